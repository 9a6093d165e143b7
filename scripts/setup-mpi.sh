#!/usr/bin/env bash
# Installs Open MPI (Debian's `libopenmpi-dev` and `openmpi-bin`) and libclang (the `mpi`
# crate generates its bindings with it) when missing: the tests build the `mpi` feature and
# run trainer ranks under `mpirun`. Needs root and apt; prints what to do otherwise.
set -euo pipefail
have() {
  command -v mpirun >/dev/null && command -v mpicc >/dev/null &&
    { ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ls /usr/lib/*/libclang*.so* >/dev/null 2>&1; }
}
if have; then
  echo "MPI ready: $(mpirun --version | head -n 1)"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "Open MPI or libclang not found: install them (Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin libclang-dev)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends libopenmpi-dev openmpi-bin libclang-dev >/dev/null
echo "MPI ready: $(mpirun --version | head -n 1)"
