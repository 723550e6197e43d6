"""Page summaries of host-tier keys and query-aware page scores (Quest-style bounds, or a mean key).

Why: scoring every host key at each turn reads the whole host history. A small device-resident summary
per page of `page` host columns (per layer and KV head) is scored instead; only the selected pages'
columns are then fetched. Two summaries are offered, and `benchmarks/bench_recall.py` measures which
recalls better on the real model:

- "minmax": per channel min and max of the page's keys. For one query q, sum_d max(q_d*min_d, q_d*max_d)
  is an upper bound of q.k over every key of the page (Quest). Computed as two matmuls:
  q+ @ max + q- @ min with q+ = max(q, 0), q- = min(q, 0), which is the same sum.
- "mean": the mean key; q.mean is the page's mean logit (no bound, but one matmul and one summary).

Shapes: keys `[e, Hkv, D]` (one layer's host columns, column c of head h is the entry that head evicted
into column c); summaries `[p, Hkv, D]` float32 with p = ceil(e / page), the last page possibly partial;
window queries `[W, Hq, D]` (query head j reads KV head j // G, G = Hq // Hkv); scores `[Hkv, p]` float32.
Scores are aggregated over the W queries and the G heads of each group: "max" (the largest bound, sound:
no query of the group can give any key of the page a larger logit) or "sum".

Everything takes its sizes from shapes and Python ints: no host sync (no `.item()`, no data-dependent
shape), so the calls can sit in the decode path on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2, use_triton

MODES = ("minmax", "mean")
AGGS = ("max", "sum")
# Scores per chunk of pages are [Hkv, G*W, pages] fp32 in the reference; bound the chunk.
_MAX_SCORES = 1 << 22


def n_pages(e: int, page: int) -> int:
    """Pages that cover e columns (the last one partial when page does not divide e)."""
    return -(-int(e) // int(page))


def _check_summary_args(keys: torch.Tensor, page: int) -> None:
    assert keys.dim() == 3, "keys must be [e, Hkv, D]"
    assert page >= 1, "page must be >= 1"


# --------------------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------------------


def page_summaries_ref(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: (kmin, kmax, kmean), each `[p, Hkv, D]` float32, over pages of `page` columns."""
    _check_summary_args(keys, page)
    e, h, d = keys.shape
    p = n_pages(e, page)
    k = keys.float()
    if e == 0:
        empty = k.new_empty(0, h, d)
        return empty, empty.clone(), empty.clone()
    pad = p * page - e
    # min/max: repeat the last column into the padding (changes neither); sum: zeros.
    rep = torch.cat([k, k[-1:].expand(pad, h, d)]) if pad else k
    zer = torch.cat([k, k.new_zeros(pad, h, d)]) if pad else k
    pages = rep.view(p, page, h, d)
    kmin, kmax = pages.amin(1), pages.amax(1)
    counts = torch.full((p,), float(page), device=k.device)
    counts[-1] = e - (p - 1) * page
    kmean = zer.view(p, page, h, d).sum(1) / counts[:, None, None]
    return kmin, kmax, kmean


@triton.jit
def _summary_kernel(
    k_ptr, min_ptr, max_ptr, mean_ptr, E, D, H, sk_e, sk_h,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (page, KV head): min, max and mean over the page's valid columns."""
    pg = tl.program_id(0)
    h = tl.program_id(1)
    offs_c = pg * PAGE + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c = (tl.arange(0, BLOCK_P) < PAGE) & (offs_c < E)
    mask_d = offs_d < D
    m2 = mask_c[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + offs_c[:, None] * sk_e + h * sk_h + offs_d[None, :], mask=m2, other=0.0)
    k = k.to(tl.float32)
    kmin = tl.min(tl.where(m2, k, float("inf")), axis=0)
    kmax = tl.max(tl.where(m2, k, float("-inf")), axis=0)
    count = tl.minimum(E - pg * PAGE, PAGE).to(tl.float32)
    kmean = tl.sum(k, axis=0) / count
    out = (pg * H + h) * D + offs_d
    tl.store(min_ptr + out, kmin, mask=mask_d)
    tl.store(max_ptr + out, kmax, mask=mask_d)
    tl.store(mean_ptr + out, kmean, mask=mask_d)


def page_summaries_triton(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version: one program per (page, head), one read of the keys."""
    _check_summary_args(keys, page)
    e, h, d = keys.shape
    p = n_pages(e, page)
    assert keys.stride(2) == 1, "keys' last dim must be contiguous"
    kmin = torch.empty(p, h, d, dtype=torch.float32, device=keys.device)
    kmax, kmean = torch.empty_like(kmin), torch.empty_like(kmin)
    if p == 0:
        return kmin, kmax, kmean
    _summary_kernel[(p, h)](
        keys, kmin, kmax, kmean, e, d, h, keys.stride(0), keys.stride(1),
        PAGE=page, BLOCK_P=next_pow2(page), BLOCK_D=max(16, next_pow2(d)),
    )  # fmt: skip
    return kmin, kmax, kmean


def page_summaries(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kmin, kmax, kmean) `[ceil(e/page), Hkv, D]` float32 of one layer's host keys `[e, Hkv, D]`."""
    if use_triton(keys):
        return page_summaries_triton(keys, page)
    return page_summaries_ref(keys, page)


def page_summaries_append(
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kmean: torch.Tensor | None,
    n_old: int,
    keys_new: torch.Tensor,
    page: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Summaries after appending columns `keys_new [m, Hkv, D]` to `n_old` summarised columns.

    Demotion appends columns; their keys are on the device at that moment, the old columns are not, so the
    old partial last page is merged (min, max, count-weighted mean) instead of recomputed. `n_old` is the
    column count the tier tracks on the host (an int: no sync). Returns new tensors of ceil((n_old+m)/page)
    pages, each in its input's dtype; the inputs are not modified. A summary given as None (one the
    caller does not keep) stays None; at least one must be given.
    """
    have = next(x for x in (kmin, kmax, kmean) if x is not None)
    m = keys_new.shape[0]
    p_old = n_pages(n_old, page)
    assert have.shape[0] == p_old, "summaries must cover exactly n_old columns"
    if m == 0:
        return kmin, kmax, kmean
    head = min((-n_old) % page, m)  # free columns in the old partial last page
    olds = (kmin, kmax, kmean)
    parts: list[list[torch.Tensor]] = [[x] if x is not None else [] for x in olds]
    if head:
        last = p_old - 1
        c_old = n_old - last * page
        part = keys_new[:head].float()
        merged = (
            torch.minimum(kmin[last].float(), part.amin(0)) if kmin is not None else None,
            torch.maximum(kmax[last].float(), part.amax(0)) if kmax is not None else None,
            (kmean[last].float() * c_old + part.sum(0)) / (c_old + head) if kmean is not None else None,
        )
        parts = [
            [x[:last], y[None].to(x.dtype)] if x is not None else []
            for x, y in zip(olds, merged, strict=True)
        ]
    if m > head:
        for out, x, new in zip(parts, olds, page_summaries(keys_new[head:], page), strict=True):
            if x is not None:
                out.append(new.to(x.dtype))
    res = [torch.cat(out) if x is not None else None for out, x in zip(parts, olds, strict=True)]
    return res[0], res[1], res[2]


def refresh_pages(
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kmean: torch.Tensor | None,
    page_ids: torch.Tensor,
    page_keys: torch.Tensor,
    valid: torch.Tensor,
) -> None:
    """Recompute, in place, the summaries of pages whose columns changed (a swap wrote displaced entries).

    page_ids `[Hkv, n]` (distinct per head); page_keys `[Hkv, n*page, D]`: the pages' columns as they are
    now (the fetched columns with the swapped ones replaced), in `gather_columns` order; valid
    `[Hkv, n*page]`: which of them are real columns (the last page may be partial). Pages are non-empty.
    A summary given as None is skipped.
    """
    hkv, n = page_ids.shape
    if n == 0:
        return
    page = page_keys.shape[1] // n
    k = page_keys.float().view(hkv, n, page, -1)
    ok = valid.view(hkv, n, page, 1)
    heads = torch.arange(hkv, device=page_ids.device)[:, None].expand(hkv, n)
    if kmin is not None:
        kmin[page_ids, heads] = torch.where(ok, k, float("inf")).amin(2).to(kmin.dtype)
    if kmax is not None:
        kmax[page_ids, heads] = torch.where(ok, k, float("-inf")).amax(2).to(kmax.dtype)
    if kmean is not None:
        kmean[page_ids, heads] = (torch.where(ok, k, 0.0).sum(2) / ok.sum(2).clamp_min(1)).to(kmean.dtype)


# --------------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------------


def _check_scores(
    q: torch.Tensor,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kmean: torch.Tensor | None,
    mode: str,
    agg: str,
) -> tuple[int, int, int, int, int]:
    assert mode in MODES, f"mode must be one of {MODES}"
    assert agg in AGGS, f"agg must be one of {AGGS}"
    used = (kmin, kmax) if mode == "minmax" else (kmean,)
    assert all(x is not None for x in used), (
        f"mode {mode} needs {'kmin and kmax' if mode == 'minmax' else 'kmean'}"
    )
    ref = used[0]
    assert q.dim() == 3 and ref.dim() == 3, "q is [W, Hq, D], summaries are [p, Hkv, D]"
    w, hq, d = q.shape
    p, hkv, d2 = ref.shape
    assert d == d2 and hq % hkv == 0, "q and summaries disagree on D, or Hq is not a multiple of Hkv"
    return w, hq, d, p, hkv


def page_scores_ref(
    q: torch.Tensor,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kmean: torch.Tensor | None,
    mode: str,
    scale: float,
    agg: str = "max",
) -> torch.Tensor:
    """Torch reference: `[Hkv, p]` float32 page scores (see the module docstring). Summaries of any float
    dtype; only the mode's are read (the others may be None)."""
    w, hq, d, p, hkv = _check_scores(q, kmin, kmax, kmean, mode, agg)
    g = hq // hkv
    qf = q.float().permute(1, 0, 2).reshape(hkv, g * w, d)  # row j*W + i: query i of head h*G + j
    out = torch.empty(hkv, p, dtype=torch.float32, device=q.device)
    if p == 0 or w == 0:
        return out.fill_(float("-inf") if agg == "max" else 0.0)
    qpos, qneg = qf.clamp_min(0), qf.clamp_max(0)
    step = max(1, _MAX_SCORES // max(1, hkv * g * w))
    for p0 in range(0, p, step):
        p1 = min(p, p0 + step)
        if mode == "minmax":
            s = torch.matmul(qpos, kmax[p0:p1].float().permute(1, 2, 0)) + torch.matmul(
                qneg, kmin[p0:p1].float().permute(1, 2, 0)
            )
        else:
            s = torch.matmul(qf, kmean[p0:p1].float().permute(1, 2, 0))
        s.mul_(scale)
        out[:, p0:p1] = s.amax(1) if agg == "max" else s.sum(1)
    return out


@triton.jit
def _page_scores_kernel(
    q_ptr, min_ptr, max_ptr, mean_ptr, out_ptr, P, W, D, G, H, scale,
    sq_w, sq_h,
    MINMAX: tl.constexpr, AGG_MAX: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (KV head, block of pages): bounds of every query of the group, then max or sum."""
    h = tl.program_id(0)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = offs_p < P
    mask_d = offs_d < D
    m2 = mask_p[:, None] & mask_d[None, :]
    summ = (offs_p[:, None] * H + h) * D + offs_d[None, :]
    if MINMAX:
        kmin_t = tl.trans(tl.load(min_ptr + summ, mask=m2, other=0.0))
        kmax_t = tl.trans(tl.load(max_ptr + summ, mask=m2, other=0.0))
    else:
        kmean_t = tl.trans(tl.load(mean_ptr + summ, mask=m2, other=0.0))
    if AGG_MAX:
        acc = tl.full([BLOCK_P], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_P], tl.float32)
    for j in range(0, G):
        hq = h * G + j
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            mask_w = offs_w < W
            q = tl.load(
                q_ptr + offs_w[:, None] * sq_w + hq * sq_h + offs_d[None, :],
                mask=mask_w[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            if MINMAX:
                s = tl.dot(tl.maximum(q, 0.0), kmax_t, input_precision="ieee")
                s += tl.dot(tl.minimum(q, 0.0), kmin_t, input_precision="ieee")
            else:
                s = tl.dot(q, kmean_t, input_precision="ieee")
            s = s * scale  # [BW, BP]
            if AGG_MAX:
                acc = tl.maximum(acc, tl.max(tl.where(mask_w[:, None], s, float("-inf")), axis=0))
            else:
                acc += tl.sum(tl.where(mask_w[:, None], s, 0.0), axis=0)
    tl.store(out_ptr + h * P + offs_p, acc, mask=mask_p)


def page_scores_triton(
    q: torch.Tensor,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kmean: torch.Tensor | None,
    mode: str,
    scale: float,
    agg: str = "max",
) -> torch.Tensor:
    """Triton version: summaries read once per page block, queries streamed; never builds [G*W, p]."""
    w, hq, d, p, hkv = _check_scores(q, kmin, kmax, kmean, mode, agg)
    out = torch.empty(hkv, p, dtype=torch.float32, device=q.device)
    if p == 0 or w == 0:
        return out.fill_(float("-inf") if agg == "max" else 0.0)
    q = q.contiguous()
    ref = kmin if mode == "minmax" else kmean
    kmin, kmax, kmean = ((x if x is not None else ref).float().contiguous() for x in (kmin, kmax, kmean))
    bp = 32
    _page_scores_kernel[(hkv, triton.cdiv(p, bp))](
        q, kmin, kmax, kmean, out, p, w, d, hq // hkv, hkv, float(scale),
        q.stride(0), q.stride(1),
        MINMAX=mode == "minmax", AGG_MAX=agg == "max",
        BLOCK_W=max(16, min(64, next_pow2(w))), BLOCK_P=bp, BLOCK_D=max(16, next_pow2(d)),
    )  # fmt: skip
    return out


def page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kmean: torch.Tensor | None,
    mode: str,
    scale: float,
    agg: str = "max",
) -> torch.Tensor:
    """`[Hkv, p]` float32 page scores of window queries `q [W, Hq, D]`; see the module docstring."""
    if use_triton(kmin if kmin is not None else kmean):
        return page_scores_triton(q, kmin, kmax, kmean, mode, scale, agg)
    return page_scores_ref(q, kmin, kmax, kmean, mode, scale, agg)


# --------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------


def select_pages(scores: torch.Tensor, n_sel: int) -> torch.Tensor:
    """`[Hkv, min(n_sel, p)]` int64 page ids per KV head: the top-scored pages, in ascending id order
    (host reads then walk memory forward). Mask pages that must not be chosen with -inf beforehand."""
    k = max(0, min(int(n_sel), scores.shape[1]))
    return scores.topk(k, dim=1).indices.sort(dim=1).values


def gather_columns(page_ids: torch.Tensor, page: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand page ids `[Hkv, n]` to host column ids `[Hkv, n*page]` and a validity mask of the same shape.

    A partial last page gives columns >= n_cols: they are clamped to n_cols - 1 (a real column, so a
    gather stays in bounds and the shape stays fixed) and marked invalid; mask them out of any choice.
    """
    offs = torch.arange(page, device=page_ids.device)
    cols = (page_ids[:, :, None] * page + offs).reshape(page_ids.shape[0], -1)
    valid = cols < n_cols
    return cols.clamp_max(max(0, n_cols - 1)), valid
