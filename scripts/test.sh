#!/usr/bin/env bash
# The test command: formatting, lints, the Python schema and ops checks and every test,
# then a table of each phase's wall time (the budget: CONTRIBUTING.md, "CI").
# Needs Redis on 127.0.0.1:6379 (RLSTREAM_TEST_REDIS overrides); .ci/run starts one.
# Installs Prometheus/promtool and Open MPI (Debian packages) when missing and run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/phases.sh

phase "python checks set-up" scripts/setup-python.sh
phase "prometheus set-up" scripts/setup-prometheus.sh
phase "MPI set-up" scripts/setup-mpi.sh
phase "schema fixtures (python)" .venv/bin/python schemas/check.py fixtures
phase "ops configs (python)" .venv/bin/python ops/check.py
phase "cargo fmt" cargo fmt --all --check

# Lint while building the tests: clippy is the compiler of this crate's targets
# (RUSTC_WORKSPACE_WRAPPER), so the dependencies are compiled once, for the tests, and
# every target the tests need (lib, bins, tests, examples) is linted as it is built. The
# benches are linted by `cargo clippy --all-targets -- -D warnings`, and in CI by the
# feature check in .ci/run.
export RUSTC_WORKSPACE_WRAPPER="${RUSTC_WORKSPACE_WRAPPER:-$(rustc --print sysroot)/bin/clippy-driver}"
export CLIPPY_ARGS="-Dwarnings"
# The tests cover the `mpi` feature: trainer ranks under `mpirun` (set up above).
phase "lint + build the tests" cargo test --features mpi --no-run
if cargo nextest --version >/dev/null 2>&1; then
  phase "tests (nextest)" cargo nextest run --features mpi --no-fail-fast
else
  phase "tests (cargo test)" cargo test --features mpi --no-fail-fast
fi
