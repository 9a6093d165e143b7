#!/usr/bin/env bash
# The pipeline as four processes against a local Redis: warm start, feed, gen, score, train.
#
#   scripts/demo.sh [TASK] [STEPS]        TASK: add | reverse | sort (default reverse), STEPS default 100
#
# Needs Redis on 127.0.0.1:6379 (REDIS_URL overrides). Writes runs/demo-TASK/ (model,
# checkpoints, logs) and prints the trainer's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
task=${1:-reverse}
steps=${2:-100}
redis=${REDIS_URL:-redis://127.0.0.1:6379}
out=runs/demo-$task
ns=demo-$task-$$
cargo build --release --quiet
bin=target/release/rlstream
mkdir -p "$out"
[ -f "$out/model/config.json" ] || $bin sft --task "$task" --out "$out/model" --steps 800
$bin feed --redis "$redis" --namespace "$ns" --task "$task" --count $((steps * 8 + 400)) >/dev/null
$bin gen --redis "$redis" --namespace "$ns" --model "$out/model" --group-size 8 --max-new-tokens 10 2>"$out/gen.log" >/dev/null &
gen=$!
$bin score --redis "$redis" --namespace "$ns" 2>"$out/score.log" >/dev/null &
score=$!
trap 'kill -INT $gen $score 2>/dev/null; wait $gen $score 2>/dev/null || true' EXIT
$bin train --redis "$redis" --namespace "$ns" --model "$out/model" --steps "$steps" --lr 5e-4 \
  --checkpoint-dir "$out/checkpoints" 2>"$out/train.log"
