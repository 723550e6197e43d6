"""Test-only policies, registered only when KVEVICT_TEST_POLICIES=1 (never in a normal server)."""

from __future__ import annotations

import torch

from sgl_kvevict.cache import runtime
from sgl_kvevict.policies import LayerView, Policy, register
from sgl_kvevict.policies.knorm import KNormPolicy


@register
class RaisingPolicy(Policy):
    """Raises inside selection, to prove a policy failure degrades only its own request."""

    name = "test_raise"

    def score(self, view: LayerView) -> torch.Tensor:
        raise RuntimeError("test_raise: deliberate failure inside a policy")


@register
class StagedFaultPolicy(KNormPolicy):
    """Fails in the middle of a staged compaction: its merge runs on the plan's dense copies of the
    region, overwrites them with garbage layer after layer, and raises at the last layer. The request
    must continue on its intact KV, exactly as if it had never compressed."""

    name = "test_fault_staged"

    def merge(self, view: LayerView, keep: torch.Tensor) -> None:
        view.k_buffer[view.slots] = float("nan")  # the staged copy, never the pool
        view.v_buffer[view.slots] = 1e4
        rt = runtime.RT
        if rt is None or view.layer == rt.n_layers - 1:
            raise RuntimeError("test_fault_staged: deliberate failure after writing the staged copies")
