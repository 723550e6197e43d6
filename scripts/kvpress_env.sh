#!/usr/bin/env bash
# Create (or reuse) kvpress's own virtualenv and print its python path on the last line.
#
# kvpress (NVIDIA's KV-compression library, the peer of benchmarks/kvpress_check.py) needs
# transformers<5.3, which the project's venv cannot hold (it pins 5.19). So kvpress, that transformers
# and the few packages pinned with it (requirements/kvpress.txt) are installed with --no-deps into a venv
# of their own, keyed by a hash of those pins and of the project venv's path; everything else kvpress
# imports comes from the project venv (scripts/env.sh), appended to sys.path *after* the kvpress venv's
# own packages by a .pth line. Why not a full second install: torch 2.14.1 and the CUDA runtime wheels it
# depends on are ~5 GB per copy; sharing them means both sides run the very same torch build, numpy and
# tokenizer files. Only the project venv's directory is put on the path: its own .pth hooks (the editable
# project, the CPU sgl_kernel stand-in) are not run here. Idempotent: well under a second when unchanged.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cache="${KVEVICT_CACHE:-$HOME/.cache/sgl-kvevict}"
py="${PYTHON:-python3}"
log() { echo "[kvpress-env] $*" >&2; }
project_py=$(bash "$here/scripts/env.sh" --shared 2>/dev/null | tail -1)  # the shared venv: no project
shared=$("$project_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
key=$( (cat "$here/requirements/kvpress.txt"; echo "$shared") | sha256sum | cut -c1-12)
venv="$cache/kvpress-venv-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  log "creating $venv (about a minute)"
  rm -rf "$venv"; mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --no-cache-dir --no-deps -r "$here/requirements/kvpress.txt" >&2
  own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$shared" > "$own/zz_sgl_kvevict_shared.pth"  # a plain path line: appended last, no hooks run
  "$venv/bin/python" - >&2 <<'PY'
import importlib.metadata as md

import kvpress  # noqa: F401  (imports every press, and with them datasets, fire, torch)
import transformers

assert transformers.__version__ == md.version("transformers"), "the project's transformers shadowed kvpress's"
print(f"[kvpress-env] kvpress {md.version('kvpress')}, transformers {transformers.__version__}, torch {md.version('torch')}")
PY
  touch "$venv/.complete"
else
  log "reusing $venv"
fi
echo "$venv/bin/python"
