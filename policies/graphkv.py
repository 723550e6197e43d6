"""`graphkv`: GraphKV (Li, Jin, Zhang 2025, arXiv 2509.00388), a score refiner over any scoring policy.

Tokens are graph nodes with the base policy's scores; edges are key cosine similarities (cached,
post-RoPE keys, per KV head). The top `source_frac * budget` tokens are sources; each multiplies the
scores of its `m` most similar other tokens by (1 - decay * e_ij), e clamped to [0, 1], the factors
accumulating over sources, and `rounds` rounds over the fixed graph raise the product to that power
(Eq. 5; re-selecting sources each round is the other reading, not taken). Then plain top-k. Only
candidates (neither sinks nor the recent window, which are kept anyway) are nodes, as in SnapKV's setting
where the observation window is outside the graph. Needs the base's needs only (keys are always there).

Readings chosen: decay coefficient lambda (lost in the text; Eq. 5 implies 1) = `decay`, default 1;
adaptive m = min(`neighbors`, max(1, round(n / 1000))) for n graph nodes (Fig. 5 legend "input length
x 1e-3"), fixed `neighbors` when `adaptive_neighbors` is false; the cap m_max is not given: default 8.
Scores that go negative (knorm) are shifted per head to start at 0 first, so that a decay always lowers a
score (the shift keeps the base ranking). decay = 0 or rounds = 0 returns the base scores untouched, so
the selection equals the base's exactly.

Composition: the wrapper uses the base's `score`, its trigger (`should_compress`) and its `merge` (d2o),
not the base's `select`; d2o's recent_fraction pin is therefore not applied under graphkv. Over `lagkv`,
whose selection is structural, the decay is applied to the lag scores inside each partition (sources =
source_frac * int(r*L) per partition), and in its chunk recursion likewise. The shared fields (sinks,
recent, interval, window) are set on graphkv and passed down; `base_config` holds only the base's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from . import REGISTRY, PolicyConfigError, build_base, register
from .base import LayerView, Policy, PolicyConfig, Refiner, short, topk_keep


def scorable_bases() -> list[str]:
    """Policies graphkv can wrap: a per-token score, or a structural select with a refine hook."""
    out = []
    for name, cls in REGISTRY.items():
        if issubclass(cls, Refiner):
            continue
        if hasattr(cls, "select_refined") or cls.score is not Policy.score:
            out.append(name)
    return sorted(out)


class GraphKVConfig(PolicyConfig):
    base: str = Field("snapkv", description="scoring policy to refine")
    base_config: dict[str, Any] = Field(default_factory=dict, description="the base's own config fields")
    source_frac: float = Field(0.3, gt=0.0, le=1.0, description="sources = this fraction of the budget")
    neighbors: int = Field(
        8, ge=1, le=1 << 10, description="m: neighbours decayed per source (cap when adaptive)"
    )
    adaptive_neighbors: bool = Field(True, description="m = min(neighbors, max(1, round(n / 1000)))")
    rounds: int = Field(1, ge=0, le=64, description="T: propagation rounds over the fixed graph")
    decay: float = Field(1.0, ge=0.0, le=1.0, description="lambda: factor (1 - lambda * e_ij)")

    @model_validator(mode="after")
    def _check_base(self) -> GraphKVConfig:
        valid = scorable_bases()
        if self.base not in valid:
            raise PolicyConfigError(
                f"graphkv cannot wrap {short(self.base)}; valid bases: {', '.join(valid)}"
            )
        build_base("graphkv", self, self.base, self.base_config)
        return self


def decay_refine(
    scores: torch.Tensor,
    keys: torch.Tensor,
    budget: int,
    source_frac: float,
    m: int,
    rounds: int,
    decay: float,
) -> torch.Tensor:
    """Eqs. 1-5: scores [R, n], keys [R, n, D] (rows independent) -> decayed scores [R, n] float32."""
    r, n = scores.shape
    s = scores.float()
    if decay == 0.0 or rounds == 0 or n < 2 or budget <= 0:
        return s
    if bool((s < 0).any()) and bool(torch.isfinite(s).all()):
        s = s - s.amin(dim=1, keepdim=True)
    k_src = min(n, max(1, int(source_frac * budget)))
    m = min(m, n - 1)
    src = s.topk(k_src, dim=1).indices  # [R, k]
    kn = F.normalize(keys.float(), dim=-1)
    sk = kn.gather(1, src.unsqueeze(-1).expand(-1, -1, kn.shape[-1]))  # [R, k, D]
    e = torch.bmm(sk, kn.transpose(1, 2))  # [R, k, n]
    e.scatter_(2, src.unsqueeze(-1), float("-inf"))  # a source does not decay itself
    val, nbr = e.topk(m, dim=2)
    logf = torch.log1p(-(decay * val.clamp(0.0, 1.0)).clamp(max=1.0 - 1e-6))
    logdecay = torch.zeros_like(s).scatter_add_(1, nbr.flatten(1), logf.flatten(1))
    return s * torch.exp(rounds * logdecay)


@register
class GraphKVPolicy(Refiner):
    name = "graphkv"
    Config = GraphKVConfig
    config: GraphKVConfig

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.base = build_base("graphkv", self.config, self.config.base, self.config.base_config)
        self.needs = self.base.needs  # type: ignore[misc]

    def n_neighbors(self, n: int) -> int:
        if not self.config.adaptive_neighbors:
            return self.config.neighbors
        return min(self.config.neighbors, max(1, round(n / 1000)))

    def refine(self, scores: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
        c = self.config
        return decay_refine(
            scores, keys, budget, c.source_frac, self.n_neighbors(scores.shape[1]), c.rounds, c.decay
        )

    def score(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError("graphkv needs the budget; use select()")

    def select(self, view: LayerView, budget: int) -> torch.Tensor:
        select_refined = getattr(self.base, "select_refined", None)
        if select_refined is not None:
            return select_refined(view, budget, self.refine)
        s = self.base.score(view).float()
        cand = view.candidates()
        n_cand = max(0, cand.stop - cand.start)
        if 0 < budget < n_cand:
            s = s.clone()
            s[:, cand] = self.refine(s[:, cand], view.keys()[:, cand], budget)
        return topk_keep(s, view, budget)
