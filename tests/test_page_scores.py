"""Host-tier kernels: page summaries, page scores, page selection and the batched host swap.

Torch references against naive loop formulas in this process; Triton kernels against the references in a
subprocess with TRITON_INTERPRET=1 and KVEVICT_TRITON=1 (as in test_kernels.py). Mocks none: these are
pure tensor ops.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from sgl_kvevict import kernels as K
from sgl_kvevict.tools.pools import SyncCounter

from .interp import run_triton_tests

ps_mod = importlib.import_module("sgl_kvevict.kernels.page_scores")
CUDA = torch.cuda.is_available()
TRITON_READY = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
triton_only = pytest.mark.triton  # without CUDA: deselected here, run by `test_interpreter_subprocess`
DTYPES = [torch.bfloat16, torch.float32]


def _keys(e: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(e, h, d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _naive_summaries(keys: torch.Tensor, page: int):
    e, h, d = keys.shape
    p = -(-e // page)
    out = [torch.zeros(p, h, d) for _ in range(3)]
    for pg in range(p):
        for hh in range(h):
            rows = [keys[c, hh].float().tolist() for c in range(pg * page, min(e, (pg + 1) * page))]
            for j in range(d):
                col = [r[j] for r in rows]
                out[0][pg, hh, j] = min(col)
                out[1][pg, hh, j] = max(col)
                out[2][pg, hh, j] = sum(col) / len(col)
    return out


# --------------------------------------------------------------------------------------------------
# torch references vs naive formulas
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,page", [(1, 4), (8, 4), (11, 4), (7, 1), (5, 16), (33, 16)])
def test_page_summaries_ref_naive(dtype, e, page):
    keys = _keys(e, 3, 5, dtype, seed=e).cpu()
    got = K.page_summaries_ref(keys, page)
    want = _naive_summaries(keys, page)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == (-(-e // page), 3, 5)
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_page_summaries_empty():
    kmin, kmax, kmean = K.page_summaries_ref(torch.zeros(0, 2, 4), 8)
    assert kmin.shape == kmax.shape == kmean.shape == (0, 2, 4)


@pytest.mark.parametrize("n_old,m", [(0, 5), (4, 4), (5, 3), (5, 20), (8, 1), (13, 0), (3, 1)])
def test_page_summaries_append_equals_recompute(n_old, m):
    """Demotion appends columns: merging into the partial last page equals summarising everything again."""
    page = 4
    keys = _keys(n_old + m, 2, 6, torch.float32, seed=n_old * 31 + m).cpu()
    old = K.page_summaries_ref(keys[:n_old], page)
    got = K.page_summaries_append(*old, n_old, keys[n_old:], page)
    want = K.page_summaries_ref(keys, page)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _naive_scores(q, kmin, kmax, kmean, mode, scale, agg):
    w, hq, d = q.shape
    p, hkv, _ = kmin.shape
    g = hq // hkv
    out = torch.zeros(hkv, p)
    for h in range(hkv):
        for pg in range(p):
            vals = []
            for j in range(g):
                for i in range(w):
                    qi = q[i, h * g + j].float().tolist()
                    if mode == "minmax":
                        lo, hi = kmin[pg, h].tolist(), kmax[pg, h].tolist()
                        s = sum(max(a * b, a * c) for a, b, c in zip(qi, lo, hi, strict=True))
                    else:
                        s = sum(a * b for a, b in zip(qi, kmean[pg, h].tolist(), strict=True))
                    vals.append(s * scale)
            out[h, pg] = max(vals) if agg == "max" else sum(vals)
    return out


@pytest.mark.parametrize("mode", ["minmax", "mean"])
@pytest.mark.parametrize("agg", ["max", "sum"])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("chunked", [False, True])
def test_page_scores_ref_naive(monkeypatch, mode, agg, hq, hkv, chunked):
    if chunked:
        monkeypatch.setattr(ps_mod, "_MAX_SCORES", 1)  # one page per chunk
    keys = _keys(21, hkv, 6, torch.float32, seed=5).cpu()
    summ = K.page_summaries_ref(keys, 4)
    q = torch.randn(3, hq, 6, generator=torch.Generator().manual_seed(6))
    got = K.page_scores_ref(q, *summ, mode, 0.4, agg)
    assert got.shape == (hkv, 6) and got.dtype == torch.float32
    torch.testing.assert_close(got, _naive_scores(q, *summ, mode, 0.4, agg), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_minmax_max_is_an_upper_bound(dtype):
    """No query of a group gives any key of a page a larger logit than the page's minmax/max score."""
    e, hq, hkv, d, page = 203, 9, 3, 16, 8
    keys = _keys(e, hkv, d, dtype, seed=7).cpu()
    q = torch.randn(5, hq, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    bound = K.page_scores_ref(q, *K.page_summaries_ref(keys, page), "minmax", 0.125, "max")
    g = hq // hkv
    qf = q.float().permute(1, 0, 2).reshape(hkv, g * 5, d)
    logits = torch.einsum("hqd,ehd->hqe", qf, keys.float()).amax(1) * 0.125  # [Hkv, e]
    pad = torch.full((hkv, (-e) % page), float("-inf"))
    per_page = torch.cat([logits, pad], 1).view(hkv, -1, page).amax(-1)
    assert (per_page <= bound + 1e-5).all()
    assert ((bound - per_page) > 1e-3).any(), "a bound, not the exact maximum"


def test_select_pages_and_gather_columns():
    scores = torch.tensor([[0.1, 5.0, -1.0, 3.0, 2.0], [9.0, 0.0, 1.0, 8.0, float("-inf")]])
    ids = K.select_pages(scores, 3)
    assert ids.tolist() == [[1, 3, 4], [0, 2, 3]]
    assert K.select_pages(scores, 99).shape == (2, 5) and K.select_pages(scores, 0).shape == (2, 0)
    cols, valid = K.gather_columns(torch.tensor([[1, 4], [0, 2]]), 4, 18)
    assert cols.tolist() == [[4, 5, 6, 7, 16, 17, 17, 17], [0, 1, 2, 3, 8, 9, 10, 11]]
    assert valid.tolist() == [[True] * 6 + [False, False], [True] * 8]


def test_refresh_pages_after_a_change():
    """After columns of selected pages change, refreshing those pages equals summarising all again."""
    e, hkv, d, page = 22, 3, 5, 4
    keys = _keys(e, hkv, d, torch.float32, seed=9).cpu()
    summ = [t.clone() for t in K.page_summaries_ref(keys, page)]
    ids = torch.tensor([[0, 5], [2, 3], [1, 5]])  # page 5 is partial (columns 20, 21)
    cols, valid = K.gather_columns(ids, page, e)
    heads = torch.arange(hkv)[:, None]
    new = torch.randn(hkv, cols.shape[1], d, generator=torch.Generator().manual_seed(10))
    changed = keys.clone()
    changed[cols[valid], heads.expand_as(cols)[valid]] = new[valid]
    K.refresh_pages(*summ, ids, changed[cols, heads], valid)
    for g, w in zip(summ, K.page_summaries_ref(changed, page), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["minmax", "mean"])
def test_one_modes_summaries_in_the_kv_dtype(mode):
    """The tier keeps only its mode's summaries, in bf16: append and refresh leave the others None and
    match the fp32 recompute to bf16 rounding, and the scores read only the mode's."""
    e, hkv, d, page, n_old = 30, 2, 8, 4, 13
    keys = _keys(e, hkv, d, torch.float32, seed=21).cpu()
    keep = (mode == "minmax", mode == "minmax", mode == "mean")

    def own(summ):
        return [x.to(torch.bfloat16) if k else None for x, k in zip(summ, keep, strict=True)]

    got = K.page_summaries_append(*own(K.page_summaries_ref(keys[:n_old], page)), n_old, keys[n_old:], page)
    ids = torch.tensor([[1, 7], [0, 4]])  # page 7 is partial (columns 28, 29)
    cols, valid = K.gather_columns(ids, page, e)
    heads = torch.arange(hkv)[:, None]
    changed = keys.clone()
    changed[cols[valid], heads.expand_as(cols)[valid]] = torch.randn(int(valid.sum()), d)
    K.refresh_pages(*got, ids, changed[cols, heads], valid)
    for g, w, k in zip(got, K.page_summaries_ref(changed, page), keep, strict=True):
        assert (g is not None) == k
        if k:
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.float(), w, rtol=1e-2, atol=1e-2)
    q = _keys(3, 2 * hkv, d, torch.float32, seed=22).cpu()
    want = K.page_scores_ref(q, *K.page_summaries_ref(changed, page), mode, 0.3, "sum")
    torch.testing.assert_close(K.page_scores_ref(q, *got, mode, 0.3, "sum"), want, rtol=2e-2, atol=5e-2)


def _naive_swap(kb, vb, slots, hk, hv, cols, swap, counts=None):
    for layer in range(len(kb)):
        for h in range(slots.shape[1]):
            for i in range(slots.shape[2] if counts is None else int(counts[layer, h])):
                s, c = int(slots[layer, h, i]), int(cols[layer, h, i])
                for dev, host in ((kb[layer], hk), (vb[layer], hv)):
                    old = dev[s, h].clone()
                    dev[s, h] = host[layer, c, h]
                    if swap:
                        host[layer, c, h] = old


def _swap_case(layers: int, hkv: int, r: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    slots_n, cols_n, d = 40, 50, 12
    kb = [torch.randn(slots_n, hkv, d, generator=g).to(dtype).to(DEVICE) for _ in range(layers)]
    vb = [torch.randn(slots_n, hkv, d, generator=g).to(dtype).to(DEVICE) for _ in range(layers)]
    hk = torch.randn(layers, cols_n, hkv, d, generator=g).to(dtype).to(DEVICE)
    hv = torch.randn(layers, cols_n, hkv, d, generator=g).to(dtype).to(DEVICE)
    slots = torch.stack(
        [torch.stack([torch.randperm(slots_n, generator=g)[:r] for _ in range(hkv)]) for _ in range(layers)]
    )
    cols = torch.stack(
        [torch.stack([torch.randperm(cols_n, generator=g)[:r] for _ in range(hkv)]) for _ in range(layers)]
    )
    return kb, vb, slots.to(DEVICE), hk, hv, cols.to(DEVICE)


def _clone(kb, vb, hk, hv):
    return [x.clone() for x in kb], [x.clone() for x in vb], hk.clone(), hv.clone()


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("r", [0, 1, 7])
def test_host_swap_ref_naive(swap, r):
    kb, vb, slots, hk, hv, cols = _swap_case(3, 2, r, torch.bfloat16, seed=r)
    want = _clone(kb, vb, hk, hv)
    _naive_swap(*want[:2], slots, *want[2:], cols, swap)
    (K.host_swap_ref if swap else K.host_fetch_ref)(kb, vb, slots, hk, hv, cols)
    for got, exp in zip([*kb, *vb, hk, hv], [*want[0], *want[1], want[2], want[3]], strict=True):
        assert torch.equal(got, exp)
    if swap and r:  # a second swap with the same ids restores both sides
        K.host_swap_ref(kb, vb, slots, hk, hv, cols)
        assert not torch.equal(kb[0], want[0][0])


@pytest.mark.parametrize("swap", [True, False])
def test_host_swap_counts_move_only_each_heads_first_pairs(swap):
    """Ragged recall: counts[l, h] pairs move per (layer, head), the others stay where they are."""
    kb, vb, slots, hk, hv, cols = _swap_case(3, 2, 7, torch.bfloat16, seed=21)
    counts = torch.tensor([[0, 7], [3, 1], [7, 5]])
    layer0 = kb[0].clone()
    want = _clone(kb, vb, hk, hv)
    _naive_swap(*want[:2], slots, *want[2:], cols, swap, counts)
    (K.host_swap if swap else K.host_fetch)(kb, vb, slots, hk, hv, cols, counts)
    for got, exp in zip([*kb, *vb, hk, hv], [*want[0], *want[1], want[2], want[3]], strict=True):
        assert torch.equal(got, exp)
    assert torch.equal(kb[0][:, 0], layer0[:, 0])  # counts 0: layer 0, head 0 as it was
    assert not torch.equal(kb[0][:, 1], layer0[:, 1])


def test_host_swap_twice_is_identity():
    kb, vb, slots, hk, hv, cols = _swap_case(2, 3, 9, torch.float32, seed=11)
    before = _clone(kb, vb, hk, hv)
    K.host_swap(kb, vb, slots, hk, hv, cols)
    assert not torch.equal(hk, before[2])
    K.host_swap(kb, vb, slots, hk, hv, cols)
    for got, exp in zip([*kb, *vb, hk, hv], [*before[0], *before[1], before[2], before[3]], strict=True):
        assert torch.equal(got, exp)


def _recall_path(keys, q, kb, vb, hk, hv, dev_slots) -> None:
    """Summaries, scores, selection, column ids, refresh, swap and fetch, as a paged recall runs them."""
    summ = K.page_summaries(keys, 16)
    summ = K.page_summaries_append(*summ, 300, keys[:40], 16)
    for mode in ("minmax", "mean"):
        scores = K.page_scores(q, *summ, mode, 0.125)
    ids = K.select_pages(scores, 2)
    cols, valid = K.gather_columns(ids, 16, 340)
    K.refresh_pages(*summ, ids, keys[:32].permute(1, 0, 2), valid)
    host_cols = cols[:, :5].expand(2, 3, 5).clamp_max(hk.shape[1] - 1)
    K.host_swap(kb, vb, dev_slots, hk, hv, host_cols)
    K.host_fetch(kb, vb, dev_slots, hk, hv, host_cols)


def test_recall_path_has_no_host_sync():
    """Summaries, scores, selection, column ids and the swap: nothing that would make a GPU wait."""
    keys = _keys(300, 3, 16, torch.bfloat16, seed=12).cpu()
    q = torch.randn(8, 9, 16).bfloat16()
    kb, vb, _, hk, hv, _ = _swap_case(2, 3, 5, torch.bfloat16, seed=13)
    with SyncCounter() as sc:
        _recall_path(keys, q, kb, vb, hk, hv, torch.arange(5).expand(2, 3, 5))
    assert sc.total == 0, sc.counts


@pytest.mark.cuda
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("ragged", [False, True])
def test_cuda_host_swap_with_a_pinned_host_store(swap, ragged):
    """The tier's layout on a GPU: the device rows on CUDA, the host store in pinned CPU memory, which the
    Triton kernel reads and writes through its mapped pointer (the ids never travel to the host)."""
    kb, vb, slots, hk, hv, cols = _swap_case(3, 3, 9, torch.bfloat16, seed=31)
    hk, hv = hk.cpu().pin_memory(), hv.cpu().pin_memory()
    counts = torch.tensor([[0, 9, 4], [1, 2, 3], [9, 9, 9]], device=DEVICE) if ragged else None
    want = [x.cpu() for x in kb], [x.cpu() for x in vb], hk.clone(), hv.clone()
    ref = K.host_swap_ref if swap else K.host_fetch_ref
    ref(*want[:2], slots.cpu(), *want[2:], cols.cpu(), None if counts is None else counts.cpu())
    (K.host_swap if swap else K.host_fetch)(kb, vb, slots, hk, hv, cols, counts)  # Triton on CUDA
    torch.cuda.synchronize()
    assert hk.is_pinned() and not hk.is_cuda
    for got, exp in zip([*kb, *vb, hk, hv], [*want[0], *want[1], want[2], want[3]], strict=True):
        assert torch.equal(got.cpu(), exp)


@pytest.mark.cuda
def test_cuda_recall_path_does_not_sync():
    """`test_recall_path_has_no_host_sync` on a GPU, checked by CUDA itself: in sync debug mode "error"
    any call that makes the host wait for the device raises. Summaries on the device, host store pinned."""
    keys = _keys(300, 3, 16, torch.bfloat16, seed=12)
    q = torch.randn(8, 9, 16, device=DEVICE).bfloat16()
    kb, vb, _, hk, hv, _ = _swap_case(2, 3, 5, torch.bfloat16, seed=13)
    hk, hv = hk.cpu().pin_memory(), hv.cpu().pin_memory()
    dev_slots = torch.arange(5, device=DEVICE).expand(2, 3, 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _recall_path(keys, q, kb, vb, hk, hv, dev_slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# Triton kernels vs torch references
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(TRITON_READY, reason="Triton tests already run in this process")
def test_interpreter_subprocess():
    """Run the `test_triton_*` tests below with TRITON_INTERPRET=1 and KVEVICT_TRITON=1."""
    run_triton_tests(__file__)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,page", [(1, 16), (37, 16), (64, 32), (100, 64), (9, 3)])
def test_triton_page_summaries(e, page, dtype):
    keys = _keys(e, 3, 40, dtype, seed=e)
    got = K.page_summaries(keys, page)  # dispatches to Triton here
    want = K.page_summaries_ref(keys, page)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@triton_only
@pytest.mark.parametrize("mode", ["minmax", "mean"])
@pytest.mark.parametrize("agg", ["max", "sum"])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("w,p", [(1, 1), (5, 33), (70, 40)])
def test_triton_page_scores(mode, agg, hq, hkv, w, p):
    keys = _keys(p * 8 - 3, hkv, 40, torch.bfloat16, seed=p)
    summ = K.page_summaries_ref(keys, 8)
    q = torch.randn(w, hq, 40, generator=torch.Generator().manual_seed(w)).bfloat16().to(DEVICE)
    got = K.page_scores(q, *summ, mode, 40**-0.5, agg)  # dispatches to Triton here
    want = K.page_scores_ref(q, *summ, mode, 40**-0.5, agg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("r", [1, 7, 40])
@pytest.mark.parametrize("ragged", [False, True])
def test_triton_host_swap(dtype, swap, r, ragged):
    kb, vb, slots, hk, hv, cols = _swap_case(2, 3, r, dtype, seed=100 + r)
    counts = torch.randint(0, r + 1, (2, 3), generator=torch.Generator().manual_seed(r)) if ragged else None
    want = _clone(kb, vb, hk, hv)
    (K.host_swap_ref if swap else K.host_fetch_ref)(*want[:2], slots, *want[2:], cols, counts)
    (K.host_swap if swap else K.host_fetch)(kb, vb, slots, hk, hv, cols, counts)  # dispatches to Triton
    for got, exp in zip([*kb, *vb, hk, hv], [*want[0], *want[1], want[2], want[3]], strict=True):
        assert torch.equal(got, exp)


_GPU_KERNELS = [
    ("_summary_kernel", {"PAGE": 32, "BLOCK_P": 32, "BLOCK_D": 64}, "bf16", {}),
    (
        "_page_scores_kernel",
        {"MINMAX": True, "AGG_MAX": True, "BLOCK_W": 32, "BLOCK_P": 32, "BLOCK_D": 64},
        "bf16",
        {},
    ),
    (
        "_page_scores_kernel",
        {"MINMAX": False, "AGG_MAX": False, "BLOCK_W": 16, "BLOCK_P": 32, "BLOCK_D": 64},
        "fp32",
        {},
    ),
    ("_swap_kernel", {"SWAP": True, "BLOCK_R": 64, "BLOCK_D": 64}, "bf16", {}),
]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="interpreted kernels cannot be compiled"
)
@pytest.mark.parametrize("kernel,consts,dtype,_", _GPU_KERNELS)
def test_kernel_compiles_for_gpu(kernel, consts, dtype, _):
    """Compile to an sm_80 cubin without a GPU: catches what the interpreter tolerates (dot shapes, types)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = "host_swap" if kernel == "_swap_kernel" else "page_scores"
    fn = getattr(importlib.import_module(f"sgl_kvevict.kernels.{mod}"), kernel)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("slot_ptr", "col_ptr", "cnt_ptr"):
            sig[name] = "*i64"
        elif name in ("min_ptr", "max_ptr", "mean_ptr", "out_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    try:
        triton.compile(src, target=GPUTarget("cuda", 80, 32))
    except RuntimeError as exc:  # no bundled ptxas on this install
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(str(exc))
        raise
