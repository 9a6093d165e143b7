#!/usr/bin/env python3
"""On-policy distillation from a stronger teacher against outcome RL alone, step for step.

The teacher: a larger model (`--hidden 128 --layers 4`, 4x the default's width x depth)
with a longer warm start and a long RL run on the task (`rlstream run`), or `--teacher DIR`.
Its own held-out pass@1 is measured by `rlstream eval`.

For each seed: the default run (`rlstream run --seed S`: warm start, then outcome RL on
the embedded bus), then the same RL phase from that run's warm start with the teacher
scoring every sampled token (`--model RUN/sft --teacher T --distill reverse-kl`, verifier
reward kept). Every `--every` steps the checkpoint of each arm is evaluated by `rlstream
eval` on the same 1,000 held-out prompts x 4 samples at temperature 1.

    python3 benches/distill_vs_rl.py --seeds 1,2,3 [--steps 200] [--every 20]
        [--teacher DIR] [--distill-coef 1] [--token-discount 0] [--out DIR]

Prints the held-out curves (mean pass@1 over seeds, with its standard error) and each arm's
wall-clock, the step at which distillation first reaches RL's final pass@1 on each seed,
and writes OUT/distill_vs_rl-coefC-discountG.json and .svg (a second run with other
settings in the same OUT reuses the RL arm and every evaluation already made). Builds nothing: run `cargo
build --release` first.
"""

import argparse
import json
import os
import sys
import tempfile
import time

# The binary, the runner and the statistics of benches/learning.py.
from learning import BIN, mean_se, rlstream


def evaluate(path, model, task, seed):
    if not os.path.exists(path):
        rlstream("eval", "--model", model, "--task", task, "--seed", str(seed), "--json", path)
    with open(path) as f:
        return json.load(f)


def checkpoint(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step-{step:08d}")


def make_teacher(args, out):
    run_dir = os.path.join(out, "teacher")
    began = time.time()
    rlstream("run", "--task", args.task, "--hidden", "128", "--layers", "4",
             "--sft-steps", str(args.teacher_sft_steps), "--steps", str(args.teacher_steps),
             "--seed", "7", "--eval-prompts", "0", "--out", run_dir, "--plain")
    return checkpoint(run_dir, args.teacher_steps), time.time() - began


def curve(run_dir, sft, args, seed, name):
    points = []
    for step in range(0, args.steps + 1, args.every):
        model = sft if step == 0 else checkpoint(run_dir, step)
        e = evaluate(os.path.join(run_dir, f"eval-{step}.json"), model, args.task, seed)
        points.append((step, e["pass_at_1"]["mean"], e["reward"]["mean"]))
        print(f"  {name} step {step}: pass@1 {e['pass_at_1']['mean']:.3f}", file=sys.stderr)
    return points


def one_seed(args, out, seed, teacher):
    rl = os.path.join(out, f"seed-{seed}-rl")
    distill = os.path.join(out, f"seed-{seed}-distill-coef{args.distill_coef:g}-discount{args.token_discount:g}")
    common = ["--task", args.task, "--seed", str(seed), "--steps", str(args.steps),
              "--checkpoint-every", str(args.every), "--eval-prompts", "0", "--plain"]
    if not os.path.exists(os.path.join(rl, "report", "summary.json")):
        rlstream("run", *common, "--out", rl)
    sft = os.path.join(rl, "sft")
    if not os.path.exists(os.path.join(distill, "report", "summary.json")):
        rlstream("run", *common, "--model", sft, "--teacher", teacher, "--distill", "reverse-kl",
                 "--distill-coef", str(args.distill_coef), "--token-discount", str(args.token_discount),
                 "--out", distill)
    summaries = {}
    for name, d in (("rl", rl), ("distill", distill)):
        with open(os.path.join(d, "report", "summary.json")) as f:
            summaries[name] = json.load(f)
    return {
        "seed": seed,
        "rl": curve(rl, sft, args, seed, "rl"),
        "distill": curve(distill, sft, args, seed, "distill"),
        "rl_wall_s": summaries["rl"]["wall_s"],
        "distill_wall_s": summaries["distill"]["wall_s"],
    }


def svg(rows, steps, teacher_pass, path):
    w, h, pad = 640, 400, 56
    top = max([teacher_pass] + [p for r in rows for k in ("rl", "distill") for _, p, _ in r[k]]) * 1.1
    x = lambda s: pad + (w - 2 * pad) * s / steps
    y = lambda v: h - pad - (h - 2 * pad) * v / top
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{w / 2}" y="{h - 16}" text-anchor="middle">RL step</text>',
             f'<text x="16" y="{h / 2}" transform="rotate(-90 16 {h / 2})" text-anchor="middle">held-out pass@1</text>',
             f'<line x1="{pad}" y1="{y(teacher_pass):.1f}" x2="{w - pad}" y2="{y(teacher_pass):.1f}" stroke="gray" stroke-dasharray="4 4"/>',
             f'<text x="{w - pad}" y="{y(teacher_pass) - 4:.1f}" text-anchor="end" fill="gray">teacher {100 * teacher_pass:.1f}%</text>']
    for i in range(0, 5):
        v = top * i / 4
        parts.append(f'<text x="{pad - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{100 * v:.0f}%</text>')
    for s in range(0, steps + 1, max(1, steps // 5)):
        parts.append(f'<text x="{x(s):.1f}" y="{h - pad + 16}" text-anchor="middle">{s}</text>')
    for k, (name, color) in enumerate((("rl", "#1f77b4"), ("distill", "#d62728"))):
        pts = []
        for j, (s, _, _) in enumerate(rows[0][name]):
            m, se = mean_se([r[name][j][1] for r in rows])
            se = 0.0 if se != se else se
            pts.append((s, m))
            parts.append(f'<line x1="{x(s):.1f}" y1="{y(m - se):.1f}" x2="{x(s):.1f}" y2="{y(m + se):.1f}" stroke="{color}"/>')
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{x(s):.1f},{y(m):.1f}" for s, m in pts) + '"/>')
        label = "outcome RL" if name == "rl" else "distillation (reverse KL) + outcome"
        parts.append(f'<text x="{pad + 10}" y="{pad + 16 * (k + 1)}" fill="{color}">{label} (mean ± SE, {len(rows)} seeds)</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--task", default="longer")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--teacher", default=None, help="a teacher model directory (made when absent)")
    p.add_argument("--teacher-sft-steps", type=int, default=1000)
    p.add_argument("--teacher-steps", type=int, default=700)
    p.add_argument("--distill-coef", type=float, default=1.0)
    p.add_argument("--token-discount", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} is missing: run `cargo build --release` first")
    out = args.out or tempfile.mkdtemp(prefix="rlstream-distill-")
    os.makedirs(out, exist_ok=True)
    teacher, teacher_s = (args.teacher, None) if args.teacher else make_teacher(args, out)
    teacher_eval = evaluate(os.path.join(out, "teacher-eval.json"), teacher, args.task, 0)
    print(f"teacher {teacher}: pass@1 {teacher_eval['pass_at_1']['mean']:.3f}", file=sys.stderr)
    rows = [one_seed(args, out, int(s), teacher) for s in args.seeds.split(",")]

    def cell(name, j):
        m, se = mean_se([r[name][j][1] for r in rows])
        return f"{100 * m:.1f}% ± {100 * se:.1f}" if se == se else f"{100 * m:.1f}%"

    tp = teacher_eval["pass_at_1"]
    lines = [
        f"Teacher: held-out pass@1 "
        f"{100 * tp['mean']:.1f}% ± {100 * 1.96 * tp['se']:.1f}"
        + (f" (made in {teacher_s:.0f} s)" if teacher_s else "") + ".",
        "",
        f"Held-out pass@1 (mean over {len(rows)} seeds ± standard error over seeds; each point "
        f"{teacher_eval['prompts']:,} held-out prompts x {teacher_eval['samples']} samples at temperature 1):",
        "",
        "| step | outcome RL | distillation + outcome |",
        "|---|---|---|",
    ]
    for j, (s, _, _) in enumerate(rows[0]["rl"]):
        lines.append(f"| {s} | {cell('rl', j)} | {cell('distill', j)} |")
    reach = []
    for r in rows:
        final = r["rl"][-1][1]
        at = next((s for s, v, _ in r["distill"] if s > 0 and v >= final), None)
        reach.append(at)
    rl_w, rl_w_se = mean_se([r["rl_wall_s"] for r in rows])
    d_w, d_w_se = mean_se([r["distill_wall_s"] for r in rows])
    lines += [
        "",
        "| | outcome RL | distillation + outcome |",
        "|---|---|---|",
        f"| RL-phase wall-clock, {args.steps} steps (mean over seeds) | {rl_w:.1f} s | {d_w:.1f} s |",
        "",
        "Step at which distillation first reaches RL's final pass@1, per seed: "
        + ", ".join(f"seed {r['seed']}: {a if a is not None else 'not within ' + str(args.steps)}"
                    for r, a in zip(rows, reach)) + ".",
    ]
    text = "\n".join(lines)
    print(text)
    tag = f"coef{args.distill_coef:g}-discount{args.token_discount:g}"
    svg(rows, args.steps, tp["mean"], os.path.join(out, f"distill_vs_rl-{tag}.svg"))
    with open(os.path.join(out, f"distill_vs_rl-{tag}.json"), "w") as f:
        json.dump({"teacher": teacher, "teacher_eval": teacher_eval, "rows": rows, "reach": reach,
                   "table": text, "args": vars(args)}, f, indent=2)
    print(f"\nwrote {out}/distill_vs_rl-{tag}.json and .svg", file=sys.stderr)


if __name__ == "__main__":
    main()
