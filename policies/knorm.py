"""`knorm`: key-norm eviction (Devoto et al. 2024). Keep the keys with the *smallest* L2 norm.

Attention-free: score = -||k||_2 per KV head on the cached (post-RoPE) keys. RoPE rotates channel pairs,
so the norm is the same pre- or post-RoPE and that ambiguity vanishes. The LagKV ablation's variant that
skips the first two layers is not offered: budgets are equal across layers in this layout, so a layer
cannot opt out of compression.
"""

from __future__ import annotations

import torch

from .base import BatchView, Policy, PolicyConfig
from .registry import register


class KNormConfig(PolicyConfig):
    """No extra fields."""


@register
class KNormPolicy(Policy):
    name = "knorm"
    Config = KNormConfig
    batchable = True

    def score_batch(self, batch: BatchView) -> torch.Tensor:
        R, L, H, nmax = batch.shape  # noqa: N806
        flat = batch.slots.reshape(-1)
        norms = torch.stack([k.index_select(0, flat).float().norm(dim=-1) for k in batch.k_buffers])
        return -norms.view(L, R, nmax, H).permute(1, 0, 3, 2)  # [L, R*Nmax, H] -> [R, L, H, Nmax]
