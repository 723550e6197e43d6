"""The per-slot ||v W_O||_1 statistic (`sgl_kvevict.cache.slotstats`) on SGLang's real pools, without a server.

Values reach the pool as in a forward pass: the statistic's own hook (`slotstats.before_attention`, with
SGLang's `ForwardMode`) runs on the values, then they are written. After every compression step (batched
compaction, per-request compaction, staged writes into a tree-owned region, split plans, D2O's merge) the
statistic of every slot in the request's row must equal `kernels.vo_norms` recomputed from the pool (to fp32
rounding), or be NaN (stale) where a merge rewrote the value. CriticalKV must keep exactly what it keeps when it
recomputes every norm.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_kvevict import kernels
from sgl_kvevict.cache import compressor, engine, slotstats
from sgl_kvevict.cache import state as st
from sgl_kvevict.config import KvConfig, OverridePolicy, ServerSettings
from sgl_kvevict.tools.pools import Pools, SyncCounter

from .test_compressor_pools import DECODE, PROMPT, L, Rank, _append, _finish_and_check_no_leak, _kvq, _start

CAP = 100  # a step cap below the region: the plan is split over two steps (one layer each)
CASES = [
    ("snapkv", {}),  # own region: the batched engine's compaction
    ("knorm", {}),
    ("d2o", {"merge": True}),  # merge: staged rows, stale marks
    ("criticalkv", {}),
    ("criticalkv", {"base": "d2o", "base_config": {"merge": True}}),
]


def _forward_write(rank: Rank, slots: torch.Tensor, values: list[torch.Tensor], mode: ForwardMode) -> None:
    """What the forward pass does per layer for the statistic: the BEFORE hook on the values it writes."""
    # the ForwardBatch fields it reads (its row pool names the server: `context.of_forward`)
    batch = SimpleNamespace(forward_mode=mode, out_cache_loc=slots, req_to_token_pool=rank.r2t)
    for layer in range(L):
        v = values[layer]
        slotstats.before_attention(SimpleNamespace(layer_id=layer), None, None, v.flatten(1), batch)


def _decode(rank: Rank, req, pos: int) -> None:
    """One decode token: the hook, then the K/V write (`_append`)."""
    _append(rank, req, pos)
    slot = rank.r2t.req_to_token[0, req.kv.kv_committed_len - 1 : req.kv.kv_committed_len].to(torch.int64)
    _, v, _ = _kvq(pos)
    _forward_write(rank, slot, [v[layer, rank.heads].unsqueeze(0) for layer in range(L)], ForwardMode.DECODE)


def _prefill(rank: Rank, policy: str, config: dict, share_prompt: bool):
    req = _start(rank, policy, config, share_prompt)
    slots = rank.r2t.req_to_token[0, :PROMPT].to(torch.int64)
    vals = [rank.kv.get_value_buffer(layer)[slots] for layer in range(L)]
    _forward_write(rank, slots, vals, ForwardMode.EXTEND)
    return req


def _stale_rows(rank: Rank, req) -> int:
    """Checks the statistic of every slot in the row against a recomputation; returns the NaN count."""
    row = rank.r2t.req_to_token[0, : req.kv.kv_committed_len].to(torch.int64)
    stale = 0
    for layer in range(L):
        got = rank.tree.ctx.stats[layer, row]  # [n, H]
        want = kernels.vo_norms(rank.kv.get_value_buffer(layer), row, rank.rt.o_proj(layer)).t()
        nan = torch.isnan(got)
        # to fp32 rounding, as test_kernels' rows-vs-pool check (a one-token chunk's sum can land an ulp
        # from a longer chunk's); another value's norm differs by far more
        msg = f"layer {layer}: a slot's norm is not its value's"
        torch.testing.assert_close(got[~nan], want[~nan], rtol=1e-6, atol=0, msg=msg)
        stale += int(nan.sum())
    return stale


def _contents(rank: Rank, req) -> list[torch.Tensor]:
    row = rank.r2t.req_to_token[0, : req.kv.kv_committed_len].to(torch.int64)
    return [rank.kv.get_value_buffer(layer)[row] for layer in range(L)] + [
        rank.kv.get_key_buffer(layer)[row] for layer in range(L)
    ]


def _scenario(
    policy: str, config: dict, share_prompt: bool, cap: int | None, stats: bool, recompute: bool = False
):
    """Prefill, compress, decode with compressions, finish. Yields (rank, req) after each step."""
    rank = Rank(slice(0, 4), torch.bfloat16)  # a bf16 model's pool and W_O: norms are bit-identical
    if stats:
        rank.tree.ctx.slot_stats = slotstats.setup(rank.rt)
    req = _prefill(rank, policy, config, share_prompt)
    s = st.get(req)

    def step(phase: str) -> None:
        if recompute:  # the earlier path with nothing cached: every norm computed at every compression
            for d in s.policy_state.layers:
                d.pop("vo", None)
                d.pop("vo_sig", None)
        rank.activate()
        if phase == "finish":
            compressor.safe_compress(req, "finish")
        else:
            engine.compress_batch([(req, phase)], cap)

    step("prefill")
    yield rank, req
    for pos in range(PROMPT, PROMPT + DECODE - 1):
        rank.activate()
        _decode(rank, req, pos)
        step("decode")
        yield rank, req
    req.done = True
    step("finish")
    assert s.pending is None and not s.failed
    yield rank, req


@pytest.mark.parametrize("cap", [None, CAP], ids=["one-step", "split"])
@pytest.mark.parametrize("share_prompt", [False, True], ids=["own", "tree-shared"])
@pytest.mark.parametrize("policy,config", CASES, ids=[f"{p}{c or ''}" for p, c in CASES])
def test_statistic_moves_with_its_row(policy: str, config: dict, share_prompt: bool, cap: int | None) -> None:
    stale_seen, rank, req = 0, None, None
    for rank, req in _scenario(policy, config, share_prompt, cap, stats=True):
        stale_seen += _stale_rows(rank, req)
    s = st.get(req)
    assert s.slot_map.own_evicted > 0, "the scenario must evict something"
    merges = config.get("merge", False) or config.get("base_config", {}).get("merge", False)
    if merges:
        assert s.policy_state.merged > 0 and stale_seen > 0, "merged rows must be marked stale"
    else:
        assert stale_seen == 0
    _finish_and_check_no_leak(rank, req, rank.alloc.alloc(0))


@pytest.mark.parametrize("share_prompt", [False, True], ids=["own", "tree-shared"])
@pytest.mark.parametrize("config", [{}, {"base": "d2o"}, {"base": "h2o"}], ids=["snapkv", "d2o", "h2o"])
def test_criticalkv_keeps_what_recomputing_keeps(config: dict, share_prompt: bool) -> None:
    def run(stats: bool) -> tuple[list[list[torch.Tensor]], int, int]:
        # every scenario on a rank of its own: its statistic is that rank's (`tree.ctx`)
        steps, req = [], None
        for rank, req in _scenario("criticalkv", config, share_prompt, None, stats, not stats):
            steps.append(_contents(rank, req))
        s = st.get(req)
        # which path ran: the per-slot statistic carries nothing in the policy state, the fallback does
        assert all(("vo" in d) != stats for d in s.policy_state.layers)
        return steps, s.slot_map.own_evicted, s.policy_state.merged

    with_stats, evicted, merged = run(stats=True)
    recomputed, evicted_b, merged_b = run(stats=False)
    assert len(with_stats) == len(recomputed) == DECODE + 1
    for a, b in zip(with_stats, recomputed, strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert (evicted, merged) == (evicted_b, merged_b) and evicted > 0


def test_stale_rows_are_recomputed_once_and_stored() -> None:
    """A NaN (stale or never written) is computed by the policy from the pool and stored back."""
    rank = Rank(slice(0, 4), torch.bfloat16)
    rank.tree.ctx.slot_stats = slotstats.setup(rank.rt)
    req = _start(rank, "criticalkv", {}, share_prompt=False)  # K/V written without the hook: all NaN
    row = rank.r2t.req_to_token[0, :PROMPT].to(torch.int64)
    assert bool(torch.isnan(rank.tree.ctx.stats[:, row]).all())
    assert compressor.compress(req, "prefill") > 0
    assert _stale_rows(rank, req) == 0


def test_batched_engine_moves_the_statistic_without_host_sync() -> None:
    pools = Pools(layers=3, max_reqs=8, max_len=168)
    b = pools.batch(8, 160, "snapkv", 48, {"window": 8})
    b.reqs[0].kv.kv_committed_len = b.reqs[0].kv.kv_allocated_len = 140  # ragged
    pools.ctx.slot_stats = slotstats.setup(pools.rt)
    stats = pools.ctx.stats
    all_slots = torch.arange(pools.kv.get_value_buffer(0).shape[0])
    for layer in range(3):  # as if every value had been written by a forward
        stats[layer] = kernels.vo_norms(
            pools.kv.get_value_buffer(layer), all_slots, pools.rt.o_proj(layer)
        ).t()
    with SyncCounter() as sc:
        freed = engine.compress_batch([(r, "decode") for r in b.reqs])
    assert all(f > 0 for f in freed)
    assert sc.counts == {}, f"host syncs in the batched step: {sc.counts}"
    for r in b.reqs:
        row = pools.r2t.req_to_token[r.kv.req_pool_idx, : r.kv.kv_committed_len].to(torch.int64)
        for layer in range(3):
            want = kernels.vo_norms(pools.kv.get_value_buffer(layer), row, pools.rt.o_proj(layer)).t()
            assert torch.equal(stats[layer, row], want)


def test_hook_has_no_host_sync_and_skips_other_modes() -> None:
    rank = Rank(slice(0, 4), torch.bfloat16)
    rank.tree.ctx.slot_stats = slotstats.setup(rank.rt)
    stats = rank.tree.ctx.stats
    slots = torch.tensor([5, 9, 3], dtype=torch.int64)
    vals = [torch.randn(3, 4, 16).bfloat16() for _ in range(L)]
    with SyncCounter() as sc:
        _forward_write(rank, slots, vals, ForwardMode.DECODE)
    assert sc.counts == {}
    for layer in range(L):
        assert torch.equal(stats[layer, slots], kernels.vo_norms_rows(vals[layer], rank.rt.o_proj(layer)).t())
    _forward_write(rank, torch.tensor([7]), [torch.randn(1, 4, 16) for _ in range(L)], ForwardMode.IDLE)
    assert bool(torch.isnan(stats[:, 7]).all())
    # a write that fails (here: more values than slots) switches the statistic off rather than leaving
    # those slots with their previous occupants' norms
    _forward_write(rank, torch.tensor([1, 2]), vals, ForwardMode.DECODE)
    assert rank.tree.ctx.stats is None
    _forward_write(rank, slots, vals, ForwardMode.DECODE)  # no buffer: the hook is a no-op


def test_buffer_only_when_a_request_can_use_it() -> None:
    any_override = ServerSettings()
    none = ServerSettings(overrides=OverridePolicy(enabled=False))
    only_snapkv = ServerSettings(overrides=OverridePolicy(policies=["snapkv"]))
    quantized = ServerSettings(quantization="--quantization fp8")
    assert slotstats.needed(KvConfig(policy="criticalkv", budget=0.5), none)
    assert not slotstats.needed(KvConfig(policy="snapkv", budget=0.5), none)
    assert slotstats.needed(KvConfig(policy="snapkv", budget=0.5), any_override)
    assert not slotstats.needed(KvConfig(policy="snapkv", budget=0.5), only_snapkv)
    assert slotstats.needed(
        KvConfig(policy="snapkv", budget=0.5),
        ServerSettings(overrides=OverridePolicy(policies=["criticalkv"])),
    )
    assert not slotstats.needed(KvConfig(policy="snapkv", budget=0.5), quantized)
