"""Recall: the stage after a policy's selection that makes eviction non-final (`demote.py` keeps what
a compression evicts on the host tier; this brings back what a new turn needs).

*When*: inside a turn's prefill, layer by layer (`arm`, then `before_attention`): before layer l's
attention, the new tokens' own layer-l queries pick what to bring back at layer l, so the prompt is
read with what it recalled, and so is the first answer token, which the prefill's logits decide
(a turn that asks for a code answers its first digit there). Where that cannot run (a chunked
prefill's earlier chunks, the history not copyable into own slots), right after the turn's prefill
compression instead, before its first decode step. With `--kv-recall-every N`, again every N decode
steps.

*Scores*: queries attend over the branch's host keys and the row's keys in one softmax; an entry's
score is the largest probability any of those queries (and query heads of its KV head) gives it: a fact
one query of the question leans on is worth bringing back, however many other queries ignore it (the
mean the policies use dilutes it by the window's length). In a prefill the queries are the turn's new
tokens (the last `PREFILL_QUERIES` of them); after it, the captured window; during decode, the queries
of the steps since the last recall.

*Pages*: a host entry ranks by the best score of its page (`--kv-recall-page` consecutive host columns of
its head, which hold tokens evicted together, mostly neighbours), so the token a query finds brings its
neighbours: the query of "the vault code is" finds "code", and the digits come with it.

*Swap*: per layer and KV head, the `R` best-ranked host entries that beat the lowest-scored displaceable
kept ones swap places with them in the request's own slots (`kernels.host_swap`): the displaced entries
go to the host in exchange, so the row keeps its length and the request's offset does not change. A
decode-time recall moves at most one page per step since the last recall. Sinks and the uncompressed
tail (the recent window, where the queries sit) are never displaced. Shared slots are never written
(invariant 1): recall runs only when the compacted history is the request's own (after a prefill
compression it always is; before a prefill, `arm` copies it out of the tree into the request's slots
first, as `compressor.own_region` does for a turn whose compression did not fire).

Every failure here degrades the request's recall only (logged, counted); its compression continues.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sgl_kvevict import kernels as K
from sgl_kvevict.cache import capture, compressor, demote, host, runtime, slotstats
from sgl_kvevict.cache import state as st
from sgl_kvevict.config import server_settings

logger = logging.getLogger("sgl_kvevict")
# A prefill's recall scores with at most this many of the turn's newest tokens' queries (bounds its cost).
PREFILL_QUERIES = 512


def tick(req: Any) -> None:
    """A decode step of a request with recall on: every `--kv-recall-every` steps its newest window
    queries recall again (a turn's answer may need what its prompt did not look at)."""
    s = st.get(req)
    if s is None or not s.recall:
        return
    every = server_settings().recall_every
    if not every:
        return
    s.recall_steps += 1
    if s.recall_steps >= every:
        s.recall_due = True


def due_next_step(req: Any) -> bool:
    """Whether the request's next decode step recalls (`tick` will make it due): the scheduler then
    processes the pending step's results first, so the recall sees the request's committed length."""
    s = st.get(req)
    if s is None or not s.recall or s.host is None and s.host_src is None:
        return False
    every = server_settings().recall_every
    return bool(every) and s.recall_steps + 1 >= every


def due(req: Any) -> bool:
    s = st.get(req)
    return s is not None and s.recall_due and s.pending is None and not s.after_extend


def safe_recall(req: Any) -> int:
    """`recall`, degrading the request's recall on a failure. Returns the entries swapped in."""
    s = st.get(req)
    if s is None:
        return 0
    s.recall_due = False
    if not demote.enabled(s):
        return 0
    try:
        return recall(req, s)
    except Exception:
        demote.fail(s, "recall")
        return 0


def _scores(
    req: Any, s: st.ReqState, row_slots: torch.Tensor, w: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[L, H, kv_len]` and `[L, H, e]`: window attention of the last `w` queries over the branch's host
    keys and the row's keys in one softmax, the host keys first (they precede every query)."""
    rt, pool = runtime.RT, host.POOL
    kv_len = int(row_slots.numel())
    cols = s.host.cols.to(pool.k.device)
    e = int(cols.numel())
    dev = row_slots.device
    every = torch.arange(e + kv_len, device=dev)
    row_out, host_out = [], []
    for layer in range(rt.n_layers):
        q = capture.STORE.get(req.kv.req_pool_idx, layer, length)[:, -w:]  # [Hq, w, D]
        keys = torch.cat(
            [pool.k[layer].index_select(0, cols).to(dev), rt.k_buffer(layer).index_select(0, row_slots)]
        )
        p = K.window_attention(q, keys, every, rt.scale, causal=True, reduce="max")  # [H, e + kv_len]
        host_out.append(p[:, :e])
        row_out.append(p[:, e:])
    return torch.stack(row_out), torch.stack(host_out)


def page_best(sc: torch.Tensor, page: int) -> torch.Tensor:
    """Each host entry scored by the best entry of its page (`page` consecutive columns of a head)."""
    if page <= 1:
        return sc
    e = sc.shape[-1]
    n = -(-e // page)
    padded = torch.nn.functional.pad(sc, (0, n * page - e), value=float("-inf"))
    best = padded.view(*sc.shape[:-1], n, page).amax(-1)
    return best.repeat_interleave(page, dim=-1)[..., :e]


def best_entries(sc: torch.Tensor, page: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `r` best host entries per (layer, head), `(page scores, indices)`, best first: by their page's
    score, then, inside a page, by their own (so a page cut by `r` gives its best entries)."""
    ranked = page_best(sc, page)
    order = sc.argsort(dim=-1, descending=True, stable=True)
    by_page = ranked.gather(-1, order).argsort(dim=-1, descending=True, stable=True)
    idx = order.gather(-1, by_page)[..., :r]
    return ranked.gather(-1, idx), idx


def recall(req: Any, s: st.ReqState) -> int:
    """Swap the best host entries into the lowest-scored displaceable kept slots (see the module)."""
    demote.take(s)
    rt, pool = runtime.RT, host.POOL
    kv = req.kv
    if s.host is None or s.host.count == 0 or s.pending is not None or s.comp_slots == 0:
        s.recall_skipped += 1  # nothing on the host (or no compacted history to swap into)
        return 0
    if not compressor.own_region(req, s):
        s.recall_skipped += 1  # the history sits in shared slots and no own copy could be made
        return 0
    kv_len = int(kv.kv_committed_len)
    lo, hi = _displaceable(s)
    length = s.tokens_for(kv_len)
    # a turn's start scores with its whole window; a decode-time recall with the queries of the steps
    # since the last recall only (the answer forming now, not the prompt the turn's start already used)
    fresh, s.recall_steps = s.recall_steps, 0
    w = min(capture.count(kv.req_pool_idx, length), kv_len - hi, fresh or kv_len)
    r = min(s.recall, hi - lo, s.host.count)
    if fresh:  # during decode: at most one page per step since the last recall (bounds a step's bytes)
        r = min(r, fresh * server_settings().recall_page)
    if r <= 0 or w <= 0:
        s.recall_skipped += 1
        return 0
    pool.touch(s.host)
    row_slots = rt.req_to_token[kv.req_pool_idx, :kv_len].to(torch.int64)
    row_sc, host_sc = _scores(req, s, row_slots, w, length)
    dbg = _DebugSwap(s, kv_len) if st.DEBUG and s.host.positions is not None else None
    swapped = int(_exchange(s, 0, row_slots, lo, hi, row_sc, host_sc, r, dbg).sum())
    if dbg is not None:
        s.host.positions = dbg.hpos
        s.debug_event(dbg.pos, length)
    _account(s, swapped)
    return swapped


def _displaceable(s: st.ReqState) -> tuple[int, int]:
    """Row range recall may displace: the compacted history past the sinks (the uncompressed tail, where
    the queries sit, and the sinks are never displaced)."""
    a = s.anchor_kv
    n_sink = max(0, min(s.policy.config.sinks - s.anchor_tokens, s.comp_slots))
    return a + n_sink, a + s.comp_slots


class _DebugSwap:
    """KVEVICT_DEBUG: the row's and the host's logical positions, updated by each exchange (the oracle
    replays them as a timeline event)."""

    def __init__(self, s: st.ReqState, kv_len: int) -> None:
        self.pos = demote.positions(s, kv_len).clone()
        self.hpos = s.host.positions.clone()

    def apply(self, layer: int, didx: torch.Tensor, hidx: torch.Tensor, swap: torch.Tensor) -> None:
        sl = slice(layer, layer + didx.shape[0])
        pos, hpos = self.pos[sl], self.hpos[sl]
        dp, hp = pos.gather(-1, didx), hpos.gather(-1, hidx)
        pos.scatter_(-1, didx, torch.where(swap, hp, dp))
        hpos.scatter_(-1, hidx, torch.where(swap, dp, hp))


def _exchange(
    s: st.ReqState,
    layer: int,
    row_slots: torch.Tensor,
    lo: int,
    hi: int,
    row_sc: torch.Tensor,
    host_sc: torch.Tensor,
    r: int,
    dbg: _DebugSwap | None,
) -> torch.Tensor:
    """Per layer (from `layer`, as many as the scores have) and KV head: the `r` best-ranked host entries
    that beat the lowest-scored kept entries of `[lo, hi)` swap places with them (`kernels.host_swap`).
    `row_sc` `[l, H, len(row_slots)]`, `host_sc` `[l, H, e]`. Returns the `[l, H]` swapped counts (on
    the device: no host sync)."""
    rt, pool = runtime.RT, host.POOL
    hs, hidx = best_entries(host_sc, server_settings().recall_page, r)  # [l, H, r], best first
    cs, cidx = (-row_sc[..., lo:hi]).topk(r, dim=-1)  # lowest-scored displaceable kept entries
    swap = hs > -cs  # the i-th best host entry beats the i-th worst kept one
    counts = swap.sum(-1)  # hs falls and the displaced score rises with i, so swap is a prefix
    dev_slots = row_slots[lo:hi][cidx]  # [l, H, r]
    host_cols = s.host.cols.to(pool.k.device)[hidx.to(pool.k.device)]
    if dbg is not None:
        dbg.apply(layer, (cidx + lo).cpu(), hidx.cpu(), swap.cpu())
    layers = range(layer, layer + int(row_sc.shape[0]))
    sl = slice(layers.start, layers.stop)
    K.host_swap(
        [rt.k_buffer(i) for i in layers],
        [rt.v_buffer(i) for i in layers],
        dev_slots,
        pool.k[sl],
        pool.v[sl],
        host_cols,
        counts,
    )
    if slotstats.STATS is not None:  # a recalled slot's ||v W_O|| is another value's: stale
        heads = torch.arange(rt.n_kv_heads, device=dev_slots.device).unsqueeze(-1)
        for i, li in enumerate(layers):
            old = slotstats.STATS[li][dev_slots[i], heads]
            slotstats.STATS[li][dev_slots[i], heads] = torch.where(swap[i], float("nan"), old)
    return counts


def _account(s: st.ReqState, swapped: int) -> None:
    """Counters of one recall (a turn's, or a decode-time one): entries in, bytes both ways."""
    rt, pool = runtime.RT, host.POOL
    s.recalled_into_history = s.recalled_into_history or swapped > 0
    moved = swapped * 2 * rt.head_dim * rt.k_buffer(0).element_size() * 2
    s.recalled += swapped
    s.bytes_moved += moved
    s.host_peak = max(s.host_peak, s.host.count if s.host is not None else 0)
    tot = pool.totals
    tot.recalled += swapped
    tot.bytes_moved += moved
    tot.recalls += 1


# ---- recall inside a forward (a prefill or a decode step) -----------------------------------------
@dataclass(eq=False)
class _Armed:
    """A request whose next forward (a prefill or a decode step) recalls layer by layer: its row range
    and the running count."""

    req: Any
    s: st.ReqState
    m: int  # row slots before the new tokens (what the prefill's queries read besides themselves)
    tokens: int  # logical tokens they stand for
    lo: int
    hi: int
    r: int
    swapped: torch.Tensor | None = None  # on the device, read once at the last layer
    dbg: _DebugSwap | None = None
    decode: bool = False


ARMED: dict[int, _Armed] = {}  # request row -> its recall inside the next forward
# Set once a decode forward ran without the hook (a CUDA graph replay runs no Python): decode-time
# recalls then run after the step's compression instead, with the queries the capture kept.
GRAPHED = False


def after_compress(req: Any, decode: bool) -> None:
    """Called per request once a scheduler step's compressions committed: a due decode-time recall is
    armed for the step's forward (its own queries, layer by layer), else runs now (`safe_recall`)."""
    global GRAPHED
    s = st.get(req)
    if s is None:
        return
    stale = ARMED.pop(req.kv.req_pool_idx, None) if req.kv.req_pool_idx is not None else None
    if stale is not None and stale.s is s:  # armed for a forward that ran without the hook
        s.recall_due = True
        if stale.decode:
            GRAPHED = True
            s.recall_steps = max(s.recall_steps, 1)
    if decode:
        tick(req)
    if not due(req):
        return
    if decode and not GRAPHED and _arm_decode(req, s):
        return
    safe_recall(req)


def _arm_decode(req: Any, s: st.ReqState) -> bool:
    """Prepare a recall inside this decode step's forward: its query, at each layer, recalls for itself
    (the token it is about to produce), at most one page per step since the last recall."""
    row, kv = req.kv.req_pool_idx, req.kv
    if not demote.enabled(s) or s.pending is not None or row is None:
        return False
    demote.take(s)
    if s.host is None or s.host.count == 0 or s.comp_slots == 0 or kv.cache_protected_len > s.anchor_kv:
        return False  # nothing to recall, or the history is not the request's own yet (`recall` copies it)
    m = int(kv.kv_committed_len)
    lo, hi = _displaceable(s)
    fresh, s.recall_steps = max(1, s.recall_steps), 0
    r = min(s.recall, hi - lo, s.host.count, fresh * server_settings().recall_page)
    if r <= 0:
        return False
    s.recall_due = False
    dbg = _DebugSwap(s, m) if st.DEBUG and s.host.positions is not None else None
    ARMED[row] = _Armed(req, s, m, s.tokens_for(m), lo, hi, r, dbg=dbg, decode=True)
    host.POOL.touch(s.host)
    return True


def arm(req: Any, s: st.ReqState) -> bool:
    """Called once a turn's prefill has its slots, before its forward: prepare a layer-by-layer recall.

    The compacted history still sits in the tree node the request matched (shared), so it is copied into
    slots the request owns first (`compressor.own_region`, up to the new tokens). False (and the turn
    recalls after its compression instead) when there is nothing to recall, the prefill is a chunk with
    more to come, or the copy cannot be made."""
    row = req.kv.req_pool_idx
    ARMED.pop(row, None)
    if not demote.enabled(s) or s.pending is not None or row is None:
        return False
    if req.extend_end is not None and req.extend_end < len(req.origin_input_ids) + len(req.output_ids):
        return False  # a chunk with more to come: the last chunk's queries recall
    demote.take(s)
    if s.host is None or s.host.count == 0 or s.comp_slots == 0:
        return False
    m = s.slots_for(int(req.prefix_len))
    if not compressor.own_region(req, s, upto=m):
        return False
    lo, hi = _displaceable(s)
    r = min(s.recall, hi - lo, s.host.count)
    if r <= 0:
        return False
    dbg = _DebugSwap(s, m) if st.DEBUG and s.host.positions is not None else None
    ARMED[row] = _Armed(req, s, m, int(req.prefix_len), lo, hi, r, dbg=dbg)
    host.POOL.touch(s.host)
    return True


def before_attention(layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: armed requests recall at this layer, before its attention."""
    if not ARMED or q is None:
        return None
    mode = forward_batch.forward_mode
    if not (mode.is_extend() or mode.is_decode()):
        return None
    rt = runtime.RT
    layer = layer_mod.layer_id - rt.start_layer
    last = layer == rt.n_layers - 1
    for row, start, n in _extend_rows(forward_batch):
        a = ARMED.get(row)
        if a is None:
            continue
        if a.req.kv.req_pool_idx != row or st.get(a.req) is not a.s or a.req.finished():
            ARMED.pop(row, None)  # armed for a request that is gone
            continue
        try:
            _recall_layer(a, row, layer, q[start : start + n])
            if last:
                ARMED.pop(row, None)
                _finish(a)
        except Exception:
            ARMED.pop(row, None)
            demote.fail(a.s, "recall")
    return None


def _extend_rows(forward_batch: Any) -> list[tuple[int, int, int]]:
    """`(row, first token, tokens)` per request of the batch, computed once per forward."""
    rows = getattr(forward_batch, "_kvevict_rows", None)
    if rows is None:
        if forward_batch.forward_mode.is_decode():
            lens = [1] * int(forward_batch.req_pool_indices.shape[0])
        else:
            lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
        starts = [sum(lens[:i]) for i in range(len(lens))]
        rows = list(zip(forward_batch.req_pool_indices.tolist(), starts, lens, strict=True))
        forward_batch._kvevict_rows = rows
    return rows


def _recall_layer(a: _Armed, row: int, layer: int, q: torch.Tensor) -> None:
    """Score the branch's host keys and the row's first `a.m` keys of `layer` with the new tokens'
    queries (a decode step's one; all keys precede every query: no causal mask), then exchange at this
    layer only."""
    rt, pool, s = runtime.RT, host.POOL, a.s
    qv = q.reshape(q.shape[0], rt.n_q_heads, rt.head_dim)[-PREFILL_QUERIES:].transpose(0, 1)
    row_slots = rt.req_to_token[row, : a.m].to(torch.int64)
    cols = s.host.cols.to(pool.k.device)
    e = int(cols.numel())
    dev = row_slots.device
    keys = torch.cat(
        [pool.k[layer].index_select(0, cols).to(dev), rt.k_buffer(layer).index_select(0, row_slots)]
    )
    p = K.window_attention(qv, keys, torch.arange(e + a.m, device=dev), rt.scale, reduce="max")
    counts = _exchange(s, layer, row_slots, a.lo, a.hi, p[None, :, e:], p[None, :, :e], a.r, a.dbg)
    a.swapped = counts.sum() if a.swapped is None else a.swapped + counts.sum()


def _finish(a: _Armed) -> None:
    s = a.s
    if a.dbg is not None:
        s.host.positions = a.dbg.hpos
        s.debug_event(a.dbg.pos, a.tokens)
    _account(s, int(a.swapped) if a.swapped is not None else 0)
