#!/usr/bin/env python3
"""LoRA against full fine-tuning, from the same warm start, at the same step count.

For each seed: the default run (`rlstream run --seed S`, embedded bus, full fine-tuning),
then the same RL phase from that run's warm start with a LoRA adapter (`--model RUN/sft
--lora-rank R --lr LR`); both final checkpoints evaluated by `rlstream eval` on the same
1,000 held-out prompts x 4 samples (the adapter with `--model RUN/sft --adapter CKPT`).

    python3 benches/lora_vs_full.py --seeds 1,2,3 [--rank 16] [--lr 2e-3] [--task longer]

Prints a Markdown table per seed and the mean LoRA - full difference with its standard
error over seeds; writes everything to OUT/lora_vs_full.json. Builds nothing: run
`cargo build --release` first.
"""

import argparse
import json
import os
import sys
import tempfile

# The binary, the runner and the statistics of benches/learning.py.
from learning import BIN, mean_se, rlstream


def evaluate(out, name, seed, task, *model):
    path = os.path.join(out, f"{name}-eval.json")
    rlstream("eval", *model, "--task", task, "--seed", str(seed), "--json", path)
    with open(path) as f:
        return json.load(f)


def final_checkpoint(run_dir):
    with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
        return os.path.join(run_dir, "checkpoints", f.read().strip())


def one_seed(args, out, seed):
    full = os.path.join(out, f"seed-{seed}-full")
    lora = os.path.join(out, f"seed-{seed}-lora")
    common = ["--task", args.task, "--seed", str(seed), "--steps", str(args.steps), "--plain"]
    rlstream("run", *common, "--out", full)
    sft = os.path.join(full, "sft")
    rlstream("run", *common, "--model", sft, "--out", lora,
             "--lora-rank", str(args.rank), "--lr", str(args.lr))
    return {
        "seed": seed,
        "warm_start": evaluate(out, f"seed-{seed}-sft", seed, args.task, "--model", sft),
        "full": evaluate(out, f"seed-{seed}-full", seed, args.task,
                         "--model", final_checkpoint(full)),
        "lora": evaluate(out, f"seed-{seed}-lora", seed, args.task,
                         "--model", sft, "--adapter", final_checkpoint(lora)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--task", default="longer")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} is missing: run `cargo build --release` first")
    out = args.out or tempfile.mkdtemp(prefix="lora-vs-full-")
    os.makedirs(out, exist_ok=True)
    rows = [one_seed(args, out, int(s)) for s in args.seeds.split(",")]

    def cell(e, key):
        return f"{e[key]['mean']:.3f} ± {e[key]['se']:.3f}"

    print(f"| seed | warm start reward | full ({args.steps} steps) | LoRA r={args.rank}, lr {args.lr} "
          f"| full pass@1 | LoRA pass@1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {cell(r['warm_start'], 'reward')} | {cell(r['full'], 'reward')} "
              f"| {cell(r['lora'], 'reward')} | {100 * r['full']['pass_at_1']['mean']:.1f}% "
              f"| {100 * r['lora']['pass_at_1']['mean']:.1f}% |")
    gain = lambda k: [r[k]["reward"]["mean"] - r["warm_start"]["reward"]["mean"] for r in rows]
    diff = [r["lora"]["reward"]["mean"] - r["full"]["reward"]["mean"] for r in rows]
    for name, xs in [("full gain", gain("full")), ("LoRA gain", gain("lora")),
                     ("LoRA - full", diff)]:
        m, se = mean_se(xs)
        print(f"{name}: held-out reward {m:+.3f} (standard error {se:.3f}, {len(xs)} seeds)")
    with open(os.path.join(out, "lora_vs_full.json"), "w") as f:
        json.dump({"args": vars(args), "seeds": rows}, f, indent=2)
    print(f"written to {out}/lora_vs_full.json")


if __name__ == "__main__":
    main()
