"""Where a compression's evicted entries go: the one hook between the compression core
(`compressor.py`, `engine.py`) and the host tier.

A compression plans which entries each (layer, KV head) keeps, then commits: it writes the kept entries
into place and frees the rest. `open` gives the commit an `Eviction` (None: the evicted entries are
dropped, as without a host tier): the commit shows it the region's slots and kept indices before its
first write (`evicting`), and says at the end whether it went through (`close`). The host tier
(`host_tier.demote.HostTier`, set as `KvEvictContext.evictions` when recall is on) copies the evicted
entries to host memory there; nothing else in the compression core knows it exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from sgl_kvevict.cache.state import ReqState


class Eviction(Protocol):
    """One commit's evicted entries."""

    def evicting(self, a: int, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Before the commit's first write: the region of `slots` starting at row index `a` keeps the
        `[L, H, k]` region indices `keep`; the others are about to be freed."""

    def close(self, committed: bool) -> None:
        """The commit went through (`committed`) or changed nothing."""


class EvictionSink(Protocol):
    def open(self, s: ReqState) -> Eviction | None:
        """The request's next commit's `Eviction`, None when its evicted entries are dropped."""


def open_for(s: ReqState) -> Eviction | None:
    sink = s.ctx.evictions
    return None if sink is None else sink.open(s)
