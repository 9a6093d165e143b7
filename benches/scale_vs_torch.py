#!/usr/bin/env python3
"""rlstream against PyTorch at two sizes, side by side in one run: the step time and the
peak resident memory of one PPO step (forward, backward, AdamW), with and without
micro-batching, on the same checkpoint and the same batch; and (`--parts gen`) the time and
peak memory of loading the checkpoint, f32 and bf16, and generation tokens/s from each file
(0.5b: prompt 128, 8 and 64 rows x 128 new tokens; small: prompt 16, 32 x 128): rlstream
holds a bf16 file's linear weights in 16 bits, PyTorch computes in bf16. The generation rows
also run llama.cpp (benches/llama_cpp.py: built once from the llama-cpp-python sdist, the
same weights converted to GGUF F32 and BF16 by its own converter, `llama-batched-bench`;
`--no-llama-cpp` leaves it out), and give rlstream's achieved FLOP rate as a share of the
measured FMA peak and the bytes its decode steps must read (every weight once a step, each
row's KV cache) per second as a share of the measured read bandwidth.

    python benches/scale_vs_torch.py [--sizes small,smollm2,0.5b] [--steps 4] [--runs 5]
                                     [--features blas] [--parts train,gen] [--flex]
                                     [--against blas] [--no-llama-cpp]

`--against FEATURES` also runs the training steps and each size's first generation shape
with those cargo features and prints the ratio of the build given by `--features` (default:
the default build) to that one.
Each process is stopped after `--limit` seconds (default 1800); its row says so.

PYTHON (default: this interpreter) must have torch and transformers. Sizes: `small` (0.8M
parameters, 32 x 64 tokens; micro-batches of 512 tokens), `smollm2` (the real
SmolLM2-135M-Instruct that `scripts/smollm2.py` converts into target/smollm2, 8 x 96
tokens; micro-batches of 192) and `0.5b` (Qwen2.5-0.5B's shape, 494M parameters, 8 x 96
tokens; micro-batches of 192 tokens). The 0.5b run needs about 16 GB of memory and several
minutes. Each measurement runs in its own process, one after another; the training step
runs `--runs` times on each side, alternating (rlstream, PyTorch, rlstream, ...), and each
side's row is the median of its runs' step times (each run's own median over `--steps`;
four by default, since rlstream's first step after the warm-up runs slower while its
allocator grows to the step's peak).
Ratios above 1 mean rlstream is faster (time) or smaller (memory).

The training rows also give each step's achieved FLOP rate (the step's multiply-adds counted
from the model's shape: every linear layer and attention's products forward, twice that
backward, the head only at completion positions for rlstream and at every position for
PyTorch) as a share of the cores' f32 FMA peak, which `train_scale -- peak` measures with a
short loop on all cores first.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MICRO = {"small": 512, "smollm2": 192, "0.5b": 192}


FEATURES = []
# The build the first is compared with (`--against`), or None.
AGAINST = None
LIMIT_S = 1800


def last_json(cmd, **kw):
    """The last line of `cmd`'s output as JSON, or {"stopped_s": LIMIT_S} when it ran past
    the limit."""
    try:
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                             timeout=LIMIT_S, **kw)
    except subprocess.TimeoutExpired:
        return {"stopped_s": LIMIT_S}
    return json.loads(out.stdout.strip().splitlines()[-1])


def rust(*args, features=None):
    features = FEATURES if features is None else features
    return last_json(
        ["cargo", "bench", "--quiet", *features, "--bench", "train_scale", "--", *args],
        cwd=ROOT,
    )


def against(*args):
    """The same rlstream row in the `--against` build, or None."""
    return rust(*args, features=["--features", AGAINST]) if AGAINST else None


def torch_step(python, ckpt, micro, steps):
    return last_json(
        [python, str(ROOT / "benches" / "torch_train_step.py"), ckpt, str(micro), str(steps)]
    )


# (prompt, new tokens, rows) per size: 0.5b at 8 rows (one group) and 64 (eight groups in
# flight, the RL load).
GEN = {"small": [(16, 128, 32)], "smollm2": [(128, 128, 8), (128, 128, 64)],
       "0.5b": [(128, 128, 8), (128, 128, 64)]}
# (groups, samples per group, prompt, completion) of the fixed training batch, as
# train_scale and torch_train_step.py build it (by vocabulary: small below 1,000 ids).
BATCH = {"small": (4, 8, 16, 48), "smollm2": (1, 8, 32, 64), "0.5b": (1, 8, 32, 64)}


def config_params(ckpt):
    """Parameters of a tied-embedding Llama checkpoint without biases, from its config."""
    c = json.loads((pathlib.Path(ckpt) / "config.json").read_text())
    d, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or d // heads
    block = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * f + 2 * d
    return c["vocab_size"] * d + layers * block + d


def step_flops(ckpt, size, torch_side):
    """Multiply-adds x 2 of one training step on `size`'s batch: forward products (every
    linear layer, attention's two products over the causal half, the head at completion
    positions, or at every position for `torch_side`), the backward twice the forward."""
    c = json.loads((pathlib.Path(ckpt) / "config.json").read_text())
    d, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or d // heads
    vocab = c["vocab_size"]
    groups, per, prompt, completion = BATCH[size]
    seqs, length = groups * per, prompt + completion
    tokens = seqs * length
    linear = layers * (d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * f)
    attention = layers * seqs * heads * hd * length * (length + 1)  # q.k and p.v, causal
    head_rows = tokens if torch_side else seqs * completion
    forward = 2 * (linear * tokens + attention + d * vocab * head_rows)
    return 3 * forward


def gen_work(ckpt, prompt, new, rows, dtype):
    """(FLOPs, bytes read) of generating `rows` x `new` tokens after `prompt`: every linear
    layer at each prompt and generated position, the head at each row's last prompt
    position and every generated one, attention's two products over the positions before;
    a decode step reads every weight once (2 bytes each from a bf16 file) and each row's
    f32 KV cache, the prefill reads the weights once."""
    c = json.loads((pathlib.Path(ckpt) / "config.json").read_text())
    d, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or d // heads
    linear = layers * (d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * f)
    head = d * c["vocab_size"]
    positions = prompt + new - 1
    attention = layers * heads * hd * positions * (positions + 1)
    flops = 2 * rows * (linear * positions + head * new + attention)
    width = 2 if dtype == "bfloat16" else 4
    cache = sum(2 * layers * kv * hd * 4 * p for p in range(prompt, positions))
    return flops, new * (linear + head) * width + rows * cache


def torch_gen_load(python, *args):
    return last_json([python, str(ROOT / "benches" / "torch_gen_load.py"), *args])


def llama_cpp(python, *args):
    """A row from benches/llama_cpp.py, or {"skipped": why} when llama.cpp could not run."""
    try:
        return last_json([python, str(ROOT / "benches" / "llama_cpp.py"), *args])
    except subprocess.CalledProcessError:
        return {"skipped": f"llama.cpp {args[0]} failed (its error is on stderr)"}


def gen_rows(python, size, ckpt, flex, llama):
    """Load (f32 and bf16 files) and generation, rlstream and PyTorch (and with `llama`,
    llama.cpp on the same weights converted to GGUF F32 and BF16), one process each; with
    `flex`, also rlstream's generation on Flex (the sampler before the trainer's kernels)."""
    bf16 = ckpt + "-bf16"
    rust("bf16", ckpt, bf16)
    ggufs = {}
    if llama:
        for dtype, outtype in (("float32", "f32"), ("bfloat16", "bf16")):
            ggufs[dtype] = f"{ckpt}-{outtype}.gguf"
            done = llama_cpp(python, "convert", ckpt, outtype, ggufs[dtype])
            if "skipped" in done:
                ggufs[dtype] = done
    out = []
    for dtype, path in (("float32", ckpt), ("bfloat16", bf16)):
        ours = rust("load", path)
        theirs = torch_gen_load(python, "load", path, dtype)
        out.append(("load", dtype, ours, theirs, None, None, None))
        print(json.dumps({"rlstream": ours, "torch": theirs}), file=sys.stderr)
    for prompt, new, rows in GEN[size]:
        shape = (str(prompt), str(new), str(rows))
        work = f"generate {rows} x {new} after {prompt}"
        for dtype, path in (("float32", ckpt), ("bfloat16", bf16)):
            ours = rust("generate", path, *shape)
            # Generation runs no BLAS in either build: the first shape of a size is enough.
            other = against("generate", path, *shape) if rows == GEN[size][0][2] else None
            before = (rust("generate-flex", path, *shape, features=FEATURES + ["--features", "flex"])
                      if flex and dtype == "float32" else None)
            theirs = torch_gen_load(python, "generate", path, dtype, *shape)
            gguf = ggufs.get(dtype)
            lcpp = (gguf if isinstance(gguf, dict) else llama_cpp(python, "generate", gguf, *shape)
                    if gguf else None)
            out.append((work, dtype, ours, theirs, other, lcpp,
                        gen_work(ckpt, *map(int, shape), dtype)))
            if before:
                out.append((work + " (Flex, the sampler before)", dtype, before, theirs, None,
                            None, None))
            print(json.dumps({"rlstream": ours, "against": other, "flex": before,
                              "torch": theirs, "llama.cpp": lcpp}), file=sys.stderr)
    return out


def median_run(runs):
    """The run whose step time is the median of `runs` (the lower middle for an even count)."""
    done = sorted((r for r in runs if "step_s" in r), key=lambda r: r["step_s"])
    return done[(len(done) - 1) // 2] if done else runs[0]


def speed(o, t, key, fmt, higher):
    """`| ours | theirs | ratio ` of one measure (`higher`: tokens/s, else seconds)."""
    cell = lambda m: f"stopped after {m['stopped_s'] // 60} min" if "stopped_s" in m else fmt(m[key])
    if "stopped_s" in o or "stopped_s" in t:
        ratio = ""
    else:
        ratio = f"{(o[key] / t[key]) if higher else (t[key] / o[key]):.2f}x"
    return f"| {cell(o)} | {cell(t)} | {ratio} "


def gb(m):
    return f"{m['peak_rss_mb'] / 1024:.2f} GB" if "peak_rss_mb" in m else ""


def main():
    global AGAINST, LIMIT_S
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,0.5b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5,
                    help="training: alternating runs of each side; each row is their median")
    ap.add_argument("--features", default="", help="cargo features for rlstream (e.g. blas)")
    ap.add_argument("--no-micro", action="store_true", help="one pass only")
    ap.add_argument("--parts", default="train", help="train, gen or train,gen")
    ap.add_argument("--flex", action="store_true",
                    help="gen: also generate on Flex, the sampler before the trainer's kernels")
    ap.add_argument("--against", default=None,
                    help="also run rlstream with these cargo features, and print the ratio")
    ap.add_argument("--no-llama-cpp", action="store_true",
                    help="gen: leave llama.cpp out (it is built once into target/llama.cpp)")
    ap.add_argument("--limit", type=int, default=LIMIT_S, help="seconds per process")
    args = ap.parse_args()
    AGAINST, LIMIT_S = args.against, args.limit
    if args.features:
        FEATURES.extend(["--features", args.features])
    python = os.environ.get("PYTHON", sys.executable)
    parts = args.parts.split(",")
    rows, gens = [], []
    machine = rust("peak")
    peak = machine["peak_gflops"]
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if size == "smollm2":
                ckpt = os.environ.get("RLSTREAM_SMOLLM2", str(ROOT / "target" / "smollm2"))
                info = {"params": config_params(ckpt)}
            else:
                ckpt = str(pathlib.Path(tmp) / size)
                info = rust("write", size, ckpt)
            if "gen" in parts:
                gens += [(size, *g) for g in gen_rows(python, size, ckpt, args.flex,
                                                      not args.no_llama_cpp)]
            for micro in ((0,) if args.no_micro else (0, MICRO[size])) if "train" in parts else ():
                runs = []
                for _ in range(args.runs):
                    ours = rust("step", ckpt, str(micro), str(args.steps))
                    theirs = torch_step(python, ckpt, micro, args.steps)
                    runs.append((ours, theirs))
                    print(json.dumps({"size": size, "rlstream": ours, "torch": theirs}),
                          file=sys.stderr, flush=True)
                other = against("step", ckpt, str(micro), str(args.steps))
                ours, theirs = median_run([r[0] for r in runs]), median_run([r[1] for r in runs])
                flops = (step_flops(ckpt, size, False), step_flops(ckpt, size, True))
                rows.append((size, info["params"], micro, ours, theirs, other, runs, flops))
    print(f"rlstream features: {args.features or 'default'}")
    if gens:
        print(f"f32 FMA peak {machine['peak_gflops']:.1f} GFLOP/s, read bandwidth "
              f"{machine['read_gbs']:.1f} GB/s (train_scale peak)")
        print("| size | work | weights | rlstream | PyTorch | ratio | llama.cpp | ratio "
              "| rlstream FLOP rate | rlstream bytes read | rlstream peak RSS "
              "| PyTorch peak RSS (before loading) | llama.cpp peak RSS |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for size, work, dtype, o, t, _, lcpp, done in gens:
            base = f" ({t['base_rss_mb'] / 1024:.2f} GB)" if "base_rss_mb" in t else ""
            if work == "load":
                cells = speed(o, t, "load_s", lambda v: f"{v:.2f} s", False)
                print(f"| {size} | {work} | {dtype} file {cells}| | | | | {gb(o)} "
                      f"| {gb(t)}{base} | |")
                continue
            tok = lambda v: f"{v:.1f} tok/s"
            cells = speed(o, t, "tokens_per_s", tok, True)
            if lcpp and "skipped" not in lcpp:
                # speed() gives `| ours | theirs | ratio `: llama.cpp's cells are the last two.
                theirs = "| " + speed(o, lcpp, "tokens_per_s", tok, True).split("| ", 2)[2]
            else:
                theirs = f"| {lcpp['skipped'] if lcpp else ''} | "
            rate = read = ""
            if done and "seconds" in o:
                flops, nbytes = done
                rate = (f"{flops / o['seconds'] / 1e9:.0f} GFLOP/s "
                        f"({flops / o['seconds'] / 1e9 / machine['peak_gflops']:.0%})")
                read = (f"{nbytes / o['seconds'] / 1e9:.1f} GB/s "
                        f"({nbytes / o['seconds'] / 1e9 / machine['read_gbs']:.0%})")
            weights = f"{dtype} file, computed in {dtype} by PyTorch"
            print(f"| {size} | {work} | {weights} {cells}{theirs}| {rate} | {read} | {gb(o)} "
                  f"| {gb(t)}{base} | {gb(lcpp) if lcpp else ''} |")
    if AGAINST:
        print(f"\n{args.features or 'default'} build against `--features {AGAINST}`, "
              "same rows (ratio above 1: the first is faster):")
        print("| size | work | weights | first | against | ratio |")
        print("|---|---|---|---|---|---|")
        for size, work, dtype, o, _, other, *_ in [g for g in gens if g[1] != "load"]:
            if other:
                cells = speed(o, other, "tokens_per_s", lambda v: f"{v:.1f} tok/s", True)
                print(f"| {size} | {work} | {dtype} {cells}|")
        for size, _, micro, o, _, other, *_ in rows:
            cells = speed(o, other, "step_s", lambda v: f"{v:.3f} s", False)
            print(f"| {size} | train step, {micro or 'one pass'} | float32 {cells}|")
    if not rows:
        return
    print(f"PyTorch {rows[0][4]['torch']} on {rows[0][4]['threads']} threads; "
          f"f32 FMA peak {peak:.1f} GFLOP/s (train_scale peak)")
    print("| size | params | micro-batch tokens | rlstream step (median) | PyTorch step (median) "
          "| speed ratio | rlstream FLOP rate | PyTorch FLOP rate | rlstream peak RSS "
          "| PyTorch peak RSS | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, params, micro, o, t, _, runs, (fo, ft) in rows:
        rate = lambda flops, m: f"{flops / m['step_s'] / 1e9:.0f} GFLOP/s ({flops / m['step_s'] / 1e9 / peak:.0%})"
        print(f"| {size} | {params / 1e6:.1f}M | {micro or 'one pass'} | {o['step_s']:.3f} s "
              f"| {t['step_s']:.3f} s | {t['step_s'] / o['step_s']:.2f}x | {rate(fo, o)} "
              f"| {rate(ft, t)} | {o['peak_rss_mb'] / 1024:.2f} GB "
              f"| {t['peak_rss_mb'] / 1024:.2f} GB | {t['peak_rss_mb'] / o['peak_rss_mb']:.2f}x |")
    print("\nEach run's step time (rlstream / PyTorch), in the order they ran:")
    for size, _, micro, _, _, _, runs, _ in rows:
        cells = ", ".join(f"{o.get('step_s', '-')} / {t.get('step_s', '-')}" for o, t in runs)
        print(f"- {size}, {micro or 'one pass'}: {cells}")


if __name__ == "__main__":
    main()
