"""Window-query capture (pure tensors): the store returns each request's last W queries oldest first for
every mix of prefill chunks and decode steps, rows without a slot write only to the dummy slot, the
hook reads nothing back from the device (it must replay inside a CUDA graph), and the stored dtype is
the queries'."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sgl_kvevict.cache import capture, context
from sgl_kvevict.tools.pools import SyncCounter

H, D = 2, 3
ROWS, SLOTS = 8, 4


@dataclass
class Mode:
    decode: bool

    def is_decode(self) -> bool:
        return self.decode

    def is_extend(self) -> bool:
        return not self.decode


@dataclass
class Layer:
    layer_id: int
    tp_q_head_num: int = H
    head_dim: int = D


class Batch:
    """The ForwardBatch fields the hook reads, as SGLang builds them (device tensors)."""

    def __init__(self, rows: list[int], positions: list[int], lens: list[int] | None) -> None:
        self.req_pool_indices = torch.tensor(rows, dtype=torch.int64)
        self.positions = torch.tensor(positions, dtype=torch.int64)
        self.forward_mode = Mode(decode=lens is None)
        if lens is not None:
            self.extend_seq_lens = torch.tensor(lens, dtype=torch.int32)
            self.extend_start_loc = torch.cumsum(self.extend_seq_lens, 0) - self.extend_seq_lens


def new_store(window: int, layers: int = 2, dtype: torch.dtype = torch.float32) -> capture.Store:
    return capture.Store(ROWS, layers, window, H, D, SLOTS, dtype, "cpu")


def encode(row: int, pos: int) -> float:
    return float(row * 1000 + pos)


def step(store: capture.Store, layers: int, items: list[tuple[int, int, int]], decode: bool) -> None:
    """One forward: `items` = (row, first position, tokens) in batch order; queries encode (row, pos)."""
    rows, positions, vals = [], [], []
    for row, start, n in items:
        rows.append(row)
        for p in range(start, start + n):
            positions.append(p)
            vals.append(encode(row, p))
    q = torch.tensor(vals).view(-1, 1).expand(-1, H * D).contiguous()
    fb = Batch(rows, positions, None if decode else [n for _, _, n in items])
    for layer in range(layers):
        store.write(layer, q, fb)


def held(store: capture.Store, row: int, layer: int, length: int) -> list[int]:
    q = store.get(row, layer, length)
    assert q.shape[0] == H and q.shape[2] == D
    return [int(x) for x in q[0, :, 0].tolist()]


def drive(window: int, chunks: list[int], decode_steps: int, start: int = 0, layers: int = 2) -> None:
    """Row 3 prefills in `chunks` (from logical position `start`: a prefix hit) then decodes, batched with
    row 5 (always decoding) and row 6 (no capture slot); after every forward row 3 and 5 hold the last
    `window` of their positions, oldest first, and row 6's queries are nowhere."""
    store = new_store(window, layers)
    assert store.ensure(3, window, start) and store.ensure(5, window, 0)
    store.write(0, torch.zeros(0, H * D), Batch([5], [], [0]))  # an empty extend writes nothing
    pos3, pos5 = start, 0
    steps: list[tuple[list[tuple[int, int, int]], bool]] = [([(3, 0, c), (6, 0, 2)], False) for c in chunks]
    steps += [([], True)] * decode_steps
    for items, decode in steps:
        if decode:
            step(store, layers, [(5, pos5, 1), (3, pos3, 1), (6, 50, 1)], True)
            pos3 += 1
        else:
            row, _, c = items[0]
            step(store, layers, [(row, pos3, c), (6, 9, 2)], False)
            pos3 += c
            step(store, layers, [(5, pos5, 1)], True)
        pos5 += 1
        for layer in range(layers):
            assert held(store, 3, layer, pos3) == [3000 + p for p in range(max(start, pos3 - window), pos3)]
            assert held(store, 5, layer, pos5) == [5000 + p for p in range(max(0, pos5 - window), pos5)]
        live = store.buf[: store.slots].flatten().tolist()
        assert not any(6000 <= x < 7000 for x in live), "a row without a slot wrote into a live slot"


@pytest.mark.parametrize("window", [1, 2, 4, 5, 32])
def test_prefill_sizes_relative_to_window_then_decode(window):
    w = window
    for first in sorted({1, max(1, w - 1), w, w + 1, 2 * w + 3}):
        drive(w, [first], 2 * w + 3)
        for second in sorted({1, max(1, w - 1), w, w + 1, 2 * w + 3}):
            drive(w, [first, second, 1, second], 3)


def test_mixed_chunks_exhaustive_small():
    for chunks in itertools.product([1, 3, 4, 5, 11], repeat=3):
        drive(4, list(chunks), 5, layers=1)


def test_capture_that_starts_past_a_prefix_hit():
    drive(4, [2, 1], 6, start=37)
    drive(8, [3], 10, start=5)


def test_window_smaller_than_the_buffer_and_layers_independent():
    store = capture.Store(ROWS, 3, 8, H, D, SLOTS, torch.float32, "cpu")
    assert store.ensure(2, 4, 0)
    q = torch.arange(10, dtype=torch.float32).view(-1, 1).expand(-1, H * D).contiguous()
    store.write(1, q, Batch([2], list(range(10)), [10]))
    assert held(store, 2, 1, 10) == [6, 7, 8, 9]
    assert held(store, 2, 0, 10) == [0, 0, 0, 0]  # layer 0 never written (zeros), layer 1 only


def test_stacked_equals_get_for_every_row():
    store = new_store(4, layers=3)
    for row, start in ((1, 0), (4, 9), (7, 2)):
        assert store.ensure(row, 4, start)
    step(store, 3, [(1, 0, 6), (4, 9, 5), (7, 2, 4)], False)
    step(store, 3, [(7, 6, 1), (1, 6, 1), (4, 14, 1)], True)
    lens = {1: 7, 4: 15, 7: 7}
    got = store.stacked([4, 1, 7], [lens[4], lens[1], lens[7]], 4)  # [R, L, W, H, D]
    for r, row in enumerate((4, 1, 7)):
        for layer in range(3):
            assert torch.equal(got[r, layer], store.get(row, layer, lens[row]).transpose(0, 1))


def test_slots_run_out_and_come_back():
    store = new_store(4)
    assert all(store.ensure(row, 4, 0) for row in range(1, 1 + SLOTS))
    assert not store.ensure(6, 4, 0)  # all slots in use
    assert not store.ensure(1 + SLOTS, 8, 0)  # a window above the buffer's
    store.drop(2)
    assert store.ensure(6, 4, 0) and store.slot_of_row[6] != store.slots
    assert int(store.slot_of_row[2]) == store.slots and int(store.win_of_row[2]) == 1
    store.ensure(6, 4, 5)  # next prefill chunk: the entry and its start are kept
    assert store.entries[6].start == 0
    store.ensure(6, 2, 5)  # another window: a fresh entry
    assert store.entries[6].window == 2 and store.entries[6].start == 5
    store.clear()
    assert not store.entries and len(store.free) == SLOTS and int(store.slot_of_row.min()) == store.slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_queries_keep_their_dtype(dtype):
    """The store holds the model's query dtype, not the KV pool's (an fp8 pool would ruin the queries)."""
    store = new_store(4, layers=1, dtype=dtype)
    assert store.ensure(1, 4, 0)
    q = torch.randn(5, H, D, dtype=torch.float32).to(dtype)
    store.write(0, q.reshape(5, H * D), Batch([1], list(range(5)), [5]))
    got = store.get(1, 0, 5)
    assert got.dtype == dtype
    assert torch.equal(got, q[-4:].transpose(0, 1))  # bit-exact: no round trip through another dtype


@pytest.mark.parametrize("decode", [True, False])
def test_the_hook_reads_nothing_back(decode):
    """Graph-safe: a decode or extend write makes no host synchronisation (no `.tolist()`, `.item()`,
    data-dependent shape), so the same kernels replay in a CUDA graph with new batch contents."""
    store = new_store(4)
    for row in (1, 2, 3):
        store.ensure(row, 4, 0)
    items = [(1, 7, 1), (2, 3, 1), (5, 0, 1)] if decode else [(1, 0, 6), (2, 0, 3), (5, 0, 2)]
    with SyncCounter() as counter:
        step(store, 2, items, decode)
    assert counter.counts == {}, counter.counts


def _sglang_pools(rows: int = 6, layers: int = 3) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    return ReqToTokenPool(rows, 64, "cpu", False), MHATokenToKVPool(
        128, 1, torch.float32, 1, D, layers, "cpu", False
    )


def _forward(r2t: Any, kv: Any, layer: int = 2) -> None:
    """One BEFORE-attention call of a decode forward over SGLang's pools `r2t`, `kv` (row 1, position 0)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend = SimpleNamespace(req_to_token_pool=r2t, token_to_kv_pool=kv)
    with forward_context(ForwardContext(attn_backend=backend)):
        q = torch.ones(1, H * D, dtype=torch.bfloat16)
        capture.before_attention(Layer(layer), q, None, None, Batch([1], [0], None))


def test_hook_without_a_store_config_does_nothing():
    r2t, kv = _sglang_pools()
    ctx = context.for_pool(r2t)
    ctx.capture_conf = None
    _forward(r2t, kv)
    assert ctx.capture is None


def test_first_forward_builds_the_store_from_sglangs_pools():
    """With CUDA graphs the model runner captures (after a warm-up forward) before the plugin attaches
    to the scheduler: the first forward must build the store from SGLang's own pools, in the context
    the tree over those pools then adopts."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_kvevict.cache.tree import KvEvictRadixCache

    r2t, kv = _sglang_pools()
    ctx = context.for_pool(r2t)
    ctx.capture_conf = (4, 2)
    _forward(r2t, kv)
    store = ctx.capture
    assert store is not None and store.buf.shape == (3, 3, 5, H, D) and store.buf.dtype == torch.bfloat16
    assert store.slot_of_row.shape[0] == r2t.req_to_token.shape[0]
    assert float(store.buf[store.slots].abs().sum()) > 0  # the warm-up's write went to the dummy slot
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(128, torch.float32, "cpu", kv, False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
    )
    assert KvEvictRadixCache(params, 6).ctx is ctx


def test_two_servers_in_one_process_keep_their_own_stores():
    """Two row pools (two servers in one process, e.g. two offline engines or two test ranks) get two
    contexts: a forward over one builds and writes only its own store."""
    (r2t_a, kv_a), (r2t_b, kv_b) = _sglang_pools(), _sglang_pools(rows=8, layers=2)
    a, b = context.for_pool(r2t_a), context.for_pool(r2t_b)
    assert a is not b
    a.capture_conf, b.capture_conf = (4, 2), (4, 2)
    _forward(r2t_a, kv_a)
    assert a.capture is not None and b.capture is None
    _forward(r2t_b, kv_b, layer=1)
    assert b.capture is not None and b.capture is not a.capture
    assert b.capture.buf.shape[1] == 2 and a.capture.buf.shape[1] == 3  # each from its own pools


@pytest.mark.parametrize("window", [1, 4, 32])
def test_an_in_flight_step_past_the_end_leaves_the_window_whole(window):
    """Under overlap a finishing request has one more decode step in flight (position `length`): its
    query must not overwrite the oldest of the `window` queries its last compression reads."""
    store = new_store(window)
    assert store.ensure(3, window, 0)
    length = 3 * window + 2
    step(store, 2, [(3, 0, length)], False)
    before = held(store, 3, 0, length)
    step(store, 2, [(3, length, 1)], True)  # the in-flight step, written before the compression reads
    assert held(store, 3, 0, length) == before == [3000 + p for p in range(length - window, length)]
