"""Where tokens are evicted: one compression step of one running request, on the live KV pool.

Steps (all layers at once, so the row stays rectangular):
1. ask the policy, layer by layer, which region tokens each KV head keeps (pure: nothing written yet);
2. if the policy merges (D2O), fold evicted tokens into kept slots;
3. compact every (layer, KV head) into the first `k` region slots, free the rest at once;
4. shrink the request's KV lengths and record the position offset for its next tokens.

When the region still overlaps tree-owned slots (its prompt was checkpointed into the radix tree right
after prefill, so that other requests can share it), the region is staged outside the pool, the
request drops its lock on that part of the tree and then takes fresh slots for the kept tokens: shared
slots are never written (invariant 1) and become evictable like any cached prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from sgl_kvevict import capture, kernels, runtime
from sgl_kvevict import state as st
from sgl_kvevict.policies import LayerView, Policy, compacted_len
from sgl_kvevict.policies.base import Phase

logger = logging.getLogger("sgl_kvevict")


def _merges(policy: Policy) -> bool:
    return type(policy).merge is not Policy.merge


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


def _alloc(n: int) -> torch.Tensor | None:
    from sglang.srt.mem_cache.allocation import alloc_token_slots

    rt = runtime.RT
    try:
        return alloc_token_slots(rt.tree, n).to(torch.int64)
    except RuntimeError:
        return None


def _releasable(req: Any, anchor: Any, own_start: int, a: int, n: int) -> int:
    """Slots that come back if the request frees its own tail and unlocks the tree part of its region:
    nodes between the anchor and its lock that nobody else holds."""
    rt = runtime.RT
    total = rt.allocator.available_size() + rt.tree.evictable_size() + max(0, a + n - own_start)
    node = req.lock.node if req.lock is not None else None
    while node is not None and node is not anchor and node is not rt.tree.root_node:
        if node.lock_ref == 1:
            total += len(node.value)
        node = node.parent
    return total


def _compact_out_of_tree(req, s, views, keeps, keep, k_bufs, v_bufs, slots, own_start) -> torch.Tensor | None:
    """The region starts with slots the tree owns (the prompt, checkpointed after prefill so others can
    share it). They are never written: the region is staged in dense copies outside the pool, merged
    and compacted there, the request lets go of the tree part (which becomes evictable cache) and of its
    own tail, and only then takes `k` fresh slots. Staging first means a full pool is no obstacle: the
    slots it needs are the ones it is giving back."""
    rt = runtime.RT
    kv = req.kv
    a, n, k = s.anchor_kv, int(slots.numel()), int(keep.shape[-1])
    anchor = s.anchor if s.anchor is not None else rt.tree.root_node
    if _releasable(req, anchor, own_start, a, n) < k:
        return None
    idx = torch.arange(n, device=slots.device)
    dense_k = [kb.index_select(0, slots) for kb in k_bufs]
    dense_v = [vb.index_select(0, slots) for vb in v_bufs]
    if _merges(s.policy):
        for v, kp, dk, dv in zip(views, keeps, dense_k, dense_v, strict=True):
            s.policy.merge(dataclasses.replace(v, k_buffer=dk, v_buffer=dv, slots=idx), kp)
    kernels.compact(dense_k, dense_v, idx, keep)
    row = rt.req_to_token[kv.req_pool_idx]
    if own_start < a + n:
        rt.allocator.free(row[own_start : a + n].to(torch.int64))
    rt.tree.relock(req, anchor, a)
    new = _alloc(k)
    if new is None:  # cannot happen after the check above; fail loudly rather than lose KV silently
        raise RuntimeError(f"kvevict: no {k} slots after releasing the region of request {req.rid}")
    for kb, vb, dk, dv in zip(k_bufs, v_bufs, dense_k, dense_v, strict=True):
        kb[new] = dk[:k]
        vb[new] = dv[:k]
    return new


def compress(req: Any, phase: Phase) -> int:
    """Run one compression step if the policy's trigger fires. Returns the slots freed (0 if none)."""
    s = st.get(req)
    rt = runtime.RT
    if s is None or not s.active or rt is None:
        return 0
    kv = req.kv
    a = s.anchor_kv
    n = kv.kv_committed_len - a
    if n <= 0 or kv.kv_allocated_len != kv.kv_committed_len:
        return 0
    cfg = s.policy.config
    n_sink = max(0, min(cfg.sinks - s.anchor_tokens, n))
    n_recent = max(0, min(cfg.recent, n - n_sink))
    budget = s.cfg.resolve_budget(n + s.own_evicted, n_sink + n_recent)
    if not s.policy.should_compress(n, n_sink, n_recent, s.comp_slots, budget, phase):
        return 0

    t0 = time.perf_counter()
    row_idx = kv.req_pool_idx
    row = rt.req_to_token[row_idx]
    slots = row[a : a + n].to(torch.int64)
    needs = s.policy.needs
    ring = capture.RINGS.get(row_idx) if "attn" in needs else None
    if not s.layer_state:
        s.layer_state = [{} for _ in range(rt.n_layers)]

    def view(layer: int, region: torch.Tensor) -> LayerView:
        attn = None
        if ring is not None:
            q = ring.get(layer)
            if q.shape[1] > 0:
                all_slots = torch.cat([row[:a].to(torch.int64), region])
                attn = kernels.window_attention(q, rt.k_buffer(layer), all_slots, rt.scale, causal=True)[
                    :, a:
                ]
        return LayerView(
            layer=layer,
            k_buffer=rt.k_buffer(layer),
            v_buffer=rt.v_buffer(layer),
            slots=region,
            n_sink=n_sink,
            n_recent=n_recent,
            n_compacted=s.comp_slots,
            attn=attn,
            o_proj=rt.o_proj(layer) if "o_proj" in needs else None,
            state=s.layer_state[layer],
        )

    # 1. selection (pure)
    views = [view(layer, slots) for layer in range(rt.n_layers)]
    keeps = select_layers(s.policy, views, budget)
    k = int(keeps[0].shape[1])
    if k >= n:
        return 0
    keep = torch.stack(keeps).to(torch.int64)  # [L, Hkv, k]

    # 2-3. merge + compaction
    k_bufs = [rt.k_buffer(layer) for layer in range(rt.n_layers)]
    v_bufs = [rt.v_buffer(layer) for layer in range(rt.n_layers)]
    own_start = kv.cache_protected_len
    if own_start <= a:  # the whole region is the request's own: merge and compact in place
        if _merges(s.policy):
            for v, kp in zip(views, keeps, strict=True):
                s.policy.merge(v, kp)
        kernels.compact(k_bufs, v_bufs, slots, keep)
        rt.allocator.free(slots[k:])
        new_region = slots[:k]
    else:
        new_region = _compact_out_of_tree(req, s, views, keeps, keep, k_bufs, v_bufs, slots, own_start)
        if new_region is None:
            return 0

    row[a : a + k] = new_region.to(row.dtype)
    kv.kv_committed_len = kv.kv_allocated_len = a + k

    # 4. bookkeeping
    for v in views:
        for name, val in v.stats.items():
            s.layer_stats.setdefault(name, [0.0] * rt.n_layers)[v.layer] = float(val)
        s.merged += int(v.stats.get("d2o_merged", 0))
        rt.totals.tokens_merged += int(v.stats.get("d2o_merged", 0))
    region_tokens = n + s.own_evicted
    comp = max(compacted_len(kp, n) for kp in keeps)
    s.comp_slots = comp
    s.comp_tokens = region_tokens - (k - comp)
    s.own_evicted += n - k
    rt.tree.offsets[row_idx] = s.offset
    dt = time.perf_counter() - t0
    s.compressions += 1
    s.seconds += dt
    tot = rt.totals
    tot.compressions += 1
    tot.tokens_evicted += n - k
    tot.slots_freed += n - k
    tot.seconds_compressing += dt
    if s.compressions == 1:
        tot.requests_compressed += 1
    logger.debug(
        "kvevict %s: %s %s kept %d of %d region slots (offset %d) in %.3fs",
        req.rid,
        s.cfg.policy,
        phase,
        k,
        n,
        s.offset,
        dt,
    )
    return n - k


THREADS = int(os.environ.get("KVEVICT_COMPRESS_THREADS", "1"))


def safe_compress(req: Any, phase: Phase) -> int:
    """A failure inside a policy degrades this request to no compression; the server keeps serving.

    Compression is many small tensor ops: on a CPU, one OpenMP thread is much faster than several
    fighting over cores (measured 0.8 ms vs 150 ms for one LagKV score on a loaded 2-core machine).
    """
    prev = torch.get_num_threads()
    try:
        if THREADS and THREADS != prev:
            torch.set_num_threads(THREADS)
        return compress(req, phase)
    except Exception:
        s = st.get(req)
        if s is not None and not s.failed:
            s.failed = True
            if runtime.RT is not None:
                runtime.RT.totals.policy_failures += 1
            logger.exception(
                "kvevict: policy %r failed for request %s; it continues uncompressed", s.cfg.policy, req.rid
            )
        return 0
    finally:
        if torch.get_num_threads() != prev:
            torch.set_num_threads(prev)


def stats(req: Any) -> dict[str, Any] | None:
    """The per-request numbers reported in `meta_info["kvevict"]`."""
    s = st.get(req)
    if s is None:
        return None
    out: dict[str, Any] = {
        "policy": s.cfg.policy,
        "budget": s.cfg.budget,
        "kv_tokens": int(req.kv.kv_committed_len),
        "prefix_kv_tokens": s.anchor_kv,
        "logical_tokens": int(req.kv.kv_committed_len) + s.offset,
        "evicted": s.own_evicted,
        "reused_evicted": s.anchor_tokens - s.anchor_kv,
        "compressions": s.compressions,
        "merged": s.merged,
        "seconds": round(s.seconds, 4),
        "failed": s.failed,
    }
    if st.DEBUG:
        out["prefix_digest"] = s.prefix_digest
        out["prefix_digest_end"] = s.prefix_digest_end
    for name, vals in s.layer_stats.items():
        out[f"layer_{name}"] = [round(x, 5) for x in vals]
    return out
