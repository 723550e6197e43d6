"""Slots for a commit: the allocator's free slots, fresh ones, and slots taken back from the tree.

The per-request commit (`compressor`) of a region that starts in the tree must never write a shared
slot (invariant 1): it writes the kept K/V into slots the request owns. `target_slots` finds them: the
request's own tail slots first, then fresh ones from the pool, and only under memory pressure the tree
nodes that the request alone holds, taken out of the tree as eviction would take them. Recall uses
`free_slots` and `alloc_slots` for the slots its recalled entries go to.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_kvevict.cache import state as st


def _exclusive_tree_nodes(rt: Any, req: Any, anchor: Any) -> list[Any]:
    """Nodes between the request's lock and its anchor, from the bottom, that only this request holds
    and that have no other child: the request may take their slots back without touching anyone."""
    out = []
    node = req.lock.node if req.lock is not None else None
    child = None
    while node is not None and node is not anchor and node is not rt.tree.root_node:
        others = [c for c in node.children.values() if c is not child]
        if node.lock_ref != 1 or others:
            break
        out.append(node)
        child, node = node, node.parent
    return out


def target_slots(req: Any, s: st.ReqState, n: int, k: int, own_start: int) -> torch.Tensor | None:
    """At least `k` slots the request owns for the kept K/V of a region that starts in the tree, or None
    with nothing changed. Its own tail slots first, then fresh ones; only when the pool cannot give
    those, the tree nodes it alone holds are taken back (as eviction would take them)."""
    rt = s.ctx.rt
    a = s.slot_map.anchor_kv
    row = rt.req_to_token[req.kv.req_pool_idx]
    own = row[own_start : a + n].to(torch.int64)
    if own.numel() >= k:
        return own
    pool = free_slots(rt)
    if own.numel() + pool >= k:
        return torch.cat([own, alloc_slots(rt, k - own.numel())])
    anchor = s.slot_map.anchor if s.slot_map.anchor is not None else rt.tree.root_node
    nodes = _exclusive_tree_nodes(rt, req, anchor)
    taken = sum(len(x.value) for x in nodes)
    if own.numel() + taken + pool < k:
        return None
    parts = [own] + [x.value.to(torch.int64) for x in reversed(nodes)]
    top = nodes[-1].parent
    rt.tree.relock(req, top, own_start - taken)  # our lock leaves the nodes: now evictable leaves...
    rt.tree.take_leaves(nodes)  # ...that we take out of the tree, bottom-up, keeping their slots
    got = torch.cat(parts)
    if got.numel() < k:
        got = torch.cat([got, alloc_slots(rt, k - got.numel())])
    return got


def _in_free_group(rt: Any) -> bool:
    return getattr(rt.allocator, "free_group", None) is not None


def free_slots(rt: Any) -> int:
    """Slots the pool can give now: free ones, and the tree's evictable cache. Inside SGLang's free group
    (a finishing batch's releases, where the last compression of a turn runs), slots that eviction frees
    come back only when the group ends: only the free slots count then."""
    return rt.allocator.available_size() + (0 if _in_free_group(rt) else rt.tree.evictable_size())


def alloc_slots(rt: Any, count: int) -> torch.Tensor:
    """`count` fresh slots (evicting unlocked tree cache as SGLang would); the caller checked
    `free_slots`."""
    from sglang.srt.mem_cache.allocation import alloc_token_slots

    out = rt.allocator.alloc(count) if _in_free_group(rt) else alloc_token_slots(rt.tree, count)
    return out.to(torch.int64)
