#!/usr/bin/env bash
# Build the wheel a GPU user installs (`pip install dist/sgl_kvevict-<version>-py3-none-any.whl`) from the
# files git tracks in this checkout (an untracked file cannot slip in; no stale build/ is reused).
#
#   bash scripts/wheel.sh [OUT_DIR]        # default: dist/ ; PYTHON=... picks the interpreter
#
# Prints the wheel's path on the last line.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$here/dist}" && cd "${1:-$here/dist}" && pwd)"
py="${PYTHON:-python3}"
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
# what the build reads: the project file, its readme, and the folders pyproject maps into the package
(cd "$here" && git ls-files -z pyproject.toml README.md sgl_kvevict kernels policies scenarios) |
  (cd "$here" && xargs -0 cp --parents -t "$src")
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/pyproject.toml" | head -1)
rm -f "$out/sgl_kvevict-$version-py3-none-any.whl"
(cd "$src" && "$py" -m pip wheel --no-deps --no-build-isolation -q -w "$out" .)
ls "$out/sgl_kvevict-$version-py3-none-any.whl"
