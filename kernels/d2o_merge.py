"""D2O token merging (D2O paper, token-level merge): fold evicted tokens into their nearest kept token.

Reading of the paper used here (where its equations leave a choice, the choice is stated):

- Similarity is on keys only, cosine, per KV head: u_e = max_c cos(k_e, k_c), c*(e) its argmax over the
  kept tokens of that head (many-to-one). Values reuse the keys' matching and weights.
- Threshold (`reduce`): 'max' reads Eq. 10 per KV head: at prefill (`init=True`) tau' = mean_e(u_e); in
  decode tau' = beta * max_e(u_e) + (1 - beta) * tau (EMA, beta weights the current step). 'mean' is the
  authors' released code: one scalar per layer, the mean over heads and evicted tokens of u_e, at prefill
  and as the EMA's current term. The *updated* threshold is the one compared against ("according to the
  current EMA threshold").
- e merges iff u_e >= tau'. GAT-style weights with Euler's number as the kept token's own weight
  (exp(cos(k_c, k_c)) = exp(1)): Z_c = e + sum exp(u_e), k_c <- (e * k_c + sum exp(u_e) k_e) / Z_c, and
  the same for v. Kept tokens that receive nothing are not rewritten (no bf16 round-trip drift).
- Unmerged evicted tokens are simply dropped later by compaction.

Zero-norm keys get cosine 0 with everything (norm clamped at 1e-12, as F.normalize does). The match is
chunked over both evicted and kept tokens (bounded memory at any length); ties go to the earliest kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ._pool import head_rows, region, write_head_rows
from .dispatch import next_pow2, use_triton

NORM_EPS = 1e-12
_MAX_SIMS = 1 << 20  # elements of one [H, evicted chunk, kept chunk] similarity block in the reference


def _prepare(
    slots: torch.Tensor, keep: torch.Tensor, tau: torch.Tensor | float | None, hkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept indices, evicted indices (the per-head complement, ascending) and tau as [Hkv] float32."""
    n = slots.numel()
    keep = keep.to(device=slots.device, dtype=torch.int64)
    assert keep.dim() == 2 and keep.shape[0] == hkv, "keep must be [Hkv, b]"
    if tau is None:
        tau_t = torch.zeros(hkv, dtype=torch.float32, device=slots.device)
    else:
        tau_t = torch.as_tensor(tau, dtype=torch.float32, device=slots.device).expand(hkv).clone()
    evicted_mask = torch.ones(hkv, n, dtype=torch.bool, device=slots.device)
    evicted_mask.scatter_(1, keep, False)
    idx = torch.arange(n, device=slots.device).expand(hkv, n)
    evicted = idx[evicted_mask].view(hkv, n - keep.shape[1])
    return keep, evicted, tau_t


def _threshold(u: torch.Tensor, tau: torch.Tensor, beta: float, init: bool, reduce: str) -> torch.Tensor:
    """tau' per head `[Hkv]` from the step's best similarities u `[Hkv, E]`.

    reduce='max' (the paper's Eq. 10 as read here): per head, mean at prefill, then
    beta * max_e(u_e) + (1 - beta) * tau. reduce='mean' (the authors' released code): one scalar per
    layer, the mean of the per-token best similarities over every head, at prefill and in the EMA.
    """
    if reduce == "mean":
        cur = u.mean().expand(u.shape[0])
        return cur.clone() if init else beta * cur + (1.0 - beta) * tau
    if init:
        return u.mean(dim=1)
    return beta * u.amax(dim=1) + (1.0 - beta) * tau


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


@triton.jit
def _d2o_match_kernel(
    k_ptr, slots_ptr, keep_ptr, ev_ptr, u_ptr, c_ptr, B, E, D, s_s, s_h, norm_eps,
    BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per (head, block of evicted): best cosine similarity and its kept index, streaming the kept keys."""
    h = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    mask_e = offs_e < E
    mask_d = offs_d < D
    e_idx = tl.load(ev_ptr + h * E + offs_e, mask=mask_e, other=0)
    e_slot = tl.load(slots_ptr + e_idx, mask=mask_e, other=0)
    ke = tl.load(
        k_ptr + e_slot[:, None] * s_s + h * s_h + offs_d[None, :],
        mask=mask_e[:, None] & mask_d[None, :],
        other=0.0,
    )
    ke = ke.to(tl.float32)
    ke = ke / tl.maximum(tl.sqrt(tl.sum(ke * ke, axis=1)), norm_eps)[:, None]
    best = tl.full([BLOCK_E], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, B, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask_c = offs_c < B
        c_idx = tl.load(keep_ptr + h * B + offs_c, mask=mask_c, other=0)
        c_slot = tl.load(slots_ptr + c_idx, mask=mask_c, other=0)
        kc = tl.load(
            k_ptr + c_slot[:, None] * s_s + h * s_h + offs_d[None, :],
            mask=mask_c[:, None] & mask_d[None, :],
            other=0.0,
        )
        kc = kc.to(tl.float32)
        kc = kc / tl.maximum(tl.sqrt(tl.sum(kc * kc, axis=1)), norm_eps)[:, None]
        sims = tl.dot(ke, tl.trans(kc), input_precision="ieee")  # [BE, BC]
        sims = tl.where(mask_c[None, :], sims, float("-inf"))
        bmax = tl.max(sims, axis=1)
        barg = tl.argmax(sims, axis=1).to(tl.int32) + c0
        better = bmax > best
        arg = tl.where(better, barg, arg)
        best = tl.where(better, bmax, best)
    tl.store(u_ptr + h * E + offs_e, best, mask=mask_e)
    tl.store(c_ptr + h * E + offs_e, arg.to(tl.int64), mask=mask_e)


@triton.jit
def _d2o_apply_kernel(
    k_ptr, v_ptr, slots_ptr, keep_ptr, ev_ptr, u_ptr, order_ptr, th_ptr, tj_ptr, start_ptr, cnt_ptr,
    B, E, D, s_s, s_h, euler,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per receiving kept token: weighted sum of itself and its merged evicted tokens, written in place.

    The evicted tokens of each target are a contiguous run of `order` (CSR), so no atomics are needed and
    the result does not depend on scheduling.
    """
    t = tl.program_id(0)
    h = tl.load(th_ptr + t)
    j = tl.load(tj_ptr + t)
    start = tl.load(start_ptr + t)
    cnt = tl.load(cnt_ptr + t)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    dst = tl.load(slots_ptr + tl.load(keep_ptr + h * B + j))
    row = dst * s_s + h * s_h + offs_d
    acc_k = tl.load(k_ptr + row, mask=mask_d, other=0.0).to(tl.float32) * euler
    acc_v = tl.load(v_ptr + row, mask=mask_d, other=0.0).to(tl.float32) * euler
    z = euler
    for i in range(start, start + cnt):
        pos = tl.load(order_ptr + h * E + i)
        w = tl.exp(tl.load(u_ptr + h * E + pos))
        src = tl.load(slots_ptr + tl.load(ev_ptr + h * E + pos)) * s_s + h * s_h + offs_d
        acc_k += w * tl.load(k_ptr + src, mask=mask_d, other=0.0).to(tl.float32)
        acc_v += w * tl.load(v_ptr + src, mask=mask_d, other=0.0).to(tl.float32)
        z += w
    tl.store(k_ptr + row, (acc_k / z).to(k_ptr.dtype.element_ty), mask=mask_d)
    tl.store(v_ptr + row, (acc_v / z).to(v_ptr.dtype.element_ty), mask=mask_d)


def d2o_merge_triton(
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
    """Triton version: matching kernel, tiny torch glue (threshold, CSR by target), merging kernel."""
    hkv, d = k_buffer.shape[1], k_buffer.shape[2]
    assert k_buffer.stride() == v_buffer.stride() and k_buffer.stride(2) == 1
    slots = slots.contiguous()
    keep, evicted, tau_t = _prepare(slots, keep, tau, hkv)
    keep = keep.contiguous()
    evicted = evicted.contiguous()
    b, n_ev = keep.shape[1], evicted.shape[1]
    if n_ev == 0 or b == 0:
        _report(stats, torch.zeros(1), 0)
        return tau_t
    dev = k_buffer.device
    u = torch.empty(hkv, n_ev, dtype=torch.float32, device=dev)
    c = torch.empty(hkv, n_ev, dtype=torch.int64, device=dev)
    bd = max(16, next_pow2(d))
    be = bc = 32
    _d2o_match_kernel[(hkv, triton.cdiv(n_ev, be))](
        k_buffer, slots, keep, evicted, u, c, b, n_ev, d, k_buffer.stride(0), k_buffer.stride(1), NORM_EPS,
        BLOCK_E=be, BLOCK_C=bc, BLOCK_D=bd,
    )  # fmt: skip
    tau_new = _threshold(u, tau_t, beta, init, reduce)
    merge = u >= tau_new[:, None]
    _report(stats, merge, hkv * n_ev)
    if not bool(merge.any()):
        return tau_new
    # CSR by target: sort each head's evicted by target index (non-merged go last with key b)
    key = torch.where(merge, c, torch.full_like(c, b))
    order = key.argsort(dim=1, stable=True).contiguous()
    count = torch.zeros(hkv, b + 1, dtype=torch.int64, device=dev).scatter_add_(1, key, torch.ones_like(key))
    start = count.cumsum(dim=1) - count
    th, tj = (count[:, :b] > 0).nonzero(as_tuple=True)
    _d2o_apply_kernel[(th.numel(),)](
        k_buffer, v_buffer, slots, keep, evicted, u, order, th.contiguous(), tj.contiguous(),
        start[th, tj].contiguous(), count[th, tj].contiguous(), b, n_ev, d,
        k_buffer.stride(0), k_buffer.stride(1), math.e,
        BLOCK_D=next_pow2(d),
    )  # fmt: skip
    return tau_new


def d2o_merge(
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
    """Merge evicted into kept slots in place; returns the new tau [Hkv]. See the module docstring."""
    if use_triton(k_buffer):
        return d2o_merge_triton(k_buffer, v_buffer, slots, keep, tau, beta, init, stats, reduce)
    return d2o_merge_ref(k_buffer, v_buffer, slots, keep, tau, beta, init, stats, reduce)
