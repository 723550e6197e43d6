#!/usr/bin/env bash
# Busy-loop N processes (default 2) until killed: the load a loaded `make test` run is measured beside.
# Usage: bash scripts/cpu_burner.sh [N] & ... ; kill %1
set -euo pipefail
n="${1:-2}"
pids=()
for _ in $(seq "$n"); do
  python3 -c 'while True: pass' &
  pids+=("$!")
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT INT TERM
wait
