#!/usr/bin/env python3
"""Does the default `rlstream run` learn, beyond what more supervised training would give?

For each seed: the default run (`rlstream run --seed S`, embedded bus), whose summary holds
`rlstream eval` results before and after RL on 1,000 held-out prompts; then the control, the
same warm start given the RL phase's wall-clock as more supervised training on the
demonstrations (`rlstream sft --init OUT/sft`, as many steps as the warm start makes in that
time), evaluated by `rlstream eval` on the same held-out prompts.

    python3 benches/learning.py --seeds 1,2,3,4,5 [--task longer] [--steps 200] [--async|--sync]
    python3 benches/learning.py --repeat 10 [--beside "CMD"] [--sync]

`--repeat N` runs the README's first command itself (`rlstream run`, every setting at its
default, seed included) N times in a row, each with its control, and reports the
distribution: each run's held-out pass@1 gain with the standard error `summary.json` gives
it, whether it reached +5 points and 3 standard errors, and whether it ended above the
control. `--beside CMD` keeps CMD (a shell command, say the test suite) running the whole
time, started again whenever it ends, as a busy machine would: it changes the async
schedule. `--sync` adds `--sync` to the command.

For an episode task (`--task guess`, `--task calc`) pass@1 is the success rate, reward the
episode's return, and a second table gives the turns per episode; a tool-use task (`calc`)
adds the tool-call rate and the share of valid calls.

Prints a Markdown table per seed and the mean gain with its standard error over seeds, and
writes everything to OUT/learning.json.
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


def rlstream(*args):
    out = subprocess.run([BIN, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"rlstream {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, sd / math.sqrt(n)


def one_seed(args, out, seed, demonstrations):
    run_dir = os.path.join(out, f"seed-{seed}")
    extra = ["--sync"] if args.sync else []
    return run_and_control(
        ["--task", args.task, "--seed", str(seed), "--steps", str(args.steps), "--plain", *extra],
        run_dir, seed, args.task, demonstrations)


def run_and_control(run_args, run_dir, seed, task, demonstrations):
    """`rlstream run RUN_ARGS` into RUN_DIR, then its control: the warm start given the RL
    phase's wall-clock as more supervised training, evaluated on the same held-out prompts."""
    rlstream("run", *run_args, "--out", run_dir)
    with open(os.path.join(run_dir, "report", "summary.json")) as f:
        s = json.load(f)
    before, after = s["held_out"][0], s["held_out"][-1]
    sft_steps = s["config"]["run"]["sft_steps"]
    # The warm start's speed, in steps per second, gives the control its step count.
    control_steps = max(1, round(s["wall_s"] * sft_steps / s["warm_start_s"]))
    control = os.path.join(run_dir, "control")
    rlstream("sft", "--task", demonstrations, "--init", os.path.join(run_dir, "sft"),
             "--steps", str(control_steps), "--seed", str(seed), "--out", control)
    ctl_json = os.path.join(run_dir, "control-eval.json")
    rlstream("eval", "--model", control, "--task", task, "--seed", str(seed),
             "--temperature", str(s["config"]["policy"]["temperature"]), "--json", ctl_json)
    with open(ctl_json) as f:
        ctl = json.load(f)
    return {
        "seed": seed,
        "gain": s["pass_at_1_gain"],
        "swaps": s["swaps"],
        "gen_idle_fraction": s["gen_idle_fraction"],
        "warm_start_s": s["warm_start_s"],
        "rl_wall_s": s["wall_s"],
        "control_steps": control_steps,
        "before": before,
        "after": after,
        "control": ctl,
    }


def repeat(args, out):
    """The README's first command, `args.repeat` times, optionally beside a busy command."""
    beside = None
    if args.beside:
        # Restarted whenever it ends, so the machine stays busy for every run.
        beside = subprocess.Popen(["bash", "-c", f"while true; do {args.beside}; done"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    rows = []
    try:
        for i in range(args.repeat):
            extra = ["--sync"] if args.sync else []
            r = run_and_control(extra, os.path.join(out, f"run-{i}"), 0, "longer", "sort")
            rows.append(r)
            print(f"run {i}: gain {100 * r['gain']['mean']:+.1f} points "
                  f"(se {100 * r['gain']['se']:.1f}), control "
                  f"{100 * r['control']['pass_at_1']['mean']:.1f}%", file=sys.stderr)
    finally:
        if beside:
            os.killpg(beside.pid, 15)
    command = "rlstream run" + (" --sync" if args.sync else "")
    lines = [
        f"`{command}` {len(rows)} times in a row{' beside `' + args.beside + '`' if args.beside else ''}; "
        f"held-out pass@1 at the training temperature on {rows[0]['after']['prompts']} prompts "
        f"× {rows[0]['after']['samples']} samples:",
        "",
        "| run | before RL | after RL | gain (points) | gain / its standard error | control (more SFT) "
        "| above the control | weight swaps | generator idle | RL wall-clock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    passed = 0
    for i, r in enumerate(rows):
        b, a, c, g = r["before"], r["after"], r["control"], r["gain"]
        z = g["mean"] / g["se"] if g["se"] > 0 else float("inf")
        above = a["pass_at_1"]["mean"] > c["pass_at_1"]["mean"]
        passed += g["mean"] >= 0.05 and z >= 3 and above
        lines.append(
            f"| {i + 1} | {100 * b['pass_at_1']['mean']:.1f}% | {100 * a['pass_at_1']['mean']:.1f}% "
            f"| {100 * g['mean']:+.1f} | {z:.1f} | {100 * c['pass_at_1']['mean']:.1f}% "
            f"| {'yes' if above else 'no'} | {r['swaps']} | {100 * r['gen_idle_fraction']:.0f}% "
            f"| {r['rl_wall_s']:.1f} s |")
    gains = [r["gain"]["mean"] for r in rows]
    m, se = mean_se(gains)
    lines += ["", f"{passed} of {len(rows)} runs gained at least 5 points and 3 standard errors "
                  f"and ended above the control; gains {100 * min(gains):+.1f} to "
                  f"{100 * max(gains):+.1f} points, mean {100 * m:+.1f} (standard error over runs "
                  f"{100 * se:.1f})."]
    return rows, "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--task", default="longer")
    p.add_argument("--demonstrations", default=None,
                   help="task the warm start imitates (sort for longer, the task otherwise)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--repeat", type=int, default=0,
                   help="run the README's first command this many times (every setting at its default)")
    p.add_argument("--beside", default=None,
                   help="with --repeat: a shell command kept running beside the runs")
    args = p.parse_args()
    demonstrations = args.demonstrations or ("sort" if args.task == "longer" else args.task)
    if not os.path.exists(BIN):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    out = args.out or tempfile.mkdtemp(prefix="rlstream-learning-")
    if args.repeat:
        rows, text = repeat(args, out)
        print(text)
        with open(os.path.join(out, "repeat.json"), "w") as f:
            json.dump({"rows": rows, "table": text}, f, indent=2)
        print(f"\nwrote {os.path.join(out, 'repeat.json')}", file=sys.stderr)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        r = one_seed(args, out, seed, demonstrations)
        rows.append(r)
        print(f"seed {seed}: pass@1 {r['before']['pass_at_1']['mean']:.3f} -> {r['after']['pass_at_1']['mean']:.3f}, "
              f"control {r['control']['pass_at_1']['mean']:.3f}", file=sys.stderr)

    def pct(e):
        return f"{100 * e['mean']:.1f}% ± {100 * 1.96 * e['se']:.1f}"

    def val(e):
        return f"{e['mean']:.3f} ± {1.96 * e['se']:.3f}"

    lines = [
        f"`rlstream run --task {args.task} --steps {args.steps}{' --sync' if args.sync else ''}` per seed; "
        f"held-out pass@1 and reward at the training temperature on {rows[0]['after']['prompts']} prompts "
        f"× {rows[0]['after']['samples']} samples (± the 95% interval of each evaluation):",
        "",
        "| seed | before RL | after RL | gain | control (more SFT) | reward before → after RL | reward, control | greedy accuracy after RL | RL / control wall-clock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gains, over_control, reward_gains = [], [], []
    for r in rows:
        b, a, c = r["before"], r["after"], r["control"]
        gain = a["pass_at_1"]["mean"] - b["pass_at_1"]["mean"]
        gains.append(gain)
        over_control.append(a["pass_at_1"]["mean"] - c["pass_at_1"]["mean"])
        reward_gains.append(a["reward"]["mean"] - b["reward"]["mean"])
        lines.append(
            f"| {r['seed']} | {pct(b['pass_at_1'])} | {pct(a['pass_at_1'])} | {100 * gain:+.1f} | "
            f"{pct(c['pass_at_1'])} | {val(b['reward'])} → {val(a['reward'])} | {val(c['reward'])} | "
            f"{pct(a['greedy_accuracy'])} | {r['rl_wall_s']:.1f} s / {r['control_steps']} SFT steps |"
        )
    g, g_se = mean_se(gains)
    oc, oc_se = mean_se(over_control)
    rg, rg_se = mean_se(reward_gains)
    lines += [
        "",
        f"Over {len(rows)} seeds: pass@1 gain {100 * g:+.1f} points (standard error {100 * g_se:.1f}, "
        f"{g / g_se:.1f}× it; smallest {100 * min(gains):+.1f}); after RL minus control "
        f"{100 * oc:+.1f} points (standard error {100 * oc_se:.1f}); reward gain {rg:+.3f} "
        f"(standard error {rg_se:.3f}).",
    ]
    # Episode tasks (guess): model turns per episode, before and after RL and the control.
    if "turns" in rows[0]["after"]:
        lines += [
            "",
            "| seed | turns per episode before RL | after RL | control | greedy success before → after RL |",
            "|---|---|---|---|---|",
        ]
        turn_gains = []
        for r in rows:
            b, a, c = r["before"], r["after"], r["control"]
            turn_gains.append(a["turns"]["mean"] - b["turns"]["mean"])
            lines.append(
                f"| {r['seed']} | {val(b['turns'])} | {val(a['turns'])} | {val(c['turns'])} | "
                f"{pct(b['greedy_accuracy'])} → {pct(a['greedy_accuracy'])} |"
            )
        t, t_se = mean_se(turn_gains)
        lines += ["", f"Turns per episode change {t:+.3f} (standard error {t_se:.3f})."]
    # Tool-use tasks (calc): how often the tool is called, and how often a call is valid.
    if "tool_call_rate" in rows[0]["after"]:
        lines += [
            "",
            "| seed | tool called, before → after RL | control | valid calls, before → after RL | control |",
            "|---|---|---|---|---|",
        ]
        call_gains, valid_gains = [], []
        for r in rows:
            b, a, c = r["before"], r["after"], r["control"]
            call_gains.append(a["tool_call_rate"]["mean"] - b["tool_call_rate"]["mean"])
            valid_gains.append(a["tool_call_validity"]["mean"] - b["tool_call_validity"]["mean"])
            lines.append(
                f"| {r['seed']} | {pct(b['tool_call_rate'])} → {pct(a['tool_call_rate'])} | {pct(c['tool_call_rate'])} | "
                f"{pct(b['tool_call_validity'])} → {pct(a['tool_call_validity'])} | {pct(c['tool_call_validity'])} |"
            )
        cg, cg_se = mean_se(call_gains)
        vg, vg_se = mean_se(valid_gains)
        lines += ["", f"Tool-call rate change {100 * cg:+.1f} points (standard error {100 * cg_se:.1f}); "
                      f"call validity change {100 * vg:+.1f} points (standard error {100 * vg_se:.1f})."]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "learning.json"), "w") as f:
        json.dump({"rows": rows, "gain": [g, g_se], "over_control": [oc, oc_se],
                   "reward_gain": [rg, rg_se], "table": text}, f, indent=2)
    print(f"\nwrote {os.path.join(out, 'learning.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
