"""Shared fixtures: real SGLang servers on the embedded SmolLM2, one per test session and configuration.

Every server runs with SGLang's memory-leak checks on: the idle check (on by default) and the busy check
after every batch (`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1`). A leaked or double-freed KV slot
kills the scheduler, and the next request of the test fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from sgl_kvevict.serve.serverproc import Server

from .helpers import POOL, _server

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def plain_server() -> Iterator[Server]:
    """The plugin installed but no --kv-policy flag: plain SGLang behaviour (fp32, to compare with HF exactly)."""
    yield from _server([*POOL, "--dtype", "float32"])


@pytest.fixture(scope="session")
def kv_server() -> Iterator[Server]:
    """One compressing server; tests pick other policies per request (custom_params)."""
    # A small prefill chunk: 2,000-token prompts (and reused compressed histories) go through chunked prefill.
    yield from _server([*POOL, "--kv-policy", "d2o", "--kv-budget", "256", "--chunked-prefill-size", "768"])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Triton cases (`triton` marker) need CUDA or Triton's interpreter. Without either, each file's
    `test_interpreter_subprocess` runs them under the interpreter (`tests/interp.py`, which checks how many
    passed), so this process deselects them rather than report them as skipped. CUDA-only tests (`cuda`
    marker) are skipped without CUDA."""
    if not torch.cuda.is_available():  # `cuda` tests: a visible skip, they ran nowhere here
        why = pytest.mark.skip(
            reason="needs a CUDA device: scripts/cuda_kernels.sh runs it on a GPU (docs/tests.md)"
        )
        for it in items:
            if it.get_closest_marker("cuda") is not None:
                it.add_marker(why)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    keep = [it for it in items if it.get_closest_marker("triton") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("triton")])
        items[:] = keep
