"""`criticalkv`: CriticalKV (Feng et al. 2025, arXiv 2502.03805), two-stage selection over an attention score.

Eviction minimises a bound on the attention-output perturbation (Thm 3.3, Eq. 7), which depends on the
attention A_i and on ||v_i W_O||_1. Per KV head, with candidate budget b (Alg. 1): stage 1 keeps the top
floor(alpha * b) by the base score (attention mass > 0.5 makes the bound's coefficient positive, Thm
3.5); stage 2 keeps the remaining b - floor(alpha * b) by (A + eps) * ||v W_O||_1 (Eq. 8). A is the base
policy's score (pooled window attention for snapkv, window-accumulated attention for h2o/d2o), as the
released code does.

The bound holds only when A is an attention distribution, so the base must be attention-based
(`attention_scores`): h2o, snapkv, d2o; anything else fails at build time, i.e. at server start.
Readings chosen: alpha = 0.5 (paper text and code; Alg. 1's header says 0.25) = `alpha`; eps = 1e-4.

- `eps_on` (default "attention", the paper's): eps is added to A, the attention probability. h2o and d2o
  score attn * window (a sum over the window's queries), so their eps is multiplied by `window` to stay
  1e-4 of A. "score" adds eps to the base's score as it is (the earlier reading: for h2o/d2o the
  effective eps was 1e-4 / window). Measured (`benchmarks/fidelity.py`, SmolLM2-135M, 2K tokens, 50%,
  h2o base): mean KL 0.456 and top-1 agreement 0.818 with eps on attention, 0.504 and 0.788 on the score.
- Grouped-query attention: the derivation is for one attention head; with G query heads on a KV head the
  sum of their bounds would rank by sum_h A_h,i ||v_i W_O[h]||_1, which needs each query head's window
  attention. The runner hands a policy the group-mean attention (one selection per KV head, as SnapKV's),
  so stage 2 ranks by mean_h A_h,i x mean_h ||v_i W_O[h]||_1, the released code's reading (kvpress'
  CriticalKVPress and the authors' DefensiveKV: group-averaged scores times group-averaged norms). Kept
  as the only reading; not measured against the per-head form.

||v W_O||_1 is O(n x Hq x D x hidden) per compression if recomputed (`kernels.vo_norms`). In the server
it is a per-slot statistic written when the value is written (`sgl_kvevict.cache.slotstats`: one norm per
token, KV head and layer, computed in the forward pass and moved with its row by every compaction), handed
to the policy as `view.vo`: every compression, the first included, reads O(n) numbers. Rows whose
statistic is stale (D2O's merge rewrote the value) or was never written are NaN there and computed here
(`slot_vo_norms`); the runner stores them back.

Without `view.vo` (no per-slot buffer: the policy used on its own, benchmarks), the norms are cached per
request and layer in `view.state` (like the carried scores): the kept tokens' norms, in kept order (the
region's first tokens after compaction), with a signature of each value row's bits. A later compression
reuses a norm when the row at that place still has the same signature and computes the rest (new
tokens; rows D2O's merge rewrote; anything after a shifted region); a first compression computes every
norm. Both paths give the same norms, hence the same selection, as recomputing.

The wrapper uses the base's score, trigger and merge (d2o), not its select. Shared fields (sinks,
recent, interval, window) are set on criticalkv and passed to the base.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from . import REGISTRY, PolicyConfigError, build_base, register
from .base import LayerView, Need, Policy, PolicyConfig, Refiner, short, topk_keep
from .h2o import H2OPolicy

N_SIG = 2  # independent signatures per value row: a changed row goes unnoticed with p ~ 2^-40
SIG_CHUNK = 4096  # tokens per signature block
_SIG_W: dict[tuple[int, str], torch.Tensor] = {}


def attention_bases() -> list[str]:
    return sorted(n for n, c in REGISTRY.items() if c.attention_scores)


class CriticalKVConfig(PolicyConfig):
    base: str = Field("snapkv", description="attention-based scoring policy (h2o, snapkv, d2o)")
    base_config: dict[str, Any] = Field(default_factory=dict, description="the base's own config fields")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="stage-1 fraction of the budget")
    eps: float = Field(
        1e-4, ge=0.0, le=1.0, description="added to A in the stage-2 score (A + eps) * ||v W_O||_1"
    )
    eps_on: Literal["attention", "score"] = Field(
        "attention",
        description="eps is relative to the attention probability ('attention': multiplied by window for "
        "h2o/d2o, whose score sums the window) or added to the base's score as is ('score')",
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


def value_signatures(v_buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[Hkv, N, N_SIG]` float64: fixed random integer combinations of each value row's 16-bit words.

    Exact integer arithmetic (|word| < 2^15, weights < 2^20, at most 2^8 words: sums < 2^53), so equal
    rows give equal signatures whatever the block shapes, and a changed row keeps all of them with
    probability about 2^-20 each."""
    n, hkv = int(slots.numel()), int(v_buffer.shape[1])
    words = v_buffer.shape[2] * v_buffer.element_size() // 2
    key = (words, str(v_buffer.device))
    w = _SIG_W.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = torch.randint(1, 1 << 20, (words, N_SIG), generator=g, dtype=torch.int64)
        w = _SIG_W[key] = w.to(torch.float64).to(v_buffer.device)
    out = torch.empty(hkv, n, N_SIG, dtype=torch.float64, device=v_buffer.device)
    for n0 in range(0, n, SIG_CHUNK):
        rows = v_buffer[slots[n0 : n0 + SIG_CHUNK]].contiguous()  # [c, Hkv, D]
        bits = rows.view(torch.int16).to(torch.float64)  # [c, Hkv, words]
        out[:, n0 : n0 + SIG_CHUNK] = (bits @ w).transpose(0, 1)
    return out


def cached_vo_norms(view: LayerView) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(norms [Hkv, N] float32, signatures [Hkv, N, N_SIG], rows computed)`: the cached norms of the
    region's first tokens where their value rows are unchanged, `kernels.vo_norms` for the rest."""
    from sgl_kvevict.kernels import vo_norms

    assert view.o_proj is not None
    sig = value_signatures(view.v_buffer, view.slots)
    h, n = sig.shape[0], sig.shape[1]
    norms = torch.empty(h, n, dtype=torch.float32, device=sig.device)
    need = torch.ones(n, dtype=torch.bool, device=sig.device)
    old, old_sig = view.state.get("vo"), view.state.get("vo_sig")
    if old is not None and old_sig is not None and old.shape[0] == h and old_sig.shape[:2] == old.shape:
        kp = min(int(old.shape[1]), n)
        same = (sig[:, :kp] == old_sig[:, :kp].to(sig.device)).all(-1).all(0)  # every head's row
        need[:kp] = ~same
        norms[:, :kp] = old[:, :kp].to(norms.device)
    idx = need.nonzero().squeeze(1)
    if idx.numel() > 0:
        norms[:, idx] = vo_norms(view.v_buffer, view.slots[idx], view.o_proj).to(norms.device)
    return norms, sig, int(idx.numel())


def slot_vo_norms(view: LayerView) -> tuple[torch.Tensor, int]:
    """`(view.vo with its NaN rows computed in place, rows computed)`: the per-slot statistic, and
    `kernels.vo_norms` for the rows where it is stale or was never written (one host read, the count)."""
    from sgl_kvevict.kernels import vo_norms

    assert view.vo is not None and view.o_proj is not None
    vo = view.vo
    idx = torch.isnan(vo).any(0).nonzero().squeeze(1)
    if idx.numel() > 0:
        vo[:, idx] = vo_norms(view.v_buffer, view.slots[idx], view.o_proj).to(vo.device, vo.dtype)
    return vo, int(idx.numel())


def score_scale(base: Policy) -> float:
    """How many attention probabilities one unit of the base's score is (h2o/d2o sum the window)."""
    return float(base.config.window) if isinstance(base, H2OPolicy) else 1.0


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
        if view.o_proj is None:
            raise ValueError("criticalkv needs view.o_proj")
        a = self.base.score(view).float()
        sig = None
        if view.vo is not None:
            vo, computed = slot_vo_norms(view)
        else:
            vo, sig, computed = cached_vo_norms(view)
        view.stats["criticalkv_vo_computed"] = float(computed)  # norms this step computed (not reused)
        cand = view.candidates()
        b = min(max(0, budget), max(0, cand.stop - cand.start))
        eps = self.config.eps * (score_scale(self.base) if self.config.eps_on == "attention" else 1.0)
        s2 = (a + eps) * vo.to(a.device)
        b1 = math.floor(self.config.alpha * b)
        if b1 > 0:
            top1 = a[:, cand].topk(b1, dim=-1).indices + cand.start
            s2.scatter_(1, top1, float("inf"))
        keep = topk_keep(s2, view, b)
        if sig is None:  # the per-slot statistic moves with its rows: nothing to carry
            view.state.pop("vo", None)
            view.state.pop("vo_sig", None)
            return keep
        # the kept tokens' norms, in the order compaction leaves them, for the next compression
        kp = keep.to(sig.device)
        view.state["vo"] = vo.gather(1, kp.to(vo.device))
        view.state["vo_sig"] = sig.gather(1, kp.unsqueeze(-1).expand(-1, -1, sig.shape[2]))
        return keep
