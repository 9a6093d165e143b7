#!/usr/bin/env python3
"""Generation where RL runs it: tokens/s of `rlstream gen` under a steady stream of groups
(G = 8, 64 rows in flight), against the same work in PyTorch with a plain batched loop.

    python benches/gen_load.py [--sizes small,0.5b] [--groups N] [--redis URL]

For each size, `rlstream feed` queues prompts of the built-in `sort` task and one
`rlstream gen` process decodes them, 8 groups of 8 at a time, admitting a new group as soon
as one finishes (no trainer: the in-flight bound is set high so that only `--max-batch 64`
limits it). Its rate is the `rlstream_tokens_total{kind="generated"}` counter over the
time from the first published group to the `--groups`-th (the ramp-up of the first wave is
left out). PyTorch then generates the same prompts, read back from the rollouts stream,
in batches of 8 prompts x 8 samples, each batch until every row has stopped (the task's stop
tokens, read off the rollouts) or reached the token limit, and is timed over all batches.

Sizes: `small` is the warm-started model of `rlstream sft --task sort` (real completion
lengths, so rows finish at different times); `0.5b` is Qwen2.5-0.5B's shape with random
weights and the Qwen3 tokenizer from tests/fixtures (every row runs to the limit). PYTHON
(default: this interpreter) must have torch, transformers, msgpack and redis; Redis must run
on 127.0.0.1:6379. Each process runs on its own, one after another.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from pipeline_05b import build, peak_kb, scrape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, GROUP = 64, 8
# (max new tokens, sft steps, groups timed) per size.
SIZES = {"small": (64, 400, 5000), "0.5b": (32, 0, 24)}


def model_dir(size, rlstream, scale, out):
    d = os.path.join(out, size)
    if size == "small":
        subprocess.run([rlstream, "sft", "--task", "sort", "--out", d,
                        "--steps", str(SIZES[size][1])], check=True, stdout=subprocess.DEVNULL)
        return d
    subprocess.run([scale, "write", "0.5b", d], check=True, stdout=subprocess.DEVNULL)
    tok = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "qwen3")
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tok, name), d)
    return d


def generated(addr):
    try:
        text = scrape(addr)
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith("rlstream_tokens_total{") and 'kind="generated"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_gen(rlstream, model, size, groups, redis_url):
    """The gen process's tokens/s, peak memory and the namespace its rollouts are in."""
    new = SIZES[size][0]
    ns = f"genload-{size}-{os.getpid()}-{time.monotonic_ns()}"
    common = ["--redis", redis_url, "--namespace", ns]
    subprocess.run([rlstream, "feed", "--task", "sort", "--count", str(groups + ROWS // GROUP)]
                   + common, check=True, stdout=subprocess.DEVNULL)
    addr = "127.0.0.1:9531"
    cmd = [rlstream, "gen", "--model", model, "--group-size", str(GROUP),
           "--max-batch", str(ROWS), "--max-new-tokens", str(new),
           "--groups-per-step", "1000", "--max-lag", "100", "--metrics-addr", addr] + common
    log = open(os.path.join(os.path.dirname(model), f"gen-{size}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    first = last = None
    peak = 0
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            peak = max(peak, peak_kb(proc.pid) or 0)
            tokens = generated(addr)
            if not tokens:
                continue
            now = time.perf_counter()
            if first is None:
                first = (now, tokens)
            last = (now, tokens)
            if published(redis_url, ns) >= groups:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if proc.returncode not in (0, -15) and first is None:
        sys.exit(f"gen failed; see {log.name}")
    secs, tokens = last[0] - first[0], last[1] - first[1]
    return {"tokens": tokens, "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 2),
            "peak_rss_mb": round(peak / 1024)}, ns


def published(redis_url, ns):
    import redis
    return redis.Redis.from_url(redis_url).xlen(f"{ns}:rollouts")


def u32s(b):
    return list(struct.unpack(f"<{len(b) // 4}I", b))


def rollouts(redis_url, ns, groups):
    """The first `groups` groups' prompts, and the stop tokens (the last token of every
    sample that finished on one)."""
    import msgpack
    import redis
    entries = redis.Redis.from_url(redis_url).xrange(f"{ns}:rollouts", count=groups)
    prompts, stops = [], set()
    for _, fields in entries:
        msg = msgpack.unpackb(fields[b"d"], raw=False)
        prompts.append(u32s(msg["prompt_tokens"]))
        for s in msg["samples"]:
            if s["finish"] == "stop":
                stops.add(u32s(s["tokens"])[-1])
    return prompts, sorted(stops)


def run_torch(python, model, size, prompts, stops):
    job = json.dumps({"model": model, "prompts": prompts, "stops": stops,
                      "new": SIZES[size][0], "group": GROUP, "rows": ROWS})
    out = subprocess.run([python, __file__, "--torch-side"], input=job, check=True,
                         stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def torch_side():
    """PyTorch: the prompts in batches of ROWS rows (each prompt GROUP times), left-padded,
    sampled at temperature 1 until every row has stopped or reached `new` tokens."""
    import resource
    import torch
    import transformers
    job = json.load(sys.stdin)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    model.eval()
    per = job["rows"] // job["group"]
    stops = torch.tensor(job["stops"] or [-1])
    tokens, t = 0, time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(job["prompts"]), per):
            rows = [p for p in job["prompts"][b:b + per] for _ in range(job["group"])]
            width = max(len(p) for p in rows)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            done = torch.zeros(len(rows), dtype=torch.bool)
            for step in range(job["new"]):
                tok = torch.multinomial(torch.softmax(logits, -1), 1)
                tokens += int((~done).sum())
                done |= torch.isin(tok[:, 0], stops)
                if bool(done.all()) or step == job["new"] - 1:
                    break
                mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], -1)
                pos = pos[:, -1:] + 1
                out = model(input_ids=tok, attention_mask=mask, position_ids=pos,
                            past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[:, -1].float()
    secs = time.perf_counter() - t
    print(json.dumps({"tokens": tokens, "seconds": round(secs, 2),
                      "tokens_per_s": round(tokens / secs, 2),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


def main():
    if sys.argv[1:] == ["--torch-side"]:
        return torch_side()
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,0.5b")
    ap.add_argument("--groups", type=int, default=None,
                    help="groups per run (default: 5000 small, 24 at 0.5b)")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379")
    args = ap.parse_args()
    python = os.environ.get("PYTHON", sys.executable)
    rlstream, scale = build(features=())
    results = []
    with tempfile.TemporaryDirectory() as out:
        for size in args.sizes.split(","):
            model = model_dir(size, rlstream, scale, out)
            groups = args.groups or SIZES[size][2]
            ours, ns = run_gen(rlstream, model, size, groups, args.redis)
            prompts, stops = rollouts(args.redis, ns, groups)
            theirs = run_torch(python, model, size, prompts, stops)
            print(json.dumps({"size": size, "rlstream": ours, "torch": theirs}), file=sys.stderr)
            results.append((size, groups, ours, theirs))
    print(f"G = {GROUP}, {ROWS} rows in flight; PyTorch "
          f"{results[0][3]['torch']} on {results[0][3]['threads']} threads, f32")
    print("| size | groups | new tokens at most | rlstream gen | PyTorch batched loop | ratio "
          "| rlstream peak RSS | PyTorch peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for size, groups, o, t in results:
        print(f"| {size} | {groups} | {SIZES[size][0]} | {o['tokens_per_s']:.1f} tok/s "
              f"| {t['tokens_per_s']:.1f} tok/s | {o['tokens_per_s'] / t['tokens_per_s']:.2f}x "
              f"| {o['peak_rss_mb'] / 1024:.2f} GB | {t['peak_rss_mb'] / 1024:.2f} GB |")


if __name__ == "__main__":
    main()
