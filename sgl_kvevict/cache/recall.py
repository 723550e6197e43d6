"""Recall: the stage after a policy's selection that makes eviction non-final (`demote.py` keeps what
a compression evicts on the host tier; this brings back what a new turn needs).

*Recall* (right after the prefill-phase compression of a turn, before its first decode step): the
turn's captured window queries score the kept history and the branch's host entries together
(softmax over the row's keys and the host keys, averaged over queries and the query heads of each KV
head, as the attention policies score), and per layer and KV head the `R` best host entries that beat
the lowest-scored displaceable kept ones swap places with them, in the request's own slots: the
displaced entries go to the host in exchange, so the row keeps its length and the request's offset
does not change. Sinks and the uncompressed tail (the recent window, where the queries sit) are never
displaced. Shared slots are never written (invariant 1): recall runs only when the compacted history
is the request's own (after a prefill compression it always is).

Every failure here degrades the request's recall only (logged, counted); its compression continues.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sgl_kvevict.cache import capture, compressor, demote, host, runtime, slotstats
from sgl_kvevict.cache import state as st

logger = logging.getLogger("sgl_kvevict")


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
) -> tuple[torch.Tensor, ...]:
    """`[L, H, kv_len]` and `[L, H, e]`: window attention of the last `w` queries over the row's keys
    and the branch's host keys in one softmax (host keys precede every query)."""
    rt, pool = runtime.RT, host.POOL
    H, D = rt.n_kv_heads, rt.head_dim  # noqa: N806
    g = rt.n_q_heads // H
    kv_len = int(row_slots.numel())
    cols = s.host.cols.to(pool.k.device)
    e = int(cols.numel())
    dev = row_slots.device
    qpos = torch.arange(kv_len - w, kv_len, device=dev).view(w, 1)
    hidden = torch.arange(kv_len, device=dev).view(1, kv_len) > qpos  # [w, kv_len] causal
    mask = torch.cat([torch.zeros(w, e, dtype=torch.bool, device=dev), hidden], dim=1)
    row_out, host_out = [], []
    for layer in range(rt.n_layers):
        q = capture.STORE.get(req.kv.req_pool_idx, layer, length)[:, -w:]  # [Hq, w, D]
        keys = torch.cat([pool.k[layer].index_select(0, cols).to(dev), rt.k_buffer(layer)[row_slots]])
        qh = q.float().reshape(H, g, w, D)
        logits = torch.einsum("hgwd,nhd->hgwn", qh, keys.float()) * rt.scale
        p = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1).mean(dim=(1, 2))  # [H, e+kv]
        host_out.append(p[:, :e])
        row_out.append(p[:, e:])
    return torch.stack(row_out), torch.stack(host_out)


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
    w = min(capture.count(kv.req_pool_idx, length), kv_len - hi)
    e = s.host.count
    r = min(s.recall, hi - lo, e)
    if r <= 0 or w <= 0:
        s.recall_skipped += 1
        return 0
    pool.touch(s.host)
    row_slots = rt.req_to_token[kv.req_pool_idx, :kv_len].to(torch.int64)
    # plan: scores, pairs and every new value, nothing written
    row_sc, host_sc = _scores(req, s, row_slots, w, length)
    hs, hidx = host_sc.topk(r, dim=-1)  # [L, H, r] best host entries, best first
    cs, cidx = (-row_sc[..., lo:hi]).topk(r, dim=-1)  # lowest-scored displaceable kept entries
    swap = hs > -cs  # [L, H, r]: the i-th best host entry beats the i-th worst kept one
    cand = row_slots[lo:hi]
    H = rt.n_kv_heads  # noqa: N806
    heads = torch.arange(H, device=row_slots.device).unsqueeze(-1)
    hcols = s.host.cols.to(pool.k.device)
    writes = []
    for layer in range(rt.n_layers):
        dslot = cand[cidx[layer]]  # [H, r]
        hcol = hcols[hidx[layer].to(pool.k.device)]
        m = swap[layer].unsqueeze(-1)
        vals = []
        for buf, hbuf in ((rt.k_buffer(layer), pool.k[layer]), (rt.v_buffer(layer), pool.v[layer])):
            d_old = buf[dslot, heads]  # [H, r, D]
            h_old = hbuf[hcol, heads.to(hbuf.device)].to(buf.device)
            vals.append((buf, hbuf, torch.where(m, h_old, d_old), torch.where(m, d_old, h_old)))
        writes.append((dslot, hcol, vals))
    pos = None
    if st.DEBUG and s.host.positions is not None:
        pos = demote.positions(s, kv_len).clone()
        hpos = s.host.positions.clone()
        didx = (cidx + lo).cpu()
        dp, hp = pos.gather(-1, didx), hpos.gather(-1, hidx.cpu())
        sw = swap.cpu()
        pos.scatter_(-1, didx, torch.where(sw, hp, dp))
        hpos.scatter_(-1, hidx.cpu(), torch.where(sw, dp, hp))
    # commit: plain indexing writes
    for dslot, hcol, vals in writes:
        for buf, hbuf, new_d, new_h in vals:
            buf[dslot, heads] = new_d
            hbuf[hcol, heads.to(hbuf.device)] = new_h.to(hbuf.device, hbuf.dtype)
    if slotstats.STATS is not None:  # a recalled slot's ||v W_O|| is another value's: stale
        for layer, (dslot, _, _) in enumerate(writes):
            old = slotstats.STATS[layer][dslot, heads]
            slotstats.STATS[layer][dslot, heads] = torch.where(swap[layer], float("nan"), old)
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


def release_request(s: st.ReqState | None) -> None:
    """A finished request's entries that no tree node took (it stored no compressed history)."""
    if s is not None and s.host is not None:
        host.release(s.host)
        s.host = None
