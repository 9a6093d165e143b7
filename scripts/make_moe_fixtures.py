#!/usr/bin/env python3
"""Builds the tiny random mixture-of-experts checkpoints the MoE parity tests use: a
Qwen3-MoE (top-2 of 8 experts, `norm_topk_prob`, one dense layer among the sparse ones)
and a Qwen2-MoE (top-2 of 6 experts with a sigmoid-gated shared expert, unnormalised gate
weights), with reference logits, each MoE layer's chosen experts per token, and greedy
continuations computed by `transformers` on CPU in float32.

    python3 -m pip install torch transformers tokenizers safetensors
    python3 scripts/make_moe_fixtures.py     # writes tests/fixtures/models/{qwen3_moe,qwen2_moe}

Each checkpoint is written in both expert layouts: `model.safetensors` as `save_pretrained`
writes it (transformers 5.24 converts back to the hub's per-expert names,
`mlp.experts.{j}.gate_proj.weight`, ...), and `fused/model.safetensors` with the fused 3-D
expert tensors transformers 5 holds in memory (`mlp.experts.gate_up_proj` `[experts,
2 * moe_intermediate, hidden]`, gate rows first, and `mlp.experts.down_proj` `[experts,
hidden, moe_intermediate]`), as a state dict saved from it has them.

The router weights are drawn wider than the rest so that no test token sits near a tie
between its k-th and (k+1)-th expert: the script checks the smallest such gap and refuses
to write a fixture whose gap is below 1e-3. The outputs are committed; CI only reads them.
"""
import json
import pathlib
import sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_parity_fixtures as dense  # noqa: E402
from make_parity_fixtures import OUT, VOCAB, char_tokenizer  # noqa: E402

# The dense fixtures' shape, a layer more (so one can stay dense among the sparse ones).
COMMON = dict(dense.COMMON, intermediate_size=48, num_hidden_layers=3,
              moe_intermediate_size=24, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16,
                       rope_theta=1_000_000.0, tie_word_embeddings=True, attention_bias=False)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=6, norm_topk_prob=False, shared_expert_intermediate_size=40,
                       rope_theta=1_000_000.0, tie_word_embeddings=False, qkv_bias=True)),
}
SEEDS = {"qwen3_moe": 5, "qwen2_moe": 6}
INPUTS = [[1, 5, 9, 13, 2, 7, 11], [1, 40, 3, 3, 17, 60, 22]]
GREEDY_PROMPT = [1, 12, 5, 7, 30]
GREEDY_NEW = 16
ROUTER_STD = 1.0
MIN_GAP = 1e-3


def routers(model):
    return [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts")]


def record_routing(model, run):
    """Runs `run()` and returns, per MoE layer, the top-k ids of every token the router
    saw and the smallest gap between the k-th and (k+1)-th probability."""
    seen, gaps, hooks = {}, [], []
    k = model.config.num_experts_per_tok
    for i, gate in routers(model):
        def hook(module, inputs, output, i=i):
            logits, _, indices = output
            probs = torch.softmax(logits.float(), dim=-1)
            top = torch.topk(probs, k + 1, dim=-1).values
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))
            seen.setdefault(i, []).append(indices.tolist())
        hooks.append(gate.register_forward_hook(hook))
    try:
        out = run()
    finally:
        for h in hooks:
            h.remove()
    return out, seen, min(gaps)


def main():
    assert VOCAB <= COMMON["vocab_size"]
    names = sys.argv[1:] or list(CONFIGS)
    for name in names:
        config_cls, cls, extra = CONFIGS[name]
        torch.manual_seed(SEEDS[name])
        config = config_cls(**COMMON, **extra)
        model = cls(config).to(torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.normal_(0.0, ROUTER_STD if pname.endswith("mlp.gate.weight") else 0.2)
        with torch.no_grad():
            out, routing, gap = record_routing(model, lambda: model(torch.tensor(INPUTS)).logits)
            greedy = model.generate(
                torch.tensor([GREEDY_PROMPT]), max_new_tokens=GREEDY_NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0, min_new_tokens=GREEDY_NEW,
            )[0, len(GREEDY_PROMPT):]
        if gap < MIN_GAP:
            sys.exit(f"{name}: a test token's k-th and (k+1)-th experts are {gap:.2e} apart; "
                     "change its seed")
        dest = OUT / name
        dest.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(dest, safe_serialization=True)
        char_tokenizer().save(str(dest / "tokenizer.json"))
        (dest / "fused").mkdir(exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (config.tie_word_embeddings and k == "lm_head.weight")}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), "fused in memory"
        save_file(state, str(dest / "fused" / "model.safetensors"), metadata={"format": "pt"})
        (dest / "fused" / "config.json").write_text((dest / "config.json").read_text())
        # Each MoE layer's [batch, len, k] expert ids for INPUTS (one router call each).
        layers = sorted(routing)
        b, l = len(INPUTS), len(INPUTS[0])
        experts = [[[routing[i][0][r * l + t] for i in layers] for t in range(l)] for r in range(b)]
        ref = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "inputs": INPUTS,
            "logits": out.tolist(),
            "moe_layers": layers,
            "experts": experts,
            "min_router_gap": gap,
            "greedy_prompt": GREEDY_PROMPT,
            "greedy_continuation": greedy.tolist(),
        }
        (dest / "reference.json").write_text(json.dumps(ref) + "\n")
        keys = sorted(model.state_dict())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params, router gap {gap:.3g}, "
              f"saved keys like {[k for k in keys if 'experts' in k][:2]}")


if __name__ == "__main__":
    main()
