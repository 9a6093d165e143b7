#!/usr/bin/env python3
"""Routing replay on a small mixture-of-experts policy: how far the trainer's log-probs sit
from the behaviour log-probs, and how often its router picks other experts than the
generator did, with `train.routing replay` and `live`, synchronous (staleness 0) and
asynchronous (the default `rlstream run`, generation a version or two ahead); and the
learning of each.

For each seed one warm start (`rlstream sft --experts E`, a Qwen3-MoE-shaped policy routing
every token to 2 of E experts) is shared by the four runs, so every comparison is paired:

    rlstream run --model WARM --task T --steps N --seed S [--sync] --routing replay|live

Generation runs on Flex, training on Autodiff over NdArray (the CPU backends rlstream
uses), so even at staleness 0 the two compute in different orders. Each run's per-step
records give the mean |log π − log μ| (`logprob_gap`), the mismatch KL (`mismatch_kl`, k3
of KL(μ‖π)) and the share of recorded (token, MoE layer) routing decisions the trainer's
live router makes differently (`routing_mismatch`; under replay the recorded experts run
anyway, so this is what replay removes). Held-out results come from the run's own
`rlstream eval` before and after RL.

    cargo build --release
    python3 benches/routing_replay.py --seeds 1,2 [--task longer] [--experts 8] [--steps 100]

Prints a Markdown table and writes OUT/routing_replay.json.
"""

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile

from learning import BIN, ROOT, mean_se, rlstream


def mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def steps_of(report):
    with open(os.path.join(report, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))

    def col(name):
        return [float(r[name]) if r.get(name) not in (None, "") else None for r in rows
                if r.get("skipped") in ("0", None)]
    return rows, col


def one_run(args, out, seed, warm, sync, routing):
    name = f"seed-{seed}-{'sync' if sync else 'async'}-{routing}"
    run_dir = os.path.join(out, name)
    extra = ["--sync"] if sync else []
    rlstream("run", "--model", warm, "--task", args.task, "--seed", str(seed),
             "--steps", str(args.steps), "--out", run_dir, "--plain",
             "--routing", routing, "--eval-prompts", str(args.eval_prompts), *extra)
    with open(os.path.join(run_dir, "report", "summary.json")) as f:
        s = json.load(f)
    _, col = steps_of(os.path.join(run_dir, "report"))
    curve = col("reward_mean")
    return {
        "seed": seed,
        "mode": "sync" if sync else "async",
        "routing": routing,
        "logprob_gap": mean(col("logprob_gap")),
        "mismatch_kl": mean(col("mismatch_kl")),
        "routing_mismatch": mean(col("routing_mismatch")),
        "staleness_mean": mean(col("staleness_mean")),
        "clip_fraction": mean(col("clip_fraction")),
        "reward_first_20": mean(curve[:20]),
        "reward_last_20": mean(curve[-20:]),
        "reward_curve": curve,
        "before": s["held_out"][0],
        "after": s["held_out"][-1],
        "wall_s": s["wall_s"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--task", default="longer")
    p.add_argument("--demonstrations", default=None,
                   help="task the warm start imitates (sort for longer, the task otherwise)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=500)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    demonstrations = args.demonstrations or ("sort" if args.task == "longer" else args.task)
    if not os.path.exists(BIN):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    out = args.out or tempfile.mkdtemp(prefix="rlstream-routing-")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        warm = os.path.join(out, f"seed-{seed}-warm")
        rlstream("sft", "--task", demonstrations, "--experts", str(args.experts),
                 "--steps", str(args.sft_steps), "--seed", str(seed), "--out", warm)
        for sync in (True, False):
            for routing in ("replay", "live"):
                r = one_run(args, out, seed, warm, sync, routing)
                rows.append(r)
                print(f"seed {seed} {r['mode']:5} {routing:6}: |Δlog p| {r['logprob_gap']:.2e}, "
                      f"KL {r['mismatch_kl']:.2e}, routing differs {100 * r['routing_mismatch']:.2f}%, "
                      f"staleness {r['staleness_mean']:.2f}, pass@1 {r['before']['pass_at_1']['mean']:.3f}"
                      f" -> {r['after']['pass_at_1']['mean']:.3f} ({r['wall_s']:.0f} s)", file=sys.stderr)

    lines = [
        f"`rlstream run --model WARM --task {args.task} --steps {args.steps}` on a warm start of "
        f"`rlstream sft --experts {args.experts}` (Qwen3-MoE-shaped, top-2), per seed; means over "
        "the run's steps; held-out pass@1 from the run's `rlstream eval` before → after RL:",
        "",
        "| seed | mode | routing | staleness | mean \\|Δ log p\\| | mismatch KL | routing differs | clip fraction | pass@1 before → after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['mode']} | {r['routing']} | {r['staleness_mean']:.2f} | "
            f"{r['logprob_gap']:.2e} | {r['mismatch_kl']:.2e} | {100 * r['routing_mismatch']:.2f}% | "
            f"{r['clip_fraction']:.4f} | {100 * r['before']['pass_at_1']['mean']:.1f}% → "
            f"{100 * r['after']['pass_at_1']['mean']:.1f}% |")
    lines.append("")
    for mode in ("sync", "async"):
        gap = {k: [r["logprob_gap"] for r in rows if r["mode"] == mode and r["routing"] == k]
               for k in ("replay", "live")}
        kl = {k: [r["mismatch_kl"] for r in rows if r["mode"] == mode and r["routing"] == k]
              for k in ("replay", "live")}
        gain = {k: [r["after"]["pass_at_1"]["mean"] - r["before"]["pass_at_1"]["mean"]
                    for r in rows if r["mode"] == mode and r["routing"] == k] for k in ("replay", "live")}
        ratio = [l / r for l, r in zip(gap["live"], gap["replay"]) if r > 0]
        kl_ratio = [l / r for l, r in zip(kl["live"], kl["replay"]) if r > 0]
        g_r, g_l = mean_se(gain["replay"]), mean_se(gain["live"])
        lines.append(
            f"- {mode}: live / replay mean |Δ log p| {mean(ratio):.2f}× (per seed "
            f"{', '.join(f'{x:.2f}' for x in ratio)}), mismatch KL {mean(kl_ratio):.2f}×; pass@1 gain "
            f"replay {100 * g_r[0]:+.1f} points, live {100 * g_l[0]:+.1f} points.")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "routing_replay.json"), "w") as f:
        json.dump({"task": args.task, "experts": args.experts, "steps": args.steps, "runs": rows,
                   "table": text}, f, indent=1)
    print(f"\nwritten to {os.path.join(out, 'routing_replay.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
