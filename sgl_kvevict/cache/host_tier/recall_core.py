"""What a turn's recall (`recall.py`) and a decode step's (`decode_recall.py`) share, both run in every
layer and KV head: how host entries rank (by their page's best score) and the least score that moves
one, how a recall is counted, and the logical positions an exchange moves (where tracked)."""

from __future__ import annotations

import torch

from sgl_kvevict.cache import state as st

# A host page comes back only where a query gives its best entry at least this much attention: weaker
# evidence swapped entries back and forth (3-5x the bytes moved) and answered no better (measured).
MIN_SCORE = 0.05


def best_entries(sc: torch.Tensor, page: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `r` best host entries per (layer, head), `(page scores, indices)`, best first: by their page's
    score, then, inside a page, by their own (so a page cut by `r` gives its best entries). An entry
    scored -inf (a paged recall's padding) keeps -inf: it never beats a kept entry.

    `r` entries come from at most `r` pages, so only the `r` best pages are sorted (by their entries), not
    every entry: a decode step's recall runs this at every layer over all of a branch's host entries."""
    if page <= 1:
        ranked = sc
        idx = sc.argsort(dim=-1, descending=True, stable=True)[..., :r]
        return ranked.gather(-1, idx), idx
    lead, e = sc.shape[:-1], sc.shape[-1]
    n = -(-e // page)
    pages = torch.nn.functional.pad(sc, (0, n * page - e), value=float("-inf")).view(*lead, n, page)
    best, top = pages.amax(-1).topk(min(r, n), dim=-1)  # the best pages, best first: [..., k]
    k = top.shape[-1]
    inside = pages.gather(-2, top.unsqueeze(-1).expand(*lead, k, page))  # their entries' own scores
    own, at = inside.sort(dim=-1, descending=True, stable=True)  # inside a page, by their own
    cand = (top.unsqueeze(-1) * page + at).flatten(-2)  # [..., k * page] entry indices, page by page
    ranked = best.unsqueeze(-1).expand(*lead, k, page).flatten(-2)
    ranked = ranked.masked_fill(own.flatten(-2) == float("-inf"), float("-inf"))  # padding stays out
    order = ranked.argsort(dim=-1, descending=True, stable=True)[..., :r]  # -inf entries last
    # a page's padding past the last entry ranks -inf, last: an index in range stands for it (never moved)
    return ranked.gather(-1, order), cand.gather(-1, order).clamp_(max=e - 1)


def mark_stale(stats: torch.Tensor | None, layer: int, dev_slots: torch.Tensor, moved: torch.Tensor) -> None:
    """A recalled slot's ||v W_O|| (`slotstats`, `[layers, slots, KV heads]`) is another value's: NaN
    (stale) where `moved`. `dev_slots`, `moved`: `[..., KV heads, r]`."""
    if stats is None:
        return
    heads = torch.arange(dev_slots.shape[-2], device=dev_slots.device).unsqueeze(-1)
    old = stats[layer][dev_slots, heads]
    stats[layer][dev_slots, heads] = torch.where(moved, torch.nan, old)


class SwapPositions:
    """Where positions are tracked (KVEVICT_DEBUG): the row's and the host's logical positions,
    updated by each exchange (under KVEVICT_DEBUG the oracle replays them as a timeline event)."""

    def __init__(self, s: st.ReqState, kv_len: int) -> None:
        self.pos = st.row_positions(s, kv_len).clone()
        self.hpos = s.recall.host.positions.clone()

    def apply(self, layer: int, didx: torch.Tensor, hidx: torch.Tensor, swap: torch.Tensor) -> None:
        sl = slice(layer, layer + didx.shape[0])
        pos, hpos = self.pos[sl], self.hpos[sl]
        dp, hp = pos.gather(-1, didx), hpos.gather(-1, hidx)
        pos.scatter_(-1, didx, torch.where(swap, hp, dp))
        hpos.scatter_(-1, hidx, torch.where(swap, dp, hp))

    def record(self, s: st.ReqState, tokens: int) -> None:
        s.recall.host.positions = self.hpos
        s.trace.event(self.pos, tokens)


def account(s: st.ReqState, swapped: int, one_way: bool = False) -> None:
    """Counters of one recall (a turn's, or a decode-time one): entries in, bytes both ways (an append
    moves them one way)."""
    rt, pool = s.ctx.rt, s.ctx.host
    s.recall.changed_history = s.recall.changed_history or swapped > 0
    moved = swapped * 2 * rt.head_dim * rt.k_buffer(0).element_size() * (1 if one_way else 2)
    s.recall.recalled += swapped
    s.recall.recalled_appended += swapped if one_way else 0
    s.recall.bytes_moved += moved
    s.recall.host_peak = max(s.recall.host_peak, s.recall.host.count if s.recall.host is not None else 0)
    tot = pool.totals
    tot.recalled += swapped
    tot.bytes_moved += moved
    tot.recalls += 1
