"""`criticalkv`: CriticalKV (Feng et al. 2025, arXiv 2502.03805), two-stage selection over an attention score.

Eviction minimises a bound on the attention-output perturbation, which depends on the attention A_i and
on ||v_i W_O||_1. Per KV head, with candidate budget b: stage 1 keeps the top floor(alpha * b) by the
base score (attention mass > 0.5 makes the bound's coefficient positive); stage 2 keeps the remaining
b - floor(alpha * b) by (A + eps) * ||v W_O||_1 (`kernels.vo_norms`: per query head with its own W_O
slice, mean over the GQA group). A is the base policy's score (pooled window attention for snapkv,
attn * window for h2o/d2o), as the released code does.

The bound holds only when A is an attention distribution, so the base must be attention-based
(`attention_scores`): h2o, snapkv, d2o; anything else fails at build time, i.e. at server start.
Readings chosen: alpha = 0.5 (paper text and code; Alg. 1's header says 0.25) = `alpha`; eps = 1e-4.
The wrapper uses the base's score, trigger and merge (d2o), not its select. Shared fields (sinks,
recent, interval, window) are set on criticalkv and passed to the base.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field, model_validator

from . import REGISTRY, PolicyConfigError, build_base, register
from .base import LayerView, Need, PolicyConfig, Refiner, short, topk_keep


def attention_bases() -> list[str]:
    return sorted(n for n, c in REGISTRY.items() if c.attention_scores)


class CriticalKVConfig(PolicyConfig):
    base: str = Field("snapkv", description="attention-based scoring policy (h2o, snapkv, d2o)")
    base_config: dict[str, Any] = Field(default_factory=dict, description="the base's own config fields")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="stage-1 fraction of the budget")
    eps: float = Field(
        1e-4, ge=0.0, le=1.0, description="added to A in the stage-2 score (A + eps) * ||v W_O||_1"
    )

    @model_validator(mode="after")
    def _check_base(self) -> CriticalKVConfig:
        valid = attention_bases()
        if self.base not in valid:
            raise PolicyConfigError(
                f"criticalkv needs an attention-based base, not {short(self.base)}; valid bases: {', '.join(valid)}"
            )
        build_base("criticalkv", self, self.base, self.base_config)
        return self


@register
class CriticalKVPolicy(Refiner):
    name = "criticalkv"
    Config = CriticalKVConfig
    config: CriticalKVConfig

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.base = build_base("criticalkv", self.config, self.config.base, self.config.base_config)
        self.needs = self.base.needs | frozenset[Need]({"attn", "o_proj"})  # type: ignore[misc]

    def score(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError("criticalkv needs the budget; use select()")

    def select(self, view: LayerView, budget: int) -> torch.Tensor:
        from sgl_kvevict.kernels import vo_norms

        if view.o_proj is None:
            raise ValueError("criticalkv needs view.o_proj")
        a = self.base.score(view).float()
        cand = view.candidates()
        b = min(max(0, budget), max(0, cand.stop - cand.start))
        s2 = (a + self.config.eps) * vo_norms(view.v_buffer, view.slots, view.o_proj).to(a.device)
        b1 = math.floor(self.config.alpha * b)
        if b1 > 0:
            top1 = a[:, cand].topk(b1, dim=-1).indices + cand.start
            s2.scatter_(1, top1, float("inf"))
        return topk_keep(s2, view, b)
