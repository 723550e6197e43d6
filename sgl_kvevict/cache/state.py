"""Per-request compression state, kept on the `Req` object (SGLang's `ReqKvInfo` has `slots=True`).

`ReqState` holds the request's config, policy, server context and lifecycle flags, and one object per
concern:

- `slot_map` (`SlotMap`): how the request's logical tokens map to its KV slots (anchor, compacted
  history, evicted counts). It is the one place that knows; every hook converts through its methods
  (`slots_for`, `tokens_for`, `offset`) instead of doing its own arithmetic.
- `policy_state` (`PolicyState`): what the policy carries from one compression to the next (per-layer
  entries, carried scores) and what it measured (merges, per-layer statistics).
- `recall` (`RecallState`): the host-tier entries the request owns, where it stands in a turn's
  recalls, and its recall counters.
- `counters` (`Counters`): compressions, seconds spent, the row's peak slots.
- `trace` (`PositionTrace`): the logical positions the row's slots hold (`tracks_positions`: wherever the
  host tier is on, and under KVEVICT_DEBUG), with, under KVEVICT_DEBUG, prefix digests and the
  kept-position timeline.

Moves that change several parts at once (a compression's commit, a recall's append, the anchor moving
down) are `ReqState` methods (`compacted`, `unevicted`, `move_anchor`).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgl_kvevict.cache.counts import LazyCount
from sgl_kvevict.cache.host_tier import host as host_tier
from sgl_kvevict.cache.nodes import CompressedNode, is_compressed
from sgl_kvevict.config import KvConfig, request_override
from sgl_kvevict.policies import Policy

if TYPE_CHECKING:
    from sgl_kvevict.cache.context import KvEvictContext

logger = logging.getLogger("sgl_kvevict")
ATTR = "_kvevict"
# Test/debug only: prefix digests and the kept-position timeline in meta_info (costs a host copy per event).
DEBUG = os.environ.get("KVEVICT_DEBUG", "0") == "1"


def tracks_positions(ctx: KvEvictContext) -> bool:
    """Whether rows and host entries carry their logical positions: wherever the host tier is on (a turn's
    append ranks positions over every layer and KV head, `host_tier.recall`), and under KVEVICT_DEBUG
    (the test oracle replays them)."""
    return DEBUG or ctx.host is not None


def row_positions(s: ReqState, kv_len: int) -> torch.Tensor:
    """`[L, H, kv_len]` logical positions of the row's first slots (where tracked: `tracks_positions`)."""
    rt = s.ctx.rt
    pos = s.trace.positions(kv_len)
    return pos.view(1, 1, -1).expand(rt.n_layers, rt.n_kv_heads, -1) if pos.dim() == 1 else pos


def fingerprint(cfg: KvConfig, policy: Policy, recall: int = 0) -> str | None:
    """Identity of a compressed history's producer; None for `none` (it never produces or reads one).
    Recall changes what a history holds (and owns host entries), so it is part of it when on."""
    if not cfg.active:
        return None
    config = policy.config.model_dump(mode="json", exclude={"shared_prefix"})  # where, not how
    ident: dict[str, Any] = {"policy": cfg.policy, "budget": cfg.budget, "config": config}
    if recall:
        ident["recall"] = recall
    raw = json.dumps(ident, sort_keys=True)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


@dataclass
class SlotMap:
    """How the request's logical tokens map to the slots of its row (the module's row layout), and
    the conversions between the two."""

    anchor: Any = None  # TreeNode at the end of the matched prefix
    anchor_tokens: int = 0
    anchor_kv: int = 0
    own_evicted: int = 0
    reused_evicted: int = 0  # tokens already evicted in the history the request matched
    inherited_evicted: int = 0  # of `own_evicted`, those of a matched branch history (not this request's)
    comp_slots: int = 0
    comp_tokens: int = 0
    # slots joined to the compacted history this turn beyond the budget (a recall's append): the turn's
    # decode budget grows by them, and its next compression that is not a decode step's folds them back
    appended: int = 0

    @property
    def offset(self) -> int:
        """Tokens evicted before the request's next token: logical position = KV slot index + offset."""
        return self.anchor_tokens - self.anchor_kv + self.own_evicted

    def slots_for(self, tokens: int) -> int:
        """KV slots that hold the first `tokens` logical tokens (the cut must lie past the evictions)."""
        return tokens - self.offset

    def tokens_for(self, slots: int) -> int:
        return slots + self.offset

    def region_tokens(self, slots: int) -> int:
        """Logical tokens that the request's own region of `slots` slots stands for (its evictions are
        all inside the region, in its compacted history)."""
        return slots + self.own_evicted

    def compacted(self, n: int, k: int, tail: int) -> None:
        """A compression kept `k` of the region's `n` slots, its last `tail` kept ones raw (the region's
        newest tokens): the compacted history ends before them."""
        tokens = self.region_tokens(n)
        self.comp_slots = k - tail
        self.comp_tokens = tokens - tail
        self.own_evicted += n - k

    def unevicted(self, count: int) -> None:
        """`count` entries per layer and KV head joined the end of the compacted history: the row holds
        `count` more slots for the same tokens (fewer evicted)."""
        self.comp_slots += count
        self.appended += count
        self.own_evicted -= count
        self.inherited_evicted = min(self.inherited_evicted, self.own_evicted)

    def move_anchor(self, node: Any, tokens: int, slots: int, drop_history: bool) -> None:
        """The anchor moves down to `node`, `tokens` tokens in `slots` slots further; with `drop_history`
        the compacted history lies above it and its evictions stop being the request's own."""
        if drop_history:
            self.own_evicted -= self.comp_tokens - self.comp_slots
            self.inherited_evicted = 0
            self.comp_slots = self.comp_tokens = 0
        self.anchor = node
        self.anchor_tokens += tokens
        self.anchor_kv += slots


@dataclass
class PolicyState:
    """What the request's policy carries from one compression to the next, and what it measured."""

    layers: list[dict] = field(default_factory=list)  # per layer: the policy's own entries (D2O's tau, ...)
    carry_stack: torch.Tensor | None = None  # [L, H, k]: the carried scores the layers' entries view
    merged_count: LazyCount = field(default_factory=LazyCount)  # D2O's merges; read as `merged`
    # per layer: floats or 0-dim device tensors (read where reported, `report.stats`)
    layer_stats: dict[str, list[float | torch.Tensor]] = field(default_factory=dict)

    @property
    def merged(self) -> int:
        """Evicted tokens merged into kept ones (D2O), read here (a host sync), not in the step."""
        return self.merged_count.value()

    def slots_inserted(self, at: int, count: int) -> None:
        """`count` slots were inserted at region index `at`: per-slot carried scores make room for them
        (the new entries carry none yet)."""
        self.carry_stack = None
        for d in self.layers:
            old = d.get("carried")
            if old is not None and old.shape[-1] >= at:
                pad = old.new_zeros(*old.shape[:-1], count)
                d["carried"] = torch.cat([old[..., :at], pad, old[..., at:]], dim=-1)


@dataclass
class Counters:
    """The request's compression numbers (`report.stats`)."""

    compressions: int = 0
    seconds: float = 0.0  # spent compressing
    kv_peak: int = 0  # the most slots the row held at a decode step's start (appended columns included)
    # the turn's recall time (`serve.hooks` measures it): arming, the prefill's recall hooks, the append
    recall_seconds: float = 0.0
    recall_mark: float | None = None  # `Totals.recall_forward_seconds` when its prefill was armed


@dataclass
class PositionTrace:
    """The logical positions held by the row's slots [0, m) per layer and KV head (`pos`) and the logical
    tokens they stand for (`tokens`), where positions are tracked (`tracks_positions`); under KVEVICT_DEBUG
    also digests of the shared prefix and the events a test oracle replays (`timeline`, see `event`)."""

    prefix_digest: str = ""
    digest_kv: int = 0  # slots the digests cover: the shared prefix at admission
    prefix_digest_end: str = ""
    pos: torch.Tensor | None = None
    tokens: int = 0
    timeline: list[dict] = field(default_factory=list)

    def positions(self, kv_len: int) -> torch.Tensor:
        """`[L, H, kv_len]` logical positions of the row's first `kv_len` slots (tail slots are 1:1)."""
        pos = self.pos
        m = 0 if pos is None else pos.shape[-1]
        if pos is not None and kv_len <= m:
            return pos[..., :kv_len]
        tail = torch.arange(self.tokens, self.tokens + kv_len - m, dtype=torch.int64)
        if pos is None:
            return tail
        tail = tail.view(1, 1, -1).expand(pos.shape[0], pos.shape[1], -1)
        return torch.cat([pos, tail], dim=-1)

    def event(self, pos: torch.Tensor, tokens: int) -> None:
        """Record that the row now holds `pos` ([L, H, m]) and that logical tokens >= `tokens` follow."""
        self.pos, self.tokens = pos, tokens
        if DEBUG:
            self.seen(pos, tokens)

    def seen(self, pos: torch.Tensor, tokens: int) -> None:
        """Record that the queries of logical tokens >= `tokens` see `pos` ([L, H, m]) and what follows,
        without changing what the row holds (a prefill over both tiers also sees the host's)."""
        # exported as sets (sorted): a recall swap leaves a head's slots out of position order
        self.timeline.append({"tokens": tokens, "positions": pos.sort(dim=-1).values.tolist()})


@dataclass
class RecallState:
    """The request's host-tier entries (`demote.py` fills them, `recall.py` brings them back), where it
    stands in a turn's recalls, and what its recalls did."""

    tokens: int = 0  # entries per layer and KV head a turn may recall (0: recall off)
    host: host_tier.HostEntries | None = None  # the host entries this request owns
    host_src: CompressedNode | None = None  # the adopted history, whose entries move at first commit
    # the adopted history's entries, read where they are when the pool had no room for a copy
    # (`demote.take`): read only, until the request's first write (`end_borrow`)
    borrowed: host_tier.HostEntries | None = None
    history_borrowed: bool = False  # it did (reported: `host_borrowed`)
    # the stored history's entries it continued (copied or borrowed), counted in their `running` until
    # the request is released (`leave`)
    adopted: host_tier.HostEntries | None = None
    # the host pool's clock when the request was first matched: its demotions never take a session's
    # latest history, an awaited one or a running fork's used since then (`HostPool.alloc`)
    arrived: int | None = None
    # logical tokens before this turn's own: recall scores with the turn's queries only (`recall.own`)
    turn_start: int | None = None
    due: bool = False  # a prefill ran: recall once its compression has committed
    append_due: bool = False  # a prefill ran: append recalled columns once its compression committed
    steps: int = 0  # decode steps since the last recall
    # a recall swapped entries into the compacted history since it was last formed: it is no longer
    # the stored node it was adopted from (the tree must not treat it as a duplicate of that node)
    changed_history: bool = False
    # a batched decode-step recall failed with this request in it: from then on it recalls alone, after
    # its compressions (`recall.safe_recall`), where a failure is its own
    alone: bool = False
    # counters, reported in `meta_info` (`report.stats`)
    recalled: int = 0
    recalled_appended: int = 0  # of `recalled`, the entries appended (moved one way, not exchanged)
    bytes_moved: int = 0
    skipped: int = 0
    host_peak: int = 0

    def entries(self) -> host_tier.HostEntries:
        """The request's host entries, an empty set when it holds none yet (what a demotion
        appends to)."""
        if self.host is None:
            self.host = host_tier.HostEntries()
        return self.host

    def drop_host(self, pool: host_tier.HostPool | None) -> None:
        """Give the request's host entries back to `pool`: no stored history took them."""
        self.end_borrow(pool)
        host_tier.release(pool, self.host)
        self.host = None

    @property
    def continued_fork(self) -> bool:
        """The stored history this request continued had several takers: it is a fork's branch."""
        return self.adopted is not None and self.adopted.takers > 1

    def join(self, e: host_tier.HostEntries) -> None:
        """The request continues stored history `e`: it runs on it until released (`leave`)."""
        self.leave()
        e.running += 1
        self.adopted = e

    def leave(self) -> None:
        """Released (finished or retracted): no longer one of its adopted history's running branches."""
        a, self.adopted = self.adopted, None
        if a is not None:
            a.running -= 1

    def end_borrow(self, pool: host_tier.HostPool | None) -> None:
        """Stop reading a borrowed stored history: before anything would write host entries (an exchange,
        a decode step's recall), after an append that read it, at a retraction and at release. What the
        request demoted itself stays its own; its stored history holds only those."""
        b, self.borrowed = self.borrowed, None
        if b is not None and pool is not None:
            pool.unborrow(b)


@dataclass
class ReqState:
    """One request's compression state: what it runs with, where it stands, and one part per concern."""

    cfg: KvConfig
    policy: Policy
    ctx: KvEvictContext  # the server this request runs on (pools, host tier, capture, settings)
    fp: str | None = None  # `fingerprint` of cfg and policy
    # lifecycle
    after_extend: bool = False  # the next compression check is the one right after a prefill
    releasing: bool = False  # released unfinished (retraction): the tree checkpoint gets a slot count
    failed: bool = False
    deferred: int = 0  # scheduler steps this request's compression waited (--kv-compress-step-tokens)
    pending: Any = None  # compressor.Pending: a compression planned over several steps, not committed yet
    ran: bool = False  # KV was allocated since the last match (a later match is a re-admission)
    commit: bool = False  # generates nothing: a prefix commit (SGLang's frontend before `fork`), kept whole
    # the parts
    slot_map: SlotMap = field(default_factory=SlotMap)
    policy_state: PolicyState = field(default_factory=PolicyState)
    counters: Counters = field(default_factory=Counters)
    trace: PositionTrace = field(default_factory=PositionTrace)
    recall: RecallState = field(default_factory=RecallState)

    def compacted(self, n: int, k: int, tail: int) -> None:
        """A compression kept `k` of the region's `n` slots, its last `tail` kept ones raw
        (`SlotMap.compacted`)."""
        self.slot_map.compacted(n, k, tail)
        self.recall.changed_history = False  # re-formed: its tokens name a new history

    def unevicted(self, count: int) -> None:
        """A recall appended `count` host entries per layer and KV head to the compacted history: the row
        holds `count` more slots for the same tokens (fewer evicted), until a compression folds them."""
        self.slot_map.unevicted(count)
        self.recall.changed_history = True
        self.policy_state.slots_inserted(self.slot_map.comp_slots - count, count)

    def move_anchor(self, node: Any, tokens: int, slots: int, drop_history: bool) -> None:
        """The branch point moved down to `node`, `tokens` tokens held in `slots` slots further. With
        `drop_history` the compressed history the region started with lies above the new anchor: it is
        shared now, and its evictions stop being the request's own."""
        self.slot_map.move_anchor(node, tokens, slots, drop_history)
        if drop_history:
            self.policy_state.layers = []
            self.recall.host_src = None  # that history is shared now: its host entries stay with it

    @property
    def active(self) -> bool:
        return self.cfg.active and not self.failed and not self.commit

    @property
    def recall_on(self) -> bool:
        """The request's config recalls (a commit request's included: the tree then keeps a branch's
        stored history the branch's own, `tree.last_shared`); `demote.enabled` adds `active`."""
        return self.recall.tokens > 0 and self.ctx.host is not None


# Every live ReqState, weakly: a soak checks that none outlives its request (a leak would grow the RSS).
LIVE: weakref.WeakValueDictionary[int, ReqState] = weakref.WeakValueDictionary()


def get(req: Any) -> ReqState | None:
    return getattr(req, ATTR, None)


def live_arms(
    armed: dict[int, Any], rows: list[tuple[int, int, int]], drop: Callable[[int], Any]
) -> Iterator[tuple[int, int, int, int, Any]]:
    """`(batch index, row, first token, tokens, arm)` for the forward's rows that hold an arm (anything
    with `req` and `s`) in `armed`. An arm left for a request that is gone (the row changed hands, the
    request's state was replaced, or it finished) is dropped (`drop(row)`) and skipped."""
    for i, (row, start, n) in enumerate(rows):
        one = armed.get(row)
        if one is None:
            continue
        if one.req.kv.req_pool_idx != row or get(one.req) is not one.s or one.req.finished():
            drop(row)
            continue
        yield i, row, start, n, one


def ensure(req: Any, ctx: KvEvictContext) -> ReqState:
    """The request's state on the server of `ctx`, created from its override (or the server config) on
    first sight."""
    s = get(req)
    if s is None:
        base = ctx.server
        try:
            cfg = request_override(req.sampling_params.custom_params, base, ctx.settings) or base
        except ValueError as e:  # validated at the HTTP layer already; be safe anyway
            logger.warning("request %s: %s; using the server policy", req.rid, e)
            cfg = base
        policy = cfg.build()
        recall = recall_tokens(cfg, ctx) if cfg.active else 0
        fp = fingerprint(cfg, policy, recall)
        s = ReqState(cfg=cfg, policy=policy, ctx=ctx, fp=fp, recall=RecallState(tokens=recall))
        LIVE[id(s)] = s
        s.commit = getattr(req.sampling_params, "max_new_tokens", None) == 0
        setattr(req, ATTR, s)
    return s


def recall_tokens(cfg: KvConfig, ctx: KvEvictContext) -> int:
    """Entries per layer and KV head a turn may recall: the request's own setting, else the server's."""
    if cfg.recall_tokens is not None:
        return cfg.recall_tokens
    return ctx.settings.recall_tokens


def copy_layer_state(layers: list[dict], slots: int | None = None) -> list[dict]:
    """A deep copy; with `slots`, per-slot entries (carried scores) cut to the first `slots` slots, the
    ones a compressed node holds (its tail may be re-matched only in part)."""

    def cp(k: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return (v[:, :slots] if k == "carried" and slots is not None else v).clone()

    return [{k: cp(k, v) for k, v in d.items()} for d in layers]


def on_match(req: Any, ctx: KvEvictContext, region: Any, prefix_pos: torch.Tensor | None = None) -> ReqState:
    """Called by the tree at every admission match (new request, or a retracted one coming back).

    The request's own region starts after `region.anchor`. When it starts with a compressed node (the
    branch's history, re-compressed with the new tokens under one budget), the node's compacted slots
    and evicted tokens become the request's own, and so does the policy state stored with it."""
    s = ensure(req, ctx)
    m = s.slot_map = SlotMap(region.anchor, region.anchor_tokens, region.anchor_kv)
    m.reused_evicted = region.tokens - region.kv
    s.recall.changed_history = False
    s.releasing = False
    s.pending = None  # planned against slots the request no longer holds
    # Per-head policy state (D2O's tau) survives a retraction; per-slot entries do not (the slots change).
    s.policy_state.layers = [{k: v for k, v in d.items() if k != "carried"} for d in s.policy_state.layers]
    first = region.first
    if s.recall.arrived is None and ctx.host is not None:
        s.recall.arrived = ctx.host.clock
    s.recall.host_src = None
    if first is not None and is_compressed(first):
        s.recall.host_src = first  # its host entries, if any, move to the request at its first commit
        m.comp_slots, m.comp_tokens = len(first.value), len(first.key)
        m.own_evicted = m.inherited_evicted = m.comp_tokens - m.comp_slots
        s.policy_state.layers = copy_layer_state(first.layer_state)
    if prefix_pos is not None:
        if not s.ran:  # a waiting request is matched again at every scheduling pass: keep the last
            s.trace.timeline = []
        s.ran = False
        s.trace.event(prefix_pos, region.tokens)
    return s


def drop(req: Any) -> None:
    if hasattr(req, ATTR):
        delattr(req, ATTR)
