"""Writes the Parquet dataset fixtures of tests/fixtures/datasets/ with pyarrow, the
library Hugging Face's datasets hub writes its Parquet conversions with, and what rlstream
must read from each (expected.json): the usable rows, and the bad rows it must count and
skip, by 0-based row number.

    python3 -m venv /tmp/pa && /tmp/pa/bin/pip install pyarrow
    /tmp/pa/bin/python scripts/make_parquet_fixtures.py

The files are committed; CI does not run this script.
"""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "datasets"


def gsm8k_style():
    """GSM8K's columns (`question`, `answer`), an extra text column and an integer one,
    snappy-compressed (pyarrow's default, as on the hub), two rows per row group. Row 2 has
    an empty question, row 4 a null answer."""
    questions = ["What is 2+3?", "What is 7*6?", "", "What is 9-4?", "What is 10/2?", "What is 1+1?"]
    answers = ["5", "42", "3", "5", None, "2"]
    table = pa.table(
        {
            "question": pa.array(questions, pa.string()),
            "answer": pa.array(answers, pa.string()),
            "source": pa.array(["a", "b", "c", "d", "e", "f"], pa.string()),
            "difficulty": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
        }
    )
    pq.write_table(table, OUT / "gsm8k_style.parquet", row_group_size=2, compression="snappy")
    good = [i for i in range(len(questions)) if questions[i] and answers[i] is not None]
    return {
        "rows": len(questions),
        "items": [
            {"row": i, "prompt": questions[i], "answer": answers[i], "source": "abcdef"[i]}
            for i in good
        ],
        "skipped": {
            str(i): "empty prompt" if not questions[i] else "`answer` is null"
            for i in range(len(questions))
            if i not in good
        },
    }


def chat_rows():
    """A `messages` column (list of {role, content} structs), integer answers and a
    per-row verifier, zstd-compressed. Row 1 ends with the assistant's turn, row 3 has no
    messages (null)."""
    def conv(q, last_assistant=False):
        m = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": q}]
        if last_assistant:
            m.append({"role": "assistant", "content": "7"})
        return m

    messages = [conv("2+2?"), conv("3+4?", True), conv("5+5?"), None, conv("6*7?")]
    answers = [4, 7, 10, 1, 42]
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = pa.table(
        {
            "messages": pa.array(messages, msg_type),
            "answer": pa.array(answers, pa.int64()),
            "verifier": pa.array(["numeric"] * 5, pa.string()),
        }
    )
    pq.write_table(table, OUT / "chat_rows.parquet", compression="zstd")
    good = [0, 2, 4]
    return {
        "rows": len(messages),
        "items": [{"row": i, "messages": messages[i], "answer": str(answers[i])} for i in good],
        "skipped": {
            "1": "the last message is the assistant's: nothing is left to answer",
            "3": "`messages` is null",
        },
    }


def wrong_types():
    """A `prompt` column of integer lists: no row has a text prompt."""
    table = pa.table(
        {
            "prompt": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
            "answer": pa.array(["x", "y"], pa.string()),
        }
    )
    pq.write_table(table, OUT / "wrong_types.parquet")
    return {
        "rows": 2,
        "items": [],
        "skipped": {"0": "`prompt` must be a string or number", "1": "`prompt` must be a string or number"},
    }


def brotli():
    """A brotli-compressed file: a codec this build does not read."""
    table = pa.table({"prompt": pa.array(["2+2="], pa.string()), "answer": pa.array(["4"], pa.string())})
    pq.write_table(table, OUT / "brotli.parquet", compression="brotli")
    return {"rows": 1, "codec": "brotli"}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    expected = {
        "pyarrow": pa.__version__,
        "gsm8k_style.parquet": gsm8k_style(),
        "chat_rows.parquet": chat_rows(),
        "wrong_types.parquet": wrong_types(),
        "brotli.parquet": brotli(),
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
