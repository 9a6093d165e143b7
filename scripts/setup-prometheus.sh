#!/usr/bin/env bash
# Installs Prometheus and promtool (Debian's `prometheus` package) when missing: the
# observability tests check scraped metrics with `promtool check metrics` and query a real
# Prometheus that scrapes a stage. Needs root and apt; prints what to do otherwise.
set -euo pipefail
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  echo "prometheus ready: $(command -v prometheus)"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "promtool/prometheus not found: install Prometheus 2.x (Debian/Ubuntu: apt-get install prometheus)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# Where an init system runs, the package also starts a system service; the tests start their own.
echo "prometheus ready: $(command -v prometheus)"
