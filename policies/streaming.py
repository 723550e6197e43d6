"""`streaming`: StreamingLLM (Xiao et al.). Sinks + the most recent tokens, nothing else.

Reading chosen: with a candidate budget `b` the policy keeps the `b` most recent candidates too, so the
kept set is always a contiguous recent window plus the sinks (the paper's cache is "sinks + rolling
window"; the runner's `recent` is only the part no policy may evict). Attention-free.
"""

from __future__ import annotations

import torch

from .base import LayerView, Policy, PolicyConfig
from .registry import register


class StreamingConfig(PolicyConfig):
    """No extra fields: the window is `recent` plus the candidate budget."""


@register
class StreamingPolicy(Policy):
    name = "streaming"
    Config = StreamingConfig

    def score(self, view: LayerView) -> torch.Tensor:
        """Region index as score: later = higher, so top-b keeps the newest candidates of every head."""
        pos = torch.arange(view.n, dtype=torch.float32, device=view.slots.device)
        return pos.unsqueeze(0).expand(view.n_kv_heads, -1)
