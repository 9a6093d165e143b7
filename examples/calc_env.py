#!/usr/bin/env python3
"""The `calc` tool-use environment as a process: an example of rlstream's environment protocol.

    rlstream gen --env-cmd "python3 examples/calc_env.py" ...

rlstream writes one JSON request per line on stdin and reads one JSON answer per line on
stdout. One process serves every episode of a generator; each request names its episode:

    -> {"op": "reset", "episode_id": "calc-000003#12", "env": "calc", "prompt": "37*48=", "meta": {...}}
    <- {"episode_id": "calc-000003#12", "ok": true}           (or "error": "why")
    -> {"op": "step", "episode_id": "calc-000003#12", "action": "calc 37*48"}
    <- {"episode_id": "calc-000003#12", "observation": "=1776.", "reward": 0.0, "done": false}
    -> {"op": "close", "episode_id": "calc-000003#12"}         (no answer)

A step's answer may add "success": true|false when "done", or be {"episode_id", "error"}.
Answers may come in any order. Anything else on stdout breaks the protocol: log to stderr.

The rules match rlstream's built-in `calc` (src/env/calc.rs): a turn `calc <a><op><b>`
(op + - *) is a call, answered `=<value>.`; `calc ` with no valid expression is answered
`?`; both are worth 0, and after MAX_CALLS calls the next one ends the episode with 0. Any
other turn is the answer: 1 if it is the value of the prompt's expression, 0 otherwise.
"""

import json
import re
import sys

MAX_CALLS = 2
EXPR = re.compile(r"(-?[0-9]{1,6})([+*-])(-?[0-9]{1,6})")


def evaluate(expr):
    """The value of `<a><op><b>`, or None."""
    m = EXPR.fullmatch(expr)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


class Episode:
    def __init__(self, meta):
        expr = meta.get("expr")
        if expr is None:
            raise ValueError("a calc prompt needs meta `expr`")
        self.answer = evaluate(expr)
        if self.answer is None:
            raise ValueError(f"meta `expr` = {expr!r} is not `<a><op><b>`")
        self.calls = 0

    def step(self, action):
        action = action.lstrip()
        if not action.startswith("calc"):
            right = action.strip() == str(self.answer)
            return {"observation": "", "reward": 1.0 if right else 0.0, "done": True, "success": right}
        if self.calls >= MAX_CALLS:
            return {"observation": "", "reward": 0.0, "done": True, "success": False}
        self.calls += 1
        value = evaluate(action[len("calc"):].strip())
        observation = "?" if value is None else f"={value}."
        return {"observation": observation, "reward": 0.0, "done": False}


def main():
    episodes = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op, eid = req.get("op"), req.get("episode_id")
        if op == "close":
            episodes.pop(eid, None)
            continue
        if op == "reset":
            try:
                episodes[eid] = Episode(req.get("meta", {}))
                answer = {"ok": True}
            except ValueError as e:
                answer = {"error": str(e)}
        elif op == "step" and eid in episodes:
            answer = episodes[eid].step(req.get("action", ""))
        elif op == "step":
            answer = {"error": f"no episode {eid!r}: reset it first"}
        else:
            answer = {"error": f"unknown op {op!r}"}
        answer["episode_id"] = eid
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
