#!/usr/bin/env python3
"""Builds the tiny random Qwen2, Qwen3, Llama and Llama 3 (rotary scaling) checkpoints the
parity tests use, with reference logits and greedy continuations computed by `transformers`
on CPU in float32.

    python3 -m pip install torch transformers tokenizers safetensors
    python3 scripts/make_parity_fixtures.py [NAME...]   # writes tests/fixtures/models/{qwen2,qwen3,llama,llama3}

The outputs are committed; CI only reads them. Re-run after changing the configs below.
"""
import json
import pathlib
import sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models"
ALPHABET = "0123456789+-=*abcdefghijklmnopqrstuvwxyz .,?!"
VOCAB = 2 + len(ALPHABET)  # 0: </s>, 1: <unk>, then one id per character

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=0,
)
# Llama 3 scaling with a short original context, so that the inputs below run past it and
# every band of the rule is used: with head_dim 16 and theta 10,000 the wavelengths are
# 6.3 (kept, < 64 / 4), 19.9 and 62.8 (interpolated) and 199 and more (divided by 8).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              # head_dim 16 while hidden / heads is 8: Qwen3's head width is its own.
              dict(rope_theta=1_000_000.0, tie_word_embeddings=True, head_dim=16,
                   attention_bias=False)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_theta=500_000.0, tie_word_embeddings=False, head_dim=8,
                   attention_bias=False)),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(rope_parameters=dict(LLAMA3_ROPE, rope_theta=10_000.0),
                    tie_word_embeddings=False, head_dim=16, attention_bias=False)),
}
SEEDS = {"qwen2": 1, "llama": 2, "qwen3": 3, "llama3": 4}
INPUTS = [[1, 5, 9, 13, 2, 7, 11], [1, 40, 3, 3, 17, 60, 22]]
GREEDY_PROMPT = [1, 12, 5, 7, 30]
GREEDY_NEW = 16
# Past Llama 3's original context of 64 positions, where the scaling matters.
LONG_INPUTS = [[1] + [(7 * i + 3) % 60 + 2 for i in range(95)],
               [1] + [(11 * i + 5) % 60 + 2 for i in range(95)]]
LONG_PROMPT = [1] + [(5 * i + 1) % 60 + 2 for i in range(69)]


def char_tokenizer():
    vocab = {"</s>": 0, "<unk>": 1}
    for i, c in enumerate(ALPHABET):
        vocab[c] = i + 2
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["</s>", "<unk>"])
    return tok


def main():
    torch.manual_seed(0)
    assert VOCAB <= COMMON["vocab_size"]
    # `make_parity_fixtures.py qwen3 llama3` rebuilds only those.
    names = sys.argv[1:] or list(CONFIGS)
    for name in names:
        config_cls, cls, extra = CONFIGS[name]
        torch.manual_seed(SEEDS[name])
        model = cls(config_cls(**COMMON, **extra)).to(torch.float32).eval()
        inputs, prompt = (LONG_INPUTS, LONG_PROMPT) if name == "llama3" else (INPUTS, GREEDY_PROMPT)
        # Random weights with some spread, biases included, so parity is a real test.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        char_tokenizer().save(str(out / "tokenizer.json"))
        with torch.no_grad():
            logits = model(torch.tensor(inputs)).logits
            greedy = model.generate(
                torch.tensor([prompt]), max_new_tokens=GREEDY_NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0, min_new_tokens=GREEDY_NEW,
            )[0, len(prompt):]
        ref = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "inputs": inputs,
            "logits": logits.tolist(),
            "greedy_prompt": prompt,
            "greedy_continuation": greedy.tolist(),
        }
        (out / "reference.json").write_text(json.dumps(ref) + "\n")
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params, {size} bytes in {out}")


if __name__ == "__main__":
    main()
