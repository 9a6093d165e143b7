# Sourced by .ci/run and scripts/test.sh: `phase NAME CMD...` runs CMD and records its wall
# time; the outermost script prints the table of every phase when it exits, pass or fail.
if [ -z "${PHASES_FILE:-}" ]; then
  PHASES_FILE=$(mktemp -t rlstream-phases.XXXXXX)
  PHASES_START=$(date +%s)
  export PHASES_FILE PHASES_START
  print_phases() {
    local rc=$?
    if [ -s "$PHASES_FILE" ]; then
      echo
      printf '%-34s %7s\n' "phase" "wall"
      cat "$PHASES_FILE"
      printf '%-34s %6ds\n' "total" $(($(date +%s) - PHASES_START))
    fi
    rm -f "$PHASES_FILE"
    return "$rc"
  }
  trap print_phases EXIT
fi

phase() {
  local name=$1
  shift
  local t0 rc=0
  t0=$(date +%s)
  "$@" || rc=$?
  printf '%-34s %6ds%s\n' "$name" $(($(date +%s) - t0)) \
    "$([ "$rc" = 0 ] || echo "  (failed: exit $rc)")" >>"$PHASES_FILE"
  return "$rc"
}
