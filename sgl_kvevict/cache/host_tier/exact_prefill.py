"""A turn's prefill over both tiers: its new tokens attend to the branch's whole history, the entries the
device holds and those the host holds, as with the full cache.

Why: a turn's prefill queries decide what the turn keeps (the policy's compression after the prefill
scores with the turn's last queries) and what comes back (the append ranks the host entries by them).
Computed over the compressed row alone, from the second layer on those queries come from a history with
the fact missing, and they rank what the question's words match (on the long recall scenario, the filler
turns' closing question). Computed over both tiers they are the full cache's queries, and so is
everything the turn writes (its K/V, its first answer token).

How: SGLang runs every prefill eagerly. After its attention at each layer (`after_attention`, an AFTER hook
on `RadixAttention.forward`), each armed request's rows of the output are recomputed over the row's
slots (the history it holds, then its new tokens, causally) and the branch's host columns at that
layer, and replace SGLang's (`attend`). Neither pool is written: the host keys and values are read
once per layer, and the device holds no more KV than before (on a GPU the layer's host block is copied in
for the product and dropped). Every chunk of a chunked prefill is armed, so the K/V it writes is exact.
A failure turns the request's recall off (logged, counted): from the failing layer on its rows keep
SGLang's output (the layers before stay as computed over both tiers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from sgl_kvevict.cache import context
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import demote

if TYPE_CHECKING:
    from sgl_kvevict.cache.context import KvEvictContext
    from sgl_kvevict.cache.host_tier.host import HostEntries

QUERY_BLOCK = 256  # queries per product at most
SCORE_BYTES = 64 << 20  # and fewer where the history is long: one product's fp32 scores stay below this


@dataclass(eq=False)
class ExactArm:
    """One request's prefill chunk over both tiers: the host columns it reads as they are when armed (the
    branch's own, or a borrowed stored history's, `entries`)."""

    req: Any
    s: st.ReqState
    cols: torch.Tensor
    entries: HostEntries


def attend(
    q: torch.Tensor,
    k_row: torch.Tensor,
    v_row: torch.Tensor,
    k_host: torch.Tensor,
    v_host: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk's `n` queries `q` `[n, Hq, D]` over the host entries `[C, H, D]` (all visible)
    and the row `[m + n, H, D]`, whose last `n` slots are the chunk's own tokens (causal). Returns
    `[n, Hq, D]` in fp32. The order of the keys does not matter: each head's softmax is over a set, so
    the host entries go first and one fused product (`scaled_dot_product_attention`, grouped heads) covers
    both tiers."""
    n, hq = q.shape[:2]
    m = k_row.shape[0] - n
    c = k_host.shape[0]
    both = ((k_host, k_row), (v_host, v_row))
    k, v = (torch.cat(kv).float().permute(1, 0, 2).unsqueeze(0) for kv in both)  # [1, H, C + m + n, D]
    out = torch.empty(n, hq, v_row.shape[-1], dtype=torch.float32, device=q.device)
    cols = torch.arange(c + m + n, device=q.device)
    block = max(1, min(QUERY_BLOCK, SCORE_BYTES // (4 * hq * (c + m + n))))
    for i in range(0, n, block):
        j = min(n, i + block)
        at = c + m + torch.arange(i, j, device=q.device)  # each query's own column
        seen = cols.unsqueeze(0) <= at.unsqueeze(1)  # [b, C + m + n]: every host column, the row causally
        qb = q[i:j].float().permute(1, 0, 2).unsqueeze(0)  # [1, Hq, b, D]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=seen, scale=scale, enable_gqa=True)
        out[i:j] = o[0].permute(1, 0, 2)
    return out


def arm(req: Any, s: st.ReqState) -> None:
    """Arm the request's next prefill chunk over both tiers (the scheduler, once its slots are allocated
    and its branch's host entries taken: `recall.has_history`)."""
    host = demote.reading(s)
    s.ctx.exact_armed[req.kv.req_pool_idx] = ExactArm(req, s, host.cols.clone(), host)
    s.ctx.host.touch(host)  # read by this turn: the most recently used branch
    s.ctx.host.in_use[req.kv.req_pool_idx] = host  # the LRU must not take what the forward reads


def disarm(ctx: KvEvictContext, row: int) -> ExactArm | None:
    one = ctx.exact_armed.pop(row, None)
    if one is not None and ctx.host is not None:
        ctx.host.in_use.pop(row, None)
    return one


def after_attention(result, layer_mod, q, k, v, forward_batch, *args, **kwargs):
    """AFTER hook on RadixAttention.forward: armed requests' rows of a prefill's attention output, over
    both tiers."""
    ctx = context.of_forward(forward_batch)
    if ctx is None or not ctx.exact_armed or q is None or not isinstance(result, torch.Tensor):
        return result
    if not forward_batch.forward_mode.is_extend():
        return result
    rt = ctx.rt
    layer = layer_mod.layer_id - rt.start_layer
    last = layer == rt.n_layers - 1
    seq_lens = forward_batch.seq_lens_cpu
    out = result.view(result.shape[0], rt.n_q_heads, -1)
    rows = context.batch_rows(ctx, forward_batch)
    for i, row, start, n, one in st.live_arms(ctx.exact_armed, rows, lambda r: disarm(ctx, r)):
        try:
            if layer_mod.logit_cap:
                raise ValueError("a layer with a logit cap: the product here does not cap")
            if layer == 0 and st.DEBUG:
                _debug_both_tiers(one, int(seq_lens[i]) - n)
            slots = rt.req_to_token[row, : int(seq_lens[i])].to(torch.int64)
            got = attend_row(
                one, layer, q[start : start + n].view(n, rt.n_q_heads, rt.head_dim), slots, layer_mod.scaling
            )
            out[start : start + n] = got.to(out.dtype)
            if last:
                disarm(ctx, row)
                _finish(one, int(seq_lens[i]))
        except Exception:
            disarm(ctx, row)
            demote.fail(one.s, "a prefill over both tiers")
    return result


def attend_row(one: ExactArm, layer: int, q: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` for one armed request at `layer`: its row's `slots` and its branch's host columns."""
    rt, pool = one.s.ctx.rt, one.s.ctx.host
    cols = one.cols.to(pool.k.device)
    k_host, v_host = (buf[layer][cols].to(q.device) for buf in (pool.k, pool.v))
    return attend(q, rt.k_buffer(layer)[slots], rt.v_buffer(layer)[slots], k_host, v_host, scale)


def _finish(one: ExactArm, kv_len: int) -> None:
    """Counters (host bytes read), and under KVEVICT_DEBUG the row's own positions as the event that
    governs the tokens after a chunk that saw host entries (they attend to the row only)."""
    s, pool, rt = one.s, one.s.ctx.host, one.s.ctx.rt
    pool.totals.prefill_bytes_read += (
        int(one.cols.numel()) * 2 * rt.n_kv_heads * rt.head_dim * pool.k.element_size() * rt.n_layers
    )
    pool.totals.prefills_both_tiers += 1
    if st.DEBUG:
        s.trace.event(s.trace.positions(kv_len), s.slot_map.tokens_for(kv_len))


def _debug_both_tiers(one: ExactArm, m: int) -> None:
    """KVEVICT_DEBUG: the chunk's queries see the row's first `m` slots and every host entry; recorded as
    an event of their union (the oracle replays it), without changing what the row holds."""
    s = one.s
    host_pos = one.entries.positions
    row_pos = st.row_positions(s, m)
    both = row_pos if host_pos is None else torch.cat([row_pos, host_pos[..., : one.cols.numel()]], dim=-1)
    s.trace.seen(both, s.slot_map.tokens_for(m))
