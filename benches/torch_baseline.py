#!/usr/bin/env python3
"""The PyTorch side of benches/model_vs_torch.sh: the same configs and workloads as
benches/model.rs, on CPU, float32, with torch's intra-op threads set to the machine's cores.

Prints one JSON object: generation tokens/s (batch 32, prompt 16, 128 new tokens, a lean
KV-cache loop over transformers' LlamaForCausalLM), one train step in seconds (batch 32 x 64,
forward + backward + AdamW), and the time to serialise / rebuild a ~25M-parameter model's
weights with safetensors.
"""
import json
import os
import time

import torch
import transformers
from safetensors.torch import load as st_load, save as st_save

torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count())))
torch.manual_seed(0)

SMALL = transformers.LlamaConfig(
    vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0,
)
BIG = transformers.Qwen2Config(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=7,
    num_attention_heads=8, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
)
BATCH, PROMPT, NEW, TRAIN_LEN = 32, 16, 128, 64


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), sorted(times)[len(times) // 2]


def main():
    model = transformers.LlamaForCausalLM(SMALL).float().eval()
    prompts = torch.tensor([[(i * 31 + j * 7) % 128 for j in range(PROMPT)] for i in range(BATCH)])

    @torch.inference_mode()
    def generate():
        out = model(input_ids=prompts, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        for _ in range(NEW):
            tok = torch.multinomial(torch.softmax(logits, -1), 1)
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]

    generate()
    _, gen_median = best_of(generate, 5)

    train_model = transformers.LlamaForCausalLM(SMALL).float().train()
    opt = torch.optim.AdamW(train_model.parameters(), lr=1e-3, weight_decay=0.01)
    seqs = torch.tensor([[(i * 13 + j * 5) % 128 for j in range(TRAIN_LEN)] for i in range(BATCH)])

    def train_step():
        logits = train_model(input_ids=seqs).logits[:, PROMPT - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(-1, seqs[:, PROMPT:, None]).squeeze(-1)
        loss = -lp.sum() / lp.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()

    train_step()
    _, train_median = best_of(train_step, 10)

    big = transformers.Qwen2ForCausalLM(BIG).float()
    state = {k: v.contiguous() for k, v in big.state_dict().items() if k != "lm_head.weight"}
    blob = st_save(state)
    _, ser = best_of(lambda: st_save({k: v.contiguous() for k, v in big.state_dict().items() if k != "lm_head.weight"}), 5)

    def rebuild():
        m = transformers.Qwen2ForCausalLM(BIG)
        m.load_state_dict(st_load(blob), strict=False)

    _, deser = best_of(rebuild, 3)
    print(json.dumps({
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "generate_tokens_per_s": BATCH * NEW / gen_median,
        "train_step_s": train_median,
        "weights_params": sum(v.numel() for v in state.values()),
        "weights_bytes": len(blob),
        "to_bytes_s": ser,
        "from_bytes_s": deser,
    }))


if __name__ == "__main__":
    main()
