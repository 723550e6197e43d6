"""The GPU-machine side: the sizing table the docs show, the 8B-shaped dummy model, the `sgl_kernel`
stand-in's CUDA import, and scripts/gpu_session.sh's CPU dry run (`long`): the bundle a bare GPU machine
gets (at most 64 MiB) unpacks and its wheels install for CPython 3.12 offline, and the real server starts on
CPU with `--load-format dummy` on the 8B-shaped config (2 layers) under a policy and answers. The dry run
builds the bundle first when it is missing (`scripts/gpu_bundle.sh`: downloads from PyPI, ~12 min on 2
cores)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_sizing_table_in_the_docs_is_the_commands_output() -> None:
    """docs/deployment.md's sizing table is `python -m sgl_kvevict.sizing`'s output, and its SmolLM2 row is
    the embedded model's own config.json read the way the start check reads a model."""
    import json

    from sgl_kvevict import sizing
    from sgl_kvevict.model import default_model_path

    doc = (ROOT / "docs" / "deployment.md").read_text()
    out = subprocess.run(
        [sys.executable, "-m", "sgl_kvevict.sizing"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() in doc
    cfg = json.loads((default_model_path() / "config.json").read_text())
    own = sizing.shape_of(cfg, name="SmolLM2-135M")
    assert own == sizing.MODELS[0]
    # a size in bytes comes back as the most columns that fit in it
    for shape in sizing.MODELS:
        cols = sizing.columns_for_bytes(1.5 * sizing.GIB, shape)
        assert sizing.host_bytes(shape, cols) <= 1.5 * sizing.GIB < sizing.host_bytes(shape, cols + 1)


def test_the_default_host_tier_follows_the_device_pool() -> None:
    """Without a size flag the host tier is twice the device pool's tokens, capped by a quarter of the RAM
    and by the column bound, and never empty."""
    from sgl_kvevict import sizing
    from sgl_kvevict.config import MAX_HOST_TOKENS

    shape = sizing.MODELS[0]
    assert sizing.default_columns(60000, shape, None) == 120000
    assert sizing.default_columns(60000, shape, 64 * sizing.GIB) == 120000
    small_ram = 1 * sizing.GIB  # a quarter of it holds fewer than 120,000 columns of 22 KiB
    cols = sizing.default_columns(60000, shape, small_ram)
    assert sizing.host_bytes(shape, cols) <= small_ram // 4 < sizing.host_bytes(shape, cols + 1)
    assert sizing.default_columns(MAX_HOST_TOKENS, shape, None) == MAX_HOST_TOKENS
    assert sizing.default_columns(0, shape, None) == 1


def test_the_dummy_model_is_8b_shaped_with_the_embedded_tokenizer(tmp_path: Path) -> None:
    import json

    from sgl_kvevict import gpu_model, sizing
    from sgl_kvevict.model import default_model_path

    gpu_model.write(tmp_path, layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    shape = sizing.shape_of(cfg)
    ref = sizing.MODELS[1]
    assert (shape.q_heads, shape.kv_heads, shape.head_dim, shape.layers) == (
        ref.q_heads,
        ref.kv_heads,
        ref.head_dim,
        2,
    )
    src = default_model_path()
    assert cfg["vocab_size"] == json.loads((src / "config.json").read_text())["vocab_size"]
    assert (tmp_path / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_the_stand_in_answers_what_sglang_imports_on_cuda() -> None:
    """Without a real sgl-kernel, the submodules SGLang imports at module load on CUDA (`utils`,
    `quantization`, `kvcacheio`) come from the stand-in, and those it imports inside a try do not."""
    import importlib

    from sgl_kvevict import cpu_compat

    if cpu_compat.real_sgl_kernel_present():
        pytest.skip("a real sgl_kernel is installed here")
    utils = importlib.import_module("sgl_kernel.utils")
    assert utils.is_arch_support_pdl() is False
    with pytest.raises(NotImplementedError, match="sgl_kernel.rmsnorm"):
        importlib.import_module("sgl_kernel").rmsnorm(None)
    quantization = importlib.import_module("sgl_kernel.quantization")
    with pytest.raises(NotImplementedError, match="ggml_dequantize"):
        quantization.ggml_dequantize(None)
    assert callable(importlib.import_module("sgl_kernel.kvcacheio").transfer_kv_per_layer)
    for guarded in ("sgl_kernel.bf16_linear", "sgl_kernel.allreduce", "sgl_kernel.flash_attn"):
        with pytest.raises(ImportError):  # SGLang imports these inside a try: its fallback must run
            importlib.import_module(guarded)


@pytest.mark.long
@pytest.mark.server
def test_gpu_session_dry_run_passes_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    if not (ROOT / "gpu-bundle" / "site.tar.xz").exists():
        subprocess.run(["bash", "scripts/gpu_bundle.sh"], cwd=ROOT, env=env, check=True, timeout=3600)
    res = subprocess.run(
        ["bash", "scripts/gpu_session.sh", "--dry-run", str(tmp_path / "out")],
        cwd=ROOT,
        env={**env, "PORT": "31977"},
        capture_output=True,
        text=True,
        timeout=3600,  # 22 min on a loaded 2-core machine: 7 for the 3.12 install, 13 for the server
    )
    log = res.stderr
    assert res.returncode == 0, log[-4000:]
    mib = int(re.search(r"bundle: \d+ files, (\d+) MiB", log).group(1))
    assert 0 < mib <= 64
    assert "unpacked" in log and "dry run passed" in log
    assert re.search(r"generate: 8 tokens, kvevict snapkv", log), log[-3000:]
    assert (tmp_path / "out" / "session.txt").read_text().count("[gpu_session") >= 4
