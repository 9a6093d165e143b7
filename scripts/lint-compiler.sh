#!/usr/bin/env bash
# The compiler of this crate's own targets in the test build (RUSTC_WORKSPACE_WRAPPER, set by
# scripts/test.sh): clippy, so that every target is linted as it is built, and for the test
# harnesses (the library's unit tests, the integration tests: rustc's `--test`) opt-level 0.
# Their code is the tests' own (assertions, set-up, tiny models through the library); the
# library that the integration tests, the binary and the stage processes run stays at the
# profile's opt-level 1. The unit-test harness is a second compile of the whole library,
# and at opt-level 0 it takes about half the time (CONTRIBUTING.md, "CI").
#
# Called by cargo as `lint-compiler.sh RUSTC ARGS...`.
set -euo pipefail
driver=${CLIPPY_DRIVER:-$(rustc --print sysroot)/bin/clippy-driver}
for arg in "$@"; do
  if [ "$arg" = --test ]; then
    exec "$driver" "$@" -C opt-level=0
  fi
done
exec "$driver" "$@"
