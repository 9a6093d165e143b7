#!/usr/bin/env bash
# Bus publish throughput as a ratio to raw Redis, measured side by side in one run.
#
# 1. redis-benchmark: pipelined XADD MAXLEN ~ 10000 (-P 100, one client) of the same payload sizes.
# 2. cargo bench --bench bus: RedisBus::publish in pipelined batches of 100, same trimming.
# Prints messages/s for both and the ratio bus/raw for each payload size.
#
#   benches/bus_vs_redis.sh            (Redis at 127.0.0.1:6379; REDIS_HOST/REDIS_PORT override)
set -euo pipefail
cd "$(dirname "$0")/.."
host=${REDIS_HOST:-127.0.0.1}
port=${REDIS_PORT:-6379}
redis-cli -h "$host" -p "$port" ping >/dev/null || { echo "no Redis at $host:$port" >&2; exit 1; }
command -v redis-benchmark >/dev/null || { echo "redis-benchmark not found (apt-get install redis-tools)" >&2; exit 1; }

export RLSTREAM_BENCH_REDIS="redis://$host:$port"
cargo bench --bench bus -- 'bus/redis(-mt)?/publish' >/tmp/rlstream-bus-bench.log 2>&1 || {
  cat /tmp/rlstream-bus-bench.log >&2; exit 1; }
# The realistic payload is a RolloutGroup of 8x256 tokens with masks; its size is in the bench id.
realistic=$(ls target/criterion/bus_redis_publish | grep '^rollout_' | head -1)
rollout_bytes=${realistic#rollout_}; rollout_bytes=${rollout_bytes%B}

raw_rate() { # payload bytes -> XADD/s from redis-benchmark
  local bytes=$1 n=$2 payload key
  payload=$(head -c "$bytes" /dev/zero | tr '\0' x)
  key="bench:raw:$$"
  redis-benchmark -h "$host" -p "$port" -c 1 -P 100 -n "$n" --csv \
    XADD "$key" MAXLEN '~' 10000 '*' d "$payload" | tail -1 | cut -d, -f2 | tr -d '"'
  redis-cli -h "$host" -p "$port" del "$key" >/dev/null
}

bus_rate() { # criterion group dir, id -> messages/s (100 messages per iteration)
  python3 - "$1" "$2" <<'PY'
import json, sys
est = json.load(open(f"target/criterion/{sys.argv[1]}/{sys.argv[2]}/new/estimates.json"))
print(f"{100 / (est['mean']['point_estimate'] * 1e-9):.0f}")
PY
}

printf '%-26s %12s %14s %6s %14s %6s\n' payload "raw XADD/s" "bus msg/s (ct)" ratio "bus msg/s (mt)" ratio
for case in "1KiB:1024:200000" "16KiB:16384:50000" "$realistic:$rollout_bytes:10000"; do
  IFS=: read -r id bytes n <<<"$case"
  raw=$(raw_rate "$bytes" "$n")
  ct=$(bus_rate bus_redis_publish "$id")
  mt=$(bus_rate bus_redis-mt_publish "$id")
  r_ct=$(python3 -c "print(f'{$ct / $raw:.2f}')")
  r_mt=$(python3 -c "print(f'{$mt / $raw:.2f}')")
  printf '%-26s %12.0f %14.0f %6s %14.0f %6s\n' "$id ($bytes B)" "$raw" "$ct" "$r_ct" "$mt" "$r_mt"
done
echo "ct: tokio current-thread runtime; mt: multi-threaded runtime (2 workers)"

