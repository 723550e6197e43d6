"""The attention scale used for scoring comes from the model's own RadixAttention modules."""

from __future__ import annotations

import gc
import logging
import math

import torch
from sglang.srt.layers.radix_attention import RadixAttention

from sgl_kvevict.cache.runtime import attention_scale


class TinyModel(torch.nn.Module):
    def __init__(self, scaling: float) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"attn": RadixAttention(4, 64, scaling, 2, layer_id=i)}) for i in range(2)
        )


def test_scale_read_from_radix_attention():
    # e.g. Gemma's query_pre_attn_scalar**-0.5 differs from 1/sqrt(head_dim)
    assert attention_scale(TinyModel(256**-0.5), head_dim=64) == 256**-0.5
    assert attention_scale(TinyModel(0.1), head_dim=64) == 0.1


def test_scale_falls_back_to_head_dim_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="sgl_kvevict"):
        got = attention_scale(torch.nn.Linear(2, 2), head_dim=64)
    assert got == 1.0 / math.sqrt(64)
    assert "no RadixAttention" in caplog.text


def test_trim_heap_gives_freed_memory_back():
    """Freed blocks between live ones stay in the C heap (RSS unchanged) until `trim_heap` returns them.

    The live neighbours matter: glibc's free() itself gives back memory at the heap's top, so a test
    that frees everything measures only what happened to sit below some other live block."""
    from sgl_kvevict.cache.runtime import trim_heap

    trim_heap()  # start from a trimmed heap: earlier tests' free blocks would take these allocations
    blocks = [torch.ones(16 * 1024) for _ in range(4000)]  # 4,000 x 64 KiB = 250 MiB, below mmap's threshold
    live = blocks[::2]  # every other block stays allocated while the heap is trimmed
    del blocks  # frees the odd blocks: 2,000 holes of 64 KiB, each between two live blocks
    try:
        assert trim_heap() >= 50
    finally:
        del live


def test_heap_stats_tell_in_use_from_free():
    """`heap_stats` (reported in `/server_info`) moves 4,000 x 64 KiB blocks from in-use to free when every
    other one is freed: what tells a live native leak from the allocator keeping freed memory."""
    from sgl_kvevict.cache.runtime import heap_stats, trim_heap

    # the heap is the process's: what the collector or another thread frees mid-measurement counts
    # against the blocks (a fresh-clone run once saw 220 of their 250 MiB), so garbage is collected
    # first and the bound on what the blocks add leaves 20% for the rest of the process
    gc.collect()
    gc.disable()
    try:
        trim_heap()
        before = heap_stats()
        assert set(before) == {"heap_in_use_mib", "heap_free_mib", "heap_mmapped_mib", "heap_arena_mib"}
        # 250 MiB in 64 KiB blocks, below mmap's threshold
        blocks = [torch.ones(16 * 1024) for _ in range(4000)]
        held = heap_stats()
        live = blocks[::2]
        del blocks  # 2,000 holes between live blocks: free, but kept by the heap
        holed = heap_stats()
        del live
    finally:
        gc.enable()
    used = (
        held["heap_in_use_mib"]
        + held["heap_mmapped_mib"]
        - before["heap_in_use_mib"]
        - before["heap_mmapped_mib"]
    )
    assert used >= 200
    assert held["heap_in_use_mib"] - holed["heap_in_use_mib"] >= 120
    assert holed["heap_free_mib"] - held["heap_free_mib"] >= 120
