"""`snapkv`: SnapKV (Li et al. 2024). Observation-window attention, smoothed by 1-D pooling.

score = pool(attn), attn = mean over the last `window` queries and over the query heads of each KV head
(`view.attn`). The released code pools each query head's attention before the group mean; avg pooling is
linear, so pooling the group mean is the same thing.
Ambiguity: the CriticalKV/AdaKV papers state max-pool kernel 7, the released SnapKV and kvpress code
avg-pool kernel 5. Default: avg, 5, zero-padded to keep the length (`count_include_pad`), as the code
does; `pooling="max"` applies max-pooling to the group-mean attention (not to each query head).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from .base import BatchView, Need, Policy, WindowScoreConfig, carry_batch
from .registry import register


class SnapKVConfig(WindowScoreConfig):
    kernel_size: int = Field(
        5, ge=1, le=1 << 10, description="pooling kernel (odd, so the output is centred)"
    )
    pooling: Literal["avg", "max"] = Field("avg", description="avg (released code) or max (paper text)")

    @field_validator("kernel_size")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("kernel_size must be odd")
        return v


def pool_scores(attn: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool `[H, N]` scores along N with a centred window of `kernel_size` (length preserved)."""
    if kernel_size == 1:
        return attn.float()
    x = attn.float().unsqueeze(1)  # [H, 1, N]
    pad = kernel_size // 2
    if pooling == "max":
        out = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return out.squeeze(1)


@register
class SnapKVPolicy(Policy):
    name = "snapkv"
    Config = SnapKVConfig
    config: SnapKVConfig
    needs = frozenset[Need]({"attn"})
    attention_scores = True
    batchable = True

    def score_batch(self, batch: BatchView) -> torch.Tensor:
        if batch.attn is None:
            raise ValueError(f"{self.name} needs batch.attn (window attention)")
        R, L, H, nmax = batch.shape  # noqa: N806
        flat = batch.attn.reshape(-1, nmax)  # pooling runs along each row's tokens
        pooled = pool_scores(flat, self.config.kernel_size, self.config.pooling).view(R, L, H, nmax)
        return carry_batch(batch, pooled, self.config)
