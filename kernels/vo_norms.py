"""CriticalKV's value-output norm ||v W_O[h]||_1 (CriticalKV's stage-2 score), without materialising v @ W_O.

Per token and query head h_q (reading the value of its KV head h_q // G), then mean over the G query
heads of each KV head, matching kvpress' GQA handling. Output `[Hkv, N]` float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ._pool import region
from .dispatch import next_pow2, use_triton

_MAX_PROD = 1 << 20  # elements of one [Hq, chunk, hidden] product block in the reference


def _ref_chunks(
    rows: Callable[[int, int], torch.Tensor], n: int, hkv: int, o_proj: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """`[Hkv, n]` from `rows(start, stop)` -> `[c, Hkv, D]` value rows. Each token's norm is computed from
    its own row only, so the norms a forward writes per slot (`vo_norms_rows`, often one token) and the
    ones a compression recomputes from the pool (`vo_norms`) agree to fp32 rounding. With 16-bit values and
    W_O the products are exact in fp32, but the sum over D follows the BLAS kernel a chunk's size picks, so
    a one-token chunk can land an ulp away (seen with torch 2.11 on an x86 CPU, and on an AVX512 Xeon)."""
    hq, d, hidden = o_proj.shape
    g = hq // hkv
    w = o_proj.float().reshape(hkv, g, d, hidden)
    out = torch.empty(hkv, n, dtype=torch.float32, device=device)
    step = max(1, _MAX_PROD // (hq * hidden))
    for n0 in range(0, n, step):
        v = rows(n0, min(n, n0 + step)).float().transpose(0, 1)  # [Hkv, c, D]
        prod = torch.matmul(v[:, None], w)  # [Hkv, G, c, hidden]
        out[:, n0 : n0 + step] = prod.abs_().sum(dim=-1).mean(dim=1)
    return out


def vo_norms_ref(v_buffer: torch.Tensor, slots: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """Torch reference, chunked over tokens. v_buffer: [pool, Hkv, D]; o_proj: [Hq, D, hidden]."""
    return _ref_chunks(
        lambda a, b: region(v_buffer, slots[a:b]), slots.numel(), v_buffer.shape[1], o_proj, v_buffer.device
    )


@triton.jit
def _vo_kernel(
    v_ptr, slots_ptr, w_ptr, out_ptr, N, D, HID, G, inv_g,
    sv_s, sv_h, sw_h, sw_d, sw_c,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Per (KV head, token block): stream W_O over hidden in blocks, accumulating |v W| row sums."""
    hkv = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D
    slot = tl.load(slots_ptr + offs_n, mask=mask_n, other=0)
    v = tl.load(
        v_ptr + slot[:, None] * sv_s + hkv * sv_h + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    v = v.to(tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, G):
        hq = hkv * G + g
        for c0 in range(0, HID, BLOCK_H):
            offs_c = c0 + tl.arange(0, BLOCK_H)
            mask_c = offs_c < HID
            w = tl.load(
                w_ptr + hq * sw_h + offs_d[:, None] * sw_d + offs_c[None, :] * sw_c,
                mask=mask_d[:, None] & mask_c[None, :],
                other=0.0,
            )
            prod = tl.dot(v, w.to(tl.float32), input_precision="ieee")  # [BN, BH]
            acc += tl.sum(tl.abs(prod), axis=1)
    tl.store(out_ptr + hkv * N + offs_n, acc * inv_g, mask=mask_n)


def vo_norms_triton(v_buffer: torch.Tensor, slots: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """Triton version (fused, like CriticalKV's vw_l1norm): reads values through the slot ids."""
    hq, d, hidden = o_proj.shape
    hkv = v_buffer.shape[1]
    g = hq // hkv
    n = slots.numel()
    assert v_buffer.stride(2) == 1
    slots = slots.contiguous()
    out = torch.empty(hkv, n, dtype=torch.float32, device=v_buffer.device)
    if n == 0:
        return out
    bn = 32
    _vo_kernel[(hkv, triton.cdiv(n, bn))](
        v_buffer, slots, o_proj, out, n, d, hidden, g, 1.0 / g,
        v_buffer.stride(0), v_buffer.stride(1), o_proj.stride(0), o_proj.stride(1), o_proj.stride(2),
        BLOCK_N=bn, BLOCK_D=max(16, next_pow2(d)), BLOCK_H=64,
    )  # fmt: skip
    return out


def vo_norms(v_buffer: torch.Tensor, slots: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """`[Hkv, N]` float32 mean over each group of ||v W_O[h_q]||_1; see the package docstring."""
    if use_triton(v_buffer):
        return vo_norms_triton(v_buffer, slots, o_proj)
    return vo_norms_ref(v_buffer, slots, o_proj)


def vo_norms_rows(v: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """`[Hkv, T]` norms of value rows not yet in the pool (`v`: `[T, Hkv, D]`, e.g. the rows a forward is
    about to write): the same computation as `vo_norms` over slots holding these rows. No host read and
    shapes fixed by T, so it can run inside a CUDA graph (`sgl_kvevict.cache.slotstats`)."""
    t = v.shape[0]
    if use_triton(v):
        return vo_norms_triton(v, torch.arange(t, device=v.device), o_proj)
    return _ref_chunks(lambda a, b: v[a:b], t, v.shape[1], o_proj, v.device)
