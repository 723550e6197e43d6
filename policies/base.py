"""The policy contract: what a policy sees, what it decides, and when it runs.

A policy never touches SGLang. The runner (`sgl_kvevict/cache/compressor.py`) hands it a `LayerView` of one
request's *compressible region* for one layer: the row slots after the protected (tree-shared) prefix.

Region layout, per KV head, in position order (index 0 = first slot after the protected prefix):

    [0, n_sink)                       sinks: always kept (non-empty only when the prefix is shorter than `sinks`)
    [0, n_compacted)                  already compressed earlier: each head may hold *different* tokens in a slot
    [n_compacted, N)                  uncompressed tail: slot j holds the same token for every head
    [N - n_recent, N)                 recent window: always kept

`select` returns, per KV head, the region indices to keep, sorted ascending, the same count for every
head (invariant 5: equal budgets across heads and layers keep the paged layout rectangular and make
tensor parallelism free). The runner then merges (D2O), compacts and frees the rest.

Every count that decides slots is known on the host before any score is computed: the kept count is
`select`'s shape, and `raw_tail` says how many of the kept indices are, by construction, the region's
last tokens for every head (so they stay one token per slot). The runner never infers either from the
selected indices, so tensor-parallel ranks holding different heads agree on them without talking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

MAX_WINDOW = 1 << 16  # bound on every token count in a policy config (sinks, recent, interval, window)
Phase = Literal["prefill", "decode", "finish"]
Need = Literal["attn", "o_proj"]


def short(v: Any, limit: int = 40) -> str:
    """`repr(v)`, cut to `limit` characters: error messages never echo a megabyte of client input."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class PolicyConfig(BaseModel):
    """Fields every policy shares. Subclasses add their own; unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no bool for a number, no "5" for 5

    sinks: int = Field(
        4, ge=0, le=MAX_WINDOW, description="first tokens of the sequence always kept (attention sinks)"
    )
    recent: int = Field(32, ge=0, le=MAX_WINDOW, description="most recent tokens always kept")
    interval: int = Field(
        16, ge=1, le=MAX_WINDOW, description="decode steps of slack before compressing again"
    )
    window: int = Field(32, ge=1, le=MAX_WINDOW, description="last W queries used for attention-based scores")
    scope: Literal["request", "branch"] = Field(
        "request",
        description="what one budget caps: the request's new tokens ('request'), or the branch's whole own "
        "history since its branch point, earlier turns included ('branch')",
    )
    shared_prefix: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="tokens at the start of the sequence declared shared (a system prompt, a fork point): "
        "never compressed by branch scope",
    )


class WindowScoreConfig(PolicyConfig):
    """Policies whose scores come from the observation window: how a kept token's score survives."""

    carry: Literal["none", "max", "decay"] = Field(
        "max",
        description="combine a kept token's earlier score with the new window's: 'none' (the newest window "
        "decides alone), 'max' (its best score so far), 'decay' (carry_decay * earlier + new)",
    )
    carry_decay: float = Field(0.5, ge=0.0, le=1.0, description="weight of the earlier score under 'decay'")


def carry_scores(view: LayerView, scores: torch.Tensor, cfg: WindowScoreConfig) -> torch.Tensor:
    """Combine the window's `[H, N]` scores with those the region's first tokens (the kept ones, in
    order) carried from earlier compressions, and leave the result in `view.state["scored"]`; the runner
    keeps the kept tokens' entries as the next compression's carried scores.

    Why: a window of the newest queries forgets what earlier turns needed; re-scoring a whole branch
    history with it alone loses early facts that per-turn scoring kept."""
    scores = scores.float()
    old = view.state.get("carried")
    if cfg.carry != "none" and old is not None and old.shape[0] == scores.shape[0]:
        m = min(old.shape[1], scores.shape[1])
        scores = scores.clone()
        old = old[:, :m].to(scores.device)
        if cfg.carry == "max":
            scores[:, :m] = torch.maximum(scores[:, :m], old)
        else:
            scores[:, :m] = scores[:, :m] + cfg.carry_decay * old
    view.state["scored"] = scores
    return scores


@dataclass
class LayerView:
    """One request, one layer: the compressible region, read straight from SGLang's paged pool.

    `k_buffer`/`v_buffer` are the layer's whole pool tensors `[pool_slots, Hkv, D]`; `slots` are the
    region's slot ids `[N]` (int64). Dense copies are available through `keys()`/`values()`.
    """

    layer: int
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    slots: torch.Tensor
    n_sink: int
    n_recent: int
    n_compacted: int
    attn: torch.Tensor | None = None  # [Hkv, N] window attention (see kernels.window_attention)
    o_proj: torch.Tensor | None = None  # [Hq, D, hidden] per-query-head slices of W_O
    # [Hkv, N] float32 ||v W_O||_1 per region token, written when its value was (the server's per-slot
    # statistic); NaN where stale or never written. A policy may fill NaNs in place: the runner stores them.
    vo: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)  # per (request, layer), kept by the runner
    # per-layer statistics a policy reports: floats, or 0-dim device tensors that the runner reads only
    # where they are reported (a read inside the step would be a host sync)
    stats: dict[str, float | torch.Tensor] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.slots.numel())

    @property
    def n_kv_heads(self) -> int:
        return int(self.k_buffer.shape[1])

    def keys(self) -> torch.Tensor:
        """Dense `[Hkv, N, D]` copy of the region's keys (post-RoPE)."""
        return self.k_buffer[self.slots].transpose(0, 1)

    def values(self) -> torch.Tensor:
        return self.v_buffer[self.slots].transpose(0, 1)

    def require_attn(self, who: str) -> torch.Tensor:
        """`attn`, or a clear error naming the policy that needed it."""
        if self.attn is None:
            raise ValueError(f"{who} needs view.attn (window attention)")
        return self.attn

    def candidates(self) -> slice:
        """Region indices that may be evicted."""
        return slice(self.n_sink, self.n - self.n_recent)


def topk_keep(scores: torch.Tensor, view: LayerView, budget: int) -> torch.Tensor:
    """Keep sinks + recent + the `budget` best-scored candidates per head; sorted region indices."""
    h, n = scores.shape
    cand = view.candidates()
    n_cand = max(0, cand.stop - cand.start)
    b = min(budget, n_cand)
    fixed = torch.cat([torch.arange(0, view.n_sink), torch.arange(n - view.n_recent, n)])
    fixed = fixed.to(scores.device).unsqueeze(0).expand(h, -1)
    if b == 0:
        return fixed.sort(dim=-1).values
    top = scores[:, cand].float().topk(b, dim=-1).indices + cand.start
    return torch.cat([fixed, top], dim=-1).sort(dim=-1).values


def compacted_len(keep: torch.Tensor, n: int) -> int:
    """`n_compacted` after compacting `keep` ([Hkv, b] sorted) out of an `n`-token region.

    The kept suffix that is the same contiguous run `..., n-2, n-1` for every head still holds one token
    per slot for all heads (the uncompressed tail); everything before it is per-head. LagKV relies on
    this count to find its raw tail in the next round.
    """
    b = int(keep.shape[1])
    if b == 0:
        return 0
    expected = torch.arange(n - b, n, device=keep.device)
    # sorted unique indices are <= n - b + i, so a match at i implies a match at every later position
    run = int((keep == expected).all(dim=0).sum())
    return b - run


class Policy:
    """Base class. Subclasses set `name`, `Config`, `needs`, and override `score` (or `select`)."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig
    needs: ClassVar[frozenset[Need]] = frozenset()
    # True when scores are attention probabilities (CriticalKV's guarantee needs them).
    attention_scores: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    # -- when -------------------------------------------------------------------------------------
    def should_compress(
        self, n_region: int, n_sink: int, n_recent: int, n_compacted: int, budget: int, phase: Phase
    ) -> bool:
        """Default: after prefill/finish when over budget; in decode once `interval` tokens over it."""
        n_cand = n_region - n_sink - n_recent
        slack = self.config.interval if phase == "decode" else 0
        return n_cand > budget + slack

    # -- what -------------------------------------------------------------------------------------
    def score(self, view: LayerView) -> torch.Tensor:
        """`[Hkv, N]` importance per region token, higher = keep."""
        raise NotImplementedError

    def select(self, view: LayerView, budget: int) -> torch.Tensor:
        """`[Hkv, k]` sorted region indices to keep (k equal for every head)."""
        return topk_keep(self.score(view), view, budget)

    def raw_tail(self, view: LayerView) -> int:
        """Kept indices that are the region's last tokens for every head whatever the scores: the recent
        window by default. After compaction they remain the uncompressed tail (one token per slot)."""
        return view.n_recent

    def merge(self, view: LayerView, keep: torch.Tensor) -> None:
        """Optional: fold evicted tokens into kept slots in place, before compaction (D2O)."""
        return None

    @property
    def merges(self) -> bool:
        return type(self).merge is not Policy.merge

    def for_budget_ratio(self, ratio: float) -> Policy:
        """The policy to run when the budget is a ratio below 1: itself, unless the policy reads the
        ratio into its own parameters (LagKV's per-partition retention)."""
        return self


class Refiner(Policy):
    """A policy that re-ranks another policy's scores (GraphKV, CriticalKV): it wraps `self.base` and
    takes from it everything but the ranking: trigger, needs, raw tail and merge."""

    base: Policy

    def should_compress(
        self, n_region: int, n_sink: int, n_recent: int, n_compacted: int, budget: int, phase: Phase
    ) -> bool:
        return self.base.should_compress(n_region, n_sink, n_recent, n_compacted, budget, phase)

    def raw_tail(self, view: LayerView) -> int:
        return self.base.raw_tail(view)

    def merge(self, view: LayerView, keep: torch.Tensor) -> None:
        self.base.merge(view, keep)

    @property
    def merges(self) -> bool:
        return self.base.merges

    def for_budget_ratio(self, ratio: float) -> Policy:
        self.base = self.base.for_budget_ratio(ratio)
        return self
