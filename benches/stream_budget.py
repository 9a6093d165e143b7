#!/usr/bin/env python3
"""Redis memory over a long run under the shipped memory limits, scaled.

Runs `rlstream run` on a real Redis with the shipped topology, every stream's
`trim_max_bytes` divided by --scale (the built-in task's groups are about 1.5 kB, so the
shipped 3.25 GiB budget would take over a million groups to reach), and --archive-dir.
While it runs, `rlstream status --json` is sampled: memory per stream against its limit.
Afterwards `rlstream replay --train` re-runs steps from an early checkpoint whose groups and
step records live in the archive by then, and `replay` counts the scored history across the
archive and Redis.

    cargo build --release
    python3 benches/stream_budget.py --steps 3000 --scale 512 [--out benches/results/stream_budget.json]

Standard library only; needs Redis on 127.0.0.1:6379 (or --redis).
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "rlstream"


def rlstream(*args, **kw):
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, check=True, **kw)


def scaled_topology(scale, path):
    limits = {}
    section = None
    out = []
    for line in (ROOT / "streams" / "default.toml").read_text().splitlines():
        if line.startswith("[streams."):
            section = line[len("[streams."):-1]
        if line.startswith("trim_max_bytes"):
            limit = int(line.split("=")[1].split("#")[0]) // scale
            limits[section] = limit
            line = f"trim_max_bytes = {limit}"
        out.append(line)
    path.write_text("\n".join(out) + "\n")
    return limits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--scale", type=int, default=512)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between status samples")
    ap.add_argument("--out", default=str(ROOT / "benches" / "results" / "stream_budget.json"))
    args = ap.parse_args()
    if not BIN.exists():
        sys.exit(f"{BIN} is missing: cargo build --release")
    work = pathlib.Path(tempfile.mkdtemp(prefix="rlstream-budget-"))
    topo = work / "topology.toml"
    limits = scaled_topology(args.scale, topo)
    archive = work / "archive"
    run_dir = work / "run"
    ns = f"budget{int(time.time())}"
    bus = ["--redis", args.redis, "--namespace", ns]
    cmd = [str(BIN), "run", *bus, "--topology", topo, "--archive-dir", archive,
           "--steps", args.steps, "--checkpoint-every", 50, "--eval-prompts", 0,
           "--out", run_dir, "--plain"]
    print(" ".join(map(str, cmd)), flush=True)
    t0 = time.time()
    log = open(work / "run.log", "w")
    proc = subprocess.Popen(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT)
    samples = []
    while proc.poll() is None:
        time.sleep(args.every)
        try:
            st = json.loads(rlstream("status", *bus, "--topology", topo, "--json").stdout)
        except subprocess.CalledProcessError as e:
            print(e.stderr, file=sys.stderr)
            continue
        step = st["trainer"]["step"] if st.get("trainer") else 0
        mem = {s["name"]: s["memory_bytes"] for s in st["streams"]}
        samples.append({"t": round(time.time() - t0, 1), "step": step, "memory": mem,
                        "total": st["memory_bytes"], "budget": st["budget_bytes"]})
        print(f"{samples[-1]['t']:7.0f}s step {step:5d}  {st['memory_bytes'] / 1024:8.0f} KiB of "
              f"{st['budget_bytes'] / 1024:.0f} KiB  " +
              " ".join(f"{k} {v / 1024:.0f}" for k, v in mem.items()), flush=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"rlstream run failed: see {work / 'run.log'}")
    peak = {name: max(s["memory"].get(name, 0) for s in samples) for name in limits}
    files = sorted(archive.glob("*.rla"))
    per_stream = {}
    for f in files:
        stream = f.name.split(".")[1]
        per_stream[stream] = per_stream.get(stream, 0) + 1
    # One history across the archive and Redis.
    scored = rlstream("replay", *bus, "--archive-dir", archive, "--stream", "scored",
                      "--topology", topo).stdout.splitlines()
    in_redis = rlstream("replay", *bus, "--stream", "scored", "--topology", topo).stdout.splitlines()
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    replayed = None
    if ckpts:
        ck = ckpts[0]
        out = rlstream("replay", *bus, "--archive-dir", archive, "--topology", topo, "--train",
                       "--checkpoint", ck, "--steps", 20).stdout
        replayed = {"checkpoint": ck.name, "summary": out.strip().splitlines()[-1]}
        print(replayed["summary"])
    first_redis_id = json.loads(in_redis[0])["id"] if in_redis else None
    report = {
        "bench": "stream_budget",
        "steps": args.steps,
        "scale": args.scale,
        "limits": limits,
        "budget": sum(limits.values()),
        "wall_s": round(wall, 1),
        "peak_memory": peak,
        "peak_over_limit": {k: round(peak[k] / limits[k], 3) for k in limits},
        "final": samples[-1] if samples else None,
        "archive_files": per_stream,
        "scored_history": len(scored),
        "scored_in_redis": len(in_redis),
        "first_scored_id_in_redis": first_redis_id,
        "replay_train": replayed,
        "samples": samples,
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    # Leave Redis as it was.
    keys = subprocess.run(["redis-cli", "-u", args.redis, "--scan", "--pattern", f"{ns}:*"],
                          capture_output=True, text=True).stdout.split()
    if keys:
        subprocess.run(["redis-cli", "-u", args.redis, "DEL", *keys], capture_output=True)


if __name__ == "__main__":
    main()
