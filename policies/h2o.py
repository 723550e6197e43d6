"""`h2o`: Heavy-Hitter Oracle (Zhang et al. 2023), window-accumulated.

H2O ranks tokens by the attention they received, summed over every query so far. Paged attention
never exposes those probabilities, so this reads the observation-window attention the runner computes
(`view.attn`, mean over the last `window` queries and over the query heads of each KV head) and sums it
over the window: score = attn * window. This is the reading the CriticalKV paper uses to simulate H2O
(last 256 queries); set `window` accordingly. A kept token's score is carried to later compressions
(`carry`, default its maximum so far), closer to the paper's all-query accumulation than one window.
"""

from __future__ import annotations

import torch

from .base import BatchView, Need, Policy, WindowScoreConfig, carry_batch
from .registry import register


class H2OConfig(WindowScoreConfig):
    """No extra fields; `window` is the number of accumulated queries."""


@register
class H2OPolicy(Policy):
    name = "h2o"
    Config = H2OConfig
    needs = frozenset[Need]({"attn"})
    attention_scores = True
    batchable = True

    def score_batch(self, batch: BatchView) -> torch.Tensor:
        if batch.attn is None:
            raise ValueError(f"{self.name} needs batch.attn (window attention)")
        return carry_batch(batch, batch.attn * self.config.window, self.config)
