"""CPU-friendly gathers from the paged pool for the torch references.

`index_select` on the slot axis is ~10x faster than `buf[slots]` advanced indexing on CPU, and per
(slot, head) rows go through a flat `[pool * H, D]` view. Both return copies, which is what the
gather-then-write semantics of compaction and merging rely on.
"""

from __future__ import annotations

import torch


def region(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[N, H, D]` copy of the region's rows."""
    return buf.index_select(0, slots)


def _flat(buf: torch.Tensor) -> torch.Tensor | None:
    """`[pool * H, D]` view when the pool's first two dims are dense (SGLang's buffers are)."""
    if buf.stride(1) == buf.shape[2] * buf.stride(2) and buf.stride(0) == buf.shape[1] * buf.stride(1):
        return buf.view(-1, buf.shape[2])
    return None


def head_rows(buf: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Copy of buf[slots, heads] (broadcast index tensors) with a trailing D axis."""
    return flat_rows(buf, slots * buf.shape[1] + heads)


def write_head_rows(buf: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor, rows: torch.Tensor) -> None:
    """buf[slots, heads] = rows, in place (index pairs must be distinct)."""
    write_flat_rows(buf, slots * buf.shape[1] + heads, rows)


def flat_rows(buf: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Copy of the rows `ids` (`slot * H + head`, any shape) of a `[slots, H, D]` pool, with a trailing D
    axis: where many gathers share their (slot, head) pairs, the ids are computed once."""
    flat = _flat(buf)
    if flat is None:
        return buf[ids // buf.shape[1], ids % buf.shape[1]]
    return flat.index_select(0, ids.reshape(-1)).view(*ids.shape, buf.shape[2])


def write_flat_rows(buf: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """The rows `ids` (`slot * H + head`) of a `[slots, H, D]` pool = `rows`, in place (ids distinct, or
    their rows equal)."""
    flat = _flat(buf)
    if flat is None:
        buf[ids // buf.shape[1], ids % buf.shape[1]] = rows.to(buf.dtype)
        return
    flat.index_copy_(0, ids.reshape(-1), rows.reshape(ids.numel(), buf.shape[2]).to(buf.dtype))
