"""What a turn's recall (`recall.py`) and a decode step's (`decode_recall.py`) share, both run in every
layer and KV head: how host entries rank (by their page's best score; a turn's append first by positions
ranked over every layer and KV head) and the least score that moves one, how a recall is counted, and
the logical positions an exchange moves."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_kvevict.cache import state as st

if TYPE_CHECKING:
    from sgl_kvevict.cache.host_tier.host import HostEntries

# A host page comes back only where a query gives its best entry at least this much attention: weaker
# evidence swapped entries back and forth (3-5x the bytes moved) and answered no better (measured).
MIN_SCORE = 0.05
# A decode-time recall moves, per layer and KV head for each step since the last recall, at most a
# `ROW_SHARE`-th of the displaceable row, in whole pages, one to `MAX_PAGES_PER_STEP` (a step's bytes
# stay bounded, and a small row is not churned: every swap displaces a kept entry). On the recall suite's
# `multikey` at 36 sessions, four pages a step mended h2o and knorm at 18% (29 and 30 of 36 against 28
# and 27 with two) but cost snapkv 4 answers at 12%, where 32 entries are a fifth of the row; a seventh
# gives two pages there and four from 18% on.
ROW_SHARE = 7
MAX_PAGES_PER_STEP = 4


def step_swaps(steps: int, page: int, room: int) -> int:
    """The most entries a decode-time recall moves per layer and KV head after `steps` decode steps, into
    a displaceable row of `room` entries."""
    pages = max(1, min(MAX_PAGES_PER_STEP, room // (ROW_SHARE * page)))
    return steps * pages * page


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


def shared_positions(
    host_sc: list[torch.Tensor], positions: list[torch.Tensor], tokens: int, a: int
) -> torch.Tensor:
    """A turn's append ranks logical positions over every layer and KV head: a position scores the sum,
    over the (layer, KV head) pairs that hold it on the host, of its entry's score there (`host_sc`
    `[H, c]` per layer, the entries' logical positions `positions` alike). Returns `[tokens]` ranks: `a`
    down to 1 for the `a` best positions that any query attended, 0 elsewhere.

    Why: each pair ranking on its own brought a planted fact back into fewer than half of the pairs, and
    the decode that copies it reads them all (on the recall suite's `multikey`, the identifiers lost their
    first letters); a position the question attends in many pairs now comes back in every pair."""
    total = torch.zeros(tokens, dtype=torch.float64)
    for sc, pos in zip(host_sc, positions, strict=True):
        w = sc.detach().to("cpu", torch.float64).nan_to_num(0.0, neginf=0.0).clamp_min(0.0)
        ok = (pos >= 0) & (pos < tokens)  # a position outside the row's tokens counts nowhere
        total.scatter_add_(0, pos.to(torch.int64).clamp(0, tokens - 1).flatten(), (w * ok).flatten())
    order = total.argsort(descending=True, stable=True)[:a]  # ties: the first position first
    chosen = order[total[order] > 0]
    ranks = torch.zeros(tokens, dtype=torch.float32)
    ranks[chosen] = torch.arange(chosen.numel(), 0, -1, dtype=torch.float32)
    return ranks


def rank_of(ranks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`shared_positions`' rank of each entry at `positions` (0 outside the row's tokens)."""
    pos = positions.to(torch.int64)
    ok = (pos >= 0) & (pos < ranks.numel())
    return ranks[pos.clamp(0, ranks.numel() - 1)] * ok


def append_order(host_sc: torch.Tensor, page: int, a: int, shared: torch.Tensor | None) -> torch.Tensor:
    """The `a` host entries per KV head that a turn's append brings back, `[H, a]` indices into `host_sc`'s
    `[H, c]`: first the entries of the positions ranked over every layer (`shared` `[H, c]`, > 0 where
    ranked, higher first), then the head's own best (`best_entries`, by page), each entry once."""
    _, own = best_entries(host_sc, page, a)  # [H, a]
    order = torch.zeros_like(host_sc, dtype=torch.float32)
    rank = 1 + torch.arange(a, 0, -1, dtype=torch.float32, device=host_sc.device) / (2 * a)  # (1, 1.5]
    order.scatter_(-1, own, rank.expand_as(own).contiguous())
    if shared is not None:
        order = torch.where((shared > 0) & (host_sc > -torch.inf), 2 + shared, order)
    return order.topk(a, dim=-1).indices


def mark_stale(stats: torch.Tensor | None, first: int, dev_slots: torch.Tensor, moved: torch.Tensor) -> None:
    """A recalled slot's ||v W_O|| (`slotstats`, `[layers, slots, KV heads]`) is another value's: NaN
    (stale) where `moved`. `dev_slots`, `moved`: `[l, ..., KV heads, r]` for the layers from `first`, all
    marked by one write (a pair that does not move writes its slot's own value back)."""
    if stats is None:
        return
    n, h = stats.shape[1], dev_slots.shape[-2]
    lead = (-1,) + (1,) * (dev_slots.dim() - 1)
    layers = torch.arange(first, first + dev_slots.shape[0], device=stats.device).view(lead)
    heads = torch.arange(h, device=stats.device).view(h, 1)
    idx = ((layers * n + dev_slots.to(stats.device)) * h + heads).flatten()
    flat = stats.view(-1)
    flat.index_put_((idx,), torch.where(moved.to(stats.device).flatten(), torch.nan, flat[idx]))


class SwapPositions:
    """The row's and the host's logical positions (tracked wherever the host tier is on), updated by each
    exchange (under KVEVICT_DEBUG the oracle also replays them as a timeline event)."""

    def __init__(self, s: st.ReqState, kv_len: int, entries: HostEntries) -> None:
        self.pos = st.row_positions(s, kv_len).clone()
        self.hpos = entries.positions.clone()
        self.entries = entries

    def apply(self, layer: int, didx: torch.Tensor, hidx: torch.Tensor, swap: torch.Tensor) -> None:
        """Layers from `layer` on, `[l, H, r]` each: where `swap`, the row entry at `didx` and the host entry
        at `hidx` exchange positions. A pair that does not swap may name any index (a padded host column
        past the branch's, or one a swapping pair names too): it reads and writes a scratch column."""
        sl = slice(layer, layer + didx.shape[0])
        row, host = self.pos[sl], self.hpos[sl]
        m, c = row.shape[-1], host.shape[-1]
        row = torch.cat([row, row.new_zeros(*row.shape[:-1], 1)], dim=-1)
        host = torch.cat([host, host.new_zeros(*host.shape[:-1], 1)], dim=-1)
        d, h = torch.where(swap, didx, m), torch.where(swap, hidx, c)
        row_pos, host_pos = row.gather(-1, d), host.gather(-1, h)
        row.scatter_(-1, d, host_pos)
        host.scatter_(-1, h, row_pos)
        self.pos[sl], self.hpos[sl] = row[..., :m], host[..., :c]

    def record(self, s: st.ReqState, tokens: int) -> None:
        self.entries.positions = self.hpos
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
