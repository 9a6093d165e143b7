#!/usr/bin/env python3
"""An external scorer for `rlstream score --scorer-cmd "python3 examples/verifier.py"`.

Protocol: one JSON object per line on stdin, one answer per line on stdout.

  request:  {"group_id": str, "task": str, "prompt": str, "completions": [str, ...], "meta": {str: str}}
  answer:   {"rewards": [float, ...]}   one reward per completion, same order
        or  {"error": "why"}            the group is retried, then dead-lettered

This one gives exact-match credit against meta["answer"], with half credit for an answer
that is right up to surrounding whitespace or case. Replace `reward` with your verifier.
Standard library only; never executes anything from the request.

`--latency-ms N` waits N ms before each answer: a stand-in for a verifier that runs unit
tests in a sandbox or calls tools, whose latency (tens to hundreds of ms per group) is
what asynchronous RL hides (benches/async_vs_sync.py --scorer-latency-ms).
"""
import argparse
import json
import sys
import time


def reward(completion: str, answer: str) -> float:
    if completion == answer:
        return 1.0
    if completion.strip().lower() == answer.strip().lower():
        return 0.5
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=0.0)
    latency = ap.parse_args().latency_ms / 1000.0
    for line in sys.stdin:
        if latency > 0:
            time.sleep(latency)
        try:
            req = json.loads(line)
            answer = req["meta"]["answer"]
            out = {"rewards": [reward(c, answer) for c in req["completions"]]}
        except (KeyError, TypeError, ValueError) as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
