"""`lagkv`: LagKV (Liang et al. 2025, arXiv 2504.04704). Attention-free, partition-wise eviction.

The region after the sinks is cut into partitions of `lag` (L) tokens. Each partition is min-max
normalised per channel with the min/max of the *next* partition, scored by the softmax over its tokens
of the channel std (Eqs. 7-11, `kernels.lag_scores`), K score + `score_v_ratio` * V score, and keeps its
top k = int(ratio * L) tokens per KV head. The last full partition (the reference of the one before it)
and the remainder form LagKV's own sliding window and stay raw.

Trigger (`should_compress`): whenever the uncompressed tail (region after max(sinks, compacted part))
holds >= 2L tokens, in prefill and decode alike; `select` then compresses every full tail partition
except the last. A one-shot compression of a fresh region of Ls tokens (S sinks) keeps exactly (Eq. 12)

    L_R = S + k * (floor((Ls - S) / L) - 1) + L + ((Ls - S) mod L),   k = int(r * L),   C = 1 - L_R / Ls

(no compression when Ls < S + 2L). The runner's `recent` window is respected too: a partition reaching
into it is not compressed (irrelevant with the defaults, recent 32 < L).

Budget: one meaning for every policy. A budget at or above the request's compressible tokens keeps
everything (`should_compress` is False while candidates <= budget), so `budget: "100%"` or a token count
longer than the context never compresses. The per-partition retention r is the config field `ratio`
(default 0.5, the paper's default); the budget caps the result (below). `ratio_from_budget: true` makes a
ratio budget the r instead (the paper names its settings by r: "50%" -> r = 0.5, "2x"); measured on
`benchmarks/fidelity.py --ratio 0.25`, at equal kept KV (34.4%) r = 0.5 capped to the budget gives mean
KL 0.29 and keeps the planted fact, r = 0.25 gives KL 0.73 and loses it, so it is off by default. At
50% the two are the same. (Eq. 13's inverse, solving r for an exact kept fraction at one length, is
the benchmark's `lagkv r=k/128` row; not applied in the server, where the length keeps changing.)

Cap (`cap_to_budget`, default on): `budget` (candidate tokens beyond sinks and recent) caps the
*compressed part* (everything between the sinks and the raw tail; the raw tail is LagKV's recent window
and is always kept). The paper has no absolute budget and never touches the compressed part again
(`cap_to_budget: false`). With the cap, while the compressed part holds c > budget tokens per head it is
re-scored as a sequence per head ("chunk recursion"): cut into chunks of L from its end (the c mod L
oldest tokens wait for the next round), each chunk referenced by its successor and the last one by the
first L raw tail tokens, and each chunk keeps its top k; this repeats until c <= budget or c < L; then,
if still over, the compressed part is scored as one partition against the raw tail (Eqs. 7-11 with
unequal sizes) and cut to the top `budget`. At a 50% budget and r = 0.5 the cap does not bind on a
one-shot compression (Eq. 12 keeps c = k (P - 1) < budget); it binds for smaller budgets (the 25%
measurement above: re-scoring the compressed part is the better reading there) and in branch scope,
where it is what keeps a session under its budget at all.

Ambiguities chosen: sinks 16 by default (the paper's S; kvpress uses 4, the other policies here 4):
measured a little better on the fidelity benchmark, KL 0.142 vs 0.147 at 50% and 0.63 vs 0.73 at 25%
(see docs/benchmarks.md); K and V scores summed with
weight `score_v_ratio` (paper/original code; kvpress averages: same ranking at 1.0); eps 1e-6 in
max - min; unbiased std; kept indices sorted.

Batched selection (`select_batch`, the runner's fast path): the same kept tokens for every request and
layer of a batch in a fixed number of tensor ops per stage, with no read back from the device. Every
count that decides a shape is a host integer known before any score (`batch_counts`, `LagCounts`): the
compacted part, the partitions scored now, the raw tail, and the chunk recursion's rounds (each maps a
compressed length `c` to `c mod L + (c // L) * k`, so every length is computed up front). Stages, each
over all requests (ragged layouts flat or padded, their indices built on the host by `ragged`):

1. *partitions*: every request's `pc + 1` partitions from `t0` laid end to end as blocks; each block
   scored against the next, layers and heads as the score's heads (`kernels.lag_scores`' own math on
   CPU, its Triton kernel on GPU; the pairs across two requests are scored and dropped), top k of each.
2. *chunk recursion*, one pass per round over the requests still in it: the compressed part's chunks
   (per head, so gathered per (slot, head) row) and the reference block.
3. *final cut*: the compressed part as one partition (Eqs. 7-10 with unequal sizes) padded to the longest (`-inf` before the
   softmax, `+inf`/`-inf` before the reference's min/max), top `budget`.

`select` (the per-request path, one layer at a time) is this selection over a batch of one request and
one layer, so both paths run the same code; `tests/test_policies.py` checks it against a plain-list
LagKV (`naive_lagkv`), `tests/test_engine_sync.py` a ragged batch against one request at a time. A
refiner (GraphKV over LagKV) re-ranks each scored partition's scores through `refine` (batch of one
only: its rows must not be padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pydantic import Field, model_validator

from . import ragged
from .base import MAX_WINDOW, BatchView, LayerView, Phase, Policy, PolicyConfig
from .registry import register

EPS = 1e-6

# (scores [R, M], keys [R, M, D], k) -> refined scores [R, M]; rows are independent (GraphKV's hook).
Refine = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class LagKVConfig(PolicyConfig):
    sinks: int = Field(
        16,
        ge=0,
        le=MAX_WINDOW,
        description="first tokens of the sequence always kept (attention sinks; LagKV's paper uses 16)",
    )
    lag: int = Field(
        128, ge=2, le=1 << 14, description="partition size L = reference size = minimum raw window"
    )
    ratio: float = Field(0.5, gt=0.0, lt=1.0, description="retention r: int(r*L) tokens kept per partition")
    ratio_from_budget: bool = Field(
        False,
        description="a ratio budget replaces `ratio` as the per-partition retention (off: r stays `ratio` "
        "and the budget caps; measured better at equal KV, see docs/benchmarks.md)",
    )
    score_v_ratio: float = Field(
        1.0, ge=0.0, le=1e3, description="weight of the V score added to the K score"
    )
    cap_to_budget: bool = Field(True, description="re-compress the compressed part while it exceeds budget")

    @model_validator(mode="after")
    def _keep_count(self) -> LagKVConfig:
        k = int(self.ratio * self.lag)
        if not 1 <= k < self.lag:
            raise ValueError(
                f"ratio {self.ratio} keeps int(ratio * lag) = {k} of each {self.lag}-token partition; it "
                f"must keep between 1 and lag - 1 = {self.lag - 1}"
            )
        return self


@register
class LagKVPolicy(Policy):
    name = "lagkv"
    Config = LagKVConfig
    config: LagKVConfig
    batchable = True

    @property
    def keep_per_partition(self) -> int:
        return int(self.config.ratio * self.config.lag)

    def for_budget_ratio(self, ratio: float) -> Policy:
        """With `ratio_from_budget`, the budget's ratio is r (alone or as a refiner's base)."""
        return self.with_ratio(ratio) if self.config.ratio_from_budget else self

    def with_ratio(self, ratio: float) -> LagKVPolicy:
        """A copy whose per-partition retention is `ratio` (a budget given as a ratio), clamped so that
        each partition keeps between 1 and L - 1 tokens (a ratio of 1 never reaches here: nothing is
        compressed at or above the whole request)."""
        lag = self.config.lag
        k = min(lag - 1, max(1, int(ratio * lag)))
        return type(self)(self.config.model_copy(update={"ratio": (k + 0.5) / lag}))

    # -- when -------------------------------------------------------------------------------------
    def _partitions(self, n: int, n_sink: int, n_recent: int, n_compacted: int) -> int:
        """Full tail partitions compressible now: each needs its successor, none may touch `recent`."""
        lag = self.config.lag
        t0 = max(n_sink, n_compacted)
        return max(0, min((n - t0) // lag - 1, (n - n_recent - t0) // lag))

    def should_compress(
        self, n_region: int, n_sink: int, n_recent: int, n_compacted: int, budget: int, phase: Phase
    ) -> bool:
        if n_region - n_sink - n_recent <= budget:  # a budget covering the request keeps everything
            return False
        if self._partitions(n_region, n_sink, n_recent, n_compacted) > 0:
            return True
        over = max(n_sink, n_compacted) - n_sink > budget
        return self.config.cap_to_budget and over

    def raw_tail(self, view: LayerView) -> int:
        """The tokens after the last compressible partition stay raw (they are the next round's lag)."""
        t0 = max(view.n_sink, view.n_compacted)
        return (
            view.n
            - t0
            - self.config.lag * self._partitions(view.n, view.n_sink, view.n_recent, view.n_compacted)
        )

    # -- what -------------------------------------------------------------------------------------
    def score(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError("lagkv selects per partition; use select()")

    def batch_counts(self, n: int, n_sink: int, n_recent: int, n_compacted: int, budget: int) -> LagCounts:
        """Partitions, raw tail, recursion rounds and cut of one request, on the host. A request that
        would keep its whole region is left to the per-request path (its group with it)."""
        c = lag_counts(self, n, n_sink, n_recent, n_compacted, budget)
        if c.k >= n:
            raise RuntimeError("lagkv: a request of the group keeps its whole region")
        return c

    def select_batch(self, batch: BatchView) -> torch.Tensor:
        return batch_select(self, batch)

    def select(self, view: LayerView, budget: int) -> torch.Tensor:
        return self.select_refined(view, budget, None)

    def select_refined(self, view: LayerView, budget: int, refine: Refine | None) -> torch.Tensor:
        """`select`, with an optional refinement of the scores inside each partition (GraphKV over
        LagKV): the batched selection over a batch of one request and one layer."""
        c = lag_counts(self, view.n, view.n_sink, view.n_recent, view.n_compacted, budget)
        return batch_select(self, BatchView.of_layer(view, c), refine)[0, 0]


# Bound on the gathered K (or V) elements scored at once: the layers are scored in chunks below it. On a
# CPU, chunks that stay in cache are faster (measured on bench_engine's lagkv at batch 8 and 32: about
# 1.5-2x less time per request at 1 << 20 than at 1 << 23); on a GPU, fewer and larger launches.
MAX_GATHER = 1 << 23
MAX_GATHER_CPU = 1 << 20


def _layer_step(per_layer: int, dev: torch.device) -> int:
    """Layers per chunk when one layer gathers `per_layer` elements (at least one)."""
    bound = MAX_GATHER if dev.type == "cuda" else MAX_GATHER_CPU
    return max(1, bound // max(1, per_layer))


@dataclass
class LagCounts:
    """One request's LagKV step, every count on the host (`lag_counts`), for `batch_select`: what `Kept`
    holds, and the recursion's."""

    n: int
    n_sink: int
    n_recent: int
    t0: int  # start of the uncompressed tail: max(sinks, compacted part)
    pc: int  # partitions scored now
    raw: int  # raw tail (LagKV's window), always kept
    c0: int  # compressed part before the cap: the compacted part + k per scored partition
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (c mod L, c // L) per recursion round
    pre: int = 0  # compressed part after the rounds, before the final cut
    cut: int = -1  # final cut to this many tokens (the budget), or -1 when none
    c: int = 0  # compressed part kept

    @property
    def k(self) -> int:
        return self.n_sink + self.c + self.raw


def lag_counts(
    pol: LagKVPolicy, n: int, n_sink: int, n_recent: int, n_compacted: int, budget: int
) -> LagCounts:
    """The host half of `LagKVPolicy.select` for one request: no tensor is read."""
    cfg = pol.config
    lag, kk = cfg.lag, pol.keep_per_partition
    t0 = max(n_sink, n_compacted)
    pc = pol._partitions(n, n_sink, n_recent, n_compacted)
    raw = n - t0 - pc * lag
    c = t0 - n_sink + pc * kk
    out = LagCounts(n, n_sink, n_recent, t0, pc, raw, c)
    if cfg.cap_to_budget and c > budget:
        budget = max(0, budget)
        ref = min(raw, lag)
        while c > budget and c >= lag and ref == lag:
            out.rounds.append((c % lag, c // lag))
            c = c % lag + (c // lag) * kk
        out.pre = c
        if c > budget:
            out.cut = budget
            c = budget
    out.c = c
    return out


def _to(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return x.to(dev, non_blocking=True)


def _block_scores(batch: BatchView, rows: torch.Tensor, lag: int, vr: float) -> torch.Tensor:
    """`[L, H, B - 1, lag]` LagKV scores (K + vr * V) of B consecutive blocks of `lag` tokens, each judged
    by the next. `rows`: `[L or 1, H, B * lag]` flat (slot * H + head) pool rows, per layer or shared.
    The rows are gathered straight into the layout the score's math reads (`[layers * heads, B, lag,
    D]`), layers chunked by `_layer_step`; the math is `kernels.lag_scores`' own, row for row."""
    from sgl_kvevict.kernels import lag_scores
    from sgl_kvevict.kernels.dispatch import use_triton
    from sgl_kvevict.kernels.lag_scores import lag_scores_heads

    _, L, H, _ = batch.shape  # noqa: N806
    D = batch.k_buffers[0].shape[-1]  # noqa: N806
    m = rows.shape[-1]
    step = _layer_step(m * H * D, rows.device)
    out = []
    for l0 in range(0, L, step):
        layers = range(l0, min(L, l0 + step))
        s = None
        for kind, w in (("k", 1.0), ("v", vr)):
            if not w:
                continue
            bufs = [(batch.k_buffers if kind == "k" else batch.v_buffers)[x] for x in layers]
            x = torch.empty(len(layers), H * m, D, dtype=bufs[0].dtype, device=rows.device)
            for i, (layer, buf) in enumerate(zip(layers, bufs, strict=True)):
                r = rows[layer if rows.shape[0] > 1 else 0].reshape(-1)
                torch.index_select(buf.view(-1, D), 0, r, out=x[i])
            if use_triton(x):  # the kernel reads [tokens, heads, D] with any strides
                one = lag_scores(x.view(-1, m, D).transpose(0, 1), torch.arange(m, device=x.device), lag)
            else:
                one = lag_scores_heads(x.float().view(-1, m // lag, lag, D))
            s = one if s is None else s + w * one
        out.append(s.view(len(layers), H, m // lag - 1, lag))
    return out[0] if len(out) == 1 else torch.cat(out)


def _rows(slots_flat: torch.Tensor, pos: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Flat pool rows `slot * H + head` of region positions `pos` `[L, H, ...]` (already offset by
    `r * Nmax` into the padded slots)."""
    idx = slots_flat.index_select(0, pos.reshape(-1)).view(pos.shape)
    return idx * heads.shape[0] + heads.view(1, -1, *([1] * (pos.dim() - 2)))


def _dense(kz: torch.Tensor, kr: torch.Tensor, rmask: torch.Tensor) -> torch.Tensor:
    """Eqs. 7-10 before the softmax, padded: z `[..., W, D]` min-max normalised per channel by the
    reference `[..., Wr, D]` whose real rows are `rmask` `[..., Wr]`. Returns the per-token std."""
    r = kr.float()
    m = rmask.unsqueeze(-1)
    mn = r.masked_fill(~m, float("inf")).amin(dim=-2, keepdim=True)
    mx = r.masked_fill(~m, float("-inf")).amax(dim=-2, keepdim=True)
    zn = (kz.float() - mn) / (mx - mn + EPS)
    return zn.std(dim=-1)


def _cut(
    batch: BatchView, fin: list[int], seq: torch.Tensor, lag: int, vr: float, refine: Refine | None
) -> torch.Tensor:
    """Stage 3 for the requests `fin`: each one's compressed part (`seq` `[L, H, R, Cmax]`, its first
    `pre` entries) scored as one partition against the raw tail's first L tokens (against itself when
    there is no raw tail: LocalKV, Eqs. 14-15) and cut to its top `cut`, in position order."""
    cs: list[LagCounts] = batch.counts
    sflat, nmax = batch.slots.reshape(-1), batch.slots.shape[1]
    L, H, R, cmax = seq.shape  # noqa: N806
    D = batch.k_buffers[0].shape[-1]  # noqa: N806
    dev = seq.device
    heads = torch.arange(H, device=dev)
    F = len(fin)  # noqa: N806
    pre = [cs[r].pre for r in fin]
    w = max(pre)
    fin_t = _to(torch.tensor(fin, dtype=torch.int64), dev)
    zsel = seq.index_select(2, fin_t)  # [L, H, F, Cmax]
    _, zmask = ragged.padded([0] * F, pre, w)
    zpos = zsel[..., :w]
    # the reference: the raw tail's first min(L, raw) positions, or the compressed part itself
    self_ref = [cs[r].raw == 0 for r in fin]
    ref_n = [p if sr else min(lag, cs[r].raw) for p, sr, r in zip(pre, self_ref, fin, strict=True)]
    wr = max(ref_n)
    raw_pos, rmask = ragged.padded([cs[r].n - cs[r].raw for r in fin], ref_n, wr)
    zidx, _ = ragged.padded([0] * F, ref_n, wr)
    # (clamped: a request judged by its raw tail reads none of these, and its tail may be longer than Cmax)
    zidx = zidx.clamp(max=cmax - 1)
    own = zsel.gather(3, _to(zidx, dev).view(1, 1, F, wr).expand(L, H, F, wr))
    sr = _to(torch.tensor(self_ref).view(F, 1), dev)
    rpos = torch.where(sr, own, _to(raw_pos, dev).view(1, 1, F, wr))
    row0 = _to(torch.tensor(fin, dtype=torch.int64) * nmax, dev).view(1, 1, F, 1)
    zrows = _rows(sflat, zpos + row0, heads)  # [L, H, F, W]
    rrows = _rows(sflat, rpos + row0, heads)  # [L, H, F, Wr]
    rm = _to(rmask, dev)
    step = _layer_step(H * F * max(w, wr) * D, dev)
    stds: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
    for l0 in range(0, L, step):
        layers = range(l0, min(L, l0 + step))
        for kind in ("k", "v") if vr else ("k",):
            bufs = batch.k_buffers if kind == "k" else batch.v_buffers
            z = torch.stack([_dense_rows(bufs[layer], zrows[layer]) for layer in layers])
            ref = torch.stack([_dense_rows(bufs[layer], rrows[layer]) for layer in layers])
            stds[kind].append(_dense(z, ref, rm))
    zm = _to(~zmask, dev)
    s = torch.cat(stds["k"]).masked_fill(zm, float("-inf")).softmax(dim=-1)
    if vr:
        s = s + vr * torch.cat(stds["v"]).masked_fill(zm, float("-inf")).softmax(dim=-1)
    s = s.masked_fill(zm, float("-inf"))
    cuts = [cs[r].cut for r in fin]
    bmax = max(cuts)
    if refine is not None:  # one request: no padding
        s = _refined(batch, s, zrows, bmax, refine)
    top = s.topk(bmax, dim=-1).indices  # [L, H, F, bmax], best first
    past = torch.arange(bmax).unsqueeze(0) >= torch.tensor(cuts).view(-1, 1)
    top = top.masked_fill(_to(past, dev), w).sort(dim=-1).values.clamp(max=w - 1)
    kept = zpos.gather(3, top)  # [L, H, F, bmax] region positions, in order
    dst = ragged.aranges([r * cmax for r in fin], cuts)
    src = ragged.aranges([i * bmax for i in range(F)], cuts)
    seq = seq.clone()
    seq.view(L, H, R * cmax).index_copy_(
        2, _to(dst, dev), kept.reshape(L, H, -1).index_select(2, _to(src, dev))
    )
    return seq


def _dense_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One layer's K or V pool `buf` at flat pool rows `rows` (any shape), with a trailing D axis."""
    flat = buf.view(-1, buf.shape[-1])
    return flat.index_select(0, rows.reshape(-1)).view(*rows.shape, buf.shape[-1])


def _top(
    batch: BatchView,
    s: torch.Tensor,
    rows: torch.Tensor,
    scored: torch.Tensor,
    kk: int,
    refine: Refine | None,
) -> torch.Tensor:
    """`[L, H, P, kk]` sorted offsets of the top `kk` of each scored block `s` `[L, H, P, lag]`. `rows`:
    the blocks' flat pool rows `[L or 1, H, B * lag]`, `scored`: which blocks `s` holds (for `refine`,
    which also reads their keys)."""
    if refine is not None:
        blocks = rows.view(rows.shape[0], rows.shape[1], -1, s.shape[-1]).index_select(2, scored)
        s = _refined(batch, s, blocks, kk, refine)
    return s.topk(kk, dim=-1).indices.sort(dim=-1).values


def _refined(batch: BatchView, s: torch.Tensor, rows: torch.Tensor, k: int, refine: Refine) -> torch.Tensor:
    """`refine` over scores `s` `[L, H, P, W]` whose keys sit at pool rows `rows` `[L or 1, H, P, W]`;
    every (layer, head, block) is one row of the refiner's input."""
    L, H, P, W = s.shape  # noqa: N806
    keys = torch.stack(
        [_dense_rows(batch.k_buffers[x], rows[x if rows.shape[0] > 1 else 0]) for x in range(L)]
    )
    return refine(s.reshape(L * H * P, W), keys.reshape(L * H * P, W, -1), k).view(L, H, P, W)


def _first_stage(
    batch: BatchView, seq: torch.Tensor, lag: int, kk: int, vr: float, refine: Refine | None
) -> None:
    """Stage 1, in place on `seq` `[L, H, R, Cmax]`: every request's scored partitions, laid end to end
    with their successors; the top `kk` of each go after the request's compacted part."""
    cs: list[LagCounts] = batch.counts
    R, L, H, nmax = batch.shape  # noqa: N806
    dev, cmax = seq.device, seq.shape[-1]
    heads = torch.arange(H, device=dev)
    part = [r for r, c in enumerate(cs) if c.pc > 0]
    if not part:
        return
    pcs = [cs[r].pc for r in part]
    blocks = [p + 1 for p in pcs]
    pos = ragged.aranges([r * nmax + cs[r].t0 for r in part], [b * lag for b in blocks])
    rows = _rows(batch.slots.reshape(-1), _to(pos, dev).view(1, 1, -1), heads)  # [1, H, M]
    s = _block_scores(batch, rows, lag, vr)  # [L, H, B - 1, lag]
    # block b is judged by block b + 1 of the same request
    scored = _to(ragged.aranges(ragged.offsets(blocks), pcs), dev)
    top = _top(batch, s.index_select(2, scored), rows, scored, kk, refine)
    shift = ragged.repeat([cs[r].t0 for r in part], pcs) + ragged.aranges([0] * len(pcs), pcs) * lag
    top = top + _to(shift, dev).view(1, 1, -1, 1)  # region positions
    dst = ragged.aranges([r * cmax + cs[r].t0 - cs[r].n_sink for r in part], [p * kk for p in pcs])
    seq.view(L, H, R * cmax).index_copy_(2, _to(dst, dev), top.reshape(L, H, -1))


def _round(
    batch: BatchView, seq: torch.Tensor, i: int, lag: int, kk: int, vr: float, refine: Refine | None
) -> torch.Tensor:
    """Stage 2, round `i` of the chunk recursion over the requests still in it: `seq` after it."""
    cs: list[LagCounts] = batch.counts
    R, L, H, nmax = batch.shape  # noqa: N806
    dev, cmax = seq.device, seq.shape[-1]
    heads = torch.arange(H, device=dev)
    act = [r for r, c in enumerate(cs) if len(c.rounds) > i]
    rem = [cs[r].rounds[i][0] for r in act]
    qs = [cs[r].rounds[i][1] for r in act]
    # each request's blocks: its q chunks from `rem` on, then the raw tail's first L tokens (the
    # reference of its last chunk), taken out of [compressed parts | raw heads]
    raw_head = ragged.aranges([cs[r].n - cs[r].raw for r in act], [lag] * len(act))
    src = torch.cat([seq.view(L, H, R * cmax), _to(raw_head, dev).view(1, 1, -1).expand(L, H, -1)], dim=2)
    seg_s, seg_n = [], []
    for a, r in enumerate(act):
        seg_s += [r * cmax + rem[a], R * cmax + a * lag]
        seg_n += [qs[a] * lag, lag]
    pos = src.index_select(2, _to(ragged.aranges(seg_s, seg_n), dev))  # [L, H, M] region positions
    pos = pos + _to(ragged.repeat([r * nmax for r in act], [(q + 1) * lag for q in qs]), dev)
    rows = _rows(batch.slots.reshape(-1), pos, heads)
    s = _block_scores(batch, rows, lag, vr)  # [L, H, B - 1, lag]
    scored = _to(ragged.aranges(ragged.offsets([q + 1 for q in qs]), qs), dev)
    top = _top(batch, s.index_select(2, scored), rows, scored, kk, refine)
    # offsets into the compressed part
    shift = ragged.repeat(rem, qs) + ragged.aranges([0] * len(qs), qs) * lag
    top = top + _to(shift, dev).view(1, 1, -1, 1)
    gidx = torch.arange(cmax, device=dev).expand(L, H, R, cmax).contiguous()
    dst = ragged.aranges([r * cmax + rem[a] for a, r in enumerate(act)], [q * kk for q in qs])
    gidx.view(L, H, R * cmax).index_copy_(2, _to(dst, dev), top.reshape(L, H, -1))
    return seq.gather(3, gidx)


def _assemble(batch: BatchView, seq: torch.Tensor) -> torch.Tensor:
    """Sinks, the compressed part `seq` `[L, H, R, Cmax]`, the raw tail; past each request's k: Nmax.
    Returns `[R, L, H, Kmax]`."""
    cs: list[LagCounts] = batch.counts
    R, L, H, nmax = batch.shape  # noqa: N806
    dev, cmax = seq.device, seq.shape[-1]
    ks = [c.k for c in cs]
    kmax = max(ks)
    j = torch.arange(kmax, dtype=torch.int64).unsqueeze(0)
    sink = batch.col([c.n_sink for c in cs])
    cc = batch.col([c.c for c in cs])
    raw0 = batch.col([c.n - c.raw for c in cs])
    fixed = torch.where(j < sink, j, raw0 + j - sink - cc)
    fixed = torch.where(j >= batch.col(ks), nmax, fixed)
    keep = _to(fixed, dev).view(1, 1, R, kmax).expand(L, H, R, kmax).contiguous()
    dst = ragged.aranges([r * kmax + c.n_sink for r, c in enumerate(cs)], [c.c for c in cs])
    srcs = ragged.aranges([r * cmax for r in range(R)], [c.c for c in cs])
    keep.view(L, H, R * kmax).index_copy_(
        2, _to(dst, dev), seq.reshape(L, H, R * cmax).index_select(2, _to(srcs, dev))
    )
    return keep.permute(2, 0, 1, 3)


def batch_select(pol: LagKVPolicy, batch: BatchView, refine: Refine | None = None) -> torch.Tensor:
    """`LagKVPolicy.select_batch`: partitions, chunk recursion and final cut for every request and layer
    of the batch at once (stages in the module's docstring); `refine` re-ranks each scored partition's
    scores (a batch of one request only)."""
    cfg = pol.config
    lag, kk, vr = cfg.lag, pol.keep_per_partition, cfg.score_v_ratio
    cs: list[LagCounts] = batch.counts
    R, L, H, _ = batch.shape  # noqa: N806
    if refine is not None and R != 1:
        raise ValueError("lagkv: a refined selection runs on one request at a time")
    dev = batch.slots.device
    cmax = max(1, max(c.c0 for c in cs))
    # the compressed part, [L, H, R, Cmax] region positions: the compacted part first
    base, _ = ragged.padded([c.n_sink for c in cs], [c.t0 - c.n_sink for c in cs], cmax)
    seq = _to(base, dev).view(1, 1, R, cmax).expand(L, H, R, cmax).contiguous()
    _first_stage(batch, seq, lag, kk, vr, refine)
    for i in range(max(len(c.rounds) for c in cs)):
        seq = _round(batch, seq, i, lag, kk, vr, refine)
    fin = [r for r, c in enumerate(cs) if c.cut > 0]
    if fin:  # the compressed part as one partition against the raw tail, cut to the budget
        seq = _cut(batch, fin, seq, lag, vr, refine)
    return _assemble(batch, seq)
