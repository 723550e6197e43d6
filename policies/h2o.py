"""`h2o`: Heavy-Hitter Oracle (Zhang et al. 2023), window-accumulated.

H2O ranks tokens by the attention they received, summed over every query so far. Paged attention
never exposes those probabilities, so this reads the observation-window attention the runner computes
(`view.attn`, mean over the last `window` queries and over the query heads of each KV head) and sums it
over the window: score = attn * window. This is the reading the CriticalKV paper uses to simulate H2O
(last 256 queries); set `window` accordingly. Scores are not carried across compressions (a merged or
compacted slot would need its history remapped); each compression sees the latest window only.
"""

from __future__ import annotations

import torch

from . import register
from .base import LayerView, Need, Policy, PolicyConfig


class H2OConfig(PolicyConfig):
    """No extra fields; `window` is the number of accumulated queries."""


@register
class H2OPolicy(Policy):
    name = "h2o"
    Config = H2OConfig
    needs = frozenset[Need]({"attn"})
    attention_scores = True

    def score(self, view: LayerView) -> torch.Tensor:
        return view.require_attn(self.name).float() * self.config.window
