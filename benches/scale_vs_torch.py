#!/usr/bin/env python3
"""rlstream against PyTorch at two sizes, side by side in one run: the step time and the
peak resident memory of one PPO step (forward, backward, AdamW), with and without
micro-batching, on the same checkpoint and the same batch; and (`--parts gen`) the time and
peak memory of loading the checkpoint, f32 and bf16, and generation tokens/s (0.5b: prompt
128, 8 and 64 rows x 128 new tokens; small: prompt 16, 32 x 128).

    python benches/scale_vs_torch.py [--sizes small,0.5b] [--steps 3] [--features blas]
                                     [--parts train,gen] [--flex]

PYTHON (default: this interpreter) must have torch and transformers. Sizes: `small` (0.8M
parameters, 32 x 64 tokens; micro-batches of 512 tokens) and `0.5b` (Qwen2.5-0.5B's shape,
494M parameters, 8 x 96 tokens; micro-batches of 192 tokens). The 0.5b run needs about
16 GB of memory and several minutes. Each measurement runs in its own process, one after
another. Ratios above 1 mean rlstream is faster (time) or smaller (memory).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MICRO = {"small": 512, "0.5b": 192}


FEATURES = []


def rust(*args):
    out = subprocess.run(
        ["cargo", "bench", "--quiet", *FEATURES, "--bench", "train_scale", "--", *args],
        cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def torch_step(python, ckpt, micro, steps):
    out = subprocess.run(
        [python, str(ROOT / "benches" / "torch_train_step.py"), ckpt, str(micro), str(steps)],
        check=True, stdout=subprocess.PIPE, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# (prompt, new tokens, rows) per size: 0.5b at 8 rows (one group) and 64 (eight groups in
# flight, the RL load).
GEN = {"small": [(16, 128, 32)], "0.5b": [(128, 128, 8), (128, 128, 64)]}


def torch_gen_load(python, *args):
    out = subprocess.run(
        [python, str(ROOT / "benches" / "torch_gen_load.py"), *args],
        check=True, stdout=subprocess.PIPE, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def gen_rows(python, size, ckpt, flex):
    """Load (f32 and bf16 files) and generation, rlstream and PyTorch, one process each; with
    `flex`, also rlstream's generation on Flex (the sampler before the trainer's kernels)."""
    bf16 = ckpt + "-bf16"
    rust("bf16", ckpt, bf16)
    out = []
    for dtype, path in (("float32", ckpt), ("bfloat16", bf16)):
        ours = rust("load", path)
        theirs = torch_gen_load(python, "load", path, dtype)
        out.append(("load", dtype, ours, theirs))
        print(json.dumps({"rlstream": ours, "torch": theirs}), file=sys.stderr)
    for prompt, new, rows in GEN[size]:
        shape = (str(prompt), str(new), str(rows))
        ours = rust("generate", ckpt, *shape)
        before = rust("generate-flex", ckpt, *shape) if flex else None
        for dtype in ("float32", "bfloat16"):
            theirs = torch_gen_load(python, "generate", ckpt, dtype, *shape)
            work = f"generate {rows} x {new} after {prompt}"
            out.append((work, dtype, ours, theirs))
            if before:
                out.append((work + " (Flex, the sampler before)", dtype, before, theirs))
            print(json.dumps({"rlstream": ours, "flex": before, "torch": theirs}),
                  file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,0.5b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--features", default="", help="cargo features for rlstream (e.g. blas)")
    ap.add_argument("--no-micro", action="store_true", help="one pass only")
    ap.add_argument("--parts", default="train", help="train, gen or train,gen")
    ap.add_argument("--flex", action="store_true",
                    help="gen: also generate on Flex, the sampler before the trainer's kernels")
    args = ap.parse_args()
    if args.features:
        FEATURES.extend(["--features", args.features])
    python = os.environ.get("PYTHON", sys.executable)
    parts = args.parts.split(",")
    rows, gens = [], []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = str(pathlib.Path(tmp) / size)
            info = rust("write", size, ckpt)
            if "gen" in parts:
                gens += [(size, *g) for g in gen_rows(python, size, ckpt, args.flex)]
            for micro in ((0,) if args.no_micro else (0, MICRO[size])) if "train" in parts else ():
                ours = rust("step", ckpt, str(micro), str(args.steps))
                theirs = torch_step(python, ckpt, micro, args.steps)
                rows.append((size, info["params"], micro, ours, theirs))
                print(json.dumps({"rlstream": ours, "torch": theirs}), file=sys.stderr)
    print(f"rlstream features: {args.features or 'default'}")
    if gens:
        print("| size | work | weights | rlstream | PyTorch | ratio | rlstream peak RSS "
              "| PyTorch peak RSS (before loading) |")
        print("|---|---|---|---|---|---|---|---|")
        for size, work, dtype, o, t in gens:
            if work == "load":
                speed = f"| {o['load_s']:.2f} s | {t['load_s']:.2f} s | {t['load_s'] / o['load_s']:.2f}x "
                weights = f"{dtype} file"
            else:
                speed = (f"| {o['tokens_per_s']:.1f} tok/s | {t['tokens_per_s']:.1f} tok/s "
                         f"| {o['tokens_per_s'] / t['tokens_per_s']:.2f}x ")
                weights = f"rlstream float32, PyTorch {dtype}"
            base = f" ({t['base_rss_mb'] / 1024:.2f} GB)" if "base_rss_mb" in t else ""
            print(f"| {size} | {work} | {weights} {speed}| {o['peak_rss_mb'] / 1024:.2f} GB "
                  f"| {t['peak_rss_mb'] / 1024:.2f} GB{base} |")
    if not rows:
        return
    print(f"PyTorch {rows[0][4]['torch']} on {rows[0][4]['threads']} threads")
    print("| size | params | micro-batch tokens | rlstream step | PyTorch step | speed ratio "
          "| rlstream peak RSS | PyTorch peak RSS | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, params, micro, o, t in rows:
        print(f"| {size} | {params / 1e6:.1f}M | {micro or 'one pass'} | {o['step_s']:.3f} s "
              f"| {t['step_s']:.3f} s | {t['step_s'] / o['step_s']:.2f}x "
              f"| {o['peak_rss_mb'] / 1024:.2f} GB | {t['peak_rss_mb'] / 1024:.2f} GB "
              f"| {t['peak_rss_mb'] / o['peak_rss_mb']:.2f}x |")


if __name__ == "__main__":
    main()
