"""`none`: the full cache. Never compresses; the server behaves exactly as plain SGLang."""

from __future__ import annotations

from .base import Phase, Policy
from .registry import register


@register
class NonePolicy(Policy):
    name = "none"

    def should_compress(
        self, n_region: int, n_sink: int, n_recent: int, n_compacted: int, budget: int, phase: Phase
    ) -> bool:
        return False
