"""A compression split over scheduler steps (`--kv-compress-step-tokens`), on SGLang's real pools.

A region larger than the step's cap is planned a few layers per step while the request keeps decoding;
the plan commits when its last layer is planned. The result must be what one unsplit compression at the
start would have kept, with the tokens decoded meanwhile intact after it; a plan dropped half way
(retraction, a failure in its second step) must leave no trace.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kvevict.cache import compressor, engine
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.tree import Region

from .test_compressor_pools import (
    DECODE,
    POLICIES,
    PROMPT,
    L,
    Rank,
    _append,
    _finish_and_check_no_leak,
    _same,
    _snapshot,
    _start,
)

CAP = 100  # < the region (PROMPT tokens): with L = 2 layers, one layer per step


def _contents(rank: Rank, req) -> list[torch.Tensor]:
    """K and V of every layer as the request's row reads them (slot numbers may differ, contents not)."""
    row = rank.r2t.req_to_token[0, : req.kv.kv_committed_len].to(torch.int64)
    out = []
    for layer in range(L):
        out += [rank.kv.get_key_buffer(layer)[row], rank.kv.get_value_buffer(layer)[row]]
    return out


def _counts(req) -> tuple:
    s = st.get(req)
    return (
        req.kv.kv_committed_len,
        s.slot_map.comp_slots,
        s.slot_map.comp_tokens,
        s.slot_map.own_evicted,
        s.slot_map.offset,
        s.failed,
    )


@pytest.mark.parametrize("share_prompt", [False, True], ids=["own", "tree-shared"])
@pytest.mark.parametrize("policy,config", POLICIES, ids=[f"{p}{c or ''}" for p, c in POLICIES])
def test_split_equals_one_step_then_decode(policy: str, config: dict, share_prompt: bool) -> None:
    # reference: one compression right after prefill, then one decode token
    ref = Rank(slice(0, 4))
    r = _start(ref, policy, config, share_prompt)
    assert engine.compress_batch([(r, "prefill")], None)[0] > 0
    ref.activate()
    _append(ref, r, PROMPT)
    want, want_counts = _contents(ref, r), _counts(r)

    # split: the first step plans layer 0 only and commits nothing; the request decodes one token; the
    # second step plans layer 1 (against the region and queries of the first) and commits
    rank = Rank(slice(0, 4))
    req = _start(rank, policy, config, share_prompt)
    before = _snapshot(rank, req)
    assert engine.compress_batch([(req, "prefill")], CAP) == [0]
    s = st.get(req)
    assert s.pending is not None and len(s.pending.keeps) == 1
    assert _same(before, _snapshot(rank, req)), "a pending plan changed the row, the tree, the pool or KV"
    assert rank.rt.totals.compressions_split == 1
    rank.activate()
    _append(rank, req, PROMPT)
    freed = engine.compress_batch([(req, "decode")], CAP)[0]
    assert s.pending is None and freed > 0
    assert _counts(req) == want_counts
    for x, y in zip(_contents(rank, req), want, strict=True):
        assert torch.equal(x, y)
    assert int(rank.tree.offsets[0]) == s.slot_map.offset
    # it goes on decoding and compressing, then finishes without leaking a slot
    for pos in range(PROMPT + 1, PROMPT + DECODE):
        rank.activate()
        _append(rank, req, pos)
        engine.compress_batch([(req, "decode")], CAP)
    req.done = True
    compressor.safe_compress(req, "finish")
    assert s.pending is None and not s.failed
    _finish_and_check_no_leak(rank, req, rank.alloc.alloc(0))


def test_retraction_drops_a_pending_plan() -> None:
    rank = Rank(slice(0, 4))
    req = _start(rank, "d2o", {}, share_prompt=False)
    s = st.get(req)
    engine.compress_batch([(req, "prefill")], CAP)
    assert s.pending is not None
    assert s.pending.states[0], "D2O's plan keeps per-layer state (its threshold)"
    assert not any(s.policy_state.layers), (
        "...in copies: the request's own state is untouched until the commit"
    )
    # re-admission after a retraction
    st.on_match(req, rank.tree.ctx, Region(rank.tree.root_node, 0, 0, None))
    assert s.pending is None and not any(s.policy_state.layers)


def test_failure_in_a_later_step_changes_nothing(monkeypatch) -> None:
    rank = Rank(slice(0, 4))
    req = _start(rank, "criticalkv", {}, share_prompt=True)
    before = _snapshot(rank, req)
    engine.compress_batch([(req, "prefill")], CAP)
    s = st.get(req)
    assert s.pending is not None

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure in the second step")

    monkeypatch.setattr(s.policy, "select", boom)
    assert engine.compress_batch([(req, "decode")], CAP) == [0]
    assert s.failed and s.pending is None and rank.rt.totals.policy_failures == 1
    assert _same(before, _snapshot(rank, req))


def test_finish_completes_a_pending_plan() -> None:
    rank = Rank(slice(0, 4))
    req = _start(rank, "snapkv", {}, share_prompt=False)
    engine.compress_batch([(req, "prefill")], CAP)
    s = st.get(req)
    assert s.pending is not None
    req.done = True
    assert compressor.safe_compress(req, "finish") > 0
    assert s.pending is None and s.counters.compressions == 1
