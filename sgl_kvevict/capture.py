"""Window-query capture: the last W post-RoPE queries of each request, per layer.

Attention-based scores (SnapKV, H2O, D2O, CriticalKV) need them; fused attention kernels never expose
attention weights, so we keep the queries and score against the paged keys ourselves. Only requests
whose policy needs them get a ring buffer; for everyone else the hook returns at once.

Order matters: the scorer applies a causal mask inside the window (query i of the window must not see
the window's later keys), so `Ring.get` returns the queries in arrival order. The ring keeps one
invariant whatever the push sizes: the query with arrival index j (0-based, per layer) lives at
`buf[j % W]`, so the next write goes to `count % W` and the oldest kept query sits there too.
"""

from __future__ import annotations

from typing import Any

import torch

ROWS_ATTR = "_kvevict_capture_rows"  # per-forward-batch (rows, extend lens), set on the batch itself


class Ring:
    """Last `window` queries per layer of one request. The buffer is allocated at the first push, in the
    query's own dtype and device (a KV cache in fp8 must not quantize the queries)."""

    def __init__(self, layers: int, window: int, heads: int, dim: int) -> None:
        self.buf: torch.Tensor | None = None  # [layers, window, heads, dim]
        self.count = [0] * layers
        self.window = window
        self.heads = heads
        self.dim = dim

    def push(self, layer: int, q: torch.Tensor) -> None:
        """Append `[t, heads, dim]` queries (any t), keeping the last `window`."""
        t = int(q.shape[0])
        if t == 0:
            return
        if self.buf is None:
            self.buf = torch.zeros(
                len(self.count), self.window, self.heads, self.dim, dtype=q.dtype, device=q.device
            )
        w = self.window
        m = min(t, w)  # only the last m of this push can survive
        start = (self.count[layer] + t - m) % w  # slot of arrival index count + t - m
        first = min(m, w - start)
        tail = q[t - m :]
        self.buf[layer, start : start + first] = tail[:first]
        if first < m:
            self.buf[layer, : m - first] = tail[first:]
        self.count[layer] += t

    def get(self, layer: int) -> torch.Tensor:
        """`[heads, n, dim]`, n = min(count, window): the last n queries, oldest first."""
        n = min(self.count[layer], self.window)
        if self.buf is None or n == 0:
            return torch.empty(self.heads, 0, self.dim)
        if self.count[layer] <= self.window:
            q = self.buf[layer, :n]
        else:
            pos = self.count[layer] % self.window
            q = torch.cat([self.buf[layer, pos:], self.buf[layer, :pos]])
        return q.transpose(0, 1)


RINGS: dict[int, Ring] = {}  # by req_pool_idx


def ensure(row: int, layers: int, window: int, heads: int, dim: int, *_pool_dtype_device: Any) -> None:
    """A ring for `row` (kept across chunked-prefill chunks). Extra arguments (the KV pool's dtype and
    device) are accepted and ignored: the buffer follows the queries themselves."""
    r = RINGS.get(row)
    if r is None or r.window != window or len(r.count) != layers:
        RINGS[row] = Ring(layers, window, heads, dim)


def drop(row: int | None) -> None:
    if row is not None:
        RINGS.pop(row, None)


def _batch_rows(forward_batch: Any) -> tuple[list[int], list[int] | None]:
    """Rows of the batch and (extend only) each row's new-token count, computed once per forward batch.

    Kept on the batch object itself: a cache keyed by `id(batch)` would hand a new batch the rows of a
    dead one whose address CPython reused.
    """
    cached = getattr(forward_batch, ROWS_ATTR, None)
    if cached is not None:
        return cached
    rows = forward_batch.req_pool_indices.tolist()
    lens = None
    if not forward_batch.forward_mode.is_decode():
        lens = forward_batch.extend_seq_lens_cpu
        lens = list(lens) if lens is not None else forward_batch.extend_seq_lens.tolist()
    cached = (rows, lens)
    setattr(forward_batch, ROWS_ATTR, cached)
    return cached


def before_attention(layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: copy the window queries of the requests that need them.

    Decode: one query per row, in row order. Extend: the rows' new tokens are concatenated in row order,
    `lens[i]` each; only the last `window` of each row's slice can survive, so only those are copied.
    """
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
    if len(lens) != len(rows):
        raise ValueError(f"capture: {len(rows)} rows but {len(lens)} extend lengths")
    start = 0
    for row, n in zip(rows, lens, strict=True):
        ring = RINGS.get(row)
        if ring is not None and n > 0:
            lo = max(start, start + n - ring.window)
            ring.push(layer, qv[lo : start + n])
        start += n
    return None
