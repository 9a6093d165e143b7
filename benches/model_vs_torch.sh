#!/usr/bin/env bash
# rlstream's model against PyTorch on CPU, same configs, measured side by side in one run.
#
#   PYTHON=/path/to/python benches/model_vs_torch.sh
#
# PYTHON must have torch, transformers and safetensors (python3 -m pip install torch
# transformers safetensors). Runs `cargo bench --features flex --bench model`, then benches/torch_baseline.py,
# and prints rlstream/PyTorch ratios (above 1 means rlstream is faster).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c 'import torch, transformers, safetensors' 2>/dev/null || {
  echo "$python lacks torch/transformers/safetensors; set PYTHON" >&2; exit 1; }

cargo bench --features flex --bench model >/tmp/rlstream-model-bench.log 2>&1 || { cat /tmp/rlstream-model-bench.log >&2; exit 1; }
THREADS=$(nproc) "$python" benches/torch_baseline.py 2>/dev/null >/tmp/rlstream-torch.json

"$python" - <<'PY'
import json
def mean_s(group, bench):
    est = json.load(open(f"target/criterion/{group}/{bench}/new/estimates.json"))
    return est["mean"]["point_estimate"] * 1e-9
t = json.load(open("/tmp/rlstream-torch.json"))
gen = {b: 32 * 128 / mean_s("model_generate_b32_p16_t128", b) for b in ("flex", "ndarray")}
train = {b: mean_s("model_train_step_b32_t64", b) for b in ("flex", "ndarray")}
to_b, from_b = mean_s("model_weights_25m", "to_bytes"), mean_s("model_weights_25m", "from_bytes")
print(f"PyTorch {t['torch']} on {t['threads']} threads")
print(f"{'workload':<40} {'rlstream':>12} {'PyTorch':>12} {'ratio':>7}")
for b in ("flex", "ndarray"):
    print(f"{'generate b32 p16 t128, tokens/s (' + b + ')':<40} {gen[b]:>12.0f} {t['generate_tokens_per_s']:>12.0f} {gen[b] / t['generate_tokens_per_s']:>7.2f}")
for b in ("flex", "ndarray"):
    print(f"{'train step b32x64, s (' + b + ')':<40} {train[b]:>12.3f} {t['train_step_s']:>12.3f} {t['train_step_s'] / train[b]:>7.2f}")
print(f"{'weights 25M to bytes, s':<40} {to_b:>12.3f} {t['to_bytes_s']:>12.3f} {t['to_bytes_s'] / to_b:>7.2f}")
print(f"{'weights 25M from bytes (new model), s':<40} {from_b:>12.3f} {t['from_bytes_s']:>12.3f} {t['from_bytes_s'] / from_b:>7.2f}")
PY
