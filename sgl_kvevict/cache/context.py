"""One server's state beyond the tree, owned by its `KvEvictRadixCache` (`tree.ctx`).

Everything a compression, a recall or a forward hook touches that is not a request's own (`ReqState`) or
the tree's: the runtime (pools, model shapes, `o_proj`, totals), the host tier, the window-query capture
store, the per-slot ||v W_O||_1 statistic, the server's config and settings, and the recalls armed for
the next forward. Nothing of it lives in a module global, so two caches in one process (the offline
`sgl.Engine`, tests, benchmarks) never share any of it.

How each place reaches it:
- the tree and everything given the tree: `tree.ctx`;
- everything given a request (or its state): `ReqState.ctx`, set when the tree first matches it;
- the scheduler hooks: the batch's or the scheduler's `tree_cache`;
- the forward hooks (`RadixAttention.forward`), which see only the forward batch: `for_pool`, the
  context registered for the batch's request-row pool. A context may be created there first (a CUDA
  graph warm-up runs a forward before the scheduler builds its tree); the tree then adopts it.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sgl_kvevict.config import KvConfig, ServerSettings, server_config, server_settings


@dataclass(eq=False)
class KvEvictContext:
    """One server's state beyond the tree and its requests (see the module)."""

    server: KvConfig = field(default_factory=server_config)  # the server-wide policy config
    settings: ServerSettings = field(default_factory=server_settings)  # operator settings (--kv-*)
    # The fields below hold objects of the modules that use this one (typed `Any` so that this module
    # imports none of them: it sits under all of them, `tests/test_layout.py`).
    rt: Any = None  # runtime.Runtime, set when the scheduler attaches (`runtime.attach`)
    host: Any = None  # host.HostPool, the host tier, when recall is on
    evictions: Any = None  # eviction.EvictionSink where compressions' evicted entries go (None: dropped)
    capture: Any = None  # capture.Store, the window-query capture store, built once (`capture.build`)
    capture_conf: tuple[int, int] | None = None  # (window, slots) the server's requests may need
    slot_stats: Any = None  # slotstats.SlotStats, CriticalKV's per-slot statistic, when one can use it
    decode_armed: dict[int, Any] = field(default_factory=dict)  # request row -> decode_recall.DecodeArm
    exact_armed: dict[int, Any] = field(default_factory=dict)  # request row -> exact_prefill.ExactArm
    step_plan: Any = None  # decode_recall.StepPlan the next decode forward runs (None: it recalls nothing)
    # One entry per prepared decode step whose results are not processed yet, oldest first: its StepPlan
    # or None. Under the overlap scheduler step N+1 is prepared (and run) before step N's results are
    # processed, so two may be in flight; each is finished when its own step's results are.
    steps_in_flight: deque[Any] = field(default_factory=deque)
    # (batch, row width, host columns, swaps) -> the bucket's decode_recall.StepBuffers (one per step in flight)
    step_buffers: dict[tuple[int, int, int, int], list[Any]] = field(default_factory=dict)
    # Set once a decode forward ran without the recall hook (a CUDA graph replay runs no Python):
    # decode-time recalls then run after the step's compression instead.
    graphed: bool = False
    # The forward batch the recall hook last ran in (weakly held) and its requests' `(row, first token,
    # tokens)`, so that they are computed once per forward (`batch_rows`).
    forward_rows: tuple[weakref.ref, list[tuple[int, int, int]]] | None = None

    def __post_init__(self) -> None:
        s = self.settings
        if self.capture_conf is None and s.capture_window is not None:
            self.capture_conf = (s.capture_window, s.capture_slots)

    @property
    def stats(self) -> Any:
        """The per-slot statistic's buffer (a tensor `[layers, pool slots, KV heads]`), None when off."""
        return None if self.slot_stats is None else self.slot_stats.buf


# Registry: a request-row pool -> the context of the server over it (weak: a pool that goes, goes).
_BY_POOL: weakref.WeakKeyDictionary[Any, KvEvictContext] = weakref.WeakKeyDictionary()


def for_pool(req_to_token_pool: Any) -> KvEvictContext:
    """The context of the server whose request rows live in `req_to_token_pool` (created on first use)."""
    ctx = _BY_POOL.get(req_to_token_pool)
    if ctx is None:
        ctx = _BY_POOL[req_to_token_pool] = KvEvictContext()
    return ctx


def find(req_to_token_pool: Any) -> KvEvictContext | None:
    """The context registered for `req_to_token_pool`, None when no server registered it."""
    return _BY_POOL.get(req_to_token_pool)


def registered() -> list[KvEvictContext]:
    """Every context alive in this process (one per server; tests may hold several)."""
    return list(_BY_POOL.values())


def of_forward(forward_batch: Any) -> KvEvictContext | None:
    """The context a forward pass belongs to, None when no server registered its row pool."""
    from sglang.srt.model_executor import forward_context as fc

    if fc.has_forward_context():
        pool = fc.get_attn_backend().req_to_token_pool
    else:
        pool = forward_batch.req_to_token_pool
    return find(pool)


def batch_rows(ctx: KvEvictContext, forward_batch: Any) -> list[tuple[int, int, int]]:
    """`(row, first token, tokens)` per request of an extend batch, computed once per forward (at its
    first layer with a request armed; its later layers find them in the context). The prefill's
    attention over both tiers uses them; a decode step's recall (`decode_recall`) needs none."""
    held = ctx.forward_rows
    if held is not None and held[0]() is forward_batch:
        return held[1]
    lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
    starts = [0, *itertools.accumulate(lens)][: len(lens)]
    rows = list(zip(forward_batch.req_pool_indices.tolist(), starts, lens, strict=True))
    ctx.forward_rows = (weakref.ref(forward_batch), rows)
    return rows
