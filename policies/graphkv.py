"""`graphkv`: GraphKV (Li, Jin, Zhang 2025, arXiv 2509.00388), a score refiner over any scoring policy.

Tokens are graph nodes with the base policy's scores; edges are key cosine similarities e_ij (Eq. 1;
cached, post-RoPE keys, per KV head). The top k scores are the sources (Eq. 2); each multiplies the
scores of its `m` most similar other tokens (Eq. 3) by (1 - lambda * e_ij) (Eq. 4), the factors
accumulating over sources, and `rounds` rounds over the fixed graph raise the product to that power
(Eq. 5, Alg. 2: the graph is built once; re-selecting sources each round is the other reading, not
taken). Then plain top-k. Only candidates (neither sinks nor the recent window, which are kept anyway)
are nodes, as in SnapKV's setting where the observation window is outside the graph. Needs the base's
needs only (keys are always there).

The paper's behaviour is the default where the text says it; the project's earlier readings are named
options:
- `source_of` (sources k = `source_frac` x B): the paper takes 0.3 of the layer's KV cache size B
  (Sec. 6.1, Table 6), which in the SnapKV frame it builds on counts the observation window: "total"
  (default) = sinks + recent window + candidate budget, the tokens a head keeps; "candidates" = the
  candidate budget only.
- `clamp_similarity`: Eqs. 4-5 use the raw cosine; a neighbour with a negative cosine (possible only
  when fewer than m tokens point the source's way) is then *raised* by (1 - lambda e) > 1. True clamps
  e to [0, 1] (decay only). Either way lambda * e is capped just below 1 so a factor never reaches 0
  by rounding.
  Measured (`benchmarks/fidelity.py`, SmolLM2-135M, 2K tokens, 50%): over snapkv, mean KL 0.516 with the
  paper's readings vs 0.522 with both earlier ones; over lagkv the clamp changes nothing (0.107).
Readings where the paper is silent: decay coefficient lambda (lost in the text; Eq. 5 implies 1) =
`decay`, default 1; adaptive m = min(`neighbors`, max(1, round(n / 1000))) for n graph nodes (Fig. 5
legend "input length x 1e-3"), fixed `neighbors` when `adaptive_neighbors` is false; the cap m_max is not
given: default 8. Scores that go negative (knorm) are shifted per head to start at 0 first, so that a
decay always lowers a score (the shift keeps the base ranking). decay = 0 or rounds = 0 returns the base
scores untouched, so the selection equals the base's exactly.

Cost: the graph is k sources x n nodes x D (Alg. 1), O(n^2) under a ratio budget. It is streamed
(`source_neighbors`): similarities exist only in blocks of at most `GRAPH_BLOCK_ELEMS` elements, never
as the `[heads, k, n]` tensor, so a compression's transient memory does not grow with k x n.

Composition: the wrapper uses the base's `score`, its trigger (`should_compress`) and its `merge` (d2o),
not the base's `select`; d2o's recent_fraction pin is therefore not applied under graphkv. Over `lagkv`,
whose selection is structural, the decay is applied to the lag scores inside each partition (sources =
source_frac * int(r*L) per partition: a partition has no sinks or window, so both `source_of` readings
agree), and in its chunk recursion likewise. The shared fields (sinks, recent, interval, window) are set
on graphkv and passed down; `base_config` holds only the base's own.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from .base import LayerView, Policy, PolicyConfig, Refiner, short, topk_keep
from .registry import REGISTRY, PolicyConfigError, build_base, register

GROUP = 64  # columns per group in the two-level top-m search
GRAPH_CHUNK = 8192  # most columns of one similarity block
GRAPH_BLOCK_ELEMS = 1 << 20  # most elements of one similarity block (4 MiB in fp32)
MAX_DECAY = 1.0 - 1e-6  # lambda * e is capped here: a factor never rounds to 0 or below


def scorable_bases() -> list[str]:
    """Policies graphkv can wrap: a per-token score, or a structural select with a refine hook."""
    out = []
    for name, cls in REGISTRY.items():
        if issubclass(cls, Refiner):
            continue
        if (
            hasattr(cls, "select_refined")
            or cls.score is not Policy.score
            or cls.score_batch is not Policy.score_batch
        ):
            out.append(name)
    return sorted(out)


class GraphKVConfig(PolicyConfig):
    base: str = Field("snapkv", description="scoring policy to refine")
    base_config: dict[str, Any] = Field(default_factory=dict, description="the base's own config fields")
    source_frac: float = Field(0.3, gt=0.0, le=1.0, description="sources = this fraction of the budget")
    source_of: Literal["total", "candidates"] = Field(
        "total",
        description="what source_frac is taken of: the tokens a head keeps, sinks and recent window "
        "included ('total', the paper's KV cache size), or the candidate budget only ('candidates')",
    )
    clamp_similarity: bool = Field(
        False, description="clamp e_ij to [0, 1] (decay only); the paper uses the raw cosine"
    )
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


def source_neighbors(
    kn: torch.Tensor, src: torch.Tensor, m: int, max_elems: int = GRAPH_BLOCK_ELEMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`m` cosine neighbours of each source, itself excluded, streamed: `(sims, idx)`, each `[R, k, m]`.

    kn: `[R, n, D]` unit keys; src: `[R, k]` source indices (distinct per row); 1 <= m <= n - 1.
    Equal to `topk(kn[src] @ kn^T with each source's own column at -inf, m)` up to ties, but the
    similarities exist only in blocks `[R, k_blk, c]` of about `max_elems` elements (a block of sources
    against a chunk of columns), never `[R, k, n]`.

    Per block, the chunk's top m come from a two-level search: the maximum of each group of `GROUP`
    consecutive columns, the m best groups (an element of the chunk's top m lies in a group whose maximum
    is at least the m-th value, and at most m groups have one), then the top m of those groups' elements:
    about GROUP / m times less top-k work than one pass over the row. A chunk's winners merge into the
    running top m of their sources.
    """
    r, n, d = kn.shape
    k = src.shape[1]
    g = GROUP
    n_pad = -(-n // g) * g
    if n_pad != n:  # zero keys fill the last group; their similarities are set to -inf below
        kn = torch.cat([kn, kn.new_zeros(r, n_pad - n, d)], dim=1)
    c = min(n_pad, max(GRAPH_CHUNK, -(-m // g) * g))
    kb = max(1, max_elems // (r * c))
    best_v = kn.new_empty(r, k, m)
    best_i = src.new_empty(r, k, m)
    neg = kn.new_tensor(float("-inf"))
    for k0 in range(0, k, kb):
        s_blk = src[:, k0 : k0 + kb]  # [R, b]
        b = s_blk.shape[1]
        q = kn.gather(1, s_blk.unsqueeze(-1).expand(-1, -1, d))  # [R, b, D]
        run_v = run_i = None
        for c0 in range(0, n_pad, c):
            cw = min(c, n_pad - c0)
            e = torch.bmm(q, kn[:, c0 : c0 + cw].transpose(1, 2))  # [R, b, cw]
            if c0 + cw > n:
                e[:, :, n - c0 :] = float("-inf")
            local = (s_blk - c0).unsqueeze(-1)  # a source is not its own neighbour
            inside = (local >= 0) & (local < cw)
            at = local.clamp(0, cw - 1)
            e.scatter_(2, at, torch.where(inside, neg, e.gather(2, at)))
            ngr = cw // g
            if ngr > 2 * m:
                grouped = e.view(r, b, ngr, g)
                top_g = grouped.amax(-1).topk(m, dim=-1).indices  # [R, b, m]
                cand = grouped.gather(2, top_g.unsqueeze(-1).expand(-1, -1, -1, g)).flatten(2)
                v, p = cand.topk(m, dim=-1)
                col = top_g.gather(2, p // g) * g + p % g + c0
            else:
                v, p = e.topk(min(m, cw), dim=-1)
                col = p + c0
            if run_v is None or run_i is None:
                run_v, run_i = v, col
            else:
                run_v, p2 = torch.cat([run_v, v], 2).topk(m, dim=-1)
                run_i = torch.cat([run_i, col], 2).gather(2, p2)
        assert run_v is not None and run_i is not None
        best_v[:, k0 : k0 + b] = run_v
        best_i[:, k0 : k0 + b] = run_i
    return best_v, best_i


def source_neighbors_dense(kn: torch.Tensor, src: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the earlier implementation): the whole `[R, k, n]` similarity tensor, then top m.
    For tests and `benchmarks/bench_policies.py --graph-dense` only."""
    sk = kn.gather(1, src.unsqueeze(-1).expand(-1, -1, kn.shape[-1]))
    e = torch.bmm(sk, kn.transpose(1, 2))
    e.scatter_(2, src.unsqueeze(-1), float("-inf"))
    return e.topk(m, dim=2)


def decay_refine(
    scores: torch.Tensor,
    keys: torch.Tensor,
    n_sources: int,
    m: int,
    rounds: int,
    decay: float,
    clamp: bool = False,
) -> torch.Tensor:
    """Eqs. 1-5: scores [R, n], keys [R, n, D] (rows independent) -> decayed scores [R, n] float32."""
    r, n = scores.shape
    s = scores.float()
    if decay == 0.0 or rounds == 0 or n < 2 or n_sources <= 0:
        return s
    if bool((s < 0).any()) and bool(torch.isfinite(s).all()):
        s = s - s.amin(dim=1, keepdim=True)
    k_src = min(n, n_sources)
    m = min(m, n - 1)
    src = s.topk(k_src, dim=1).indices  # [R, k]
    val, nbr = source_neighbors(F.normalize(keys.float(), dim=-1), src, m)
    if clamp:
        val = val.clamp(0.0, 1.0)
    logf = torch.log1p(-(decay * val).clamp(max=MAX_DECAY))
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

    def refine(self, scores: torch.Tensor, keys: torch.Tensor, kept: int) -> torch.Tensor:
        """Decay `scores` [R, n] given `kept`, the tokens a head keeps (the B that sources are taken of)."""
        c = self.config
        n_src = max(1, int(c.source_frac * kept)) if kept > 0 else 0
        return decay_refine(
            scores, keys, n_src, self.n_neighbors(scores.shape[1]), c.rounds, c.decay, c.clamp_similarity
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
            kept = budget + (view.n_sink + view.n_recent if self.config.source_of == "total" else 0)
            s = s.clone()
            s[:, cand] = self.refine(s[:, cand], view.keys()[:, cand], kept)
        return topk_keep(s, view, budget)
