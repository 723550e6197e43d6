"""`d2o`: Dynamic Discriminative Operations (Wan et al. 2024, arXiv 2406.13035).

Token level: H2O-style eviction, plus sinks and a recent window; with `merge` on (the paper's method, off
by default: on the recall suite's multikey family it cost 3 of 12 answers), each evicted token is then
merged into its most key-similar kept token when the similarity clears an EMA threshold
(`kernels.d2o_merge`; tau kept per (request, layer) in `view.state["tau"]`, tau_0 = mean similarity at
the first compression, then tau <- beta * cur + (1 - beta) * tau).

Scores (`scores`). The paper accumulates the attention every query paid each token, over the prompt and
every decode step. Paged attention returns no probabilities, so a second attention pass over the whole
context at every step would be needed for that. 'accumulated' approximates it without one: at each
compression the captured window's attention (mean over the last `window` queries) is credited once per
query that arrived since the previous compression (at most `window`) and added to the kept tokens'
carried sums; cost per compression is one `[Hkv, N]` add on top of the window attention every
attention policy computes anyway. 'window' is `h2o`'s reading (attn * window, carried by max).

Threshold (`threshold`). 'max': per KV head, the step's best similarity as the EMA's current term (the
paper's Eq. 10 as written); 'mean': one scalar per layer, the mean of per-token best similarities (the
authors' released code).

Defaults are chosen from the recall measurement in docs/benchmarks.md (merge on/off, both score and threshold
readings, at equal KV): see its D2O section for the numbers and the command.

Recent window: the paper splits the layer budget N:M = 3:1 between heavy hitters and recent tokens.
`recent_fraction` (default 0.25) is M / (N + M) of the kept non-sink tokens (candidate budget + the
runner's `recent`): the newest candidates are kept on top of `recent` until the recent part reaches it.
Set 0 for plain H2O-style selection beyond the runner's window.

Layer level: the paper gives each layer alpha_l = L_layers * softmax_l(1 / sigma2_l) of the average budget,
sigma2_l = variance over tokens of the column-summed prompt attention. Budgets here stay uniform across
layers, for a structural reason: SGLang's paged KV gives a token one slot index in `req_to_token`, and
that slot holds its K and V in *every* layer's buffer. A layer that keeps fewer tokens than another
cannot free a slot the other layer still uses, so an unequal allocation saves no memory at all; at the
same memory it would only drop tokens from the layers the paper rates sparse. (The paper's own gain from
the layer level, its ablation "without layer operation", is 1.0-1.9 points at 20% KV on Llama-3-8B.) Unequal layers
would need a per-layer slot map, which SGLang's attention kernels do not take. So the allocation is
only *reported*:
`view.stats["d2o_sigma2"]` (head-averaged variance of the window column sums, attn * window, over the
region) and `view.stats["d2o_inv_var"]` = 1 / sigma2, the softmax logit; alpha_l is
L_layers * softmax over layers of `d2o_inv_var`. Like `d2o_merged` (evicted tokens merged), they are
0-dim device tensors: the step never reads them back (a host sync would stall a GPU scheduler), the
runner's report does (`report.stats`).

Readings chosen where the paper is silent (reconstructed): keys-only cosine similarity; the updated
threshold is compared; merged tokens keep their own slot's carried score (h2o's `carry`);
`merge=False` gives the paper's "without merging" ablation.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from .base import MERGED_STAT, LayerView, topk_keep
from .h2o import H2OConfig, H2OPolicy
from .registry import register


class D2OConfig(H2OConfig):
    recent_fraction: float = Field(0.25, ge=0.0, lt=1.0, description="M / (N + M); paper N:M = 3:1 -> 0.25")
    beta: float = Field(0.7, gt=0.0, le=1.0, description="EMA weight of the current step's max similarity")
    merge: bool = Field(
        False,
        description="merge evicted tokens into kept ones (the paper's merge; off by default: it costs "
        "answers on the recall suite's multikey family)",
    )
    scores: Literal["window", "accumulated"] = Field(
        "window",
        description="'accumulated': each compression adds the window's attention, credited to the queries "
        "that arrived since the last one, to the kept tokens' carried sums (the paper's running H2O sum "
        "without a second attention pass); 'window': h2o's reading (window score, `carry` across steps)",
    )
    threshold: Literal["max", "mean"] = Field(
        "max",
        description="EMA threshold's current term: 'max' = per KV head, the step's best similarity "
        "(the paper's Eq. 10); 'mean' = one scalar per layer, the mean of per-token best similarities "
        "(the authors' released code)",
    )


@register
class D2OPolicy(H2OPolicy):
    """H2O's window-accumulated score (inherited), its own selection split and the merge."""

    name = "d2o"
    Config = D2OConfig
    config: D2OConfig

    def score(self, view: LayerView) -> torch.Tensor:
        if self.config.scores == "window":
            return super().score(view)
        # Accumulated: the paper sums the attention every query ever paid a token. The window's mean
        # attention stands in for each query that arrived since the last compression (the region grew
        # by exactly those tokens; at most `window` of them are credited: the rest were never captured).
        attn = view.require_attn(self.name).float()
        old = view.state.get("carried")
        fresh = view.n - (old.shape[1] if old is not None else 0)
        s = attn * float(max(0, min(fresh, self.config.window)))
        if old is not None and old.shape[0] == s.shape[0]:
            m = min(old.shape[1], s.shape[1])
            s[:, :m] += old[:, :m].to(s.device)
        view.state["scored"] = s
        return s

    def select(self, view: LayerView, budget: int) -> torch.Tensor:
        s = self.score(view)
        self._report_density(view, s)
        cand = view.candidates()
        n_cand = max(0, cand.stop - cand.start)
        total = min(budget, n_cand) + view.n_recent
        extra = min(max(0, round(self.config.recent_fraction * total) - view.n_recent), budget, n_cand)
        if extra > 0:
            s = s.clone()
            s[:, cand.stop - extra : cand.stop] = float("inf")
        return topk_keep(s, view, budget)

    @staticmethod
    def _report_density(view: LayerView, colsum: torch.Tensor) -> None:
        """Device tensors (0-dim): the runner reads them only where they are reported, not in the step."""
        if colsum.shape[1] < 2:
            return
        sigma2 = colsum.var(dim=-1).mean()
        view.stats["d2o_sigma2"] = sigma2
        view.stats["d2o_inv_var"] = 1.0 / sigma2.clamp_min(1e-30)

    @property
    def merges(self) -> bool:
        """Only with `merge` on: without it D2O is a selection like H2O's and takes the batched path."""
        return self.config.merge

    def merge(self, view: LayerView, keep: torch.Tensor) -> None:
        if not self.config.merge:
            return
        from sgl_kvevict.kernels import d2o_merge

        tau = view.state.get("tau")
        counts: dict[str, Any] = {}
        view.state["tau"] = d2o_merge(
            view.k_buffer,
            view.v_buffer,
            view.slots,
            keep,
            tau,
            self.config.beta,
            tau is None,
            counts,
            self.config.threshold,
        )
        view.stats[MERGED_STAT] = counts["merged"]  # a device tensor: no host sync in the step
