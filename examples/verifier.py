#!/usr/bin/env python3
"""An external scorer for `rlstream score --scorer-cmd "python3 examples/verifier.py"`.

Protocol: one JSON object per line on stdin, one answer per line on stdout.

  request:  {"request_id": str, "group_id": str, "task": str, "prompt": str,
             "completions": [str, ...], "meta": {str: str}}
  answer:   {"request_id": str, "rewards": [float, ...]}   one reward per completion, same order
        or  {"request_id": str, "error": "why"}            the group is retried, then dead-lettered

`request_id` must come back only when the score stage runs with `--scorer-in-flight N` above
1: it then sends up to N requests before their answers, which may come in any order.

This one gives exact-match credit against meta["answer"], with half credit for an answer
that is right up to surrounding whitespace or case. Replace `reward` with your verifier.
Standard library only; never executes anything from the request.

`--latency-ms N` waits N ms before each answer: a stand-in for a verifier that runs unit
tests in a sandbox or calls tools, whose latency (tens to hundreds of ms per group) is
what asynchronous RL hides (benches/async_vs_sync.py --scorer-latency-ms). Requests then
wait on threads, so that a stage holding several groups in flight gets them back after
one latency, as from a sandbox service.
"""
import argparse
import json
import sys
import threading
import time


def reward(completion: str, answer: str) -> float:
    if completion == answer:
        return 1.0
    if completion.strip().lower() == answer.strip().lower():
        return 0.5
    return 0.0


WRITE = threading.Lock()


def answer(line: str, latency: float) -> None:
    if latency > 0:
        time.sleep(latency)
    out = {}
    try:
        req = json.loads(line)
        if isinstance(req, dict) and "request_id" in req:
            out["request_id"] = req["request_id"]
        expected = req["meta"]["answer"]
        out["rewards"] = [reward(c, expected) for c in req["completions"]]
    except (KeyError, TypeError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    with WRITE:
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=0.0)
    latency = ap.parse_args().latency_ms / 1000.0
    waiting = []
    for line in sys.stdin:
        if latency > 0:
            waiting = [t for t in waiting if t.is_alive()]
            waiting.append(threading.Thread(target=answer, args=(line, latency)))
            waiting[-1].start()
        else:
            answer(line, 0.0)
    for t in waiting:  # answer what is out before exiting
        t.join()


if __name__ == "__main__":
    main()
