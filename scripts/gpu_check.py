#!/usr/bin/env python3
"""The GPU check behind scripts/gpu-check.sh: parity, generation and training with binaries
built with `--features cuda`, on a machine that has CUDA, PyTorch and transformers but no Rust
toolchain. It makes its own model with PyTorch (random weights, Qwen2.5-0.5B's shape, or the
small config with --size small), then:

1. parity: greedy continuations and their log-probs from `rlstream generate --json` against
   transformers on the same device, for a few prompts;
2. load and generation: the bench binary's `load` and `generate` (prompt 128, 8 rows x 128
   new tokens) against a lean PyTorch KV-cache loop (benches/torch_gen_load.py), float32 and
   bfloat16;
3. training: the bench binary's `step` (forward, backward, AdamW) for a few steps against
   benches/torch_train_step.py.

    python3 scripts/gpu_check.py --bin dist/rlstream --bench-bin dist/train_scale [--size 0.5b]

Each result is printed as a JSON line and written to OUT/gpu-check.json (OUT: $OUT, or
--out). The same script runs on a CPU build (both binaries without `cuda`, DEVICE=cpu) to
check the flow itself.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=32768, rope_theta=1000000.0),
    "small": dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rope_theta=10000.0),
}


def run(*cmd, env=None):
    out = subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    return out.stdout


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def make_model(size, path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**SHAPES[size], tie_word_embeddings=True, rms_norm_eps=1e-6,
                                   use_sliding_window=False)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(path, safe_serialization=True)
    return cfg


@torch.inference_mode()
def parity(bin_path, path, device, vocab, prompts=4, new=16):
    """Sampled tokens' log-probs (temperature 1) against transformers' log-softmax at the
    same positions, and greedy tokens against transformers' argmax along the same sequence."""
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
            "greedy_agreement": agree / max(total, 1), "max_abs_logprob_diff": worst}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="rlstream built with --features cuda")
    ap.add_argument("--bench-bin", required=True, help="the train_scale bench binary, same build")
    ap.add_argument("--size", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    device = os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / f"model-{args.size}"
    results = []

    def report(r):
        results.append(r)
        print(json.dumps(r), flush=True)
        (out / "gpu-check.json").write_text(json.dumps(results, indent=1))

    report({"check": "machine", "device": device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None})
    t = time.perf_counter()
    cfg = make_model(args.size, model_dir)
    report({"check": "model", "size": args.size, "seconds": round(time.perf_counter() - t, 1)})
    report(parity(args.bin, model_dir, device, cfg.vocab_size))

    bf16_dir = out / f"model-{args.size}-bf16"
    run(args.bench_bin, "bf16", model_dir, bf16_dir)
    torch_env = {"DEVICE": device}
    for dtype, path in (("float32", model_dir), ("bfloat16", bf16_dir)):
        ours = last_json(run(args.bench_bin, "load", path))
        theirs = last_json(run(sys.executable, ROOT / "benches" / "torch_gen_load.py", "load",
                               path, dtype, env=torch_env))
        report({"check": "load", "file": dtype, "rlstream": ours, "torch": theirs})
    prompt, new, rows = (128, 128, 8) if args.size == "0.5b" else (16, 128, 32)
    ours = last_json(run(args.bench_bin, "generate", model_dir, prompt, new, rows))
    for dtype in ("float32", "bfloat16"):
        theirs = last_json(run(sys.executable, ROOT / "benches" / "torch_gen_load.py",
                               "generate", model_dir, dtype, prompt, new, rows, env=torch_env))
        report({"check": "generate", "rlstream": ours, "torch": theirs,
                "ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)})
    ours = last_json(run(args.bench_bin, "step", model_dir, 0, args.steps))
    theirs = last_json(run(sys.executable, ROOT / "benches" / "torch_train_step.py", model_dir,
                           0, args.steps, env=torch_env))
    report({"check": "train_step", "rlstream": ours, "torch": theirs,
            "ratio": round(theirs["step_s"] / ours["step_s"], 3)})


if __name__ == "__main__":
    main()
