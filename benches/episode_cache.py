#!/usr/bin/env python3
"""An agent episode's later calls with and without the episode's KV cache kept between
calls: the first-token latency of each call of a ten-call episode on the real
SmolLM2-135M-Instruct.

    .venv/bin/python benches/episode_cache.py [--calls 10] [--episodes 3] [--max-tokens 24]
        [--append 40] [--model target/smollm2] [--binary target/release/rlstream]

Two `rlstream gen --serve` processes on the same model, one after the other, one with the
default cache (`--serve-episode-cache-mb 1024`), one with it off (`0`). Each plays
`--episodes` episodes of `--calls` streamed `/v1/completions` calls with the real `openai`
client, each call's prompt the previous prompt, the model's text and `--append` tokens' worth
of text the client adds (as a tool's answer would be), under `X-Rlstream-Episode`. Per call:
the time to the first streamed token. Each episode's calls are checked to extend it (the
endpoint's drift counter stays 0), and the two runs' first calls sample alike (same seeds,
same version), so every later call reads the same history in both. Needs Redis on
127.0.0.1:6379, the `openai` package, and the model (`scripts/smollm2.py` puts it in
target/smollm2). Prints a table and writes benches/results/episode_cache.json.
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = " The tool answered: the result is 1776, checked twice, and the next step is to"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(addr, series):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series):
                return float(line.split()[-1])
    return 0.0


def serve(args, cache_mb, log):
    port, metrics = free_port(), f"127.0.0.1:{free_port()}"
    cmd = [args.binary, "gen", "--model", args.model, "--serve", str(port),
           "--metrics-addr", metrics, "--namespace", f"bench-cache-{os.getpid()}-{cache_mb}",
           "--serve-episode-cache-mb", str(cache_mb)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}/v1", metrics
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the endpoint never came up")


def episode(client, model, args, e):
    """One episode's calls: each call's time to its first token, and its prompt length."""
    prompt = f"Question {e}: what is 37 times 48? Think step by step."
    out = []
    for c in range(args.calls):
        started = time.perf_counter()
        first = None
        text = ""
        s = client.completions.create(
            model=model, prompt=prompt, max_tokens=args.max_tokens, stream=True, seed=100 * e + c,
            extra_headers={"X-Rlstream-Episode": f"bench-{os.getpid()}-{e}"})
        for chunk in s:
            if first is None and chunk.choices and chunk.choices[0].text is not None:
                first = time.perf_counter() - started
            if chunk.choices:
                text += chunk.choices[0].text or ""
        out.append({"call": c + 1, "first_token_s": first, "prompt_chars": len(prompt),
                    "text": text})
        prompt = prompt + text + (TOOL * (1 + args.append // 20))[: args.append * 4]
    return out


def run(args, cache_mb):
    with tempfile.TemporaryFile() as log:
        proc, base, metrics = serve(args, cache_mb, log)
        try:
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            calls = [episode(client, model, args, e) for e in range(args.episodes)]
            drift = metric(metrics, "rlstream_serve_drift_total")
            continued = metric(metrics, 'rlstream_serve_episode_cache_total{outcome="continued"}')
        finally:
            proc.terminate()
            proc.wait()
    if drift:
        raise SystemExit(f"{drift} calls did not extend their episode")
    return {"cache_mb": cache_mb, "episodes": calls, "continued": continued}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--append", type=int, default=40, help="about this many tokens added a call")
    p.add_argument("--model", default=os.path.join(ROOT, "target", "smollm2"))
    p.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "rlstream"))
    args = p.parse_args()
    runs = [run(args, 1024), run(args, 0)]
    print(f"{'call':>4} {'kept cache: first token s':>27} {'no cache: first token s':>25} {'ratio':>6}")
    rows = []
    for c in range(args.calls):
        kept = statistics.median(ep[c]["first_token_s"] for ep in runs[0]["episodes"])
        none = statistics.median(ep[c]["first_token_s"] for ep in runs[1]["episodes"])
        chars = runs[0]["episodes"][0][c]["prompt_chars"]
        rows.append({"call": c + 1, "prompt_chars": chars, "kept_s": kept, "none_s": none})
        print(f"{c + 1:>4} {kept:>27.3f} {none:>25.3f} {none / kept:>6.2f}")
    same = all(a["text"] == b["text"] for ea, eb in zip(runs[0]["episodes"], runs[1]["episodes"])
               for a, b in zip(ea, eb))
    print(f"every call sampled the same text with and without the cache: {same}")
    print(f"continued calls with the cache: {runs[0]['continued']:.0f}; without: {runs[1]['continued']:.0f}")
    os.makedirs(os.path.join(ROOT, "benches", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benches", "results", "episode_cache.json"), "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "args": vars(args), "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
