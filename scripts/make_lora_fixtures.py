#!/usr/bin/env python3
"""Reference logits of the LoRA adapters rlstream wrote, computed by `peft` on CPU in float32.

For each name, `tests/fixtures/lora/NAME/` holds an adapter that rlstream wrote
(`adapter_model.safetensors` + `adapter_config.json`, made by
`RLSTREAM_BLESS=1 cargo test --test lora`) for the base `tests/fixtures/models/NAME`. This
script loads the base with `transformers`, applies the adapter with
`peft.PeftModel.from_pretrained`, and writes the logits of fixed inputs, with and without the
adapter, to `tests/fixtures/lora/NAME/reference.json`.

    python3 -m pip install torch transformers peft safetensors
    python3 scripts/make_lora_fixtures.py [NAME...]

The outputs are committed; CI only reads them (it installs no torch).
"""
import json
import pathlib
import sys

import peft
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
NAMES = ["qwen3", "llama"]
INPUTS = [[1, 5, 9, 13, 2, 7, 11], [1, 40, 3, 3, 17, 60, 22]]


def main():
    for name in sys.argv[1:] or NAMES:
        base_dir, adapter_dir = ROOT / "models" / name, ROOT / "lora" / name
        base = transformers.AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            base_logits = base(torch.tensor(INPUTS)).logits
        model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        with torch.no_grad():
            logits = model(torch.tensor(INPUTS)).logits
        ref = {
            "peft": peft.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "inputs": INPUTS,
            "logits": logits.tolist(),
            "base_logits": base_logits.tolist(),
        }
        (adapter_dir / "reference.json").write_text(json.dumps(ref) + "\n")
        diff = (logits - base_logits).abs().max().item()
        print(f"{name}: adapter moves the logits by up to {diff:.4f}")


if __name__ == "__main__":
    main()
