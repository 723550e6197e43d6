#!/usr/bin/env bash
# The project's Triton kernels on a CUDA GPU, with no SGLang and no server: their tests against the torch
# references (every `test_triton_*` and `test_cuda_*` test runs in this process on the device, at the
# suite's sizes) and the kernel benchmark (torch reference and Triton kernel side by side).
# Needs torch, triton, pydantic, pytest and pytest-xdist, and this checkout importable
# (`pip install --no-deps -e .`).
#
#   bash scripts/cuda_kernels.sh [OUT_DIR]      # default: results/kernels-cuda
#
# Writes OUT_DIR/device.txt, tests.txt, bench.txt and bench.json; exits non-zero if a test failed.
set -uo pipefail
out=${1:-results/kernels-cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" - > "$out/device.txt" <<'PY' || exit 2
import torch
import triton

assert torch.cuda.is_available(), "no CUDA device is visible"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
PY
cat "$out/device.txt"
echo "[cuda_kernels] tests"
"$py" -m pytest -q -rs -p no:cacheprovider --noconftest -n "${WORKERS:-8}" \
  tests/test_kernels.py tests/test_page_scores.py 2>&1 | tee "$out/tests.txt"
rc=$?
echo "[cuda_kernels] benchmark"
PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" "$py" benchmarks/bench_kernels.py --device cuda \
  --repeats "${REPEATS:-20}" --out "$out/bench.json" 2>&1 | tee "$out/bench.txt" || rc=1
exit $rc
