#!/usr/bin/env python3
"""An agent loop written against the OpenAI API, trained by rlstream through `gen --serve`.

    rlstream gen --model DIR --serve 8000 --group-size 4 ...   (with score and train running)
    python3 examples/calc_agent.py --base http://127.0.0.1:8000/v1 --model NAME --groups 64

Each episode asks the model one `calc` question (`37*48=`). A model turn is a tool call
(`calc 37*48`, answered `=1776.` by the tool, here a Python function) or the answer; the
episode's reward is 1 for the right product. The loop is an ordinary OpenAI client loop:
the prompt of each call is the previous prompt, the model's text and the tool's answer. Two
headers make it trainable: `X-Rlstream-Episode` names the episode and `X-Rlstream-Group` its
group (the G episodes of one question, G = gen's --group-size); closing each episode with
its reward publishes the group to the trainer once its G episodes are closed. rlstream keeps
the tokens the model sampled: each call continues the episode's ids with the text the
client added (the tool's answer), tokenized on its own and recorded as environment tokens.

The rules are those of rlstream's built-in `calc` environment (examples/calc_env.py).
`--record FILE` writes what every call returned (token ids, log-probs, versions) and the
sample each episode should become, as JSON lines, for tests/integration/agent_episodes.rs.
Needs the `openai` package (scripts/setup-python.sh installs it in .venv).
"""

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calc_env import MAX_CALLS, Episode  # noqa: E402

EPISODE, GROUP = "X-Rlstream-Episode", "X-Rlstream-Group"


def close(base, key, episode, reward):
    """Closes an episode with its reward: the server's answer (published or waiting)."""
    req = urllib.request.Request(
        f"{base}/rlstream/episodes/{episode}/close",
        data=json.dumps({"reward": reward}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def play(client, args, question, group, episode, tool_latency):
    """One episode: calls until the model answers or runs out of calls; its record."""
    a, b = question
    env = Episode({"expr": f"{a}*{b}"})
    prompt = f"{a}*{b}="
    calls, reward = [], 0.0
    for _ in range(MAX_CALLS + 1):
        r = client.completions.create(
            model=args.model, prompt=prompt, max_tokens=args.max_tokens,
            extra_headers={EPISODE: episode, GROUP: group})
        choice = r.choices[0]
        calls.append(choice.model_extra["rlstream"])
        out = env.step(choice.text)
        if out["done"]:
            reward = out["reward"]
            break
        time.sleep(tool_latency)
        prompt = prompt + choice.text + out["observation"]
    else:
        reward = 0.0
    answer = close(args.base, args.key, episode, reward)
    return {"episode": episode, "group": group, "reward": reward, "calls": calls,
            "closed": answer, "sample": expected_sample(calls, reward)}


def expected_sample(calls, reward):
    """The sample rlstream should train: each call's completion, and between two calls the
    ids the client added (the next prompt past the ids so far) as environment tokens."""
    seq = list(calls[0]["prompt_token_ids"])
    prompt_len = len(seq)
    tokens, logprobs, versions, env = [], [], [], []
    for c in calls:
        added = c["prompt_token_ids"][len(seq):]
        assert c["prompt_token_ids"][:len(seq)] == seq, "a call did not extend its episode"
        if added:
            env.append([len(tokens), len(added)])
            tokens += added
            logprobs += [0.0] * len(added)
            versions += [None] * len(added)
        tokens += c["token_ids"]
        logprobs += c["logprobs"]
        versions += c["versions"]
        seq = c["prompt_token_ids"] + c["token_ids"]
    return {"prompt": seq[:prompt_len], "tokens": tokens, "logprobs": logprobs,
            "versions": versions, "env": env, "return": reward}


def wait_ready(base, key, patience_s):
    """Waits for the endpoint to answer GET /models: a generator started just before this
    script may still be loading its model."""
    deadline = time.time() + patience_s
    req = urllib.request.Request(base.rstrip("/") + "/models",
                                 headers={"Authorization": f"Bearer {key}"})
    while True:
        try:
            with urllib.request.urlopen(req, timeout=5):
                return
        except OSError as e:
            if time.time() > deadline:
                sys.exit(f"no endpoint at {base} after {patience_s:.0f} s ({e}): "
                         "is `rlstream gen --serve` running?")
            time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the endpoint, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", help="the model to call (default: the one the endpoint serves)")
    ap.add_argument("--key", default=os.environ.get("RLSTREAM_SERVE_KEY", "none"))
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4, help="gen's --group-size")
    ap.add_argument("--clients", type=int, default=16, help="episodes played at once")
    ap.add_argument("--max-tokens", type=int, default=11)
    ap.add_argument("--tool-latency-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", help="write each episode's calls and expected sample here")
    ap.add_argument("--wait-s", type=float, default=120.0,
                    help="how long to wait for the endpoint to come up")
    args = ap.parse_args()
    wait_ready(args.base, args.key, args.wait_s)
    client = openai.OpenAI(base_url=args.base, api_key=args.key, max_retries=0, timeout=300)
    if args.model is None:
        args.model = client.models.list().data[0].id
    rng = random.Random(args.seed)
    tag = f"{args.seed}-{time.time_ns()}"
    jobs = []
    for g in range(args.groups):
        question = (rng.randint(10, 99), rng.randint(10, 99))
        for e in range(args.group_size):
            jobs.append((question, f"g{tag}-{g}", f"e{tag}-{g}-{e}"))
    done, lock, failures = [], threading.Lock(), []

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                question, group, episode = jobs.pop(0)
            try:
                rec = play(client, args, question, group, episode, args.tool_latency_ms / 1000)
            except Exception as e:  # a failed episode is reported, the others go on
                with lock:
                    failures.append(f"{episode}: {e!r}")
                continue
            with lock:
                done.append(rec)

    started = time.time()
    threads = [threading.Thread(target=worker) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - started
    if args.record:
        with open(args.record, "w") as f:
            for rec in done:
                f.write(json.dumps(rec) + "\n")
    solved = sum(r["reward"] for r in done)
    published = sum(1 for r in done if r["closed"].get("published"))
    print(json.dumps({"episodes": len(done), "failed": len(failures), "solved": solved,
                      "groups_published": published, "wall_s": round(wall, 2),
                      "failures": failures[:5]}))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
