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

and, on the Qwen2 fixture, the other objectives of `src/stages/train/objective.rs` as their
papers write them (VARIANTS: the `[train]` settings each one runs with):

- GSPO (arXiv 2507.18071): the sequence's ratio s = exp(mean_t (log-prob - behaviour)),
  carried per token as exp(log-prob - log-prob.detach() + log s.detach()), in PPO's clip;
- CISPO (arXiv 2506.13585): -(clamp(r, 1 - clip_eps, 1 + clip_eps_high), without gradient)
  * A * log-prob;
- dual clip (arXiv 1912.09729): for A < 0, min(PPO's loss, -clip_ratio_c * A);
- REINFORCE: -min(r, is_cap) * A;
- off-policy masking: a token whose ratio (token) or whose sequence's geometric-mean ratio
  exp(mean_t log r) (sequence) lies outside [is_mask_low, is_mask_high] drops out of the
  loss, still counting in the aggregation's denominators;
- KL to the initial model (the same weights here, so log-prob - reference is 0 with a
  gradient): k1 = log-prob - reference, times kl_coef, aggregated as the loss is;
- entropy bonus: minus entropy_coeff times the entropy of each token's distribution (the
  tempered logits' softmax, over the kept ids when the sample has a mask), aggregated as
  the loss is;
- decoupled PPO (AReaL, arXiv 2505.24298) with one update per step, so the proximal
  policy is the current one without gradient: PPO's clip on r = exp(log-prob -
  log-prob.detach()), each token weighed by exp(log-prob - behaviour) without gradient,
  and dropped when that weight exceeds behav_imp_weight_cap;
- aggregation: token-mean (sum / tokens), seq-mean-token-mean (mean over sequences of each
  mean), seq-mean-token-sum (mean over sequences of each sum), seq-mean-token-sum-norm (each
  sum divided by the longest completion, mean over sequences).

Outputs are committed; tests/integration/grad_parity.rs compares rlstream's trainer with them.
"""
import json
import math
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
    """Each completion token's log-prob, and the entropy of the distribution it is taken
    under."""
    ids = torch.tensor([prompt + sample["tokens"]])
    logits = model(ids).logits[0] / temperature
    p = len(prompt)
    out, entropy = [], []
    for j, tok in enumerate(sample["tokens"]):
        row = logits[p - 1 + j]
        mask = sample.get("mask")
        if mask is None:
            logp = torch.log_softmax(row, dim=-1)
            out.append(logp[tok])
        else:
            kept = mask["ids"][mask["offsets"][j]:mask["offsets"][j + 1]]
            logp = row[kept] - torch.logsumexp(row[kept], dim=-1)
            out.append(row[tok] - torch.logsumexp(row[kept], dim=-1))
        entropy.append(-(logp.exp() * logp).sum())
    return torch.stack(out), torch.stack(entropy)


# Each variant's settings beyond the batch's; the names are the fixtures' file names.
VARIANTS = {
    "ppo": {"loss": "ppo"},
    "tis": {"loss": "tis"},
    "gspo": {"loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"},
    "cispo": {"loss": "cispo"},
    "ppo_dual_clip": {"loss": "ppo", "clip_ratio_c": 1.01},
    "reinforce_seq_sum": {"loss": "reinforce", "loss_agg_mode": "seq-mean-token-sum"},
    "ppo_sum_norm_k1": {"loss": "ppo", "loss_agg_mode": "seq-mean-token-sum-norm",
                        "kl_coef": 0.1, "kl_loss_type": "k1"},
    "ppo_token_mask": {"loss": "ppo", "is_mask": "token", "is_mask_low": 0.8, "is_mask_high": 1.25},
    "cispo_sequence_mask": {"loss": "cispo", "is_mask": "sequence", "is_mask_low": 0.8,
                            "is_mask_high": 1.25},
    "ppo_entropy": {"loss": "ppo", "entropy_coeff": 0.05},
    "ppo_decoupled_cap": {"loss": "ppo", "use_decoupled_loss": True,
                          "behav_imp_weight_cap": 1.5},
    "gspo_decoupled_seq_mean": {"loss": "gspo", "use_decoupled_loss": True,
                                "loss_agg_mode": "seq-mean-token-mean"},
}
# Variants also made on the Llama fixture.
BOTH = ("ppo", "tis")


def kept(lp, behaviour, v):
    """1 where off-policy masking keeps a token, else 0 (no gradient)."""
    lo, hi = v.get("is_mask_low", 0.5), v.get("is_mask_high", 2.0)
    log_ratio = (lp - behaviour).detach()
    mode = v.get("is_mask", "none")
    if mode == "token":
        inside = log_ratio
    elif mode == "sequence":
        inside = log_ratio.mean().expand_as(log_ratio)
    else:
        return torch.ones_like(lp)
    return ((inside >= math.log(lo)) & (inside <= math.log(hi))).float()


def per_token_loss(lp, behaviour, adv, v):
    b = BATCH
    lo, hi = 1 - b["clip_eps"], 1 + b["clip_eps_high"]
    if v.get("use_decoupled_loss"):
        # The proximal policy is the current one: ratios against it, the behaviour's
        # staleness as a weight.
        weight = torch.exp(lp - behaviour).detach()
        cap = v.get("behav_imp_weight_cap", 0.0)
        capped = (weight <= cap).float() if cap > 0 else torch.ones_like(weight)
        plain = dict(v, use_decoupled_loss=False)
        return per_token_loss(lp, lp.detach(), adv, plain) * weight * capped
    if v["loss"] == "gspo":
        seq = (lp - behaviour).mean()
        ratio = torch.exp(torch.clamp(lp - lp.detach() + seq.detach(), max=10.0))
    else:
        ratio = torch.exp(lp - behaviour)
    if v["loss"] in ("ppo", "gspo"):
        out = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        c = v.get("clip_ratio_c", 0.0)
        if c > 0 and adv < 0:
            out = torch.minimum(out, torch.full_like(out, -c * adv))
        return out
    if v["loss"] == "tis":
        return -(torch.clamp(ratio, max=b["is_cap"]).detach() * adv * lp)
    if v["loss"] == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * adv * lp)
    return -(torch.clamp(ratio, max=b["is_cap"]) * adv)


def aggregate(rows, mode):
    if mode == "token-mean":
        return torch.cat(rows).sum() / sum(r.numel() for r in rows)
    if mode == "seq-mean-token-mean":
        return torch.stack([r.mean() for r in rows]).mean()
    if mode == "seq-mean-token-sum":
        return torch.stack([r.sum() for r in rows]).mean()
    longest = max(r.numel() for r in rows)
    return torch.stack([r.sum() / longest for r in rows]).mean()


def loss(model, v):
    b = BATCH
    rows, kl, entropy = [], [], []
    for g in b["groups"]:
        for s, adv in zip(g["samples"], g["advantages"]):
            lp, h = logprobs(model, g["prompt"], s, b["temperature"])
            behaviour = torch.tensor(s["logprobs"])
            rows.append(per_token_loss(lp, behaviour, adv, v) * kept(lp, behaviour, v))
            kl.append(lp - lp.detach())  # k1 against the initial (same) weights
            entropy.append(h)
    mode = v.get("loss_agg_mode", "token-mean")
    value = aggregate(rows, mode)
    if v.get("kl_coef", 0.0) > 0:
        value = value + v["kl_coef"] * aggregate(kl, mode)
    if v.get("entropy_coeff", 0.0) != 0:
        value = value - v["entropy_coeff"] * aggregate(entropy, mode)
    return value


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    batch = dict(BATCH, variants=VARIANTS)
    (OUT / "batch.json").write_text(json.dumps(batch, indent=1) + "\n")
    losses = {"transformers": transformers.__version__, "torch": torch.__version__}
    for name in ("qwen2", "llama"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            MODELS / name, dtype=torch.float32
        ).eval()
        for kind, v in VARIANTS.items():
            if name != "qwen2" and kind not in BOTH:
                continue
            model.zero_grad()
            value = loss(model, v)
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
