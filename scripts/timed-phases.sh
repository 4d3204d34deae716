#!/usr/bin/env bash
# Runs `make <phase>` for each phase in order, stopping at the first that fails, and prints how long each
# took (make test runs its phases through this; docs/TESTING.md records the times on our machines).
#
#   scripts/timed-phases.sh make build test-cpp ...
set -uo pipefail
make_cmd=$1
shift
summary=()
for phase in "$@"; do
  start=$(date +%s)
  $make_cmd --no-print-directory "$phase"
  status=$?
  summary+=("$phase $(($(date +%s) - start)) s")
  if [ $status -ne 0 ]; then
    echo "timed-phases: $phase FAILED (exit $status); times: $(IFS=,; echo "${summary[*]}" | sed "s/,/, /g")" >&2
    exit $status
  fi
done
total=0
for s in "${summary[@]}"; do total=$((total + $(echo "$s" | awk '{print $2}'))); done
echo "timed-phases: all passed in $total s: $(IFS=,; echo "${summary[*]}" | sed 's/,/, /g')"
