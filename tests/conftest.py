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

from .helpers import CHECKED_ENV, POOL, RECALL_BUDGET, RECALL_HOST, RECALL_TOKENS, START_TIMEOUT, _server

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


# Module fixtures whose server several modules share: those modules run back to back
# (`pytest_collection_modifyitems`), and the server stops after the last of them, so no idle server
# waits beside the later modules' own.
SHARED = ("recall_server",)


@pytest.fixture(scope="session")
def _kept_servers() -> Iterator[dict[str, Server]]:
    """Servers a module fixture keeps for the next module, which uses it too; any still held stop here."""
    kept: dict[str, Server] = {}
    yield kept
    for srv in kept.values():
        srv.stop()


def _next_module_uses(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether the module run after this one (this session's items, in run order) uses `fixture`."""
    items = request.session.items
    mine = [i for i, it in enumerate(items) if getattr(it, "module", None) is request.module]
    later = items[mine[-1] + 1 :] if mine else []
    nxt = getattr(later[0], "module", None) if later else None
    return any(fixture in it.fixturenames for it in later if getattr(it, "module", None) is nxt)


@pytest.fixture(scope="module")
def recall_server(request: pytest.FixtureRequest, _kept_servers: dict[str, Server]) -> Iterator[Server]:
    """The host tier on: snapkv at a 64-token budget in branch scope, recall up to 64 entries per layer and
    KV head, 1,500 host columns, SGLang's metrics on. `test_recall_e2e.py` and `test_ops_e2e.py` share it:
    one start (80-150 s) instead of two."""
    srv = _kept_servers.pop("recall_server", None)
    if srv is None:
        args = ["--max-total-tokens", "20000", "--kv-policy", "snapkv", "--kv-budget", str(RECALL_BUDGET)]
        args += ["--kv-policy-config", '{"scope": "branch"}', "--kv-recall-tokens", str(RECALL_TOKENS)]
        args += ["--kv-host-tokens", str(RECALL_HOST), "--enable-metrics"]
        srv = Server(args, env=CHECKED_ENV, timeout=START_TIMEOUT).start()
    try:
        yield srv
    finally:
        alive, tail = srv.alive(), srv.tail()
        if alive and _next_module_uses(request, "recall_server"):
            _kept_servers["recall_server"] = srv
        else:
            srv.stop()
    assert alive, f"server died during the tests; log tail:\n{tail}"


def _back_to_back(items: list[pytest.Item], fixture: str) -> None:
    """The modules with a test that uses `fixture` run one after another, where the first of them ran."""
    users = {getattr(it, "module", None) for it in items if fixture in it.fixturenames} - {None}
    if len(users) < 2:
        return
    first = next(i for i, it in enumerate(items) if getattr(it, "module", None) in users)
    moved = [it for it in items if getattr(it, "module", None) in users]
    rest = [it for it in items if getattr(it, "module", None) not in users]
    items[:] = rest[:first] + moved + rest[first:]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that share a server (`SHARED`) run back to back.

    Triton cases (`triton` marker) need CUDA or Triton's interpreter. Without either, each file's
    `test_interpreter_subprocess` runs them under the interpreter (`tests/interp.py`, which checks how many
    passed), so this process deselects them rather than report them as skipped. CUDA-only tests (`cuda`
    marker) are skipped without CUDA."""
    for fixture in SHARED:
        _back_to_back(items, fixture)
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
