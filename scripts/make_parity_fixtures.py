#!/usr/bin/env python3
"""Builds the tiny random Qwen2 and Llama checkpoints the parity tests use, with
reference logits and greedy continuations computed by `transformers` on CPU in float32.

    python3 -m pip install torch transformers tokenizers safetensors
    python3 scripts/make_parity_fixtures.py        # writes tests/fixtures/models/{qwen2,llama}

The outputs are committed; CI only reads them. Re-run after changing the configs below.
"""
import json
import pathlib

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
CONFIGS = {
    "qwen2": transformers.Qwen2Config(**COMMON, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "llama": transformers.LlamaConfig(**COMMON, rope_theta=500_000.0, tie_word_embeddings=False,
                                      head_dim=8, attention_bias=False),
}
INPUTS = [[1, 5, 9, 13, 2, 7, 11], [1, 40, 3, 3, 17, 60, 22]]
GREEDY_PROMPT = [1, 12, 5, 7, 30]
GREEDY_NEW = 16


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
    for name, cfg in CONFIGS.items():
        torch.manual_seed({"qwen2": 1, "llama": 2}[name])
        cls = transformers.Qwen2ForCausalLM if name == "qwen2" else transformers.LlamaForCausalLM
        model = cls(cfg).to(torch.float32).eval()
        # Random weights with some spread, biases included, so parity is a real test.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        char_tokenizer().save(str(out / "tokenizer.json"))
        with torch.no_grad():
            logits = model(torch.tensor(INPUTS)).logits
            greedy = model.generate(
                torch.tensor([GREEDY_PROMPT]), max_new_tokens=GREEDY_NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0, min_new_tokens=GREEDY_NEW,
            )[0, len(GREEDY_PROMPT):]
        ref = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "inputs": INPUTS,
            "logits": logits.tolist(),
            "greedy_prompt": GREEDY_PROMPT,
            "greedy_continuation": greedy.tolist(),
        }
        (out / "reference.json").write_text(json.dumps(ref) + "\n")
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params, {size} bytes in {out}")


if __name__ == "__main__":
    main()
