"""LagKV scores (LagKV paper, Eq. 7-11): each partition judged against the min/max of the *next* one.

Attention-free, so it runs straight on the pool: `[H, P-1, lag]` softmax-normalised per partition.
The policy calls it once for K and once for V and adds the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pool import region
from .dispatch import next_pow2, use_triton

EPS = 1e-6


def lag_scores_ref(buf: torch.Tensor, slots: torch.Tensor, lag: int) -> torch.Tensor:
    """Torch reference. buf: [pool, H, D]; slots: [P*lag] with P >= 2. Returns [H, P-1, lag] float32."""
    n = slots.numel()
    assert lag > 0 and n % lag == 0 and n // lag >= 2, "slots must hold P >= 2 whole partitions"
    p = n // lag
    h, d = buf.shape[1], buf.shape[2]
    return lag_scores_heads(region(buf, slots).float().view(p, lag, h, d).permute(2, 0, 1, 3).contiguous())


def lag_scores_heads(x: torch.Tensor) -> torch.Tensor:
    """The reference's math on a dense float32 `[H, P, lag, D]` (P >= 2): `[H, P-1, lag]`. Separate so
    that the batched engine, which gathers its blocks in this layout already, runs the very same ops."""
    d = x.shape[-1]
    ref = x[:, 1:]
    mn = ref.amin(dim=2, keepdim=True)
    rng = ref.amax(dim=2, keepdim=True).sub_(mn).add_(EPS)
    zn = x[:, :-1].sub(mn).div_(rng)
    # two-pass unbiased std by hand: ~3x faster on CPU than torch.std (Welford), same result
    zn.sub_(zn.mean(dim=-1, keepdim=True))
    return zn.square_().sum(dim=-1).div_(d - 1).sqrt_().softmax(dim=-1)


@triton.jit
def _lag_kernel(
    buf_ptr, slots_ptr, out_ptr, LAG, D, P1, s_s, s_h, eps,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (head, scored partition); streams the lag tokens in blocks (lag may be 1024)."""
    h = tl.program_id(0)
    p = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    base = buf_ptr + h * s_h
    # channel-wise min / max over the next partition
    mn = tl.full([BLOCK_D], float("inf"), tl.float32)
    mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for l0 in range(0, LAG, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        mask_l = offs_l < LAG
        slot = tl.load(slots_ptr + (p + 1) * LAG + offs_l, mask=mask_l, other=0)
        m2 = mask_l[:, None] & mask_d[None, :]
        z = tl.load(base + slot[:, None] * s_s + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        mn = tl.minimum(mn, tl.min(tl.where(m2, z, float("inf")), axis=0))
        mx = tl.maximum(mx, tl.max(tl.where(m2, z, float("-inf")), axis=0))
    inv = 1.0 / (tl.where(mask_d, mx - mn, 0.0) + eps)
    mn = tl.where(mask_d, mn, 0.0)
    out_row = out_ptr + (h * P1 + p) * LAG
    # per-token unbiased std over channels; write it raw, track the max for a stable softmax
    smax = tl.full([BLOCK_L], float("-inf"), tl.float32)
    for l0 in range(0, LAG, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        mask_l = offs_l < LAG
        slot = tl.load(slots_ptr + p * LAG + offs_l, mask=mask_l, other=0)
        m2 = mask_l[:, None] & mask_d[None, :]
        z = tl.load(base + slot[:, None] * s_s + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        zn = tl.where(m2, (z - mn[None, :]) * inv[None, :], 0.0)
        mean = tl.sum(zn, axis=1) / D
        dev = tl.where(m2, zn - mean[:, None], 0.0)
        std = tl.sqrt(tl.sum(dev * dev, axis=1) / (D - 1))
        tl.store(out_row + offs_l, std, mask=mask_l)
        smax = tl.maximum(smax, tl.where(mask_l, std, float("-inf")))
    tl.debug_barrier()  # the stds are re-read from global memory, possibly by other threads
    mval = tl.max(smax, axis=0)
    ssum = tl.zeros([BLOCK_L], tl.float32)
    for l0 in range(0, LAG, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        mask_l = offs_l < LAG
        std = tl.load(out_row + offs_l, mask=mask_l, other=float("-inf"))
        ssum += tl.where(mask_l, tl.exp(std - mval), 0.0)
    inv_sum = 1.0 / tl.sum(ssum, axis=0)
    tl.debug_barrier()
    for l0 in range(0, LAG, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        mask_l = offs_l < LAG
        std = tl.load(out_row + offs_l, mask=mask_l, other=0.0)
        tl.store(out_row + offs_l, tl.exp(std - mval) * inv_sum, mask=mask_l)


def lag_scores_triton(buf: torch.Tensor, slots: torch.Tensor, lag: int) -> torch.Tensor:
    """Triton version: one program per (head, partition), no dense copy of the region."""
    n = slots.numel()
    assert lag > 0 and n % lag == 0 and n // lag >= 2, "slots must hold P >= 2 whole partitions"
    assert buf.stride(2) == 1, "buffer last dim must be contiguous"
    p1 = n // lag - 1
    h, d = buf.shape[1], buf.shape[2]
    out = torch.empty(h, p1, lag, dtype=torch.float32, device=buf.device)
    slots = slots.contiguous()
    _lag_kernel[(h, p1)](
        buf, slots, out, lag, d, p1, buf.stride(0), buf.stride(1), EPS,
        BLOCK_L=min(64, next_pow2(lag)), BLOCK_D=next_pow2(d),
    )  # fmt: skip
    return out


def lag_scores(buf: torch.Tensor, slots: torch.Tensor, lag: int) -> torch.Tensor:
    """`[H, P-1, lag]` float32 LagKV scores; see the package docstring for the contract."""
    if use_triton(buf):
        return lag_scores_triton(buf, slots, lag)
    return lag_scores_ref(buf, slots, lag)
