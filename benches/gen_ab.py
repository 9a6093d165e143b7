#!/usr/bin/env python3
"""The generator before and after a change, rlstream alone, side by side in one run.

    python benches/gen_ab.py --before REV [--runs 5] [--groups 16] [--redis URL]

Builds revision REV in a scratch git worktree and this tree (release, default features,
one shared target directory), writes Qwen2.5-0.5B's shape with random weights, then runs
both builds interleaved (before, after, before, ...), `--runs` times each:

- `generate`: the sampler alone (the train_scale bench's `generate`), 8 rows x 128 new
  tokens after a 128-token prompt, tokens/s including prefill;
- `gen under load`: one `rlstream gen` process on Redis with `--max-batch 64` (8 groups of
  8 in flight, a new group admitted as one finishes), 32 new tokens, its generated-token
  counter over the time from the first published group to the `--groups`-th
  (benches/gen_load.py's measure, without PyTorch).

Prints every run as a JSON line and, per work, the medians and after/before. The machine's
timings move by 10% and more between runs of one binary (BENCHMARKS.md), which is why the
runs are interleaved and the medians compared. Needs Redis on 127.0.0.1:6379 and the
`redis` Python package.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from gen_load import ROOT, model_dir, run_gen


def built(tree, target):
    """The release binary and the train_scale bench of the tree at `tree`, copied aside (both
    trees build into `target`, so each build's binaries are kept apart)."""
    env = dict(os.environ, CARGO_TARGET_DIR=target)
    subprocess.run(["cargo", "build", "--release", "--bin", "rlstream"], cwd=tree, env=env,
                   check=True)
    subprocess.run(["cargo", "bench", "--bench", "train_scale", "--no-run"], cwd=tree, env=env,
                   check=True)
    deps = os.path.join(target, "release", "deps")
    benches = [os.path.join(deps, f) for f in os.listdir(deps)
               if f.startswith("train_scale-") and "." not in f
               and os.access(os.path.join(deps, f), os.X_OK)]
    side = os.path.join(target, "gen-ab", os.path.basename(tree.rstrip("/")))
    os.makedirs(side, exist_ok=True)
    paths = []
    for src in (os.path.join(target, "release", "rlstream"), max(benches, key=os.path.getmtime)):
        dst = os.path.join(side, os.path.basename(src).split("-")[0])
        shutil.copy2(src, dst)
        paths.append(dst)
    return tuple(paths)


def last_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the revision to compare against")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16, help="groups timed under load")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379")
    args = ap.parse_args()
    target = os.path.join(ROOT, "target")
    out = tempfile.mkdtemp(prefix="gen-ab-")
    before_tree = os.path.join(out, "before")
    subprocess.run(["git", "worktree", "add", "--detach", before_tree, args.before],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    try:
        builds = {"before": built(before_tree, target), "after": built(ROOT, target)}
        model = model_dir("0.5b", builds["after"][0], builds["after"][1], out)
        results = {(side, work): [] for side in builds for work in ("generate", "gen_load")}
        for run in range(args.runs):
            for side, (rlstream, bench) in builds.items():
                g = last_json([bench, "generate", model, "128", "128", "8"])
                results[(side, "generate")].append(g["tokens_per_s"])
                print(json.dumps({"run": run, "side": side, "work": "generate", **g}), flush=True)
                load, _ = run_gen(rlstream, model, "0.5b", args.groups, args.redis)
                results[(side, "gen_load")].append(load["tokens_per_s"])
                print(json.dumps({"run": run, "side": side, "work": "gen_load", **load}),
                      flush=True)
        for work in ("generate", "gen_load"):
            b = statistics.median(results[("before", work)])
            a = statistics.median(results[("after", work)])
            print(json.dumps({"work": work, "before_median_tok_s": b, "after_median_tok_s": a,
                              "after_over_before": round(a / b, 4),
                              "before": results[("before", work)],
                              "after": results[("after", work)]}), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", before_tree], cwd=ROOT,
                       check=False)


if __name__ == "__main__":
    sys.exit(main())
