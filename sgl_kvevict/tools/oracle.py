"""HF transformers reference for attention over an evicted KV cache: per-layer, per-KV-head masks at the
true positions, in one fp32 forward.

Why masking reproduces the server: the server keeps every token's post-RoPE K/V as computed and only
drops slots (per layer and KV head), and a token's K/V at layer l depends only on what its own query saw
at the layers below. So one HF forward over all tokens, where row p of the attention mask is what the
query of position p saw when the server computed it, gives the same hidden states, K/V and logits as the
server's step-by-step computation (up to float rounding). Merges that change K/V values (D2O) are not
reproducible by masking.

Two users:
- the eviction-path oracle (`tests/test_oracle_e2e.py`): the server's `kept_timeline` (KVEVICT_DEBUG=1)
  becomes the mask rows (`visibility`), and the server's greedy tokens are compared with HF's argmax
  (`check_tokens`);
- `benchmarks/fidelity.py`: a policy's selection over a prefilled context masks the cached past
  (`PastMask`) while a question is teacher-forced.

A timeline is a list of events `{"tokens": T, "positions": P}`, `P[l][h]` the sorted logical positions
that layer l / KV head h holds after the event; every token at position >= T then gets its K/V appended.
The query at position p sees `P[l][h] ∪ [T, p]` for the last event (in list order) with `T <= p`;
positions before the first event are plain causal (computed by a request with nothing evicted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

ATTN_IMPL = "kvevict_masked"

Timeline = list[dict[str, Any]]


# -- timelines -> masks ---------------------------------------------------------------------------------


def validate(timeline: Timeline, n_layers: int, n_kv_heads: int) -> None:
    """Shape and ordering checks, so a malformed export fails here with the event named, not as a wrong
    mask later."""
    for i, ev in enumerate(timeline):
        if set(ev) < {"tokens", "positions"}:
            raise ValueError(f"event {i}: needs 'tokens' and 'positions', got {sorted(ev)}")
        t, pos = int(ev["tokens"]), ev["positions"]
        if t < 0:
            raise ValueError(f"event {i}: tokens {t} < 0")
        if len(pos) != n_layers:
            raise ValueError(f"event {i}: {len(pos)} layers, expected {n_layers}")
        for li, heads in enumerate(pos):
            if len(heads) != n_kv_heads:
                raise ValueError(f"event {i} layer {li}: {len(heads)} KV heads, expected {n_kv_heads}")
            for h, p in enumerate(heads):
                if any(b <= a for a, b in zip(p, p[1:], strict=False)):
                    raise ValueError(f"event {i} layer {li} head {h}: positions not strictly ascending")
                if p and (p[0] < 0 or p[-1] >= t):
                    raise ValueError(f"event {i} layer {li} head {h}: positions outside [0, {t})")


def row_events(timeline: Timeline, n: int) -> torch.Tensor:
    """`[n]` int64: index of the event that governs each query position (-1: plain causal)."""
    owner = torch.full((n,), -1, dtype=torch.int64)
    for i, ev in enumerate(timeline):
        t = int(ev["tokens"])
        if t < n:
            owner[t:] = i
    return owner


def visibility(timeline: Timeline, n: int, layer: int, n_kv_heads: int) -> torch.Tensor:
    """`[Hkv, n, n]` bool: entry `[h, p, k]` says whether the query at position p saw the K/V of
    position k at this layer and KV head."""
    ar = torch.arange(n)
    causal = ar.unsqueeze(0) <= ar.unsqueeze(1)  # [q, k]
    mask = causal.unsqueeze(0).repeat(n_kv_heads, 1, 1)
    owner = row_events(timeline, n)
    for i, ev in enumerate(timeline):
        rows = (owner == i).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        t = int(ev["tokens"])
        keep = torch.zeros(n_kv_heads, n, dtype=torch.bool)
        for h, p in enumerate(ev["positions"][layer]):
            keep[h, torch.as_tensor(p, dtype=torch.int64)] = True
        keep[:, t:] = True  # appended after the event; causality (k <= p) still applies
        mask[:, rows, :] = keep.unsqueeze(1) & causal[rows].unsqueeze(0)
    return mask


def admission_mismatch(prev: Timeline, admission: dict[str, Any], computed: int | None = None) -> str | None:
    """The next turn's admission must hold exactly what the previous request held of the matched prefix:
    its last event's positions plus the tokens appended after it, cut at the admission's token count
    (`computed`: how many tokens' K/V the previous request computed, if known). Returns a description of
    the first difference, or None."""
    last = prev[-1]
    t, t_prev = int(admission["tokens"]), int(last["tokens"])
    if computed is not None and t > computed:
        return f"admission matched {t} tokens but the previous request computed K/V for only {computed}"
    for li, (heads, heads_prev) in enumerate(zip(admission["positions"], last["positions"], strict=True)):
        for h, (p, q) in enumerate(zip(heads, heads_prev, strict=True)):
            want = [x for x in q if x < t] + list(range(t_prev, t))
            if list(p) != want:
                diff = sorted(set(p) ^ set(want))[:8]
                return f"layer {li} head {h}: admission holds {len(p)} positions, previous held {len(want)} (differ at {diff})"
    return None


def compose(turns: Sequence[Timeline]) -> Timeline:
    """One timeline for a conversation: each turn's events after the previous turns'. Positions before a
    turn's admission keep the rows of the request that computed their K/V (the last event rule)."""
    out: Timeline = []
    for tl in turns:
        out.extend(tl)
    return out


# -- the attention function -------------------------------------------------------------------------------


class MaskSource(Protocol):
    def mask(self, layer: int, q_len: int, kv_len: int) -> torch.Tensor | None:
        """`[Hkv, q_len, kv_len]` bool (True = visible), ANDed with causality; None = plain causal."""

    def observe(self, layer: int, query: torch.Tensor) -> None:
        """Sees each layer's post-RoPE queries `[1, Hq, q_len, D]` (capture for window scores)."""


@dataclass
class TimelineMask:
    """Masks of one full-sequence forward (no cache) from a timeline; built lazily per layer."""

    timeline: Timeline
    n_kv_heads: int

    def mask(self, layer: int, q_len: int, kv_len: int) -> torch.Tensor:
        if q_len != kv_len:
            raise ValueError("TimelineMask is for one forward over the whole sequence (no KV cache)")
        return visibility(self.timeline, kv_len, layer, self.n_kv_heads)

    def observe(self, layer: int, query: torch.Tensor) -> None:
        pass


@dataclass
class PastMask:
    """Per-layer `[Hkv, C]` keep masks over the first C cached positions; later keys all visible."""

    masks: Sequence[torch.Tensor] | None = None
    capture_window: int = 0  # > 0: keep the last W queries of each layer in `queries`
    queries: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, layer: int, q_len: int, kv_len: int) -> torch.Tensor | None:
        if self.masks is None or kv_len == q_len:  # no past: the prefill itself is plain causal
            return None
        keep = self.masks[layer]
        m = torch.ones(keep.shape[0], q_len, kv_len, dtype=torch.bool)
        m[:, :, : keep.shape[1]] = keep.unsqueeze(1)
        return m

    def observe(self, layer: int, query: torch.Tensor) -> None:
        if self.capture_window:
            self.queries[layer] = query[0, :, -self.capture_window :].detach().clone()


_ACTIVE: list[MaskSource] = []


@contextlib.contextmanager
def masking(source: MaskSource | None) -> Iterator[None]:
    """Forwards of a model loaded with `attn_implementation=ATTN_IMPL` inside this block use `source`."""
    if source is None:
        yield
        return
    _ACTIVE.append(source)
    try:
        yield
    finally:
        _ACTIVE.pop()


def masked_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Eager attention (softmax in fp32), causal by construction, with the active source's mask.

    The new queries are the last `q_len` positions of the `kv_len` keys (HF's cache convention); batch 1.
    """
    b, hq, s, d = query.shape
    if b != 1:
        raise ValueError("the masked attention takes one sequence at a time")
    hkv, n_all = key.shape[1], key.shape[2]
    g = hq // hkv
    src = _ACTIVE[-1] if _ACTIVE else None
    if src is not None:
        src.observe(module.layer_idx, query)
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    logits = torch.matmul(query, k.transpose(-1, -2)) * (scaling if scaling is not None else d**-0.5)
    qpos = torch.arange(n_all - s, n_all).unsqueeze(1)
    allowed = (torch.arange(n_all).unsqueeze(0) <= qpos).unsqueeze(0)  # [1, s, n_all]
    m = src.mask(module.layer_idx, s, n_all) if src is not None else None
    if m is not None:
        allowed = allowed & m.repeat_interleave(g, dim=0)  # KV head -> its group of query heads
    logits = logits.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = logits.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, v)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_IMPL, masked_attention)
    AttentionMaskInterface.register(ATTN_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTN_IMPL


def load_model(path: str | None = None) -> Any:
    """The model in fp32 with the masked attention (default: the embedded SmolLM2)."""
    from transformers import AutoModelForCausalLM

    if path is None:
        from sgl_kvevict.model import default_model_path

        path = str(default_model_path())
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=register()
    ).eval()


def timeline_logits(
    model: Any, ids: Sequence[int], timeline: Timeline, rows: Sequence[int] | None = None
) -> torch.Tensor:
    """fp32 logits of one forward over `ids` at positions 0..n-1 under the timeline: `[n, vocab]`, or
    `[len(rows), vocab]` for the given query positions only (the LM head is a fifth of this model)."""
    cfg = model.config
    validate(timeline, cfg.num_hidden_layers, cfg.num_key_value_heads)
    n = len(ids)
    with torch.no_grad(), masking(TimelineMask(timeline, cfg.num_key_value_heads)):
        hidden = model.model(
            input_ids=torch.tensor([list(ids)]), position_ids=torch.arange(n).unsqueeze(0), use_cache=False
        ).last_hidden_state[0]
        if rows is not None:
            hidden = hidden[torch.as_tensor(list(rows), dtype=torch.int64)]
        return model.lm_head(hidden).float()


# -- comparing greedy tokens ------------------------------------------------------------------------------


@dataclass
class TokenCheck:
    """Greedy tokens (and their log-probabilities, if the server returned them) vs HF at the same positions."""

    compared: int = 0
    ties: list[tuple[int, float]] = field(default_factory=list)  # (position, gap): allowed flips
    mismatches: list[tuple[int, int, int, float]] = field(default_factory=list)  # (pos, server, hf, gap)
    logprob_errors: list[tuple[int, float]] = field(default_factory=list)  # (pos, |diff|) over tolerance
    max_logprob_diff: float = 0.0

    def merge(self, other: TokenCheck) -> TokenCheck:
        self.compared += other.compared
        self.ties += other.ties
        self.mismatches += other.mismatches
        self.logprob_errors += other.logprob_errors
        self.max_logprob_diff = worse(self.max_logprob_diff, other.max_logprob_diff)
        return self

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.logprob_errors

    def describe(self) -> str:
        s = f"{self.compared} tokens compared, {len(self.ties)} near-ties"
        if self.ties:
            s += " (" + ", ".join(f"pos {p} gap {g:.2g}" for p, g in self.ties) + ")"
        s += f", max |logprob diff| {self.max_logprob_diff:.2g}"
        if self.mismatches:
            s += "; TOKEN MISMATCHES " + ", ".join(
                f"pos {p}: server {a} vs HF {b} (gap {g:.3g})" for p, a, b, g in self.mismatches[:10]
            )
        if self.logprob_errors:
            s += "; LOGPROB ERRORS " + ", ".join(f"pos {p}: {d:.3g}" for p, d in self.logprob_errors[:10])
        return s


def worse(worst: float, x: float) -> float:
    """The larger of two errors, NaN worse than any number and kept (`max(0.0, nan)` is 0.0: NaN lost)."""
    return x if x != x or x > worst else worst


def check_tokens(
    logits: torch.Tensor,
    rows: Sequence[int],
    ids: Sequence[int],
    tol: float,
    server_logprobs: Sequence[float] | None = None,
    logprob_tol: float = 1e-3,
) -> TokenCheck:
    """Compare the server's greedy token `ids[p + 1]` with HF's argmax of `logits[i]` (position
    `p = rows[i]`), and the server's log-probability of it (if given) with HF's.

    A differing token is a near-tie (allowed, counted) when HF's logit of its own argmax exceeds its
    logit of the server's token by less than `tol`; anything else is a mismatch.
    """
    res = TokenCheck()
    logp = logits.log_softmax(-1)
    for i, (row, pos) in enumerate(zip(logits, rows, strict=True)):
        want, got = int(row.argmax()), int(ids[pos + 1])
        res.compared += 1
        if server_logprobs is not None:
            d = abs(float(logp[i, got]) - float(server_logprobs[i]))
            res.max_logprob_diff = worse(res.max_logprob_diff, d)
            if not d <= logprob_tol:  # NaN fails
                res.logprob_errors.append((pos, d))
        if want == got:
            continue
        gap = float(row[want] - row[got])
        if gap < tol:
            res.ties.append((pos, gap))
        else:
            res.mismatches.append((pos, got, want, gap))
    return res


@dataclass
class Turn:
    """One request of a conversation as the server saw it: its input ids, greedy output ids and timeline."""

    input_ids: list[int]
    output_ids: list[int]
    timeline: Timeline
    output_logprobs: list[float] | None = None  # the server's log-probability of each output token

    @property
    def ids(self) -> list[int]:
        return self.input_ids + self.output_ids


def check_conversation(
    model: Any, turns: Sequence[Turn], tol: float, logprob_tol: float = 1e-3
) -> TokenCheck:
    """Check every output token of a conversation (one turn = one request) against HF.

    Each turn's input must extend the previous turn's ids, and its admission must hold exactly what the
    previous turn kept (`admission_mismatch`). The K/V of a position comes from the request that computed
    it, so the turns' timelines are composed; one forward checks several turns as long as no later
    admission recomputes a position their outputs depend on (otherwise a forward per turn).
    The first turn must have matched an uncompressed prefix (computed with nothing evicted).
    """
    if not turns:
        return TokenCheck()
    first = turns[0].timeline[0] if turns[0].timeline else None
    if first is not None:
        t = int(first["tokens"])
        for li, heads in enumerate(first["positions"]):
            if any(list(p) != list(range(t)) for p in heads):
                raise ValueError(
                    f"turn 1 matched a compressed prefix at layer {li}: its history is unknown here"
                )
    res, composed, pending = TokenCheck(), [], []
    lps: list[float] | None = []
    for k, turn in enumerate(turns):
        if not turn.timeline and k:
            raise ValueError(f"turn {k + 1}: empty timeline (a later turn always has an admission)")
        if k:
            prev = turns[k - 1]
            if turn.input_ids[: len(prev.ids)] != prev.ids:
                raise ValueError(f"turn {k + 1}: input does not extend turn {k}'s ids")
            # the K/V of the previous turn's last output token was never computed
            err = admission_mismatch(prev.timeline, turn.timeline[0], len(prev.ids) - 1)
            if err:
                raise AssertionError(f"turn {k + 1} admission: {err}")
        composed = compose([composed, turn.timeline])
        full = turn.ids
        pending.extend(range(len(turn.input_ids) - 1, len(full) - 1))
        have_lp = turn.output_logprobs is not None and lps is not None
        lps = [*lps, *turn.output_logprobs] if have_lp else None
        nxt = int(turns[k + 1].timeline[0]["tokens"]) if k + 1 < len(turns) else None
        if nxt is None or nxt <= len(full) - 2:
            logits = timeline_logits(model, full, composed, pending)
            res.merge(check_tokens(logits, pending, full, tol, lps, logprob_tol))
            pending, lps = [], []
    return res
