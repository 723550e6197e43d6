"""What the compressing tree hangs on SGLang's `TreeNode`, read by the modules below the tree.

A compressed node (a request's compressed history) carries `kvevict_compressed = True`, its producer's
fingerprint `kvevict_fp` and the policy state `kvevict_state` stored with it. This leaf holds the
predicate, so the tree, its event recorder and the request state ask one function.
"""

from __future__ import annotations

from typing import Any


def is_compressed(node: Any) -> bool:
    """Whether `node` is a compressed history (fewer KV slots than tokens, matched whole or not at all)."""
    return getattr(node, "kvevict_compressed", False)
