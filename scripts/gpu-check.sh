#!/usr/bin/env bash
# The GPU check: fixtures, parity, host traffic, load, generation, training steps and NCCL of
# the `cuda` build against PyTorch on the same GPU, within ten minutes (scripts/gpu_check.py
# says what each part measures).
#
# Build where the Rust toolchain is (the GPU machine needs none; the two stripped binaries
# are what travels):
#   scripts/gpu-check.sh build        # -> dist/rlstream, dist/train_scale (features cuda, blas off)
# Then, on a machine with CUDA, PyTorch and transformers, from the repository root:
#   scripts/gpu-check.sh [--size 0.5b|small]     # results in $OUT/gpu-check.json
# The rehearsal, which CI runs: the same flow without PyTorch on the `wgpu` build (Mesa's
# lavapipe where there is no GPU), with the test build's binaries:
#   scripts/gpu-check.sh rehearse     # results in target/gpu-check-rehearsal/gpu-check.json
set -euo pipefail
cd "$(dirname "$0")/.."

# The executable cargo builds for `$@` (a JSON message stream on stdout), with the config
# override in RLSTREAM_CARGO_CONFIG if any (scripts/test.sh's profile for the wgpu build).
executable() {
  local config=()
  if [ -n "${RLSTREAM_CARGO_CONFIG:-}" ]; then
    config=(--config "$RLSTREAM_CARGO_CONFIG")
  fi
  local sub=$1
  shift
  cargo "$sub" "${config[@]}" "$@" --message-format json 2>/dev/null | python3 -c 'import json,sys
out = [m["executable"] for m in map(json.loads, sys.stdin)
       if m.get("reason") == "compiler-artifact" and m.get("executable")]
print(out[-1] if out else "")'
}

case "${1:-}" in
  build)
    shift
    features=${FEATURES:-cuda}
    cargo build --release --features "$features" --bin rlstream
    bench=$(executable bench --features "$features" --bench train_scale --no-run)
    mkdir -p dist
    strip -o dist/rlstream target/release/rlstream
    strip -o dist/train_scale "$bench"
    ls -l dist
    ;;
  rehearse)
    shift
    features=${FEATURES:-wgpu}
    bin=$(executable build --features "$features" --bin rlstream)
    bench=$(executable test --features "$features" --bench train_scale --no-run)
    if [ -z "$bin" ] || [ -z "$bench" ]; then
      echo "gpu-check rehearse: the $features build failed (run the cargo commands above to see why)" >&2
      exit 1
    fi
    # Vulkan's loader warns on every start without a runtime directory (none in CI).
    if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
      XDG_RUNTIME_DIR=$(mktemp -d)
      export XDG_RUNTIME_DIR
    fi
    exec python3 scripts/gpu_check.py --rehearse --size small --steps 1 --budget-s "${BUDGET_S:-300}" \
      --bin "$bin" --bench-bin "$bench" --out "${OUT:-target/gpu-check-rehearsal}" "$@"
    ;;
  *)
    exec python3 scripts/gpu_check.py --bin dist/rlstream --bench-bin dist/train_scale \
      --out "${OUT:-gpu-check-out}" "$@"
    ;;
esac
