#!/usr/bin/env python3
"""The generator before and after a change, rlstream alone, side by side in one run.

    python benches/gen_ab.py --before REV [--runs 5] [--groups 16] [--redis URL] [--reuse]

Builds revision REV in a scratch git worktree and this tree (release, default features,
one shared target directory), writes Qwen2.5-0.5B's shape with random weights, then runs
both builds interleaved (before, after, before, ...), `--runs` times each:

- `generate`: the sampler alone (the train_scale bench's `generate`), 8 rows x 128 new
  tokens after a 128-token prompt, tokens/s including prefill;
- `gen under load`: one `rlstream gen` process on Redis with `--max-batch 64` (8 groups of
  8 in flight, a new group admitted as one finishes), 32 new tokens, its generated-token
  tokens from the first published group to the `--groups`-th, read off the groups' own
  `finished_us` (see `stream_rate`); benches/gen_load.py's measure, the metrics counter
  over that window, is shown beside it (under full load a scrape can time out for a whole
  run, which reads 0).

Prints every run as a JSON line and, per work, the medians and after/before. The machine's
timings move by 10% and more between runs of one binary (BENCHMARKS.md), which is why the
runs are interleaved and the medians compared. `--reuse` runs the binaries the last
build left in target/gen-ab/ instead of building. Needs Redis on 127.0.0.1:6379 and the
`redis` Python package (scripts/setup-python.sh puts it in .venv).
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


def stream_rate(redis_url, ns, groups):
    """Tokens/s of the first `groups` groups on the run's rollouts stream, from their own
    `finished_us`: the tokens of every group after the first over the time from the first's
    finish to the last's. At 0.5B every row runs to the token limit, so the groups finish in
    waves of 8 and this counts the rest of the first wave too: it reads higher than the
    counter's rate (which starts after the first wave is published), the same way for both
    builds, and never reads 0 when a scrape of the counter timed out."""
    import msgpack
    import redis
    entries = redis.Redis.from_url(redis_url).xrange(f"{ns}:rollouts", count=groups)
    done = []
    for _, fields in entries:
        msg = msgpack.unpackb(fields[b"d"], raw=False)
        tokens = sum(len(s["tokens"]) // 4 for s in msg["samples"])
        done.append((msg["finished_us"], tokens))
    done.sort()
    secs = (done[-1][0] - done[0][0]) / 1e6
    return round(sum(t for _, t in done[1:]) / secs, 2)


def forget(redis_url, ns):
    """Deletes a run's streams."""
    import redis
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(f"{ns}:*"))
    if keys:
        r.delete(*keys)


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
    ap.add_argument("--reuse", action="store_true",
                    help="run the binaries of the last build in target/gen-ab/")
    args = ap.parse_args()
    target = os.path.join(ROOT, "target")
    out = tempfile.mkdtemp(prefix="gen-ab-")
    before_tree = os.path.join(out, "before")
    if not args.reuse:
        subprocess.run(["git", "worktree", "add", "--detach", before_tree, args.before],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    try:
        if args.reuse:
            side = lambda name: tuple(os.path.join(target, "gen-ab", name, b)
                                      for b in ("rlstream", "train_scale"))
            builds = {"before": side("before"), "after": side(os.path.basename(ROOT))}
        else:
            builds = {"before": built(before_tree, target), "after": built(ROOT, target)}
        model = model_dir("0.5b", builds["after"][0], builds["after"][1], out)
        results = {(side, work): [] for side in builds for work in ("generate", "gen_load")}
        for run in range(args.runs):
            for side, (rlstream, bench) in builds.items():
                g = last_json([bench, "generate", model, "128", "128", "8"])
                results[(side, "generate")].append(g["tokens_per_s"])
                print(json.dumps({"run": run, "side": side, "work": "generate", **g}), flush=True)
                load, ns = run_gen(rlstream, model, "0.5b", args.groups, args.redis)
                load["stream_tokens_per_s"] = stream_rate(args.redis, ns, args.groups)
                forget(args.redis, ns)
                results[(side, "gen_load")].append(load["stream_tokens_per_s"])
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
        if not args.reuse:
            subprocess.run(["git", "worktree", "remove", "--force", before_tree], cwd=ROOT,
                           check=False)


if __name__ == "__main__":
    sys.exit(main())
