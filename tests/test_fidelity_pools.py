"""D2O's merge on SGLang's real pools, checked against the paper's equations written from its text.

D2O (Wan et al. 2024), token level: each evicted token e finds its nearest kept token by the cosine
similarity of *keys* (Eq. 9: U = K_e K_c^T / (|K_e| |K_c|), c*(e) = argmax_c U[e, c], u_e its value);
it is merged only if u_e reaches the EMA threshold (Eq. 10: tau_0 = mean of u_e at prompt encoding,
tau_t = beta * max(U_t) + (1 - beta) * tau_{t-1} in decoding, compared with the current tau_t); the merge
is a weighted average with Euler's number as the kept token's own weight (Eqs. 11-12:
k_c <- (e * k_c + sum exp(u_e) k_e) / (e + sum exp(u_e)), and *the same weights for the values*). Per
KV head here. The reference below is a plain loop over heads and tokens, independent of the kernels.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from sgl_kvevict.cache import compressor
from sgl_kvevict.cache import state as st
from tests.test_compressor_pools import DECODE, HKV, PROMPT, Rank, _append, _start, _tree_keys

BETA = 0.7
d2o_mod = importlib.import_module("sgl_kvevict.kernels.d2o_merge")  # the package re-exports the function


def _paper_merge(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, tau: list[float] | None, mode: str):
    """Eqs. 9-12 for one layer. k, v: `[N, H, D]` region before the step; keep: `[H, b]`.

    Returns (expected kept K `[b, H, D]`, kept V, new tau per head, merged count)."""
    n, h_n, _ = k.shape
    kept = [[int(x) for x in keep[h]] for h in range(h_n)]
    best: list[list[tuple[float, int]]] = []
    for h in range(h_n):
        ev = [j for j in range(n) if j not in kept[h]]
        row = []
        for e in ev:
            sims = [float(torch.nn.functional.cosine_similarity(k[e, h], k[c, h], dim=0)) for c in kept[h]]
            i = max(range(len(sims)), key=lambda t, s=sims: (s[t], -t))  # first best on ties
            row.append((sims[i], i))
        best.append(row)
    if mode == "mean":  # the released code: one scalar, mean of the per-token best similarities
        allu = [u for row in best for u, _ in row]
        cur = [sum(allu) / len(allu)] * h_n
        taus = cur if tau is None else [BETA * c + (1 - BETA) * t for c, t in zip(cur, tau, strict=True)]
    elif tau is None:  # Eq. 10 at prompt encoding, per head
        taus = [sum(u for u, _ in row) / len(row) for row in best]
    else:
        taus = [BETA * max(u for u, _ in row) + (1 - BETA) * t for row, t in zip(best, tau, strict=True)]
    out_k = torch.stack([k[keep[h], h] for h in range(h_n)], dim=1).double()
    out_v = torch.stack([v[keep[h], h] for h in range(h_n)], dim=1).double()
    merged = 0
    for h in range(h_n):
        ev = [j for j in range(n) if j not in kept[h]]
        z = [math.e] * len(kept[h])
        nk = [math.e * k[c, h].double() for c in kept[h]]
        nv = [math.e * v[c, h].double() for c in kept[h]]
        hit = set()
        for e, (u, i) in zip(ev, best[h], strict=True):
            if u >= taus[h]:
                w = math.exp(u)
                z[i] += w
                nk[i] = nk[i] + w * k[e, h].double()
                nv[i] = nv[i] + w * v[e, h].double()
                hit.add(i)
                merged += 1
        for i in hit:  # a kept token that receives nothing is unchanged
            out_k[i, h] = nk[i] / z[i]
            out_v[i, h] = nv[i] / z[i]
    return out_k.float(), out_v.float(), taus, merged


def _region(rank: Rank, req, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = rank.r2t.req_to_token[0, : req.kv.kv_committed_len].long()
    return slots, rank.kv.get_key_buffer(layer)[slots].clone(), rank.kv.get_value_buffer(layer)[slots].clone()


@pytest.mark.parametrize("mode", ["max", "mean"])
def test_d2o_merge_on_real_pools_follows_the_paper(mode: str) -> None:
    """Prefill (tau_0) and a later decode step (EMA) on MHATokenToKVPool: every kept slot's K and V per
    head, the merged count and tau all match Eqs. 9-12 computed from the pool before the step."""
    rank = Rank(slice(0, HKV))
    req = _start(rank, "d2o", {"threshold": mode, "merge": True}, False)
    s = st.get(req)
    keeps: list[torch.Tensor] = []
    real_select = s.policy.select

    def spy(view, budget):  # the real selection; the test only records what it chose
        out = real_select(view, budget)
        keeps.append(out.clone())
        return out

    s.policy.select = spy
    checked = {"prefill": 0, "decode": 0}
    tau: list[list[float] | None] = [None] * rank.rt.n_layers
    pos = PROMPT
    for phase in ["prefill"] + ["decode"] * (DECODE - 1):
        if phase == "decode":
            _append(rank, req, pos)
            pos += 1
        before = [_region(rank, req, layer) for layer in range(rank.rt.n_layers)]
        merged_before = s.policy_state.merged
        keeps.clear()
        freed = compressor.compress(req, phase)
        if freed == 0:
            continue
        want_merged = 0
        slots_after = rank.r2t.req_to_token[0, : req.kv.kv_committed_len].long()
        for layer, (_, k0, v0) in enumerate(before):
            want_k, want_v, want_tau, m = _paper_merge(k0, v0, keeps[layer], tau[layer], mode)
            want_merged += m
            got_k = rank.kv.get_key_buffer(layer)[slots_after]
            got_v = rank.kv.get_value_buffer(layer)[slots_after]
            torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5)
            got_tau = s.policy_state.layers[layer]["tau"]
            torch.testing.assert_close(got_tau, torch.tensor(want_tau), rtol=1e-5, atol=1e-6)
            if mode == "mean":
                assert bool((got_tau == got_tau[0]).all()), "the released code's threshold is one scalar"
            tau[layer] = want_tau
        assert s.policy_state.merged - merged_before == want_merged
        assert want_merged > 0, "the scenario must merge something"
        checked[phase] += 1
    assert checked["prefill"] == 1 and checked["decode"] >= 1


def _full_run(rank: Rank, config: dict, preset_tau: float | None) -> dict:
    req = _start(rank, "d2o", config, False)
    s = st.get(req)
    if preset_tau is not None:
        s.policy_state.layers = [{"tau": torch.full((HKV,), preset_tau)} for _ in range(rank.rt.n_layers)]
    freed = [compressor.compress(req, "prefill")]
    for pos in range(PROMPT, PROMPT + DECODE - 1):
        rank.activate()
        _append(rank, req, pos)
        freed.append(compressor.compress(req, "decode"))
    slots = rank.r2t.req_to_token[0, : req.kv.kv_committed_len].long()
    return {
        "freed": freed,
        "row": slots.tolist(),
        "k": [rank.kv.get_key_buffer(layer)[slots].clone() for layer in range(rank.rt.n_layers)],
        "v": [rank.kv.get_value_buffer(layer)[slots].clone() for layer in range(rank.rt.n_layers)],
        "tree": _tree_keys(rank.tree),
        "merged": s.policy_state.merged,
    }


def test_d2o_zero_merge_weight_equals_eviction_exactly() -> None:
    """An unreachable threshold gives every evicted token merge weight m_{e,c} = 0 (Eq. 11): the pool,
    the row and the tree must then be bit-for-bit those of `merge: false` (H2O-style eviction)."""
    merged = _full_run(Rank(slice(0, HKV)), {"merge": True}, float("inf"))
    plain = _full_run(Rank(slice(0, HKV)), {"merge": False}, None)
    normal = _full_run(Rank(slice(0, HKV)), {"merge": True}, None)
    assert sum(plain["freed"]) > 0 and merged["merged"] == 0 and normal["merged"] > 0
    assert merged["freed"] == plain["freed"] and merged["row"] == plain["row"]
    assert merged["tree"] == plain["tree"]
    for a, b in zip(merged["k"] + merged["v"], plain["k"] + plain["v"], strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(normal["k"], plain["k"], strict=True))


def test_d2o_match_is_chunked(monkeypatch) -> None:
    """No similarity block larger than `_MAX_SIMS` elements, and the same result as one big block."""
    g = torch.Generator().manual_seed(3)
    n, h, d, b = 300, 3, 8, 120
    kb = torch.randn(n, h, d, generator=g)
    vb = torch.randn(n, h, d, generator=g)
    slots = torch.arange(n)
    keep = torch.stack([torch.randperm(n, generator=g)[:b].sort().values for _ in range(h)])
    want_k, want_v = kb.clone(), vb.clone()
    want_tau = d2o_mod.d2o_merge_ref(want_k, want_v, slots, keep, None, BETA, True)
    sizes: list[int] = []
    real = torch.bmm  # the match is one batched matmul over the heads per block

    def counting(a, b_, **kw):
        out = real(a, b_, **kw)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(d2o_mod, "_MAX_SIMS", 3 * 40 * 40)
    monkeypatch.setattr(torch, "bmm", counting)
    got_tau = d2o_mod.d2o_merge_ref(kb, vb, slots, keep, None, BETA, True)
    monkeypatch.setattr(torch, "bmm", real)
    assert len(sizes) > 4 and max(sizes) <= 3 * 40 * 40
    assert sum(sizes) == h * (n - b) * b  # every (evicted, kept) pair once
    torch.testing.assert_close(got_tau, want_tau)
    torch.testing.assert_close(kb, want_k)
    torch.testing.assert_close(vb, want_v)


@pytest.mark.parametrize("budget", [1.0, 10**6, 0.5])
def test_lagkv_budget_covering_the_request_frees_nothing(monkeypatch, budget) -> None:
    """On the real pools, LagKV at a budget of 100% or above the request's length keeps every slot (as
    every other policy does); at 50% it compresses."""
    import tests.test_compressor_pools as tcp

    real_req = tcp._req

    def req_with_budget(policy, config, n_tokens):
        req = real_req(policy, config, n_tokens)
        req.sampling_params.custom_params["kvevict"]["budget"] = budget
        return req

    monkeypatch.setattr(tcp, "_req", req_with_budget)
    rank = Rank(slice(0, HKV))
    out = tcp._run(rank, "lagkv", {"lag": 16}, False)
    if budget == 0.5:
        assert sum(out["freed"]) > 0
    else:
        assert sum(out["freed"]) == 0 and out["counts"][2] == 0  # nothing evicted
