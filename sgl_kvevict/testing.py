"""Test-only policies, registered only when KVEVICT_TEST_POLICIES=1 (never in a normal server)."""

from __future__ import annotations

import torch

from sgl_kvevict.policies import LayerView, Policy, register


@register
class RaisingPolicy(Policy):
    """Raises inside selection, to prove a policy failure degrades only its own request."""

    name = "test_raise"

    def score(self, view: LayerView) -> torch.Tensor:
        raise RuntimeError("test_raise: deliberate failure inside a policy")
