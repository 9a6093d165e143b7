#!/usr/bin/env python3
"""Agents through the OpenAI-compatible endpoint: async against sync with a slow tool, and the
`calc` agent (examples/calc_agent.py) learning, over seeds.

    .venv/bin/python benches/agent_learning.py [--part speed,learning] [--seeds 1,2,3]
        [--steps 200] [--speed-steps 10] [--tool-latency-ms 100]

Both parts run `rlstream gen --serve`, `score` and `train` as processes of the release build
on Redis (127.0.0.1:6379), with threads of the real `openai` client playing episodes: an
ordinary agent loop whose tool (the calculator) is a Python function.

- *speed*: a `calc` warm start (`rlstream sft`, 1,500 steps), G = 4, 4 groups per step,
  16 client threads, the tool answering after `--tool-latency-ms`. Async: the clients play
  without pause while the trainer trains. Sync: the clients play one step's 4 groups, then
  wait until the trainer has stepped on them and the generator has swapped the new version
  in, so every group is sampled by the newest weights. Reported: wall time to
  `--speed-steps` trainer steps, and episodes played.
- *learning*: per seed, the warm start, then RL through the endpoint for `--steps` trainer
  steps (G = 8, 8 groups per step, lr 5e-4, max lag 4: `rlstream run --task calc`'s
  settings), 32 client threads. `rlstream eval --task calc` (1,000 held-out questions x 4
  episodes at temperature 1) on the warm start and on the trained checkpoint.

Results are printed and written to benches/results/agent_learning.json.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import types

import openai

from pipeline_05b import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from calc_agent import play  # noqa: E402


class Pipeline:
    """gen --serve, score and train on a fresh namespace; stopped on exit."""

    def __init__(self, rlstream, out, model, seed, group, per_step, steps, port):
        self.out, self.port = out, port
        ns = f"agent-bench-{os.getpid()}-{port}"
        common = ["--redis", "redis://127.0.0.1:6379", "--namespace", ns]
        policy = ["--model", model, "--groups-per-step", str(per_step), "--max-lag", "4",
                  "--seed", str(seed)]
        self.ckpt = os.path.join(out, f"ckpt-{port}")
        cmds = {
            "gen": [rlstream, "gen", "--serve", str(port), "--group-size", str(group),
                    "--max-batch", "64", "--serve-max-requests", "128"] + policy + common,
            "score": [rlstream, "score"] + common,
            "train": [rlstream, "train", "--steps", str(steps), "--lr", "5e-4",
                      "--checkpoint-dir", self.ckpt, "--checkpoint-every", str(steps)]
            + policy + common,
        }
        self.logs = {n: os.path.join(out, f"{n}-{port}.log") for n in cmds}
        self.procs = {}
        for name, cmd in cmds.items():
            with open(self.logs[name], "w") as f:
                self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
        deadline = time.time() + 120
        while True:
            try:
                openai.OpenAI(base_url=self.base(), api_key="none", max_retries=0).models.list()
                break
            except openai.APIConnectionError:
                if time.time() > deadline:
                    raise SystemExit(open(self.logs["gen"]).read())
                time.sleep(0.2)

    def base(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def swaps(self):
        return open(self.logs["gen"]).read().count("new weights swapped in")

    def trained(self):
        return self.procs["train"].poll() is not None

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            p.wait()


def agents(pipe, model, group, threads, tool_latency, seed, stop, groups=None):
    """Plays groups of episodes with `threads` clients until `stop()` (or `groups` groups);
    the episodes played."""
    client = openai.OpenAI(base_url=pipe.base(), api_key="none", max_retries=0, timeout=300)
    args = types.SimpleNamespace(model=model, max_tokens=11, base=pipe.base(), key="none")
    rng, lock = random.Random(seed), threading.Lock()
    state = {"next": 0, "episodes": 0, "failed": 0}
    queue = []

    def job():
        with lock:
            if not queue:
                if groups is not None and state["next"] >= groups:
                    return None
                g = state["next"]
                state["next"] += 1
                question = (rng.randint(10, 99), rng.randint(10, 99))
                queue.extend((question, f"s{seed}-{pipe.port}-{g}", f"s{seed}-{pipe.port}-{g}-{e}")
                             for e in range(group))
            return queue.pop(0)

    def worker():
        while not stop():
            j = job()
            if j is None:
                return
            try:
                play(client, args, *j, tool_latency)
                with lock:
                    state["episodes"] += 1
            except Exception as e:  # counted; a pipeline that stopped ends the run
                with lock:
                    state["failed"] += 1
                if stop():
                    return
                print(f"episode failed: {e!r}", file=sys.stderr)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return state


def warm_start(rlstream, out, seed):
    d = os.path.join(out, f"sft-{seed}")
    if not os.path.exists(os.path.join(d, "config.json")):
        subprocess.run([rlstream, "sft", "--task", "calc", "--steps", "1500", "--seed", str(seed),
                        "--out", d], check=True, stdout=subprocess.DEVNULL)
    return d


def evaluate(rlstream, model, seed, path):
    subprocess.run([rlstream, "eval", "--model", model, "--task", "calc", "--seed", str(seed),
                    "--json", path], check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        d = json.load(f)
    return {k: round(d[k]["mean"], 4) for k in ("pass_at_1", "tool_call_rate", "tool_call_validity")}


def speed(rlstream, out, a):
    model = warm_start(rlstream, out, 1)
    name = os.path.basename(model)
    results = []
    for mode in ("async", "sync"):
        pipe = Pipeline(rlstream, out, model, 1, 4, 4, a.speed_steps, 18600 + len(results))
        t0 = time.time()
        played = {"episodes": 0, "failed": 0}
        try:
            if mode == "async":
                played = agents(pipe, name, 4, 16, a.tool_latency_ms / 1000, 1, pipe.trained)
            else:
                for k in range(a.speed_steps):
                    s = agents(pipe, name, 4, 16, a.tool_latency_ms / 1000, 100 + k,
                               pipe.trained, groups=4)
                    played["episodes"] += s["episodes"]
                    while pipe.swaps() < k + 1 and not pipe.trained():
                        time.sleep(0.01)
            while not pipe.trained():
                time.sleep(0.05)
            wall = time.time() - t0
        finally:
            pipe.stop()
        r = {"mode": mode, "steps": a.speed_steps, "wall_s": round(wall, 2),
             "episodes": played["episodes"], "tool_latency_ms": a.tool_latency_ms}
        print(json.dumps(r), flush=True)
        results.append(r)
    return results


def learning(rlstream, out, a):
    results = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        model = warm_start(rlstream, out, seed)
        before = evaluate(rlstream, model, seed, os.path.join(out, f"before-{seed}.json"))
        pipe = Pipeline(rlstream, out, model, seed, 8, 8, a.steps, 18700 + seed)
        t0 = time.time()
        try:
            played = agents(pipe, os.path.basename(model), 8, 32, 0.0, seed, pipe.trained)
            while not pipe.trained():
                time.sleep(0.05)
            wall = time.time() - t0
        finally:
            pipe.stop()
        latest = open(os.path.join(pipe.ckpt, "latest")).read().strip()
        after = evaluate(rlstream, os.path.join(pipe.ckpt, latest), seed,
                         os.path.join(out, f"after-{seed}.json"))
        r = {"seed": seed, "steps": a.steps, "rl_wall_s": round(wall, 1),
             "episodes": played["episodes"], "before": before, "after": after}
        print(json.dumps(r), flush=True)
        results.append(r)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="speed,learning")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--speed-steps", type=int, default=10)
    ap.add_argument("--tool-latency-ms", type=float, default=100.0)
    ap.add_argument("--features", default="")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rlstream, _ = build(("--features", a.features) if a.features else ())
    out = a.out or tempfile.mkdtemp(prefix="agent-learning-")
    os.makedirs(out, exist_ok=True)
    res = {}
    parts = a.part.split(",")
    if "speed" in parts:
        res["speed"] = speed(rlstream, out, a)
    if "learning" in parts:
        res["learning"] = learning(rlstream, out, a)
    path = os.path.join(ROOT, "benches", "results", "agent_learning.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
