"""Per-request compression state, kept on the `Req` object (SGLang's `ReqKvInfo` has `slots=True`).

Row layout of a request under compression (KV space, i.e. positions in its `req_to_token` row):

    [0, anchor_kv)                         matched prefix, owned by the tree (never written)
    [anchor_kv, anchor_kv + comp_slots)    compacted history: per KV head, kept tokens in position order
    [anchor_kv + comp_slots, kv_len)       uncompressed tail: one token per slot, 1:1 with the last tokens

`anchor_tokens - anchor_kv` tokens were already evicted inside the matched prefix (a compressed node)
and `own_evicted` in the request's own region; their sum is the position offset of its next token.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from sgl_kvevict.config import KvConfig, request_override, server_config
from sgl_kvevict.policies import Policy

logger = logging.getLogger("sgl_kvevict")
ATTR = "_kvevict"
DEBUG = os.environ.get("KVEVICT_DEBUG", "0") == "1"  # prefix digests in meta_info (tests)


@dataclass
class ReqState:
    cfg: KvConfig
    policy: Policy
    anchor: Any = None  # TreeNode at the end of the matched prefix
    anchor_tokens: int = 0
    anchor_kv: int = 0
    own_evicted: int = 0
    comp_slots: int = 0
    comp_tokens: int = 0
    after_extend: bool = False  # the next compression check is the one right after a prefill
    releasing: bool = False  # released unfinished (retraction): the tree checkpoint gets a slot count
    failed: bool = False
    compressions: int = 0
    merged: int = 0
    seconds: float = 0.0
    layer_state: list[dict] = field(default_factory=list)
    layer_stats: dict[str, list[float]] = field(default_factory=dict)
    prefix_digest: str = ""
    prefix_digest_end: str = ""

    @property
    def offset(self) -> int:
        return self.anchor_tokens - self.anchor_kv + self.own_evicted

    @property
    def active(self) -> bool:
        return self.cfg.active and not self.failed


_SERVER: KvConfig | None = None


def _server() -> KvConfig:
    global _SERVER
    if _SERVER is None:
        _SERVER = server_config()
    return _SERVER


def get(req: Any) -> ReqState | None:
    return getattr(req, ATTR, None)


def on_match(req: Any, node: Any, tokens: int, kv: int) -> ReqState:
    """Called by the tree at every admission match (new request, or a retracted one coming back)."""
    s = get(req)
    if s is None:
        base = _server()
        try:
            cfg = request_override(req.sampling_params.custom_params, base) or base
        except ValueError as e:  # validated at the HTTP layer already; be safe anyway
            logger.warning("request %s: %s; using the server policy", req.rid, e)
            cfg = base
        s = ReqState(cfg=cfg, policy=cfg.build())
        setattr(req, ATTR, s)
    # A fresh match (re)starts the request's own region after the matched prefix.
    s.anchor, s.anchor_tokens, s.anchor_kv = node, tokens, kv
    s.own_evicted = s.comp_slots = s.comp_tokens = 0
    s.layer_state = []
    return s


def drop(req: Any) -> None:
    if hasattr(req, ATTR):
        delattr(req, ATTR)
