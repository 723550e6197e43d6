"""The batched compression step on SGLang's real pools: same result as one request at a time, and no
host synchronisation inside it.

A host sync (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, a data-dependent shape) stalls the GPU stream
at every compression; `SyncCounter` counts what would stall on CUDA while running here on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import Field

from sgl_kvevict.cache import compressor, engine, report, trigger
from sgl_kvevict.cache import state as st
from sgl_kvevict.policies import REGISTRY, LayerView, Policy, PolicyConfig
from sgl_kvevict.policies.base import BatchView
from sgl_kvevict.serve import hooks
from sgl_kvevict.tools.pools import Pools, SyncCounter

LAYERS, TOKENS = 3, 160
CONFIGS = {
    "streaming": {},
    "knorm": {},
    "h2o": {"window": 8},
    "snapkv": {"window": 8},
    "snapkv-max": {"window": 8, "pooling": "max"},
    "h2o-decay": {"window": 8, "carry": "decay"},
    "h2o-none": {"window": 8, "carry": "none"},
}
# Max-pooling makes plateaus of equal scores: top-k may break those ties differently over a padded batch
# than over one request's candidates. There each head's kept K/V rows are compared as sets: at most
# `kernel_size - 1` (a plateau is one kernel wide) may differ, per head and layer.
TIES = {"snapkv-max": 4}
FALLBACK = "batched compression failed"
# Policies whose step still syncs, and why (their per-policy costs are another part of the same work).
STILL_SYNCING = {
    "graphkv": "per-request path (refiner over a base policy)",
    "criticalkv": "per-request path (refiner over a base policy)",
}


def _name(key: str) -> str:
    return key.split("-")[0]


def _state(pools: Pools, batch) -> dict:
    rows = []
    for r in batch.reqs:
        s = st.get(r)
        kv_len = r.kv.kv_committed_len
        slots = pools.r2t.req_to_token[r.kv.req_pool_idx, :kv_len].long()
        rows.append(
            (
                kv_len,
                s.comp_slots,
                s.own_evicted,
                slots.tolist(),
                [pools.kv.get_key_buffer(layer)[slots].clone() for layer in range(LAYERS)],
                [pools.kv.get_value_buffer(layer)[slots].clone() for layer in range(LAYERS)],
                [d.get("carried") for d in s.layer_state],
            )
        )
    return {"rows": rows, "free": pools.alloc.available_size(), "offsets": pools.tree.offsets[:8].tolist()}


def _tied_rows_agree(a: list[torch.Tensor], b: list[torch.Tensor], most: int) -> None:
    """Per layer and KV head: the (K, V) rows of `b` that `a` does not hold number at most `most`."""
    layers = len(a) // 2
    for layer in range(layers):
        x = torch.cat([a[layer], a[layers + layer]], -1)
        y = torch.cat([b[layer], b[layers + layer]], -1)
        assert x.shape == y.shape
        for h in range(x.shape[1]):
            held = (y[:, h, None, :] == x[None, :, h, :]).all(-1).any(-1)
            assert int((~held).sum()) <= most, f"layer {layer} head {h}: {int((~held).sum())} rows differ"


@pytest.mark.parametrize("key", list(CONFIGS))
def test_batched_step_equals_per_request(key: str, caplog: pytest.LogCaptureFixture) -> None:
    """Variable lengths over requests, two steps (the second combines carried scores)."""
    _compare(_name(key), CONFIGS[key], TIES.get(key), caplog)


class VNormConfig(PolicyConfig):
    power: float = Field(2.0, gt=0, le=8)


class VNormPolicy(Policy):
    """A new policy written as docs/contributing.md shows: `score`, `score_batch`, `batchable`."""

    name = "test_vnorm"
    Config = VNormConfig
    batchable = True

    def score(self, view: LayerView) -> torch.Tensor:
        return view.values().float().norm(p=self.config.power, dim=-1)

    def score_batch(self, batch: BatchView) -> torch.Tensor:
        R, L, H, n = batch.shape  # noqa: N806
        flat = batch.slots.reshape(-1)
        norms = [v.index_select(0, flat).float().norm(p=self.config.power, dim=-1) for v in batch.v_buffers]
        return torch.stack(norms).view(L, R, n, H).permute(1, 0, 3, 2)


def test_a_new_policy_is_on_the_fast_path(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """A policy the engine has never heard of, registered by name: batched because it declares it, and
    equal to its own per-request path. A subclass that changes `score` alone is not batchable."""
    monkeypatch.setitem(REGISTRY, VNormPolicy.name, VNormPolicy)
    _compare(VNormPolicy.name, {"power": 1.0}, None, caplog)

    class Changed(VNormPolicy):
        def score(self, view: LayerView) -> torch.Tensor:
            return -super().score(view)

    assert VNormPolicy.batchable and not Changed.batchable


def _compare(name: str, config: dict, ties: int | None, caplog: pytest.LogCaptureFixture) -> None:
    out = []
    for batched in (False, True):
        pools = Pools(layers=LAYERS, max_reqs=4, max_len=TOKENS + 8, seed=3)
        b = pools.batch(4, TOKENS, name, 48, config)
        for i, r in enumerate(b.reqs):  # ragged: shorten the first requests
            r.kv.kv_committed_len = r.kv.kv_allocated_len = TOKENS - 9 * i
        for _ in range(2):
            if batched:
                jobs = [j for j in (trigger.prepare(r, "decode") for r in b.reqs) if j is not None]
                assert jobs and all(engine._policy_key(j) is not None for j in jobs), "batched path"
                hooks._compress_batch(b)
                assert FALLBACK not in caplog.text  # the batched step ran, no per-request fallback
            else:
                for r in b.reqs:
                    compressor.safe_compress(r, "decode")
            for i, r in enumerate(b.reqs):  # grow every request again, past the trigger
                kv = r.kv
                new = pools.alloc.alloc(40)
                pools.r2t.req_to_token[i, kv.kv_committed_len : kv.kv_committed_len + 40] = new.to(
                    torch.int32
                )
                kv.kv_committed_len = kv.kv_allocated_len = kv.kv_committed_len + 40
        out.append(_state(pools, b))
    ref, got = out
    assert ref["free"] == got["free"] and ref["offsets"] == got["offsets"]
    assert any(row[2] > 0 for row in ref["rows"]), "the scenario must evict"
    for a, b in zip(ref["rows"], got["rows"], strict=True):
        if ties is not None:
            assert a[:4] == b[:4]
            _tied_rows_agree(a[4] + a[5], b[4] + b[5], ties)
            continue
        assert a[:4] == b[:4]
        for x, y in zip(a[4] + a[5], b[4] + b[5], strict=True):
            assert torch.equal(x, y)
        for x, y in zip(a[6], b[6], strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y)


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


# D2O still takes the per-request path (it merges), but that path no longer syncs either.
D2O_CONFIGS = {
    "d2o": {"window": 8},
    "d2o-accumulated-mean": {"window": 8, "scores": "accumulated", "threshold": "mean"},
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
        assert s.compressions == 2 and all("tau" in d for d in s.layer_state)
        rep = report.stats(r)
        assert rep["merged"] == s.merged > 0
        assert len(rep["layer_d2o_sigma2"]) == LAYERS and all(x > 0 for x in rep["layer_d2o_sigma2"])
    assert pools.rt.totals.tokens_merged == sum(st.get(r).merged for r in b.reqs)


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
            st.get(r).comp_slots = comp[i]
    return b


@pytest.mark.parametrize("key", list(LAG))
def test_batched_lagkv_equals_per_request(key: str, caplog: pytest.LogCaptureFixture) -> None:
    """LagKV's batched selection (partitions, chunk recursion, final cut) against `compressor.run`, two
    steps on ragged requests: same kept tokens, K/V, rows, free slots and offsets."""
    _compare_lag(key, caplog)


@pytest.mark.parametrize("key", ["cut", "compacted"])
def test_batched_lagkv_layer_chunks(key: str, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """The same with the gathers bounded to one layer at a time (what long regions and large batches
    get): the scores of each layer chunk land in the right place."""
    from sgl_kvevict.policies import lagkv as el

    monkeypatch.setattr(el, "MAX_GATHER", 1)
    monkeypatch.setattr(el, "MAX_GATHER_CPU", 1)
    _compare_lag(key, caplog)


def _lag_counts(job: trigger.Job):
    """The host counts of LagKV's batched selection for one job."""
    return job.s.policy.batch_counts(job.n, job.n_sink, job.n_recent, job.s.comp_slots, job.budget)


def _compare_lag(key: str, caplog: pytest.LogCaptureFixture) -> None:
    grow = LAG[key][3]
    out = []
    for batched in (False, True):
        pools = Pools(layers=LAYERS, max_reqs=6, max_len=600, seed=5)
        b = _lag_batch(pools, key)
        steps = []
        for step in range(2):
            if batched:
                jobs = [j for j in (trigger.prepare(r, "decode") for r in b.reqs) if j is not None]
                assert all(engine._policy_key(j) is not None for j in jobs)
                if step == 0:
                    assert LAG_COVERS[key]([_lag_counts(j) for j in jobs])
                hooks._compress_batch(b)
                assert FALLBACK not in caplog.text  # no per-request fallback
            else:
                for r in b.reqs:
                    compressor.safe_compress(r, "decode")
            steps.append([st.get(r).compressions for r in b.reqs])
            for i, r in enumerate(b.reqs):
                kv = r.kv
                new = pools.alloc.alloc(grow)
                pools.r2t.req_to_token[i, kv.kv_committed_len : kv.kv_committed_len + grow] = new.to(
                    torch.int32
                )
                kv.kv_committed_len = kv.kv_allocated_len = kv.kv_committed_len + grow
        assert not any(st.get(r).failed for r in b.reqs)
        out.append((_state(pools, b), steps))
    (ref, ref_steps), (got, got_steps) = out
    assert ref_steps == got_steps
    assert sum(ref_steps[1]) > sum(ref_steps[0]) > 0, "both steps must compress something"
    assert ref["free"] == got["free"] and ref["offsets"] == got["offsets"]
    for a, b in zip(ref["rows"], got["rows"], strict=True):
        assert a[:4] == b[:4]
        for x, y in zip(a[4] + a[5], b[4] + b[5], strict=True):
            assert torch.equal(x, y)


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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the subprocess")
def test_batched_lagkv_equals_per_request_on_triton() -> None:
    """The GPU path of the batched scores (the Triton kernel over the gathered, strided blocks) against the
    per-request one (the kernel over the pool), in the Triton interpreter: the scenario with rounds."""
    env = dict(os.environ, TRITON_INTERPRET="1", KVEVICT_TRITON="1")
    k = "lagkv_equals_per_request and cap and not nocap and not triton"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", k]
    res = subprocess.run(cmd, env=env, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout.splitlines()[-1], res.stdout[-2000:]
