#!/usr/bin/env bash
# The test command: formatting, lints, the Python schema and ops checks and every test.
# Needs Redis on 127.0.0.1:6379 (RLSTREAM_TEST_REDIS overrides); .ci/run starts one.
# Installs Prometheus/promtool (Debian package) when missing and run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-python.sh
scripts/setup-prometheus.sh
.venv/bin/python schemas/check.py fixtures
.venv/bin/python ops/check.py
cargo fmt --all --check
cargo clippy --all-targets -- -D warnings
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --no-fail-fast
else
  cargo test --no-fail-fast
fi
