"""Kernel tests: torch references against naive loop formulas, Triton kernels against the references.

The Triton tests need a GPU or the Triton interpreter. TRITON_INTERPRET must be set before triton is
imported, and the production dispatch reads KVEVICT_TRITON, so on CPU `test_interpreter_subprocess`
re-runs this file's `test_triton_*` tests in a subprocess with both variables set; neither leaks into
this process or into other test modules.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_kvevict import kernels as K

from . import naive
from .interp import run_triton_tests

# the package re-exports functions named like their modules, so fetch the modules themselves
d2o_mod = importlib.import_module("sgl_kvevict.kernels.d2o_merge")
vo_mod = importlib.import_module("sgl_kvevict.kernels.vo_norms")
wa_mod = importlib.import_module("sgl_kvevict.kernels.window_attention")

CUDA = torch.cuda.is_available()
TRITON_READY = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
triton_only = pytest.mark.triton  # without CUDA: deselected here, run by `test_interpreter_subprocess`

SIZES = [1, 7, 129, 300]
# The same sizes where n = 300 costs most of the interpreter's time and adds no branch 129 does not (the
# kernels' blocks are 32 or 64 rows: 129 already spans several and ends on a partial one): the n = 300
# cases run in `make test-long` (`test_interpreter_subprocess_long`), the rest in `make test`.
SIZES_300_LONG = [1, 7, 129, pytest.param(300, marks=pytest.mark.long)]
GQA = [(9, 3), (4, 4)]
DTYPES = [torch.bfloat16, torch.float32]


def _pool(
    n: int, h: int, d: int, dtype: torch.dtype, seed: int, extra: int = 23
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool bigger than the region, with the region's slots scattered in random order."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(n + extra, h, d, generator=g).to(dtype)
    slots = torch.randperm(n + extra, generator=g)[:n].to(torch.int64)
    return buf.to(DEVICE), slots.to(DEVICE)


def _sorted_keep(n: int, h: int, b: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g)[:b].sort().values for _ in range(h)]).to(DEVICE)


def _rows(buf: torch.Tensor, slots: torch.Tensor, h: int) -> list[list[float]]:
    """Naive gather: the region's rows of head h as python floats."""
    return [buf[int(s), h].float().tolist() for s in slots]


# --------------------------------------------------------------------------------------------------
# torch references vs naive formulas (small, in-process, CPU)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_window_attention_ref_naive(monkeypatch, dtype, hq, hkv, chunked, causal):
    if chunked:
        monkeypatch.setattr(wa_mod, "_MAX_LOGITS", 1)  # one KV head per chunk
    n, w, d = 11, 3, 8
    k_buffer, slots = _pool(n, hkv, d, dtype, seed=1)
    k_buffer, slots = k_buffer.cpu(), slots.cpu()
    q = torch.randn(hq, w, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = K.window_attention_ref(q, k_buffer, slots, 0.3, causal=causal)
    assert got.dtype == torch.float32 and got.shape == (hkv, n)
    want = naive.window_attention(q, k_buffer[slots], 0.3, causal).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(hkv), rtol=1e-5, atol=1e-5)
    most = K.window_attention_ref(q, k_buffer, slots, 0.3, causal=causal, reduce="max")
    torch.testing.assert_close(most, naive.window_attention(q, k_buffer[slots], 0.3, causal, "max").float())
    assert (most >= got - 1e-6).all()


def test_window_attention_ref_large_n_cpu():
    """Production CPU shape: N=8192, W=32, Hq=9, Hkv=3, D=64 must fit and stay normalised."""
    k_buffer = torch.randn(8192 + 5, 3, 64).bfloat16()
    slots = torch.randperm(8192 + 5)[:8192]
    q = torch.randn(9, 32, 64).bfloat16()
    out = K.window_attention(q, k_buffer, slots, 64**-0.5)
    assert out.shape == (3, 8192)
    torch.testing.assert_close(out.sum(-1), torch.ones(3), rtol=1e-4, atol=1e-4)


def _naive_lag(buf: torch.Tensor, slots: torch.Tensor, lag: int) -> torch.Tensor:
    """`[H, P - 1, lag]`: each full partition's LagKV score against the next one, per KV head."""
    rows, p = buf[slots], len(slots) // lag
    out = torch.zeros(buf.shape[1], p - 1, lag)
    for h in range(buf.shape[1]):
        for part in range(p - 1):
            out[h, part] = naive.lag_score(
                rows[part * lag : (part + 1) * lag, h], rows[(part + 1) * lag : (part + 2) * lag, h]
            )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lag,p", [(1, 2), (5, 3), (4, 2)])
def test_lag_scores_ref_naive(dtype, lag, p):
    buf, slots = _pool(lag * p, 2, 6, dtype, seed=3)
    buf, slots = buf.cpu(), slots.cpu()
    got = K.lag_scores_ref(buf, slots, lag)
    assert got.shape == (2, p - 1, lag) and got.dtype == torch.float32
    torch.testing.assert_close(got, _naive_lag(buf, slots, lag), rtol=1e-5, atol=1e-6)


def test_lag_scores_constant_channel_is_finite():
    buf, slots = _pool(8, 2, 6, torch.float32, seed=4)
    buf[:, :, 0] = 1.5  # max == min in channel 0
    out = K.lag_scores_ref(buf.cpu(), slots.cpu(), 4)
    assert torch.isfinite(out).all()


def _naive_compact(k_buffers, v_buffers, slots, keep):
    for layer in range(len(k_buffers)):
        for buf in (k_buffers[layer], v_buffers[layer]):
            old = buf.clone()
            for h in range(keep.shape[1]):
                for i in range(keep.shape[2]):
                    buf[int(slots[i]), h] = old[int(slots[int(keep[layer, h, i])]), h]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,b", [(1, 1), (9, 4), (12, 12), (10, 0)])
@pytest.mark.parametrize("strided", [False, True])
def test_compact_ref_naive(dtype, n, b, strided):
    layers, h = 3, 3
    pools = [_pool(n, h, 5, dtype, seed=10 + i) for i in range(2 * layers)]
    slots = pools[0][1].cpu()
    kb = [p[0].cpu() for p in pools[:layers]]
    vb = [p[0].cpu() for p in pools[layers:]]
    if strided:  # not a dense [pool, H, D] tensor: the ref falls back to advanced indexing
        kb = [torch.cat([x, x], dim=2)[..., :5] for x in kb]
        vb = [torch.cat([x, x], dim=2)[..., :5] for x in vb]
    keep = torch.stack([_sorted_keep(n, h, b, seed=20 + layer).cpu() for layer in range(layers)])
    want_k, want_v = [x.clone() for x in kb], [x.clone() for x in vb]
    _naive_compact(want_k, want_v, slots, keep)
    K.compact_ref(kb, vb, slots, keep)
    for got, want in zip(kb + vb, want_k + want_v, strict=True):
        assert torch.equal(got, want)


def _naive_d2o(kb, vb, slots, keep, tau, beta, init):
    """Loop version of the D2O merge as read in kernels/d2o_merge.py; returns (tau', merged)."""
    h_n = kb.shape[1]
    n = len(slots)
    new_tau, merged = [], 0
    for h in range(h_n):
        keys, vals = _rows(kb, slots, h), _rows(vb, slots, h)
        kept = [int(x) for x in keep[h]]
        ev = [j for j in range(n) if j not in kept]
        if not ev:
            new_tau.append(float(tau[h]))
            continue

        def cos(a, b):
            na = max(math.sqrt(sum(x * x for x in a)), 1e-12)
            nb = max(math.sqrt(sum(x * x for x in b)), 1e-12)
            return sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)

        best = []
        for e in ev:
            sims = [cos(keys[e], keys[c]) for c in kept]
            i = max(range(len(kept)), key=lambda t, sims=sims: sims[t])
            best.append((sims[i], kept[i]))
        us = [u for u, _ in best]
        t = sum(us) / len(us) if init else beta * max(us) + (1 - beta) * float(tau[h])
        new_tau.append(t)
        acc = {c: (math.e, [math.e * x for x in keys[c]], [math.e * x for x in vals[c]]) for c in kept}
        got = set()
        for e, (u, c) in zip(ev, best, strict=True):
            if u >= t:
                z, ak, av = acc[c]
                w = math.exp(u)
                acc[c] = (
                    z + w,
                    [a + w * x for a, x in zip(ak, keys[e], strict=True)],
                    [a + w * x for a, x in zip(av, vals[e], strict=True)],
                )
                got.add(c)
                merged += 1
        for c in got:
            z, ak, av = acc[c]
            kb[int(slots[c]), h] = torch.tensor([x / z for x in ak]).to(kb.dtype)
            vb[int(slots[c]), h] = torch.tensor([x / z for x in av]).to(vb.dtype)
    return torch.tensor(new_tau), merged


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("init", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("b", [5, 10])  # 10: mostly kept, the ref compares against all tokens and masks
def test_d2o_merge_ref_naive(monkeypatch, dtype, init, chunked, b):
    if chunked:
        monkeypatch.setattr(d2o_mod, "_MAX_SIMS", 1)
    n, h, d = 13, 3, 4  # small D so that similarities spread and some pass the threshold
    kb, slots = _pool(n, h, d, dtype, seed=30)
    vb, _ = _pool(n, h, d, dtype, seed=31)
    kb, vb, slots = kb.cpu(), vb.cpu(), slots.cpu()
    keep = _sorted_keep(n, h, b, seed=32).cpu()
    tau = torch.tensor([0.5, 0.9, -0.2])
    want_k, want_v = kb.clone(), vb.clone()
    want_tau, want_merged = _naive_d2o(want_k, want_v, slots, keep, tau, 0.7, init)
    stats: dict = {}
    got_tau = K.d2o_merge_ref(kb, vb, slots, keep, tau, 0.7, init, stats=stats)
    torch.testing.assert_close(got_tau, want_tau, rtol=1e-5, atol=1e-6)
    assert stats == {"merged": want_merged, "evicted": h * (n - b)}
    assert 0 < want_merged < h * (n - b)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(kb, want_k, **tol)
    torch.testing.assert_close(vb, want_v, **tol)


def test_d2o_merge_nothing_evicted():
    kb, slots = _pool(6, 2, 4, torch.float32, seed=5)
    before = kb.clone()
    stats: dict = {}
    tau = K.d2o_merge(kb.cpu(), kb.cpu(), slots.cpu(), torch.arange(6).expand(2, 6), 0.25, 0.7, False, stats)
    assert torch.equal(tau, torch.full((2,), 0.25)) and stats["merged"] == 0 and torch.equal(kb, before)


class _BmmSizes(TorchDispatchMode):
    """Records the element count of every `bmm` output: the similarity blocks the match builds."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name == "aten::bmm":
            self.sizes.append(out.numel())
        return out


def _dense_match(kn: torch.Tensor, evicted: torch.Tensor, keep: torch.Tensor):
    """The full `[H, E, b]` cosine matrix at once, then max (first index on ties)."""
    heads = torch.arange(kn.shape[1])[:, None]
    ke, kc = kn[evicted, heads], kn[keep, heads]  # [H, E, D], [H, b, D]
    return torch.einsum("hed,hbd->heb", ke, kc).max(dim=-1)


@pytest.mark.parametrize("bound", [21, 97, 3 * 40 * 13, 1 << 20])
def test_d2o_match_chunked_equals_dense(bound):
    """Bounded blocks (kept chunked too when one evicted row is over the bound; evicted only; one
    block), same best similarity and kept index as the dense matrix, duplicate keys resolving to the
    earliest kept token across chunk boundaries."""
    n, h, d, b = 211, 3, 16, 130
    g = torch.Generator().manual_seed(7)
    k = torch.randn(n, h, d, generator=g)
    keep = _sorted_keep(n, h, b, seed=8).cpu()
    evicted = d2o_mod._evicted(keep, n)
    for hh in range(h):  # exact ties: a kept key copied to a later kept index and to evicted tokens
        k[keep[hh, 100], hh] = k[keep[hh, 3], hh]
        k[evicted[hh, :5], hh] = k[keep[hh, 3], hh]
    kn = k / k.norm(dim=-1, keepdim=True)
    with _BmmSizes() as rec:
        u, c = d2o_mod._match_ref(kn, evicted, keep, max_sims=bound)
    want_u, want_c = _dense_match(kn, evicted, keep)
    torch.testing.assert_close(u, want_u, rtol=1e-6, atol=1e-6)
    assert torch.equal(c, want_c)
    assert (c[:, :5] == 3).all(), "ties go to the earliest kept token"
    full = h * (n - b) * b
    assert max(rec.sizes) <= max(bound, h), rec.sizes  # one row per head is the smallest block
    assert sum(rec.sizes) == full, "every (evicted, kept) pair is computed exactly once"
    assert (len(rec.sizes) > 1) == (bound < full)


def test_d2o_match_large_region_stays_bounded():
    """8K tokens, half kept, production bound: no block above `_MAX_SIMS` elements."""
    n, h, d, b = 8192, 3, 64, 4096
    g = torch.Generator().manual_seed(9)
    kn = torch.nn.functional.normalize(torch.randn(n, h, d, generator=g), dim=-1)
    keep = _sorted_keep(n, h, b, seed=10).cpu()
    evicted = d2o_mod._evicted(keep, n)
    with _BmmSizes() as rec:
        u, c = d2o_mod._match_ref(kn, evicted, keep)
    assert max(rec.sizes) <= d2o_mod._MAX_SIMS < h * (n - b) * b
    rows = torch.arange(0, n - b, 257)  # spot-check against a dense computation of a few rows
    want_u, want_c = _dense_match(kn, evicted[:, rows], keep)
    torch.testing.assert_close(u[:, rows], want_u, rtol=1e-6, atol=1e-6)
    assert torch.equal(c[:, rows], want_c)


@pytest.mark.parametrize("width", [1, 63, 64, 128, 200, 4096 + 17])
def test_d2o_row_max_equals_torch_max(width):
    """Grouped max: the same values and the same first index as `max(dim=-1)`, plateaus included."""
    g = torch.Generator().manual_seed(width)
    sims = (torch.randn(3, 9, width, generator=g) * 2).round() / 2  # few distinct values: many ties
    sims[0, 0, width // 2 :] = 5.0  # a plateau of the maximum starting mid-row
    if width > 64:
        sims[1, 0, -1] = 9.0  # the maximum alone in the last (partial) group
    got_v, got_i = d2o_mod._row_max(sims)
    want_v, want_i = sims.max(dim=-1)
    assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)


def test_d2o_evicted_is_the_sorted_complement():
    n, h, b = 50, 4, 17
    keep = _sorted_keep(n, h, b, seed=11).cpu()
    got = d2o_mod._evicted(keep, n)
    for hh in range(h):
        want = sorted(set(range(n)) - set(keep[hh].tolist()))
        assert got[hh].tolist() == want


def _naive_vo(v_buffer, slots, o_proj):
    hq, d, hidden = o_proj.shape
    hkv = v_buffer.shape[1]
    g = hq // hkv
    out = torch.zeros(hkv, len(slots))
    for h in range(hq):
        w = o_proj[h].float().tolist()
        for j, v in enumerate(_rows(v_buffer, slots, h // g)):
            l1 = sum(abs(sum(v[i] * w[i][c] for i in range(d))) for c in range(hidden))
            out[h // g, j] += l1 / g
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("chunked", [False, True])
def test_vo_norms_ref_naive(monkeypatch, dtype, hq, hkv, chunked):
    if chunked:
        monkeypatch.setattr(vo_mod, "_MAX_PROD", 1)
    vb, slots = _pool(7, hkv, 4, dtype, seed=40)
    o_proj = torch.randn(hq, 4, 6, generator=torch.Generator().manual_seed(41)).to(dtype)
    got = K.vo_norms_ref(vb.cpu(), slots.cpu(), o_proj)
    assert got.shape == (hkv, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, _naive_vo(vb.cpu(), slots.cpu(), o_proj), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("chunk", [1, 2, 5, 300])
def test_vo_norms_rows_equal_pool_norms_bf16(hq, hkv, chunk):
    """The rows a forward writes, in chunks of any size (one decode token, a prefill chunk), get the norms
    `vo_norms` recomputes from the pool later, to fp32 rounding. 16-bit values and weights make every
    product exact, but the sum over D follows the BLAS kernel: equal bit for bit with this machine's torch,
    one fp32 ulp apart for one-token chunks on another (an x86 CPU with torch 2.11)."""
    vb, slots = _pool(300, hkv, 64, torch.bfloat16, seed=42)
    vb, slots = vb.cpu(), slots.cpu()
    o_proj = torch.randn(hq, 64, 96, generator=torch.Generator().manual_seed(43)).to(torch.bfloat16)
    want = K.vo_norms_ref(vb, slots, o_proj)
    got = torch.cat([K.vo_norms_rows(vb[slots[i : i + chunk]], o_proj) for i in range(0, 300, chunk)], 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_dispatch_cpu_uses_ref(monkeypatch):
    monkeypatch.delenv("KVEVICT_TRITON", raising=False)
    assert not K.use_triton(torch.zeros(1))
    monkeypatch.setenv("KVEVICT_TRITON", "1")
    assert K.use_triton(torch.zeros(1))


# --------------------------------------------------------------------------------------------------
# Triton kernels vs torch references (interpreter on CPU: small sizes)
# --------------------------------------------------------------------------------------------------


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.skipif(TRITON_READY, reason="Triton tests already run in this process")
def test_interpreter_subprocess():
    """Run the `test_triton_*` tests below in a subprocess with TRITON_INTERPRET=1 and KVEVICT_TRITON=1: the
    cases without the `long` marker, every kernel and a representative part of each grid (`make test`)."""
    run_triton_tests(__file__, "triton and not long")


@pytest.mark.long
@pytest.mark.skipif(TRITON_READY, reason="Triton tests already run in this process")
def test_interpreter_subprocess_long():
    """The rest of each grid, the `triton` cases with the `long` marker (`make test-long`)."""
    run_triton_tests(__file__, "triton and long")


_FLOAT_ARGS = {"scale", "inv_count", "eps", "norm_eps", "euler", "inv_g"}
_INDEX_PTRS = {
    "slots_ptr",
    "keep_ptr",
    "ev_ptr",
    "c_ptr",
    "order_ptr",
    "start_ptr",
    "cnt_ptr",
}
_FP32_PTRS = {"lse_ptr", "out_ptr", "u_ptr", "m_ptr", "s_ptr"}
_GPU_KERNELS = [
    (
        "window_attention",
        "_wa_lse_kernel",
        {"BLOCK_W": 32, "BLOCK_N": 64, "BLOCK_D": 64, "CAUSAL": True, "ONE_SPLIT": False},
    ),
    ("window_attention", "_wa_combine_kernel", {"BLOCK_W": 32}),
    (
        "window_attention",
        "_wa_prob_kernel",
        {"BLOCK_W": 32, "BLOCK_N": 64, "BLOCK_D": 64, "CAUSAL": False, "MAX": False},
    ),
    (
        "window_attention",
        "_wa_prob_kernel",
        {"BLOCK_W": 32, "BLOCK_N": 64, "BLOCK_D": 64, "CAUSAL": True, "MAX": True},
    ),
    ("lag_scores", "_lag_kernel", {"BLOCK_L": 64, "BLOCK_D": 64}),
    ("compact", "_gather_kernel", {"BLOCK_B": 64, "BLOCK_D": 64}),
    ("compact", "_scatter_kernel", {"BLOCK_B": 64, "BLOCK_D": 64}),
    ("d2o_merge", "_d2o_match_kernel", {"BLOCK_E": 32, "BLOCK_C": 32, "BLOCK_D": 64}),
    ("d2o_merge", "_d2o_apply_kernel", {"BLOCK_D": 64}),
    ("vo_norms", "_vo_kernel", {"BLOCK_N": 32, "BLOCK_D": 64, "BLOCK_H": 64}),
]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="interpreted kernels cannot be compiled"
)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("module,kernel,consts", _GPU_KERNELS)
def test_kernel_compiles_for_gpu(module, kernel, consts, dtype):
    """Compile to an sm_80 cubin without a GPU: catches what the interpreter tolerates (dot shapes, types)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"sgl_kvevict.kernels.{module}"), kernel)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _INDEX_PTRS:
            sig[name] = "*i64"
        elif name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    try:
        triton.compile(src, target=GPUTarget("cuda", 80, 32))
    except RuntimeError as exc:  # no bundled ptxas on this install
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(str(exc))
        raise


@triton_only
def test_triton_dispatch_env():
    """Triton in this process: a CUDA tensor, or the interpreter's opt-in for a CPU one."""
    assert K.use_triton(torch.zeros(1, device=DEVICE))


@pytest.mark.cuda
def test_cuda_kernels_do_not_sync():
    """On a GPU the Triton kernels and their wrappers never make the host wait: CUDA's sync debug mode
    turns any synchronising call (a scalar read, a device-to-host copy, a data-dependent shape) into an
    error."""
    n, b = 300, 75
    kb, slots = _pool(n, 3, 64, torch.bfloat16, seed=5)
    vb, _ = _pool(n, 3, 64, torch.bfloat16, seed=6)
    q = torch.randn(9, 8, 64, device=DEVICE).bfloat16()
    o_proj = torch.randn(9, 64, 96, device=DEVICE).bfloat16()
    keep = _sorted_keep(n, 3, b, seed=7)
    keep_l = torch.stack([keep, keep])
    tau = torch.zeros(3, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        K.window_attention(q, kb, slots, 0.125, True, "max")
        K.lag_scores(kb, slots[:256], 64)
        K.vo_norms(vb, slots, o_proj)
        K.d2o_merge(kb, vb, slots, keep, tau, 0.7, False)
        K.compact([kb, kb.clone()], [vb, vb.clone()], slots, keep_l)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_triton_window_attention(n, hq, hkv, dtype, causal, reduce):
    d, w = 40, min(n, 5) if n != 129 else 32
    k_buffer, slots = _pool(n, hkv, d, dtype, seed=n)
    q = torch.randn(hq, w, d, generator=torch.Generator().manual_seed(n + 1)).to(dtype).to(DEVICE)
    got = K.window_attention(q, k_buffer, slots, d**-0.5, causal, reduce)  # dispatches to Triton here
    want = K.window_attention_ref(q, k_buffer, slots, d**-0.5, causal, reduce)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@triton_only
@pytest.mark.parametrize("split_blocks", [1, 2])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_triton_window_attention_splits(monkeypatch, split_blocks, reduce):
    """Pass 1 splits N across programs: with 64-token splits, the last split (token 128) is in the future
    of the window's first 31 queries, so they see nothing there and the combine must ignore it."""
    monkeypatch.setattr(wa_mod, "_SPLIT_BLOCKS", split_blocks)
    n, d = 129, 40
    k_buffer, slots = _pool(n, 3, d, torch.float32, seed=9)
    q = torch.randn(9, 32, d, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    got = K.window_attention(q, k_buffer, slots, d**-0.5, True, reduce)  # dispatches to Triton here
    want = K.window_attention_ref(q, k_buffer, slots, d**-0.5, True, reduce)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [3, 4])
@pytest.mark.parametrize("lag,p", [(1, 2), (7, 3), (43, 3), (100, 3)])
def test_triton_lag_scores(lag, p, h, dtype):
    buf, slots = _pool(lag * p, h, 64, dtype, seed=lag)
    got = K.lag_scores_triton(buf, slots, lag)
    want = K.lag_scores_ref(buf, slots, lag)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(K.lag_scores(buf, slots, lag), want, rtol=1e-4, atol=1e-6)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv", [3, 4])
@pytest.mark.parametrize("n", SIZES_300_LONG)
@pytest.mark.parametrize("pattern", ["random", "tail", "identity"])
def test_triton_compact_overlapping(n, hkv, dtype, pattern):
    layers, d = 2, 40
    pools = [_pool(n, hkv, d, dtype, seed=100 + i) for i in range(2 * layers)]
    slots = pools[0][1]
    kb = [p[0] for p in pools[:layers]]
    vb = [p[0] for p in pools[layers:]]
    b = max(1, (2 * n) // 3)
    if pattern == "random":
        keep = torch.stack([_sorted_keep(n, hkv, b, seed=7 * layer + n) for layer in range(layers)])
    elif pattern == "tail":  # every destination is also a source: maximal overlap
        keep = torch.arange(n - b, n, device=DEVICE).expand(layers, hkv, b).contiguous()
    else:
        keep = torch.arange(b, device=DEVICE).expand(layers, hkv, b).contiguous()
    want_k, want_v = [x.clone() for x in kb], [x.clone() for x in vb]
    K.compact_ref(want_k, want_v, slots, keep)
    K.compact(kb, vb, slots, keep)  # dispatches to Triton here
    for got, want in zip(kb + vb, want_k + want_v, strict=True):
        assert torch.equal(got, want)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv", [3, 4])
@pytest.mark.parametrize("n", SIZES_300_LONG)
@pytest.mark.parametrize("init,mostly_kept", [(True, False), (False, False), (False, True)])
def test_triton_d2o_merge(n, hkv, dtype, init, mostly_kept):
    d = 8  # small head dim: similarities spread out, so a fair share of tokens merge
    kb, slots = _pool(n, hkv, d, dtype, seed=200 + n)
    vb, _ = _pool(n, hkv, d, dtype, seed=300 + n)
    b = max(1, n - 5 if mostly_kept else n // 3)  # decode evicts a few, prefill most
    keep = _sorted_keep(n, hkv, b, seed=n)
    tau = torch.linspace(0.2, 0.8, hkv, device=DEVICE)
    want_k, want_v = kb.clone(), vb.clone()
    want_stats: dict = {}
    want_tau = K.d2o_merge_ref(want_k, want_v, slots, keep, tau, 0.7, init, want_stats)
    stats: dict = {}
    got_tau = K.d2o_merge(kb, vb, slots, keep, tau, 0.7, init, stats)  # dispatches to Triton here
    torch.testing.assert_close(got_tau, want_tau, rtol=1e-5, atol=1e-6)
    assert stats == want_stats
    if n > b:
        assert stats["merged"] > 0
    torch.testing.assert_close(kb, want_k, **_tol(dtype))
    torch.testing.assert_close(vb, want_v, **_tol(dtype))


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("n", SIZES_300_LONG)
def test_triton_vo_norms(n, hq, hkv, dtype):
    d, hidden = 40, 100  # neither a block multiple: exercises the masks
    vb, slots = _pool(n, hkv, d, dtype, seed=400 + n)
    o_proj = torch.randn(hq, d, hidden, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    got = K.vo_norms(vb, slots, o_proj)  # dispatches to Triton here
    want = K.vo_norms_ref(vb, slots, o_proj)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES_300_LONG)
def test_triton_vo_norms_rows(n, dtype):
    """The forward's rows through the Triton kernel (what the hook runs on a GPU) vs the pool's norms."""
    vb, slots = _pool(n, 3, 40, dtype, seed=500 + n)
    o_proj = torch.randn(9, 40, 100, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    got = K.vo_norms_rows(vb[slots].contiguous(), o_proj)  # dispatches to Triton here
    torch.testing.assert_close(got, K.vo_norms(vb, slots, o_proj), rtol=1e-5, atol=1e-5)
