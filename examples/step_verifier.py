#!/usr/bin/env python3
"""An external scorer that places rewards on tokens: per step, or per token index.

    rlstream score --scorer-cmd "python3 examples/step_verifier.py" --step-separator ";"
    rlstream score --scorer-cmd "python3 examples/step_verifier.py --per token"

Protocol (one JSON object per line each way; see examples/verifier.py for the basics):

  request:  {"group_id": str, "task": str, "prompt": str, "completions": [str, ...],
             "tokens": [[int, ...], ...],       each completion's token ids, stop token included
             "steps": [[str, ...], ...],        with --step-separator: each completion's steps
             "meta": {str: str}}
  answer:   {"rewards": [float, ...],           one outcome reward per completion (required)
             "step_rewards": [[float, ...], ...]          one per step of each completion,
         or  "token_rewards": [[[int, float], ...], ...]} [token index, reward] pairs

rlstream splits a completion's text (without its stop token) after every occurrence of the
separator, keeping the separator at the end of the step it closes, and puts a step's reward
on the step's last token (the one holding its last character). Indices in token_rewards
count the request's `tokens` of that completion from 0. Tokens given no reward get 0.

This one grades against meta["answer"]: `--per step` gives each step 1 when it equals the
answer's step at the same place (the answer split the same way) and 0 otherwise; `--per
token` gives each of the first len(answer) tokens whose character is the answer's character
at that place 0.1 (character tokenizers only: one token per character). The outcome
reward is exact match.

`--bad KIND` answers wrongly on purpose (index: a token index past the completion; steps:
one step reward too few), for tests of how rlstream refuses a bad answer.
"""
import argparse
import json
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per", choices=["step", "token"], default="step")
    ap.add_argument("--separator", default=";")
    ap.add_argument("--bad", choices=["index", "steps"])
    args = ap.parse_args()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            answer = req["meta"]["answer"]
            out = {"rewards": [1.0 if c.strip() == answer else 0.0 for c in req["completions"]]}
            if args.per == "step":
                want = [s + args.separator for s in answer.split(args.separator)]
                out["step_rewards"] = [
                    [1.0 if i < len(want) and s.rstrip(args.separator) == want[i].rstrip(args.separator) else 0.0
                     for i, s in enumerate(steps)]
                    # Without --step-separator there are no steps: each completion is one
                    # (rlstream then refuses step_rewards and says why).
                    for steps in req.get("steps") or [[c] for c in req["completions"]]
                ]
                if args.bad == "steps":
                    out["step_rewards"][0] = out["step_rewards"][0][:-1]
            else:
                out["token_rewards"] = [
                    [[i, 0.1] for i, ch in enumerate(c[: len(toks)]) if i < len(answer) and ch == answer[i]]
                    for c, toks in zip(req["completions"], req["tokens"])
                ]
                if args.bad == "index":
                    out["token_rewards"][0].append([len(req["tokens"][0]), 1.0])
        except (KeyError, TypeError, ValueError) as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
