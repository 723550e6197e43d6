"""Policy unit tests: every formula against a naive re-implementation written here (the window attention
and LagKV's score: `tests/naive.py`), plus the invariants (exact budgets, sinks and recent window kept,
sorted indices) and the registry's errors."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvevict import policies as P
from sgl_kvevict.policies.base import LayerView

from . import naive

H, HQ, D, HID = 3, 9, 16, 24


def make_view(
    n: int,
    n_sink: int = 4,
    n_recent: int = 8,
    n_compacted: int = 0,
    seed: int = 0,
    pool_extra: int = 0,
    attn: bool = True,
) -> LayerView:
    """Dense keys [N, H, D] in a pool; slots = arange(N) (or a permutation inside a larger pool)."""
    g = torch.Generator().manual_seed(seed)
    pool = n + pool_extra
    k = torch.randn(pool, H, D, generator=g)
    v = torch.randn(pool, H, D, generator=g)
    slots = torch.arange(n) if pool_extra == 0 else torch.randperm(pool, generator=g)[:n]
    a = torch.rand(H, n, generator=g).pow(4).softmax(-1) if attn else None
    o = torch.randn(HQ, D, HID, generator=g) / 4
    return LayerView(0, k, v, slots, n_sink, n_recent, n_compacted, attn=a, o_proj=o)


def dense(view: LayerView, which: str = "k") -> list[list[torch.Tensor]]:
    """Per head, per region index, the vector (python lists: the naive side)."""
    buf = view.k_buffer if which == "k" else view.v_buffer
    return [[buf[int(s), h].double() for s in view.slots] for h in range(view.n_kv_heads)]


def naive_keep(scores: list[list[float]], view: LayerView, b: int) -> list[list[int]]:
    n = view.n
    cand = list(range(view.n_sink, n - view.n_recent))
    out = []
    for row in scores:
        best = sorted(cand, key=lambda j: -row[j])[: min(b, len(cand))]
        out.append(sorted(set(range(view.n_sink)) | set(range(n - view.n_recent, n)) | set(best)))
    return out


def as_lists(keep: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row] for row in keep]


def check_invariants(keep: torch.Tensor, view: LayerView, n_kept: int) -> None:
    assert keep.shape == (view.n_kv_heads, n_kept)
    assert keep.dtype == torch.int64
    assert bool((keep[:, 1:] > keep[:, :-1]).all()), "kept indices sorted, unique"
    assert int(keep.min()) >= 0 and int(keep.max()) < view.n
    for row in as_lists(keep):
        assert set(range(view.n_sink)) <= set(row)
        assert set(range(view.n - view.n_recent, view.n)) <= set(row)


# ---------------------------------------------------------------- scoring policies: formulas


def test_streaming_keeps_sinks_and_newest() -> None:
    view = make_view(50)
    keep = P.build("streaming").select(view, 10)
    want = list(range(4)) + list(range(50 - 8 - 10, 50))
    assert as_lists(keep) == [want] * H


def test_knorm_formula() -> None:
    view = make_view(40, pool_extra=20)
    pol = P.build("knorm")
    ks = dense(view)
    want = [[-math.sqrt(sum(float(x) ** 2 for x in ks[h][j])) for j in range(view.n)] for h in range(H)]
    assert torch.allclose(pol.score(view), torch.tensor(want, dtype=torch.float32), atol=1e-5)
    assert as_lists(pol.select(view, 12)) == naive_keep(want, view, 12)


def test_h2o_window_accumulated_attention() -> None:
    view = make_view(30, attn=False)
    q = torch.randn(HQ, 4, D)
    want = naive.window_attention(q, view.k_buffer[view.slots], 0.25).float() * 4
    from sgl_kvevict.kernels import window_attention

    view.attn = window_attention(q, view.k_buffer, view.slots, 0.25)
    pol = P.build("h2o", {"window": 4})
    assert torch.allclose(pol.score(view), want, atol=1e-5)
    assert as_lists(pol.select(view, 7)) == naive_keep(want.tolist(), view, 7)


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("kernel", [1, 5, 7])
def test_snapkv_pooling(pooling: str, kernel: int) -> None:
    view = make_view(35)
    pol = P.build("snapkv", {"kernel_size": kernel, "pooling": pooling})
    a = view.attn.tolist()
    want = []
    for row in a:
        out = []
        for j in range(len(row)):
            win = [row[t] for t in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= t < len(row)]
            out.append(max(win) if pooling == "max" else sum(win) / kernel)  # zero padding counted
        want.append(out)
    assert torch.allclose(pol.score(view), torch.tensor(want), atol=1e-6)
    keep = pol.select(view, 9)
    if pooling == "avg":
        assert as_lists(keep) == naive_keep(want, view, 9)
    else:  # max pooling makes ties: compare the kept candidates' scores
        for h, row in enumerate(as_lists(keep)):
            got = sorted(want[h][j] for j in row if 4 <= j < 35 - 8)
            assert got == sorted(want[h][4 : 35 - 8])[-9:]


SCORING = [
    ("streaming", {}),
    ("knorm", {}),
    ("h2o", {}),
    ("snapkv", {}),
    ("d2o", {}),
    ("d2o", {"recent_fraction": 0.0}),
    ("graphkv", {}),
    ("graphkv", {"base": "knorm", "rounds": 2}),
    ("graphkv", {"base": "d2o"}),
    ("criticalkv", {}),
    ("criticalkv", {"base": "h2o", "alpha": 0.25}),
    ("criticalkv", {"base": "d2o"}),
]


@pytest.mark.parametrize("name,cfg", SCORING)
@pytest.mark.parametrize("budget", [0, 1, 13, 60, 10_000])
def test_budget_sinks_recent_sorted(name: str, cfg: dict, budget: int) -> None:
    view = make_view(80, n_sink=4, n_recent=8, pool_extra=16, seed=budget)
    pol = P.build(name, {"recent": 8, **cfg})
    keep = pol.select(view, budget)
    check_invariants(keep, view, 4 + 8 + min(budget, 80 - 12))


# ---------------------------------------------------------------- LagKV


def naive_lagkv(view: LayerView, lag: int, r: float, budget: int | None, vr: float = 1.0) -> list[list[int]]:
    """LagKV selection per head with plain lists, following the lagkv docstring (one compression call)."""
    n, k = view.n, int(r * lag)
    t0 = max(view.n_sink, view.n_compacted)
    pc = max(0, min((n - t0) // lag - 1, (n - view.n_recent - t0) // lag))
    ks, vs = view.k_buffer[view.slots], view.v_buffer[view.slots]
    out = []
    for h in range(view.n_kv_heads):

        def score(idx: list[int], ref: list[int], h: int = h) -> list[float]:
            sk = naive.lag_score(ks[idx, h], ks[ref, h])
            sv = naive.lag_score(vs[idx, h], vs[ref, h])
            return (sk + vr * sv).tolist()

        def top(idx: list[int], s: list[float], kk: int) -> list[int]:
            best = sorted(range(len(idx)), key=lambda i: -s[i])[:kk]
            return [idx[i] for i in sorted(best)]

        seq = list(range(view.n_sink, t0))
        for p in range(pc):
            part = list(range(t0 + p * lag, t0 + (p + 1) * lag))
            nxt = list(range(t0 + (p + 1) * lag, t0 + (p + 2) * lag))
            seq += top(part, score(part, nxt), k)
        raw = list(range(t0 + pc * lag, n))
        ref = raw[:lag]
        if budget is not None:
            while len(seq) > budget and len(seq) >= lag and len(ref) == lag:
                rem = len(seq) % lag
                chunks = seq[rem:] + ref
                new = seq[:rem]
                for c in range(len(seq) // lag):
                    part, nxt = chunks[c * lag : (c + 1) * lag], chunks[(c + 1) * lag : (c + 2) * lag]
                    new += top(part, score(part, nxt), k)
                seq = new
            if len(seq) > budget:
                seq = top(seq, score(seq, ref or seq), budget)
        out.append(list(range(view.n_sink)) + seq + raw)
    return out


def eq12(ls: int, s: int, lag: int, r: float) -> int:
    if ls < s + 2 * lag:
        return ls
    return s + int(r * lag) * ((ls - s) // lag - 1) + lag + (ls - s) % lag


@pytest.mark.parametrize(
    "n,sinks,lag,r", [(100, 4, 8, 0.5), (131, 16, 16, 0.25), (47, 0, 8, 0.375), (20, 4, 8, 0.5)]
)
def test_lagkv_one_shot_matches_naive_and_eq12(n: int, sinks: int, lag: int, r: float) -> None:
    view = make_view(n, n_sink=sinks, n_recent=4, pool_extra=7, seed=n)
    pol = P.build("lagkv", {"lag": lag, "ratio": r, "sinks": sinks, "recent": 4})
    keep = pol.select(view, 10**9)
    assert keep.shape[1] == eq12(n, sinks, lag, r)
    assert as_lists(keep) == naive_lagkv(view, lag, r, None)
    check_invariants(keep, view, keep.shape[1])


def expected_capped(c: int, lag: int, k: int, budget: int) -> int:
    while c > budget and c >= lag:
        c = c % lag + (c // lag) * k
    return min(c, budget)


@pytest.mark.parametrize("budget", [0, 5, 20, 33, 40, 64, 1000])
def test_lagkv_chunk_recursion_count_and_content(budget: int) -> None:
    n, sinks, lag, r = 180, 4, 8, 0.5
    view = make_view(n, n_sink=sinks, n_recent=4, seed=budget)
    pol = P.build("lagkv", {"lag": lag, "ratio": r, "recent": 4})
    keep = pol.select(view, budget)
    pc = (n - sinks) // lag - 1
    raw = n - sinks - pc * lag
    c = expected_capped(pc * int(r * lag), lag, int(r * lag), budget)
    assert keep.shape[1] == sinks + c + raw
    assert keep.shape[1] == eq12(n, sinks, lag, r) - pc * int(r * lag) + c
    assert as_lists(keep) == naive_lagkv(view, lag, r, budget)
    check_invariants(keep, view, keep.shape[1])


def test_lagkv_cap_off_ignores_budget() -> None:
    view = make_view(100, n_recent=4)
    pol = P.build("lagkv", {"lag": 8, "cap_to_budget": False, "recent": 4})
    assert pol.select(view, 3).shape[1] == eq12(100, 4, 8, 0.5)


def test_lagkv_decode_round_on_compacted_region() -> None:
    """Second round: the compacted part (per-head tokens) is kept, only the raw tail is partitioned."""
    n, lag = 90, 8
    view = make_view(n, n_sink=4, n_recent=4, n_compacted=30, seed=3, pool_extra=10)
    pol = P.build("lagkv", {"lag": lag, "recent": 4})
    keep = pol.select(view, 10**6)
    assert as_lists(keep) == naive_lagkv(view, lag, 0.5, None)
    pc = (n - 30) // lag - 1
    assert keep.shape[1] == 30 + pc * 4 + (n - 30 - pc * lag)
    assert P.compacted_len(keep, n) == 30 + pc * 4
    # over budget: the compacted part is re-compressed against the raw tail
    keep2 = pol.select(view, 20)
    assert as_lists(keep2) == naive_lagkv(view, lag, 0.5, 20)


def test_lagkv_trigger() -> None:
    pol = P.build("lagkv", {"lag": 8, "recent": 4})
    assert not pol.should_compress(4 + 15, 4, 4, 0, 0, "decode")
    assert pol.should_compress(4 + 16, 4, 4, 0, 0, "decode")
    assert pol.should_compress(4 + 16, 4, 4, 0, 0, "prefill")
    assert not pol.should_compress(40 + 15, 4, 4, 40, 36, "decode")
    assert pol.should_compress(40 + 16, 4, 4, 40, 36, "decode")
    assert pol.should_compress(40 + 3, 4, 4, 40, 20, "decode")  # compacted part over the budget
    assert not P.build("lagkv", {"lag": 8, "recent": 12}).should_compress(4 + 19, 4, 12, 0, 0, "decode")
    # a budget covering every candidate keeps everything, whatever the partitions
    assert not pol.should_compress(4 + 64, 4, 4, 0, 60, "prefill")
    assert pol.should_compress(4 + 64, 4, 4, 0, 59, "prefill")


def test_lagkv_with_ratio_hook() -> None:
    pol = P.build("lagkv", {"lag": 16})
    assert pol.with_ratio(0.25).keep_per_partition == 4 and pol.keep_per_partition == 8
    assert pol.with_ratio(0.001).keep_per_partition == 1 and pol.with_ratio(0.999).keep_per_partition == 15


def test_lagkv_budget_means_what_it_says() -> None:
    """A budget covering the request keeps everything; with `ratio_from_budget` a ratio budget is LagKV's
    per-partition r (also as a refiner's base), else `ratio` stays and the budget caps."""
    from sgl_kvevict.config import KvConfig

    n, sinks, recent = 2500, 4, 32
    for budget in (1.0, 1 << 24, n):
        cfg = KvConfig(policy="lagkv", budget=budget)
        b = cfg.resolve_budget(n, sinks + recent)
        assert not cfg.build().should_compress(n, sinks, recent, 0, b, "prefill"), budget
    cfg = KvConfig(policy="lagkv", budget=0.5)
    assert cfg.build().should_compress(n, sinks, recent, 0, cfg.resolve_budget(n, sinks + recent), "prefill")
    assert KvConfig(policy="lagkv", budget=0.25, config={"lag": 16}).build().keep_per_partition == 8
    follow = {"lag": 16, "ratio_from_budget": True}
    assert KvConfig(policy="lagkv", budget=0.25, config=follow).build().keep_per_partition == 4
    assert KvConfig(policy="lagkv", budget=256, config=follow).build().keep_per_partition == 8
    g = KvConfig(policy="graphkv", budget=0.25, config={"base": "lagkv", "base_config": follow}).build()
    assert g.base.keep_per_partition == 4


def test_lagkv_ratio_error_names_field_and_range() -> None:
    with pytest.raises(P.PolicyConfigError, match=r"ratio 0.001 keeps .* between 1 and lag - 1 = 127"):
        P.build("lagkv", {"ratio": 0.001})


# ---------------------------------------------------------------- D2O


def test_d2o_recent_fraction_and_density_stats() -> None:
    view = make_view(100, n_sink=4, n_recent=8)
    pol = P.build("d2o", {"recent": 8, "window": 32})
    budget = 40
    keep = pol.select(view, budget)
    extra = round(0.25 * (budget + 8)) - 8  # 4 more recent candidates on top of `recent`
    s = (view.attn * 32).tolist()
    for row in s:
        for j in range(100 - 8 - extra, 100 - 8):
            row[j] = float("inf")
    assert as_lists(keep) == naive_keep(s, view, budget)
    col = view.attn * 32
    var = [float(torch.tensor([float(x) for x in r], dtype=torch.float64).var()) for r in col]
    assert view.stats["d2o_sigma2"] == pytest.approx(sum(var) / H, rel=1e-4)
    assert view.stats["d2o_inv_var"] == pytest.approx(H / sum(var), rel=1e-4)


def test_d2o_merge_conserves_weighted_sum() -> None:
    view = make_view(60, pool_extra=5, seed=7)
    pol = P.build("d2o", {"beta": 0.7, "merge": True})
    k0, v0 = view.k_buffer.clone().double(), view.v_buffer.clone().double()
    keep = pol.select(view, 20)
    pol.merge(view, keep)
    e = math.e
    taus = []
    for h in range(H):
        kept = [int(x) for x in keep[h]]
        ev = [j for j in range(view.n) if j not in kept]
        kk = {j: k0[int(view.slots[j]), h] for j in range(view.n)}
        cos = {(x, c): float(kk[x] @ kk[c] / (kk[x].norm() * kk[c].norm())) for x in ev for c in kept}
        best = {x: max(kept, key=lambda c, x=x: cos[(x, c)]) for x in ev}
        u = {x: cos[(x, best[x])] for x in ev}
        tau = sum(u.values()) / len(u)
        taus.append(tau)
        merged = [x for x in ev if u[x] >= tau]
        for which, buf0, buf in (("k", k0, view.k_buffer), ("v", v0, view.v_buffer)):
            lhs = torch.zeros(D, dtype=torch.float64)
            rhs = torch.zeros(D, dtype=torch.float64)
            for c in kept:
                z = e + sum(math.exp(u[x]) for x in merged if best[x] == c)
                lhs += z * buf[int(view.slots[c]), h].double()
                rhs += e * buf0[int(view.slots[c]), h]
            for x in merged:
                rhs += math.exp(u[x]) * buf0[int(view.slots[x]), h]
            assert torch.allclose(lhs, rhs, atol=1e-3), which
    assert torch.allclose(view.state["tau"].double(), torch.tensor(taus, dtype=torch.float64), atol=1e-5)
    # decode: EMA of the step's max similarity, not a re-initialisation
    tau0 = view.state["tau"].clone()
    view2 = make_view(30, pool_extra=0, seed=8)
    view2.state = view.state
    keep2 = pol.select(view2, 10)
    pol.merge(view2, keep2)
    assert not torch.allclose(view2.state["tau"], tau0)


def test_d2o_accumulated_scores_sum_each_query_once() -> None:
    """`scores: accumulated`: the first compression scores attn * W (W queries seen); the next adds the
    window's attention once per query that arrived since (the region grew by exactly those), onto the
    kept tokens' carried sums, in kept order."""
    pol = P.build("d2o", {"scores": "accumulated", "recent": 8, "window": 8, "merge": False})
    view = make_view(60, n_sink=4, n_recent=8)
    keep = pol.select(view, 20)
    first = view.state["scored"]
    torch.testing.assert_close(first, view.attn * 8)
    view.state["carried"] = first.gather(1, keep)  # what the runner keeps for the next compression
    k = keep.shape[1]
    view2 = make_view(k + 5, n_sink=4, n_recent=8, seed=1)
    view2.state = view.state
    pol.select(view2, 20)
    want = view2.attn * 5
    want[:, :k] += first.gather(1, keep)
    torch.testing.assert_close(view2.state["scored"], want)
    window = P.build("d2o", {"recent": 8, "window": 8})  # h2o's reading: max with the carried score
    view3 = make_view(k + 5, n_sink=4, n_recent=8, seed=1)
    view3.state = {"carried": first.gather(1, keep)}
    window.select(view3, 20)
    want = view3.attn * 8
    want[:, :k] = torch.maximum(want[:, :k], first.gather(1, keep))
    torch.testing.assert_close(view3.state["scored"], want)


def test_d2o_merge_off() -> None:
    view = make_view(40)
    k0 = view.k_buffer.clone()
    pol = P.build("d2o", {"merge": False})
    pol.merge(view, pol.select(view, 5))
    assert torch.equal(view.k_buffer, k0) and "tau" not in view.state


# ---------------------------------------------------------------- GraphKV


def naive_decay(
    s: list[float],
    keys: list[torch.Tensor],
    n_src: int,
    m: int,
    rounds: int,
    lam: float,
    clamp: bool = False,
) -> list[float]:
    """GraphKV from the paper's text: e_ij cosine of keys (Eq. 1), the top-k scores are sources (Eq. 2),
    each source's m most similar other tokens (Eq. 3) are multiplied by (1 - lambda e_ij) (Eq. 4), the
    factors multiplying over sources and over T rounds of the fixed graph (Eq. 5, Alg. 2)."""
    n = len(s)
    nk = [k / k.norm() for k in keys]
    src = sorted(range(n), key=lambda j: -s[j])[:n_src]
    out = list(s)
    for i in src:
        sims = sorted(((float(nk[i] @ nk[j]), j) for j in range(n) if j != i), reverse=True)[: min(m, n - 1)]
        for e, j in sims:
            e = min(max(e, 0.0), 1.0) if clamp else e
            out[j] *= (1 - lam * e) ** rounds
    return out


@pytest.mark.parametrize("rounds,lam,m", [(1, 1.0, 3), (2, 0.5, 5), (3, 0.8, 1)])
@pytest.mark.parametrize("source_of", ["total", "candidates"])
@pytest.mark.parametrize("clamp", [False, True])
def test_graphkv_decay_formula(rounds: int, lam: float, m: int, source_of: str, clamp: bool) -> None:
    view = make_view(60, n_recent=8)
    pol = P.build(
        "graphkv",
        {
            "rounds": rounds,
            "decay": lam,
            "neighbors": m,
            "adaptive_neighbors": False,
            "recent": 8,
            "source_of": source_of,
            "clamp_similarity": clamp,
        },
    )
    budget = 20
    # sources: 0.3 x the KV a head keeps (the paper's B counts the observation window), or x the budget
    n_src = int(0.3 * (budget + 4 + 8)) if source_of == "total" else int(0.3 * budget)
    base = P.build("snapkv", {"recent": 8}).score(view)
    cand = view.candidates()
    ks = dense(view)
    want = []
    for h in range(H):
        row = base[h].tolist()
        row[cand] = naive_decay(row[cand], ks[h][cand], n_src, m, rounds, lam, clamp)
        want.append(row)
    assert as_lists(pol.select(view, budget)) == naive_keep(want, view, budget)
    kept = budget + 12 if source_of == "total" else budget
    refined = pol.refine(base[:, cand], view.keys()[:, cand], kept)
    assert torch.allclose(refined, torch.tensor([w[cand] for w in want]), rtol=1e-4, atol=1e-9)


def test_graphkv_negative_similarity_raises_score_unless_clamped() -> None:
    """Eq. 4 with a neighbour at cosine -0.5: (1 - e) = 1.5 raises it; the clamped reading leaves it."""
    s = torch.tensor([[1.0, 0.5]])
    keys = torch.tensor([[[1.0, 0.0], [-0.5, 0.75**0.5]]])
    cls = P.REGISTRY["graphkv"]
    raw = cls.refine(P.build("graphkv", {"neighbors": 1, "adaptive_neighbors": False}), s, keys, 1)
    clamped = cls.refine(
        P.build("graphkv", {"neighbors": 1, "adaptive_neighbors": False, "clamp_similarity": True}),
        s,
        keys,
        1,
    )
    assert torch.allclose(raw, torch.tensor([[1.0, 0.75]])) and torch.equal(clamped, s)


def dense_neighbors(kn: torch.Tensor, src: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier dense implementation: the whole [R, k, n] similarity tensor, then top-m."""
    from sgl_kvevict.policies.graphkv import source_neighbors_dense

    return source_neighbors_dense(kn, src, m)


def dense_decay_refine(
    scores: torch.Tensor, keys: torch.Tensor, n_src: int, m: int, rounds: int, decay: float
) -> torch.Tensor:
    """The earlier dense `decay_refine` (clamped reading), kept here as the reference."""
    r, n = scores.shape
    s = scores.float()
    if bool((s < 0).any()):
        s = s - s.amin(dim=1, keepdim=True)
    src = s.topk(min(n, n_src), dim=1).indices
    val, nbr = dense_neighbors(torch.nn.functional.normalize(keys.float(), dim=-1), src, min(m, n - 1))
    logf = torch.log1p(-(decay * val.clamp(0.0, 1.0)).clamp(max=1.0 - 1e-6))
    logdecay = torch.zeros_like(s).scatter_add_(1, nbr.flatten(1), logf.flatten(1))
    return s * torch.exp(rounds * logdecay)


@pytest.mark.parametrize(
    "r,n,k,m,max_elems",
    [
        (3, 100, 10, 3, 1 << 20),
        (2, 1000, 300, 8, 5000),
        (1, 70, 69, 69, 100),
        (3, 130, 5, 1, 64),
        (2, 3000, 900, 4, 1 << 14),
    ],
)
def test_graphkv_streamed_neighbours_equal_dense(
    r: int, n: int, k: int, m: int, max_elems: int, monkeypatch
) -> None:
    from sgl_kvevict.policies import graphkv as G

    monkeypatch.setattr(G, "GRAPH_CHUNK", 512)  # several column chunks, several source blocks
    g = torch.Generator().manual_seed(n)
    kn = torch.nn.functional.normalize(torch.randn(r, n, 16, generator=g).bfloat16().float(), dim=-1)
    src = torch.rand(r, n, generator=g).topk(k, dim=1).indices
    shapes: list[int] = []
    bmm = torch.bmm

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = bmm(a, b)
        shapes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "bmm", spy)
    got_v, got_i = G.source_neighbors(kn, src, m, max_elems)
    monkeypatch.setattr(torch, "bmm", bmm)
    want_v, want_i = dense_neighbors(kn, src, m)
    assert torch.allclose(got_v, want_v, atol=1e-6)
    assert torch.equal(got_i.sort(-1).values, want_i.sort(-1).values)
    # bounded: no similarity block beyond max(max_elems, one source row of a chunk per head)
    assert max(shapes) <= max(max_elems, r * 512)
    if max_elems < r * k * n:
        assert max(shapes) < r * k * n, "never the whole [R, k, n] tensor"


@pytest.mark.parametrize("seed", range(3))
def test_graphkv_selection_equals_dense_reference(seed: int) -> None:
    """Same kept set as the earlier dense implementation (clamped, candidate-budget sources)."""
    view = make_view(700, n_recent=8, seed=seed, pool_extra=50)
    cfg = {"recent": 8, "source_of": "candidates", "clamp_similarity": True, "adaptive_neighbors": False}
    pol = P.build("graphkv", cfg)
    budget = 300
    s = P.build("snapkv", {"recent": 8}).score(view)
    cand = view.candidates()
    s[:, cand] = dense_decay_refine(s[:, cand], view.keys()[:, cand], int(0.3 * budget), 8, 1, 1.0)
    assert torch.equal(pol.select(view, budget), P.topk_keep(s, view, budget))


@pytest.mark.parametrize(
    "base,cfg",
    [("snapkv", {}), ("knorm", {}), ("h2o", {}), ("streaming", {}), ("lagkv", {"lag": 8}), ("d2o", {})],
)
@pytest.mark.parametrize("zero", [{"decay": 0.0}, {"rounds": 0}])
def test_graphkv_decay_zero_equals_base(base: str, cfg: dict, zero: dict) -> None:
    view = make_view(120, pool_extra=9, seed=5)
    g = P.build("graphkv", {"base": base, "base_config": cfg, "recent": 8, **zero})
    b = P.build(base, {**cfg, "recent": 8})
    for budget in (3, 17, 50):
        assert torch.equal(
            g.select(view, budget), b.select(view, budget) if base != "d2o" else _plain(b, view, budget)
        )
    assert g.needs == b.needs


def _plain(d2o: P.Policy, view: LayerView, budget: int) -> torch.Tensor:
    """graphkv uses the base's score, not d2o's recency pin."""
    return P.topk_keep(d2o.score(view), view, budget)


def test_graphkv_over_lagkv_decays_inside_partitions() -> None:
    view = make_view(100, n_recent=4, seed=2)
    g = P.build(
        "graphkv",
        {
            "base": "lagkv",
            "base_config": {"lag": 8},
            "recent": 4,
            "adaptive_neighbors": False,
            "neighbors": 2,
        },
    )
    lag = P.build("lagkv", {"lag": 8, "recent": 4})
    keep_g, keep_l = g.select(view, 10**6), lag.select(view, 10**6)
    assert keep_g.shape == keep_l.shape and not torch.equal(keep_g, keep_l)
    check_invariants(keep_g, view, keep_g.shape[1])
    assert g.should_compress(100, 4, 4, 0, 10**6, "decode") == lag.should_compress(
        100, 4, 4, 0, 10**6, "decode"
    )
    # within budget the recursion applies too
    assert g.select(view, 9).shape == lag.select(view, 9).shape


def test_graphkv_negative_scores_are_decayed_down() -> None:
    s = torch.tensor([[-1.0, -2.0, -1.01, -5.0]])
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.01], [0.0, -1.0]]])
    out = P.REGISTRY["graphkv"].refine(
        P.build("graphkv", {"base": "knorm", "neighbors": 1, "adaptive_neighbors": False}), s, keys, 1
    )
    assert int(out.argmax()) == 0 and float(out[0, 2]) < float(
        out[0, 1]
    )  # the near-duplicate of the top token fell


# ---------------------------------------------------------------- CriticalKV


def naive_vo(view: LayerView) -> list[list[float]]:
    g = HQ // H
    out = []
    for h in range(H):
        row = []
        for j in range(view.n):
            v = view.v_buffer[int(view.slots[j]), h].double()
            row.append(
                sum(float((v @ view.o_proj[qh].double()).abs().sum()) for qh in range(h * g, (h + 1) * g)) / g
            )
        out.append(row)
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.25, 1.0])
def test_criticalkv_two_stages(alpha: float) -> None:
    view = make_view(70, n_recent=8, pool_extra=3)
    pol = P.build("criticalkv", {"alpha": alpha, "recent": 8})
    budget = 22
    keep = as_lists(pol.select(view, budget))
    a = P.build("snapkv").score(view).tolist()
    vo = naive_vo(view)
    cand = list(range(4, 70 - 8))
    b1 = math.floor(alpha * budget)
    for h in range(H):
        stage1 = sorted(cand, key=lambda j, h=h: -a[h][j])[:b1]
        assert set(stage1) <= set(keep[h]), "stage 1: top alpha*b by attention"
        rest = [j for j in cand if j not in stage1]
        stage2 = sorted(rest, key=lambda j, h=h: -(a[h][j] + 1e-4) * vo[h][j])[: budget - b1]
        assert set(keep[h]) == set(range(4)) | set(range(62, 70)) | set(stage1) | set(stage2)
    assert pol.needs == frozenset({"attn", "o_proj"})


@pytest.mark.parametrize("base", ["h2o", "d2o"])
@pytest.mark.parametrize("eps_on", ["attention", "score"])
def test_criticalkv_eps_is_relative_to_attention(base: str, eps_on: str) -> None:
    """Alg. 1 / Eq. 8: stage 2 ranks by (A_i + eps) ||v_i W_O||_1 with A the attention probability. h2o/d2o
    score attn * window, so the paper's eps on A is eps * window on their score ('attention')."""
    view = make_view(70, n_recent=8, pool_extra=3, seed=4)
    # attention concentrated on few tokens: eps decides the order of the near-zero rest
    small = torch.rand(H, 70, generator=torch.Generator().manual_seed(7)) * 1e-3
    view.attn = small.index_fill_(1, torch.tensor([5, 9, 30]), 0.3)
    pol = P.build("criticalkv", {"base": base, "recent": 8, "eps": 0.01, "eps_on": eps_on, "window": 16})
    budget = 22
    keep = as_lists(pol.select(view, budget))
    prob = view.attn.tolist()  # A: h2o's score / window (no carried scores on a first compression)
    vo = naive_vo(view)
    cand = list(range(4, 62))
    eps = 0.01 if eps_on == "attention" else 0.01 / 16
    b1 = math.floor(0.5 * budget)
    for h in range(H):
        stage1 = set(sorted(cand, key=lambda j, h=h: -prob[h][j])[:b1])
        rest = [j for j in cand if j not in stage1]
        stage2 = sorted(rest, key=lambda j, h=h: -(prob[h][j] + eps) * vo[h][j])[: budget - b1]
        assert set(keep[h]) - set(range(4)) - set(range(62, 70)) - stage1 == set(stage2)


def _compact(view: LayerView, keep: torch.Tensor, new: int, seed: int) -> LayerView:
    """The region after the runner compacts `keep` into its first slots and `new` tokens arrive."""
    g = torch.Generator().manual_seed(seed)
    h, k = keep.shape
    heads = torch.arange(h).unsqueeze(-1)
    kb = torch.cat(
        [view.k_buffer[view.slots[keep], heads].transpose(0, 1), torch.randn(new, h, D, generator=g)]
    )
    vb = torch.cat(
        [view.v_buffer[view.slots[keep], heads].transpose(0, 1), torch.randn(new, h, D, generator=g)]
    )
    a = torch.rand(h, k + new, generator=g).pow(4).softmax(-1)
    return LayerView(
        0,
        kb,
        vb,
        torch.arange(k + new),
        view.n_sink,
        view.n_recent,
        k,
        attn=a,
        o_proj=view.o_proj,
        state=view.state,
    )


@pytest.mark.parametrize("base", ["snapkv", "d2o"])
def test_criticalkv_cached_norms_select_as_recomputing(base: str, monkeypatch) -> None:
    """Compressions in a row: the norms carried in view.state give the same selection as recomputing
    every norm, and only rows that are new (or whose values changed) are computed again."""
    from sgl_kvevict.policies import criticalkv as C

    computed: list[int] = []
    real = C.cached_vo_norms

    def spy(view: LayerView):
        out = real(view)
        computed.append(out[2])
        return out

    monkeypatch.setattr(C, "cached_vo_norms", spy)
    merge = {"base_config": {"merge": True}} if base == "d2o" else {}
    pol = P.build("criticalkv", {"base": base, "recent": 8, **merge})
    view = make_view(90, n_recent=8, pool_extra=7, seed=1)
    budget = 30
    keep = pol.select(view, budget)
    pol.merge(view, keep)  # d2o rewrites kept rows: their signatures no longer match
    assert computed == [90]
    for step in range(4):
        view = _compact(view, keep, 17, seed=step)
        fresh = LayerView(
            0,
            view.k_buffer,
            view.v_buffer,
            view.slots,
            4,
            8,
            view.n_compacted,
            attn=view.attn,
            o_proj=view.o_proj,
            state={},
        )
        fresh.state = {k: v for k, v in view.state.items() if not k.startswith("vo")}
        want = pol.select(fresh, budget)
        keep = pol.select(view, budget)
        assert torch.equal(keep, want)
        assert torch.allclose(view.state["vo"], fresh.state["vo"], rtol=1e-5)
        if base == "snapkv":
            assert computed[-1] == 17, "only the new tokens"
        else:
            assert 17 <= computed[-1] < view.n, "new tokens and merged rows"
        pol.merge(view, keep)


def test_criticalkv_changed_rows_are_recomputed() -> None:
    pol = P.build("criticalkv", {"recent": 8})
    view = make_view(60, n_recent=8, seed=3)
    keep = pol.select(view, 20)
    nxt = _compact(view, keep, 5, seed=9)
    nxt.v_buffer[3, 1] += 1.0  # one head's row changes in place (as a merge would)
    from sgl_kvevict.kernels import vo_norms
    from sgl_kvevict.policies.criticalkv import cached_vo_norms

    norms, _, computed = cached_vo_norms(nxt)
    assert computed == 6
    assert torch.allclose(norms, vo_norms(nxt.v_buffer, nxt.slots, nxt.o_proj), rtol=1e-5)


# ---------------------------------------------------------------- registry and composition


def test_registry_errors() -> None:
    with pytest.raises(P.PolicyConfigError, match="valid choices: .*criticalkv.*lagkv.*streaming"):
        P.build("nope")
    with pytest.raises(P.PolicyConfigError, match="'lag'"):
        P.build("lagkv", {"lag": "x"})
    with pytest.raises(P.PolicyConfigError, match="'bogus'"):
        P.build("snapkv", {"bogus": 1})
    with pytest.raises(P.PolicyConfigError, match="valid bases: d2o, h2o, snapkv"):
        P.build("criticalkv", {"base": "lagkv"})
    with pytest.raises(P.PolicyConfigError, match="valid bases"):
        P.build("criticalkv", {"base": "graphkv"})
    with pytest.raises(P.PolicyConfigError, match="valid bases"):
        P.build("graphkv", {"base": "none"})
    with pytest.raises(P.PolicyConfigError, match="kernel_size"):
        P.build("graphkv", {"base_config": {"kernel_size": 2}})
    with pytest.raises(P.PolicyConfigError, match="window"):
        P.build("criticalkv", {"base_config": {"window": 8}})
    with pytest.raises(P.PolicyConfigError, match="ratio"):
        P.build("lagkv", {"ratio": 0.001})


def test_composition_needs_and_shared_fields() -> None:
    p = P.build("graphkv", {"base": "lagkv", "window": 16, "sinks": 2})
    assert p.needs == frozenset() and p.base.config.sinks == 2 and p.base.config.window == 16
    c = P.build("criticalkv", {"base": "d2o", "base_config": {"beta": 0.5}})
    assert c.needs == frozenset({"attn", "o_proj"}) and c.base.config.beta == 0.5
    assert P.build("h2o").needs == frozenset({"attn"}) and P.build("lagkv").needs == frozenset()


def test_compacted_len() -> None:
    keep = torch.tensor([[0, 1, 5, 8, 9], [0, 2, 3, 8, 9]])
    assert P.compacted_len(keep, 10) == 3
    assert P.compacted_len(torch.tensor([[0, 1, 2]]), 3) == 0
    assert P.compacted_len(torch.tensor([[0, 1, 2]]), 5) == 3
    assert P.compacted_len(torch.zeros(2, 0, dtype=torch.int64), 5) == 0


# ---------------------------------------------------------------- host-side counts and carried scores

RAW_TAIL_CASES = [
    ("streaming", {}),
    ("knorm", {}),
    ("h2o", {}),
    ("snapkv", {}),
    ("d2o", {}),
    ("lagkv", {"lag": 8}),
    ("lagkv", {"lag": 8, "cap_to_budget": False}),
    ("graphkv", {}),
    ("graphkv", {"base": "lagkv", "base_config": {"lag": 8}}),
    ("criticalkv", {}),
]


@pytest.mark.parametrize("name,cfg", RAW_TAIL_CASES, ids=[f"{n}{c or ''}" for n, c in RAW_TAIL_CASES])
@pytest.mark.parametrize("n_compacted", [0, 20])
def test_raw_tail_is_kept_by_every_head_whatever_the_scores(name: str, cfg: dict, n_compacted: int) -> None:
    """The count the runner uses for the compacted boundary comes from the config, not the scores: it
    must hold for any data (tensor-parallel ranks see different heads)."""
    pol = P.build(name, {"sinks": 4, "recent": 8, **cfg})
    for seed in range(4):
        view = make_view(96, n_compacted=n_compacted, seed=seed)
        keep = pol.select(view, 24)
        tail = pol.raw_tail(view)
        assert 0 <= tail <= keep.shape[1]
        assert torch.equal(keep[:, keep.shape[1] - tail :], torch.arange(96 - tail, 96).expand(H, -1))


def test_refiner_is_a_base_class() -> None:
    for name in ("graphkv", "criticalkv"):
        pol = P.build(name)
        assert isinstance(pol, P.Refiner) and pol.merges == pol.base.merges
    assert not isinstance(P.build("snapkv"), P.Refiner)
    assert P.build("graphkv", {"base": "d2o", "base_config": {"merge": True}}).merges
    assert not P.build("graphkv", {"base": "d2o"}).merges and not P.build("graphkv").merges


@pytest.mark.parametrize("mode", ["none", "max", "decay"])
def test_carried_scores_combine_with_the_window(mode: str) -> None:
    pol = P.build("h2o", {"sinks": 0, "recent": 0, "carry": mode, "carry_decay": 0.5})
    view = make_view(10, n_sink=0, n_recent=0)
    new = view.attn.float() * pol.config.window
    old = torch.full((H, 4), 0.3)
    view.state["carried"] = old
    got = pol.score(view)
    want = new.clone()
    if mode == "max":
        want[:, :4] = torch.maximum(new[:, :4], old)
    elif mode == "decay":
        want[:, :4] = new[:, :4] + 0.5 * old
    assert torch.allclose(got, want)
    assert torch.equal(view.state["scored"], got)


def test_an_early_high_score_survives_under_max() -> None:
    """A token that mattered when it was scored is not evicted because the newest window ignores it."""
    pol = P.build("snapkv", {"sinks": 0, "recent": 0, "kernel_size": 1})
    view = make_view(12, n_sink=0, n_recent=0)
    view.attn = torch.full((H, 12), 0.05)
    view.attn[:, 11] = 0.4
    view.state["carried"] = torch.zeros(H, 6)
    view.state["carried"][:, 2] = 1.0  # token 2 was the fact an earlier window attended to
    keep = pol.select(view, 2)
    assert all(2 in row and 11 in row for row in as_lists(keep))
    none = P.build("snapkv", {"sinks": 0, "recent": 0, "kernel_size": 1, "carry": "none"})
    view.state.pop("scored")
    assert all(2 not in row for row in as_lists(none.select(view, 1)))
