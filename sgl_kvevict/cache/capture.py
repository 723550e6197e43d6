"""Window-query capture: the last W post-RoPE queries of each request that needs them, per layer.

Attention-based scores (SnapKV, H2O, D2O, CriticalKV) need them; fused attention kernels never expose
attention weights, so we keep the queries and score against the paged keys ourselves.

Graph-safe by construction: one buffer `[slots + 1, layers, W, q_heads, D]` is allocated once, before
any CUDA graph is captured, and the hook writes into it with one `index_put_` per layer whose indices
are computed on the device from the batch's own tensors (`req_pool_indices`, `positions`, for extend
`extend_seq_lens`/`extend_start_loc`) and a device map row -> capture slot. No Python branch depends on
the step's data and nothing is read back, so a replayed graph performs the same writes. Rows without a
capture slot (other policies; padded rows of a graph batch, which use row 0, a row SGLang never hands
to a request) write to the extra dummy slot `slots`, which nobody reads.

The ring invariant: the query of logical position p of a request sits at `[slot, layer, p % (window + 1)]`
(positions are logical: evicted tokens still count, see `hooks.init_new`), so the last `window`
positions are always the ones present, whatever the mix of prefill chunks and decode steps. The ring
holds one query more than the window: under the overlap scheduler a request that finishes has one more
decode step in flight, whose query (position `length`) lands before the request's last compression reads
its window (positions `length - window .. length - 1`); with `window + 1` places it cannot overwrite
the oldest of them, so overlap on and off score with the same queries. The host
knows from which position a request's capture started (`Entry.start`), so "is the window full" and
"in which order are the queries" are host arithmetic on the request's logical length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl_kvevict.cache import context

if TYPE_CHECKING:
    from sgl_kvevict.cache.context import KvEvictContext

logger = logging.getLogger("sgl_kvevict")


@dataclass
class Entry:
    """A request row's place in the store: its slot, its policy's window and first captured position."""

    slot: int
    window: int
    start: int

    @property
    def ring(self) -> int:
        """Places in the ring: one more than the window (see the module docstring)."""
        return self.window + 1


class Store:
    """The preallocated capture buffer and the row -> slot map (both on the queries' device)."""

    def __init__(
        self,
        rows: int,
        layers: int,
        window: int,
        heads: int,
        dim: int,
        slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        start_layer: int = 0,
    ) -> None:
        self.window, self.slots, self.start_layer = window, slots, start_layer
        self.heads, self.dim, self.layers = heads, dim, layers
        self.buf = torch.zeros(slots + 1, layers, window + 1, heads, dim, dtype=dtype, device=device)
        self.slot_of_row = torch.full((rows,), slots, dtype=torch.int64, device=device)
        self.win_of_row = torch.ones(rows, dtype=torch.int64, device=device)
        self.free = list(range(slots - 1, -1, -1))
        self.entries: dict[int, Entry] = {}

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def ensure(self, row: int, window: int, start: int) -> bool:
        """A slot for `row`, kept across chunked-prefill chunks; False when none is free or the window
        does not fit the buffer (the caller then leaves the request uncompressed)."""
        e = self.entries.get(row)
        if e is not None and e.window == window:
            return True
        if e is not None:
            self.drop(row)
        if window > self.window or not self.free or not 0 <= row < self.slot_of_row.shape[0]:
            return False
        e = Entry(self.free.pop(), window, start)
        self.entries[row] = e
        self.slot_of_row[row] = e.slot  # a host-to-device write of one element, ordered before the forward
        self.win_of_row[row] = e.ring
        return True

    def drop(self, row: int) -> None:
        e = self.entries.pop(row, None)
        if e is None:
            return
        self.slot_of_row[row] = self.slots
        self.win_of_row[row] = 1
        self.free.append(e.slot)

    def clear(self) -> None:
        """Every slot free again (tests and benchmarks that reuse one store)."""
        for row in list(self.entries):
            self.drop(row)
        self.free = list(range(self.slots - 1, -1, -1))

    def count(self, row: int, length: int) -> int:
        """Queries present for a request whose logical length is `length` (at most its window)."""
        e = self.entries.get(row)
        return 0 if e is None else max(0, min(e.window, length - e.start))

    def order(self, row: int, length: int, n: int) -> list[int]:
        """Buffer indices of the last `n` queries, oldest first (positions length-n .. length-1)."""
        ring = self.entries[row].ring
        return [(length - n + i) % ring for i in range(n)]

    def get(self, row: int, layer: int, length: int) -> torch.Tensor:
        """`[heads, n, dim]`: the last n = `count` queries of one layer, oldest first."""
        n = self.count(row, length)
        if n == 0:
            return torch.empty(self.heads, 0, self.dim, dtype=self.buf.dtype, device=self.buf.device)
        idx = torch.tensor(self.order(row, length, n), dtype=torch.int64).to(
            self.buf.device, non_blocking=True
        )
        return self.buf[self.entries[row].slot, layer].index_select(0, idx).transpose(0, 1)

    def stacked(self, rows: list[int], lengths: list[int], w: int) -> torch.Tensor:
        """`[R, layers, w, heads, dim]`: every row's last `w` queries of every layer, oldest first, in one
        gather (the rows' windows must be full). Indices come from host integers."""
        slots = torch.tensor([self.entries[r].slot for r in rows], dtype=torch.int64)
        order = torch.tensor(
            [self.order(r, n, w) for r, n in zip(rows, lengths, strict=True)], dtype=torch.int64
        )
        dev = self.buf.device
        picked = self.buf.index_select(0, slots.to(dev, non_blocking=True))  # [R, L, W, Hq, D]
        R, L = len(rows), self.layers  # noqa: N806
        idx = order.to(dev, non_blocking=True).view(R, 1, w, 1, 1).expand(R, L, w, self.heads, self.dim)
        return picked.gather(2, idx)

    def put(self, row: int, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Write `[t, heads, dim]` queries of logical `positions` for one row (what the hook does for a
        batch; used where no forward runs, e.g. tests on real pools)."""
        e = self.entries[row]
        keep = positions[-e.window :]
        self.buf[e.slot, layer].index_copy_(
            0, keep.to(torch.int64) % e.ring, q[-e.window :].to(self.buf.dtype)
        )

    def write(self, layer: int, q: torch.Tensor, forward_batch: Any) -> None:
        """The batch's queries of one layer into the store: one `index_put_`, device indices only."""
        rows = forward_batch.req_pool_indices
        pos = forward_batch.positions
        qv = q.reshape(q.shape[0], self.heads, self.dim)
        slot = self.slot_of_row[rows]
        win = self.win_of_row[rows]
        if not forward_batch.forward_mode.is_decode():
            lens = forward_batch.extend_seq_lens
            tok = torch.repeat_interleave(
                torch.arange(rows.shape[0], device=rows.device), lens, output_size=qv.shape[0]
            )
            slot, win = slot[tok], win[tok]
            within = torch.arange(qv.shape[0], device=rows.device) - forward_batch.extend_start_loc[tok]
            # only a row's last `ring` tokens may land: earlier ones share their buffer index
            slot = torch.where(within >= lens[tok] - win, slot, self.slots)
        layer_idx = torch.full_like(slot, layer - self.start_layer)
        self.buf.index_put_((slot, layer_idx, pos.to(torch.int64) % win), qv.to(self.buf.dtype))


def ensure(ctx: KvEvictContext, row: int, window: int, start: int) -> bool:
    return ctx.capture is not None and ctx.capture.ensure(row, window, start)


def drop(ctx: KvEvictContext, row: int | None) -> None:
    if row is not None and ctx.capture is not None:
        ctx.capture.drop(row)


def live(ctx: KvEvictContext) -> int:
    return 0 if ctx.capture is None else len(ctx.capture.entries)


def count(ctx: KvEvictContext, row: int, length: int) -> int:
    return 0 if ctx.capture is None else ctx.capture.count(row, length)


def build(
    ctx: KvEvictContext,
    rows: int,
    layers: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device: Any,
    start_layer: int = 0,
) -> Store | None:
    """The context's store, built once (None when its `capture_conf` says no request captures). Called
    when the plugin attaches to the scheduler, or by the first forward if that runs first (a CUDA graph
    warm-up)."""
    if ctx.capture is not None or ctx.capture_conf is None:
        return ctx.capture
    window, slots = ctx.capture_conf
    store = Store(rows, layers, window, heads, dim, min(slots, max(1, rows - 1)), dtype, device, start_layer)
    ctx.capture = store
    logger.info(
        "sgl-kvevict: window-query capture buffer: %d slots x %d layers x %d queries x %d heads x %d (%.1f MiB)",
        store.slots,
        layers,
        window,
        heads,
        dim,
        store.nbytes / (1 << 20),
    )
    return store


def _pools(forward_batch: Any) -> tuple[Any, Any]:
    """SGLang's request and KV pools during a forward (the attention backend holds them in 0.5.23)."""
    from sglang.srt.model_executor import forward_context as fc

    if fc.has_forward_context():
        backend = fc.get_attn_backend()
        return backend.req_to_token_pool, backend.token_to_kv_pool
    return forward_batch.req_to_token_pool, forward_batch.token_to_kv_pool


def before_attention(layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: every row's queries into the store (see the module)."""
    if q is None:
        return None
    mode = forward_batch.forward_mode
    if not (mode.is_decode() or mode.is_extend()):
        return None
    r2t, pool = _pools(forward_batch)
    ctx = context.for_pool(r2t)
    store = ctx.capture
    if store is None:
        if ctx.capture_conf is None:
            return None
        store = build(
            ctx,
            int(r2t.req_to_token.shape[0]),
            int(pool.layer_num),
            int(layer_mod.tp_q_head_num),
            int(layer_mod.head_dim),
            q.dtype,
            q.device,
            int(getattr(pool, "start_layer", 0) or 0),
        )
    store.write(layer_mod.layer_id, q, forward_batch)
    return None
