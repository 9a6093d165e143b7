#!/usr/bin/env python3
"""A training step's peak memory and time at real vocabularies and lengths, rlstream beside
PyTorch, one process per cell: the small size, the real SmolLM2-135M-Instruct
(`scripts/smollm2.py` makes it), and Qwen2.5-0.5B's shape at vocabularies of 49,152 and
151,936, each on one group of SAMPLES sequences of 256, 1,024 and 4,096 tokens (a 32-token
prompt, the rest completion), one sequence a micro-batch, PPO with AdamW.

    python benches/train_memory.py [--models small,smollm2,0.5b-49k,0.5b-152k]
                                   [--lens 256,1024,4096] [--samples 2] [--limit 1800]
                                   [--torch-skip 0.5b-152k:4096]

PYTHON (default: this interpreter) needs torch and transformers for the PyTorch column
(its plain `log_softmax(...).gather(...)` over the completion positions and transformers'
default attention); rlstream's side runs `cargo bench --bench train_scale -- long`.
Peak memory is each process's resident high-water mark (VmHWM / ru_maxrss).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT_S = 1800


def last_json(cmd):
    try:
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                             timeout=LIMIT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"stopped_s": LIMIT_S}
    except subprocess.CalledProcessError as e:
        return {"failed": e.returncode}
    return json.loads(out.stdout.strip().splitlines()[-1])


def cargo(*args):
    return last_json(["cargo", "bench", "--quiet", "--bench", "train_scale", "--", *args])


def checkpoint(name, tmp):
    """The directory of model `name`, written into `tmp` when it is a random one."""
    if name == "smollm2":
        path = pathlib.Path(os.environ.get("RLSTREAM_SMOLLM2", ROOT / "target" / "smollm2"))
        if not (path / "config.json").exists():
            sys.exit(f"{path} holds no model: run scripts/smollm2.py first")
        return str(path)
    size, vocab = {"small": ("small", 128), "0.5b-49k": ("0.5b", 49_152),
                   "0.5b-152k": ("0.5b", 151_936)}[name]
    out = str(pathlib.Path(tmp) / name)
    cargo("write-vocab", size, str(vocab), out)
    return out


def cell(m):
    if "stopped_s" in m:
        return f"stopped after {m['stopped_s'] // 60} min", ""
    if "failed" in m:
        return f"failed (exit {m['failed']})", ""
    return f"{m['peak_rss_mb'] / 1024:.2f} GB", f"{m['step_s']:.2f} s"


def main():
    global LIMIT_S
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="small,smollm2,0.5b-49k,0.5b-152k")
    ap.add_argument("--lens", default="256,1024,4096")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--limit", type=int, default=LIMIT_S, help="seconds per process")
    ap.add_argument("--torch-skip", default="",
                    help="MODEL:LEN cells PyTorch does not run (e.g. ones this machine cannot hold)")
    args = ap.parse_args()
    LIMIT_S = args.limit
    python = os.environ.get("PYTHON", sys.executable)
    skip = set(args.torch_skip.split(",")) if args.torch_skip else set()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ckpt = checkpoint(name, tmp)
            for length in args.lens.split(","):
                ours = cargo("long", ckpt, length, str(args.samples))
                if f"{name}:{length}" in skip:
                    theirs = {"skipped": True}
                else:
                    theirs = last_json([python, str(ROOT / "benches" / "torch_train_step.py"),
                                        ckpt, length, "0", length, str(args.samples)])
                rows.append((name, length, ours, theirs))
                print(json.dumps({"model": name, "len": length, "rlstream": ours,
                                  "torch": theirs}), file=sys.stderr, flush=True)
    print(f"{args.samples} sequences a step, one a micro-batch")
    print("| model | tokens a sequence | rlstream peak | PyTorch peak | memory ratio "
          "| rlstream step | PyTorch step | speed ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, length, o, t in rows:
        (om, os_), (tm, ts) = cell(o), (("not run", "") if "skipped" in t else cell(t))
        both = all("peak_rss_mb" in m for m in (o, t))
        mem = f"{t['peak_rss_mb'] / o['peak_rss_mb']:.2f}x" if both else ""
        spd = f"{t['step_s'] / o['step_s']:.2f}x" if both else ""
        print(f"| {name} | {length} | {om} | {tm} | {mem} | {os_} | {ts} | {spd} |")


if __name__ == "__main__":
    main()
