"""The host tier: K/V entries a compression evicted, kept in host memory instead of dropped.

Layout `[layers, columns, kv_heads, head_dim]`, the device pool's with columns for slots. One host
*column* mirrors one device slot: for column j, (layer l, head h) holds one evicted entry of that head.
Eviction is rectangular per request (every head of every layer evicts the same count), so a compression
that evicts `e` entries per head fills exactly `e` columns, and each (layer, head) keeps its own order.

Why not SGLang's `MHATokenToKVPoolHost`: its transfers move whole device slots (every layer and head
of one token) to whole host slots, while demoted entries of one column come from different tokens per
head; and its constructor sizes itself against the device pool's pointer tables and the HiCache host
memory budget (a fixed reserve of host RAM), neither of which exists for a side tier on a CPU server.
The store here is the same layout in plain torch; a column copy is one `index_copy_` per layer.

Ownership: a `HostEntries` (one branch's columns) is held by exactly one owner at a time, a running
request's `RecallState.host` or a compressed tree node's `host_entries`; it moves between them, so no
two branches can mutate the same entries: a request continuing a stored history takes a copy
(`HostPool.copy`, its room taken from colder branches, never from a running request's entries), and
the node keeps its own for the next one (a fork sibling, a retried turn). Where the pool has no room for
a copy, the request takes the node's entries when nobody else continues it, else *reads* them where
they are (`HostPool.borrow`): never writes them, and gives them up before its first write
(`RecallState.end_borrow`); entries with readers are never evicted, and an owner's release of them
waits for the last reader (`HostPool.unborrow`).
When it needs columns the pool takes them back from branches least recently used, in the order `alloc`
gives (a fork's branches' stored histories first; the histories about to be continued last): whole
branches, and only the newest columns still needed from the last one (`trim`); an emptied branch still
runs, on what the device holds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("sgl_kvevict")


@dataclass(eq=False)
class PageSummaries:
    """Per-page summaries of a branch's first `n` host columns' keys, `page` columns a page: `[p, L, H, D]`
    per-channel min and max (`minmax`) or the mean key (`mean`), the other None, in the KV dtype on the KV
    pool's device (`recall.py` scores pages with them instead of every host key; `kernels/page_scores.py`
    computes them)."""

    kmin: torch.Tensor | None
    kmax: torch.Tensor | None
    kmean: torch.Tensor | None
    n: int
    page: int

    def at(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`(kmin, kmax, kmean)` of one layer, `[p, H, D]` views (None where not kept)."""
        return tuple(x[:, layer] if x is not None else None for x in (self.kmin, self.kmax, self.kmean))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.kmin, self.kmax, self.kmean) if x is not None)


@dataclass(eq=False)
class HostEntries:
    """One branch's host columns, in demotion order, and (where tracked) the logical positions they hold."""

    cols: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    positions: torch.Tensor | None = None  # [L, H, e] logical positions (None: lost, see `HostPool.append`)
    dropped: int = 0  # columns the pool took back (LRU) from this branch
    summaries: PageSummaries | None = None  # of a prefix of `cols`, built and kept by `recall.py`
    readers: int = 0  # requests reading these entries without a copy (`HostPool.borrow`)
    takers: int = 0  # requests that continued this stored history (copied or borrowed it: `demote.take`)
    running: int = 0  # of them, those still running (`RecallState.leave` counts them out)
    released: bool = False  # its owner released it while read: the columns go back with the last reader
    # stored by a branch of a fork (the history it continued had several takers): rarely continued, so
    # the pool gives its room first (`HostPool.alloc`)
    fork_branch: bool = False
    touched: int = 0  # the pool's clock when it was last used (`HostPool.touch`)

    @property
    def count(self) -> int:
        return int(self.cols.numel())

    @property
    def awaits_next_turn(self) -> bool:
        """A session's latest stored history, not continued yet: its next turn is likely on its way."""
        return self.takers == 0 and not self.fork_branch

    @property
    def live_fork(self) -> bool:
        """A stored history several branches continued while one of them still runs: a sibling may still
        come for it. Once its branches are done it ages like any other (a finished session's fork must
        not outlive the live sessions' histories)."""
        return self.takers > 1 and self.running > 0


@dataclass
class HostTotals:
    demoted: int = 0  # columns written by compressions
    recalled: int = 0  # (layer, head) entries brought back to the device
    bytes_moved: int = 0
    keys_read: int = 0  # bytes of host keys read to score recalls (every key, or the fetched pages')
    recalls: int = 0  # requests that ran a recall
    recall_failures: int = 0
    copied: int = 0  # columns copied host to host (a request continuing a stored history)
    # branches the LRU took columns back from (all of them, or the newest it needed)
    branches_dropped: int = 0
    columns_dropped: int = 0
    demote_refused: int = 0  # evictions that could not be demoted (pool full even after the LRU)
    # requests that adopted a stored history whose host entries the LRU had taken back: they answer
    # without what it evicted
    histories_missed: int = 0
    # requests that read a stored history's entries without a copy (no room for one): its prefill and
    # its append read them; its decode steps recall from its excerpt and what it demoted itself
    histories_borrowed: int = 0
    # requests that took their stored history's entries from its node (a session's next turn, nobody
    # else continuing it, no room for a copy): the node keeps none for a later sibling or retry
    histories_moved: int = 0
    decode_steps: int = 0  # decode steps whose fixed-shape recall ran (`decode_recall`)
    decode_steps_overlapped: int = 0  # of them, planned before the previous step's results were processed
    prefills_both_tiers: int = 0  # prefill chunks that attended over the host entries too (`exact_prefill`)
    prefill_bytes_read: int = 0  # host keys and values those chunks read
    decode_step_syncs: int = 0  # KVEVICT_DEBUG only: host syncs counted inside them (`syncs.SyncCounter`)


class HostPool:
    """Preallocated host columns, a free list, and the LRU order of the branches holding columns."""

    def __init__(
        self, layers: int, heads: int, dim: int, columns: int, dtype: torch.dtype, pin: bool = False
    ) -> None:
        self.layers, self.heads, self.dim, self.size = layers, heads, dim, columns
        # one column more than the free list holds: `scratch`, which a fixed-shape recall's pairs that do
        # not move name (`decode_recall`); never a branch's
        shape = (layers, columns + 1, heads, dim)
        self.scratch = columns
        # zeros, not empty: every page is committed at start, as SGLang's own KV pool is (and pinned memory
        # on a GPU always is), so the tier's memory shows at start instead of creeping up over hours as
        # columns are first written, which an operator cannot tell from a leak
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.free_cols = torch.arange(columns - 1, -1, -1, dtype=torch.int64)  # a stack, top at the end
        self.n_free = columns
        self.lru: OrderedDict[int, HostEntries] = OrderedDict()
        # request row -> the entries a recall armed for the next forward reads and writes: never evicted
        self.in_use: dict[int, HostEntries] = {}
        self.totals = HostTotals()
        self.clock = 0  # counts touches: when a branch was last used (`HostEntries.touched`)

    @property
    def column_bytes(self) -> int:
        """Bytes of one column, K and V."""
        return 2 * self.layers * self.heads * self.dim * self.k.element_size()

    @property
    def used(self) -> int:
        return self.size - self.n_free

    def touch(self, e: HostEntries) -> None:
        if e.count and not e.released:
            self.lru[id(e)] = e
            self.lru.move_to_end(id(e))
            self.clock += 1
            e.touched = self.clock

    def drop_first(self, e: HostEntries) -> None:
        """`e` becomes the first branch the LRU drops (a stored history whose request took a copy)."""
        if id(e) in self.lru:
            self.lru.move_to_end(id(e), last=False)

    def alloc(
        self,
        n: int,
        keep: Iterable[HostEntries | None] = (),
        copying: HostEntries | None = None,
        count_refused: bool = True,
        last: Iterable[HostEntries] = (),
        arrived: int | None = None,
    ) -> torch.Tensor | None:
        """`n` free columns for a demotion (or a copy of `copying`), taken back from least-recently-used
        branches as needed (whole branches, and the newest columns of the last one: a small demotion
        costs another history what it needs, not all of it): never those in `keep`, nor entries a
        recall armed for the next forward holds (`in_use`) or a request reads (`borrow`). A copy takes
        only branches less recently used than `copying`, and never a running fork's history
        (`live_fork`: a sibling that finds no room borrows instead) nor a session's latest
        (`awaits_next_turn`). Branches a fork's branches stored and histories already
        continued go first, then sessions' latest, then those in `last` (stored histories a waiting
        request is about to continue) and running forks' histories, each group least recently used
        first. A demotion of a request that arrived at pool clock `arrived` takes from those last two
        groups only branches touched before it arrived: the history a session stored while the request
        ran is for that session's next turn, on its way, and outweighs what the request evicts now (a
        finished session's history ages out once newer requests arrive). None when the pool cannot
        give them (nothing is evicted then; a demotion's are counted as refused unless `count_refused`
        is False: a borrower's excerpt, `recall.EXCERPT`, is not one)."""
        if n <= 0:
            return torch.zeros(0, dtype=torch.int64)
        held = {*(id(e) for e in keep), *(id(e) for e in self.in_use.values())}
        order = list(self.lru.values())
        if copying is not None:  # a copy displaces only what is colder than the history it copies
            order = order[: order.index(copying)] if id(copying) in self.lru else []
        later = {id(e) for e in last}

        def group(e: HostEntries) -> int:  # 0: rarely continued; 1: a session's latest; 2: needed next
            return 2 if e.live_fork or id(e) in later else int(e.awaits_next_turn)

        victims = [
            e
            for e in order
            if id(e) not in held
            and not e.readers
            and not (copying is not None and (e.live_fork or e.awaits_next_turn))
            and not (arrived is not None and e.touched > arrived and group(e) > 0)
        ]
        victims.sort(key=group)
        if n > self.n_free + sum(e.count for e in victims):
            self.totals.demote_refused += n if count_refused and copying is None else 0
            return None
        for victim in victims:  # as many columns as still needed, the victim's newest ones
            short = n - self.n_free
            if short <= 0:
                break
            took = min(short, victim.count)
            self.totals.branches_dropped += 1
            self.totals.columns_dropped += took
            victim.dropped += took
            if took == victim.count:
                self.release(victim)
            else:
                self.trim(victim, took)
        out = self.free_cols[self.n_free - n : self.n_free].clone()
        self.n_free -= n
        return out

    def trim(self, e: HostEntries, a: int) -> None:
        """The branch gives back its last `a` columns, keeping the page summaries of its whole pages that
        remain and the positions of the entries that remain."""
        c2 = e.count - a
        self.give_back(e.cols[c2:])
        e.cols = e.cols[:c2].clone()
        sm = e.summaries
        if sm is not None and sm.n > c2:  # whole pages only: the next recall re-summarises the rest
            full = c2 // sm.page
            cut = [x[:full].clone() if x is not None else None for x in (sm.kmin, sm.kmax, sm.kmean)]
            e.summaries = PageSummaries(*cut, n=full * sm.page, page=sm.page)
        if e.positions is not None:
            e.positions = e.positions[..., :c2].clone()

    def give_back(self, cols: torch.Tensor) -> None:
        """Columns that were allocated but never attached to a branch (a commit that did not happen)."""
        m = int(cols.numel())
        if m:
            self.free_cols[self.n_free : self.n_free + m] = cols.to(torch.int64).flip(0)
            self.n_free += m

    def release(self, e: HostEntries | None) -> None:
        """Every column of a branch back to the pool; the object stays valid (empty). Entries a request
        still reads (`borrow`) go back when it is done with them (`unborrow`)."""
        if e is None:
            return
        self.lru.pop(id(e), None)
        if e.readers:
            e.released = True
            return
        self.give_back(e.cols)
        e.cols = torch.zeros(0, dtype=torch.int64)
        e.positions = None
        e.summaries = None

    def append(self, e: HostEntries, cols: torch.Tensor, positions: torch.Tensor | None) -> None:
        if not cols.numel():
            return
        e.cols = torch.cat([e.cols, cols])
        if positions is not None and (e.positions is not None or e.count == cols.numel()):
            e.positions = positions if e.positions is None else torch.cat([e.positions, positions], dim=-1)
        else:
            e.positions = None
        self.touch(e)

    def copy(self, e: HostEntries, busy: Iterable[HostEntries] = ()) -> HostEntries | None:
        """A second branch holding the same entries in columns of its own (a fork sibling's: each
        branch then swaps into its own, and neither sees the other's recalls). Room comes from the
        branches less recently used than `e`, least recently used first (a copy displaces only what is
        colder than the history it copies), never from a running fork's history or `busy` (the entries
        running requests own and those waiting requests are about to continue: a copy must not cost
        another branch its history). None when that is not enough."""
        cols = self.alloc(e.count, keep=(e, *busy), copying=e)
        if cols is None:
            return None
        src, dst = e.cols.to(self.k.device), cols.to(self.k.device)
        for buf in (self.k, self.v):
            buf.index_copy_(1, dst, buf.index_select(1, src))
        self.totals.copied += e.count
        out = HostEntries(cols=cols, positions=None if e.positions is None else e.positions.clone())
        out.summaries, e.summaries = e.summaries, None  # same columns in the same order: same pages
        self.touch(out)
        return out

    def borrow(self, e: HostEntries) -> None:
        """A request reads `e` (a stored history's) without a copy of its own: no eviction takes it until
        the request gives it up (`unborrow`)."""
        e.readers += 1
        self.totals.histories_borrowed += 1
        self.touch(e)

    def unborrow(self, e: HostEntries) -> None:
        """A reader is done with `e`; the last one returns its columns if its owner released it meanwhile."""
        e.readers -= 1
        if e.readers == 0 and e.released:
            e.released = False
            self.release(e)

    def write(self, cols: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """`k`, `v`: `[e, H, D]` entries of one layer into columns `cols`."""
        idx = cols.to(self.k.device)
        self.k[layer].index_copy_(0, idx, k.to(self.k.device, self.k.dtype))
        self.v[layer].index_copy_(0, idx, v.to(self.v.device, self.v.dtype))

    def stats(self) -> dict[str, int]:
        d = dict(self.totals.__dict__)
        d.update(host_capacity=self.size, host_used=self.used, host_branches=len(self.lru))
        return d


def build(
    layers: int, heads: int, dim: int, columns: int, dtype: torch.dtype, device: torch.device
) -> HostPool:
    """A server's host pool (pinned when the KV pool is on a GPU, for asynchronous copies); its context
    keeps it (`KvEvictContext.host`)."""
    pool = HostPool(layers, heads, dim, columns, dtype, pin=device.type == "cuda")
    logger.info(
        "sgl-kvevict: host tier: %d columns x %d layers x %d KV heads x %d (%.1f MiB, committed at start)",
        columns,
        layers,
        heads,
        dim,
        columns * pool.column_bytes / (1 << 20),
    )
    return pool


def release(pool: HostPool | None, e: HostEntries | None) -> None:
    if pool is not None and e is not None:
        pool.release(e)
