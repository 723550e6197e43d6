"""A decode step's recall at one layer on a CPU, fused into one compiled loop (numba).

The decision and the exchange are `sgl_kvevict.cache.host_tier.decode_recall.choose` followed by
`host_swap`: that torch form is the reference (and the form a CUDA graph holds); this kernel makes the
same decisions from the same inputs. Why a second form: at batch 1 on a CPU the torch form is ~100 small
ops per layer (gathers, fp32 copies, two products, a softmax, sorts, masks), and their overhead, not their
arithmetic, was most of a decode step's recall. Here each (batch row, KV head) reads its host and row keys
once, scores them, ranks and exchanges in one pass.

Per batch row b and KV head h (C host columns, then W row entries; `pad` marks the padding of both):
1. logits = scale * q[b, h, g] . key for every query head g of the group, key in fp32 from the bf16 pool;
2. an entry's score is its best query head's log-softmax over the C + W entries (`choose` ranks by the
   softmax itself; the log is monotone, so the ranking and comparisons are the same);
3. host entries (not `not_host`) are ranked by their page's best score, then by their own inside a
   page (`recall_core.best_entries`); the row's entries outside `fixed` are ranked lowest first;
4. the i-th best host entry replaces the i-th lowest row entry when it scores higher, scores at least
   `min_score` and i < r[b]; such pairs exchange their K and V rows (device slot <-> host column).
Records, `[B, H, R]`: row positions, host indices, device slots and host columns (0 and `scratch` where
nothing moves) and whether the pair moved, as `choose` returns them. Ties are broken by the lower index.

The sum of the softmax uses a polynomial exp (relative error ~1e-7, the same order as the reductions'
rounding), so a decision can differ from the torch form's only between two scores closer than that.
Keys must be bf16 (the pools are passed as their uint16 bits); other dtypes use the torch form.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
except ImportError:  # a GPU machine needs no CPU kernel
    numba = None

_FAST = {"reassoc", "contract"}  # reorder sums (vectorised); never assume away inf or NaN


def _jit(fastmath: bool = False):
    def wrap(fn):
        if numba is None:
            return fn
        return numba.njit(cache=True, nogil=True, fastmath=_FAST if fastmath else False)(fn)

    return wrap


@_jit(fastmath=True)
def _logits(q_bh, keys, pad_b, logits, scale):  # [G, D] . [n, D] -> [G, n], padding -inf
    groups, dim = q_bh.shape
    for j in range(keys.shape[0]):
        if pad_b[j]:
            for g in range(groups):
                logits[g, j] = np.float32(-np.inf)
            continue
        for g in range(groups):
            acc = np.float32(0.0)
            for d in range(dim):
                acc += q_bh[g, d] * keys[j, d]
            logits[g, j] = acc * scale


@_jit(fastmath=True)
def _exp_sum(x, m, frac, bits):  # sum(exp(x - m)): 2^k * 2^f, |f| <= 1/2, f by a degree-6 polynomial
    n = x.shape[0]
    for j in range(n):
        t = max((x[j] - m) * np.float32(1.4426950408889634), np.float32(-126.0))
        k = np.floor(t + np.float32(0.5))
        f = t - k
        p = np.float32(1.5403530393381606e-4)
        p = np.float32(1.3333558146428443e-3) + f * p
        p = np.float32(9.618129107628477e-3) + f * p
        p = np.float32(5.550410866482158e-2) + f * p
        p = np.float32(0.2402265069591007) + f * p
        p = np.float32(0.6931471805599453) + f * p
        frac[j] = np.float32(1.0) + f * p
        bits[j] = (np.int32(k) + np.int32(127)) << 23
    scale = bits.view(np.float32)
    s = np.float32(0.0)
    for j in range(n):
        s += frac[j] * scale[j]
    return s


@_jit()
def _insert(vals, ids, held, cap, v, i):  # keep the `cap` largest, descending, earlier first on ties
    if held == cap and not v > vals[cap - 1]:
        return held
    t = held if held < cap else cap - 1
    while t > 0 and v > vals[t - 1]:
        vals[t], ids[t] = vals[t - 1], ids[t - 1]
        t -= 1
    vals[t], ids[t] = v, i
    return min(held + 1, cap)


@_jit()
def _check_ids(dev_rows, host_rows, heads, row_ids, host_ids, pad, fixed, slots, cols, c):
    """Every index the layer reads or writes is in its pool, checked before anything moves: the loop
    itself does not check bounds, and a bad index must fail the step (which is undone), not the server."""
    for b in range(row_ids.shape[0]):
        for j in range(pad.shape[1]):
            if pad[b, j]:
                continue
            for h in range(heads):
                rid = host_ids[b, h, j] if j < c else row_ids[b, h, j - c]
                if rid < 0 or rid >= (host_rows if j < c else dev_rows):
                    raise IndexError("recall_layer_cpu: a key index outside its pool")
        for j in range(c):
            if cols[b, j] < 0 or cols[b, j] * heads >= host_rows:
                raise IndexError("recall_layer_cpu: a host column outside the host store")
        for j in range(fixed.shape[1]):
            if not fixed[b, j] and (slots[b, j] < 0 or slots[b, j] * heads >= dev_rows):
                raise IndexError("recall_layer_cpu: a device slot outside the pool")


@_jit()
def _recall_layer(
    q, k_dev, v_dev, k_host, v_host, row_ids, host_ids, pad, not_host, fixed, r_rows, page, swaps,
    min_score, scale, slots, cols, scratch, pos_o, hidx_o, dslot_o, hcol_o, moved_o,
):  # fmt: skip
    batch, heads, groups, dim = q.shape
    c, w = host_ids.shape[2], row_ids.shape[2]
    n, r = c + w, swaps
    ninf = np.float32(-np.inf)
    log_min = np.float32(np.log(min_score)) if min_score > 0 else ninf
    n_pages = (c + page - 1) // page
    bits16 = np.empty((n, dim), np.uint32)
    keys = bits16.view(np.float32)
    logits = np.empty((groups, n), np.float32)
    score = np.empty(n, np.float32)
    frac, bits = np.empty(n, np.float32), np.empty(n, np.int32)
    page_best = np.empty(n_pages, np.float32)
    top_s, top_i = np.empty(r, np.float32), np.empty(r, np.int64)  # the best pages
    own_s, own_i = np.empty(page, np.float32), np.empty(page, np.int64)  # one page's entries, sorted
    host_s, host_i = np.empty(r, np.float32), np.empty(r, np.int64)  # the best host entries
    tail = np.empty(r, np.int64)  # chosen pages' entries scored -inf, ranked last
    row_neg, row_i = np.empty(r, np.float32), np.empty(r, np.int64)  # the lowest row entries, negated
    _check_ids(k_dev.shape[0], k_host.shape[0], heads, row_ids, host_ids, pad, fixed, slots, cols, c)
    for b in range(batch):
        for h in range(heads):
            for j in range(n):  # the keys, bf16 bits to fp32
                if pad[b, j]:
                    continue
                if j < c:
                    src, rid = k_host, host_ids[b, h, j]
                else:
                    src, rid = k_dev, row_ids[b, h, j - c]
                for d in range(dim):
                    bits16[j, d] = np.uint32(src[rid, d]) << 16
            _logits(q[b, h], keys, pad[b], logits, np.float32(scale))
            for j in range(n):
                score[j] = ninf
            for g in range(groups):  # log-softmax over the entries, best query head
                m = ninf
                for j in range(n):
                    m = max(m, logits[g, j])
                lse = m + np.log(_exp_sum(logits[g], m, frac, bits))
                for j in range(n):
                    score[j] = max(score[j], logits[g, j] - lse)
            for j in range(c):
                if not_host[b, j]:
                    score[j] = ninf
            for k in range(n_pages):
                best = ninf
                for j in range(k * page, min(c, k * page + page)):
                    best = max(best, score[j])
                page_best[k] = best
            kp, held = min(r, n_pages), 0
            for k in range(n_pages):  # the kp best pages, best first
                held = _insert(top_s, top_i, held, kp, page_best[k], k)
            got, n_tail = 0, 0
            for u in range(kp):
                lo = top_i[u] * page
                size, held = min(c, lo + page) - lo, 0
                for a in range(size):  # inside the page by own score, stable
                    held = _insert(own_s, own_i, held, size, score[lo + a], lo + a)
                for a in range(size):
                    if own_s[a] == ninf:
                        if n_tail < r:
                            tail[n_tail] = own_i[a]
                            n_tail += 1
                    elif got < r:
                        host_s[got], host_i[got] = top_s[u], own_i[a]
                        got += 1
            for t in range(n_tail):
                if got < r:
                    host_s[got], host_i[got] = ninf, tail[t]
                    got += 1
            while got < r:
                host_s[got], host_i[got] = ninf, c - 1
                got += 1
            held = 0
            for j in range(w):  # the r lowest row entries that may be displaced, as the r largest negated
                held = _insert(row_neg, row_i, held, r, ninf if fixed[b, j] else -score[c + j], j)
            for t in range(r):
                hs = host_s[t]
                moved = hs > -row_neg[t] and hs > ninf and hs >= log_min and t < r_rows[b]
                pos_o[b, h, t], hidx_o[b, h, t], moved_o[b, h, t] = row_i[t], host_i[t], moved
                if not moved:
                    dslot_o[b, h, t], hcol_o[b, h, t] = 0, scratch
                    continue
                slot, col = slots[b, row_i[t]], cols[b, host_i[t]]
                dslot_o[b, h, t], hcol_o[b, h, t] = slot, col
                a, z = slot * heads + h, col * heads + h
                for d in range(dim):
                    k_dev[a, d], k_host[z, d] = k_host[z, d], k_dev[a, d]
                    v_dev[a, d], v_host[z, d] = v_host[z, d], v_dev[a, d]


def _bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 `[rows, H, D]` pool as its `[rows * H, D]` uint16 bits (a view: writes land in the pool)."""
    return t.view(torch.int16).reshape(-1, t.shape[-1]).numpy().view(np.uint16)


def supports(keys: torch.Tensor) -> bool:
    """Whether this kernel can run on the pool `keys`: numba present, a CPU pool of bf16."""
    return numba is not None and keys.device.type == "cpu" and keys.dtype == torch.bfloat16


def recall_layer_cpu(
    q: torch.Tensor,
    k_dev: torch.Tensor,
    v_dev: torch.Tensor,
    k_host: torch.Tensor,
    v_host: torch.Tensor,
    row_ids: torch.Tensor,
    host_ids: torch.Tensor,
    pad: torch.Tensor,
    not_host: torch.Tensor,
    fixed: torch.Tensor,
    r: torch.Tensor,
    page: int,
    swaps: int,
    min_score: float,
    scale: float,
    slots: torch.Tensor,
    cols: torch.Tensor,
    scratch: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Decide and exchange one layer (see the module). `q` `[B, Hq, D]`; the pools `[slots, H, D]` and the
    host store's layer `[cols, H, D]`, bf16, exchanged in place; `row_ids` `[B, H, W]` and `host_ids`
    `[B, H, C]` index the pools' flat `[rows * H, D]` views; `pad` `[B, C + W]`, `not_host` `[B, C]`,
    `fixed` `[B, W]`, `r` `[B]`, `slots` `[B, W]`, `cols` `[B, C]`; `out`: the records `[B, H, R]`
    (positions, host indices, device slots, host columns: int64; moved: bool), written in place."""
    b, heads = row_ids.shape[0], row_ids.shape[1]
    qf = q.float().reshape(b, heads, -1, q.shape[-1]).numpy()
    _recall_layer(
        qf, _bits(k_dev), _bits(v_dev), _bits(k_host), _bits(v_host),
        row_ids.numpy(), host_ids.numpy(), pad.reshape(b, -1).numpy(), not_host.reshape(b, -1).numpy(),
        fixed.reshape(b, -1).numpy(), r.numpy(), int(page), int(swaps), float(min_score), float(scale),
        slots.numpy(), cols.reshape(b, -1).numpy(), int(scratch), *(x.numpy() for x in out),
    )  # fmt: skip


def warm(heads: int, group: int, dim: int) -> None:
    """Compile the kernel (or load it from numba's cache) now, on a step's layouts at the smallest sizes,
    so that a server's first recalling decode step does not wait the ~3 s of a first compile."""
    k = torch.zeros(4, heads, dim, dtype=torch.bfloat16)
    ids = torch.zeros(1, heads, 1, dtype=torch.int64)
    flags = torch.zeros(1, 1, 1, dtype=torch.bool)
    out = (
        *(torch.zeros(1, heads, 1, dtype=torch.int64) for _ in range(4)),
        torch.zeros(1, heads, 1, dtype=torch.bool),
    )
    one = torch.ones(1, dtype=torch.int64)
    recall_layer_cpu(
        torch.zeros(1, heads * group, dim, dtype=torch.bfloat16), k, k.clone(), k.clone(), k.clone(),
        ids, ids.clone(), torch.zeros(1, 1, 1, 2, dtype=torch.bool), flags, flags.clone(), one, 1, 1, 0.0,
        1.0, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, dtype=torch.int64), 0, out,
    )  # fmt: skip
