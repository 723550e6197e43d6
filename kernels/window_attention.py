"""Observation-window attention over a request's paged KV (SnapKV / CriticalKV / D2O scores).

The decode kernels (FlashInfer, Triton paged attention) never return probabilities, so the policies
recompute softmax(q k^T) for the last W queries. Output is `[Hkv, N]`: mean over the W queries and over
the G = Hq // Hkv query heads that share each KV head; every row sums to 1. `reduce="max"` takes the
largest probability over them instead (recall: a token any query of the turn leans on is worth bringing
back, however few the queries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pool import region
from .dispatch import next_pow2, use_triton

# Logits per chunk of KV heads are [G, W, N] fp32; bound the chunk so N=8192 stays small in memory.
_MAX_LOGITS = 1 << 20
# Triton pass 1: tokens per program, in blocks of 64 (N=8192 gives 32 splits per query head).
_SPLIT_BLOCKS = 4


def _check(w: int, n: int, causal: bool) -> None:
    assert not causal or w <= n, "causal window attention needs the window's own tokens among the N slots"


def window_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    causal: bool = False,
    reduce: str = "mean",
) -> torch.Tensor:
    """Torch reference (used on CPU in production). q: [Hq, W, D]; k_buffer: [pool, Hkv, D]; slots: [N].

    causal=True: query i of the window sits at position N - W + i and does not see later tokens.
    """
    hq, w, d = q.shape
    _check(w, slots.numel(), causal)
    hkv = k_buffer.shape[1]
    g = hq // hkv
    n = slots.numel()
    k = region(k_buffer, slots).float()  # [N, Hkv, D]
    qf = q.float().reshape(hkv, g * w, d)
    out = torch.empty(hkv, n, dtype=torch.float32, device=k.device)
    step = max(1, _MAX_LOGITS // max(1, g * w * n))
    for h0 in range(0, hkv, step):
        h1 = min(hkv, h0 + step)
        kh = k[:, h0:h1].permute(1, 2, 0)  # [h, D, N]
        logits = torch.matmul(qf[h0:h1], kh).mul_(scale)  # [h, G*W, N]
        if causal:
            future = torch.ones(w, w, dtype=torch.bool, device=k.device).triu_(1)  # [query, key in window]
            logits.view(h1 - h0, g, w, n)[..., n - w :].masked_fill_(future, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        out[h0:h1] = p.amax(dim=1) if reduce == "max" else p.mean(dim=1)
    return out


@triton.jit
def _wa_lse_kernel(
    q_ptr, k_ptr, slots_ptr, m_ptr, s_ptr, N, W, D, G, scale, SPLIT, n_splits,
    sq_h, sq_w, sk_s, sk_h,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):  # fmt: skip
    """Pass 1, one program per (query head, split of SPLIT tokens): each window query's running max and
    sum of exponentials over the split (`_wa_combine_kernel` merges the splits into the log-sum-exp;
    with ONE_SPLIT the log-sum-exp is written to `m_ptr` here). Splitting N keeps a GPU busy: one program
    per query head alone used 9 of an H200's 132 SMs."""
    hq = tl.program_id(0)
    sp = tl.program_id(1)
    hkv = hq // G
    offs_w = tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    mask_w = offs_w < W
    mask_d = offs_d < D
    q = tl.load(
        q_ptr + hq * sq_h + offs_w[:, None] * sq_w + offs_d[None, :],
        mask=mask_w[:, None] & mask_d[None, :],
        other=0.0,
    )
    q = q.to(tl.float32)
    m = tl.full([BLOCK_W], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_W], tl.float32)
    start = sp * SPLIT  # SPLIT is a multiple of BLOCK_N: a block never crosses into the next split
    for n0 in range(start, tl.minimum(start + SPLIT, N), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        slot = tl.load(slots_ptr + offs_n, mask=mask_n, other=0)
        k = tl.load(
            k_ptr + slot[:, None] * sk_s + hkv * sk_h + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [BW, BN]
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= (N - W + offs_w)[:, None])
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # a causal split can hold nothing a query sees: its max stays -inf, its sum 0 (no inf - inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        m = m_new
    out = (hq * n_splits + sp) * W + offs_w
    if ONE_SPLIT:
        tl.store(m_ptr + out, m + tl.log(s), mask=mask_w)
    else:
        tl.store(m_ptr + out, m, mask=mask_w)
        tl.store(s_ptr + out, s, mask=mask_w)


@triton.jit
def _wa_combine_kernel(m_ptr, s_ptr, lse_ptr, W, n_splits, BLOCK_W: tl.constexpr):
    """Pass 1b, one program per query head: the splits' maxima and sums into each query's log-sum-exp (a
    split a causal query sees nothing of has max -inf and adds 0; every query sees token 0)."""
    hq = tl.program_id(0)
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < W
    m_all = tl.full([BLOCK_W], float("-inf"), tl.float32)
    for sp in range(0, n_splits):
        m = tl.load(m_ptr + (hq * n_splits + sp) * W + offs_w, mask=mask_w, other=float("-inf"))
        m_all = tl.maximum(m_all, m)
    m_all = tl.where(mask_w, m_all, 0.0)
    total = tl.zeros([BLOCK_W], tl.float32)
    for sp in range(0, n_splits):
        m = tl.load(m_ptr + (hq * n_splits + sp) * W + offs_w, mask=mask_w, other=float("-inf"))
        part = tl.load(s_ptr + (hq * n_splits + sp) * W + offs_w, mask=mask_w, other=0.0)
        total += part * tl.exp(m - m_all)
    tl.store(lse_ptr + hq * W + offs_w, m_all + tl.log(total), mask=mask_w)


@triton.jit
def _wa_prob_kernel(
    q_ptr, k_ptr, slots_ptr, lse_ptr, out_ptr, N, W, D, G, scale, inv_count,
    sq_h, sq_w, sk_s, sk_h,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    MAX: tl.constexpr,
):  # fmt: skip
    """Pass 2, one program per (KV head, token block): sum (or max) of probabilities over the group's
    queries."""
    hkv = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_w = offs_w < W
    mask_d = offs_d < D
    slot = tl.load(slots_ptr + offs_n, mask=mask_n, other=0)
    k = tl.load(
        k_ptr + slot[:, None] * sk_s + hkv * sk_h + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    kt = tl.trans(k.to(tl.float32))
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, G):
        hq = hkv * G + g
        q = tl.load(
            q_ptr + hq * sq_h + offs_w[:, None] * sq_w + offs_d[None, :],
            mask=mask_w[:, None] & mask_d[None, :],
            other=0.0,
        )
        lse = tl.load(lse_ptr + hq * W + offs_w, mask=mask_w, other=0.0)
        logits = tl.dot(q.to(tl.float32), kt, input_precision="ieee") * scale
        p = tl.exp(logits - lse[:, None])
        visible = mask_w[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= (N - W + offs_w)[:, None])
        p = tl.where(visible, p, 0.0)
        if MAX:
            acc = tl.maximum(acc, tl.max(p, axis=0))
        else:
            acc += tl.sum(p, axis=0)
    tl.store(out_ptr + hkv * N + offs_n, acc * inv_count, mask=mask_n)


def window_attention_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    causal: bool = False,
    reduce: str = "mean",
) -> torch.Tensor:
    """Two-pass Triton version (LSE, then probabilities); never materialises [Hq, W, N]."""
    hq, w, d = q.shape
    _check(w, slots.numel(), causal)
    hkv = k_buffer.shape[1]
    g = hq // hkv
    n = slots.numel()
    q = q.contiguous()
    slots = slots.contiguous()
    assert k_buffer.stride(2) == 1, "k_buffer last dim must be contiguous"
    out = torch.empty(hkv, n, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    bw, bd = max(16, next_pow2(w)), max(16, next_pow2(d))
    bn = 64
    split = bn * _SPLIT_BLOCKS
    n_splits = triton.cdiv(n, split)
    m_part = torch.empty(hq, n_splits, w, dtype=torch.float32, device=q.device)
    s_part = torch.empty_like(m_part)
    _wa_lse_kernel[(hq, n_splits)](
        q, k_buffer, slots, m_part, s_part, n, w, d, g, float(scale), split, n_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        BLOCK_W=bw, BLOCK_N=bn, BLOCK_D=bd, CAUSAL=causal, ONE_SPLIT=n_splits == 1,
    )  # fmt: skip
    if n_splits == 1:
        lse = m_part.view(hq, w)
    else:
        lse = torch.empty(hq, w, dtype=torch.float32, device=q.device)
        _wa_combine_kernel[(hq,)](m_part, s_part, lse, w, n_splits, BLOCK_W=bw)
    _wa_prob_kernel[(hkv, triton.cdiv(n, bn))](
        q, k_buffer, slots, lse, out, n, w, d, g, float(scale), 1.0 if reduce == "max" else 1.0 / (g * w),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        BLOCK_W=bw, BLOCK_N=bn, BLOCK_D=bd, CAUSAL=causal, MAX=reduce == "max",
    )  # fmt: skip
    return out


def window_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    causal: bool = False,
    reduce: str = "mean",
) -> torch.Tensor:
    """`[Hkv, N]` float32 window attention; see the package docstring for the contract."""
    assert reduce in ("mean", "max"), f"reduce must be mean or max, got {reduce!r}"
    if use_triton(k_buffer):
        return window_attention_triton(q, k_buffer, slots, scale, causal, reduce)
    return window_attention_ref(q, k_buffer, slots, scale, causal, reduce)
