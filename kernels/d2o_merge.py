"""D2O token merging (D2O paper, token-level merge): fold evicted tokens into their nearest kept token.

Reading of the paper used here (where its equations leave a choice, the choice is stated):

- Similarity is on keys only, cosine, per KV head: u_e = max_c cos(k_e, k_c), c*(e) its argmax over the
  kept tokens of that head (many-to-one). Values reuse the keys' matching and weights.
- Threshold (`reduce`): 'max' reads Eq. 10 per KV head: at prefill (`init=True`) tau' = mean_e(u_e); in
  decode tau' = beta * max_e(u_e) + (1 - beta) * tau (EMA, beta weights the current step). 'mean' is the
  authors' released code: one scalar per layer, the mean over heads and evicted tokens of u_e, at prefill
  and as the EMA's current term. The *updated* threshold is the one compared against ("according to the
  current EMA threshold").
- e merges iff u_e >= tau'. GAT-style weights with Euler's number as the kept token's own weight
  (exp(cos(k_c, k_c)) = exp(1)): Z_c = e + sum exp(u_e), k_c <- (e * k_c + sum exp(u_e) k_e) / Z_c, and
  the same for v. Kept tokens that receive nothing are not rewritten (no bf16 round-trip drift).
- Unmerged evicted tokens are simply dropped later by compaction.

Zero-norm keys get cosine 0 with everything (norm clamped at 1e-12, as F.normalize does). The match is
one batched matmul over the heads per chunk of evicted tokens, never a block above `_MAX_SIMS`
elements (the kept tokens are chunked too only when one evicted row alone would exceed it); ties go to
the earliest kept.

No host synchronisation anywhere (a GPU would stall the scheduler on each): the evicted set is built
from host counts, the merge works per evicted token instead of per data-dependent receiver, and the
merged count is returned as a device tensor that only its reporter reads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ._pool import head_rows, region, write_head_rows
from .dispatch import next_pow2, use_triton

NORM_EPS = 1e-12
# Elements of one `[H, evicted chunk, kept chunk]` fp32 similarity block (4 MiB): the match never holds
# more, whatever the region length. Read at call time (tests shrink it to force chunking).
_MAX_SIMS = 1 << 20
_GROUP = 64  # columns per group in `_row_max`


def _evicted(keep: torch.Tensor, n: int) -> torch.Tensor:
    """`[Hkv, n - b]` evicted region indices per head (the complement of `keep`, ascending).

    Built without a host sync: each evicted index lands at its rank among the evicted (a cumulative
    count), kept ones in a spill column that is cut off; every shape comes from host counts."""
    hkv, b = keep.shape
    kept = torch.zeros(hkv, n, dtype=torch.bool, device=keep.device).scatter_(1, keep, True)
    rank = torch.cumsum(~kept, dim=1) - 1
    pos = torch.where(kept, torch.full_like(rank, n - b), rank)
    out = torch.empty(hkv, n - b + 1, dtype=torch.int64, device=keep.device)
    out.scatter_(1, pos, torch.arange(n, device=keep.device).expand(hkv, n))
    return out[:, : n - b]


def _prepare(
    slots: torch.Tensor, keep: torch.Tensor, tau: torch.Tensor | float | None, hkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept indices, evicted indices (the per-head complement, ascending) and tau as [Hkv] float32."""
    keep, tau_t = _keep_and_tau(slots, keep, tau, hkv)
    return keep, _evicted(keep, slots.numel()), tau_t


def _keep_and_tau(
    slots: torch.Tensor, keep: torch.Tensor, tau: torch.Tensor | float | None, hkv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`keep` as int64 `[Hkv, b]` on the slots' device, and tau as `[Hkv]` float32 (0 before the first)."""
    keep = keep.to(device=slots.device, dtype=torch.int64)
    assert keep.dim() == 2 and keep.shape[0] == hkv, "keep must be [Hkv, b]"
    if tau is None:
        return keep, torch.zeros(hkv, dtype=torch.float32, device=slots.device)
    return keep, torch.as_tensor(tau, dtype=torch.float32, device=slots.device).expand(hkv).clone()


def _threshold(u: torch.Tensor, tau: torch.Tensor, beta: float, init: bool, reduce: str) -> torch.Tensor:
    """tau' per head `[Hkv]` from the step's best similarities u `[Hkv, E]`.

    reduce='max' (the paper's Eq. 10 as read here): per head, mean at prefill, then
    beta * max_e(u_e) + (1 - beta) * tau. reduce='mean' (the authors' released code): one scalar per
    layer, the mean of the per-token best similarities over every head, at prefill and in the EMA.
    """
    if reduce == "mean":
        cur = u.mean().expand(u.shape[0])
        return cur.clone() if init else beta * cur + (1.0 - beta) * tau
    if init:
        return u.mean(dim=1)
    return beta * u.amax(dim=1) + (1.0 - beta) * tau


def _rows(flat: torch.Tensor, idx: torch.Tensor, hkv: int) -> torch.Tensor:
    """Rows of a region's `[N * Hkv, D]` view for region indices `idx` `[Hkv, m]` -> `[Hkv, m, D]`."""
    heads = torch.arange(hkv, device=idx.device)[:, None]
    return flat.index_select(0, (idx * hkv + heads).reshape(-1)).view(hkv, idx.shape[1], flat.shape[1])


def _row_max(sims: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sims.max(dim=-1)` (values, first index of the max) in about a quarter of its CPU time.

    torch's max-with-indices is a scalar loop on CPU, while `amax` is vectorised: the row's maximum
    per group of `_GROUP` columns (amax), the first group holding the row's maximum (a max over
    b / _GROUP), then the first column of that group equal to it. Ties resolve as in one `max`: the
    earliest column. Columns past the last whole group are compared on their own."""
    n = sims.shape[-1]
    g = n // _GROUP
    if g < 2:
        return sims.max(dim=-1)
    groups = sims[..., : g * _GROUP].unflatten(-1, (g, _GROUP))
    best, grp = groups.amax(dim=-1).max(dim=-1)
    sub = groups.gather(-2, grp[..., None, None].expand(*grp.shape, 1, _GROUP)).squeeze(-2)
    arg = (sub == best[..., None]).to(torch.uint8).argmax(dim=-1) + grp * _GROUP
    if g * _GROUP < n:
        tail, ti = sims[..., g * _GROUP :].max(dim=-1)
        better = tail > best
        best = torch.where(better, tail, best)
        arg = torch.where(better, ti + g * _GROUP, arg)
    return best, arg


def _match_ref(
    kn: torch.Tensor, evicted: torch.Tensor, keep: torch.Tensor, max_sims: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best cosine u `[H, E]` and its kept index c `[H, E]` from unit keys kn `[N, H, D]` (contiguous).

    One batched matmul over the heads per block of evicted tokens against every kept token; no block
    exceeds `max_sims` elements (`_MAX_SIMS` by default): the evicted tokens go in chunks of
    max_sims / (H * b), and only when one evicted row against every kept token is over the bound are
    the kept tokens chunked too, with a running max (ties keep the earlier kept token, as one
    unchunked argmax does). A full `[H, E, b]` matrix is O(N^2) memory at long contexts."""
    bound = _MAX_SIMS if max_sims is None else max_sims
    hkv, n_ev, b = kn.shape[1], evicted.shape[1], keep.shape[1]
    flat = kn.view(-1, kn.shape[2])
    cb = max(1, min(b, bound // hkv))
    ce = max(1, min(n_ev, bound // (hkv * cb)))
    kc_t = [_rows(flat, keep[:, c0 : c0 + cb], hkv).transpose(1, 2) for c0 in range(0, b, cb)]
    u = torch.empty(hkv, n_ev, dtype=torch.float32, device=kn.device)
    c = torch.empty(hkv, n_ev, dtype=torch.int64, device=kn.device)
    # one block buffer for the whole match: a fresh multi-MiB tensor per block costs page faults
    # (an mmap each, above glibc's threshold) on the CPU and allocator traffic elsewhere
    buf = torch.empty(hkv * ce * cb, dtype=torch.float32, device=kn.device)

    def sims(ke: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
        out = buf[: ke.shape[0] * ke.shape[1] * kc.shape[2]].view(ke.shape[0], ke.shape[1], kc.shape[2])
        return torch.bmm(ke, kc, out=out)

    for e0 in range(0, n_ev, ce):
        ke = _rows(flat, evicted[:, e0 : e0 + ce], hkv)  # [H, ce, D]
        best, arg = _row_max(sims(ke, kc_t[0]))
        for i, kc in enumerate(kc_t[1:], start=1):
            m, a = _row_max(sims(ke, kc))
            better = m > best
            best = torch.where(better, m, best)
            arg = torch.where(better, a + i * cb, arg)
        u[:, e0 : e0 + ce], c[:, e0 : e0 + ce] = best, arg
    return u, c


def _report(stats: dict[str, Any] | None, merged: torch.Tensor, n_evicted: int) -> None:
    """`merged` stays a device tensor (0-dim int64): reading it is the reporter's sync, not the step's."""
    if stats is not None:
        stats["merged"] = merged.sum()
        stats["evicted"] = n_evicted


def _apply_ref(
    bufs: tuple[torch.Tensor, ...],
    slots: torch.Tensor,
    keep: torch.Tensor,
    evicted: torch.Tensor,
    u: torch.Tensor,
    c: torch.Tensor,
    merge: torch.Tensor,
) -> None:
    """Weighted merge into the kept rows, in place, with every shape known on the host.

    Work is indexed by evicted token (H * E rows), never by the data-dependent set of receivers: each
    evicted token's target gets one accumulator row (that of the first evicted token with the same
    target, a scatter-min), weights of unmerged tokens are 0, and every evicted token's target row is
    written back: receivers with their merged value (duplicates write the same value), the others with
    their own value unchanged (a bf16 row round-trips exactly through fp32)."""
    hkv, n_ev = u.shape
    b = keep.shape[1]
    dev = u.device
    heads = torch.arange(hkv, device=dev)[:, None].expand(hkv, n_ev).reshape(-1)
    target = (heads * b + c.reshape(-1)).contiguous()  # flat (head, kept index) per evicted token
    pos = torch.arange(hkv * n_ev, device=dev)
    first = torch.full((hkv * b,), hkv * n_ev, dtype=torch.int64, device=dev)
    acc = first.scatter_reduce_(0, target, pos, reduce="amin").index_select(0, target)
    w = torch.where(merge, u.exp(), torch.zeros_like(u)).reshape(-1)
    z = torch.full((hkv * n_ev,), math.e, dtype=torch.float32, device=dev).index_add_(0, acc, w)
    got = torch.zeros(hkv * n_ev, dtype=torch.int64, device=dev).index_add_(0, acc, merge.reshape(-1).long())
    recv = (got > 0).index_select(0, acc)[:, None]
    zt = z.index_select(0, acc)[:, None]
    dst = slots[keep.reshape(-1).index_select(0, target)]
    src = slots[evicted.reshape(-1)]
    for buf in bufs:
        own = head_rows(buf, dst, heads).float()  # [H * E, D] each evicted token's target row
        num = own * math.e
        num.index_add_(0, acc, head_rows(buf, src, heads).float().mul_(w[:, None]))
        write_head_rows(buf, dst, heads, torch.where(recv, num.index_select(0, acc).div_(zt), own))


def d2o_merge_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    tau: torch.Tensor | float | None,
    beta: float,
    init: bool,
    stats: dict[str, Any] | None = None,
    reduce: str = "max",
) -> torch.Tensor:
    """Torch reference. Returns the new tau [Hkv]; `stats` (if given) gets 'merged' (a device tensor)
    and 'evicted' (an int). No host sync: safe to run between decode steps on a GPU."""
    hkv = k_buffer.shape[1]
    keep, evicted, tau_t = _prepare(slots, keep, tau, hkv)
    b, n_ev = keep.shape[1], evicted.shape[1]
    if n_ev == 0 or b == 0:
        _report(stats, torch.zeros(1, dtype=torch.int64, device=slots.device), 0)
        return tau_t
    k = region(k_buffer, slots).float()  # [N, H, D]
    kn = k.div_(k.norm(dim=-1, keepdim=True).clamp_min_(NORM_EPS))
    u, c = _match_ref(kn, evicted, keep)
    del k, kn
    tau_new = _threshold(u, tau_t, beta, init, reduce)
    merge = u >= tau_new[:, None]
    _report(stats, merge, hkv * n_ev)
    _apply_ref((k_buffer, v_buffer), slots, keep, evicted, u, c, merge)
    return tau_new


@triton.jit
def _d2o_match_kernel(
    k_ptr, slots_ptr, keep_ptr, ev_ptr, u_ptr, c_ptr, B, E, D, s_s, s_h, norm_eps,
    BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per (head, block of evicted): best cosine similarity and its kept index, streaming the kept keys."""
    h = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    mask_e = offs_e < E
    mask_d = offs_d < D
    e_idx = tl.load(ev_ptr + h * E + offs_e, mask=mask_e, other=0)
    e_slot = tl.load(slots_ptr + e_idx, mask=mask_e, other=0)
    ke = tl.load(
        k_ptr + e_slot[:, None] * s_s + h * s_h + offs_d[None, :],
        mask=mask_e[:, None] & mask_d[None, :],
        other=0.0,
    )
    ke = ke.to(tl.float32)
    ke = ke / tl.maximum(tl.sqrt(tl.sum(ke * ke, axis=1)), norm_eps)[:, None]
    best = tl.full([BLOCK_E], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, B, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask_c = offs_c < B
        c_idx = tl.load(keep_ptr + h * B + offs_c, mask=mask_c, other=0)
        c_slot = tl.load(slots_ptr + c_idx, mask=mask_c, other=0)
        kc = tl.load(
            k_ptr + c_slot[:, None] * s_s + h * s_h + offs_d[None, :],
            mask=mask_c[:, None] & mask_d[None, :],
            other=0.0,
        )
        kc = kc.to(tl.float32)
        kc = kc / tl.maximum(tl.sqrt(tl.sum(kc * kc, axis=1)), norm_eps)[:, None]
        sims = tl.dot(ke, tl.trans(kc), input_precision="ieee")  # [BE, BC]
        sims = tl.where(mask_c[None, :], sims, float("-inf"))
        bmax = tl.max(sims, axis=1)
        barg = tl.argmax(sims, axis=1).to(tl.int32) + c0
        better = bmax > best
        arg = tl.where(better, barg, arg)
        best = tl.where(better, bmax, best)
    tl.store(u_ptr + h * E + offs_e, best, mask=mask_e)
    tl.store(c_ptr + h * E + offs_e, arg.to(tl.int64), mask=mask_e)


@triton.jit
def _d2o_apply_kernel(
    k_ptr, v_ptr, slots_ptr, keep_ptr, ev_ptr, u_ptr, order_ptr, start_ptr, cnt_ptr,
    B, E, D, s_s, s_h, euler,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per kept (head, index): weighted sum of itself and its merged evicted tokens, written in place.

    One program per kept token of every head (a grid the host knows, so nothing is read back to size
    it); a kept token that receives nothing writes nothing. The evicted tokens of each target are a
    contiguous run of `order` (CSR), so no atomics are needed and the result does not depend on
    scheduling.
    """
    t = tl.program_id(0)
    h = t // B
    j = t % B
    start = tl.load(start_ptr + h * (B + 1) + j)
    cnt = tl.load(cnt_ptr + h * (B + 1) + j)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = (offs_d < D) & (cnt > 0)
    dst = tl.load(slots_ptr + tl.load(keep_ptr + h * B + j))
    row = dst * s_s + h * s_h + offs_d
    acc_k = tl.load(k_ptr + row, mask=mask_d, other=0.0).to(tl.float32) * euler
    acc_v = tl.load(v_ptr + row, mask=mask_d, other=0.0).to(tl.float32) * euler
    z = euler
    for i in range(start, start + cnt):
        pos = tl.load(order_ptr + h * E + i)
        w = tl.exp(tl.load(u_ptr + h * E + pos))
        src = tl.load(slots_ptr + tl.load(ev_ptr + h * E + pos)) * s_s + h * s_h + offs_d
        acc_k += w * tl.load(k_ptr + src, mask=mask_d, other=0.0).to(tl.float32)
        acc_v += w * tl.load(v_ptr + src, mask=mask_d, other=0.0).to(tl.float32)
        z += w
    tl.store(k_ptr + row, (acc_k / z).to(k_ptr.dtype.element_ty), mask=mask_d)
    tl.store(v_ptr + row, (acc_v / z).to(v_ptr.dtype.element_ty), mask=mask_d)


def d2o_merge_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    tau: torch.Tensor | float | None,
    beta: float,
    init: bool,
    stats: dict[str, Any] | None = None,
    reduce: str = "max",
) -> torch.Tensor:
    """Triton version: matching kernel, tiny torch glue (threshold, CSR by target), merging kernel.

    No host sync: the merging grid is every kept token of every head, sized from host counts."""
    hkv, d = k_buffer.shape[1], k_buffer.shape[2]
    assert k_buffer.stride() == v_buffer.stride() and k_buffer.stride(2) == 1
    slots = slots.contiguous()
    keep, evicted, tau_t = _prepare(slots, keep, tau, hkv)
    keep = keep.contiguous()
    evicted = evicted.contiguous()
    b, n_ev = keep.shape[1], evicted.shape[1]
    if n_ev == 0 or b == 0:
        _report(stats, torch.zeros(1, dtype=torch.int64, device=slots.device), 0)
        return tau_t
    dev = k_buffer.device
    u = torch.empty(hkv, n_ev, dtype=torch.float32, device=dev)
    c = torch.empty(hkv, n_ev, dtype=torch.int64, device=dev)
    bd = max(16, next_pow2(d))
    be = bc = 32
    _d2o_match_kernel[(hkv, triton.cdiv(n_ev, be))](
        k_buffer, slots, keep, evicted, u, c, b, n_ev, d, k_buffer.stride(0), k_buffer.stride(1), NORM_EPS,
        BLOCK_E=be, BLOCK_C=bc, BLOCK_D=bd,
    )  # fmt: skip
    tau_new = _threshold(u, tau_t, beta, init, reduce)
    merge = u >= tau_new[:, None]
    _report(stats, merge, hkv * n_ev)
    # CSR by target: sort each head's evicted by target index (non-merged go last with key b)
    key = torch.where(merge, c, torch.full_like(c, b))
    order = key.argsort(dim=1, stable=True).contiguous()
    count = torch.zeros(hkv, b + 1, dtype=torch.int64, device=dev).scatter_add_(1, key, torch.ones_like(key))
    start = count.cumsum(dim=1) - count
    _d2o_apply_kernel[(hkv * b,)](
        k_buffer, v_buffer, slots, keep, evicted, u, order, start.contiguous(), count, b, n_ev, d,
        k_buffer.stride(0), k_buffer.stride(1), math.e,
        BLOCK_D=next_pow2(d),
    )  # fmt: skip
    return tau_new


def d2o_merge(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    tau: torch.Tensor | float | None,
    beta: float,
    init: bool,
    stats: dict[str, Any] | None = None,
    reduce: str = "max",
) -> torch.Tensor:
    """Merge evicted into kept slots in place; returns the new tau [Hkv]. See the module docstring."""
    if use_triton(k_buffer):
        return d2o_merge_triton(k_buffer, v_buffer, slots, keep, tau, beta, init, stats, reduce)
    return d2o_merge_ref(k_buffer, v_buffer, slots, keep, tau, beta, init, stats, reduce)
