#!/usr/bin/env python3
"""The PyTorch side of the load and generation rows of benches/scale_vs_torch.py.

    python benches/torch_gen_load.py load DIR DTYPE
    python benches/torch_gen_load.py generate DIR DTYPE PROMPT NEW ROWS

DTYPE is float32 or bfloat16: the dtype the weights are held (and, in PyTorch, computed) in.
DEVICE=cuda runs on the GPU (scripts/gpu_check.py); the CPU otherwise.
`load` times `from_pretrained` on DIR; `generate` runs ROWS rows of PROMPT tokens and NEW
sampled tokens each (temperature 1, no stop token) with a lean KV-cache loop, after a 4-token
warm-up. Each prints one JSON object with the time and the process's peak resident memory
(and the peak before loading, the interpreter and torch alone).
"""
import json
import os
import resource
import sys
import time

import torch
import transformers

torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count())))
DEVICE = os.environ.get("DEVICE", "cpu")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(path, dtype):
    base = peak_mb()
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(DEVICE)
    sync()
    secs = time.perf_counter() - t
    return model, secs, base


@torch.inference_mode()
def generate(model, prompt, new, rows, vocab):
    ids = torch.tensor([[(i * 31 + j * 7) % vocab for j in range(prompt)] for i in range(rows)],
                       device=DEVICE)
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()
    for _ in range(new - 1):
        tok = torch.multinomial(torch.softmax(logits, -1), 1)
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    return rows * new


def main():
    mode, path, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model, load_s, base = load(path, dtype)
    model.eval()
    if mode == "load":
        print(json.dumps({"load_s": round(load_s, 3), "peak_rss_mb": round(peak_mb()),
                          "base_rss_mb": round(base), "dtype": dtype}))
        return
    prompt, new, rows = (int(a) for a in sys.argv[4:7])
    vocab = model.config.vocab_size
    generate(model, prompt, 4, rows, vocab)
    sync()
    t = time.perf_counter()
    tokens = generate(model, prompt, new, rows, vocab)
    sync()
    secs = time.perf_counter() - t
    print(json.dumps({"rows": rows, "prompt": prompt, "new": new, "tokens": tokens,
                      "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2),
                      "peak_rss_mb": round(peak_mb()), "dtype": dtype,
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "device": DEVICE}))


if __name__ == "__main__":
    main()
