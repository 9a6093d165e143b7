#!/usr/bin/env python3
"""The 0.5B pipeline end to end: `feed`, `gen`, `score` and `train` as separate processes on
Redis, with a Qwen2.5-0.5B-shaped model (random weights, bf16 checkpoint) and the Qwen3
tokenizer committed under tests/fixtures/tokenizers/qwen3, for a few steps.

Weights travel bf16 (the checkpoint's dtype) as deltas through the chosen store, with
`keep_versions` and `--max-bytes` set so that trainer + generator + Redis fit this machine's
memory with room to spare. Printed: time per step, each version's publish-to-swap latency
at the generator, what the weights store holds, and each process's peak resident memory
(VmHWM, polled) and Redis's peak.

Usage: python3 benches/pipeline_05b.py [--steps 3] [--store redis|dir] [--out DIR]
    [--features blas]
Needs the release binaries (built here with cargo, --features blas unless told) and Redis on
127.0.0.1:6379 (`--redis URL` for another).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(features=("--features", "blas")):
    """Builds the release binary and the train_scale bench with `features`; returns their
    paths."""
    subprocess.run(["cargo", "build", "--release", *features], cwd=ROOT, check=True)
    subprocess.run(
        ["cargo", "bench", *features, "--bench", "train_scale", "--no-run"],
        cwd=ROOT,
        check=True,
    )
    deps = os.path.join(ROOT, "target", "release", "deps")
    benches = [
        os.path.join(deps, f)
        for f in os.listdir(deps)
        if f.startswith("train_scale-") and os.access(os.path.join(deps, f), os.X_OK)
        and "." not in f
    ]
    return os.path.join(ROOT, "target", "release", "rlstream"), max(benches, key=os.path.getmtime)


def peak_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def scrape(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def redis_peak(url):
    out = subprocess.run(
        ["redis-cli", "-u", url, "info", "memory"], capture_output=True, text=True
    ).stdout
    m = re.search(r"used_memory_peak:(\d+)", out)
    return int(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--store", default="redis", choices=["redis", "dir"])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--features", default="blas", help="cargo features of the build ('' for none)"
    )
    args = ap.parse_args()
    rlstream, scale = build(("--features", args.features) if args.features else ())
    out = args.out or tempfile.mkdtemp(prefix="pipeline-05b-")
    os.makedirs(out, exist_ok=True)
    f32 = os.path.join(out, "model-f32")
    model = os.path.join(out, "model")
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        subprocess.run([scale, "write", "0.5b", f32], check=True)
        subprocess.run([scale, "bf16", f32, model], check=True)
        shutil.rmtree(f32)
        tok = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "qwen3")
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(os.path.join(tok, name), model)
    ns = f"pipeline05b-{os.getpid()}"
    shared = os.path.join(out, "shared")
    os.makedirs(shared, exist_ok=True)
    common = ["--redis", args.redis, "--namespace", ns]
    weights = ["--store", args.store, "--store-dir", shared, "--max-bytes", str(3 << 30)]
    gen_metrics, train_metrics = "127.0.0.1:9511", "127.0.0.1:9512"
    subprocess.run(
        [rlstream, "feed", "--task", "sort", "--count", "64"] + common, check=True,
        stdout=subprocess.DEVNULL,
    )
    policy = ["--model", model, "--groups-per-step", "1", "--max-lag", "2"]
    cmds = {
        "gen": [rlstream, "gen"] + common + policy + weights
        + ["--group-size", "4", "--max-new-tokens", "16", "--metrics-addr", gen_metrics],
        "score": [rlstream, "score", "--tokenizer", model] + common,
        "train": [rlstream, "train"] + common + policy + weights
        + [
            "--steps", str(args.steps), "--keep-versions", "2",
            "--checkpoint-dir", os.path.join(out, f"ckpt-{ns}"), "--checkpoint-every", "1000",
            "--lr", "1e-6", "--metrics-addr", train_metrics,
        ],
    }
    procs, logs, peaks = {}, {}, {}
    started = time.time()
    for name, cmd in cmds.items():
        logs[name] = open(os.path.join(out, f"{name}.log"), "w")
        env = dict(os.environ, RUST_LOG="info")
        procs[name] = subprocess.Popen(cmd, stdout=logs[name], stderr=logs[name], env=env)
    last_gen = ""
    while procs["train"].poll() is None:
        for name, p in procs.items():
            k = peak_kb(p.pid)
            if k:
                peaks[name] = max(peaks.get(name, 0), k)
        try:
            last_gen = scrape(gen_metrics)
        except OSError:
            pass
        if time.time() - started > 3600:
            sys.exit("no end in an hour; see the logs in " + out)
        time.sleep(0.5)
    wall = time.time() - started
    # The generator takes the last version after the trainer stops: give it a moment.
    time.sleep(10)
    try:
        last_gen = scrape(gen_metrics)
    except OSError:
        pass
    for name in ["gen", "score"]:
        procs[name].terminate()
        procs[name].wait(timeout=60)
    if procs["train"].returncode != 0:
        sys.exit(f"train failed; see {out}/train.log")
    train_log = re.sub(r"\x1b\[[0-9;]*m", "", open(os.path.join(out, "train.log")).read())
    steps = [float(x) for x in re.findall(r"step_s[=:] ?\"?([0-9.]+)", train_log)]
    swaps = metric(last_gen, "rlstream_weights_publish_to_swap_seconds_count")
    swap_sum = metric(last_gen, "rlstream_weights_publish_to_swap_seconds_sum")
    result = {
        "store": args.store,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "train_step_s": steps,
        "gen_swaps": int(swaps),
        "publish_to_swap_mean_s": round(swap_sum / swaps, 2) if swaps else None,
        "peak_rss_gb": {k: round(v / 1048576, 2) for k, v in peaks.items()},
        "redis_used_memory_peak_gb": round((redis_peak(args.redis) or 0) / 2**30, 2),
        "out": out,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
