"""D2O's merge as it was before its cost work (torch reference only), for `bench_policies.py
--side-by-side` ("d2o-previous"): chunked over evicted *and* kept tokens with a per-block `max`
(with indices), advanced-indexing gathers, and host syncs (`bool(merge.any())`, `nonzero`, `unique`,
`int(merged.sum())`). Same results as `kernels.d2o_merge_ref`; kept only to time the two in one run.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sgl_kvevict.kernels._pool import head_rows, region, write_head_rows
from sgl_kvevict.kernels.d2o_merge import NORM_EPS, _keep_and_tau, _threshold  # unchanged by the cost work

_MAX_SIMS = 1 << 20  # elements of one [H, evicted chunk, kept chunk] similarity block in the reference


def _prepare(
    slots: torch.Tensor, keep: torch.Tensor, tau: torch.Tensor | float | None, hkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept indices, evicted indices (the per-head complement, ascending) and tau as [Hkv] float32."""
    n = slots.numel()
    keep, tau_t = _keep_and_tau(slots, keep, tau, hkv)
    evicted_mask = torch.ones(hkv, n, dtype=torch.bool, device=slots.device)
    evicted_mask.scatter_(1, keep, False)
    idx = torch.arange(n, device=slots.device).expand(hkv, n)
    evicted = idx[evicted_mask].view(hkv, n - keep.shape[1])
    return keep, evicted, tau_t


def _match_ref(
    kn: torch.Tensor, evicted: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best cosine u `[H, E]` and its kept index c `[H, E]` from unit keys kn `[H, N, D]`.

    Chunked over evicted *and* kept tokens with a running max: no similarity block exceeds `_MAX_SIMS`
    elements, whatever the region length (a full [E, b] matrix per head is O(N^2) memory at 32K)."""
    hkv, n_ev, b = kn.shape[0], evicted.shape[1], keep.shape[1]
    heads = torch.arange(hkv, device=kn.device)[:, None]
    side = max(1, math.isqrt(_MAX_SIMS // hkv))
    ce, cb = min(n_ev, side), min(b, side)
    u = torch.empty(hkv, n_ev, dtype=torch.float32, device=kn.device)
    c = torch.empty(hkv, n_ev, dtype=torch.int64, device=kn.device)
    for e0 in range(0, n_ev, ce):
        ke = kn[heads, evicted[:, e0 : e0 + ce]]  # [H, ce, D]
        best = torch.full(ke.shape[:2], float("-inf"), device=kn.device)
        arg = torch.zeros(ke.shape[:2], dtype=torch.int64, device=kn.device)
        for c0 in range(0, b, cb):
            kc = kn[heads, keep[:, c0 : c0 + cb]]  # [H, cb, D]
            m, a = torch.matmul(ke, kc.transpose(1, 2)).max(dim=-1)
            better = m > best  # ties keep the earlier kept token, as one unchunked argmax would
            best = torch.where(better, m, best)
            arg = torch.where(better, a + c0, arg)
        u[:, e0 : e0 + ce], c[:, e0 : e0 + ce] = best, arg
    return u, c


def _report(stats: dict[str, Any] | None, merged: torch.Tensor, n_evicted: int) -> None:
    if stats is not None:
        stats["merged"] = int(merged.sum())
        stats["evicted"] = n_evicted


def d2o_merge_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    tau: torch.Tensor | float | None,
    beta: float,
    init: bool,
    stats: dict[str, Any] | None = None,
    reduce: str = "max",
) -> torch.Tensor:
    """Torch reference. Returns the new tau [Hkv]; `stats` (if given) gets 'merged' and 'evicted' counts."""
    hkv = k_buffer.shape[1]
    keep, evicted, tau_t = _prepare(slots, keep, tau, hkv)
    b, n_ev = keep.shape[1], evicted.shape[1]
    if n_ev == 0 or b == 0:
        _report(stats, torch.zeros(1), 0)
        return tau_t
    k = region(k_buffer, slots).float().transpose(0, 1)  # [H, N, D]
    kn = k.div_(k.norm(dim=-1, keepdim=True).clamp_min_(NORM_EPS))
    u, c = _match_ref(kn, evicted, keep)
    tau_new = _threshold(u, tau_t, beta, init, reduce)
    merge = u >= tau_new[:, None]
    _report(stats, merge, hkv * n_ev)
    if not bool(merge.any()):
        return tau_new
    # only the merged evicted tokens and their targets are touched (decode evicts a handful)
    mh, me = merge.nonzero(as_tuple=True)
    targets, inv = torch.unique(mh * b + c[mh, me], return_inverse=True)  # flat (head, kept index)
    hh, jj = targets // b, targets % b
    dst = slots[keep[hh, jj]]
    src = slots[evicted[mh, me]]
    w = u[mh, me].exp()
    z = torch.full((targets.numel(), 1), math.e, dtype=torch.float32, device=k.device)
    z.index_add_(0, inv, w[:, None])
    for buf in (k_buffer, v_buffer):
        num = head_rows(buf, dst, hh).float().mul_(math.e)
        num.index_add_(0, inv, head_rows(buf, src, mh).float().mul_(w[:, None]))
        write_head_rows(buf, dst, hh, num.div_(z))
    return tau_new
