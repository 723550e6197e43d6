"""When a request compresses: the policy's trigger, and the host-side counts of a step (`Job`).

`prepare` decides, from host counts only (no tensor is read), whether a request's compression fires
this step and with which counts (its region, sinks, recent window, budget); the step itself (plan,
agree, commit) is `compressor.run` or the batched engine. `due` asks the same question without side
effects, for the overlap scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_kvevict.cache import branch_point
from sgl_kvevict.cache import state as st
from sgl_kvevict.policies.base import Phase


@dataclass
class Job:
    """One request whose trigger fired this step: every count the step needs, decided on the host."""

    req: Any
    s: st.ReqState
    phase: Phase
    a: int  # anchor_kv: the region starts here in the row
    n: int  # region slots
    n_sink: int
    n_recent: int
    budget: int
    own_start: int  # kv.cache_protected_len: slots from here on are the request's own
    layers: int = 1 << 30  # layers to plan this step (fewer than all: the plan continues next step)


def prepare(req: Any, phase: Phase) -> Job | None:
    """The host-side half of a step: None when the policy's trigger does not fire. No tensor is read."""
    s = st.get(req)
    if s is None or not s.active or s.ctx.rt is None:
        return None
    kv = req.kv
    cfg = s.policy.config
    if cfg.scope == "branch":
        branch_point.move(req, s)
    p = s.pending
    if p is not None:
        if p.valid_for(req, s):
            p.job.phase = phase if phase == "finish" else p.job.phase
            p.job.layers = 1 << 30
            return p.job  # continues; the caller may limit its layers again
        s.pending = None
    if kv.kv_allocated_len != kv.kv_committed_len:
        return None
    counts = fires(req, s, phase)
    if counts is None:
        return None
    return Job(req, s, phase, s.slot_map.anchor_kv, *counts, kv.cache_protected_len)


def fires(req: Any, s: st.ReqState, phase: Phase) -> tuple[int, int, int, int] | None:
    """`(n, n_sink, n_recent, budget)` of the request's region when its policy's trigger fires, else None."""
    return _counts(s, req.kv.kv_committed_len - s.slot_map.anchor_kv, phase)


def may_fire(req: Any, s: st.ReqState) -> bool:
    """Whether the request's trigger can fire before its turn ends: `fires`' test at the longest the turn
    can grow to (its prompt and every token it may still generate), from host counts only."""
    most = getattr(req.sampling_params, "max_new_tokens", None)
    if most is None:
        return True
    end = s.slot_map.slots_for(len(req.origin_input_ids) + int(most))
    return _counts(s, end - s.slot_map.anchor_kv, "prefill") is not None


def _counts(s: st.ReqState, n: int, phase: Phase) -> tuple[int, int, int, int] | None:
    cfg = s.policy.config
    if n <= 0:
        return None
    n_sink = max(0, min(cfg.sinks - s.slot_map.anchor_tokens, n))
    n_recent = max(0, min(cfg.recent, n - n_sink))
    budget = s.cfg.resolve_budget(s.slot_map.region_tokens(n), n_sink + n_recent)
    if phase == "decode":  # the columns a recall appended this turn stay until the turn ends
        budget += s.slot_map.appended
    if not s.policy.should_compress(n, n_sink, n_recent, s.slot_map.comp_slots, budget, phase):
        return None
    return n, n_sink, n_recent, budget


def due(req: Any) -> bool:
    """Whether the request's next compression check may compress (host counts only, no side effect):
    a prefill just ran, a split plan is under way, or the policy's decode trigger fires at its length.
    The overlap scheduler processes a step's results before preparing the next one when this holds
    (see `hooks.get_next_batch_to_run`)."""
    s = st.get(req)
    if s is None or not s.active or s.ctx.rt is None:
        return False
    return s.after_extend or s.pending is not None or fires(req, s, "decode") is not None
