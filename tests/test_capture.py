"""Window-query capture (pure tensors): the ring returns the last W queries in arrival order for every
push pattern, the batch hook slices each row's own queries, and the stored dtype is the query's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from sgl_kvevict import capture

H, D = 2, 3


def queries(start: int, t: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[t, H, D]` queries whose every entry encodes its arrival index (start..start+t-1)."""
    idx = torch.arange(start, start + t, dtype=torch.float32)
    return idx.view(t, 1, 1).expand(t, H, D).to(dtype).clone()


def arrival(ring: capture.Ring, layer: int) -> list[int]:
    """The arrival indices `ring.get(layer)` holds, in the order it returns them."""
    q = ring.get(layer)
    assert q.shape[0] == H and q.shape[2] == D
    return [int(x) for x in q[0, :, 0].tolist()]


def run_pushes(window: int, sizes: list[int], layers: int = 2) -> None:
    ring = capture.Ring(layers, window, H, D)
    ref: list[int] = []  # naive reference: every query ever pushed
    for size in sizes:
        for layer in range(layers):
            ring.push(layer, queries(len(ref), size))
        ref.extend(range(len(ref), len(ref) + size))
        for layer in range(layers):
            assert arrival(ring, layer) == ref[-window:], (window, sizes, layer)


@pytest.mark.parametrize("window", [1, 2, 4, 5, 32])
def test_every_push_size_relative_to_window(window):
    w = window
    for first in sorted({1, max(1, w - 1), w, w + 1, 2 * w + 3}):
        # a prefill of `first` tokens, then decode pushes of 1 (crossing the wrap several times)
        run_pushes(w, [first] + [1] * (2 * w + 3))
        for second in sorted({1, max(1, w - 1), w, w + 1, 2 * w + 3}):
            run_pushes(w, [first, second, 1, second, first])


def test_bug_report_case_prefill_not_multiple_of_window():
    ring = capture.Ring(1, 4, H, D)
    ring.push(0, queries(0, 10))
    assert arrival(ring, 0) == [6, 7, 8, 9]
    ring.push(0, queries(10, 1))
    assert arrival(ring, 0) == [7, 8, 9, 10]


def test_mixed_sequences_exhaustive_small():
    for sizes in itertools.product([1, 3, 4, 5, 11], repeat=4):
        run_pushes(4, list(sizes), layers=1)


def test_layers_are_independent():
    ring = capture.Ring(3, 4, H, D)
    ring.push(1, queries(0, 6))
    assert arrival(ring, 0) == [] and arrival(ring, 2) == []
    assert arrival(ring, 1) == [2, 3, 4, 5]


def test_empty_ring_and_empty_push():
    ring = capture.Ring(2, 4, H, D)
    ring.push(0, queries(0, 0))
    assert ring.buf is None
    assert ring.get(0).shape == (H, 0, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_queries_keep_their_dtype(dtype):
    """The ring follows the queries' dtype, not the KV pool's (an fp8 pool would ruin the queries)."""
    capture.RINGS.clear()
    try:
        capture.ensure(0, 2, 4, H, D, torch.float8_e4m3fn, torch.device("cpu"))
        ring = capture.RINGS[0]
        q = torch.randn(5, H, D, dtype=torch.float32).to(dtype)
        ring.push(0, q)
        assert ring.buf is not None and ring.buf.dtype == dtype
        got = ring.get(0)
        assert got.dtype == dtype
        assert torch.equal(got, q[-4:].transpose(0, 1))  # bit-exact: no round trip through another dtype
    finally:
        capture.RINGS.clear()


def test_ensure_keeps_the_ring_across_chunks_and_replaces_on_new_window():
    capture.RINGS.clear()
    try:
        capture.ensure(7, 1, 4, H, D)
        ring = capture.RINGS[7]
        ring.push(0, queries(0, 3))
        capture.ensure(7, 1, 4, H, D)  # next prefill chunk of the same request
        assert capture.RINGS[7] is ring
        capture.ensure(7, 1, 8, H, D)  # another window: a fresh ring
        assert capture.RINGS[7] is not ring and capture.RINGS[7].count == [0]
        capture.drop(7)
        assert 7 not in capture.RINGS
    finally:
        capture.RINGS.clear()


# -- the batch hook, driven with small stand-ins for SGLang's ForwardBatch and RadixAttention ---------


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
    """Attributes the hook reads; a plain object, so the hook may set its per-batch cache on it."""

    def __init__(self, rows: list[int], lens: list[int] | None) -> None:
        self.req_pool_indices = torch.tensor(rows)
        self.forward_mode = Mode(decode=lens is None)
        self.extend_seq_lens_cpu = lens
        self.extend_seq_lens = None if lens is None else torch.tensor(lens)


def drive(batches: list[tuple[list[int], list[int] | None]], window: int, layers: int = 2) -> None:
    """Run the hook over a batch sequence; each row's queries encode (row, arrival index)."""
    capture.RINGS.clear()
    ref: dict[int, list[int]] = {}
    try:
        for rows, lens in batches:
            for row in rows:
                if row not in ref:  # joins: the scheduler creates its ring after allocation
                    capture.ensure(row, layers, window, H, D)
                    ref[row] = []
            for row in list(ref):
                if row not in rows and row not in capture.RINGS:
                    del ref[row]
            counts = lens if lens is not None else [1] * len(rows)
            vals: list[int] = []
            for row, n in zip(rows, counts, strict=True):
                new = [row * 1000 + len(ref[row]) + i for i in range(n)]
                ref[row].extend(new)
                vals.extend(new)
            q = torch.tensor(vals, dtype=torch.float32).view(-1, 1).expand(-1, H * D).contiguous()
            fb = Batch(rows, lens)
            for layer in range(layers):
                capture.before_attention(Layer(layer), q, None, None, fb)
            for row in rows:
                for layer in range(layers):
                    got = [int(x) for x in capture.RINGS[row].get(layer)[0, :, 0].tolist()]
                    assert got == ref[row][-window:], (rows, lens, row, layer)
    finally:
        capture.RINGS.clear()


def test_chunked_prefill_then_decode():
    w = 4
    # one request: three prefill chunks (3, 6, 1 tokens), then decode steps
    drive([([5], [3]), ([5], [6]), ([5], [1])] + [([5], None)] * 6, w)


def test_changing_batch_composition():
    w = 4
    batches: list[tuple[list[int], list[int] | None]] = [
        ([0, 1], [10, 3]),  # two prefills in one batch
        ([0, 1], None),
        ([2], [7]),  # a third request prefills alone
        ([0, 1, 2], None),
        ([1, 2], None),  # row 0 sits out a step (e.g. it is in another batch)
        ([3, 0], [5, 0]),  # a new prefill batched with a zero-length entry
        ([2, 0, 3, 1], None),  # rows in another order
        ([2, 0, 3, 1], None),
        ([4, 1], [1, 9]),  # an existing row extends again (e.g. chunk continuation)
        ([1, 4, 0], None),
    ]
    drive(batches, w)


def test_rows_without_a_ring_are_skipped_and_others_unaffected():
    capture.RINGS.clear()
    try:
        capture.ensure(1, 1, 4, H, D)
        q = queries(0, 8).reshape(8, H * D)
        capture.before_attention(Layer(0), q, None, None, Batch([0, 1], [5, 3]))
        assert 0 not in capture.RINGS
        assert [int(x) for x in capture.RINGS[1].get(0)[0, :, 0].tolist()] == [5, 6, 7]
    finally:
        capture.RINGS.clear()


def test_rows_are_cached_on_the_batch_object_not_by_address():
    """A new batch at a dead batch's address (CPython reuses ids) must read its own rows."""
    capture.RINGS.clear()
    try:
        capture.ensure(0, 1, 4, H, D)
        capture.ensure(1, 1, 4, H, D)
        fb = Batch([0], None)
        addr = id(fb)
        capture.before_attention(Layer(0), queries(0, 1).reshape(1, H * D), None, None, fb)
        del fb
        reused = None
        for _ in range(1000):  # find a new batch object at the same address
            nb = Batch([1], None)
            if id(nb) == addr:
                reused = nb
                break
            del nb
        batch = reused if reused is not None else Batch([1], None)
        capture.before_attention(Layer(0), queries(42, 1).reshape(1, H * D), None, None, batch)
        assert [int(x) for x in capture.RINGS[0].get(0)[0, :, 0].tolist()] == [0]
        assert [int(x) for x in capture.RINGS[1].get(0)[0, :, 0].tolist()] == [42]
        assert getattr(batch, capture.ROWS_ATTR) == ([1], None)
    finally:
        capture.RINGS.clear()
