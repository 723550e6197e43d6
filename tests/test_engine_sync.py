"""The batched compression step on SGLang's real pools against a naive reference, and no host
synchronisation inside it.

The reference is written here from the formulas of `docs/policies.md` and each policy's docstring, in
plain torch (the window attention and LagKV's score are `tests/naive.py`'s, the ones `test_policies.py`
and `test_kernels.py` check against too): one request, one layer and one KV head at a time, over the
region's K/V read back from the pool before the step and the request's captured window queries. The
step under test is the one the server runs (`hooks._compress_batch`: the engine's single call per
scheduler step), on requests of different lengths, twice: the second step combines the scores the first
one carried. After each step every (request, layer, KV head) must hold exactly the reference's kept
tokens, in position order, each with its own K and V; the freed slots and the position offsets must add
up. Where scores tie (the
plateaus of max-pooling) or lie within float rounding of the top-k boundary, either token may be kept:
the policies rank by score and define no order among equal ones.

A host sync (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, a data-dependent shape) stalls the GPU stream
at every compression; `SyncCounter` counts what would stall on CUDA while running here on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import Field

from sgl_kvevict.cache import engine, report, trigger
from sgl_kvevict.cache import state as st
from sgl_kvevict.policies import REGISTRY, LayerView, Policy, PolicyConfig
from sgl_kvevict.policies.base import BatchView
from sgl_kvevict.serve import hooks
from sgl_kvevict.tools.pools import Pools, SyncCounter

from . import naive

LAYERS, TOKENS, BUDGET, GROW = 3, 160, 48, 40
CONFIGS = {
    "streaming": {},
    "knorm": {},
    "h2o": {"window": 8},
    "snapkv": {"window": 8},
    "snapkv-max": {"window": 8, "pooling": "max"},
    "h2o-decay": {"window": 8, "carry": "decay"},
    "h2o-none": {"window": 8, "carry": "none"},
}
# Configs whose scores tie at the top-k boundary (max-pooling makes plateaus of equal scores): the
# scenario must meet such ties. Every other config must meet none: its kept sets are the reference's,
# up to two scores closer than float32 can tell apart.
TIES = {"snapkv-max"}
# Relative distance from the top-k boundary within which the step's float32 scores and the reference's
# float64 ones may order two tokens differently.
ROUNDING = 1e-5
FALLBACK = "batched compression failed"
# Policies whose step still syncs, and why (their per-policy costs are another part of the same work).
STILL_SYNCING = {
    "graphkv": "per-request path (refiner over a base policy)",
    "criticalkv": "per-request path (refiner over a base policy)",
}


def _name(key: str) -> str:
    return key.split("-")[0]


# ---------------------------------------------------------------- the reference


@dataclass
class Before:
    """One request just before a step, as the reference reads it. Its region is its whole row."""

    n: int  # region slots
    tokens: int  # logical length (slots + evicted tokens)
    evicted: int
    comp: int  # the compacted part of the region
    k: list[torch.Tensor]  # per layer `[n, Hkv, D]` float64, the row's K (per head: its own tokens)
    v: list[torch.Tensor]
    q: list[torch.Tensor] | None  # per layer `[Hq, W, D]` float64: the last W captured queries, oldest first


def _before(pools: Pools, batch: Any, window: int | None) -> list[Before]:
    out = []
    for r in batch.reqs:
        s = st.get(r)
        assert s.slot_map.anchor_kv == 0 and s.slot_map.anchor_tokens == 0, "the region is the whole row"
        n, row = r.kv.kv_committed_len, r.kv.req_pool_idx
        slots = pools.r2t.req_to_token[row, :n].long()
        q = None
        if window is not None:  # the capture's ring: the query of logical position p sits at p mod ring
            e, length = pools.store.entries[row], n + s.slot_map.own_evicted
            at = torch.tensor([p % e.ring for p in range(length - window, length)])
            q = [pools.store.buf[e.slot, layer, at].transpose(0, 1).double() for layer in range(LAYERS)]
        out.append(
            Before(
                n=n,
                tokens=n + s.slot_map.own_evicted,
                evicted=s.slot_map.own_evicted,
                comp=s.slot_map.comp_slots,
                k=[pools.kv.get_key_buffer(layer)[slots].double() for layer in range(LAYERS)],
                v=[pools.kv.get_value_buffer(layer)[slots].double() for layer in range(LAYERS)],
                q=q,
            )
        )
    return out


def _counts(cfg: Any, budget: int | float, bf: Before) -> tuple[int, int, int]:
    """(sinks, recent, budget) of the region: a token budget is candidates beyond the windows; a ratio
    is of the request's own tokens, windows included."""
    n_sink = min(cfg.sinks, bf.n)
    n_recent = min(cfg.recent, bf.n - n_sink)
    if isinstance(budget, int):
        return n_sink, n_recent, budget
    return n_sink, n_recent, max(0, int(round(budget * (bf.n + bf.evicted))) - n_sink - n_recent)


def _pool(a: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """A centred window of `kernel` along the tokens: the max of the tokens it covers, or their sum over
    `kernel` (average pooling whose zero padding counts)."""
    half, n = kernel // 2, len(a)
    out = torch.empty_like(a)
    for j in range(n):
        part = a[max(0, j - half) : min(n, j + half + 1)]
        out[j] = part.max() if how == "max" else part.sum() / kernel
    return out


def _scores(name: str, cfg: Any, bf: Before, layer: int, head: int, scale: float) -> torch.Tensor:
    """`[n]` one KV head's scores, higher = keep (each policy's docstring)."""
    keys = bf.k[layer][:, head]
    if name == "streaming":
        return torch.arange(bf.n, dtype=torch.float64)  # the newest candidates
    if name == "knorm":
        return -keys.norm(dim=-1)
    if name == VNormPolicy.name:
        return bf.v[layer][:, head].norm(p=cfg.power, dim=-1)
    assert bf.q is not None
    g = bf.q[layer].shape[0] // bf.k[layer].shape[1]
    q = bf.q[layer][head * g : (head + 1) * g]  # this KV head's G query heads
    attn = naive.window_attention(q, keys[:, None], scale, causal=True)[0]
    if name == "h2o":
        return attn * cfg.window
    assert name == "snapkv"
    return _pool(attn, cfg.kernel_size, cfg.pooling)


def _carry(cfg: Any, new: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """A kept token's earlier score (the region's first tokens are the kept ones, in order) combined with
    its new one: the larger ('max'), or new + carry_decay * earlier ('decay'); 'none': the new alone."""
    if old is None or cfg.carry == "none":
        return new
    m = min(len(old), len(new))
    out = new.clone()
    if cfg.carry == "max":
        out[:m] = torch.maximum(new[:m], old[:m])
    else:
        out[:m] = new[:m] + cfg.carry_decay * old[:m]
    return out


def _check_topk(scores: torch.Tensor, kept: list[int], n_sink: int, n_recent: int, budget: int) -> bool:
    """The sinks, the recent window and the `budget` best-scored candidates are kept (the reference's
    top-k, up to ties at its boundary: equal scores, or scores within float rounding of it). Returns
    whether two candidates at the boundary score exactly the same."""
    n = len(scores)
    fixed = set(range(n_sink)) | set(range(n - n_recent, n))
    cand = list(range(n_sink, n - n_recent))
    b = min(budget, len(cand))
    got = set(kept)
    assert fixed <= got, "a sink or a recent token was evicted"
    chosen = got - fixed
    assert len(chosen) == b and len(kept) == len(fixed) + b, (len(chosen), b)
    if b in (0, len(cand)):
        return False
    ranked = sorted(cand, key=lambda j: -float(scores[j]))
    edge = float(scores[ranked[b - 1]])
    tol = ROUNDING * abs(edge)
    above = {j for j in cand if float(scores[j]) > edge + tol}
    near = {j for j in cand if abs(float(scores[j]) - edge) <= tol}
    assert above <= chosen, f"evicted, though above the boundary: {sorted(above - chosen)}"
    assert chosen <= above | near, f"kept, though below the boundary: {sorted(chosen - above - near)}"
    return len({float(scores[j]) for j in near}) < len(near)  # two candidates score the same


def _kept(before_k: torch.Tensor, before_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[int]:
    """Which tokens of the region one (layer, KV head) holds after the step: each row's K found among
    the rows before (random K: every row is unique), its V the same token's, in position order."""
    same = (k[:, None, :] == before_k[None, :, :]).all(-1)  # [k, n]
    assert bool((same.sum(1) == 1).all()), "a row holds K that no region token had"
    idx = same.double().argmax(1)
    assert torch.equal(v, before_v[idx]), "a row's V is not its token's"
    out = idx.tolist()
    assert out == sorted(set(out)), "kept tokens out of position order"
    return out


def _after(pools: Pools, r: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = pools.r2t.req_to_token[r.kv.req_pool_idx, : r.kv.kv_committed_len].long()
    return pools.kv.get_key_buffer(layer)[slots].double(), pools.kv.get_value_buffer(layer)[slots].double()


def _grow(pools: Pools, batch: Any, by: int) -> None:
    """Every request decodes `by` tokens: fresh slots, their K/V written as a forward would (a freed slot
    still holds the K/V of a token that moved)."""
    for i, r in enumerate(batch.reqs):
        kv = r.kv
        new = pools.alloc.alloc(by)
        for layer in range(LAYERS):
            for buf in (pools.kv.get_key_buffer(layer), pools.kv.get_value_buffer(layer)):
                buf[new] = torch.randn(by, *buf.shape[1:], generator=pools.gen).to(buf.dtype)
        pools.r2t.req_to_token[i, kv.kv_committed_len : kv.kv_committed_len + by] = new.to(torch.int32)
        kv.kv_committed_len = kv.kv_allocated_len = kv.kv_committed_len + by


def _step(pools: Pools, batch: Any, caplog: pytest.LogCaptureFixture) -> list[bool]:
    """The server's step over the batch, on the batched path (no per-request fallback); returns which
    requests the trigger picked."""
    jobs = [trigger.prepare(r, "decode") for r in batch.reqs]
    assert all(engine._policy_key(j) is not None for j in jobs if j is not None), "batched path"
    hooks._compress_batch(batch)
    assert FALLBACK not in caplog.text, "the batched step fell back to the per-request path"
    return [j is not None for j in jobs]


def _check_totals(pools: Pools, batch: Any, before: list[Before], free: int) -> None:
    """Freed slots back in the allocator; each request's position offset is its evicted count."""
    freed = sum(bf.n - r.kv.kv_committed_len for r, bf in zip(batch.reqs, before, strict=True))
    assert pools.alloc.available_size() == free + freed
    for r, bf in zip(batch.reqs, before, strict=True):
        assert int(pools.tree.offsets[r.kv.req_pool_idx]) == bf.tokens - r.kv.kv_committed_len


# ---------------------------------------------------------------- top-k policies


def _against_reference(name: str, config: dict, caplog: pytest.LogCaptureFixture) -> int:
    """Ragged requests, two batched steps, every kept set against the reference; returns at how many
    (request, layer, head) top-k boundaries two scores were equal."""
    pools = Pools(layers=LAYERS, max_reqs=4, max_len=TOKENS + 8, seed=3)
    b = pools.batch(4, TOKENS, name, BUDGET, config)
    for i, r in enumerate(b.reqs):  # ragged: shorten the first requests
        r.kv.kv_committed_len = r.kv.kv_allocated_len = TOKENS - 9 * i
    pol = st.get(b.reqs[0]).policy
    cfg, heads = pol.config, pools.kv_heads
    window = cfg.window if "attn" in pol.needs else None
    carries = hasattr(cfg, "carry")
    carried: list[list[torch.Tensor | None]] = [[None] * LAYERS for _ in b.reqs]  # the reference's own
    ties = 0
    for _ in range(2):
        before, free = _before(pools, b, window), pools.alloc.available_size()
        picked = _step(pools, b, caplog)
        for i, (r, bf) in enumerate(zip(b.reqs, before, strict=True)):
            n_sink, n_recent, budget = _counts(cfg, BUDGET, bf)
            fires = bf.n - n_sink - n_recent > budget + cfg.interval  # the decode trigger
            assert picked[i] == fires and fires, "every request compresses at both steps"
            s = st.get(r)
            for layer in range(LAYERS):
                k, v = _after(pools, r, layer)
                kept_scores = []
                for h in range(heads):
                    kept = _kept(bf.k[layer][:, h], bf.v[layer][:, h], k[:, h], v[:, h])
                    scores = _scores(name, cfg, bf, layer, h, pools.rt.scale)
                    if carries:
                        old = carried[i][layer]
                        scores = _carry(cfg, scores, None if old is None else old[h])
                    ties += _check_topk(scores, kept, n_sink, n_recent, budget)
                    kept_scores.append(scores[kept])
                got = s.policy_state.layers[layer].get("carried")
                assert (got is not None) == carries
                if carries:
                    carried[i][layer] = want = torch.stack(kept_scores)
                    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-7)
        _check_totals(pools, b, before, free)
        _grow(pools, b, GROW)
    return ties


@pytest.mark.parametrize("key", list(CONFIGS))
def test_batched_step_matches_reference(key: str, caplog: pytest.LogCaptureFixture) -> None:
    ties = _against_reference(_name(key), CONFIGS[key], caplog)
    assert (ties > 0) == (key in TIES), f"{ties} boundaries with equal scores"


class VNormConfig(PolicyConfig):
    power: float = Field(2.0, gt=0, le=8)


class VNormPolicy(Policy):
    """A new policy written as docs/contributing.md shows: `score_batch` and `batchable`."""

    name = "test_vnorm"
    Config = VNormConfig
    batchable = True

    def score_batch(self, batch: BatchView) -> torch.Tensor:
        R, L, H, n = batch.shape  # noqa: N806
        flat = batch.slots.reshape(-1)
        norms = [v.index_select(0, flat).float().norm(p=self.config.power, dim=-1) for v in batch.v_buffers]
        return torch.stack(norms).view(L, R, n, H).permute(1, 0, 3, 2)


def test_a_new_policy_is_on_the_fast_path(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """A policy the engine has never heard of, registered by name: batched because it declares it, and
    keeping what its formula says. A subclass that changes `score` alone is not batchable."""
    monkeypatch.setitem(REGISTRY, VNormPolicy.name, VNormPolicy)
    assert _against_reference(VNormPolicy.name, {"power": 1.0}, caplog) == 0

    class Changed(VNormPolicy):
        def score(self, view: LayerView) -> torch.Tensor:
            return -super().score(view)

    assert VNormPolicy.batchable and not Changed.batchable


@pytest.mark.parametrize("key", list(CONFIGS))
def test_batched_step_has_no_host_sync(key: str, caplog: pytest.LogCaptureFixture) -> None:
    pools = Pools(layers=LAYERS, max_reqs=8, max_len=TOKENS + 8)
    b = pools.batch(8, TOKENS, _name(key), 48, CONFIGS[key])
    b.reqs[0].kv.kv_committed_len = b.reqs[0].kv.kv_allocated_len = TOKENS - 20  # ragged
    assert all(engine._policy_key(trigger.prepare(r, "decode")) is not None for r in b.reqs)
    with SyncCounter() as sc:
        freed = engine.compress_batch([(r, "decode") for r in b.reqs])
    assert FALLBACK not in caplog.text, "the batched step fell back to the per-request path"
    assert all(f > 0 for f in freed), "every request compressed"
    assert sc.counts == {}, f"host syncs in the batched step: {sc.counts}"


# D2O with its merge takes the per-request path, but that path no longer syncs either.
D2O_CONFIGS = {
    "d2o": {"window": 8, "merge": True},
    "d2o-accumulated-mean": {"window": 8, "scores": "accumulated", "threshold": "mean", "merge": True},
}


@pytest.mark.parametrize("key", list(D2O_CONFIGS))
def test_d2o_step_has_no_host_sync(key: str) -> None:
    """D2O's score, select, merge and the runner's bookkeeping around it: no host sync, at the first
    compression (threshold initialised) and at a decode-time one (EMA), while tokens really merge. The
    merged count and the density statistics are read only afterwards, where they are reported."""
    pools = Pools(layers=LAYERS, max_reqs=4, max_len=TOKENS + 48)
    b = pools.batch(4, TOKENS, "d2o", 48, D2O_CONFIGS[key])
    b.reqs[0].kv.kv_committed_len = b.reqs[0].kv.kv_allocated_len = TOKENS - 20  # ragged
    assert all(engine._policy_key(trigger.prepare(r, "decode")) is None for r in b.reqs)
    for step in range(2):
        with SyncCounter() as sc:
            freed = engine.compress_batch([(r, "decode") for r in b.reqs])
        assert all(f > 0 for f in freed), f"step {step}: every request compressed"
        assert sc.counts == {}, f"step {step}: host syncs in D2O's step: {sc.counts}"
        for i, r in enumerate(b.reqs):  # grow every request past the trigger again
            kv = r.kv
            new = pools.alloc.alloc(40)
            pools.r2t.req_to_token[i, kv.kv_committed_len : kv.kv_committed_len + 40] = new.to(torch.int32)
            kv.kv_committed_len = kv.kv_allocated_len = kv.kv_committed_len + 40
    for r in b.reqs:
        s = st.get(r)
        assert s.counters.compressions == 2 and all("tau" in d for d in s.policy_state.layers)
        rep = report.stats(r)
        assert rep["merged"] == s.policy_state.merged > 0
        assert len(rep["layer_d2o_sigma2"]) == LAYERS and all(x > 0 for x in rep["layer_d2o_sigma2"])
    assert pools.rt.totals.tokens_merged == sum(st.get(r).policy_state.merged for r in b.reqs)


@pytest.mark.parametrize("name", sorted(STILL_SYNCING))
def test_still_syncing_policies_are_listed(name: str) -> None:
    """The list above stays honest: a policy named there really takes the per-request path."""
    pools = Pools(layers=LAYERS, max_reqs=2, max_len=TOKENS + 8)
    b = pools.batch(2, TOKENS, name, 48, {"window": 8})
    jobs = [trigger.prepare(r, "decode") for r in b.reqs]
    assert all(j is not None for j in jobs)
    assert all(engine._policy_key(j) is None for j in jobs)


def test_sync_counter_sees_syncs() -> None:
    """The counter itself: every kind of host read it is meant to catch."""
    x = torch.arange(6)
    with SyncCounter() as sc:
        int(x.sum())
        bool(x.any())
        x.tolist()
        _ = x[x > 2]
        torch.repeat_interleave(x, x)
    assert sc.counts == {
        "aten::_local_scalar_dense": 2,
        "Tensor.tolist": 1,
        "aten::index(bool mask)": 1,
        "aten::repeat_interleave": 1,
    }


def _lag_fires(cfg: Any, n: int, n_sink: int, n_recent: int, comp: int, budget: int) -> bool:
    """LagKV's trigger: over budget, and a full tail partition to compress (or, with the cap, a
    compressed part over budget)."""
    t0 = max(n_sink, comp)
    parts = max(0, min((n - t0) // cfg.lag - 1, (n - n_recent - t0) // cfg.lag))
    if n - n_sink - n_recent <= budget:
        return False
    return parts > 0 or (cfg.cap_to_budget and t0 - n_sink > budget)


def _lag_keep(
    cfg: Any, keys: torch.Tensor, vals: torch.Tensor, n_sink: int, n_recent: int, comp: int, budget: int
):
    """One (layer, KV head)'s kept region indices, following the lagkv docstring: partitions of L from
    max(sinks, compacted part), each scored against the next and keeping its top int(ratio * L); the last
    full partition and the rest stay raw; with the cap, the compressed part is re-scored in chunks of L
    from its end (the oldest c mod L wait), the last chunk against the first L raw tokens, until it fits
    the budget or is shorter than L; then, if still over, cut to the top `budget` against the raw tail."""
    n, lag, k = len(keys), cfg.lag, int(cfg.ratio * cfg.lag)
    t0 = max(n_sink, comp)
    parts = max(0, min((n - t0) // lag - 1, (n - n_recent - t0) // lag))

    def score(idx: list[int], ref: list[int]) -> torch.Tensor:
        by_values = naive.lag_score(vals[idx], vals[ref])
        return naive.lag_score(keys[idx], keys[ref]) + cfg.score_v_ratio * by_values

    def top(idx: list[int], ref: list[int], kk: int) -> list[int]:
        s = score(idx, ref)
        best = sorted(range(len(idx)), key=lambda i: -float(s[i]))[:kk]
        return [idx[i] for i in sorted(best)]

    seq = list(range(n_sink, t0))
    for p in range(parts):
        start = t0 + p * lag
        seq += top(list(range(start, start + lag)), list(range(start + lag, start + 2 * lag)), k)
    raw = list(range(t0 + parts * lag, n))
    ref = raw[:lag]
    if cfg.cap_to_budget:
        while len(seq) > budget and len(seq) >= lag and len(ref) == lag:
            rem = len(seq) % lag
            chunks, new = seq[rem:] + ref, seq[:rem]
            for c in range(len(seq) // lag):
                new += top(chunks[c * lag : (c + 1) * lag], chunks[(c + 1) * lag : (c + 2) * lag], k)
            seq = new
        if len(seq) > budget:
            seq = top(seq, ref or seq, budget)
    return list(range(n_sink)) + seq + raw


# LagKV: (config, budget, lengths of the requests, growth between the two steps, compacted part preset
# per request). Lengths differ so the requests score different numbers of partitions; the second step
# runs on the compacted part the first one left (and re-cuts it under the cap).
LAG = {
    # default lag 128: 2, 1, 1 and 0 partitions; the last one compresses only in the second step
    "default": ({}, 200, [420, 370, 320, 270], 40, None),
    # lag 16, budget 24: partitions, then the chunk recursion binds (56 -> 32 -> 16 tokens)
    "cap": ({"lag": 16}, 24, [160, 151, 142, 117, 98, 80], 40, None),
    # budget 5: the recursion ends under L and the final cut binds; a ratio budget: per-request budgets
    "cut": ({"lag": 16, "sinks": 4}, 5, [160, 143, 129, 101, 77, 64], 24, None),
    "ratio": (
        {"lag": 16, "ratio": 0.25, "sinks": 4, "recent": 4},
        0.08,
        [160, 150, 131, 120, 90, 70],
        40,
        None,
    ),
    "nocap": ({"lag": 16, "cap_to_budget": False}, 24, [160, 151, 142, 117, 98, 80], 40, None),
    "v0": ({"lag": 16, "score_v_ratio": 0.0}, 5, [160, 143, 129, 101, 77, 64], 24, None),
    # a compacted part preset: the whole region (no raw tail: judged against itself), a raw tail shorter
    # than L (no recursion, straight to the final cut), and one long enough for rounds
    "compacted": ({"lag": 16, "recent": 0}, 6, [120, 110, 100, 90], 20, [120, 100, 40, 0]),
}


# What each scenario must exercise in its first step (so a scenario cannot silently stop testing it).
LAG_COVERS = {
    "default": lambda cs: {c.pc for c in cs} >= {1, 2} and not any(c.rounds for c in cs),
    "cap": lambda cs: any(len(c.rounds) > 1 for c in cs) and any(not c.rounds for c in cs),
    "cut": lambda cs: all(c.cut > 0 for c in cs) and len({len(c.rounds) for c in cs}) > 2,
    "ratio": lambda cs: len({c.cut for c in cs if c.cut > 0}) > 1,
    "nocap": lambda cs: all(not c.rounds and c.cut < 0 for c in cs) and any(c.c > 24 for c in cs),
    "v0": lambda cs: any(c.cut > 0 for c in cs) and any(c.rounds for c in cs),
    "compacted": lambda cs: (
        any(c.raw == 0 and c.cut > 0 for c in cs)
        and any(0 < c.raw < 16 and c.cut > 0 and not c.rounds for c in cs)
    ),
}


def _lag_batch(pools: Pools, key: str):
    cfg, budget, lens, _, comp = LAG[key]
    b = pools.batch(len(lens), max(lens), "lagkv", budget, cfg)
    for i, r in enumerate(b.reqs):
        extra = max(lens) - lens[i]
        if extra:  # ragged: give the tail slots back
            tail = pools.r2t.req_to_token[i, lens[i] : max(lens)].long()
            pools.alloc.free(tail)
        r.kv.kv_committed_len = r.kv.kv_allocated_len = lens[i]
        if comp is not None:
            st.get(r).slot_map.comp_slots = comp[i]
    return b


@pytest.mark.parametrize("key", list(LAG))
def test_batched_lagkv_matches_reference(key: str, caplog: pytest.LogCaptureFixture) -> None:
    """LagKV's batched selection (partitions, chunk recursion, final cut) against the reference, two
    steps on ragged requests: the same kept tokens with their K/V, free slots and offsets."""
    _lag_against_reference(key, caplog)


@pytest.mark.parametrize("key", ["cut", "compacted"])
def test_batched_lagkv_layer_chunks(key: str, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """The same with the gathers bounded to one layer at a time (what long regions and large batches
    get): the scores of each layer chunk land in the right place."""
    from sgl_kvevict.policies import lagkv as el

    monkeypatch.setattr(el, "MAX_GATHER", 1)
    monkeypatch.setattr(el, "MAX_GATHER_CPU", 1)
    _lag_against_reference(key, caplog)


def _lag_counts(job: trigger.Job):
    """The host counts of LagKV's batched selection for one job."""
    return job.s.policy.batch_counts(job.n, job.n_sink, job.n_recent, job.s.slot_map.comp_slots, job.budget)


def _lag_against_reference(key: str, caplog: pytest.LogCaptureFixture) -> None:
    _, budget_setting, _, grow, _ = LAG[key]
    pools = Pools(layers=LAYERS, max_reqs=6, max_len=600, seed=5)
    b = _lag_batch(pools, key)
    cfg = st.get(b.reqs[0]).policy.config
    compressed = []
    for step in range(2):
        if step == 0:
            jobs = [j for j in (trigger.prepare(r, "decode") for r in b.reqs) if j is not None]
            assert LAG_COVERS[key]([_lag_counts(j) for j in jobs])
        before, free = _before(pools, b, None), pools.alloc.available_size()
        picked = _step(pools, b, caplog)
        for i, (r, bf) in enumerate(zip(b.reqs, before, strict=True)):
            n_sink, n_recent, budget = _counts(cfg, budget_setting, bf)
            assert picked[i] == _lag_fires(cfg, bf.n, n_sink, n_recent, bf.comp, budget)
            for layer in range(LAYERS):
                k, v = _after(pools, r, layer)
                for h in range(pools.kv_heads):
                    kept = _kept(bf.k[layer][:, h], bf.v[layer][:, h], k[:, h], v[:, h])
                    if not picked[i]:
                        assert kept == list(range(bf.n)), "a request whose trigger did not fire changed"
                        continue
                    keys, vals = bf.k[layer][:, h], bf.v[layer][:, h]
                    assert kept == _lag_keep(cfg, keys, vals, n_sink, n_recent, bf.comp, budget), (
                        i,
                        layer,
                        h,
                    )
        assert not any(st.get(r).failed for r in b.reqs)
        _check_totals(pools, b, before, free)
        compressed.append(sum(picked))
        _grow(pools, b, grow)
    assert compressed[0] > 0 and compressed[1] > 0, "both steps must compress something"


@pytest.mark.parametrize("key", list(LAG))
def test_batched_lagkv_has_no_host_sync(key: str) -> None:
    pools = Pools(layers=LAYERS, max_reqs=6, max_len=600)
    b = _lag_batch(pools, key)
    items = [(r, "decode") for r in b.reqs]
    want = [trigger.prepare(r, "decode") is not None for r in b.reqs]
    with SyncCounter() as sc:
        freed = engine.compress_batch(items)
    assert [f > 0 for f in freed] == want and any(want)
    assert sc.counts == {}, f"host syncs in the batched lagkv step: {sc.counts}"


@pytest.mark.long  # under the Triton interpreter: 106-142 s in the runs of docs/tests.md; `make test-long`
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the subprocess")
def test_batched_lagkv_equals_per_request_on_triton() -> None:
    """The GPU path of the batched scores (the Triton kernel over the gathered, strided blocks) against the
    reference, in the Triton interpreter: the scenario with rounds."""
    env = dict(os.environ, TRITON_INTERPRET="1", KVEVICT_TRITON="1")
    k = "lagkv_matches_reference and cap and not nocap"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", k]
    res = subprocess.run(cmd, env=env, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout.splitlines()[-1], res.stdout[-2000:]
