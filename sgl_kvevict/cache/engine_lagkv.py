"""LagKV's selection for a whole batch group at once: `[R, L, H, Kmax]` kept region indices.

`policies.lagkv.LagKVPolicy.select` runs per request and per layer; this computes the same kept tokens
for every request and layer of a group (same config, regions the requests own) in a fixed number of
tensor ops per stage, with no host synchronisation. Everything that decides a shape is a host integer
known before any score: the compacted part, the partitions scored now, the raw tail, and the chunk
recursion's rounds (each round maps a compressed length `c` to `c mod L + (c // L) * k`, so the
number of rounds and every length are computed on the host up front; `Counts`).

Stages, each over all requests (ragged layouts are flat or padded, their indices built on the host):

1. *partitions*: every request's `pc + 1` partitions from `t0` laid end to end as blocks; each block
   scored against the next, layers and heads as the score's heads (`kernels.lag_scores`' own math on
   CPU, its Triton kernel on GPU, as on the per-request path; the pairs across two requests are scored
   and dropped), top `k` per scored partition.
2. *chunk recursion* (`cap_to_budget`), one batched pass per round over the requests still in it: the
   compressed part's chunks (per head, so gathered per (slot, head) row) and the reference block.
3. *final cut*: `lag_score_dense` over the compressed part padded to the longest (`-inf` before the
   softmax, `+inf`/`-inf` before the reference's min/max), top `budget`.

Scores are computed by the same ops, row for row, as the per-request path, so the kept tokens are the
same (`tests/test_engine_sync.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_kvevict.cache import ragged
from sgl_kvevict.cache.compressor import Job

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
class Counts:
    """One request's LagKV step, every count on the host (mirrors `LagKVPolicy.select_refined`)."""

    n: int
    n_sink: int
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


def counts(job: Job) -> Counts:
    """The host half of `LagKVPolicy.select` for one request: no tensor is read."""
    pol = job.s.policy
    cfg = pol.config
    lag, kk = cfg.lag, pol.keep_per_partition
    t0 = max(job.n_sink, job.s.comp_slots)
    pc = pol._partitions(job.n, job.n_sink, job.n_recent, job.s.comp_slots)
    raw = job.n - t0 - pc * lag
    c = t0 - job.n_sink + pc * kk
    out = Counts(job.n, job.n_sink, t0, pc, raw, c)
    budget = job.budget
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


def _block_scores(rt: Any, rows: torch.Tensor, lag: int, vr: float) -> torch.Tensor:
    """`[L, H, B - 1, lag]` LagKV scores (K + vr * V) of B consecutive blocks of `lag` tokens, each judged
    by the next. `rows`: `[L or 1, H, B * lag]` flat (slot * H + head) pool rows, per layer or shared.
    The rows are gathered straight into the layout the score's math reads (`[layers * heads, B, lag,
    D]`), layers chunked by `_layer_step`; the math is `kernels.lag_scores`' own, row for row."""
    from sgl_kvevict.kernels import lag_scores
    from sgl_kvevict.kernels.dispatch import use_triton
    from sgl_kvevict.kernels.lag_scores import lag_scores_heads

    L, H, D = rt.n_layers, rt.n_kv_heads, rt.head_dim  # noqa: N806
    m = rows.shape[-1]
    step = _layer_step(m * H * D, rows.device)
    out = []
    for l0 in range(0, L, step):
        layers = range(l0, min(L, l0 + step))
        s = None
        for kind, w in (("k", 1.0), ("v", vr)):
            if not w:
                continue
            bufs = [rt.k_buffer(x) if kind == "k" else rt.v_buffer(x) for x in layers]
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
    """`policies.lagkv.lag_score_dense` before its softmax, padded: z `[..., W, D]` judged by the
    reference `[..., Wr, D]` whose real rows are `rmask` `[..., Wr]`. Returns the per-token std."""
    from sgl_kvevict.policies.lagkv import EPS

    r = kr.float()
    m = rmask.unsqueeze(-1)
    mn = r.masked_fill(~m, float("inf")).amin(dim=-2, keepdim=True)
    mx = r.masked_fill(~m, float("-inf")).amax(dim=-2, keepdim=True)
    zn = (kz.float() - mn) / (mx - mn + EPS)
    return zn.std(dim=-1)


def _cut(
    rt: Any,
    cs: list[Counts],
    fin: list[int],
    seq: torch.Tensor,
    sflat: torch.Tensor,
    nmax: int,
    lag: int,
    vr: float,
) -> torch.Tensor:
    """Stage 3 for the requests `fin`: each one's compressed part (`seq` `[L, H, R, Cmax]`, its first
    `pre` entries) scored as one partition against the raw tail's first L tokens (against itself when
    there is no raw tail, as `LagKVPolicy._recurse` does) and cut to its top `cut`, in position order."""
    L, H, R, cmax = seq.shape  # noqa: N806
    D = rt.head_dim  # noqa: N806
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
            z = torch.stack([_dense_rows(rt, layer, kind, zrows[layer]) for layer in layers])
            ref = torch.stack([_dense_rows(rt, layer, kind, rrows[layer]) for layer in layers])
            stds[kind].append(_dense(z, ref, rm))
    zm = _to(~zmask, dev)
    s = torch.cat(stds["k"]).masked_fill(zm, float("-inf")).softmax(dim=-1)
    if vr:
        s = s + vr * torch.cat(stds["v"]).masked_fill(zm, float("-inf")).softmax(dim=-1)
    s = s.masked_fill(zm, float("-inf"))
    cuts = [cs[r].cut for r in fin]
    bmax = max(cuts)
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


def _dense_rows(rt: Any, layer: int, kind: str, rows: torch.Tensor) -> torch.Tensor:
    """K or V of one layer at flat pool rows `rows` (any shape), with a trailing D axis."""
    buf = rt.k_buffer(layer) if kind == "k" else rt.v_buffer(layer)
    flat = buf.view(-1, buf.shape[-1])
    return flat.index_select(0, rows.reshape(-1)).view(*rows.shape, buf.shape[-1])


def select(jobs: list[Job], cs: list[Counts], slots_pad: torch.Tensor) -> torch.Tensor:
    """`[R, L, H, Kmax]` kept region indices per request, layer and head, sorted, padded with Nmax past
    each request's own k. `slots_pad`: `[R, Nmax]` region slots (padding repeats a real slot)."""
    rt = jobs[0].s.ctx.rt
    pol = jobs[0].s.policy
    cfg = pol.config
    lag, kk, vr = cfg.lag, pol.keep_per_partition, cfg.score_v_ratio
    dev = slots_pad.device
    L, H = rt.n_layers, rt.n_kv_heads  # noqa: N806
    R, nmax = slots_pad.shape  # noqa: N806
    heads = torch.arange(H, device=dev)
    sflat = slots_pad.reshape(-1)
    cmax = max(1, max(c.c0 for c in cs))

    # the compressed part, [L, H, R, Cmax] region positions: the compacted part first
    comp = [c.t0 - c.n_sink for c in cs]
    base, _ = ragged.padded([c.n_sink for c in cs], comp, cmax)
    seq = _to(base, dev).view(1, 1, R, cmax).expand(L, H, R, cmax).contiguous()

    # 1. every request's scored partitions, laid end to end with their successors; top k of each
    part = [r for r, c in enumerate(cs) if c.pc > 0]
    if part:
        pcs = [cs[r].pc for r in part]
        blocks = [p + 1 for p in pcs]
        pos = ragged.aranges([r * nmax + cs[r].t0 for r in part], [b * lag for b in blocks])
        rows = _rows(sflat, _to(pos, dev).view(1, 1, -1), heads)  # [1, H, M]
        s = _block_scores(rt, rows, lag, vr)  # [L, H, B - 1, lag]
        # block b is judged by block b + 1 of the same request
        scored = ragged.aranges(ragged.offsets(blocks), pcs)
        top = s.index_select(2, _to(scored, dev)).topk(kk, dim=-1).indices.sort(dim=-1).values
        shift = ragged.repeat([cs[r].t0 for r in part], pcs) + ragged.aranges([0] * len(pcs), pcs) * lag
        top = top + _to(shift, dev).view(1, 1, -1, 1)  # region positions
        dst = ragged.aranges([r * cmax + comp[r] for r in part], [p * kk for p in pcs])
        seq.view(L, H, R * cmax).index_copy_(2, _to(dst, dev), top.reshape(L, H, -1))

    # 2. chunk recursion, one pass per round over the requests still in it
    for i in range(max(len(c.rounds) for c in cs)):
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
        s = _block_scores(rt, _rows(sflat, pos, heads), lag, vr)  # [L, H, B - 1, lag]
        scored = ragged.aranges(ragged.offsets([q + 1 for q in qs]), qs)
        top = s.index_select(2, _to(scored, dev)).topk(kk, dim=-1).indices.sort(dim=-1).values
        # offsets into the compressed part
        shift = ragged.repeat(rem, qs) + ragged.aranges([0] * len(qs), qs) * lag
        top = top + _to(shift, dev).view(1, 1, -1, 1)
        gidx = torch.arange(cmax, device=dev).expand(L, H, R, cmax).contiguous()
        dst = ragged.aranges([r * cmax + rem[a] for a, r in enumerate(act)], [q * kk for q in qs])
        gidx.view(L, H, R * cmax).index_copy_(2, _to(dst, dev), top.reshape(L, H, -1))
        seq = seq.gather(3, gidx)

    # 3. final cut to the budget: the compressed part as one partition against the raw tail
    fin = [r for r, c in enumerate(cs) if c.cut > 0]
    if fin:
        seq = _cut(rt, cs, fin, seq, sflat, nmax, lag, vr)

    # sinks, the compressed part, the raw tail; past k: Nmax
    ks = [c.k for c in cs]
    kmax = max(ks)
    j = torch.arange(kmax, dtype=torch.int64).unsqueeze(0)
    sink = torch.tensor([c.n_sink for c in cs]).view(-1, 1)
    cc = torch.tensor([c.c for c in cs]).view(-1, 1)
    raw0 = torch.tensor([c.n - c.raw for c in cs]).view(-1, 1)
    k_col = torch.tensor(ks).view(-1, 1)
    fixed = torch.where(j < sink, j, raw0 + j - sink - cc)
    fixed = torch.where(j >= k_col, nmax, fixed)
    keep = _to(fixed, dev).view(1, 1, R, kmax).expand(L, H, R, kmax).contiguous()
    dst = ragged.aranges([r * kmax + c.n_sink for r, c in enumerate(cs)], [c.c for c in cs])
    srcs = ragged.aranges([r * cmax for r in range(R)], [c.c for c in cs])
    keep.view(L, H, R * kmax).index_copy_(
        2, _to(dst, dev), seq.reshape(L, H, R * cmax).index_select(2, _to(srcs, dev))
    )
    return keep.permute(2, 0, 1, 3)
