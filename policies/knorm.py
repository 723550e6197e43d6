"""`knorm`: key-norm eviction (Devoto et al. 2024). Keep the keys with the *smallest* L2 norm.

Attention-free: score = -||k||_2 per KV head on the cached (post-RoPE) keys. RoPE rotates channel pairs,
so the norm is the same pre- or post-RoPE and that ambiguity vanishes. The LagKV ablation's variant that
skips the first two layers is not offered: budgets are equal across layers in this layout, so a layer
cannot opt out of compression.
"""

from __future__ import annotations

import torch

from .base import LayerView, Policy, PolicyConfig
from .registry import register


class KNormConfig(PolicyConfig):
    """No extra fields."""


@register
class KNormPolicy(Policy):
    name = "knorm"
    Config = KNormConfig

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys().float().norm(dim=-1)
