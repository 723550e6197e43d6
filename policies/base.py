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

from . import ragged

MAX_WINDOW = 1 << 16  # bound on every token count in a policy config (sinks, recent, interval, window)
Phase = Literal["prefill", "decode", "finish"]
# The `LayerView.stats` entry where a merging policy reports how many evicted tokens it merged (a device
# count; the runner adds it to the request's and the server's `merged` totals).
MERGED_STAT = "d2o_merged"
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
        "history since its branch point, earlier turns included ('branch'); a server that recalls "
        "(--kv-recall-tokens) defaults --kv-scope to 'branch'",
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


@dataclass
class Kept:
    """One request's batched step in host integers, known before any score: the region length `n`, its
    sinks and recent window, the kept count `k`, and `raw`, how many of the kept are the region's last
    tokens for every head (`raw_tail`). Subclasses add what their selection needs (LagKV's)."""

    n: int
    n_sink: int
    n_recent: int
    k: int
    raw: int


@dataclass
class BatchView:
    """Many requests, every layer: the batched counterpart of `LayerView`, `[requests, layers, KV heads,
    tokens]`. Regions are padded to the longest (`Nmax`); every ragged count is a host integer in
    `counts` (from `Policy.batch_counts`), so a selection over it needs no read back from the device.

    `slots`: `[R, Nmax]` int64 region slots, the padding repeating a real slot of its row; `valid`:
    `[R, Nmax]` which are real. `k_buffers`/`v_buffers`: each layer's whole pool tensor `[pool_slots,
    Hkv, D]`. `attn`: `[R, L, Hkv, Nmax]` window attention, zeros in the padding (policies that need
    "attn"). `states`/`stacks`: each request's per-layer state dicts and the stacked `[L, Hkv, m]`
    carried scores its last batched compression left (read by `carry_batch`)."""

    slots: torch.Tensor
    valid: torch.Tensor
    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    counts: list[Any]
    attn: torch.Tensor | None = None
    states: list[list[dict[str, Any]]] = field(default_factory=list)
    stacks: list[torch.Tensor | None] = field(default_factory=list)
    # out: `[R, L, Hkv, Nmax]` scores whose kept entries the runner carries to the next compression
    scored: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """`(R, L, Hkv, Nmax)`."""
        r, nmax = self.slots.shape
        return r, len(self.k_buffers), int(self.k_buffers[0].shape[1]), nmax

    def col(self, values: list[int]) -> torch.Tensor:
        """A host `[R, 1]` int64 column of per-request integers."""
        return torch.tensor(values, dtype=torch.int64).view(-1, 1)

    @classmethod
    def of_layer(cls, view: LayerView, counts: Any = None) -> BatchView:
        """The batch of one request and one layer that `view` is: no padding, the view's own per-layer
        state (so carried scores are read from it). `counts` defaults to the view's windows with every
        token kept (a score needs no budget); a selection passes its own."""
        n = view.n
        kept = Kept(n, view.n_sink, view.n_recent, n, view.n_recent) if counts is None else counts
        return cls(
            slots=view.slots.view(1, -1),
            valid=torch.ones(1, n, dtype=torch.bool, device=view.slots.device),
            k_buffers=[view.k_buffer],
            v_buffers=[view.v_buffer],
            counts=[kept],
            attn=None if view.attn is None else view.attn.float().view(1, 1, *view.attn.shape),
            states=[[view.state]],
            stacks=[None],
        )


def pad_sorted(keep: torch.Tensor, ks: list[int], nmax: int) -> torch.Tensor:
    """`keep` `[R, L, H, Kmax]` with the entries past each request's own k set to `nmax` (so they go
    last), then every head's indices in position order: what `Policy.select_batch` returns."""
    r, kmax = keep.shape[0], keep.shape[-1]
    past = (torch.arange(kmax).unsqueeze(0) >= torch.tensor(ks).view(-1, 1)).to(keep.device)  # [R, Kmax]
    return keep.masked_fill(past.view(r, 1, 1, kmax), nmax).sort(dim=-1).values


def topk_keep_batch(scores: torch.Tensor, batch: BatchView) -> torch.Tensor:
    """`topk_keep` for a batch: sinks, recent and each request's best `k - sinks - recent` candidates per
    (layer, head) of `[R, L, H, Nmax]` scores. Equal budgets across layers and heads make one top-k
    over all of them exact; returns what `Policy.select_batch` returns."""
    R, _, _, nmax = batch.shape  # noqa: N806
    dev = scores.device
    pos = torch.arange(nmax, dtype=torch.int64).unsqueeze(0)
    n_col = batch.col([c.n for c in batch.counts])
    sink_col = batch.col([c.n_sink for c in batch.counts])
    recent_col = batch.col([c.n_recent for c in batch.counts])
    fixed = ((pos < sink_col) | ((pos >= n_col - recent_col) & (pos < n_col))).to(dev)
    ranked = scores.masked_fill(~batch.valid.view(R, 1, 1, nmax), float("-inf"))
    ranked = ranked.masked_fill(fixed.view(R, 1, 1, nmax), float("inf"))
    ks = [c.k for c in batch.counts]
    keep = ranked.topk(max(ks), dim=-1).indices  # fixed first, then the best candidates
    return pad_sorted(keep, ks, nmax)


def carry_batch(batch: BatchView, scores: torch.Tensor, cfg: WindowScoreConfig) -> torch.Tensor:
    """Combine the window's new `[R, L, H, Nmax]` scores with those each request's first tokens (the kept
    ones, in order) carried from its last compression: 'max' or 'decay' (`WindowScoreConfig.carry`);
    'none' ignores them. Leaves the result in `batch.scored`, whose kept entries the runner carries on
    (the per-request path, a batch of one, in `view.state["scored"]`).

    Why: a window of the newest queries forgets what earlier turns needed; re-scoring a whole branch
    history with it alone loses early facts that per-turn scoring kept."""
    batch.scored = scores = _carry_batch(batch, scores, cfg)
    return scores


def _carry_batch(batch: BatchView, scores: torch.Tensor, cfg: WindowScoreConfig) -> torch.Tensor:
    if cfg.carry == "none":
        return scores
    R, L, H, nmax = scores.shape  # noqa: N806
    olds, lens = [], []
    for r, c in enumerate(batch.counts):
        old = carried_stack(batch.states[r], batch.stacks[r])
        m = 0 if old is None else min(int(old.shape[-1]), c.n)
        lens.append(m)
        if m:
            olds.append(old[..., :m].to(scores.device, torch.float32).reshape(L * H, m))
    if not any(lens):
        return scores
    flat = torch.cat(olds, dim=1)  # [L*H, sum m]
    idx = ragged.aranges([r * nmax for r in range(R)], lens).to(scores.device, non_blocking=True)
    prior = torch.full((L * H, R * nmax), float("-inf") if cfg.carry == "max" else 0.0, device=scores.device)
    prior.index_copy_(1, idx, flat)
    prior = prior.view(L, H, R, nmax).permute(2, 0, 1, 3)
    if cfg.carry == "max":
        return torch.maximum(scores, prior)
    return scores + cfg.carry_decay * prior


def carried_stack(states: list[dict[str, Any]], base: torch.Tensor | None) -> torch.Tensor | None:
    """`[L, H, m]` carried scores of a request: `base`, the stacked tensor its last batched compression
    left (when every layer's entry is still a view of it), else a stack of the per-layer entries."""
    per = [d.get("carried") for d in states]
    if not per or any(x is None for x in per):
        return None
    if (
        base is not None
        and base.shape[0] == len(per)
        and all(x.data_ptr() == base[i].data_ptr() and x.shape == base[i].shape for i, x in enumerate(per))
    ):
        return base
    if len({tuple(x.shape) for x in per}) != 1:
        return None
    return torch.stack(per)


class Policy:
    """Base class. Subclasses set `name`, `Config`, `needs`, and override `score` (or `select`)."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig
    needs: ClassVar[frozenset[Need]] = frozenset()
    # True when scores are attention probabilities (CriticalKV's guarantee needs them).
    attention_scores: ClassVar[bool] = False
    # True when the policy selects over a batch (`select_batch`, by default `score_batch` + top-k): the
    # runner then compresses all the requests of a step that use it in one pass (the fast path). A
    # subclass that overrides `score`, `select` or `raw_tail` without its own batched counterpart is
    # not batchable unless it says so itself (`__init_subclass__`).
    batchable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "batchable" in cls.__dict__:
            return
        per_request = any(m in cls.__dict__ for m in ("score", "select", "raw_tail"))
        batched = any(m in cls.__dict__ for m in ("score_batch", "select_batch", "batch_counts"))
        if per_request and not batched:
            cls.batchable = False

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
        """`[Hkv, N]` importance per region token, higher = keep. By default `score_batch` over the batch
        of one request and one layer (`BatchView.of_layer`): a policy writes its score once, and the
        per-request path runs the same rule as the batched one. The scores it carries to the next
        compression land in `view.state["scored"]` (`carry_batch`)."""
        if type(self).score_batch is Policy.score_batch:
            raise NotImplementedError(f"policy {self.name!r} defines neither score nor score_batch")
        one = BatchView.of_layer(view)
        scores = self.score_batch(one)[0, 0]
        if one.scored is not None:
            view.state["scored"] = one.scored[0, 0]
        return scores

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

    # -- what, for a batch (policies with `batchable`) ---------------------------------------------
    def batch_counts(self, n: int, n_sink: int, n_recent: int, n_compacted: int, budget: int) -> Kept:
        """The host half of `select_batch` for one request: its kept count and raw tail, read from no
        tensor. Default: sinks + recent + up to `budget` candidates, the recent window raw. May raise
        when the batched selection cannot take the request (its group then runs per request)."""
        b = min(budget, max(0, n - n_sink - n_recent))
        return Kept(n, n_sink, n_recent, n_sink + b + n_recent, n_recent)

    def score_batch(self, batch: BatchView) -> torch.Tensor:
        """`[R, L, Hkv, Nmax]` float32 scores of every request's region on every layer (`score` for a
        batch; the padding is never kept, whatever its score)."""
        raise NotImplementedError

    def select_batch(self, batch: BatchView) -> torch.Tensor:
        """`[R, L, Hkv, Kmax]` kept region indices per request, layer and head: each request's first
        `batch.counts[r].k` sorted, the rest `Nmax` (`pad_sorted`). Must keep what `select` keeps."""
        return topk_keep_batch(self.score_batch(batch), batch)

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
