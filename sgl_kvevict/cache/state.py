"""Per-request compression state, kept on the `Req` object (SGLang's `ReqKvInfo` has `slots=True`).

`ReqState` is the one object that knows how a request's logical tokens map to its KV slots; every hook
converts through its methods (`slots_for`, `tokens_for`) instead of doing its own arithmetic.

Row layout of a request under compression (KV space, i.e. positions in its `req_to_token` row):

    [0, anchor_kv)                         matched prefix, owned by the tree (never written)
    [anchor_kv, anchor_kv + comp_slots)    compacted history: per KV head, kept tokens in position order
    [anchor_kv + comp_slots, kv_len)       uncompressed tail: one token per slot, 1:1 with the last tokens

`anchor_tokens - anchor_kv` tokens were already evicted inside the matched prefix (a compressed node)
and `own_evicted` in the request's own region; their sum is the position offset of its next token.

`fingerprint` names what would produce a compressed history (policy, budget, full policy config): the
tree lets a request through a compressed node only when the fingerprints are equal, the way SGLang
keeps LoRA adapters and cache salts apart with `RadixKey.extra_key`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_kvevict.cache.runtime import LazyCount
from sgl_kvevict.config import KvConfig, request_override, server_config
from sgl_kvevict.policies import Policy

logger = logging.getLogger("sgl_kvevict")
ATTR = "_kvevict"
# Test/debug only: prefix digests and the kept-position timeline in meta_info (costs a host copy per event).
DEBUG = os.environ.get("KVEVICT_DEBUG", "0") == "1"


def fingerprint(cfg: KvConfig, policy: Policy) -> str | None:
    """Identity of a compressed history's producer; None for `none` (it never produces or reads one)."""
    if not cfg.active:
        return None
    config = policy.config.model_dump(mode="json", exclude={"shared_prefix"})  # where, not how
    raw = json.dumps({"policy": cfg.policy, "budget": cfg.budget, "config": config}, sort_keys=True)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


@dataclass
class ReqState:
    cfg: KvConfig
    policy: Policy
    fp: str | None = None
    anchor: Any = None  # TreeNode at the end of the matched prefix
    anchor_tokens: int = 0
    anchor_kv: int = 0
    own_evicted: int = 0
    reused_evicted: int = 0  # tokens already evicted in the history the request matched
    inherited_evicted: int = 0  # of `own_evicted`, those of a matched branch history (not this request's)
    comp_slots: int = 0
    comp_tokens: int = 0
    after_extend: bool = False  # the next compression check is the one right after a prefill
    releasing: bool = False  # released unfinished (retraction): the tree checkpoint gets a slot count
    failed: bool = False
    deferred: int = 0  # scheduler steps this request's compression waited (--kv-compress-step-tokens)
    pending: Any = None  # compressor.Pending: a compression planned over several steps, not committed yet
    ran: bool = False  # KV was allocated since the last match (a later match is a re-admission)
    commit: bool = False  # generates nothing: a prefix commit (SGLang's frontend before `fork`), kept whole
    compressions: int = 0
    merged_count: LazyCount = field(default_factory=LazyCount)  # D2O's merges; read as `merged`
    seconds: float = 0.0
    layer_state: list[dict] = field(default_factory=list)
    carry_stack: torch.Tensor | None = None  # [L, H, k]: the carried scores the layers' entries view
    # per layer: floats or 0-dim device tensors (read where reported, `compressor.stats`)
    layer_stats: dict[str, list[float | torch.Tensor]] = field(default_factory=dict)
    prefix_digest: str = ""
    digest_kv: int = 0  # slots the digests cover: the shared prefix at admission
    prefix_digest_end: str = ""
    # debug (KVEVICT_DEBUG=1): logical positions held by row slots [0, m) per layer and KV head, the
    # logical tokens they stand for, and the events a test oracle replays (see `debug_event`).
    dbg_pos: torch.Tensor | None = None
    dbg_tokens: int = 0
    timeline: list[dict] = field(default_factory=list)

    @property
    def merged(self) -> int:
        """Evicted tokens merged into kept ones (D2O), read here (a host sync), not in the step."""
        return self.merged_count.value()

    @property
    def offset(self) -> int:
        """Tokens evicted before the request's next token: logical position = KV slot index + offset."""
        return self.anchor_tokens - self.anchor_kv + self.own_evicted

    def slots_for(self, tokens: int) -> int:
        """KV slots that hold the first `tokens` logical tokens (the cut must lie past the evictions)."""
        return tokens - self.offset

    def tokens_for(self, slots: int) -> int:
        return slots + self.offset

    @property
    def active(self) -> bool:
        return self.cfg.active and not self.failed and not self.commit

    # -- debug timeline -----------------------------------------------------------------------------
    def debug_positions(self, kv_len: int) -> torch.Tensor:
        """`[L, H, kv_len]` logical positions of the row's first `kv_len` slots (tail slots are 1:1)."""
        pos = self.dbg_pos
        m = 0 if pos is None else pos.shape[-1]
        if pos is not None and kv_len <= m:
            return pos[..., :kv_len]
        tail = torch.arange(self.dbg_tokens, self.dbg_tokens + kv_len - m, dtype=torch.int64)
        if pos is None:
            return tail
        tail = tail.view(1, 1, -1).expand(pos.shape[0], pos.shape[1], -1)
        return torch.cat([pos, tail], dim=-1)

    def debug_event(self, pos: torch.Tensor, tokens: int) -> None:
        """Record that the row now holds `pos` ([L, H, m]) and that logical tokens >= `tokens` follow."""
        self.dbg_pos, self.dbg_tokens = pos, tokens
        self.timeline.append({"tokens": tokens, "positions": pos.tolist()})


_SERVER: KvConfig | None = None
# Every live ReqState, weakly: a soak checks that none outlives its request (a leak would grow the RSS).
LIVE: weakref.WeakValueDictionary[int, ReqState] = weakref.WeakValueDictionary()


def _server() -> KvConfig:
    global _SERVER
    if _SERVER is None:
        _SERVER = server_config()
    return _SERVER


def get(req: Any) -> ReqState | None:
    return getattr(req, ATTR, None)


def ensure(req: Any) -> ReqState:
    """The request's state, created from its override (or the server config) on first sight."""
    s = get(req)
    if s is None:
        base = _server()
        try:
            cfg = request_override(req.sampling_params.custom_params, base) or base
        except ValueError as e:  # validated at the HTTP layer already; be safe anyway
            logger.warning("request %s: %s; using the server policy", req.rid, e)
            cfg = base
        policy = cfg.build()
        s = ReqState(cfg=cfg, policy=policy, fp=fingerprint(cfg, policy))
        LIVE[id(s)] = s
        s.commit = getattr(req.sampling_params, "max_new_tokens", None) == 0
        setattr(req, ATTR, s)
    return s


def copy_layer_state(layers: list[dict], slots: int | None = None) -> list[dict]:
    """A deep copy; with `slots`, per-slot entries (carried scores) cut to the first `slots` slots, the
    ones a compressed node holds (its tail may be re-matched only in part)."""

    def cp(k: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return (v[:, :slots] if k == "carried" and slots is not None else v).clone()

    return [{k: cp(k, v) for k, v in d.items()} for d in layers]


def on_match(req: Any, region: Any, prefix_pos: torch.Tensor | None = None) -> ReqState:
    """Called by the tree at every admission match (new request, or a retracted one coming back).

    The request's own region starts after `region.anchor`. When it starts with a compressed node (the
    branch's history, re-compressed with the new tokens under one budget), the node's compacted slots
    and evicted tokens become the request's own, and so does the policy state stored with it."""
    s = ensure(req)
    s.anchor, s.anchor_tokens, s.anchor_kv = region.anchor, region.anchor_tokens, region.anchor_kv
    s.own_evicted = s.inherited_evicted = s.comp_slots = s.comp_tokens = 0
    s.reused_evicted = region.tokens - region.kv
    s.releasing = False
    s.pending = None  # planned against slots the request no longer holds
    # Per-head policy state (D2O's tau) survives a retraction; per-slot entries do not (the slots change).
    s.layer_state = [{k: v for k, v in d.items() if k != "carried"} for d in s.layer_state]
    first = region.first
    if first is not None and getattr(first, "kvevict_compressed", False):
        s.comp_slots, s.comp_tokens = len(first.value), len(first.key)
        s.own_evicted = s.inherited_evicted = s.comp_tokens - s.comp_slots
        s.layer_state = copy_layer_state(getattr(first, "kvevict_state", []))
    if prefix_pos is not None:
        if not s.ran:  # a waiting request is matched again at every scheduling pass: keep the last
            s.timeline = []
        s.ran = False
        s.debug_event(prefix_pos, region.tokens)
    return s


def drop(req: Any) -> None:
    if hasattr(req, ATTR):
        delattr(req, ATTR)
