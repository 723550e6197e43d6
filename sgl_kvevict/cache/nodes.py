"""The compressing tree's own node type, read by the modules below the tree.

A compressed node (a request's compressed history) is a `CompressedNode`: an SGLang `TreeNode` that
also holds its producer's fingerprint, the policy state stored with it, its host entries and (where
tracked) the logical positions its slots hold. Only the tree creates one (`KvEvictRadixCache.
_insert_compressed`); it is never split (it is matched whole or not at all), so SGLang's own node code,
which creates and splits plain `TreeNode`s only, never has to carry these fields. This leaf holds the
type and its predicate, so the tree, its event recorder and the request state ask one function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

if TYPE_CHECKING:
    from sgl_kvevict.cache.host_tier.host import HostEntries


class CompressedNode(TreeNode):
    """A compressed history: `len(value)` slots (fewer than its `len(key)` tokens) and what goes with it."""

    def __init__(self, priority: int, fp: str, positions: torch.Tensor | None = None) -> None:
        super().__init__(priority=priority)
        self.fp = fp  # the fingerprint of the config that produced it (`state.fingerprint`)
        self.positions = (
            positions  # `[L, H, slots]` logical position each slot holds where tracked, else None
        )
        # The producer's per-head policy state, continued by the branch's next turn (`PolicyState.layers`);
        # empty when the node was stored by another request first (a duplicate keeps the first one's).
        self.layer_state: list[dict] = []
        self.host_entries: HostEntries | None = None  # its evicted tokens' entries on the host tier, if any


def is_compressed(node: Any) -> TypeGuard[CompressedNode]:
    """Whether `node` is a compressed history (fewer KV slots than tokens, matched whole or not at all)."""
    return isinstance(node, CompressedNode)
