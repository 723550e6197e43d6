"""Where tokens are evicted: one compression step of one running request, on the live KV pool.

A step has two phases, so that a failure anywhere in policy code leaves the request exactly as it was:

*Plan* (may fail, writes nothing the request or the tree can see):
1. ask the policy, layer by layer, which region tokens each KV head keeps;
2. if the policy merges (`Policy.merges`), or the region starts with slots the tree owns, stage the region's K/V in
   dense copies outside the pool, merge there and compact there.

*Commit* (plain indexing, no policy code): write the kept K/V into the first `k` region slots (or, for a
tree-owned region, into slots the request owns), free the rest, shrink the request's lengths and record
the position offset of its next tokens.

The plan may span several scheduler steps (`Pending`): with `--kv-compress-step-tokens`, a region
larger than the step's cap is planned a few layers per step while the request keeps decoding, and it
commits once every layer is planned; tokens decoded meanwhile move down behind the kept ones.

Tensor-parallel ranks hold different KV heads of the same request. Every count that decides slots (the
kept count, the raw tail, the compacted boundary) comes from the budget and the policy's config on the
host, never from scores, and the ranks agree on the plan's success before any commit: their rows and
trees stay identical.

When the region overlaps tree-owned slots (its prompt was checkpointed into the radix tree right after
prefill, so that other requests can share it), shared slots are never written (invariant 1): the kept
K/V goes to the request's own tail slots first, then to fresh slots, and only under memory pressure does
the request take back the tree nodes that it alone holds.

This module is the plan and the commit. The rest of a step lives beside it: when a request compresses
and with which counts (`trigger`), moving a branch-scoped request's branch point below shared nodes
(`branch_point`), the slots a commit writes to and taking them back from the tree (`slots`), the
tensor-parallel agreement (`tp`), thread pinning (`threads`) and the `meta_info` report (`report`). The
batched step over many requests is `engine`; it shares this module's commit (`compact_own`, `account`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_kvevict import kernels
from sgl_kvevict.cache import eviction, slotstats
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.context import KvEvictContext
from sgl_kvevict.cache.slots import target_slots
from sgl_kvevict.cache.threads import one_thread
from sgl_kvevict.cache.tp import agree
from sgl_kvevict.cache.trigger import Job, prepare
from sgl_kvevict.policies import LayerView, Policy, ragged
from sgl_kvevict.policies.base import MERGED_STAT, Phase

logger = logging.getLogger("sgl_kvevict")


def select_layers(policy: Policy, views: list[LayerView], budget: int) -> list[torch.Tensor]:
    """Step 1 for every layer: `[Hkv, k]` kept region indices per layer, nothing written yet.

    A separate function so `benchmarks/bench_policies.py` times the server's own selection. The counts
    must match across layers, or the request's row could not stay rectangular.
    """
    keeps = [policy.select(v, budget) for v in views]
    k = int(keeps[0].shape[1])
    if any(int(x.shape[1]) != k for x in keeps):
        raise RuntimeError(f"policy {policy.name!r} kept different counts across layers")
    return keeps


@dataclass
class Plan:
    """What a compression step will do, decided without touching the pool, the row or the tree."""

    slots: torch.Tensor  # [n] region slots
    keep: torch.Tensor  # [L, Hkv, k] kept region indices
    views: list[LayerView]
    tail: int  # kept indices that are the region's last tokens for every head
    dense_k: list[torch.Tensor] | None = None  # staged and compacted region K/V, `[k, Hkv, D]` each
    dense_v: list[torch.Tensor] | None = None
    stale: torch.Tensor | None = None  # [L, Hkv, k] kept rows whose value the merge rewrote

    @property
    def n(self) -> int:
        return int(self.slots.numel())

    @property
    def k(self) -> int:
        return int(self.keep.shape[-1])


def _check_tail(keep: torch.Tensor, n: int, tail: int, name: str) -> None:
    """Debug only (a host sync): the raw tail a policy declares really is kept by every head."""
    if tail == 0:
        return
    want = torch.arange(n - tail, n, device=keep.device)
    if not bool((keep[..., keep.shape[-1] - tail :] == want).all()):
        raise RuntimeError(f"policy {name!r} declared a raw tail of {tail} tokens it does not keep")


@dataclass
class Pending:
    """A compression in progress. Its selection runs layer by layer, possibly over several scheduler
    steps (`--kv-compress-step-tokens`: a large first compression must not stall the batch), against
    the region as it was when it started; the request keeps decoding meanwhile. Nothing the request or
    the tree can see changes before the last layer is planned and the plan commits: the policy works
    on copies of its per-layer state, and a pending compression that is dropped (retraction, release,
    the branch point moved) leaves no trace."""

    job: Job
    slots: torch.Tensor  # [n] region slots at the start
    states: list[dict]  # working copies of the request's per-layer policy state
    queries: list[torch.Tensor] | None  # window queries per layer, frozen at the start (split runs)
    keeps: list[torch.Tensor] = field(default_factory=list)  # [Hkv, k] per planned layer
    views: list[LayerView] = field(default_factory=list)
    dense_k: list[torch.Tensor] = field(default_factory=list)
    dense_v: list[torch.Tensor] = field(default_factory=list)
    stale: list[torch.Tensor] = field(default_factory=list)  # [Hkv, k] per merged layer (per-slot stats on)
    seconds: float = 0.0
    comp_slots: int = 0  # the request's compacted boundary when it started

    def valid_for(self, req: Any, s: st.ReqState) -> bool:
        """The region it planned is still the request's region, unchanged."""
        j, kv = self.job, req.kv
        return (
            s.slot_map.anchor_kv == j.a
            and kv.cache_protected_len == j.own_start
            and kv.kv_committed_len >= j.a + j.n
            and kv.kv_allocated_len == kv.kv_committed_len
            and s.slot_map.comp_slots == self.comp_slots
        )


def _plan_layer(p: Pending, v: LayerView, stage: bool) -> None:
    """Step 1 (and the staging of step 2) for one layer: nothing in the pool or the row is written.
    Only missing per-slot norms the policy computed are stored: they describe values that stay as they
    are whether or not the plan commits, so storing them early is safe and saves computing them again."""
    s, slots, rt = p.job.s, p.slots, p.job.s.ctx.rt
    kp = s.policy.select(v, p.job.budget)
    if v.vo is not None and s.ctx.stats is not None:  # norms the policy filled in: computed once
        slotstats.write_back(s.ctx.stats, v.layer, slots, v.vo)
    n = int(slots.numel())
    lay = v.layer
    if p.keeps and int(kp.shape[1]) != int(p.keeps[0].shape[1]):
        raise RuntimeError(f"policy {s.policy.name!r} kept different counts across layers")
    p.keeps.append(kp)
    p.views.append(v)
    k = int(kp.shape[1])
    if k >= n:
        return
    scored = v.state.pop("scored", None)  # scores carried to the next compression (kept order)
    if scored is not None:
        v.state["carried"] = scored.gather(1, kp.to(scored.device))
    keep = kp.to(torch.int64)
    if stage and not s.policy.merges:  # gather only the kept rows: O(k), never the whole region
        heads = torch.arange(keep.shape[0], device=slots.device).unsqueeze(-1)
        p.dense_k.append(rt.k_buffer(lay)[slots[keep], heads].transpose(0, 1))
        p.dense_v.append(rt.v_buffer(lay)[slots[keep], heads].transpose(0, 1))
    elif s.policy.merges:  # the merge reads evicted tokens and writes kept ones: stage the region
        idx = torch.arange(n, device=slots.device)
        dk = rt.k_buffer(lay).index_select(0, slots)
        dv = rt.v_buffer(lay).index_select(0, slots)
        s.policy.merge(dataclasses.replace(v, k_buffer=dk, v_buffer=dv, slots=idx), kp)
        kernels.compact([dk], [dv], idx, keep.unsqueeze(0))
        p.dense_k.append(dk[:k])
        p.dense_v.append(dv[:k])
        if s.ctx.stats is not None:  # the rows whose value the merge changed: their statistic is stale
            heads = torch.arange(keep.shape[0], device=slots.device).unsqueeze(-1)
            before = rt.v_buffer(lay)[slots[keep], heads]  # [Hkv, k, D]
            p.stale.append((dv[:k].transpose(0, 1) != before).any(-1))


def _plan(p: Pending) -> Plan | None:
    """Every layer planned: the whole plan, or None when the policy keeps the whole region."""
    s = p.job.s
    k, n = int(p.keeps[0].shape[1]), int(p.slots.numel())
    if k >= n:
        return None
    keep = torch.stack(p.keeps).to(torch.int64)  # [L, Hkv, k]
    tail = min(s.policy.raw_tail(p.views[0]), k)
    if st.DEBUG:
        _check_tail(keep, n, tail, s.policy.name)
    plan = Plan(slots=p.slots, keep=keep, views=p.views, tail=tail)
    if p.dense_k:
        plan.dense_k, plan.dense_v = p.dense_k, p.dense_v
    if p.stale:
        plan.stale = torch.stack(p.stale)
    return plan


def _commit(req: Any, s: st.ReqState, plan: Plan, own_start: int) -> bool:
    """Write the plan into the pool and the request's row. Returns False when it cannot (nothing changed).

    The evicted entries are shown to the request's `eviction.Eviction` (the host tier, when recall is
    on) before any slot is written; it is opened before `target_slots` may take the adopted node out of
    the tree."""
    ev = eviction.open_for(s)
    ok = False
    try:
        ok = _write(req, s, plan, own_start, ev)
        return ok
    finally:
        if ev is not None:
            ev.close(ok)


def _write(req: Any, s: st.ReqState, plan: Plan, own_start: int, ev: eviction.Eviction | None) -> bool:
    """`_commit`'s writes; `ev` (if any) sees the evicted entries right before the first one."""
    rt = s.ctx.rt
    kv, a, k = req.kv, s.slot_map.anchor_kv, plan.k
    row = rt.req_to_token[kv.req_pool_idx]
    end = kv.kv_committed_len  # past the region: tokens decoded while a split plan was pending
    after = row[a + plan.n : end].clone()
    k_bufs = [rt.k_buffer(layer) for layer in range(rt.n_layers)]
    v_bufs = [rt.v_buffer(layer) for layer in range(rt.n_layers)]
    stats = s.ctx.stats
    if own_start <= a:  # the whole region is the request's own: compact in place
        if ev is not None:
            ev.evicting(a, plan.slots, plan.keep)
        if plan.dense_k is None:  # the batched step's commit, for a batch of one
            compact_own(s.ctx, plan.slots.view(1, -1), plan.keep.unsqueeze(0), [k], [plan.n])
        else:
            if stats is not None:
                slotstats.write(stats, plan.slots[:k], _staged_stats(stats, plan))
            for kb, vb, dk, dv in zip(k_bufs, v_bufs, plan.dense_k, plan.dense_v, strict=True):
                kb[plan.slots[:k]] = dk
                vb[plan.slots[:k]] = dv
            rt.allocator.free(plan.slots[k:])
        new = plan.slots[:k]
    else:
        target = target_slots(req, s, plan.n, plan.k, own_start)
        if target is None:
            return False
        if ev is not None:
            ev.evicting(a, plan.slots, plan.keep)
        new, spare = target[:k], target[k:]
        if stats is not None:
            slotstats.write(stats, new, _staged_stats(stats, plan))
        for kb, vb, dk, dv in zip(k_bufs, v_bufs, plan.dense_k, plan.dense_v, strict=True):
            kb[new] = dk
            vb[new] = dv
        if spare.numel():
            rt.allocator.free(spare)
        if kv.cache_protected_len > a:  # the tree part is no longer the request's: it becomes cache
            rt.tree.relock(req, s.slot_map.anchor if s.slot_map.anchor is not None else rt.tree.root_node, a)
    row[a : a + k] = new.to(row.dtype)
    row[a + k : a + k + after.numel()] = after
    kv.kv_committed_len = kv.kv_allocated_len = a + k + after.numel()
    return True


def compact_own(
    ctx: KvEvictContext, slots: torch.Tensor, keep: torch.Tensor, ks: list[int], ns: list[int]
) -> None:
    """The commit of regions the requests own, for one request or a batch: each request's kept entries
    move into the first `k` slots of its region (one gather, then one write, per layer and buffer for
    all requests: sources and destinations may overlap), the per-slot statistic moves with its rows,
    and the rest of the slots go back to the allocator in one call. The caller writes the rows' lengths.

    `slots`: `[R, Nmax]` int64 region slots (padding repeats a real slot); `keep`: `[R, L, Hkv, Kmax]`
    sorted kept region indices, each request's first `ks[r]` real; `ns`: the region lengths. Every
    index is built from these host counts: no read back from the device."""
    rt = ctx.rt
    dev = slots.device
    R, L, H, kmax = keep.shape  # noqa: N806
    nmax = slots.shape[1]
    sel = _host_index(ks, kmax, dev)  # [sum k] valid (request, i) pairs of the padded kept layout
    src = slots.gather(1, keep.clamp(max=nmax - 1).reshape(R, -1)).view(R, L, H, kmax)
    src = src.permute(1, 0, 3, 2).reshape(L, R * kmax, H).index_select(1, sel)  # [L, sum k, H]
    heads = torch.arange(H, device=dev)
    src_rows = (src * H + heads).reshape(L, -1)  # [L, sum k * H] flat (slot, head) pool rows
    dst = slots[:, :kmax].reshape(-1).index_select(0, sel)  # the first k region slots
    dst_rows = (dst.unsqueeze(-1) * H + heads).reshape(-1)
    for layer in range(L):
        for buf in (rt.k_buffer(layer), rt.v_buffer(layer)):
            flat = buf.view(-1, buf.shape[-1])
            flat.index_copy_(0, dst_rows, flat.index_select(0, src_rows[layer]))  # gather, then write
    if ctx.stats is not None:  # the per-slot statistic moves with its row, all layers in one op
        slotstats.move_rows(ctx.stats, src_rows, dst_rows)
    drop = [n - k for k, n in zip(ks, ns, strict=True)]
    tail = ragged.aranges([r * nmax + k for r, k in enumerate(ks)], drop).to(dev, non_blocking=True)
    rt.allocator.free(slots.reshape(-1).index_select(0, tail))


def _host_index(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """Flat positions `r * width + j` for j < lengths[r]: where ragged rows sit in a padded layout."""
    starts = [r * width for r in range(len(lengths))]
    return ragged.aranges(starts, lengths).to(device, non_blocking=True)


def own_region(req: Any, s: st.ReqState, upto: int | None = None) -> bool:
    """Make the request's region its own slots when it still starts in the tree (its prefill
    compression did not fire, e.g. a short question turn): the region is copied, whole, into slots the
    request owns, exactly as a compression that keeps every token would (`_write`); the
    tree's copy stays as cache. Shared slots are never written. False when it cannot (nothing changed).

    `upto`: copy only the row's first `upto` slots (the tree part, before a prefill's forward has written
    the slots allocated for its new tokens; those stay where they are)."""
    rt, kv, a = s.ctx.rt, req.kv, s.slot_map.anchor_kv
    if kv.cache_protected_len <= a:
        return True
    if kv.kv_allocated_len != kv.kv_committed_len or s.pending is not None:
        return False
    n = int(kv.kv_committed_len if upto is None else upto) - a
    if n <= 0:
        return True
    slots = rt.req_to_token[kv.req_pool_idx, a : a + n].to(torch.int64)
    keep = torch.arange(n, device=slots.device).view(1, 1, n).expand(rt.n_layers, rt.n_kv_heads, n)
    plan = Plan(
        slots=slots,
        keep=keep,
        views=[],
        tail=0,
        dense_k=[rt.k_buffer(layer)[slots] for layer in range(rt.n_layers)],
        dense_v=[rt.v_buffer(layer)[slots] for layer in range(rt.n_layers)],
    )
    return _write(req, s, plan, int(kv.cache_protected_len), None)


def _staged_stats(stats: torch.Tensor, plan: Plan) -> torch.Tensor:
    """`[L, Hkv, k]` per-slot statistic of the staged rows, in kept order: the kept rows' own, NaN
    (recomputed when next needed) where the merge rewrote the value."""
    vals = slotstats.gather(stats, plan.slots, plan.keep)
    if plan.stale is not None:
        vals = vals.masked_fill(plan.stale.to(vals.device), float("nan"))
    return vals


def compress(req: Any, phase: Phase) -> int:
    """Run one compression step if the policy's trigger fires. Returns the slots freed (0 if none)."""
    job = prepare(req, phase)
    return 0 if job is None else run(job)


def run(job: Job) -> int:
    """One request's step on its own (every policy, every region layout): plan, agree, commit.

    With `job.layers` below the layer count the plan advances by that many layers and the commit
    waits for a later step (see `Pending`); the request's pending compression, if any, continues."""
    s, rt = job.s, job.s.ctx.rt
    rt.order_after_forward()
    p = s.pending if s.pending is not None and s.pending.job is job else _begin(job)
    s.pending = None
    t0 = time.perf_counter()
    error = None
    try:
        stop = min(rt.n_layers, len(p.keeps) + max(1, job.layers))
        stage = job.own_start > job.a
        for layer in range(len(p.keeps), stop):
            _plan_layer(p, _view(p, layer), stage)
    except Exception as e:  # policy code: degrade this request, after the ranks agree
        error = e
    p.seconds += time.perf_counter() - t0
    if not agree(rt, error is None):
        raise (
            error if error is not None else RuntimeError("compression failed on another tensor-parallel rank")
        )
    if len(p.keeps) < rt.n_layers:
        s.pending = p
        rt.totals.compressions_split += 1
        return 0
    t0 = time.perf_counter()
    plan = _plan(p)
    if plan is None:
        s.policy_state.layers = p.states
        return 0
    req = job.req
    d = req.kv.kv_committed_len - (job.a + job.n)  # tokens decoded while the plan was pending
    if not _commit(req, s, plan, job.own_start):
        return 0
    s.policy_state.layers = p.states
    k = plan.k
    for v in plan.views:  # bookkeeping: device statistics stay tensors, read where reported (`stats`)
        for name, val in v.stats.items():
            s.policy_state.layer_stats.setdefault(name, [0.0] * rt.n_layers)[v.layer] = val
        merged = v.stats.get(MERGED_STAT)
        if merged is not None:
            s.policy_state.merged_count.add(merged)
            rt.totals.merged.add(merged)
    dt = p.seconds + time.perf_counter() - t0
    rt.tree.offsets[req.kv.req_pool_idx] = account(job, k, plan.tail, plan.keep, dt, after=d)
    return job.n - k


def _begin(job: Job) -> Pending:
    """A new plan over the job's region. When it will span several steps, the window queries are frozen
    now: later queries attend to tokens past the region, which its causal mask does not cover."""
    s, rt, req = job.s, job.s.ctx.rt, job.req
    row = rt.req_to_token[req.kv.req_pool_idx]
    slots = row[job.a : job.a + job.n].to(torch.int64)
    if not s.policy_state.layers:
        s.policy_state.layers = [{} for _ in range(rt.n_layers)]
    queries = None
    store = s.ctx.capture
    if "attn" in s.policy.needs and store is not None and job.layers < rt.n_layers:
        length = s.slot_map.tokens_for(job.a + job.n)
        queries = [store.get(req.kv.req_pool_idx, layer, length) for layer in range(rt.n_layers)]
    states = [dict(d) for d in s.policy_state.layers]
    return Pending(job=job, slots=slots, states=states, queries=queries, comp_slots=s.slot_map.comp_slots)


def _view(p: Pending, layer: int) -> LayerView:
    """What the policy sees of one layer: the region's slots, the pools, the window's attention."""
    job, rt = p.job, p.job.s.ctx.rt
    s, a = job.s, job.a
    needs = s.policy.needs
    attn = None
    if "attn" in needs:
        if p.queries is not None:
            q = p.queries[layer]
        else:
            store = s.ctx.capture
            length = s.slot_map.tokens_for(a + job.n)
            q = store.get(job.req.kv.req_pool_idx, layer, length) if store is not None else None
        if q is not None and q.shape[1] > 0:
            row = rt.req_to_token[job.req.kv.req_pool_idx]
            all_slots = torch.cat([row[:a].to(torch.int64), p.slots])
            attn = kernels.window_attention(q, rt.k_buffer(layer), all_slots, rt.scale, causal=True)[:, a:]
    return LayerView(
        layer=layer,
        k_buffer=rt.k_buffer(layer),
        v_buffer=rt.v_buffer(layer),
        slots=p.slots,
        n_sink=job.n_sink,
        n_recent=job.n_recent,
        n_compacted=s.slot_map.comp_slots,
        attn=attn,
        o_proj=rt.o_proj(layer) if "o_proj" in needs else None,
        vo=slotstats.read(s.ctx.stats, layer, p.slots)
        if "o_proj" in needs and s.ctx.stats is not None
        else None,
        state=p.states[layer],
    )


def account(job: Job, k: int, tail: int, keep: torch.Tensor | None, dt: float, after: int = 0) -> int:
    """Host bookkeeping after a commit (counts, totals, the debug timeline); returns the new offset.
    `after`: tokens that follow the region in the row (decoded while the plan was pending)."""
    s, a, n, rt = job.s, job.a, job.n, job.s.ctx.rt
    if keep is not None and st.tracks_positions(s.ctx):
        before = st.row_positions(s, a + n + after)
        region = before[..., a : a + n].gather(-1, keep)
        pos = torch.cat([before[..., :a], region, before[..., a + n :]], dim=-1)
        s.trace.event(pos, s.slot_map.tokens_for(a + n + after))
    s.compacted(n, k, tail)
    if job.phase != "decode":  # folded into the budget: the turn's appended columns are gone
        s.slot_map.appended = 0
    s.counters.compressions += 1
    s.counters.seconds += dt
    tot = rt.totals
    tot.compressions += 1
    tot.tokens_evicted += n - k
    tot.slots_freed += n - k
    tot.seconds_compressing += dt
    if s.counters.compressions == 1:
        tot.requests_compressed += 1
    logger.debug(
        "kvevict %s: %s %s kept %d of %d region slots (offset %d) in %.3fs",
        job.req.rid,
        s.cfg.policy,
        job.phase,
        k,
        n,
        s.slot_map.offset,
        dt,
    )
    return s.slot_map.offset


def safe_compress(req: Any, phase: Phase) -> int:
    """A failure inside a policy degrades this request to no compression; the server keeps serving."""
    with one_thread():
        try:
            job = prepare(req, phase)
        except Exception:
            degrade(req)
            return 0
        return 0 if job is None else safe_run(job)


def safe_run(job: Job) -> int:
    """`run`, degrading the request on a failure (the caller holds `one_thread`)."""
    try:
        return run(job)
    except Exception:
        degrade(job.req)
        return 0


def degrade(req: Any) -> None:
    """The request continues uncompressed: its policy failed (logged once, counted in the totals)."""
    s = st.get(req)
    if s is not None and not s.failed:
        s.failed = True
        if s.ctx.rt is not None:
            s.ctx.rt.totals.policy_failures += 1
        logger.exception(
            "kvevict: policy %r failed for request %s; it continues uncompressed", s.cfg.policy, req.rid
        )
