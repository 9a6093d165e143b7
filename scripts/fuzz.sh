#!/usr/bin/env bash
# Fuzzes message decoding and the weights announce with cargo-fuzz (libFuzzer), seeded
# from the schema fixtures, for a bounded time per target. Not part of CI's default run.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      default 60
#
# Needs a nightly toolchain (`rustup toolchain install nightly`); installs cargo-fuzz from
# crates.io if missing. Prints executions per target; crashes land in fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzzing needs a nightly toolchain: rustup toolchain install nightly" >&2
  exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
# Seeds: the golden message fixtures; for the announce target, each fixture behind its
# length prefix.
mkdir -p fuzz/corpus/decode_messages fuzz/corpus/weights_announce
cp schemas/fixtures/*.msgpack fuzz/corpus/decode_messages/
python3 - <<'PY'
import pathlib, struct
src = pathlib.Path("schemas/fixtures/WeightsAnnounce.msgpack").read_bytes()
out = pathlib.Path("fuzz/corpus/weights_announce/announce_with_blob")
out.write_bytes(struct.pack("<H", len(src)) + src + b"\0" * 64)
PY
status=0
for target in decode_messages weights_announce; do
  log=fuzz/$target.log
  if cargo +nightly fuzz run "$target" -- -max_total_time="$secs" >"$log" 2>&1; then
    result="no crash"
  else
    result="CRASH (see $log and fuzz/artifacts/$target/)"
    status=1
  fi
  runs=$(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1 || true)
  echo "$target: ${runs:-no summary}; $result"
done
exit $status
