#!/usr/bin/env python3
"""Reference losses and gradients for the trainer, computed by PyTorch on the tiny Qwen2 and
Llama fixtures (tests/fixtures/models, made by make_parity_fixtures.py).

    python3 -m pip install torch transformers safetensors
    python3 scripts/make_grad_fixtures.py      # writes tests/fixtures/grads/

For one fixed batch of scored groups (tests/fixtures/grads/batch.json: prompts, completions,
behaviour log-probs, advantages, one sampling mask) it computes, as rlstream's trainer
defines them, the PPO loss and the TIS loss and every parameter's gradient, in float32:

- log-prob of completion token j: logits at position (prompt length - 1 + j), divided by
  the temperature, log-softmax (renormalised over the kept ids when the sample has a mask);
- ratio r = exp(log-prob - behaviour log-prob), per token;
- PPO: -min(r * A, clamp(r, 1 - clip_eps, 1 + clip_eps_high) * A);
- TIS: -(min(r, is_cap), without gradient) * A * log-prob;
- the loss is the sum over completion tokens divided by their number.

Outputs are committed; tests/integration/grad_parity.rs compares rlstream's trainer with them.
"""
import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
OUT = ROOT / "tests" / "fixtures" / "grads"

BATCH = {
    "temperature": 0.9,
    "clip_eps": 0.2,
    "clip_eps_high": 0.28,
    "is_cap": 2.0,
    "groups": [
        {
            "prompt": [1, 5, 9, 13],
            "advantages": [0.8, -0.8],
            "samples": [
                {"tokens": [2, 7, 11, 20], "logprobs": [-4.0, -4.6, -3.5, -5.2]},
                {
                    "tokens": [17, 60],
                    "logprobs": [-1.3, -0.9],
                    "mask": {"offsets": [0, 3, 5], "ids": [17, 4, 9, 60, 2]},
                },
            ],
        },
        {
            "prompt": [1, 40, 3],
            "advantages": [1.3, -0.2],
            "samples": [
                {"tokens": [22, 3, 5], "logprobs": [-4.3, -3.9, -6.0]},
                {"tokens": [8], "logprobs": [-2.5]},
            ],
        },
    ],
}


def logprobs(model, prompt, sample, temperature):
    ids = torch.tensor([prompt + sample["tokens"]])
    logits = model(ids).logits[0] / temperature
    p = len(prompt)
    out = []
    for j, tok in enumerate(sample["tokens"]):
        row = logits[p - 1 + j]
        mask = sample.get("mask")
        if mask is None:
            out.append(torch.log_softmax(row, dim=-1)[tok])
        else:
            kept = mask["ids"][mask["offsets"][j]:mask["offsets"][j + 1]]
            out.append(row[tok] - torch.logsumexp(row[kept], dim=-1))
    return torch.stack(out)


def loss(model, kind):
    b = BATCH
    terms = []
    for g in b["groups"]:
        for s, adv in zip(g["samples"], g["advantages"]):
            lp = logprobs(model, g["prompt"], s, b["temperature"])
            ratio = torch.exp(lp - torch.tensor(s["logprobs"]))
            if kind == "ppo":
                clipped = torch.clamp(ratio, 1 - b["clip_eps"], 1 + b["clip_eps_high"])
                terms.append(-torch.minimum(ratio * adv, clipped * adv))
            else:
                terms.append(-(torch.clamp(ratio, max=b["is_cap"]).detach() * adv * lp))
    per_token = torch.cat(terms)
    return per_token.sum() / per_token.numel()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "batch.json").write_text(json.dumps(BATCH, indent=1) + "\n")
    losses = {"transformers": transformers.__version__, "torch": torch.__version__}
    for name in ("qwen2", "llama"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            MODELS / name, dtype=torch.float32
        ).eval()
        for kind in ("ppo", "tis"):
            model.zero_grad()
            value = loss(model, kind)
            value.backward()
            grads = {
                n: p.grad.detach().contiguous()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            save_file(grads, str(OUT / f"{name}_{kind}.safetensors"))
            losses[f"{name}_{kind}"] = value.item()
            print(f"{name} {kind}: loss {value.item():.6f}, {len(grads)} gradients")
    (OUT / "losses.json").write_text(json.dumps(losses, indent=1) + "\n")


if __name__ == "__main__":
    main()
