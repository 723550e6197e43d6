"""Recall: the stage after a policy's selection that makes eviction non-final (`demote.py` keeps what
a compression evicts on the host tier; this brings back what a new turn needs).

*When*: right after the prefill-phase compression of a turn, before its first decode step; with
`--kv-recall-every N`, again every N decode steps.

*Scores*: the captured window queries attend over the branch's host keys and the row's keys in one
softmax; an entry's score is the largest probability any of those queries (and query heads of its KV
head) gives it: a fact one query of the question leans on is worth bringing back, however many other
queries ignore it (the mean the policies use dilutes it by the window's length). A turn's start scores
with its whole window; a decode-time recall with the queries of the steps since the last recall.

*Pages*: a host entry ranks by the best score of its page (`--kv-recall-page` consecutive host columns of
its head, which hold tokens evicted together, mostly neighbours), so the token a query finds brings its
neighbours: the query of "the vault code is" finds "code", and the digits come with it.

*Swap*: per layer and KV head, the `R` best-ranked host entries that beat the lowest-scored displaceable
kept ones swap places with them in the request's own slots (`kernels.host_swap`): the displaced entries
go to the host in exchange, so the row keeps its length and the request's offset does not change. A
decode-time recall moves at most one page per step since the last recall. Sinks and the uncompressed
tail (the recent window, where the queries sit) are never displaced. Shared slots are never written
(invariant 1): recall runs only when the compacted history is the request's own (after a prefill
compression it always is).

Every failure here degrades the request's recall only (logged, counted); its compression continues.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sgl_kvevict import kernels as K
from sgl_kvevict.cache import capture, compressor, demote, host, runtime, slotstats
from sgl_kvevict.cache import state as st
from sgl_kvevict.config import server_settings

logger = logging.getLogger("sgl_kvevict")


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
    a = s.anchor_kv
    if s.host is None or s.host.count == 0 or s.pending is not None or s.comp_slots == 0:
        s.recall_skipped += 1  # nothing on the host (or no compacted history to swap into)
        return 0
    if not compressor.own_region(req, s):
        s.recall_skipped += 1  # the history sits in shared slots and no own copy could be made
        return 0
    kv_len = int(kv.kv_committed_len)
    n_sink = max(0, min(s.policy.config.sinks - s.anchor_tokens, s.comp_slots))
    lo, hi = a + n_sink, a + s.comp_slots
    length = s.tokens_for(kv_len)
    # a turn's start scores with its whole window; a decode-time recall with the queries of the steps
    # since the last recall only (the answer forming now, not the prompt the turn's start already used)
    fresh, s.recall_steps = s.recall_steps, 0
    w = min(capture.count(kv.req_pool_idx, length), kv_len - hi, fresh or kv_len)
    e = s.host.count
    r = min(s.recall, hi - lo, e)
    if fresh:  # during decode: at most one page per step since the last recall (bounds a step's bytes)
        r = min(r, fresh * server_settings().recall_page)
    if r <= 0 or w <= 0:
        s.recall_skipped += 1
        return 0
    pool.touch(s.host)
    row_slots = rt.req_to_token[kv.req_pool_idx, :kv_len].to(torch.int64)
    # plan: scores and pairs, nothing written
    row_sc, host_sc = _scores(req, s, row_slots, w, length)
    hs, hidx = best_entries(host_sc, server_settings().recall_page, r)  # [L, H, r], best first
    cs, cidx = (-row_sc[..., lo:hi]).topk(r, dim=-1)  # lowest-scored displaceable kept entries
    swap = hs > -cs  # [L, H, r]: the i-th best host entry beats the i-th worst kept one
    counts = swap.sum(-1)  # [L, H]: hs falls and the displaced score rises with i, so swap is a prefix
    dev_slots = row_slots[lo:hi][cidx]  # [L, H, r]
    host_cols = s.host.cols.to(pool.k.device)[hidx.to(pool.k.device)]
    pos = None
    if st.DEBUG and s.host.positions is not None:
        pos = demote.positions(s, kv_len).clone()
        hpos = s.host.positions.clone()
        didx = (cidx + lo).cpu()
        dp, hp = pos.gather(-1, didx), hpos.gather(-1, hidx.cpu())
        sw = swap.cpu()
        pos.scatter_(-1, didx, torch.where(sw, hp, dp))
        hpos.scatter_(-1, hidx.cpu(), torch.where(sw, dp, hp))
    # commit: one ragged exchange per layer
    layers = range(rt.n_layers)
    K.host_swap(
        [rt.k_buffer(i) for i in layers],
        [rt.v_buffer(i) for i in layers],
        dev_slots,
        pool.k,
        pool.v,
        host_cols,
        counts,
    )
    if slotstats.STATS is not None:  # a recalled slot's ||v W_O|| is another value's: stale
        heads = torch.arange(rt.n_kv_heads, device=dev_slots.device).unsqueeze(-1)
        for layer in layers:
            old = slotstats.STATS[layer][dev_slots[layer], heads]
            slotstats.STATS[layer][dev_slots[layer], heads] = torch.where(swap[layer], float("nan"), old)
    if pos is not None:
        s.host.positions = hpos
        s.debug_event(pos, length)
    swapped = int(swap.sum())  # one host read per turn (reported; the prefill step, not decode)
    moved = swapped * 2 * rt.head_dim * rt.k_buffer(0).element_size() * 2
    s.recalled += swapped
    s.bytes_moved += moved
    s.host_peak = max(s.host_peak, s.host.count)
    tot = pool.totals
    tot.recalled += swapped
    tot.bytes_moved += moved
    tot.recalls += 1
    return swapped
