#!/usr/bin/env bash
# What scripts/gpu_session.sh installs on a bare GPU machine with no network (it has torch and Triton, no
# SGLang, no sgl-kernel, no FlashInfer): the Python 3.12 wheels below, downloaded here into
# gpu-wheels/ (git-ignored, not carried), unpacked and packed again as one xz archive (gpu-bundle/site.tar.xz:
# the wheels are 119 MiB as downloaded, over the 64 MiB that can be carried; SGLang's benchmark, gRPC,
# multimodal and Rust-server extensions, its diffusion package and tests are left out), this project's
# wheel, and an 8B-shaped Llama model folder (config only: weights are SGLang's `--load-format dummy`)
# with the embedded SmolLM2 tokenizer. Writes gpu-bundle/ (git-ignored) and prints its size; fails above
# 64 MiB.
#
#   bash scripts/gpu_bundle.sh            # or: make gpu-bundle
#
# Not bundled, with their sizes on PyPI: sglang-kernel 0.4.10 (x86_64: 355.7 MiB) and flashinfer-python
# (96.6 MiB): neither fits. SGLang runs without them on CUDA only with its Triton attention backend, the
# pytorch sampler, its pure-torch op paths (SGLANG_FORCE_FUSED_OP_BACKEND=torch) and this project's
# `sgl_kernel` stand-in for the names SGLang imports (sgl_kvevict/cpu_compat): what gpu_session.sh checks.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/gpu-bundle"
wheels="$here/gpu-wheels"
py="${PYTHON:-python3}"
limit=$((64 << 20))
rm -rf "$out" "$wheels"; mkdir -p "$out/model" "$wheels"
# sglang's own pins that run on torch 2.11 (the GPU machine's), with --no-deps: torch, triton and the
# NVIDIA libraries are the machine's; multimodal, datasets, router and dev tools are left out.
pkgs=(
  sglang==0.5.23 transformers==5.19.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0
  numpy==2.4.6 regex==2026.11.15 PyYAML==6.0.3 tqdm==4.70.1 packaging==26.3 requests==2.34.2
  urllib3==2.8.0 idna==3.20 certifi==2026.10.18 charset-normalizer==3.5.2 filelock==4.2.11 fsspec==2026.9.0
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 pillow==13.0.0 fastapi==0.165.0 starlette==1.10.0
  annotated-doc==0.0.7 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 typing_extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 h11==0.16.0
  uvicorn==0.54.0 uvloop==0.23.0 msgspec==0.22.0 pyzmq==27.3.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1
  aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf==0.19.0
  einops==0.8.2 openai==2.8.0 distro==1.9.0 httpx==0.28.1 httpcore==1.0.9 jiter==0.19.0
  partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 jsonschema==4.26.0 referencing==0.37.0
  rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 xgrammar==0.2.7 python-multipart==0.0.34
  prometheus_client==0.26.0 opentelemetry-api==1.45.2 click==8.5.1 ipython==9.18.1 traitlets==5.16.1 decorator pygments==2.21.0
  prompt_toolkit==3.0.53 wcwidth==0.9.4 pexpect==4.9.0 ptyprocess==0.7.0
  stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 matplotlib-inline==0.2.2
  ipython_pygments_lexers==1.1.1 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 Jinja2==3.1.6
  MarkupSafe==3.0.4 loguru==0.7.3
)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$wheels" "${pkgs[@]}" 2>&1 | grep -v "is ignored" >&2 || true
printf '%s\n' "${pkgs[@]}" > "$wheels/packages.txt"
site="$(mktemp -d)"; trap 'rm -rf "$site"' EXIT
"$py" - "$wheels" "$site" <<'PY'
import sys, zipfile
from pathlib import Path
# parts of the sglang wheel a text model served over HTTP never loads
SKIP = ("sglang/multimodal_gen/", "sglang/test/", "sglang/srt/rust_extensions/_")
# this project comes as its own wheel, installed over the archive (gpu_session.sh)
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            if not (whl.name.startswith("sglang-") and info.filename.startswith(SKIP)):
                z.extract(info, sys.argv[2])
PY
tar -C "$site" -cf - . | xz -6 -T0 > "$out/site.tar.xz"
PYTHON="$py" bash "$here/scripts/wheel.sh" "$out" >/dev/null
"$py" -m sgl_kvevict.gpu_model "$out/model" >&2
xz -9 "$out/model/tokenizer.json"
size=$(du -sb "$out" | cut -f1)
printf '[gpu-bundle] %s: %d files, %.1f MiB (limit 64 MiB)\n' "$out" "$(find "$out" -type f | wc -l)" \
  "$(echo "$size / 1048576" | bc -l)" >&2
du -sb "$out"/* "$out"/model/* | sort -n -r | head -6 | awk '{printf "  %7.1f MiB  %s\n", $1/1048576, $2}' >&2
[ "$size" -le "$limit" ] || { echo "[gpu-bundle] over 64 MiB" >&2; exit 1; }
