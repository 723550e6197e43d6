"""In-place compaction of a request's region after selection (paged layout stays rectangular).

For each layer l and KV head h: buf[slots[i], h] = old buf[slots[keep[l, h, i]], h] for i < b. Because
keep is sorted ascending, keep[l, h, i] >= i: sources and destinations overlap, so a naive parallel copy
could read a slot another block already overwrote. Both versions gather first, then write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pool import head_rows, write_head_rows
from .dispatch import next_pow2, use_triton


def _check(slots: torch.Tensor, keep: torch.Tensor, n_layers: int) -> None:
    assert keep.dim() == 3 and keep.shape[0] == n_layers, "keep must be [L_layers, Hkv, b]"
    assert keep.shape[2] <= slots.numel(), "cannot keep more tokens than the region holds"


def compact_ref(
    k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor], slots: torch.Tensor, keep: torch.Tensor
) -> None:
    """Torch reference: advanced-index gather (a copy) then indexed write, per layer."""
    _check(slots, keep, len(k_buffers))
    b = keep.shape[2]
    if b == 0:
        return
    keep = keep.to(slots.device)
    heads = torch.arange(keep.shape[1], device=slots.device)[:, None]  # [Hkv, 1]
    dst = slots[:b][None, :].expand(keep.shape[1], b)  # [Hkv, b]
    for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        src = slots[keep[layer]]  # [Hkv, b]
        k_new = head_rows(kb, src, heads)  # [Hkv, b, D] copy
        v_new = head_rows(vb, src, heads)
        write_head_rows(kb, dst, heads, k_new)
        write_head_rows(vb, dst, heads, v_new)


@triton.jit
def _gather_kernel(
    k_ptr, v_ptr, slots_ptr, keep_ptr, tk_ptr, tv_ptr, B, D, s_s, s_h,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Pass 1: copy the kept rows of one head into a dense temp [Hkv, b, D]."""
    h = tl.program_id(0)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, BLOCK_D)
    mask_b = offs_b < B
    m2 = mask_b[:, None] & (offs_d < D)[None, :]
    idx = tl.load(keep_ptr + h * B + offs_b, mask=mask_b, other=0)
    src = tl.load(slots_ptr + idx, mask=mask_b, other=0)
    ptr = src[:, None] * s_s + h * s_h + offs_d[None, :]
    tmp = (h * B + offs_b)[:, None] * D + offs_d[None, :]
    tl.store(tk_ptr + tmp, tl.load(k_ptr + ptr, mask=m2), mask=m2)
    tl.store(tv_ptr + tmp, tl.load(v_ptr + ptr, mask=m2), mask=m2)


@triton.jit
def _scatter_kernel(
    k_ptr, v_ptr, slots_ptr, tk_ptr, tv_ptr, B, D, s_s, s_h,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Pass 2: write the temp rows to the first b slots of the region."""
    h = tl.program_id(0)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, BLOCK_D)
    mask_b = offs_b < B
    m2 = mask_b[:, None] & (offs_d < D)[None, :]
    dst = tl.load(slots_ptr + offs_b, mask=mask_b, other=0)
    ptr = dst[:, None] * s_s + h * s_h + offs_d[None, :]
    tmp = (h * B + offs_b)[:, None] * D + offs_d[None, :]
    tl.store(k_ptr + ptr, tl.load(tk_ptr + tmp, mask=m2), mask=m2)
    tl.store(v_ptr + ptr, tl.load(tv_ptr + tmp, mask=m2), mask=m2)


def compact_triton(
    k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor], slots: torch.Tensor, keep: torch.Tensor
) -> None:
    """Triton version: two launches per layer (gather into a temp, then write), so overlap is harmless."""
    _check(slots, keep, len(k_buffers))
    hkv, b = keep.shape[1], keep.shape[2]
    if b == 0:
        return
    slots = slots.contiguous()
    keep = keep.to(device=slots.device, dtype=torch.int64).contiguous()
    bb = 64
    for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        assert kb.stride() == vb.stride() and kb.dtype == vb.dtype and kb.stride(2) == 1
        d = kb.shape[2]
        tk = torch.empty(hkv, b, d, dtype=kb.dtype, device=kb.device)
        tv = torch.empty_like(tk)
        grid = (hkv, triton.cdiv(b, bb))
        _gather_kernel[grid](
            kb, vb, slots, keep[layer], tk, tv, b, d, kb.stride(0), kb.stride(1),
            BLOCK_B=bb, BLOCK_D=next_pow2(d),
        )  # fmt: skip
        _scatter_kernel[grid](
            kb, vb, slots, tk, tv, b, d, kb.stride(0), kb.stride(1),
            BLOCK_B=bb, BLOCK_D=next_pow2(d),
        )  # fmt: skip


def compact(
    k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor], slots: torch.Tensor, keep: torch.Tensor
) -> None:
    """Compact every layer's region in place; see the package docstring for the contract."""
    if not k_buffers:
        return
    if use_triton(k_buffers[0]):
        compact_triton(k_buffers, v_buffers, slots, keep)
    else:
        compact_ref(k_buffers, v_buffers, slots, keep)
