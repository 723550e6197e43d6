"""The per-request report: the numbers a response carries in `meta_info["kvevict"]`.

Device statistics that the policies record (`PolicyState.layer_stats`) stay tensors until here: they are
read once, when the report is built.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_kvevict.cache import state as st


def stats(req: Any) -> dict[str, Any] | None:
    """The per-request numbers reported in `meta_info["kvevict"]`."""
    s = st.get(req)
    if s is None:
        return None
    out: dict[str, Any] = {
        "policy": s.cfg.policy,
        "budget": s.cfg.budget,
        "scope": s.policy.config.scope,
        "kv_tokens": int(req.kv.kv_committed_len),
        "prefix_kv_tokens": s.slot_map.anchor_kv,
        "logical_tokens": s.slot_map.tokens_for(int(req.kv.kv_committed_len)),
        "evicted": s.slot_map.own_evicted - s.slot_map.inherited_evicted,
        "reused_evicted": s.slot_map.reused_evicted,
        "branch_kv_tokens": int(req.kv.kv_committed_len) - s.slot_map.anchor_kv,
        "compressions": s.counters.compressions,
        "merged": s.policy_state.merged,
        "seconds": round(s.counters.seconds, 4),
        "failed": s.failed,
    }
    if s.recall.tokens > 0 or s.recall.recalled:
        out.update(
            recall_tokens=s.recall.tokens,
            recalled=s.recall.recalled,
            appended=s.recall.recalled_appended,
            bytes_moved=s.recall.bytes_moved,
            host_tokens=s.recall.host_peak,
            host_borrowed=s.recall.history_borrowed,
            peak_kv_tokens=max(s.counters.kv_peak, int(req.kv.kv_committed_len)),
            recall_skipped=s.recall.skipped,
            recall_seconds=round(s.counters.recall_seconds, 4),
        )
    if st.DEBUG:
        out["prefix_digest"] = s.trace.prefix_digest
        out["prefix_digest_end"] = s.trace.prefix_digest_end
        out["kept_timeline"] = s.trace.timeline
    for (
        name,
        vals,
    ) in s.policy_state.layer_stats.items():  # device statistics are read here: one read per statistic
        out[f"layer_{name}"] = [round(x, 5) for x in _host_floats(vals)]
    return out


def _host_floats(vals: list[float | torch.Tensor]) -> list[float]:
    """Per-layer statistics as floats; the 0-dim device tensors among them copied in one transfer."""
    if not any(isinstance(x, torch.Tensor) for x in vals):
        return [float(x) for x in vals]
    dev = next(x.device for x in vals if isinstance(x, torch.Tensor))
    return torch.stack(
        [torch.as_tensor(x, dtype=torch.float32, device=dev).reshape(()) for x in vals]
    ).tolist()
