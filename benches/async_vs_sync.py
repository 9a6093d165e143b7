#!/usr/bin/env python3
"""The headline benchmark: `rlstream run` asynchronous vs `--sync`, side by side.

For each task, both modes start from the same warm-start model, with the same config and
seed, one after the other on this machine. Printed per task:

- trained tokens/s in each mode and the ratio async/sync;
- wall-clock time until the reward (20-step moving average) first reaches a target, and the
  ratio; the target is halfway from the starting reward (first 20 steps, both runs) to the
  lower of the two final rewards (last 20 steps);
- final reward and accuracy (mean of the last 20 steps);
- generator idle fraction (time it waited for prompts with nothing to decode);
- weight-swap stall per swap, p50/p99 (time the decode loop spends picking up new weights);
- staleness of the trained groups (versions behind the trainer);
- held-out greedy reward and accuracy before and after (the unbiased measure: the training
  reward of an async run leans towards prompts whose groups finish first);
- the machine's ceiling for the throughput ratio, from measured stage times per token: sync
  pays generation plus training (each on both cores, measured in the sync run); async pays
  the slower of the two as measured in the async run, where they share the cores. The
  achieved ratio is compared with it.

- with `--eval-every N`, the held-out learning curve: pass@1 (`rlstream eval`'s set, at the
  training temperature) at every N steps against the wall time the step finished at, and
  how much sooner async reaches the sync run's final held-out pass@1 than sync does (both
  at the first evaluated point at or above it); the finals are equal within intervals when
  their 95% intervals overlap. Held-out points are noisy (about ±2 points at 1,000 prompts),
  so an async run that stops at the sync run's step count may end a little under sync's
  final and never reach it: `--async-steps M` runs async for M steps instead, which only
  extends its held-out curve. Every other figure, and the finals compared, are taken at
  the sync run's steps (the async run's generation counts, drops and staleness excepted:
  those cover its whole run).

Usage: python3 benches/async_vs_sync.py [--steps 200] [--tasks sort,longsort] [--out DIR]
                                        [--scorer-latency-ms MS] [--scorer-in-flight N]
                                        [--env-latency-ms MS] [--eval-every N] [--async-steps M]
                                        [--seeds 0,1,2]
Needs nothing but Python 3 and the release binary (built here with cargo).

`--scorer-latency-ms MS` is the latency-bound scenario, the balance of production RL where
decoding is on GPUs and scoring waits on sandboxes or tools: rewards come from the external
scorer `examples/verifier.py`, which waits MS milliseconds per group before answering; a pool
of `--scorers` (default 8) such processes scores that many groups at once, as a sandbox pool
would. `--scorer-in-flight N` lets each process hold N groups at once (answers come back
by `request_id`), as a sandbox service serves several requests at a time.

`--env-latency-ms MS` is the episode scenario (use it with an episode task, e.g.
`--tasks guess`): every environment step takes MS milliseconds before it answers, and
episodes run from 1 to 6 turns, so a synchronous step waits for its longest episode's
chain of steps while an asynchronous generator keeps other episodes decoding and training
goes on.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 20


def sh(cmd, log=None):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as err:
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}" + (f"; see {log}" if log else ""))
    return out.stdout


def moving(xs, w=WINDOW):
    out, s = [], 0.0
    for i, x in enumerate(xs):
        s += x
        if i >= w:
            s -= xs[i - w]
        out.append(s / min(i + 1, w))
    return out


def load(run_dir):
    rep = os.path.join(run_dir, "report")
    with open(os.path.join(rep, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(rep, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return summary, rows


def time_to(rows, target):
    """First time the full-window moving average of the reward reaches `target`."""
    avg = moving([r["reward_mean"] for r in rows])
    for i in range(WINDOW - 1, len(rows)):
        if avg[i] >= target:
            return rows[i]["time_s"]
    return float("nan")


def held_out(summary, upto):
    """Held-out (before, after) pairs of the run's `rlstream eval` points, after being its
    last point at or before step `upto`."""
    points = [p for p in summary.get("held_out") or [] if p["step"] <= upto]
    if not points:
        return {}
    b, a = points[0], points[-1]
    return {k: (b[k]["mean"], a[k]["mean"]) for k in ("pass_at_1", "reward", "greedy_accuracy", "greedy_reward")}


def curve(summary):
    """The held-out pass@1 points of a run: (step, time_s, mean, lo, hi), before RL first."""
    return [(p["step"], p.get("time_s", 0.0), p["pass_at_1"]["mean"], p["pass_at_1"]["lo"], p["pass_at_1"]["hi"])
            for p in summary.get("held_out") or []]


def time_to_pass(points, target):
    """Wall time of the first evaluated point after RL started at or above `target`."""
    for step, t, mean, _, _ in points:
        if step > 0 and mean >= target:
            return t
    return float("nan")


def rate(rows):
    """Trained tokens per second of RL up to the last of `rows`."""
    return sum(r["tokens"] for r in rows) / rows[-1]["time_s"] if rows and rows[-1]["time_s"] > 0 else float("nan")


def tail_mean(rows, key):
    t = rows[-WINDOW:]
    return sum(r[key] for r in t) / max(1, len(t))


def stage_times(s):
    """Generation and training seconds per trained token: busy time per token each stage
    handled, so runs whose completions differ in length compare fairly."""
    gen = s["gen_busy_s"] / max(1, s["generated_tokens"])
    train = s["train_busy_s"] / max(1, s["trained_tokens"])
    return gen, train


def staleness_text(s):
    total = sum(s["staleness"].values()) or 1
    return ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in sorted(s["staleness"].items(), key=lambda kv: int(kv[0])))


def bench(binary, task, steps, out, extra, sft_steps, seed, async_steps):
    model = os.path.join(out, f"sft-{task}")
    if not os.path.exists(model):
        sh([binary, "sft", "--task", task, "--steps", str(sft_steps), "--out", model], os.path.join(out, f"sft-{task}.log"))
    runs = {}
    for mode in ["async", "sync"]:
        d = os.path.join(out, f"{task}-seed{seed}-{mode}")
        n = async_steps if mode == "async" else steps
        cmd = [binary, "run", "--task", task, "--model", model, "--steps", str(n), "--out", d, "--plain",
               "--seed", str(seed)] + extra
        if mode == "sync":
            cmd.append("--sync")
        sh(cmd, d + ".log")
        runs[mode] = load(d)
    (sa, ra_all), (ss, rs) = runs["async"], runs["sync"]
    # Both modes are compared over the sync run's steps; an async run given more steps
    # (--async-steps) only extends its held-out curve, to find when it reaches sync's final.
    ra = [r for r in ra_all if r["step"] <= steps]
    head = lambda rows: sum(r["reward_mean"] for r in rows[:WINDOW]) / max(1, len(rows[:WINDOW]))
    start = (head(ra) + head(rs)) / 2
    final = min(tail_mean(ra, "reward_mean"), tail_mean(rs, "reward_mean"))
    target = start + 0.5 * (final - start)
    ta, ts = time_to(ra, target), time_to(rs, target)
    g_sync, t_sync = stage_times(ss)
    g_async, t_async = stage_times(sa)
    ceiling = (g_sync + t_sync) / max(g_async, t_async)
    tps = {"async": rate(ra), "sync": rate(rs)}
    achieved = tps["async"] / tps["sync"]
    ca, cs = curve(sa), curve(ss)
    sync_final = cs[-1][2] if cs else float("nan")
    ha, hs = time_to_pass(ca, sync_final), time_to_pass(cs, sync_final)
    # async's point at the sync run's last step: the finals compared at equal steps
    at_steps = [p for p in ca if p[0] <= steps]
    ca_final = at_steps[-1] if at_steps else None
    res = {
        "task": task,
        "steps": steps,
        "seed": seed,
        "held_out_curve": {"async": ca, "sync": cs},
        "sync_final_pass_at_1": sync_final,
        "time_to_sync_final_s": {"async": ha, "sync": hs},
        "time_to_sync_final_ratio": hs / ha if ha == ha and ha > 0 else float("nan"),
        "async_steps": async_steps,
        "async_final_at_steps": ca_final,
        "finals_overlap": bool(ca_final and cs and ca_final[3] <= cs[-1][4] and cs[-1][3] <= ca_final[4]),
        "trained_tokens_per_s": tps,
        "throughput_ratio": achieved,
        "ceiling_ratio": ceiling,
        "of_ceiling": achieved / ceiling,
        "target_reward": target,
        "time_to_target_s": {"async": ta, "sync": ts},
        "time_to_target_ratio": ts / ta if ta == ta and ta > 0 else float("nan"),
        "final_reward": {"async": tail_mean(ra, "reward_mean"), "sync": tail_mean(rs, "reward_mean")},
        "final_accuracy": {"async": tail_mean(ra, "accuracy"), "sync": tail_mean(rs, "accuracy")},
        "wall_s": {"async": ra[-1]["time_s"] if ra else float("nan"), "sync": rs[-1]["time_s"] if rs else float("nan")},
        "eval": {m: held_out(s, steps) for m, s in [("async", sa), ("sync", ss)]},
        "dropped_stale": {"async": sa["dropped"].get("stale", 0), "sync": ss["dropped"].get("stale", 0)},
        "generated_groups": {"async": sa["generated_groups"], "sync": ss["generated_groups"]},
        "gen_idle_fraction": {"async": sa["gen_idle_fraction"], "sync": ss["gen_idle_fraction"]},
        "stage_us_per_token": {"sync": {"gen": 1e6 * g_sync, "train": 1e6 * t_sync}, "async": {"gen": 1e6 * g_async, "train": 1e6 * t_async}},
        "swap_stall_us": {m: {"p50": 1e6 * s["swap_stall_p50_s"], "p99": 1e6 * s["swap_stall_p99_s"], "max": 1e6 * s["swap_stall_max_s"], "swaps": s["swaps"]} for m, s in [("async", sa), ("sync", ss)]},
        "staleness": {"async": staleness_text(sa), "sync": staleness_text(ss)},
    }
    return res


def report(r):
    a, s = "async", "sync"
    lines = [
        f"### `{r['task']}`, {r['steps']} steps, seed {r['seed']}"
        + (f", scorer latency {r['scorer_latency_ms']:g} ms per group, {r['scorers']} scorers"
           f" holding {r['scorer_in_flight']} group(s) each" if r.get("scorer_latency_ms") else "")
        + (f", environment latency {r['env_latency_ms']:g} ms per step" if r.get("env_latency_ms") else ""),
        "",
        "| | async | sync | async/sync |",
        "|---|---|---|---|",
        f"| trained tokens/s | {r['trained_tokens_per_s'][a]:.0f} | {r['trained_tokens_per_s'][s]:.0f} | **{r['throughput_ratio']:.2f}×** |",
        f"| wall time (s) | {r['wall_s'][a]:.1f} | {r['wall_s'][s]:.1f} | |",
        f"| time to reward {r['target_reward']:.3f} (s) | {r['time_to_target_s'][a]:.1f} | {r['time_to_target_s'][s]:.1f} | **{r['time_to_target_ratio']:.2f}× shorter** |",
        f"| final reward (last {WINDOW} steps) | {r['final_reward'][a]:.3f} | {r['final_reward'][s]:.3f} | |",
        f"| final accuracy (last {WINDOW} steps) | {100 * r['final_accuracy'][a]:.1f}% | {100 * r['final_accuracy'][s]:.1f}% | |",
        f"| generator idle | {100 * r['gen_idle_fraction'][a]:.0f}% | {100 * r['gen_idle_fraction'][s]:.0f}% | |",
        f"| held-out pass@1 at the training temperature, before → after | {100 * r['eval'][a]['pass_at_1'][0]:.1f}% → {100 * r['eval'][a]['pass_at_1'][1]:.1f}% | {100 * r['eval'][s]['pass_at_1'][0]:.1f}% → {100 * r['eval'][s]['pass_at_1'][1]:.1f}% | |",
        f"| held-out reward at the training temperature, before → after | {r['eval'][a]['reward'][0]:.3f} → {r['eval'][a]['reward'][1]:.3f} | {r['eval'][s]['reward'][0]:.3f} → {r['eval'][s]['reward'][1]:.3f} | |",
        f"| held-out greedy accuracy, before → after | {100 * r['eval'][a]['greedy_accuracy'][0]:.1f}% → {100 * r['eval'][a]['greedy_accuracy'][1]:.1f}% | {100 * r['eval'][s]['greedy_accuracy'][0]:.1f}% → {100 * r['eval'][s]['greedy_accuracy'][1]:.1f}% | |",
        f"| groups generated / dropped as stale | {r['generated_groups'][a]} / {r['dropped_stale'][a]} | {r['generated_groups'][s]} / {r['dropped_stale'][s]} | |",
        f"| generation / training busy time per token (µs) | {r['stage_us_per_token'][a]['gen']:.0f} / {r['stage_us_per_token'][a]['train']:.0f} | {r['stage_us_per_token'][s]['gen']:.0f} / {r['stage_us_per_token'][s]['train']:.0f} | |",
        f"| swap stall p50 / p99 (µs), swaps | {r['swap_stall_us'][a]['p50']:.1f} / {r['swap_stall_us'][a]['p99']:.1f}, {r['swap_stall_us'][a]['swaps']} | {r['swap_stall_us'][s]['p50']:.1f} / {r['swap_stall_us'][s]['p99']:.1f}, {r['swap_stall_us'][s]['swaps']} | |",
        f"| staleness of trained groups | {r['staleness'][a]} | {r['staleness'][s]} | |",
    ]
    if len(r["held_out_curve"][s]) > 2:
        fmt = lambda pts: ", ".join(f"{step}: {t:.1f} s {100 * m:.1f}%" for step, t, m, _, _ in pts if step > 0)
        final = lambda p: f"{100 * p[2]:.1f}% [{100 * p[3]:.1f}, {100 * p[4]:.1f}]" if p else "-"
        lines += [
            f"| held-out pass@1 along the run (step: time, pass@1) | {fmt(r['held_out_curve'][a])} | {fmt(r['held_out_curve'][s])} | |",
            f"| held-out pass@1 at step {r['steps']} [95% interval] | {final(r['async_final_at_steps'])} | {final(r['held_out_curve'][s][-1])} | "
            + ("equal within intervals |" if r["finals_overlap"] else "**intervals apart** |"),
            f"| time to sync's final held-out pass@1 ({100 * r['sync_final_pass_at_1']:.1f}%) (s) | "
            f"{r['time_to_sync_final_s'][a]:.1f} | {r['time_to_sync_final_s'][s]:.1f} | "
            f"**{r['time_to_sync_final_ratio']:.2f}× sooner** |",
        ]
    lines += [
        "",
        f"Ceiling for async/sync throughput on this machine: **{r['ceiling_ratio']:.2f}×** "
        f"(sync generation + training time per token / the slower async stage's time per token); achieved "
        f"{r['throughput_ratio']:.2f}× = {100 * r['of_ceiling']:.0f}% of it.",
        "",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tasks", default="sort,longsort")
    p.add_argument("--out", default=None, help="where runs and results.json go (default: a temp dir)")
    p.add_argument("--bin", default=None, help="rlstream binary (default: build target/release/rlstream)")
    p.add_argument("--scorer-latency-ms", type=float, default=0.0,
                   help="score with examples/verifier.py waiting this long per group")
    p.add_argument("--scorers", type=int, default=8,
                   help="with --scorer-latency-ms: external scorer processes (groups scored at once)")
    p.add_argument("--scorer-in-flight", type=int, default=1,
                   help="with --scorer-latency-ms: groups each scorer process holds at once")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out pass@1 every this many steps (checkpoints as often), for the curve")
    p.add_argument("--seeds", default="0", help="comma-separated RL seeds, each run in both modes")
    p.add_argument("--async-steps", type=int, default=0,
                   help="steps of the async run (default --steps): more extend its held-out curve past "
                        "the sync run's steps, to find when it reaches sync's final pass@1; "
                        "every other figure is taken over the first --steps")
    p.add_argument("--env-latency-ms", type=float, default=0.0,
                   help="episode tasks: every environment step waits this long before answering")
    p.add_argument("--sft-steps", type=int, default=100, help="warm-start steps before both runs")
    p.add_argument("extra", nargs="*", help="more `rlstream run` flags, after --")
    args = p.parse_args()
    if args.scorer_latency_ms > 0:
        verifier = os.path.join(ROOT, "examples", "verifier.py")
        args.extra += ["--scorer-cmd", f"{sys.executable} {verifier} --latency-ms {args.scorer_latency_ms:g}",
                       "--scorers", str(args.scorers), "--scorer-in-flight", str(args.scorer_in_flight)]
    if args.eval_every > 0:
        args.extra += ["--eval-every", str(args.eval_every), "--checkpoint-every", str(args.eval_every)]
    if args.env_latency_ms > 0:
        args.extra += ["--env-latency-ms", f"{args.env_latency_ms:g}"]
    binary = args.bin
    if binary is None:
        sh(["cargo", "build", "--release", "--quiet"])
        binary = os.path.join(ROOT, "target", "release", "rlstream")
    out = args.out or tempfile.mkdtemp(prefix="rlstream-bench-")
    os.makedirs(out, exist_ok=True)
    print(f"runs in {out}; {os.cpu_count()} CPUs", file=sys.stderr)
    seeds = [int(x) for x in args.seeds.split(",")]
    async_steps = max(args.async_steps, args.steps)
    results = [bench(binary, t, args.steps, out, args.extra, args.sft_steps, seed, async_steps)
               for t in args.tasks.split(",") for seed in seeds]
    for r in results:
        r["scorer_latency_ms"] = args.scorer_latency_ms
        r["scorers"] = args.scorers
        r["scorer_in_flight"] = args.scorer_in_flight
        r["env_latency_ms"] = args.env_latency_ms
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    for r in results:
        print(report(r))
    if len(seeds) > 1:
        print("| task | seed | async/sync trained tokens/s | sooner to sync's final held-out pass@1 | held-out pass@1 at the last sync step, async / sync |")
        print("|---|---|---|---|---|")
        for r in results:
            ca, cs = r["async_final_at_steps"], r["held_out_curve"]["sync"]
            finals = f"{100 * ca[2]:.1f}% / {100 * cs[-1][2]:.1f}%" if ca and cs else "-"
            print(f"| {r['task']} | {r['seed']} | {r['throughput_ratio']:.2f}× | {r['time_to_sync_final_ratio']:.2f}× | {finals}"
                  + ("" if r["finals_overlap"] else " (intervals apart)") + " |")
    print(f"results: {os.path.join(out, 'results.json')}")


if __name__ == "__main__":
    main()
