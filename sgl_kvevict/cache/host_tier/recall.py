"""Recall: the stage after a policy's selection that makes eviction non-final (`demote.py` keeps what
a compression evicts on the host tier; this brings back what a turn needs).

*When*, three times, each with the queries of the moment:
1. a turn's prefill attends over both tiers (`exact_prefill`): its new tokens, its first answer token
   and the queries its compression ranks by are the full cache's;
2. once that compression committed, before the first decode step, the turn's own window queries bring
   the host entries of the positions they attend most (over every layer and KV head, then each pair's
   own best) back into fresh slots appended to the row (*Append*, below);
3. every `--kv-recall-config` `every` decode steps, the step's own query exchanges host entries with
   the row's weakest inside the step's forward, in every layer and KV head, in fixed shapes for the
   whole batch (`decode_recall`).
   Where a decode forward ran without the hook (a CUDA graph replay runs no Python), or a request's
   batched recall failed once, the same exchange runs after the step's compression instead (`recall`),
   with the captured queries of the steps since the last one.

*Scores*: queries attend over the branch's host keys and the row's keys in one softmax; an entry's
score is the largest probability any of those queries (and query heads of its KV head) gives it: a fact
one query of the question leans on is worth bringing back, however many other queries ignore it (the
mean the policies use dilutes it by the window's length).

*Pages*: a host entry ranks by the best score of its page (`--kv-recall-config` `page` consecutive host columns of
its head, which hold tokens evicted together, mostly neighbours), so the token a query finds brings its
neighbours: the query of "the vault code is" finds "code", and the digits come with it.

*Swap*: per layer and KV head, the `R` best-ranked host entries that beat the lowest-scored displaceable
kept ones, and whose page a query gives at least `recall_core.MIN_SCORE` of its attention, swap places
with them in the request's own slots (`kernels.host_swap`). The floor keeps weak evidence from moving
entries back and forth (without it a turn moved 3-5x the bytes and answered no better). The displaced
entries go to the host in exchange, so the row keeps its length and the request's offset does not
change. A decode-time recall moves at most `recall_core.step_swaps` entries: a share of the displaceable
row per step since the last recall, in whole pages. Sinks and the uncompressed tail (the recent window,
where the queries sit) are never displaced.
Shared slots are never written (invariant 1): recall runs only when the compacted history is the
request's own (after a prefill compression it always is; otherwise `compressor.own_region` copies it
out of the tree first).

*Append* (`append`): once a turn's prefill compression committed, before its first
decode step, the turn's window queries bring `a` <= R host entries per layer and KV head into
fresh slots inserted after the compacted history, displacing nothing: first those of the `a` logical
positions they attend most over every layer and KV head (`recall_core.shared_positions`), in every pair
that holds them on the host, then each pair's own best; the row grows by `a` for the same
tokens (`ReqState.unevicted`), the turn's decode budget grows with it, and the turn's last compression
folds them back. The branch's last `a` columns fill the holes on the host (`holes_filled`), which gives
those columns back.

Every failure here degrades the request's recall only (logged, counted); its compression continues.
A failure part-way swaps back what the recall had swapped (`Recall.rollback`), so the row and the host
hold what they held before it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from sgl_kvevict import kernels as K
from sgl_kvevict.cache import capture, compressor, context, threads
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import decode_recall, demote, exact_prefill, host, recall_core
from sgl_kvevict.cache.host_tier.recall_core import SwapPositions, account, best_entries, mark_stale
from sgl_kvevict.cache.slots import alloc_slots, free_slots
from sgl_kvevict.cache.syncs import SyncCounter

if TYPE_CHECKING:
    from sgl_kvevict.cache.context import KvEvictContext

logger = logging.getLogger("sgl_kvevict")
# A paged recall of R entries fetches the columns of ceil(FETCH * R / page) pages per layer and KV head
# (chosen by their minmax key summaries), at least `FETCH_PAGES`, then keeps the best R of them by exact
# score. In a history of hundreds of pages, 64 candidate pages per layer and head found 7 of 12 planted
# facts where 8 (16 for a turn's R) found 2, and scoring every key 6 (measured on the long recall replay).
FETCH = 2
FETCH_PAGES = 64
# A request that borrowed its stored history (no room for a copy) keeps, from the append on, a copy of
# its best `EXCERPT * R` entries per layer and KV head beyond those appended (R: its recall tokens), by
# the append's ranking: its decode steps recall from them and from what it demotes itself. An answer
# that recalls p pages every step recalls 4R entries in 4R / (p * page) steps.
EXCERPT = 4


def tick(req: Any) -> None:
    """A decode step of a request with recall on: every `--kv-recall-config` `every` steps its newest
    queries recall again (a turn's answer may need what its prompt did not look at)."""
    s = st.get(req)
    if s is None or not s.recall.tokens:
        return
    s.recall.steps += 1
    if s.recall.steps >= s.ctx.settings.recall.every:
        s.recall.due = True


def due(req: Any) -> bool:
    s = st.get(req)
    return s is not None and s.recall.due and s.pending is None and not s.after_extend


def own(s: st.ReqState, length: int) -> int:
    """How many of the row's newest `length` logical tokens are the turn's own. A turn's recall scores
    with those queries only: a window reaching back into the previous turn would bring back what that
    turn's answer read (its note), not what this turn asks for."""
    return length - (s.recall.turn_start or 0)


def safe_recall(req: Any) -> int:
    """`recall`, degrading the request's recall on a failure. Returns the entries swapped in."""
    s = st.get(req)
    if s is None:
        return 0
    s.recall.due = False
    return _degrading(req, s, recall, "recall")


def _degrading(req: Any, s: st.ReqState, run: Any, what: str) -> int:
    """`run(req, s)` when the request recalls; a failure turns its recall off (logged, counted)."""
    if not demote.enabled(s):
        return 0
    try:
        return run(req, s)
    except Exception:
        demote.fail(s, what)
        return 0


def has_history(s: st.ReqState, read_only: bool = False) -> bool:
    """Whether a recall has something to bring back and somewhere to put it: the branch's host entries
    (taken first, `demote.take`; a borrowed history's for a pass that only reads them, `read_only`, and
    the borrow ends before any other), a compacted history, and no split compression under way."""
    demote.take(s)
    if not read_only:
        s.recall.end_borrow(s.ctx.host)
    e = demote.reading(s)
    return e is not None and e.count > 0 and s.pending is None and s.slot_map.comp_slots > 0


def recall(req: Any, s: st.ReqState) -> int:
    """Swap the best host entries into the lowest-scored displaceable kept slots (see the module), with
    the captured window's queries, after the turn's compression. Returns the entries swapped in."""
    kv = req.kv
    if not has_history(s):
        s.recall.skipped += 1  # nothing on the host (or no compacted history to swap into)
        return 0
    if not compressor.own_region(req, s):
        s.recall.skipped += 1  # the history sits in shared slots and no own copy could be made
        return 0
    kv_len = int(kv.kv_committed_len)
    lo, hi = _displaceable(s)
    length = s.slot_map.tokens_for(kv_len)
    # a turn's start scores with its own tokens' window queries; a decode-time recall with the queries of
    # the steps since the last recall only (the answer forming now, not the prompt the start already used)
    fresh, s.recall.steps = s.recall.steps, 0
    w = min(capture.count(s.ctx, kv.req_pool_idx, length), kv_len - hi, fresh or own(s, length))
    r = swaps(s, lo, hi, fresh)
    if r <= 0 or w <= 0:
        s.recall.skipped += 1
        return 0
    one = Recall.start(req, s, kv_len, length, lo, hi, r)
    try:
        for layer in range(s.ctx.rt.n_layers):
            q = s.ctx.capture.get(kv.req_pool_idx, layer, length)[:, -w:]  # [Hq, w, D], the row's last w
            one.layer(layer, q)
    except Exception:
        one.rollback("recall")
        return 0
    return one.finish()


def safe_append(req: Any) -> int:
    """`append`, degrading the request's recall on a failure. Returns the slots the row grew by."""
    s = st.get(req)
    if s is None or not s.recall.append_due:
        return 0
    s.recall.append_due = False
    grown = _degrading(req, s, append, "recall (append)")
    if grown:  # what it needed of a borrowed history is on the device now
        s.recall.end_borrow(s.ctx.host)
    return grown


def append(req: Any, s: st.ReqState) -> int:
    """After a turn's prefill compression, before its first decode step: the turn's window queries bring
    `a` host entries per layer and KV head (`Recall.append_all`) back into fresh slots appended to the
    compacted history, displacing nothing. The turn then decodes over its budget plus them; its next compression
    that is not a decode step's folds them back into the budget (`trigger.fires`). `a` is at most
    R, the entries the branch evicted, and what the slot pool can spare (twice `a` must be free or
    evictable: SGLang's next memory check must not retract for it). Returns `a` (0: nothing appended;
    the turn's other recalls are unchanged)."""
    kv, rt = req.kv, s.ctx.rt
    if not has_history(s, read_only=True):
        return 0
    if kv.kv_allocated_len != kv.kv_committed_len or not compressor.own_region(req, s):
        return 0
    kv_len = int(kv.kv_committed_len)
    lo, hi = _displaceable(s)
    length = s.slot_map.tokens_for(kv_len)
    w = min(capture.count(s.ctx, kv.req_pool_idx, length), kv_len - hi, own(s, length))
    src = demote.reading(s)
    a = min(s.recall.tokens, s.slot_map.own_evicted, src.count, int(rt.req_to_token.shape[1]) - kv_len)
    paged = None, 0
    if a > 0:  # a paged append picks from the fetched pages
        a, paged = _paged_room(s, a)
    if a <= 0 or w <= 0 or free_slots(rt) < 2 * a:
        return 0
    one = Recall.start(req, s, kv_len, length, lo, hi, a, paged=paged)
    one.new = alloc_slots(rt, a)
    try:
        if one.read_only:
            one.excerpt = _excerpt_columns(s, one, a)
        one.append_all(
            [s.ctx.capture.get(kv.req_pool_idx, layer, length)[:, -w:] for layer in range(rt.n_layers)]
        )
    except Exception:
        one.rollback("recall (append)")
        rt.allocator.free(one.new)
        return 0
    return one.finish()


def _excerpt_columns(s: st.ReqState, one: Recall, a: int) -> torch.Tensor | None:
    """Fresh host columns for a borrower's excerpt (`EXCERPT`): as many as its ranked entries beyond the
    `a` appended hold (a paged append ranks the fetched pages' entries only), taken as a demotion takes
    them (`demote.columns`). None when the pool has no room."""
    x = min(EXCERPT * s.recall.tokens, _ranked_columns(one.src.count, (one.sums, one.n_sel)) - a)
    if x <= 0:
        return None
    return demote.columns(s, x, count_refused=False)


def _ranked_columns(count: int, paged: tuple[host.PageSummaries | None, int]) -> int:
    """How many real columns per head a recall over `count` host columns ranks: all of them, or, paged
    (`_paged`), at least `(n - 1) * page + 1` in the `n` fetched pages (the last may be partial)."""
    sums, n_sel = paged
    return count if sums is None else (n_sel - 1) * sums.page + 1


def _paged_room(s: st.ReqState, a: int) -> tuple[int, tuple[host.PageSummaries | None, int]]:
    """The append's count and its fetched pages: it picks from the columns the pages `_paged` fetches for
    `a` rank (`_ranked_columns`), so `a` shrinks to that until they agree."""
    src = demote.reading(s)
    while True:
        paged = _paged(s.ctx, src, a)
        room = min(a, _ranked_columns(src.count, paged))
        if room == a or room <= 0:
            return room, paged
        a = room


def swaps(s: st.ReqState, lo: int, hi: int, steps: int) -> int:
    """The most entries per layer and KV head a recall may move into rows `[lo, hi)`: at most the
    request's recall tokens and the branch's host entries, and during decode (`steps` > 0 decode steps
    since the last recall) at most `recall_core.step_swaps` (a step's bytes stay bounded)."""
    r = min(s.recall.tokens, hi - lo, s.recall.host.count)
    return min(r, recall_core.step_swaps(steps, s.ctx.settings.recall.page, hi - lo)) if steps else r


def _displaceable(s: st.ReqState) -> tuple[int, int]:
    """Row range recall may displace: the compacted history past the sinks (the uncompressed tail, where
    the queries sit, and the sinks are never displaced)."""
    a = s.slot_map.anchor_kv
    n_sink = max(0, min(s.policy.config.sinks - s.slot_map.anchor_tokens, s.slot_map.comp_slots))
    return a + n_sink, a + s.slot_map.comp_slots


def exchange(
    s: st.ReqState,
    layer: int,
    row_slots: torch.Tensor,
    lo: int,
    hi: int,
    row_sc: torch.Tensor,
    host_sc: torch.Tensor,
    r: int,
    tracked: SwapPositions | None,
    cand: torch.Tensor | None = None,
    log: list[Undo] | None = None,
) -> torch.Tensor:
    """Per layer (from `layer`, as many as the scores have) and KV head: the `r` best-ranked host entries
    that beat the lowest-scored kept entries of `[lo, hi)` swap places with them (`kernels.host_swap`).
    `row_sc` `[l, H, len(row_slots)]`, `host_sc` `[l, H, c]`: every host entry (`cand` None), or the
    candidates `cand` `[l, H, c]` (indices into the branch's columns, whole pages in a row). Each swap is
    appended to `log` as it is written (a swap is its own inverse: `Recall.rollback` replays the log
    backwards). Returns the `[l, H]` swapped counts (on the device: no host sync)."""
    rt, pool, cfg = s.ctx.rt, s.ctx.host, s.ctx.settings
    hs, hidx = best_entries(host_sc, cfg.recall.page, r)  # [l, H, r], best first
    if cand is not None:
        hidx = cand.gather(-1, hidx)
    cs, cidx = (-row_sc[..., lo:hi]).topk(r, dim=-1)  # lowest-scored displaceable kept entries
    # the i-th best host entry beats the i-th worst kept one, with a query's attention behind it
    swap = (hs > -cs) & (hs >= recall_core.MIN_SCORE)
    counts = swap.sum(-1)  # hs falls and the displaced score rises with i, so swap is a prefix
    dev_slots = row_slots[lo:hi][cidx]  # [l, H, r]
    host_cols = s.recall.host.cols.to(pool.k.device)[hidx.to(pool.k.device)]
    if tracked is not None:
        tracked.apply(layer, (cidx + lo).cpu(), hidx.cpu(), swap.cpu())
    layers = range(layer, layer + int(row_sc.shape[0]))
    sl = slice(layers.start, layers.stop)
    args = ([rt.k_buffer(i) for i in layers], [rt.v_buffer(i) for i in layers], dev_slots)
    args += (pool.k[sl], pool.v[sl], host_cols, counts)
    K.host_swap(*args)
    if log is not None:
        log.append(Swapped(args))
    mark_stale(s.ctx.stats, layer, dev_slots, swap)
    return counts


# ---- page summaries: score pages, fetch only the chosen pages' columns ----------------------------
def summaries(ctx: KvEvictContext, e: host.HostEntries, page: int) -> host.PageSummaries:
    """The branch's page summaries (per-channel key bounds, in the KV dtype), brought up to its column count.
    Columns demoted since the last recall are read from the host once, and merged into the partial last
    page (`page_summaries_append`); a swap refreshes the pages it wrote (`Recall.layer`), so summaries
    always describe the columns."""
    pool, rt = ctx.host, ctx.rt
    kb = rt.k_buffer(0)
    lh = rt.n_layers * pool.heads
    sm = e.summaries
    if sm is None or sm.page != page or sm.n > e.count:
        empty = torch.zeros(0, rt.n_layers, pool.heads, pool.dim, dtype=kb.dtype, device=kb.device)
        sm = host.PageSummaries(empty, empty.clone(), None, n=0, page=page)
    if sm.n < e.count:
        new = pool.k[:, e.cols[sm.n :].to(pool.k.device)]  # [L, m, H, D]
        new = new.transpose(0, 1).reshape(new.shape[1], lh, pool.dim).to(kb.device)  # [m, L*H, D]
        flat = [
            x.reshape(x.shape[0], lh, pool.dim) if x is not None else None
            for x in (sm.kmin, sm.kmax, sm.kmean)
        ]
        got = K.page_summaries_append(*flat, sm.n, new, page)
        shaped = [
            x.view(x.shape[0], rt.n_layers, pool.heads, pool.dim) if x is not None else None for x in got
        ]
        sm = host.PageSummaries(*shaped, n=e.count, page=page)
    e.summaries = sm
    return sm


def _paged(ctx: KvEvictContext, e: host.HostEntries, r: int) -> tuple[host.PageSummaries | None, int]:
    """`(summaries, pages to fetch per head)` when a recall of `r` entries scores pages, `(None, 0)` when
    it scores every host key (the branch has no more pages than a paged recall would fetch anyway: then
    it is exact and costs no more)."""
    page = ctx.settings.recall.page
    n_sel = max(-(-FETCH * r // page), FETCH_PAGES)
    if K.n_pages(e.count, page) <= n_sel:
        return None, 0
    return summaries(ctx, e, page), n_sel


class Scored(NamedTuple):
    """One layer's scores (`Recall.score`): the host entries' `[H, c]` (-inf: a fetched page's padding)
    and the row's `[H, m]`; where pages were fetched, the candidates `[H, c]` (indices into the branch's
    columns), which of them are real, and the pages."""

    host_sc: torch.Tensor
    row_sc: torch.Tensor
    cand: torch.Tensor | None
    valid: torch.Tensor | None
    page_ids: torch.Tensor | None


# ---- the undo log of one recall: what `Recall.rollback` replays backwards --------------------------
@dataclass(frozen=True, eq=False)
class Swapped:
    """One `kernels.host_swap` call as written (its arguments): replaying it swaps the pairs back."""

    args: tuple


@dataclass(frozen=True, eq=False)
class Appended:
    """An append at `layer` took each KV head's branch columns `hidx` `[H, a]` into the fresh slots."""

    layer: int
    hidx: torch.Tensor


Undo = Swapped | Appended


# ---- one recall, layer by layer (inside a forward, or after a compression) ------------------------
@dataclass(eq=False)
class Recall:
    """One recall of one request, run layer by layer: the row range it may displace, what it scores,
    and the running count."""

    req: Any
    s: st.ReqState
    m: int  # row slots the queries read besides themselves (in a prefill: those before the new tokens)
    tokens: int  # logical tokens they stand for
    lo: int
    hi: int
    r: int
    row_slots: torch.Tensor  # the row's first `m` slots (int64)
    cols: torch.Tensor  # the branch's host columns (on the host pool's device)
    sums: host.PageSummaries | None  # None: every host key is scored
    n_sel: int  # pages fetched per head and layer when paged
    src: host.HostEntries  # the entries it reads: the branch's own, or (an append) a borrowed history's
    tracked: SwapPositions | None = None  # the row's and host's logical positions (None: not known)
    new: torch.Tensor | None = None  # appending: the fresh device slots (int64) the columns go to
    appended_pos: list[torch.Tensor] = field(default_factory=list)  # tracked: their positions, per layer
    excerpt: torch.Tensor | None = None  # appending from a borrowed history: its excerpt's fresh columns
    excerpt_pos: list[torch.Tensor] = field(default_factory=list)  # tracked: their positions, per layer
    swapped: torch.Tensor | None = None  # on the device, read once at the end
    done: list[Undo] = field(default_factory=list)  # what this recall wrote so far, in order (`rollback`)

    @property
    def read_only(self) -> bool:
        """Reading a borrowed history (`demote.take`): nothing is written to its columns."""
        return self.src is not self.s.recall.host

    @property
    def appending(self) -> bool:
        """Append mode (fresh slots `new` take the entries) rather than an exchange with kept ones."""
        return self.new is not None

    @classmethod
    def start(
        cls,
        req: Any,
        s: st.ReqState,
        m: int,
        tokens: int,
        lo: int,
        hi: int,
        r: int,
        paged: tuple[host.PageSummaries | None, int] | None = None,
    ) -> Recall:
        """`paged`: `_paged(s.recall.host, r)` when the caller has it already."""
        pool, src = s.ctx.host, demote.reading(s)
        pool.touch(src)
        sums, n_sel = paged if paged is not None else _paged(s.ctx, src, r)
        row_slots = s.ctx.rt.req_to_token[req.kv.req_pool_idx, :m].to(torch.int64)
        tracked = SwapPositions(s, m, src) if src.positions is not None else None
        cols = src.cols.to(pool.k.device)
        return cls(req, s, m, tokens, lo, hi, r, row_slots, cols, sums, n_sel, src, tracked)

    def score(self, layer: int, q: torch.Tensor) -> Scored:
        """The host entries' and the row's scores at `layer` under queries `q` `[Hq, w, D]`, the row's last
        `w` entries (each sees the host entries and the row up to itself)."""
        rt, pool = self.s.ctx.rt, self.s.ctx.host
        dev = self.row_slots.device
        heads = torch.arange(pool.heads, device=pool.k.device).unsqueeze(-1)
        cand = valid = page_ids = None
        if self.sums is None:
            hk = pool.k[layer].index_select(0, self.cols).to(dev)  # [e, H, D]
        else:
            sm = self.sums
            sc = K.page_scores(q.transpose(0, 1), *sm.at(layer), "minmax", rt.scale, "sum")
            page_ids = K.select_pages(sc, self.n_sel)  # [H, n]
            cand, valid = K.gather_columns(page_ids, sm.page, int(self.cols.numel()))  # [H, c]
            hk = _host_keys(pool, layer, self.cols[cand.to(pool.k.device)], heads).to(dev)  # [c, H, D]
        e = int(hk.shape[0])
        pool.totals.keys_read += hk.numel() * hk.element_size() * (1 if cand is None else 2)  # + refresh
        keys = torch.cat([hk, rt.k_buffer(layer).index_select(0, self.row_slots)])
        p = K.window_attention(q, keys, torch.arange(keys.shape[0], device=dev), rt.scale, True, "max")
        host_sc = p[:, :e] if valid is None else p[:, :e].masked_fill(~valid, float("-inf"))
        return Scored(host_sc, p[:, e:], cand, valid, page_ids)

    def layer(self, layer: int, q: torch.Tensor) -> None:
        """Score (`score`) and exchange at `layer` with queries `q`."""
        pool, dev = self.s.ctx.host, self.row_slots.device
        x = self.score(layer, q)
        counts = exchange(
            self.s,
            layer,
            self.row_slots,
            self.lo,
            self.hi,
            x.row_sc[None],
            x.host_sc[None],
            self.r,
            self.tracked,
            None if x.cand is None else x.cand[None],
            self.done,
        )
        self.swapped = counts.sum() if self.swapped is None else self.swapped + counts.sum()
        if x.cand is not None:  # the swap wrote displaced entries into the fetched pages: re-summarise them
            heads = torch.arange(pool.heads, device=pool.k.device).unsqueeze(-1)
            now = _host_keys(pool, layer, self.cols[x.cand.to(pool.k.device)], heads).to(dev).transpose(0, 1)
            K.refresh_pages(*self.sums.at(layer), x.page_ids, now, x.valid)
        elif self.src.summaries is not None:  # scored flat: the swapped columns' summaries are stale
            self.src.summaries = None

    def append_all(self, qs: list[torch.Tensor]) -> None:
        """Append mode: every layer scored first (`qs`, the queries per layer), then the logical positions
        ranked over all of them (`recall_core.shared_positions`, where the host entries' positions are
        known), then each layer's appends written (`append_layer`)."""
        scored = [self.score(layer, q) for layer, q in enumerate(qs)]
        a = int(self.new.numel())
        pos = ranks = None
        if self.tracked is not None:
            pos = [self._host_positions(layer, x.cand) for layer, x in enumerate(scored)]
            ranks = recall_core.shared_positions([x.host_sc for x in scored], pos, self.tokens, a)
        for layer, x in enumerate(scored):
            shared = None if ranks is None else recall_core.rank_of(ranks, pos[layer])
            self.append_layer(layer, x.host_sc, x.cand, shared)

    def _host_positions(self, layer: int, cand: torch.Tensor | None) -> torch.Tensor:
        """`[H, c]` logical positions of the host entries scored at `layer` (all, or the candidates)."""
        hpos = self.tracked.hpos[layer]
        return hpos.clone() if cand is None else hpos.gather(-1, cand.cpu())

    def append_layer(
        self, layer: int, host_sc: torch.Tensor, cand: torch.Tensor | None, shared: torch.Tensor | None
    ) -> None:
        """Append mode at `layer`: each KV head's `a` host entries (`recall_core.append_order`: the entries
        of the positions ranked over every layer first, `shared` `[H, c]`, then the head's own best) go to
        the fresh slots `new` (no entry is displaced), and the branch's last `a` columns of that head fill
        the holes they leave, so the branch ends `a` columns shorter (`finish` gives those back) and its
        pages stay dense. A borrowed history (`read_only`) is only read: the request stops reading it
        after the append (`safe_append`)."""
        pool, s = self.s.ctx.host, self.s
        a = int(self.new.numel())
        page = s.ctx.settings.recall.page
        idx = recall_core.append_order(
            host_sc, page, a, None if shared is None else shared.to(host_sc.device)
        )
        hidx = idx if cand is None else cand.gather(-1, idx)  # [H, a] branch column indices
        hidx = hidx.to(pool.k.device)
        heads = torch.arange(pool.heads, device=pool.k.device).unsqueeze(-1)
        rt = s.ctx.rt
        slots = self.new.unsqueeze(0).expand(pool.heads, -1)  # [H, a]: every head's entry to the same slot
        args = ([rt.k_buffer(layer)], [rt.v_buffer(layer)], slots[None], pool.k[layer : layer + 1])
        K.host_fetch(*args, pool.v[layer : layer + 1], self.cols[hidx][None])
        self.done.append(Appended(layer, hidx))
        if self.tracked is not None:
            self.appended_pos.append(self.tracked.hpos[layer].gather(-1, hidx.cpu()))
        if self.read_only:
            if self.excerpt is not None:
                self._excerpt_layer(layer, host_sc.scatter(-1, idx, float("-inf")), cand)
            return
        src, dst = holes_filled(hidx, int(self.cols.numel()))
        for buf in (pool.k, pool.v):
            buf[layer][self.cols[dst], heads] = buf[layer][self.cols[src], heads]
        if self.tracked is not None:
            hpos = self.tracked.hpos[layer]
            hpos.scatter_(-1, dst.cpu(), hpos.gather(-1, src.cpu()))
        if self.sums is not None:  # the pages the holes were in hold other entries now: re-summarise
            sm = self.sums
            page_ids = (dst // sm.page).to(self.row_slots.device)
            c2 = int(self.cols.numel()) - a
            cols, ok = K.gather_columns(page_ids, sm.page, c2)
            now = _host_keys(pool, layer, self.cols[cols.to(pool.k.device)], heads).to(self.row_slots.device)
            K.refresh_pages(*sm.at(layer), page_ids, now.transpose(0, 1), ok)
        elif s.recall.host.summaries is not None:
            s.recall.host.summaries = None

    def _excerpt_layer(self, layer: int, rest: torch.Tensor, cand: torch.Tensor | None) -> None:
        """A borrower's excerpt at `layer`: each KV head's best entries by `rest` (the append's scores,
        the appended ones out) copied from the borrowed columns into the excerpt's fresh columns."""
        pool = self.s.ctx.host
        x = int(self.excerpt.numel())
        _, xi = best_entries(rest, self.s.ctx.settings.recall.page, x)  # [H, x]
        xidx = (xi if cand is None else cand.gather(-1, xi)).to(pool.k.device)
        heads = torch.arange(pool.heads, device=pool.k.device).unsqueeze(-1)
        dst = self.excerpt.to(pool.k.device).expand(pool.heads, -1)
        for buf in (pool.k, pool.v):
            buf[layer][dst, heads] = buf[layer][self.cols[xidx], heads]
        if self.tracked is not None:
            self.excerpt_pos.append(self.tracked.hpos[layer].gather(-1, xidx.cpu()))

    def rollback(self, what: str) -> None:
        """A failure part-way (some layers swapped): swap those layers back, newest first, so the row and
        the host hold what they held before this recall (nothing lost, nothing duplicated); then turn
        recall off for the request (`demote.fail`). The branch's page summaries are dropped (a refresh
        may have seen the swapped columns); the next recall rebuilds them from the columns."""
        try:
            for step in reversed(self.done):
                if isinstance(step, Appended):  # the chosen entries back to their columns (holes refilled)
                    if not self.read_only:  # nothing was moved out of a borrowed history
                        self._undo_append(step.layer, step.hidx)
                else:  # a swap is its own inverse
                    K.host_swap(*step.args)
            self.done.clear()
        except Exception:
            logger.exception("kvevict: undoing a failed recall failed")
        if self.s.recall.host is not None:
            self.s.recall.host.summaries = None
        if self.excerpt is not None:  # never joined the branch
            self.s.ctx.host.give_back(self.excerpt)
            self.excerpt = None
        demote.fail(self.s, what)

    def _undo_append(self, layer: int, hidx: torch.Tensor) -> None:
        """The entries `append_layer` fetched into the fresh slots `new` back to each KV head's branch
        columns `hidx` `[H, a]` (the holes were refilled since: the columns must be written again)."""
        rt, pool = self.s.ctx.rt, self.s.ctx.host
        heads = torch.arange(pool.heads, device=pool.k.device).unsqueeze(-1)
        dev_heads = torch.arange(pool.heads, device=self.new.device).unsqueeze(-1)
        at, slots = self.cols[hidx], self.new.unsqueeze(0)
        for dev, hst in ((rt.k_buffer(layer), pool.k[layer]), (rt.v_buffer(layer), pool.v[layer])):
            hst[at, heads] = dev[slots, dev_heads].to(hst.device)

    def finish(self) -> int:
        if self.appending:
            return self._finish_append()
        self.done.clear()
        swapped = int(self.swapped) if self.swapped is not None else 0
        if self.tracked is not None:
            self.tracked.record(self.s, self.tokens)
        account(self.s, swapped)
        return swapped

    def _finish_append(self) -> int:
        """Every layer appended: the fresh slots join the row after the compacted history (the tail moves
        right), the request's counts say so (`ReqState.unevicted`), and the branch gives back its last
        `a` columns, whose entries now fill the holes."""
        self.done.clear()
        s, kv = self.s, self.req.kv
        rt, pool = s.ctx.rt, s.ctx.host
        a, hi = int(self.new.numel()), self.hi
        row = rt.req_to_token[kv.req_pool_idx]
        end = int(kv.kv_committed_len)
        tail = row[hi:end].clone()
        row[hi : hi + a] = self.new.to(row.dtype)
        row[hi + a : end + a] = tail
        kv.kv_committed_len = kv.kv_allocated_len = end + a
        s.unevicted(a)
        if s.ctx.stats is not None:  # fresh slots: no statistic yet
            for li in range(rt.n_layers):
                s.ctx.stats[li][self.new] = float("nan")
        rt.tree.offsets[kv.req_pool_idx] = s.slot_map.offset
        if not self.read_only:  # a borrowed history is left as it was
            self._shrink_branch(a)
        elif self.excerpt is not None:  # the borrower's own copy of the rest of what it ranked best
            pos = torch.stack(self.excerpt_pos) if self.tracked is not None else None
            pool.append(s.recall.entries(), self.excerpt, pos)
            pool.totals.copied += int(self.excerpt.numel())
        if self.tracked is not None:
            pos = self.tracked.pos
            added = torch.stack(self.appended_pos)  # [L, H, a]
            s.trace.event(torch.cat([pos[..., :hi], added, pos[..., hi:]], dim=-1), self.tokens)
        account(s, a * pool.heads * rt.n_layers, one_way=True)
        return a

    def _shrink_branch(self, a: int) -> None:
        """The branch gives back its last `a` columns (their entries filled the holes), keeping its page
        summaries of whole pages and its entries' positions."""
        e = self.s.recall.host
        c2 = e.count - a
        self.s.ctx.host.trim(e, a)
        if self.tracked is not None:
            e.positions = self.tracked.hpos[..., :c2].clone()


def holes_filled(hidx: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(src, dst)` `[H, a]`: after each head's columns `hidx` `[H, a]` (distinct) leave a branch of `c`
    columns, the moves that keep it dense in `c - a` columns: the head's entries in the last `a` columns
    that stay fill, in order, the holes below `c - a`. Pairs past a head's count are `src == dst`
    (no-ops), so the shape stays fixed and nothing is read back."""
    h, a = hidx.shape
    c2 = c - a
    holes = torch.where(hidx < c2, hidx, c).sort(dim=-1).values  # the head's holes first, ascending
    gone = torch.zeros(h, a + 1, dtype=torch.int8, device=hidx.device)  # column a: a sink for the rest
    gone.scatter_(-1, torch.where(hidx >= c2, hidx - c2, a), 1)
    stay = torch.sort(gone[:, :a], dim=-1, stable=True).indices + c2  # staying tail columns first
    real = holes < c2
    return stay, torch.where(real, holes, stay)


def _host_keys(pool: host.HostPool, layer: int, cols: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """`[c, H, D]` host keys of `layer`, head h's from its own columns `cols[h]` (`cols` `[H, c]`)."""
    return pool.k[layer][cols, heads].transpose(0, 1)


# ---- recall inside a forward (a prefill over both tiers, a decode step) -----------------------------------------
def after_compress(req: Any, decode: bool) -> int:
    """Called per request once a scheduler step's compressions committed: after a prefill, recalled
    columns are appended (`safe_append`); a due decode-time recall is armed
    for the step's forward (its own queries, layer by layer), else runs now (`safe_recall`). Returns
    the slots the request's row grew by (the batch's lengths grow with it)."""
    s = st.get(req)
    if s is None:
        return 0
    grown = 0 if decode else safe_append(req)
    if grown:
        s.recall.due = False  # the append brought back the turn's best entries
    stale = disarm(s.ctx, req.kv.req_pool_idx) if req.kv.req_pool_idx is not None else None
    if stale is not None and stale.s is s:  # armed for a forward that did not run it (a retraction)
        s.recall.due = True
    if decode:
        tick(req)
    if not due(req):
        return grown
    if decode and not s.ctx.graphed and not s.recall.alone and arm(req, s, decode=True):
        return grown
    safe_recall(req)
    return grown


def arm(req: Any, s: st.ReqState, decode: bool = False) -> bool:
    """Prepare the request's next forward to read the host tier, layer by layer. True when armed (the
    recall is no longer due); False when the request recalls otherwise (after its compression) or not
    at all.

    A prefill chunk (`decode` False) attends over both tiers (`exact_prefill`), once the turn has its
    slots: its compacted history still sits in the tree node it matched (shared), so it is copied into
    slots the request owns first (`compressor.own_region`, up to the new tokens). A decode step's query
    recalls for the token it is about to write, at most `recall_core.step_swaps` entries (a share of the
    row per step since the last recall), in fixed shapes for the whole batch (`decode_recall`).
    A failure here turns recall off for the request (logged, counted); nothing else changes."""
    row = req.kv.req_pool_idx
    disarm(s.ctx, row)
    try:
        armed = _plan_arm(req, s, decode)
    except Exception:
        demote.fail(s, "arming a recall")
        armed = False
    if armed:
        s.recall.due = False
    return armed


def disarm(ctx: KvEvictContext, row: int) -> decode_recall.DecodeArm | None:
    """Drop what is armed for a request row (if anything), and its hold on the branch's host entries;
    returns a decode step's arm."""
    if ctx.host is not None:
        ctx.host.in_use.pop(row, None)
    ctx.exact_armed.pop(row, None)
    return ctx.decode_armed.pop(row, None)


def _plan_arm(req: Any, s: st.ReqState, decode: bool) -> bool:
    kv, row = req.kv, req.kv.req_pool_idx
    if not demote.enabled(s) or row is None or not has_history(s, read_only=not decode):
        return False
    if not decode:  # every chunk of a prefill: each writes exact K/V
        m = s.slot_map.slots_for(int(req.prefix_len))
        if not compressor.own_region(req, s, upto=m):
            return False
        exact_prefill.arm(req, s)
        return True
    if kv.cache_protected_len > s.slot_map.anchor_kv:
        return False  # the history is not the request's own yet (`recall` copies it)
    lo, hi = _displaceable(s)
    fresh, s.recall.steps = max(1, s.recall.steps), 0
    r = swaps(s, lo, hi, fresh)
    if r > 0:
        decode_recall.arm(req, s, lo, hi, r)
    return r > 0


# A guard only: one decode step is prepared ahead of the one whose results are processed (overlap).
MAX_STEPS_IN_FLIGHT = 4


def plan_step(ctx: KvEvictContext, reqs: list[Any]) -> None:
    """The scheduler, last thing before a decode forward: the batch's armed decode recalls as one
    fixed-shape plan for the forward's layers (`decode_recall.plan`), queued until the step's results
    are processed (`finish_step`). Under the overlap scheduler the previous step's plan is still queued:
    nothing here waits for it (its records live in their own buffers)."""
    plan = None
    if ctx.decode_armed and ctx.host is not None:
        plan = decode_recall.plan(ctx, reqs)
        if plan is not None:
            plan.overlapped = bool(ctx.steps_in_flight)
    while len(ctx.steps_in_flight) >= MAX_STEPS_IN_FLIGHT:  # results that never came: do not hold on
        logger.warning(
            "kvevict: a decode step's results were never processed; its recall records are read now"
        )
        _finish(ctx, ctx.steps_in_flight.popleft())
    ctx.step_plan = plan
    ctx.steps_in_flight.append(plan)


def finish_step(ctx: KvEvictContext) -> None:
    """The scheduler, processing a decode step's results: that step's recall records (the oldest step in
    flight) become counters (`decode_recall.finish`)."""
    if ctx.steps_in_flight:
        _finish(ctx, ctx.steps_in_flight.popleft())


def _finish(ctx: KvEvictContext, one: decode_recall.StepPlan | None) -> None:
    """A plan no layer ran means the forward ran without the hook (a CUDA graph replay runs no Python):
    decode-time recalls then run after each step's compression instead (`after_compress`)."""
    if ctx.step_plan is one:
        ctx.step_plan = None
    if one is None:
        return
    if one.layers_done == 0 and not one.failed:
        if not ctx.graphed:
            logger.warning(
                "kvevict: a decode forward ran without the recall hook (a CUDA graph replay?): decode-time "
                "recalls run after each step's compression from now on"
            )
        ctx.graphed = True
        for a in one.arms:
            if a is not None:
                a.s.recall.due = True
                a.s.recall.steps = max(a.s.recall.steps, 1)
    try:
        decode_recall.finish(ctx, one)
    except Exception:  # the exchanges stand (both pools consistent); the step's accounting is lost
        logger.exception("kvevict: reading back a decode step's recall failed")
        for a in one.arms:
            if a is not None:
                demote.fail(a.s, "recall (after a decode step)")


def drop_finished(req: Any, s: st.ReqState) -> None:
    """A request found finished while a later decode step (launched under the overlap scheduler) still
    holds its recall: that step's exchanges for it go back before its last compression, since without
    overlap that step never runs. Its history then goes into the tree as without overlap."""
    for one in s.ctx.steps_in_flight:
        if one is None:
            continue
        for i, a in enumerate(one.arms):
            if a is not None and a.s is s:
                try:
                    one.undo_row(s.ctx, i)
                except Exception:
                    decode_recall.fail(s.ctx, one)
                    logger.exception("kvevict: undoing a finished request's in-flight recall failed")


def before_attention(layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: a decode step's planned recall runs at this layer, before its
    attention."""
    if q is None:
        return None
    ctx = context.of_forward(forward_batch)
    if ctx is None or ctx.step_plan is None or not forward_batch.forward_mode.is_decode():
        return None
    rt = ctx.rt
    layer = layer_mod.layer_id - rt.start_layer
    one = ctx.step_plan
    if not one.failed and one.layers_done == layer:  # each layer once, in order
        try:
            # KVEVICT_DEBUG: count what would make the host wait for a GPU (the tests expect none)
            with threads.one_thread(), SyncCounter() if st.DEBUG else contextlib.nullcontext() as syncs:
                one.layer(ctx, layer, q.view(-1, rt.n_q_heads, rt.head_dim))
            if syncs is not None:
                ctx.host.totals.decode_step_syncs += syncs.total
        except Exception:  # the batch's decode recall only: its earlier layers are swapped back
            logger.exception("kvevict: a decode step's recall failed")
            decode_recall.fail(ctx, one)
    return None
