#!/usr/bin/env python3
"""Writes tests/fixtures/smollm2/lora/: an adapter that rlstream trained on
SmolLM2-135M-Instruct, and the log-probs `peft` gives with it, for the CI test that loads
it in rlstream without torch.

    rlstream run --model target/smollm2 --dataset DATA.jsonl --held-out-share 0 \\
        --eval-prompts 0 --lora-rank 4 --lora-alpha 8 --lora-targets q,v --lr 2e-3 \\
        --steps 4 --sync --out RUN
    python3 -m pip install torch transformers peft safetensors
    python3 scripts/make_smollm2_lora.py RUN/checkpoints/step-00000004 [target/smollm2]

Copies the adapter (adapter_config.json, adapter_model.safetensors: rank 4 on q_proj and
v_proj, about 0.9 MB in float32) into the fixture directory, loads the base with
transformers and the adapter with `peft.PeftModel.from_pretrained`, and writes
reference.json: for the sampled continuations of ../reference.json, each token's log-prob
at their temperature with the adapter and without it, on CPU in float32 (a float64
softmax). The outputs are committed; CI only reads them.
"""
import json
import pathlib
import shutil
import sys

import peft
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "smollm2"
FILES = ["adapter_config.json", "adapter_model.safetensors"]


@torch.no_grad()
def logprobs(model, prompt, tokens, temperature):
    """Each of `tokens`' log-prob after `prompt` and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1:-1].to(torch.float64) / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def main():
    adapter = pathlib.Path(sys.argv[1])
    base_dir = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "target" / "smollm2"
    out = FIXTURES / "lora"
    out.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copyfile(adapter / f, out / f)
    config = json.loads((out / "adapter_config.json").read_text())
    # The fixture names its base as the tests find it, not the run's own path.
    config["base_model_name_or_path"] = "target/smollm2"
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=torch.float32).eval()
    cases = json.loads((FIXTURES / "reference.json").read_text())["sampled"]
    without = [logprobs(base, c["prompt"], c["tokens"], c["temperature"]) for c in cases]
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with_adapter = [logprobs(model, c["prompt"], c["tokens"], c["temperature"])
                    for c in cases]
    moved = max(abs(a - b) for x, y in zip(with_adapter, without) for a, b in zip(x, y))
    (out / "reference.json").write_text(json.dumps({
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "sequences": [{"prompt": c["prompt"], "tokens": c["tokens"],
                       "temperature": c["temperature"]} for c in cases],
        "logprobs": with_adapter,
        "base_logprobs": without,
    }, indent=1) + "\n")
    size = (out / "adapter_model.safetensors").stat().st_size
    print(f"wrote {out}: adapter {size} bytes, moves log-probs by up to {moved:.4f}")


if __name__ == "__main__":
    main()
