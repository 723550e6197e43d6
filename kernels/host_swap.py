"""Batched exchange of device KV entries with host-tier columns (recall by swap), and a fetch-only copy.

For each layer l, KV head h and i < r (K and V alike):
    dev[l][dev_slots[l, h, i], h]  <->  host[l, host_cols[l, h, i], h]
`host_swap` exchanges the two rows (the displaced device entry goes to the host column it came from:
the host keeps the same number of columns, the device row keeps its length); `host_fetch` only copies the
host row to the device slot (recall into slots the request owns but that hold nothing yet).

Pairs must be distinct within a (layer, head): each program of the Triton kernel reads both rows before
it writes them, and no other program touches them, so the exchange needs no temporary.

`counts` (`[L, Hkv]` int64, optional) makes the exchange ragged without a host sync: only the first
`counts[l, h]` pairs of each (layer, head) move, the rest are left as they are. Recall swaps a different
number of entries per head (those whose host score beats the displaced one's), so it passes the counts
and keeps the ids rectangular.

Shapes: device buffers per layer `[slots, Hkv, D]` (SGLang's `k_buffer[l]`), host store `[L, cols, Hkv, D]`,
ids `[L, Hkv, r]` int64. One launch per layer, no host sync: sizes come from shapes only.

On a GPU the Triton kernel reads and writes a pinned host store directly (a pinned tensor's pointer is
mapped into the device's address space), so the ids chosen on the device never travel to the host
(checked on an H200: `tests/test_page_scores.py::test_cuda_host_swap_with_a_pinned_host_store`). The
store must be pinned: Triton refuses a pageable one at launch. The torch reference moves ids to each
buffer's device, which syncs when the devices differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pool import flat_rows, write_flat_rows
from .dispatch import next_pow2, use_triton


def _check(
    k_buffers: list[torch.Tensor], host_k: torch.Tensor, dev_slots: torch.Tensor, host_cols: torch.Tensor
) -> None:
    n_layers = len(k_buffers)
    assert host_k.dim() == 4 and host_k.shape[0] == n_layers, "host store must be [L, cols, Hkv, D]"
    assert dev_slots.dim() == 3 and dev_slots.shape == host_cols.shape, "ids must both be [L, Hkv, r]"
    assert dev_slots.shape[0] == n_layers and dev_slots.shape[1] == host_k.shape[2], "ids: wrong L or Hkv"


def _exchange_ref(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    swap: bool,
    counts: torch.Tensor | None = None,
) -> None:
    _check(k_buffers, host_k, dev_slots, host_cols)
    hkv = dev_slots.shape[1]
    if dev_slots.shape[2] == 0 or not k_buffers:
        return
    dev = k_buffers[0].device
    d_slots = dev_slots.to(dev)
    h_cols = host_cols.to(host_k.device)
    d_heads = torch.arange(hkv, device=dev)[:, None]
    h_heads = torch.arange(hkv, device=host_k.device)[:, None]
    moves = None  # [L, Hkv, r, 1] on the device: which pairs move (None: all)
    if counts is not None:
        moves = (torch.arange(dev_slots.shape[2], device=dev) < counts.to(dev).unsqueeze(-1)).unsqueeze(-1)
    for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        d_ids, h_ids = d_slots[layer] * hkv + d_heads, h_cols[layer] * hkv + h_heads  # K and V alike
        for buf, hbuf in ((kb, host_k), (vb, host_v)):
            h_row = flat_rows(hbuf[layer], h_ids).to(dev)  # [Hkv, r, D] copies
            d_row = flat_rows(buf, d_ids) if swap or moves is not None else None
            new_d = h_row if moves is None else torch.where(moves[layer], h_row, d_row)
            if swap:
                new_h = d_row if moves is None else torch.where(moves[layer], d_row, h_row)
                write_flat_rows(hbuf[layer], h_ids, new_h.to(hbuf.device))
            write_flat_rows(buf, d_ids, new_d)


def host_swap_ref(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Torch reference: gather both sides (copies), then write both, per layer."""
    _exchange_ref(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, True, counts)


def host_fetch_ref(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Torch reference of the copy-only recall: host rows to device slots, the host left as it was."""
    _exchange_ref(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, False, counts)


@triton.jit
def _swap_kernel(
    k_ptr, v_ptr, hk_ptr, hv_ptr, slot_ptr, col_ptr, cnt_ptr, R, D,
    s_s, s_h, hs_c, hs_h,
    SWAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (KV head, block of r): load the device and the host rows, write them crossed."""
    h = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < tl.load(cnt_ptr + h)  # counts[l, h] <= R: the pairs of this head that move
    m2 = mask_r[:, None] & (offs_d < D)[None, :]
    slot = tl.load(slot_ptr + h * R + offs_r, mask=mask_r, other=0)
    col = tl.load(col_ptr + h * R + offs_r, mask=mask_r, other=0)
    dptr = slot[:, None] * s_s + h * s_h + offs_d[None, :]
    hptr = col[:, None] * hs_c + h * hs_h + offs_d[None, :]
    hk = tl.load(hk_ptr + hptr, mask=m2)
    hv = tl.load(hv_ptr + hptr, mask=m2)
    if SWAP:
        dk = tl.load(k_ptr + dptr, mask=m2)
        dv = tl.load(v_ptr + dptr, mask=m2)
        tl.store(hk_ptr + hptr, dk.to(hk.dtype), mask=m2)
        tl.store(hv_ptr + hptr, dv.to(hv.dtype), mask=m2)
    tl.store(k_ptr + dptr, hk.to(k_ptr.dtype.element_ty), mask=m2)
    tl.store(v_ptr + dptr, hv.to(v_ptr.dtype.element_ty), mask=m2)


def _exchange_triton(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    swap: bool,
    counts: torch.Tensor | None = None,
) -> None:
    _check(k_buffers, host_k, dev_slots, host_cols)
    n_layers, hkv, r = dev_slots.shape
    if r == 0 or not k_buffers:
        return
    assert host_k.stride() == host_v.stride() and host_k.stride(3) == 1, "host K/V must share a dense layout"
    slots = dev_slots.to(device=k_buffers[0].device, dtype=torch.int64).contiguous()
    cols = host_cols.to(device=k_buffers[0].device, dtype=torch.int64).contiguous()
    if counts is None:
        cnt = torch.full((n_layers, hkv), r, dtype=torch.int64, device=slots.device)
    else:
        cnt = counts.to(device=slots.device, dtype=torch.int64).clamp(0, r).contiguous()
    br = 64
    for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        assert kb.stride() == vb.stride() and kb.stride(2) == 1, "device K/V must share a dense layout"
        d = kb.shape[2]
        _swap_kernel[(hkv, triton.cdiv(r, br))](
            kb, vb, host_k[layer], host_v[layer], slots[layer], cols[layer], cnt[layer], r, d,
            kb.stride(0), kb.stride(1), host_k.stride(1), host_k.stride(2),
            SWAP=swap, BLOCK_R=br, BLOCK_D=next_pow2(d),
        )  # fmt: skip


def host_swap_triton(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Triton version: one launch per layer, K and V together."""
    _exchange_triton(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, True, counts)


def host_fetch_triton(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Triton version of the copy-only recall."""
    _exchange_triton(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, False, counts)


def host_swap(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Exchange `r` device entries with `r` host columns per (layer, head), in place; see the docstring."""
    if k_buffers and use_triton(k_buffers[0]):
        host_swap_triton(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, counts)
    else:
        host_swap_ref(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, counts)


def host_fetch(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    dev_slots: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    host_cols: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Copy `r` host columns per (layer, head) into device slots, in place; the host is unchanged."""
    if k_buffers and use_triton(k_buffers[0]):
        host_fetch_triton(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, counts)
    else:
        host_fetch_ref(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, counts)
