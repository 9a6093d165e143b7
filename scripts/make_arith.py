#!/usr/bin/env python3
"""A verifiable dataset for a small chat model: arithmetic and short word problems with
numeric answers, as chat rows (`messages`, `answer`, `verifier: math`) in JSONL.

    python3 scripts/make_arith.py OUT_DIR [--train 2000] [--held-out 500] [--seed 0]

writes OUT_DIR/arith.jsonl (training rows) and OUT_DIR/arith_held.jsonl (held-out rows,
no question shared with the training rows). Standard library only; the same seed writes
the same files.
"""
import argparse
import json
import pathlib
import random

# Asked at the end of every question: a bare number is what the `math` verifier reads
# best, and what a 135M chat model gives often enough (about a fifth of its samples at
# temperature 0.7) for RL to have something to reinforce.
ASK = " Answer with the number only."
NAMES = ["Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Ben", "Zoe"]
# (template, answer of a and b, whether a is raised by b so that the answer stays >= 0)
WORD = [
    ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?",
     lambda a, b: a + b, False),
    ("{n} has {a} marbles and gives away {b}. How many marbles are left?",
     lambda a, b: a - b, True),
    ("A box holds {a} pens. How many pens are in {b} boxes?", lambda a, b: a * b, False),
    ("{n} reads {a} pages a day for {b} days. How many pages is that?",
     lambda a, b: a * b, False),
    ("A class has {a} girls and {b} boys. How many children are in the class?",
     lambda a, b: a + b, False),
    ("{n} had {a} dollars and spent {b}. How many dollars are left?",
     lambda a, b: a - b, True),
]


def problem(rng):
    """One question and its answer: a sum, a difference, a product or a word problem,
    small numbers all."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        return f"What is {a} + {b}?", a + b
    if kind == 1:
        a, b = rng.randint(5, 40), rng.randint(1, 9)
        return f"What is {a} - {b}?", a - b
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", a * b
    template, answer, raise_a = rng.choice(WORD)
    a, b = rng.randint(2, 15), rng.randint(2, 9)
    if raise_a:
        a += b
    return template.format(n=rng.choice(NAMES), a=a, b=b), answer(a, b)


def rows(seed, n, avoid=()):
    """`n` rows of distinct questions, none of them in `avoid`."""
    rng = random.Random(seed)
    seen = set(avoid)
    out = []
    while len(out) < n:
        question, answer = problem(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append({
            "messages": [{"role": "user", "content": question + ASK}],
            "answer": str(answer),
            "verifier": "math",
        })
    return out


def write(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--held-out", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    held = rows(2 * a.seed + 1, a.held_out)
    asked = [r["messages"][0]["content"].removesuffix(ASK) for r in held]
    train = rows(2 * a.seed + 2, a.train, asked)
    write(a.out / "arith_held.jsonl", held)
    write(a.out / "arith.jsonl", train)
    print(f"{a.out}/arith.jsonl: {len(train)} rows; {a.out}/arith_held.jsonl: {len(held)} rows")


if __name__ == "__main__":
    main()
