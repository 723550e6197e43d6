"""Tensor-parallel agreement: every rank commits a compression only if every rank's plan succeeded.

Ranks hold different KV heads of the same request; the counts that decide slots come from the host (the
budget, the policy's config), so the ranks' rows and trees stay identical as long as they commit the
same steps. A plan that fails on one rank (policy code raised) fails on all of them.
"""

from __future__ import annotations

from typing import Any

import torch


def agree(rt: Any, ok: bool) -> bool:
    """Every tensor-parallel rank commits only if every rank's plan succeeded (one host sync, TP only)."""
    if rt is None or rt.tp_size <= 1:
        return ok
    from sglang.srt.distributed import get_tp_group

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return int(flag.item()) == 0
