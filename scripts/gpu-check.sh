#!/usr/bin/env bash
# The GPU check: parity, load, generation and training steps of the `cuda` build against
# PyTorch on the same GPU (scripts/gpu_check.py says what each part measures).
#
# Build where the Rust toolchain is (the GPU machine needs none; the two stripped binaries
# are what travels):
#   scripts/gpu-check.sh build        # -> dist/rlstream, dist/train_scale (features cuda, blas off)
# Then, on a machine with CUDA, PyTorch and transformers, from the repository root:
#   scripts/gpu-check.sh [--size 0.5b|small]     # results in $OUT/gpu-check.json
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = build ]; then
  shift
  features=${FEATURES:-cuda}
  cargo build --release --features "$features" --bin rlstream
  bench=$(cargo bench --features "$features" --bench train_scale --no-run --message-format json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "train_scale" and m.get("executable"):
        print(m["executable"])' | tail -1)
  mkdir -p dist
  strip -o dist/rlstream target/release/rlstream
  strip -o dist/train_scale "$bench"
  ls -l dist
  exit 0
fi
exec python3 scripts/gpu_check.py --bin dist/rlstream --bench-bin dist/train_scale \
  --out "${OUT:-gpu-check-out}" "$@"
