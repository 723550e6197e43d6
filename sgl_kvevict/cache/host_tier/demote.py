"""Demote: the entries a compression evicts go to the host tier instead of being dropped.

Inside a compression's commit, the entries it evicts, per layer and KV head, are written to freshly
allocated host columns (`host.py`) before their device slots are freed. The columns are written in the
plan (they belong to no branch yet, so nobody sees them) and join the request's `HostEntries` only once
the commit went through; a commit that does not happen gives them back. `recall.py` brings them back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.common import match_kv_cache

from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import host

if TYPE_CHECKING:
    from sgl_kvevict.cache.context import KvEvictContext
    from sgl_kvevict.cache.nodes import CompressedNode

logger = logging.getLogger("sgl_kvevict")


def enabled(s: st.ReqState | None) -> bool:
    return s is not None and s.recall_on and s.active


def evicted_indices(keep: torch.Tensor, n: int) -> torch.Tensor:
    """`[..., n - k]` region indices not in `keep` (`[..., k]`), ascending per row (no host sync)."""
    mask = torch.zeros(*keep.shape[:-1], n, dtype=torch.int8, device=keep.device)
    mask.scatter_(-1, keep.to(torch.int64), 1)
    order = torch.sort(mask, dim=-1, stable=True).indices  # evicted (0) first, in index order
    return order[..., : n - keep.shape[-1]]


def take(s: st.ReqState) -> None:
    """The request takes the host entries of the compressed node it adopted, as it takes the node's
    device KV: a copy (`HostPool.copy`), so the node keeps them for whoever continues it next (a fork
    sibling, a retried turn) and they go with the node. The node's entries become the pool's first LRU
    victims when nobody else continues them (the request's copy is the one a session goes on with);
    a fork's keep their place for the siblings still to come. When the pool cannot hold a copy (a
    copy never drops a running request's entries: `HostPool.copy`), the entries move to the
    request when nobody else continues the history (`sole_continuation`: a session's next turn), and
    otherwise the request reads the node's entries where they are (`HostPool.borrow`,
    `RecallState.borrowed`) until its first write (`RecallState.end_borrow`): its prefill and its append
    see the whole history, it keeps an excerpt for its decode steps (`recall.EXCERPT`), and a fork of
    `n` branches costs one history's columns and the excerpts, not `n` copies."""
    src = s.recall.host_src
    s.recall.host_src = None
    got = src.host_entries if src is not None else None
    pool = s.ctx.host
    if got is None or pool is None:  # nothing was demoted from this history
        return
    if got.count == 0:  # the LRU took them back
        pool.totals.histories_missed += got.dropped > 0
        return
    got.takers += 1
    s.recall.join(got)
    rest = others(s)  # the server's other live requests, read once
    mine = pool.copy(got, [*running_entries(rest), *awaited(rest)])
    sole = sole_continuation(src, got, rest)
    if mine is None and not sole:
        s.recall.end_borrow(pool)
        pool.borrow(got)
        s.recall.borrowed, s.recall.history_borrowed = got, True
        s.recall.host_peak = max(s.recall.host_peak, got.count)
        return
    if mine is None:  # the session's next turn, and no room for a copy: the entries move to it
        mine, src.host_entries = got, host.HostEntries(dropped=got.count, takers=got.takers)
        s.recall.leave()  # its own entries now, not a stored history it runs on
        got.takers = 0  # and nobody has continued them yet
        pool.totals.histories_moved += 1
    elif sole:  # the copy is the one the session goes on with (a fork's keep their place)
        pool.drop_first(got)
    if s.recall.host is None or s.recall.host.count == 0:
        s.recall.host = mine
    else:  # already holds some (a retracted request coming back): merge
        pool.append(s.recall.host, mine.cols, mine.positions if s.recall.host.positions is not None else None)
        pool.lru.pop(id(mine), None)
        mine.cols = torch.zeros(0, dtype=torch.int64)
    pool.touch(s.recall.host)


def others(s: st.ReqState) -> list[st.ReqState]:
    """The other live requests of `s`'s server."""
    return [o for o in list(st.LIVE.values()) if o is not s and o.ctx is s.ctx]


def running_entries(rest: list[st.ReqState]) -> list[host.HostEntries]:
    """The host entries the requests `rest` own: neither a copy nor a demotion takes them."""
    return [o.recall.host for o in rest if o.recall.host is not None]


def awaited(rest: list[st.ReqState]) -> list[host.HostEntries]:
    """The entries of the stored histories the requests `rest` have matched and not taken yet (a fork's
    siblings still waiting, a session's next turn before its first commit): they are needed next, so a
    copy never takes them and a demotion takes them last."""
    nodes = [o.recall.host_src for o in rest if o.recall.host_src is not None]
    return [n.host_entries for n in nodes if n.host_entries is not None]


def match_waiting(tree_cache: Any, waiting: list) -> None:
    """Match each request that just joined the waiting queue, as SGLang's longest-prefix scheduling
    matches every waiting request: a question that waits to be admitted then counts as awaiting its
    history (`awaited`, `sole_continuation`), so the first of a fork's branches to run borrows instead
    of moving the entries away, and the LRU takes the history last. SGLang matches a request again at
    admission (`on_match` then sees the tree as it is then); a waiting request's match only guards."""
    for req in waiting:
        if st.get(req) is None:
            match_kv_cache(req, tree_cache)


def sole_continuation(src: CompressedNode, got: host.HostEntries, rest: list[st.ReqState]) -> bool:
    """Nobody but the request taking them continues the stored history `src` (whose entries are
    `got`): no other request took or reads them, and none of the others `rest`, waiting or running, has
    matched `src` and not taken them yet. Its entries can then move to the request when the pool has no
    room for a copy: a borrow would leave the session's next stored history with only what this turn
    demoted itself (the borrow ends at the append), while a fork's siblings, which do need the node's
    entries, borrow them."""
    if got.takers > 1 or got.readers:
        return False
    return not any(o.recall.host_src is src for o in rest)


def columns(s: st.ReqState, n: int, count_refused: bool = True) -> torch.Tensor | None:
    """`n` fresh host columns for request `s` (a demotion, or a borrower's excerpt). The LRU may drop
    stored histories for them, never the entries a running request holds (its turn would go on without
    its history: what this request evicts now is worth less), nor a session's latest history stored
    since this request arrived (`RecallState.arrived`), and the histories waiting requests have matched
    only after every other (`awaited`). Only an eviction orders victims: the other requests are
    read when the pool is short. None when the pool cannot give them."""
    pool = s.ctx.host
    keep: list[host.HostEntries] = [s.recall.entries()]
    last: list[host.HostEntries] = []
    if pool.n_free < n:
        rest = others(s)
        keep += running_entries(rest)
        last = awaited(rest)
    return pool.alloc(n, keep=keep, last=last, count_refused=count_refused, arrived=s.recall.arrived)


def reading(s: st.ReqState) -> host.HostEntries | None:
    """The entries a read-only pass over the branch's history reads (a prefill over both tiers, an
    append): a borrowed stored history's while the request reads one, else its own."""
    return s.recall.borrowed if s.recall.borrowed is not None else s.recall.host


def attach(ctx: KvEvictContext, pool: host.HostPool) -> None:
    """Turn the host tier on for a server: its pool, and compressions' evicted entries demoted into it."""
    ctx.host = pool
    ctx.evictions = HostTier()


class HostTier:
    """The host tier as the compression core's `eviction.EvictionSink` (`KvEvictContext.evictions`): a
    request with recall on takes its adopted history's host entries (`take`), then each commit's evicted
    entries are demoted."""

    def open(self, s: st.ReqState) -> Demoting | None:
        if not enabled(s):
            return None
        take(s)
        return Demoting(s)


@dataclass(eq=False)
class Demoting:
    """One commit's demotion (`eviction.Eviction`): the host columns are written in `evicting` and join
    the request's entries in `close` only if the commit went through."""

    s: st.ReqState
    planned: Demotion | None = None

    def evicting(self, a: int, slots: torch.Tensor, keep: torch.Tensor) -> None:
        self.planned = plan_demote(self.s, a, slots, keep)

    def close(self, committed: bool) -> None:
        commit_demote(self.s, self.planned, committed)


@dataclass
class Demotion:
    cols: torch.Tensor
    positions: torch.Tensor | None


def plan_demote(s: st.ReqState, a: int, slots: torch.Tensor, keep: torch.Tensor) -> Demotion | None:
    """Copy the entries a compression of region `slots` (starting at row index `a`) evicts into new host
    columns, before anything in the pool is written. None when recall is off or the host cannot hold
    them (they are then lost, as without the tier). `keep`: `[L, H, k]` kept region indices."""
    if not enabled(s):
        return None
    try:
        pool, rt = s.ctx.host, s.ctx.rt
        n, k = int(slots.numel()), int(keep.shape[-1])
        if k >= n:
            return None
        cols = columns(s, n - k)
        if cols is None:
            return None
        ev = evicted_indices(keep, n)  # [L, H, e]
        heads = torch.arange(ev.shape[1], device=slots.device).unsqueeze(-1)
        for layer in range(rt.n_layers):
            src = slots[ev[layer].to(slots.device)]  # [H, e]
            pool.write(
                cols,
                layer,
                rt.k_buffer(layer)[src, heads].transpose(0, 1),
                rt.v_buffer(layer)[src, heads].transpose(0, 1),
            )
        pos = st.row_positions(s, a + n)[..., a:].gather(-1, ev.cpu())  # the host tier tracks positions
        return Demotion(cols, pos)
    except Exception:
        fail(s, "demotion")
        return None


def commit_demote(s: st.ReqState, d: Demotion | None, committed: bool) -> None:
    pool = s.ctx.host
    if d is None or pool is None:
        return
    if not committed or s.recall.host is None:
        pool.give_back(d.cols)
        return
    pool.append(s.recall.host, d.cols, d.positions)
    pool.totals.demoted += int(d.cols.numel())
    s.recall.host_peak = max(s.recall.host_peak, s.recall.host.count)


def fail(s: st.ReqState, what: str) -> None:
    s.recall.tokens = 0
    if s.ctx.host is not None:
        s.ctx.host.totals.recall_failures += 1
    logger.exception("kvevict: %s failed; the request continues without recall", what)
