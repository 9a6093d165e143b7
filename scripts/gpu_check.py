#!/usr/bin/env python3
"""The GPU check behind scripts/gpu-check.sh: parity, generation, training, host traffic and
NCCL with binaries built with `--features cuda`, on a machine that has CUDA, PyTorch and
transformers but no Rust toolchain, all within one time budget (--budget-s, 600 by default).
It makes its own model with PyTorch (random weights, Qwen2.5-0.5B's shape, or the small
config with --size small), then:

1. fixtures: greedy continuations of the committed tiny models (tests/fixtures/models, each
   with transformers' own continuation) from `rlstream generate`;
2. parity: greedy continuations and their log-probs from `rlstream generate --json` against
   transformers on the same device, for a few prompts;
3. transfers: the bytes that cross between host and device in a training step and a decode
   step (the bench binary's `transfers`, counted inside the backend): statistics, the
   batch and the sampler's logits, never a copy of the model;
4. load and generation: the bench binary's `load` and `generate` (prompt 128, 8 rows x 128
   new tokens) against a lean PyTorch KV-cache loop (benches/torch_gen_load.py), float32 and
   bfloat16;
5. training: the bench binary's `step` (forward, backward, AdamW) for a few steps against
   benches/torch_train_step.py;
6. nccl: one NCCL rank's all-reduce of a model's worth of gradients (the bench's `nccl`),
   from host buffers and in place in the backend's CUDA memory (`--grad-buffers`).

    python3 scripts/gpu_check.py --bin dist/rlstream --bench-bin dist/train_scale [--size 0.5b]

`--rehearse` runs the same flow without PyTorch, on whatever backend the binaries were built
for (CI: the `wgpu` build on Mesa's lavapipe): the model comes from the bench's `write`, the
PyTorch comparisons are left out, and the fixtures, transfers and timings run as on the GPU.

Each result is printed as a JSON line and written to OUT/gpu-check.json (OUT: $OUT, or
--out). A part that fails or runs out of the budget is recorded as such; the exit status is
non-zero if any did.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "models"
SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=32768, rope_theta=1000000.0),
    "small": dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rope_theta=10000.0),
}


def num_params(shape):
    """Parameters of a Qwen2 shape with a tied head (494,032,768 for 0.5b): the NCCL
    all-reduce's size."""
    d, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    kv_dim = d // heads * kv
    layer = (d * d + d) + 2 * (d * kv_dim + kv_dim) + d * d + 3 * d * shape["intermediate_size"] + 2 * d
    return shape["vocab_size"] * d + shape["num_hidden_layers"] * layer + d


class OutOfTime(Exception):
    pass


class Deadline:
    """The check's time budget: every command gets what is left of it."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        left = self.end - time.monotonic()
        if left <= 1:
            raise OutOfTime()
        return left


DEADLINE = Deadline(600)


def run(*cmd, env=None):
    try:
        out = subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, **(env or {})},
                             timeout=DEADLINE.left())
    except subprocess.TimeoutExpired as e:
        raise OutOfTime() from e
    return out.stdout


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def make_model(size, path):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**SHAPES[size], tie_word_embeddings=True, rms_norm_eps=1e-6,
                                   use_sliding_window=False)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(path, safe_serialization=True)
    return cfg.vocab_size


def fixtures(bin_path):
    """Greedy continuations of every committed fixture model against transformers'."""
    agree, total, models = 0, 0, []
    for d in sorted(p for p in FIXTURES.iterdir() if (p / "reference.json").exists()):
        ref = json.loads((d / "reference.json").read_text())
        want = ref["greedy_continuation"]
        doc = last_json(run(bin_path, "generate", "--model", d, "--prompt-ids",
                            ",".join(map(str, ref["greedy_prompt"])), "--temperature", 0,
                            "--max-new-tokens", len(want), "--json"))
        c = doc["completions"][0]
        # generate stops at the model's end-of-sequence id; the reference runs on past it.
        got, want = c["ids"], want if c["finish"] != "stop" else want[:len(c["ids"])]
        same = sum(int(a == b) for a, b in zip(got, want))
        agree += same
        total += len(want)
        models.append({"model": d.name, "agree": same, "of": len(want)})
    return {"check": "fixtures", "models": models, "greedy_agreement": agree / max(total, 1),
            "ok": agree == total}


def parity(bin_path, path, device, vocab, prompts=4, new=16):
    """Sampled tokens' log-probs (temperature 1) against transformers' log-softmax at the
    same positions, and greedy tokens against transformers' argmax along the same sequence."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to(device).eval()
    worst, agree, total = 0.0, 0, 0
    for p in range(prompts):
        ids = [(p * 131 + j * 17 + 1) % vocab for j in range(16)]

        def ours(temperature):
            doc = last_json(run(bin_path, "generate", "--model", path, "--prompt-ids",
                                ",".join(map(str, ids)), "--temperature", temperature,
                                "--max-new-tokens", new, "--seed", p, "--json"))
            return doc["completions"][0]

        @torch.inference_mode()
        def reference(tokens):
            seq = torch.tensor([ids + tokens], device=device)
            logits = model(input_ids=seq).logits[0].float()
            return torch.log_softmax(logits[len(ids) - 1:len(ids) - 1 + len(tokens)], -1)

        sampled = ours(1)
        ref = reference(sampled["ids"])
        for i, (t, lp) in enumerate(zip(sampled["ids"], sampled["logprobs"])):
            worst = max(worst, abs(ref[i, t].item() - lp))
        greedy = ours(0)["ids"]
        ref = reference(greedy)
        for i, t in enumerate(greedy):
            total += 1
            agree += int(ref[i].argmax().item() == t)
    return {"check": "parity", "prompts": prompts, "greedy_tokens": total,
            "greedy_agreement": agree / max(total, 1), "max_abs_logprob_diff": worst,
            "ok": worst < 1e-3 and agree / max(total, 1) > 0.95}


def transfers(bench_bin, path):
    """Host traffic of a training step and a decode step: each a small fraction of the
    model's bytes, the decode step's reads the logits and little more."""
    r = last_json(run(bench_bin, "transfers", path))
    train, decode = r["train_step"], r["decode_step"]
    moved = train["read_bytes"] + train["write_bytes"]
    r["check"] = "transfers"
    r["train_share_of_model"] = round(moved / r["param_bytes"], 6)
    r["ok"] = (moved < r["param_bytes"] / 20
               and decode["read_bytes"] <= r["decode_logit_bytes"] + 4096
               and decode["write_bytes"] <= 64 * 1024)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="rlstream built with --features cuda")
    ap.add_argument("--bench-bin", required=True, help="the train_scale bench binary, same build")
    ap.add_argument("--size", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=600,
                    help="the whole check's time limit (default ten minutes)")
    ap.add_argument("--rehearse", action="store_true",
                    help="the flow without PyTorch, on the binaries' own backend")
    args = ap.parse_args()
    global DEADLINE
    DEADLINE = Deadline(args.budget_s)
    started = time.monotonic()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / f"model-{args.size}"
    results = []

    def report(r):
        results.append(r)
        print(json.dumps(r), flush=True)
        (out / "gpu-check.json").write_text(json.dumps(results, indent=1))

    def part(name, f):
        t = time.monotonic()
        try:
            r = f()
        except OutOfTime:
            r = {"check": name, "ok": False, "error": f"out of the {args.budget_s:.0f} s budget"}
        except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as e:
            r = {"check": name, "ok": False, "error": str(e)}
        r.setdefault("ok", True)
        r["seconds"] = round(time.monotonic() - t, 1)
        report(r)
        return r

    if args.rehearse:
        device, vocab = "rehearsal", SHAPES[args.size]["vocab_size"]
        report({"check": "machine", "device": device, "bin": str(args.bin)})

        def write():
            run(args.bench_bin, "write", args.size, model_dir)
            return {"check": "model", "size": args.size}
        part("model", write)
    else:
        import torch
        device = os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
        report({"check": "machine", "device": device, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None})
        vocab = SHAPES[args.size]["vocab_size"]
        part("model", lambda: {"check": "model", "size": args.size,
                               "vocab": make_model(args.size, model_dir)})

    part("fixtures", lambda: fixtures(args.bin))
    if not args.rehearse:
        part("parity", lambda: parity(args.bin, model_dir, device, vocab))
    part("transfers", lambda: transfers(args.bench_bin, model_dir))

    torch_env = {"DEVICE": device}
    bf16_dir = out / f"model-{args.size}-bf16"
    part("bf16", lambda: {"check": "bf16", **last_json(run(args.bench_bin, "bf16", model_dir,
                                                             bf16_dir))})
    for dtype, path in (("float32", model_dir), ("bfloat16", bf16_dir)):
        def load(dtype=dtype, path=path):
            r = {"check": "load", "file": dtype, "rlstream": last_json(run(args.bench_bin,
                                                                           "load", path))}
            if not args.rehearse:
                r["torch"] = last_json(run(sys.executable, ROOT / "benches" / "torch_gen_load.py",
                                           "load", path, dtype, env=torch_env))
            return r
        part("load", load)
    prompt, new, rows = (128, 128, 8) if args.size == "0.5b" else (16, 128, 32)
    if args.rehearse:
        prompt, new, rows = 8, 8, 2

    def generate():
        ours = last_json(run(args.bench_bin, "generate", model_dir, prompt, new, rows))
        r = {"check": "generate", "rlstream": ours}
        if not args.rehearse:
            for dtype in ("float32", "bfloat16"):
                theirs = last_json(run(sys.executable, ROOT / "benches" / "torch_gen_load.py",
                                       "generate", model_dir, dtype, prompt, new, rows,
                                       env=torch_env))
                r[f"torch_{dtype}"] = theirs
                r[f"ratio_{dtype}"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
        return r
    part("generate", generate)

    def train_step():
        ours = last_json(run(args.bench_bin, "step", model_dir, 0, args.steps))
        r = {"check": "train_step", "rlstream": ours}
        if not args.rehearse:
            theirs = last_json(run(sys.executable, ROOT / "benches" / "torch_train_step.py",
                                   model_dir, 0, args.steps, env=torch_env))
            r["torch"] = theirs
            r["ratio"] = round(theirs["step_s"] / ours["step_s"], 3)
        return r
    part("train_step", train_step)
    part("nccl", lambda: {"check": "nccl",
                          **last_json(run(args.bench_bin, "nccl",
                                                         num_params(SHAPES[args.size])))})

    failed = [r["check"] for r in results if r.get("ok") is False]
    report({"check": "total", "seconds": round(time.monotonic() - started, 1),
            "budget_s": args.budget_s, "failed": failed})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
