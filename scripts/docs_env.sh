#!/usr/bin/env bash
# Create (or reuse) the docs site's own small virtualenv and print its python path on the last line.
#
# mkdocs and mkdocs-material (requirements/docs.txt) build docs/ into a site (`make docs`). They are kept
# out of the project venv so that `make test` never needs them; the venv is keyed by a hash of the pins,
# like scripts/kvpress_env.sh. Idempotent: well under a second when unchanged.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cache="${KVEVICT_CACHE:-$HOME/.cache/sgl-kvevict}"
py="${PYTHON:-python3}"
log() { echo "[docs-env] $*" >&2; }
key=$(sha256sum "$here/requirements/docs.txt" | cut -c1-12)
venv="$cache/docs-venv-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  log "creating $venv"
  rm -rf "$venv"; mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --no-cache-dir -r "$here/requirements/docs.txt" >&2
  touch "$venv/.complete"
else
  log "reusing $venv"
fi
echo "$venv/bin/python"
