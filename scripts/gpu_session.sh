#!/usr/bin/env bash
# The server on a bare GPU machine in at most 10 minutes: a machine with torch and Triton and nothing
# else (no SGLang, no sgl-kernel, no FlashInfer, no network), given this working tree and gpu-bundle/
# (`make gpu-bundle` builds it here: Python 3.12 wheels, this project's wheel, an 8B-shaped Llama config
# with the embedded tokenizer; at most 64 MiB).
#
#   bash scripts/gpu_session.sh [--dry-run] [--throughput] [OUT_DIR]     # default OUT_DIR: results/gpu-session
#
# First `gpu_check.py --preflight` (every module a server imports at start that is missing here, listed
# at once; none started if any). Checks (benchmarks/gpu_check.py on SGLang's Triton attention backend with snapkv, `--load-format dummy`,
# CUDA graphs and the overlap scheduler on): greedy tokens at budget 100% equal `none`'s; compressing outputs equal
# with overlap on and off; every slot back after /flush_cache (strict memory checks on); recall at its
# defaults runs no decode-step recall. --throughput adds benchmarks/replay.py: 64 multi-turn sessions at
# once over a KV pool that holds about a quarter of them uncompressed, `none` vs snapkv, lagkv and d2o at
# budget 25%: output tokens/s and sessions running.
#
# Without sgl-kernel and FlashInfer (355.7 MiB and 96.6 MiB wheels: they do not fit), SGLang runs on
# CUDA with: the Triton attention backend, the pytorch sampler, its pure-torch op paths
# (SGLANG_FORCE_FUSED_OP_BACKEND=torch: RMSNorm, SiluAndMul, rotary in torch) and this project's
# `sgl_kernel` stand-in (sgl_kvevict/cpu_compat), which answers the names SGLang imports at module load
# and raises NotImplementedError naming any function a forward then calls. The script says which held.
#
# --dry-run (CPU; `make test-long` runs it): checks the bundle (size, and that its wheels install into a
# clean Python 3.12 target offline), starts the real server on CPU with --load-format dummy on a 2-layer
# variant of the 8B-shaped config with a policy, and sends one request. What only a GPU shows: the
# server's start on CUDA without sgl-kernel, CUDA graphs and overlap over compacted rows, the
# throughput of an 8B-shaped model.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bundle="${GPU_BUNDLE:-$here/gpu-bundle}"
dry=0 tput=0 out=""
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    --throughput) tput=1 ;;
    -*) echo "gpu_session: unknown option $a (--dry-run, --throughput)" >&2; exit 2 ;;
    *) out="$a" ;;
  esac
done
out="${out:-$here/results/gpu-session}"
mkdir -p "$out"
t0=$(date +%s)
# unpack an .xz archive or file with Python's own lzma (a bare machine may have no xz binary)
untar() { "$1" -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2], filter='data')" "$2" "$3"; }
model_dir() {  # a writable copy of the bundle's model folder, tokenizer.json unpacked
  mkdir -p "$2" && cp -r "$bundle/model/." "$2/" &&
    "$1" -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" \
      "$2/tokenizer.json.xz" "$2/tokenizer.json" && rm -f "$2/tokenizer.json.xz"
}
say() { echo "[gpu_session +$(( $(date +%s) - t0 ))s] $*" | tee -a "$out/session.txt" >&2; }
: > "$out/session.txt"

[ -f "$bundle/site.tar.xz" ] && [ -f "$bundle/model/config.json" ] || {
  echo "gpu_session: no bundle at $bundle: run \`make gpu-bundle\` on a machine with network first" >&2; exit 2; }
size=$(du -sb "$bundle" | cut -f1)
say "bundle: $(find "$bundle" -type f | wc -l) files, $(( size >> 20 )) MiB (limit 64 MiB)"
[ "$size" -le $((64 << 20)) ] || { say "FAIL: bundle over 64 MiB"; exit 1; }

if [ "$dry" = 1 ]; then
  py="${PYTHON:-$(bash "$here/scripts/env.sh")}"
  py312="${PYTHON312:-}"  # a CPython 3.12 that runs, if this machine has one (a pyenv shim may not)
  for cand in $py312 $(ls "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null) $(command -v python3.12); do
    "$cand" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null && { py312="$cand"; break; }
    py312=""
  done
  target="$(mktemp -d)"; trap 'rm -rf "$target"' EXIT
  wheels="${GPU_WHEELS:-$here/gpu-wheels}"
  if [ -d "$wheels" ]; then
    say "install check: the downloaded wheels into a clean target for CPython 3.12, offline (pip --no-index)"
    pipv="$py"; [ -n "$py312" ] && pipv="$py312"
    "$pipv" -m pip install -q --no-index --no-deps --find-links "$wheels" --target "$target/pip" \
      --python-version 3.12 --only-binary=:all: -r "$wheels/packages.txt" 2>&1 | grep -v "is ignored" >&2
    [ -d "$target/pip/sglang" ] || { say "FAIL: pip install check"; exit 1; }
    say "pip installed $(ls "$target/pip" | grep -c dist-info) distributions for 3.12"
  fi
  say "unpack check: site.tar.xz (what the GPU machine gets) and this project's wheel into a clean target"
  untar "$py" "$bundle/site.tar.xz" "$target/site" || { say "FAIL: unpack"; exit 1; }
  "$py" -m pip install -q --no-index --no-deps --upgrade --target "$target/site" "$bundle"/sgl_kvevict-*.whl 2>&1 | grep -v "is ignored" >&2
  [ -d "$target/site/sglang/srt" ] && [ -d "$target/site/sgl_kvevict" ] || { say "FAIL: unpack check"; exit 1; }
  say "unpacked $(ls "$target/site" | grep -c dist-info) distributions"
  if [ -n "$py312" ]; then  # what imports without torch (the GPU machine's, not bundled) under Python 3.12
    PYTHONPATH="$target/site" "$py312" -c "import transformers, fastapi, uvicorn, uvloop, msgspec, zmq, pydantic, \
openai, IPython, PIL, numpy, aiohttp, jsonschema, sentencepiece, tokenizers, orjson, huggingface_hub, prometheus_client, \
partial_json_parser, setproctitle, multipart, soundfile, gguf, einops, dill, pybase64, psutil, regex, yaml, loguru; \
print('python3.12 imports: ok')" 2>&1 | tail -1 | tee -a "$out/session.txt" >&2
    grep -q "python3.12 imports: ok" "$out/session.txt" || { say "FAIL: a bundled package does not import under 3.12"; exit 1; }
  fi
  small="$target/model-2l"
  model_dir "$py" "$small" || { say "FAIL: the bundle's model folder"; exit 1; }
  "$py" -c "import json, sys; p = sys.argv[1] + '/config.json'; c = json.load(open(p)); c['num_hidden_layers'] = 2; \
json.dump(c, open(p, 'w'))" "$small"
  say "CPU: the real server, --load-format dummy, the 8B shape on 2 layers, snapkv at 25%"
  PORT=${PORT:-31977}
  "$py" -m sgl_kvevict.launch --model-path "$small" --load-format dummy --kv-policy snapkv --kv-budget 0.25 \
    --max-total-tokens 4096 --port "$PORT" > "$out/dry-run-server.log" 2>&1 &
  pid=$!
  ok=0
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then ok=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 2
  done
  if [ "$ok" = 1 ]; then
    body='{"text":"The operations log says","sampling_params":{"max_new_tokens":8,"temperature":0,"ignore_eos":true}}'
    resp=$(curl -sf -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$PORT/generate")
    echo "$resp" | "$py" -c "import json,sys; r=json.load(sys.stdin); m=r['meta_info']; print('generate:', m['completion_tokens'], 'tokens, kvevict', m['kvevict'][0]['policy'])" \
      2>&1 | tee -a "$out/session.txt" >&2 || ok=0
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  [ "$ok" = 1 ] || { say "FAIL: the dummy server did not serve (see $out/dry-run-server.log)"; exit 1; }
  say "dry run passed. Only a GPU shows: SGLang starting on CUDA without sgl-kernel/FlashInfer (the stand-in"
  say "  and SGLANG_FORCE_FUSED_OP_BACKEND=torch), CUDA graphs and overlap over compacted rows, the 8B throughput"
  exit 0
fi

# ---- on the GPU machine -------------------------------------------------------------------------------
py=python3
"$py" - <<'PY' 2>&1 | tee -a "$out/session.txt" >&2 || exit 2
import importlib.util, sys, torch, triton
assert torch.cuda.is_available(), "no CUDA device is visible"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}; python {sys.version.split()[0]}, "
      f"torch {torch.__version__}, triton {triton.__version__}")
print("present:", {m: importlib.util.find_spec(m) is not None for m in ("sglang", "sgl_kernel", "flashinfer", "numpy")})
PY
venv="$here/.gpu-venv"
if [ ! -x "$venv/bin/python" ]; then
  say "venv over the machine's torch/triton (--system-site-packages), wheels from the bundle (no network)"
  "$py" -m venv --system-site-packages "$venv" || exit 2
  purelib=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  untar "$venv/bin/python" "$bundle/site.tar.xz" "$purelib" || exit 2
  # the machine's torch may sit outside the base interpreter's own site folders (a user site, a folder
  # on sys.path by other means), which a venv does not see: list every such folder after the bundle's
  "$py" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
    > "$purelib/zz_machine_site.pth"
  "$venv/bin/python" -c "import torch" 2>/dev/null || { say "FAIL: the venv does not import the machine's torch"; exit 2; }
  "$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$bundle"/sgl_kvevict-*.whl 2>&1 | tail -5 | tee -a "$out/session.txt" >&2
fi
py="$venv/bin/python"
real=$("$py" -c "import importlib.util as u; print(u.find_spec('sgl_kernel') is not None)")
if [ "$real" = True ] && "$py" -c "import sgl_kernel, sys; sys.exit(0 if getattr(sgl_kernel, 'IS_KVEVICT_STUB', False) else 1)" 2>/dev/null; then real=False; fi
if [ "$real" != True ]; then
  "$py" -m sgl_kvevict.cpu_compat install >/dev/null 2>&1
  say "sgl_kernel: the project's pure-torch stand-in (sgl_kvevict/cpu_compat; names only, ops in torch via SGLANG_FORCE_FUSED_OP_BACKEND=torch)"
  export SGLANG_FORCE_FUSED_OP_BACKEND=torch
else
  say "sgl_kernel: a real one is installed"
fi
export HF_HUB_OFFLINE=1 SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1
model="$out/model"
model_dir "$py" "$model" || exit 2
# every module missing on this machine at once, before the first of five server starts (a minute each)
say "preflight: the modules a server imports at start, here (gpu_check.py --preflight)"
"$py" "$here/benchmarks/gpu_check.py" --preflight 2>&1 | tee -a "$out/session.txt" >&2
[ "${PIPESTATUS[0]}" = 0 ] || { say "FAIL: preflight (the list above); no server started"; exit 1; }
# decode graphs up to batch 16 (the check's 16 requests): five server starts must fit in seven minutes
flags=(--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.85 --cuda-graph-max-bs-decode 16)
say "checks: gpu_check.py, triton backend, snapkv (none, 3 runs, recall), graphs and overlap on"
timeout 420 "$py" "$here/benchmarks/gpu_check.py" --model-path "$model" --backends triton --policies snapkv \
  --requests 16 --prompt-words 200 --max-new-tokens 32 --out "$out/gpu_check.json" -- "${flags[@]}" \
  2>&1 | tee "$out/gpu_check.txt" | grep -E "^\{|^backend|^triton|Error|NotImplementedError|error:" | tail -30 >&2
rc=${PIPESTATUS[0]}
missing=$(grep -o "sgl_kernel\.[a-z_0-9]* has no CPU stand-in" "$out/gpu_check.txt" | sort -u | cut -d' ' -f1)
[ -n "$missing" ] && say "the stand-in was called on CUDA for: $missing (needs a torch version or the real sgl-kernel)"
say "gpu_check exit code $rc (0 passed, 1 a check failed, 124 over its 7 minutes)"
if [ "$tput" = 1 ]; then
  # 64 sessions x (600 system + 3 turns x (~600 tool + 64 new)) ~ 64 x 2,600 tokens; the pool holds a quarter
  say "throughput: 64 sessions, 3 turns, pool 41,600 tokens (~1/4 of the sessions uncompressed)"
  timeout 900 "$py" "$here/benchmarks/replay.py" --scenarios agent --sessions 64 --concurrency 64 --turns 3 \
    --max-new-tokens 64 --tool-tokens 300,900 --system-tokens 600 --max-total-tokens 41600 \
    --policies none,snapkv,lagkv,d2o --budgets 0.25 --score none --no-stream --server-mode shared \
    --model-path "$model" --server-arg=--load-format --server-arg=dummy --server-arg=--sampling-backend \
    --server-arg=pytorch --server-arg=--attention-backend --server-arg=triton --out "$out/throughput" \
    2>&1 | tail -40 | tee "$out/throughput.txt" >&2
fi
say "done"
exit "$rc"
