#!/usr/bin/env python3
"""The PyTorch side of benches/scale_vs_torch.py: one trainer step on the checkpoint DIR
written by `cargo bench --bench train_scale -- write SIZE DIR`, on the same batch and the
same objective as rlstream's trainer (PPO, clip 0.2 / 0.28, the loss averaged over
completion tokens, global-norm clipping at 1.0, AdamW), with a log-softmax gather over the
completion positions, in micro-batches of at most MICRO tokens (0: one pass) with
gradients accumulated.

    python benches/torch_train_step.py DIR MICRO STEPS [LEN SAMPLES]

With LEN and SAMPLES, the batch is one group of SAMPLES sequences of LEN tokens (a 32-token
prompt, the rest completion), as `train_scale -- long` trains it.

Prints one JSON object: the median step time over STEPS timed steps (after one warm-up)
and the process's peak resident memory.
"""
import json
import math
import os
import resource
import sys
import time

import torch
import transformers

torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count())))
DEVICE = os.environ.get("DEVICE", "cpu")  # cuda: scripts/gpu_check.py


def batch(size, vocab):
    groups, per, prompt, completion = (4, 8, 16, 48) if size == "small" else (1, 8, 32, 64)
    uniform = -math.log(vocab)
    out = []
    for g in range(groups):
        p = [(g * 31 + j * 7) % vocab for j in range(prompt)]
        for i in range(per):
            c = [(g * 13 + i * 17 + j * 5) % vocab for j in range(completion)]
            out.append((p, c, [uniform] * completion, 1.0 if i % 2 == 0 else -1.0))
    return out


def micro_batches(samples, max_tokens):
    if max_tokens == 0:
        return [samples]
    out, cur, used = [], [], 0
    for s in samples:
        n = len(s[0]) + len(s[1])
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    out.append(cur)
    return out


def part_loss(model, part, n_tokens):
    # Samples of one micro-batch share their lengths here (fixed-shape batch), so they stack.
    p = len(part[0][0])
    c = len(part[0][1])
    ids = torch.tensor([s[0] + s[1] for s in part], device=DEVICE)
    logits = model(ids).logits[:, p - 1:p - 1 + c]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor([s[1] for s in part], device=DEVICE).unsqueeze(-1)).squeeze(-1)
    mu = torch.tensor([s[2] for s in part], device=DEVICE)
    adv = torch.tensor([s[3] for s in part], device=DEVICE).unsqueeze(-1)
    ratio = torch.exp(lp - mu)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    return per_token.sum() / n_tokens


def main():
    path, micro, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).train()
    vocab = model.config.vocab_size
    size = "0.5b" if vocab > 1000 else "small"
    samples = batch(size, vocab)
    if len(sys.argv) > 5:
        length, per = int(sys.argv[4]), int(sys.argv[5])
        uniform = -math.log(vocab)
        p = [(j * 7) % vocab for j in range(32)]
        samples = [(p, [(i * 17 + j * 5) % vocab for j in range(length - 32)],
                    [uniform] * (length - 32), 1.0 if i % 2 == 0 else -1.0) for i in range(per)]
    n_tokens = sum(len(s[1]) for s in samples)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for part in micro_batches(samples, micro):
            part_loss(model, part, n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"step {i}: {dt:.3f} s", file=sys.stderr)
        if i > 0 or steps == 0:
            times.append(dt)
    times.sort()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"size": size, "micro_batch_tokens": micro, "steps": steps,
                      "step_s": round(times[len(times) // 2], 4), "peak_rss_mb": round(peak_mb),
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "device": DEVICE}))


if __name__ == "__main__":
    main()
