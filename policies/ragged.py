"""Ragged index layouts built on the host from host integers, for the batched selections and the engine.

Requests in one batched step have different lengths, so their rows sit in flat or padded layouts. Every
index into such a layout is computed here from counts the host already knows, never read back from the
device: copying the result to the device is the step's only transfer, and it does not wait on the GPU.
"""

from __future__ import annotations

import itertools

import torch


def aranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Host int64 `cat([arange(s, s + n) for s, n in zip(starts, lengths)])` in a few vector ops."""
    n = torch.tensor(lengths, dtype=torch.int64)
    total = int(sum(lengths))
    base = torch.tensor(starts, dtype=torch.int64) - torch.cumsum(n, 0) + n
    return torch.repeat_interleave(base, n, output_size=total) + torch.arange(total, dtype=torch.int64)


def padded(starts: list[int], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host `[len(starts), width]` positions `start + min(j, n - 1)` (padding repeats the last valid
    one, so every index stays in range) and the mask `j < n` of the real ones."""
    j = torch.arange(width, dtype=torch.int64).unsqueeze(0)
    n = torch.tensor(lengths, dtype=torch.int64).view(-1, 1)
    return torch.tensor(starts, dtype=torch.int64).view(-1, 1) + torch.minimum(j, (n - 1).clamp(min=0)), j < n


def offsets(lengths: list[int]) -> list[int]:
    """Exclusive prefix sums: where each of consecutive segments of these lengths starts."""
    return [0, *itertools.accumulate(lengths)][:-1]


def repeat(values: list[int], counts: list[int]) -> torch.Tensor:
    """Host int64 `values[i]` repeated `counts[i]` times (with its output size, so no sync)."""
    return torch.repeat_interleave(
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int64),
        output_size=sum(counts),
    )
