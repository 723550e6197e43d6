"""Window-query capture: the last W post-RoPE queries of each request, per layer.

Attention-based scores (SnapKV, H2O, D2O, CriticalKV) need them; fused attention kernels never expose
attention weights, so we keep the queries and score against the paged keys ourselves. Only requests
whose policy needs them get a ring buffer; for everyone else the hook returns at once.
"""

from __future__ import annotations

import torch


class Ring:
    def __init__(
        self, layers: int, window: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.buf = torch.zeros(layers, window, heads, dim, dtype=dtype, device=device)
        self.count = [0] * layers
        self.window = window

    def push(self, layer: int, q: torch.Tensor) -> None:
        """Append `[t, heads, dim]` queries, keeping the last `window`."""
        t = q.shape[0]
        if t >= self.window:
            self.buf[layer] = q[-self.window :]
            self.count[layer] += t
            return
        pos = self.count[layer] % self.window
        first = min(t, self.window - pos)
        self.buf[layer, pos : pos + first] = q[:first]
        if first < t:
            self.buf[layer, : t - first] = q[first:]
        self.count[layer] += t

    def get(self, layer: int) -> torch.Tensor:
        """`[heads, w, dim]` in arrival order (order does not matter for the mean, but keep it tidy)."""
        n = min(self.count[layer], self.window)
        if n < self.window:
            q = self.buf[layer, :n]
        else:
            pos = self.count[layer] % self.window
            q = torch.cat([self.buf[layer, pos:], self.buf[layer, :pos]])
        return q.transpose(0, 1)


RINGS: dict[int, Ring] = {}  # by req_pool_idx


def ensure(
    row: int, layers: int, window: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    r = RINGS.get(row)
    if r is None or r.window != window:
        RINGS[row] = Ring(layers, window, heads, dim, dtype, device)


def drop(row: int | None) -> None:
    if row is not None:
        RINGS.pop(row, None)


_rows_cache: tuple[int, list[int], list[int] | None] = (-1, [], None)


def _batch_rows(forward_batch) -> tuple[list[int], list[int] | None]:
    global _rows_cache
    key = id(forward_batch)
    if _rows_cache[0] != key:
        rows = forward_batch.req_pool_indices.tolist()
        lens = None
        if not forward_batch.forward_mode.is_decode():
            lens = forward_batch.extend_seq_lens_cpu
            lens = list(lens) if lens is not None else forward_batch.extend_seq_lens.tolist()
        _rows_cache = (key, rows, lens)
    return _rows_cache[1], _rows_cache[2]


def before_attention(layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: copy the window queries of the requests that need them."""
    if not RINGS or q is None:
        return None
    mode = forward_batch.forward_mode
    if not (mode.is_decode() or mode.is_extend()):
        return None
    layer = layer_mod.layer_id
    rows, lens = _batch_rows(forward_batch)
    qv = q.reshape(q.shape[0], layer_mod.tp_q_head_num, layer_mod.head_dim)
    if lens is None:
        for i, row in enumerate(rows):
            ring = RINGS.get(row)
            if ring is not None:
                ring.push(layer, qv[i : i + 1])
        return None
    start = 0
    for row, n in zip(rows, lens, strict=False):
        ring = RINGS.get(row)
        if ring is not None and n > 0:
            lo = max(start, start + n - ring.window)
            ring.push(layer, qv[lo : start + n])
        start += n
    return None
