#!/usr/bin/env python3
"""Do the objectives learn? Held-out pass@1 before and after `rlstream run` under each.

For each task, preset and seed: `rlstream run --task TASK --seed S --plain FLAGS`, every
other setting at its default (the embedded bus, the task's default steps), whose summary
holds `rlstream eval` before and after RL on 1,000 held-out prompts. Resumable: a run
whose summary is already in OUT is read, not run again, so an interrupted sweep goes on
where it stopped.

    python3 benches/objectives.py [--tasks longer] [--presets ppo,gspo,...] [--seeds 0,1,2]
                                  [--out DIR]
    python3 benches/objectives.py --tasks calc --presets ppo,gspo,cispo,ppo-dual-clip

Prints, per task, a Markdown table: each preset's flags, its held-out pass@1 after RL per
seed (with the evaluation's 95% interval), and the mean gain over seeds with its standard
error; writes everything to OUT/objectives.json.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "rlstream")

# Each objective as its paper or the peers run it (docs/objectives.md).
PRESETS = {
    "ppo": [],
    "gspo": ["--loss", "gspo", "--clip-eps", "3e-4", "--clip-eps-high", "4e-4",
             "--loss-agg-mode", "seq-mean-token-mean"],
    "cispo": ["--loss", "cispo", "--clip-eps", "0.99", "--clip-eps-high", "4"],
    "ppo-dual-clip": ["--clip-ratio-c", "3"],
    "ppo-token-mask": ["--is-mask", "token"],
    "ppo-sequence-mask": ["--is-mask", "sequence"],
    "dr-grpo": ["--loss-agg-mode", "seq-mean-token-sum-norm", "--advantage", "nostd"],
    "grpo-seq-mean": ["--loss-agg-mode", "seq-mean-token-mean"],
    "tis": ["--loss", "tis"],
    "reinforce": ["--loss", "reinforce"],
    "ppo-kl-k3": ["--kl-coef", "0.05", "--kl-loss-type", "k3"],
    "ppo-entropy": ["--entropy-coeff", "0.001"],
    "ppo-4-updates": ["--ppo-mini-batch-size", "4", "--ppo-epochs", "2"],
    "decoupled": ["--use-decoupled-loss"],
    "decoupled-4-updates": ["--use-decoupled-loss", "--ppo-mini-batch-size", "4", "--ppo-epochs", "2"],
    "decoupled-4-updates-loglinear": ["--use-decoupled-loss", "--ppo-mini-batch-size", "4", "--ppo-epochs", "2",
                                      "--prox-logp-method", "loglinear"],
    # Four updates a step take four Adam steps: the same movement per step at a quarter
    # of the learning rate.
    "ppo-4-updates-lr-quarter": ["--ppo-mini-batch-size", "4", "--ppo-epochs", "2", "--lr", "1.25e-4"],
    "decoupled-4-updates-lr-quarter": ["--use-decoupled-loss", "--ppo-mini-batch-size", "4", "--ppo-epochs", "2",
                                       "--lr", "1.25e-4"],
    # Every step learns (docs/objectives.md): dynamic sampling, a difficulty-aware feed,
    # and overlong handling under a limit with room past the longest answer (`longer`'s
    # answers end by 11 tokens; 16 leaves 5 a rambling completion can run into).
    "filter-groups": ["--filter-groups"],
    "reoffer": ["--reoffer", "0.5"],
    "filter-groups-reoffer": ["--filter-groups", "--reoffer", "0.5"],
    "len16": ["--max-new-tokens", "16"],
    "len16-mask-truncated": ["--max-new-tokens", "16", "--mask-truncated"],
    "len16-overlong": ["--max-new-tokens", "16", "--overlong-buffer", "4"],
    "len16-length-penalty": ["--max-new-tokens", "16", "--length-penalty", "0.1"],
}


def run(task, preset, seed, out):
    """The run's summary, from OUT when it was run before."""
    d = os.path.join(out, task, preset, f"seed-{seed}")
    summary = os.path.join(d, "report", "summary.json")
    if not os.path.exists(summary):
        cmd = [BIN, "run", "--task", task, "--seed", str(seed), "--plain", "--out", d, *PRESETS[preset]]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    with open(summary) as f:
        return json.load(f)


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def steps_of(d):
    """The run's step records (report/metrics.jsonl)."""
    with open(os.path.join(d, "report", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def sampling_row(preset, runs, dirs):
    """Per preset, means over seeds: pass@1 at each held-out point with its step and
    time, the share of groups filtered, the trainer's mean wait, and the truncated share."""
    points, filtered, waits, cut, walls, again = {}, [], [], [], [], []
    for s, d in zip(runs, dirs):
        for i, h in enumerate(s["held_out"]):
            p = points.setdefault(i, [[], [], []])
            p[0].append(h["pass_at_1"]["mean"])
            p[1].append(h.get("step", 0))
            p[2].append(h.get("time_s", 0.0))
        recs = steps_of(d)
        f = sum(r.get("filtered_groups", 0) for r in recs)
        g = sum(r.get("groups", 0) for r in recs)
        filtered.append(f / max(f + g, 1))
        waits.append(sum(r.get("wait_s", 0.0) for r in recs) / max(len(recs), 1))
        samples = sum(r.get("groups", 0) for r in recs) * 8
        cut.append(sum(r.get("truncated_samples", 0) for r in recs) / max(samples, 1))
        walls.append(s["wall_s"])
        again.append(s.get("prompts_reoffered", 0) / max(s.get("prompts_fed", 0), 1))
    mean = lambda xs: sum(xs) / len(xs)
    curve = " → ".join(f"{100 * mean(v[0]):.1f}% (step {mean(v[1]):.0f}, {mean(v[2]):.0f} s)"
                       for v in points.values())
    return (f"| {preset} | {curve} | {100 * mean(filtered):.1f}% | {100 * mean(again):.1f}% | "
            f"{mean(waits):.2f} s | {100 * mean(cut):.1f}% | {mean(walls):.0f} s |")


def sampling_table(task, results, dirs):
    lines = [
        f"`{task}`, means over seeds: held-out pass@1 at each evaluation (its step and "
        "seconds into RL), groups filtered, prompts fed again, the trainer's mean wait per "
        "step, completions cut at the limit, and RL wall time:",
        "",
        "| preset | pass@1 (step, time) | filtered | fed again | wait per step | truncated | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset, runs in results.items():
        lines.append(sampling_row(preset, runs, dirs[preset]))
    return "\n".join(lines)


def table(task, results, seeds):
    lines = [
        f"`{task}`: held-out pass@1 at the training temperature after RL, per seed "
        "[95% interval], and the gain over seeds:",
        "",
        "| preset | flags | " + " | ".join(f"seed {s}" for s in seeds) + " | mean gain (points) ± standard error |",
        "|---|---|" + "---|" * len(seeds) + "---|",
    ]
    for preset, runs in results.items():
        cells, gains = [], []
        for s in runs:
            before, after = s["held_out"][0]["pass_at_1"], s["held_out"][-1]["pass_at_1"]
            cells.append(f"{100 * after['mean']:.1f}% [{100 * after['lo']:.1f}, {100 * after['hi']:.1f}]")
            gains.append(after["mean"] - before["mean"])
        m, se = mean_se(gains)
        flags = " ".join(PRESETS[preset]) or "(defaults)"
        lines.append(f"| {preset} | `{flags}` | " + " | ".join(cells) + f" | {100 * m:+.1f} ± {100 * se:.1f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="longer")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=None, help="where runs go; give the same to resume")
    args = p.parse_args()
    presets = args.presets.split(",")
    unknown = [x for x in presets if x not in PRESETS]
    if unknown:
        sys.exit(f"unknown presets {unknown}; known: {', '.join(PRESETS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if not os.path.exists(BIN):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    out = args.out or tempfile.mkdtemp(prefix="rlstream-objectives-")
    print(f"runs in {out}", file=sys.stderr)
    everything = {}
    for task in args.tasks.split(","):
        results = {pr: [run(task, pr, s, out) for s in seeds] for pr in presets}
        dirs = {pr: [os.path.join(out, task, pr, f"seed-{s}") for s in seeds] for pr in presets}
        everything[task] = {pr: [{"seed": s, "held_out": r["held_out"], "wall_s": r["wall_s"]}
                                 for s, r in zip(seeds, runs)] for pr, runs in results.items()}
        print(table(task, results, seeds))
        print()
        print(sampling_table(task, results, dirs))
        print()
    with open(os.path.join(out, "objectives.json"), "w") as f:
        json.dump({"presets": PRESETS, "results": everything}, f, indent=2)
    print(f"wrote {os.path.join(out, 'objectives.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
