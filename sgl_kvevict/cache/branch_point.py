"""Branch scope: moving a request's branch point (its anchor) below the tree nodes that became shared.

The region a branch-scoped request compresses starts at its anchor. Before its first compression the
tree part of the region may hold nodes another request now holds too, or that lie inside the declared
`shared_prefix`; the anchor moves below the deepest such node (`move`), so that no shared token is
ever compressed away. A declared prefix the tree does not hold yet (the request's prompt was never
checkpointed: a turn that finishes in its prefill step compresses in its release, before SGLang's
release checkpoint) goes into the tree first (`_publish_declared`), so that the anchor can move below
it too.
"""

from __future__ import annotations

from typing import Any

from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.nodes import is_compressed


def move(req: Any, s: st.ReqState) -> None:
    """Branch scope, before the first compression: the region's tree part (the prompt checkpointed after
    prefill, the adopted history) may hold nodes that are shared by now: held by another running request
    (a fork sibling admitted after this request matched), or inside the declared `shared_prefix` (on a
    first turn nothing was matched yet, so the match could not place it). The region starts below the
    deepest such node; a node the declared prefix cuts is split there."""
    rt = s.ctx.rt
    if req.lock is None:
        return
    _publish_declared(req, s)
    if req.kv.cache_protected_len <= s.slot_map.anchor_kv:
        return
    chain, node = [], req.lock.node
    while node is not None and node is not s.slot_map.anchor and node is not rt.tree.root_node:
        chain.append(node)
        node = node.parent
    if node is not (s.slot_map.anchor if s.slot_map.anchor is not None else rt.tree.root_node):
        return
    chain.reverse()  # top-down from the anchor
    cut = rt.tree.last_shared(
        chain,
        s.slot_map.anchor_tokens,
        s.policy.config.shared_prefix,
        req,
        branches=False,
        keep_history=s.recall_on,  # `prepare` runs this for active requests only
    )
    if cut < 0:
        return
    above = chain[: cut + 1]
    s.move_anchor(
        chain[cut],
        sum(len(x.key) for x in above),
        sum(len(x.value) for x in above),
        drop_history=any(is_compressed(x) for x in above),
    )


def _publish_declared(req: Any, s: st.ReqState) -> None:
    """Before the first compression: a declared `shared_prefix` that the tree does not hold for the
    request yet (its row still owns some of it) goes into the tree, uncompressed, as SGLang's checkpoint
    after prefill would have put it there; `move` then places the anchor below it.

    Without it, a first turn that finishes in its prefill step (a client-composed turn that generates
    one token) is compressed by its release before SGLang checkpoints anything: its region starts at the
    root, and its compressed history starts inside the declared prefix. The tree must treat such a node
    as shared whole (`tree.last_shared`: a compressed node is never split), so every later turn of the
    session would hold that first history frozen beside its own budget, and no other session could reuse
    the prefix."""
    m, kv, rt = s.slot_map, req.kv, s.ctx.rt
    upto = s.policy.config.shared_prefix
    if (
        upto <= m.anchor_tokens
        or m.offset != 0  # one slot per token: nothing evicted before or in the region yet
        or m.comp_tokens > 0  # a compacted history: not before the first compression
        or kv.cache_protected_len >= upto
        or kv.kv_committed_len < upto
        or kv.kv_allocated_len != kv.kv_committed_len
        or s.pending is not None
        or getattr(req, "skip_radix_cache_insert", False)
    ):
        return
    rt.tree.checkpoint(req, up_to=upto)
