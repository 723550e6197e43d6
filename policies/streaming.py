"""`streaming`: StreamingLLM (Xiao et al.). Sinks + the most recent tokens, nothing else.

Reading chosen: with a candidate budget `b` the policy keeps the `b` most recent candidates too, so the
kept set is always a contiguous recent window plus the sinks (the paper's cache is "sinks + rolling
window"; the runner's `recent` is only the part no policy may evict). Attention-free.
"""

from __future__ import annotations

import torch

from .base import BatchView, LayerView, Policy, PolicyConfig, pad_sorted
from .registry import register


class StreamingConfig(PolicyConfig):
    """No extra fields: the window is `recent` plus the candidate budget."""


@register
class StreamingPolicy(Policy):
    name = "streaming"
    Config = StreamingConfig
    batchable = True

    def score(self, view: LayerView) -> torch.Tensor:
        """Region index as score: later = higher, so top-b keeps the newest candidates of every head."""
        pos = torch.arange(view.n, dtype=torch.float32, device=view.slots.device)
        return pos.unsqueeze(0).expand(view.n_kv_heads, -1)

    def select_batch(self, batch: BatchView) -> torch.Tensor:
        """Every head keeps its sinks, then the contiguous run `[n - (k - sinks), n)`: no score needed."""
        R, L, H, nmax = batch.shape  # noqa: N806
        ks = [c.k for c in batch.counts]
        kmax = max(ks)
        pos = torch.arange(kmax, dtype=torch.int64).unsqueeze(0)
        shift = batch.col([c.n - c.k for c in batch.counts])
        sink = batch.col([c.n_sink for c in batch.counts])
        keep = torch.where(pos < sink, pos, pos + shift).to(batch.slots.device)  # [R, Kmax]
        return pad_sorted(keep.view(R, 1, 1, kmax).expand(R, L, H, kmax), ks, nmax)
