#!/usr/bin/env bash
# Installs a Vulkan driver that runs on the CPU, Mesa's lavapipe (Debian's
# `mesa-vulkan-drivers`, with the loader `libvulkan1`), when no Vulkan driver is there: the
# tests run the model, sampler and trainer on burn's CubeCL backend over wgpu (feature
# `wgpu`), the runtime, fusion and kernels the `cuda` build shares. Needs root and apt;
# prints what to do otherwise.
set -euo pipefail
have() {
  ls /usr/share/vulkan/icd.d/*.json >/dev/null 2>&1 &&
    { ls /usr/lib/*/libvulkan.so.1 >/dev/null 2>&1 || ls /usr/lib/libvulkan.so.1 >/dev/null 2>&1; }
}
if have; then
  echo "Vulkan ready: $(ls /usr/share/vulkan/icd.d/ | tr '\n' ' ')"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "no Vulkan driver found: install one (Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
echo "Vulkan ready: $(ls /usr/share/vulkan/icd.d/ | tr '\n' ' ')"
