"""The attention scale used for scoring comes from the model's own RadixAttention modules."""

from __future__ import annotations

import functools
import json
import logging
import math
import subprocess
import sys

import pytest
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


# The heap measurements run in a fresh interpreter: the heap is the process's, and what an earlier test,
# the collector or another thread allocates or frees mid-measurement would count against the blocks.
# 4,000 blocks of 64 KiB (below glibc's mmap threshold), every other one freed: the holes sit between
# live blocks, where glibc's free() cannot give them back at the heap's top.
HEAP_PROBE = """
import gc, json, torch
from sgl_kvevict.cache.runtime import heap_stats, trim_heap
gc.collect(); gc.disable()
trim_heap()
before = heap_stats()
blocks = [torch.ones(16 * 1024) for _ in range(4000)]
size = sum(b.numel() * b.element_size() for b in blocks) / (1 << 20)
held = heap_stats()
live = blocks[::2]
del blocks
holed = heap_stats()
trimmed = trim_heap()
print(json.dumps({"size": size, "before": before, "held": held, "holed": holed, "trimmed": trimmed}))
"""


@functools.cache
def _heap_probe() -> dict:
    res = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    if not got["before"]:
        pytest.skip("no glibc mallinfo2 in this process: the heap is not glibc's")
    return got


def test_trim_heap_gives_freed_memory_back():
    """Freed blocks between live ones stay in the C heap (RSS unchanged) until `trim_heap` returns them:
    at least half of the holes' size (the blocks' own size, measured in the probe)."""
    got = _heap_probe()
    assert got["trimmed"] >= got["size"] / 4, got


def test_heap_stats_tell_in_use_from_free():
    """`heap_stats` (reported in `/server_info`) moves the blocks from in-use to free when every other one
    is freed: what tells a live native leak from the allocator keeping freed memory. Bounds from the
    blocks' own size: 80% of it in use, 80% of the holes' half moved."""
    got = _heap_probe()
    before, held, holed, size = got["before"], got["held"], got["holed"], got["size"]
    assert set(before) == {"heap_in_use_mib", "heap_free_mib", "heap_mmapped_mib", "heap_arena_mib"}
    used = (
        held["heap_in_use_mib"]
        + held["heap_mmapped_mib"]
        - before["heap_in_use_mib"]
        - before["heap_mmapped_mib"]
    )
    assert used >= 0.8 * size, got
    assert held["heap_in_use_mib"] - holed["heap_in_use_mib"] >= 0.8 * size / 2, got
    assert holed["heap_free_mib"] - held["heap_free_mib"] >= 0.8 * size / 2, got
