"""Per-slot statistics written when K/V is written: CriticalKV's ||v W_O||_1 per KV head.

Why: CriticalKV's stage 2 needs, per token and KV head, the group mean of ||v W_O[h]||_1. Recomputing it at
a compression is O(n x Hq x D x hidden) per layer (16.6 decode steps of CPU at 8K tokens for a first
compression). A token's value never changes while it sits in its slot, so the forward pass computes the
norm once, when it writes the value, and stores it beside the KV pool (`SlotStats.buf`, the server context's `stats`) `[layers,
pool slots, KV heads]` float32, indexed by slot. A compression then reads O(n) numbers.

The statistic follows its row. Every place that moves K/V between slots moves it too: the batched
compaction (`engine._run_group`), the per-request compaction and the staged writes (`compressor._commit`,
a split plan's commit included). D2O's merge rewrites kept values: those rows are marked stale (NaN) at
the commit, and so is every slot not written yet (the buffer starts as NaN). A policy that finds a NaN
computes that norm from the pool (`policies.criticalkv.slot_vo_norms`) and the compressor writes it back
(`write_back`), so each stale row is recomputed once.

The forward hook (`before_attention`, BEFORE `RadixAttention.forward`, registered in `hooks.HOOKS`) does
one `kernels.vo_norms_rows` and one `index_copy_` per layer, from device tensors only (no `.item()`, no
`.tolist()`, shapes fixed by the batch's token count), so it may run inside a CUDA graph; it returns at
once when no buffer exists. The buffer exists only when a request can use it: the server's policy, or a
policy an override may name, needs "o_proj" (`needed`). Cost: about one extra o_proj product per token
and layer in the forward pass, and 4 bytes per slot, layer and KV head (1/64 of a bf16 pool with
head_dim 64).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sgl_kvevict import kernels
from sgl_kvevict.cache import context

logger = logging.getLogger("sgl_kvevict")


@dataclass(eq=False)
class SlotStats:
    """The statistic of one server (its context's `slot_stats`) and what the forward hook needs to write it."""

    buf: torch.Tensor  # [layers, pool slots, KV heads] float32; NaN = not written or stale
    w: list[torch.Tensor]  # per layer: the o_proj slices the hook multiplies by (fp32 on CPU)
    start: int  # the KV pool's first layer id (layer_id - start indexes buf)
    dtype: torch.dtype  # the pool's value dtype: norms are of the row as stored


def needed(cfg: Any, settings: Any) -> bool:
    """Whether any request on this server can ask for a policy that reads ||v W_O||_1.

    The server's own policy counts; so does any policy an override may name (all of them when
    `--kv-overrides` names no `policies`), except on a quantized model, where such overrides are
    refused (HTTP 400) and the server's own CriticalKV is refused at start."""
    from sgl_kvevict import policies

    if cfg.active and "o_proj" in cfg.build().needs:
        return True
    rules = settings.overrides
    if not rules.enabled or settings.quantization:
        return False
    names = rules.policies if rules.policies is not None else policies.available()
    for name in names:
        try:
            if "o_proj" in policies.build(name).needs:
                return True
        except Exception:  # a policy whose defaults do not build cannot be named without a config
            continue
    return False


def setup(rt: Any) -> SlotStats:
    """Allocate the buffer for `rt`'s pool (once, at start) and cache the o_proj slices the hook uses."""
    v0 = rt.v_buffer(0)
    buf = torch.full((rt.n_layers, v0.shape[0], rt.n_kv_heads), float("nan"), device=v0.device)
    # the torch reference casts W_O to fp32 at every call: do it once here (the Triton kernel reads it as is)
    w = [
        rt.o_proj(layer) if kernels.use_triton(v0) else rt.o_proj(layer).float()
        for layer in range(rt.n_layers)
    ]
    logger.info(
        "sgl-kvevict: per-slot ||v W_O||_1 statistic on (%d layers x %d slots x %d KV heads, %.1f MiB)",
        rt.n_layers,
        v0.shape[0],
        rt.n_kv_heads,
        buf.numel() * 4 / 2**20,
    )
    return SlotStats(buf, w, rt.start_layer, v0.dtype)


def record(stats: torch.Tensor, layer: int, v: torch.Tensor, loc: torch.Tensor, o_proj: torch.Tensor) -> None:
    """Write the norms of value rows `v` `[T, Hkv, D]` into `stats[layer]` at slots `loc` `[T]`: one
    norm computation and one index copy, device tensors only."""
    norms = kernels.vo_norms_rows(v, o_proj)  # [Hkv, T]
    stats[layer].index_copy_(0, loc.to(torch.int64), norms.t())


def before_attention(layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: the norms of the values this layer is about to write.

    Values are cast to the pool's dtype first, so the norm is the one of the stored row (what a
    compression would recompute). `v` None (a layer that reuses another layer's KV) writes nothing."""
    if v is None:
        return None
    ctx = context.of_forward(forward_batch)
    ss = None if ctx is None else ctx.slot_stats
    if ss is None:
        return None
    try:
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_extend()):
            return None
        layer = layer_mod.layer_id - ss.start
        rows = v.reshape(v.shape[0], ss.buf.shape[2], -1)
        if rows.dtype != ss.dtype:
            rows = rows.to(ss.dtype)
        record(ss.buf, layer, rows, forward_batch.out_cache_loc, ss.w[layer])
    except Exception:
        # a missed write would leave the slot's previous occupant's norm: turn the statistic off instead
        # (CriticalKV then computes its norms at compression time, as without this module)
        logger.exception("kvevict: per-slot ||v W_O||_1 write failed; statistic switched off")
        ctx.slot_stats = None
    return None


# ---- moving the statistic with its row ------------------------------------------------------------
def move_rows(stats: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """`stats[l].flat[dst_rows] = stats[l].flat[src_rows[l]]` for every layer at once (gather, then
    write, so sources and destinations may overlap). Rows are flat `slot * H + head` indices, as the
    batched compaction builds them: `src_rows` `[L, M]`, `dst_rows` `[M]`."""
    flat = stats.view(stats.shape[0], -1)
    flat.index_copy_(1, dst_rows, flat.gather(1, src_rows))


def gather(stats: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`[L, H, k]` copy of the statistic of each layer's and head's kept rows, `slots[keep[l, h]]`."""
    h = stats.shape[2]
    heads = torch.arange(h, device=stats.device).view(1, h, 1)
    src = slots.to(stats.device)[keep.to(stats.device)] * h + heads  # [L, H, k]
    return stats.view(stats.shape[0], -1).gather(1, src.reshape(stats.shape[0], -1)).view(src.shape)


def write(stats: torch.Tensor, slots: torch.Tensor, vals: torch.Tensor) -> None:
    """`stats[l, slots[i], h] = vals[l, h, i]`: the rows written to `slots` in kept order."""
    h = stats.shape[2]
    heads = torch.arange(h, device=stats.device).view(h, 1)
    dst = (slots.to(stats.device).view(1, -1) * h + heads).reshape(-1)  # [H * k]
    stats.view(stats.shape[0], -1).index_copy_(1, dst, vals.reshape(stats.shape[0], -1))


def compact(stats: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> None:
    """What `kernels.compact` does to the K/V rows, for the statistic: each layer's and head's kept
    rows `slots[keep[l, h, i]]` move to `slots[i]`."""
    write(stats, slots[: keep.shape[-1]], gather(stats, slots, keep))


def read(stats: torch.Tensor, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """`[Hkv, N]` copy of one layer's statistic at `slots` (what a policy gets as `LayerView.vo`)."""
    return stats[layer].index_select(0, slots.to(stats.device)).t().contiguous()


def write_back(stats: torch.Tensor, layer: int, slots: torch.Tensor, vo: torch.Tensor) -> None:
    """Store `[Hkv, N]` norms of `slots` that a policy filled in (rows that were stale or never written)."""
    stats[layer].index_copy_(0, slots.to(stats.device), vo.t().to(stats.dtype))
