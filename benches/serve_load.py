#!/usr/bin/env python3
"""The endpoint under load: latency and tokens/s of `rlstream gen --serve` for 1, 8 and 32
concurrent OpenAI clients.

    .venv/bin/python benches/serve_load.py [--sizes small,0.5b] [--clients 1,8,32]
        [--requests N] [--max-tokens T] [--repeat R] [--redis URL] [--features F]
        [--out DIR] [--results FILE] [--rlstream BINARY]

For each size one `rlstream gen --serve` process (release build) serves; for each client
count C, C threads of the real `openai` client (one shared client, as an agent framework
would hold) each send `--requests` streamed `/v1/completions` calls one after another, with
prompts of the built-in `sort` task. Per call: the time to the first token and to the last
byte; per run: p50 and p99 of both over all calls, and completion tokens per second (all
calls' tokens over the run's wall time). Beside each run, one call with `n` = C rows
(no per-call cost: one HTTP request, one prefill) gives the decoder's own tokens/s for the
same batch size. Each call's tokens, versions and log-probs are checked to be present and
of one length. The CPU time the generator process and this client spent per call (from
/proc and `os.times`) shows which side bounds a run where the model is cheap.

Sizes: `small` is a warm-started `sort` model (`rlstream sft`, real completion lengths: rows
end at their stop token); `0.5b` is Qwen2.5-0.5B's shape with random weights and the Qwen3
tokenizer from tests/fixtures (every row runs to `--max-tokens`). Needs Redis on
127.0.0.1:6379 (the generator also joins its prompt stream, which stays empty) and the
`openai` package (scripts/setup-python.sh installs it in .venv). Results are printed and
written to benches/results/serve_load.json.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

import openai

from pipeline_05b import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_dir(size, rlstream, scale, out):
    d = os.path.join(out, size)
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    if size == "small":
        subprocess.run([rlstream, "sft", "--task", "sort", "--out", d, "--steps", "400"],
                       check=True, stdout=subprocess.DEVNULL)
        return d
    if scale is None:
        raise SystemExit(f"no model in {d}: run once without --rlstream to write it")
    subprocess.run([scale, "write", "0.5b", d], check=True, stdout=subprocess.DEVNULL)
    tok = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "qwen3")
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tok, name), d)
    return d


def prompts(n):
    """Prompts of the built-in `sort` task: 3 to 6 digits to sort."""
    import random
    rng = random.Random(7)
    return [
        "sort:" + "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6))) + "="
        for _ in range(n)
    ]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def cpu_s(pid):
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(client, model, clients, requests, max_tokens, server_pid):
    calls, lock = [], threading.Lock()
    texts = prompts(clients * requests)

    def worker(k):
        for r in range(requests):
            t0 = time.perf_counter()
            first, tokens, versions, logprobs = None, 0, 0, 0
            stream = client.completions.create(
                model=model, prompt=texts[k * requests + r], max_tokens=max_tokens, stream=True)
            for chunk in stream:
                for c in chunk.choices:
                    rl = (c.model_extra or {}).get("rlstream", {})
                    if rl.get("token_ids") and first is None:
                        first = time.perf_counter() - t0
                    tokens += len(rl.get("token_ids", []))
                    versions += len(rl.get("versions", []))
                    logprobs += len(rl.get("logprobs", []))
            assert tokens > 0 and tokens == versions == logprobs, (tokens, versions, logprobs)
            with lock:
                calls.append({"first_s": first, "total_s": time.perf_counter() - t0,
                              "tokens": tokens})

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    server0, client0 = cpu_s(server_pid), sum(os.times()[:2])
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    server, client_cpu = cpu_s(server_pid) - server0, sum(os.times()[:2]) - client0
    tokens = sum(c["tokens"] for c in calls)
    return {
        "server_cpu_ms_per_call": round(1000 * server / len(calls), 2),
        "client_cpu_ms_per_call": round(1000 * client_cpu / len(calls), 2),
        "clients": clients,
        "calls": len(calls),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "first_token_p50_s": round(pct([c["first_s"] for c in calls], 0.5), 4),
        "first_token_p99_s": round(pct([c["first_s"] for c in calls], 0.99), 4),
        "latency_p50_s": round(pct([c["total_s"] for c in calls], 0.5), 4),
        "latency_p99_s": round(pct([c["total_s"] for c in calls], 0.99), 4),
        "tokens_per_call_mean": round(statistics.mean(c["tokens"] for c in calls), 1),
    }


def one_call(client, model, n, max_tokens):
    """The same rows in one call (`n` = the client count): the endpoint without the cost of
    many calls, side by side with them."""
    t0 = time.perf_counter()
    r = client.completions.create(model=model, prompt=prompts(1)[0], n=n, max_tokens=max_tokens)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.model_extra["rlstream"]["token_ids"]) for c in r.choices)
    return {"one_call_n": n, "one_call_tokens": tokens,
            "one_call_tokens_per_s": round(tokens / wall, 1)}


def wait_up(addr, proc, log):
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gen exited:\n{open(log).read()}")
        try:
            urllib.request.urlopen(f"http://{addr}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the endpoint never came up")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,0.5b")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests", type=int, default=0,
                    help="calls per client (0: 16 for small, 4 for 0.5b at 1 client, scaled down)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379")
    ap.add_argument("--features", default="", help="cargo features of the build")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each client count, each beside its own one call (a machine "
                    "shared with others moves single runs by 10-20%%)")
    ap.add_argument("--rlstream", default=None,
                    help="a built binary to serve with instead of this tree's release build "
                    "(another commit's, side by side); the 0.5b model must be in --out already")
    ap.add_argument("--out", default=None, help="where models and logs go (kept between runs)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benches", "results", "serve_load.json"),
                    help="where the raw lines are written")
    args = ap.parse_args()
    if args.rlstream:
        rlstream, scale = args.rlstream, None
    else:
        rlstream, scale = build(("--features", args.features) if args.features else ())
    out = args.out or tempfile.mkdtemp(prefix="serve-load-")
    results = []
    for size in args.sizes.split(","):
        d = model_dir(size, rlstream, scale, out)
        port = 18500 + len(results)
        addr = f"127.0.0.1:{port}"
        log = os.path.join(out, f"gen-{size}.log")
        ns = f"serve-load-{os.getpid()}-{size}"
        cmd = [rlstream, "gen", "--model", d, "--serve", str(port), "--max-batch", "64",
               "--serve-max-requests", "64", "--redis", args.redis, "--namespace", ns]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
        try:
            wait_up(addr, proc, log)
            client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="none",
                                   max_retries=0, timeout=600)
            model = os.path.basename(d)
            one_run(client, model, 1, 2, args.max_tokens, proc.pid)  # warm-up
            for c in [int(x) for x in args.clients.split(",")]:
                per = args.requests or max(2, (16 if size == "small" else 4) * 8 // max(c, 8))
                shares = []
                for _ in range(args.repeat):
                    r = one_run(client, model, c, per, args.max_tokens, proc.pid)
                    r.update({"size": size, "max_tokens": args.max_tokens})
                    r.update(one_call(client, model, c, args.max_tokens))
                    r["share"] = round(r["tokens_per_s"] / r["one_call_tokens_per_s"], 3)
                    shares.append(r["share"])
                    print(json.dumps(r), flush=True)
                    results.append(r)
                if args.repeat > 1:
                    print(f"{size}, {c} clients: median share of one call "
                          f"{statistics.median(shares):.3f} over {args.repeat} runs "
                          f"({', '.join(f'{x:.3f}' for x in shares)})", flush=True)
        finally:
            proc.terminate()
            proc.wait()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    path = args.results
    with open(path, "w") as f:
        json.dump({"machine": machine, "features": args.features, "runs": results}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
