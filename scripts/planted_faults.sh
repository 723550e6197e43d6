#!/usr/bin/env bash
# Planted faults: proof that the suite catches the bugs it is meant to catch.
#
# Each tests/faults/NN-name.patch is a minimal change that a real bug could look like. Its header names
# the fault (`# fault: ...`), the tests that must catch it (`# catches: <pytest node id>`, one a line,
# run together) and, where they need it, an environment (`# env: K=V ...`). For each patch this script
# applies it to the working tree (`git apply`), runs its tests (`python -m pytest -x -q <ids>`, with a
# per-fault time limit), records caught (the tests failed) or missed (they passed) and the seconds, and
# reverts it (`git apply -R`). A trap reverts the patch in place on every exit, Ctrl-C included.
#
# Why in place and not in a separate worktree: the editable install maps `sgl_kvevict.kernels` and
# `sgl_kvevict.policies` to this checkout's `kernels/` and `policies/`, so a second worktree's copies
# of them would never be imported; the faults have to be planted where the venv looks.
#
# Usage: scripts/planted_faults.sh [PATCH ...]   (default: every tests/faults/*.patch)
#   FAULT_TIMEOUT  seconds per fault (default 900: a server test starts a server first)
#   FAULTS_LOG     folder for each fault's pytest output (default a fresh temporary folder)
# Refuses to run on a dirty tree (a fault must land on the code as committed). Exits 1 when a fault was
# missed (or its patch did not apply), 0 when every fault was caught.
set -uo pipefail

cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "planted_faults: the working tree has uncommitted changes; commit or stash them first" >&2
  exit 2
fi
PY=$(bash scripts/env.sh) || exit 2
TIMEOUT=${FAULT_TIMEOUT:-900}
LOGS=${FAULTS_LOG:-$(mktemp -d /tmp/planted-faults.XXXXXX)}
mkdir -p "$LOGS"

if [ $# -gt 0 ]; then patches=("$@"); else patches=(tests/faults/*.patch); fi

APPLIED=""
restore() {
  if [ -n "$APPLIED" ]; then
    git apply -R "$APPLIED" || echo "planted_faults: could not revert $APPLIED: run git checkout -- ." >&2
    APPLIED=""
  fi
}
trap restore EXIT
trap 'restore; exit 130' INT TERM

rows=()
missed=0
for patch in "${patches[@]}"; do
  name=$(basename "$patch" .patch)
  mapfile -t ids < <(sed -n 's/^# catches: *//p' "$patch")
  envs=$(sed -n 's/^# env: *//p' "$patch")
  if [ ${#ids[@]} -eq 0 ] || ! git apply --check "$patch" 2>"$LOGS/$name.log"; then
    rows+=("$name|APPLY FAILED or no '# catches:' line|-")
    missed=$((missed + 1))
    continue
  fi
  git apply "$patch" && APPLIED=$patch
  echo "[faults] $name: ${ids[*]}" >&2
  t0=$(date +%s%N)
  # shellcheck disable=SC2086  # envs is a list of K=V words
  env $envs timeout -k 30 "$TIMEOUT" "$PY" -m pytest -x -q -p no:cacheprovider "${ids[@]}" >"$LOGS/$name.log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  restore
  if [ $rc -eq 1 ]; then
    failed=$(sed -n 's/^FAILED \([^ ]*\).*/\1/p' "$LOGS/$name.log" | head -1)
    rows+=("$name|${failed:-${ids[0]}}|$secs")
  else
    # 0: every test passed, the fault went through; anything else (a timeout, an error while collecting,
    # no test run) is no proof either way
    why=$([ $rc -eq 0 ] && echo "MISSED" || echo "NOT RUN (pytest exit $rc)")
    rows+=("$name|$why: ${ids[*]}|$secs")
    missed=$((missed + 1))
  fi
done

printf '\n%-40s | %-95s | %s\n' "fault" "test that caught it" "seconds"
printf '%s\n' "$(printf -- '-%.0s' {1..150})"
for row in "${rows[@]}"; do
  IFS='|' read -r f t s <<<"$row"
  printf '%-40s | %-95s | %s\n' "$f" "$t" "$s"
done
echo "(pytest output of each fault: $LOGS)"
if [ $missed -gt 0 ]; then
  echo "planted_faults: $missed of ${#patches[@]} faults not caught" >&2
  exit 1
fi
echo "planted_faults: all ${#patches[@]} faults caught"
