"""Test-only policies, registered only by the test set-up (never in a normal server); one of
them, `test_recall_fault`, fails inside the recall stage (its exchange and its append are wrapped, for
that policy only).

The test set-up turns them on: its servers run with `KVEVICT_LOAD=sgl_kvevict.tools.testing:load`
(`tests/helpers.py`), which the plugin's `load` calls in every process; a normal server never imports
the tools."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sgl_kvevict.cache import context
from sgl_kvevict.cache.host_tier import exact_prefill, recall
from sgl_kvevict.policies import REGISTRY, LayerView, Policy, register
from sgl_kvevict.policies.knorm import KNormPolicy
from sgl_kvevict.policies.snapkv import SnapKVPolicy


class RaisingPolicy(Policy):
    """Raises inside selection, to prove a policy failure degrades only its own request."""

    name = "test_raise"

    def score(self, view: LayerView) -> torch.Tensor:
        raise RuntimeError("test_raise: deliberate failure inside a policy")


class StagedFaultPolicy(KNormPolicy):
    """Fails in the middle of a staged compaction: its merge runs on the plan's dense copies of the
    region, overwrites them with garbage layer after layer, and raises at the last layer. The request
    must continue on its intact KV, exactly as if it had never compressed."""

    name = "test_fault_staged"

    def merge(self, view: LayerView, keep: torch.Tensor) -> None:
        view.k_buffer[view.slots] = float("nan")  # the staged copy, never the pool
        view.v_buffer[view.slots] = 1e4
        # the process's one server (a test server): its layer count says which layer is the last
        rts = [ctx.rt for ctx in context.registered() if ctx.rt is not None]
        if len(rts) != 1 or view.layer == rts[0].n_layers - 1:
            raise RuntimeError("test_fault_staged: deliberate failure after writing the staged copies")


class RecallFaultPolicy(SnapKVPolicy):
    """SnapKV whose every recall fails right after its first swap that moved entries (see
    `_failing_exchange`), its append's first layer (`_failing_append`), or its prefill over both tiers'
    first layer (`_failing_both_tiers`): what was written is undone, and nothing replaced SGLang's output.
    A turn must then run exactly as with recall off, since the failure comes before any attention reads
    the row."""

    name = "test_recall_fault"


def _failing_exchange(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def exchange(s: Any, layer: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts = real(s, layer, *args, **kwargs)
        if s.policy.name == RecallFaultPolicy.name and int(counts.sum()) > 0:
            raise RuntimeError(
                f"test_recall_fault: deliberate failure after swapping {int(counts.sum())} entries "
                f"at layer {layer}"
            )
        return counts

    return exchange


def _failing_both_tiers(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The prefill over both tiers fails at its first layer, once computed, before its output replaces
    SGLang's: the turn then runs as with recall off."""

    def attend_row(one: Any, layer: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(one, layer, *args, **kwargs)
        if one.s.policy.name == RecallFaultPolicy.name:
            raise RuntimeError(
                f"test_recall_fault: deliberate failure after attending over both tiers at layer {layer}"
            )
        return out

    return attend_row


def _failing_append(real: Callable[..., None]) -> Callable[..., None]:
    def append(self: Any, layer: int, *args: Any, **kwargs: Any) -> None:
        real(self, layer, *args, **kwargs)
        if self.s.policy.name == RecallFaultPolicy.name:
            raise RuntimeError(
                f"test_recall_fault: deliberate failure after swapping {int(self.new.numel())} entries "
                f"per head into appended slots at layer {layer}"
            )

    return append


def load() -> None:
    """Registers the test policies (idempotent); called by the plugin's load when the set-up names it."""
    for cls in (RaisingPolicy, StagedFaultPolicy, RecallFaultPolicy):
        if cls.name not in REGISTRY:
            register(cls)
    if recall.exchange.__module__ != __name__:  # not yet the failing wrapper defined here
        recall.exchange = _failing_exchange(recall.exchange)
    if exact_prefill.attend_row.__module__ != __name__:
        exact_prefill.attend_row = _failing_both_tiers(exact_prefill.attend_row)
    if recall.Recall.append_layer.__module__ != __name__:
        recall.Recall.append_layer = _failing_append(recall.Recall.append_layer)
