#!/usr/bin/env python3
"""examples/calc_env.py that misbehaves at its K-th step request, for the tests.

    faulty_env.py crash K     exits at the K-th step
    faulty_env.py hang K      stops answering at the K-th step (reads on, answers nothing)
    faulty_env.py garbage K   answers the K-th step with a line that is not a JSON object
    faulty_env.py error K     answers every K-th step with an error (the process goes on)
    faulty_env.py slow MS     answers every step after MS milliseconds, out of order

Each new process counts from zero, so a restarted one misbehaves again K steps later.
"""

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from calc_env import Episode  # noqa: E402

mode, k = sys.argv[1], int(sys.argv[2])
episodes, steps, hung = {}, 0, False
lock = threading.Lock()


def send(answer):
    with lock:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


for line in sys.stdin:
    req = json.loads(line)
    op, eid = req["op"], req["episode_id"]
    if op == "close":
        episodes.pop(eid, None)
        continue
    if op == "reset":
        if not hung:
            episodes[eid] = Episode(req["meta"])
            send({"episode_id": eid, "ok": True})
        continue
    steps += 1
    if hung:
        continue
    if mode == "crash" and steps == k:
        sys.exit(3)
    if mode == "hang" and steps == k:
        hung = True
        continue
    if mode == "garbage" and steps == k:
        send("not json at all")
        continue
    if mode == "error" and steps % k == 0:
        send({"episode_id": eid, "error": f"step {steps} fails on purpose"})
        continue
    answer = episodes[eid].step(req["action"])
    answer["episode_id"] = eid
    if mode == "slow":
        threading.Timer(k / 1000.0, send, [answer]).start()
    else:
        send(answer)
