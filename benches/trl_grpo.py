#!/usr/bin/env python3
"""TRL's GRPOTrainer on the CPU on a chat dataset of rlstream's form (JSONL `messages`,
`answer`), with the settings of an rlstream run, saving the final model for
`rlstream eval`. Run by benches/real_model.py; needs torch, transformers and trl.

    python benches/trl_grpo.py --model DIR --dataset FILE --out DIR --steps 40 --lr 1e-5 \\
        --groups 8 --group-size 8 --max-new-tokens 16 --temperature 0.7 --seed 0

The reward is the `math` verifier's rule (the text after the last `####`, else the last
number, compared as numbers); rlstream's own verifier evaluates the saved model. Prints
one JSON line: steps, wall seconds in all and per step, the mean training reward of the
first and last steps.
"""
import argparse
import json
import re
import time

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text):
    """The answer the `math` verifier reads: after the last ####, else the last number."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reward(completions, answer, **_):
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        got = final_number(text)
        out.append(1.0 if got is not None and abs(got - float(a)) <= 1e-6 * max(1, abs(float(a))) else 0.0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(a.seed)
    data = load_dataset("json", data_files=a.dataset, split="train")
    data = data.rename_column("messages", "prompt").remove_columns(["verifier"])
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    batch = a.groups * a.group_size
    cfg = GRPOConfig(
        output_dir=a.out,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=a.group_size,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        use_cpu=True,
        bf16=False,
        seed=a.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_dropout=True,
        # TRL turns it on by default; rlstream keeps its activations, and 135M fits.
        gradient_checkpointing=False,
    )
    rewards = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
                print(f"step {state.global_step}: reward {logs['reward']:.3f}", flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Log()])
    start = time.time()
    trainer.train()
    wall = time.time() - start
    trainer.save_model(a.out)
    tok.save_pretrained(a.out)
    k = max(1, len(rewards) // 10)
    print(json.dumps({
        "steps": a.steps, "wall_s": wall, "step_s": wall / max(1, a.steps),
        "reward_start": sum(rewards[:k]) / k if rewards else None,
        "reward_end": sum(rewards[-k:]) / k if rewards else None,
    }))


if __name__ == "__main__":
    main()
