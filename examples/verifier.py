#!/usr/bin/env python3
"""An external scorer for `rlstream score --scorer-cmd "python3 examples/verifier.py"`.

Protocol: one JSON object per line on stdin, one answer per line on stdout.

  request:  {"group_id": str, "task": str, "prompt": str, "completions": [str, ...], "meta": {str: str}}
  answer:   {"rewards": [float, ...]}   one reward per completion, same order
        or  {"error": "why"}            the group is retried, then dead-lettered

This one gives exact-match credit against meta["answer"], with half credit for an answer
that is right up to surrounding whitespace or case. Replace `reward` with your verifier.
Standard library only; never executes anything from the request.
"""
import json
import sys


def reward(completion: str, answer: str) -> float:
    if completion == answer:
        return 1.0
    if completion.strip().lower() == answer.strip().lower():
        return 0.5
    return 0.0


def main() -> None:
    for line in sys.stdin:
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
