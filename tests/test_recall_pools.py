"""The host tier on SGLang's real pools: a compression demotes exactly what it evicts, and a recall swaps
the entries a torch reference picks, keeping device + host = the region's original entries per head."""

from __future__ import annotations

import os
from array import array
from math import inf

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_kvevict import kernels as K
from sgl_kvevict.cache import capture, compressor, engine, nodes, trigger
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import demote, host, recall, recall_core
from sgl_kvevict.config import RecallTuning, ServerSettings
from sgl_kvevict.tools.pools import Pools

L, H, G, D, N, W, R = 3, 2, 2, 16, 160, 16, 6


def _tags(buf_k: list[torch.Tensor], buf_v: list[torch.Tensor], probe: torch.Tensor) -> torch.Tensor:
    """`[L, H, m]` sorted fingerprints (K.probe + 3 V.probe) of entries: a multiset per (layer, head)."""
    return (
        torch.stack(
            [(k.float() @ probe + 3 * (v.float() @ probe)) for k, v in zip(buf_k, buf_v, strict=True)]
        )
        .sort(-1)
        .values
    )


@pytest.fixture
def pools():
    p = Pools(layers=L, kv_heads=H, group=G, head_dim=D, max_reqs=4, max_len=256, dtype=torch.float32)
    yield p


def _setup(p: Pools, policy: str):
    batch = p.batch(1, N, policy, 48, {"window": W} if policy != "lagkv" else {"lag": 16, "window": W})
    req = batch.reqs[0]
    s = st.get(req)
    s.recall.tokens = R
    demote.attach(p.ctx, host.HostPool(L, H, D, 512, torch.float32))
    if "attn" not in s.policy.needs:  # recall scores with the window even for attention-free policies
        assert capture.ensure(p.ctx, 0, W, 0)
    q = torch.randn(L, W, H * G, D, generator=p.gen)
    for layer in range(L):
        p.store.put(0, layer, q[layer], torch.arange(N - W, N))
    slots = p.r2t.req_to_token[0, :N].long()
    heads = torch.arange(H).unsqueeze(-1)
    orig_k = [p.kv.get_key_buffer(layer)[slots].transpose(0, 1).clone() for layer in range(L)]
    orig_v = [p.kv.get_value_buffer(layer)[slots].transpose(0, 1).clone() for layer in range(L)]
    return batch, req, s, heads, orig_k, orig_v


def _compressed(p: Pools, monkeypatch, cfg: ServerSettings, policy: str = "snapkv"):
    """`_setup` under the server settings `cfg`, then the prefill compression (which demotes): the request,
    its state, and the fingerprints of the region's entries (`_tags`) with the probe that makes them."""
    p.ctx.settings = cfg
    batch, req, s, heads, orig_k, orig_v = _setup(p, policy)
    probe = torch.randn(D, generator=p.gen)
    want = _tags(orig_k, orig_v, probe)
    with compressor.one_thread():
        assert compressor.compress(req, "prefill") > 0
    return req, s, probe, want


def _held(p: Pools, req, s) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer `[H, m]` entries: the row's region on the device, then the host columns."""
    kv_len = req.kv.kv_committed_len
    slots = p.r2t.req_to_token[0, :kv_len].long()
    cols = s.recall.host.cols
    ks = [
        torch.cat([p.kv.get_key_buffer(ly)[slots].transpose(0, 1), p.ctx.host.k[ly][cols].transpose(0, 1)], 1)
        for ly in range(L)
    ]
    vs = [
        torch.cat(
            [p.kv.get_value_buffer(ly)[slots].transpose(0, 1), p.ctx.host.v[ly][cols].transpose(0, 1)], 1
        )
        for ly in range(L)
    ]
    return ks, vs


def _tuning(
    monkeypatch,
    page: int = 8,
    summary: str = "minmax",
    fetch_pages: int = recall.FETCH_PAGES,
    min_score: float = 0.0,
) -> ServerSettings:
    """Settings with recall page `page`, and recall's fixed constants set for the test: `summary` "off"
    scores every host key (a recall then never has more pages than it fetches), `fetch_pages` pages at
    least are fetched, `min_score` is the floor."""
    monkeypatch.setattr(recall, "FETCH_PAGES", 1 << 30 if summary == "off" else fetch_pages)
    monkeypatch.setattr(recall_core, "MIN_SCORE", min_score)
    return ServerSettings(recall_tokens=R, recall=RecallTuning(page=page))


def _page_bound(q: torch.Tensor, keys: torch.Tensor, summary: str) -> float:
    """Score of one page of `keys` `[n, D]` for queries `q` `[m, D]`, summed over the queries, by loops:
    minmax: sum_d max(q_d min_d, q_d max_d) (Quest's bound); mean: q . mean key."""
    kmin, kmax, kmean = keys.amin(0), keys.amax(0), keys.mean(0)
    tot = 0.0
    for qi in q:
        if summary == "minmax":
            tot += sum(max(float(qi[d] * kmin[d]), float(qi[d] * kmax[d])) for d in range(D))
        else:
            tot += float(qi @ kmean)
    return tot / D**0.5


def _room(s: st.ReqState) -> int:
    """The displaceable row a decode-time recall's step cap follows."""
    lo, hi = recall._displaceable(s)
    return hi - lo


def _reference_swaps(
    p: Pools,
    req,
    s,
    page: int = 1,
    w: int = W,
    summary: str = "off",
    cap: int = R,
    floor: float = 0.0,
    fetch: int = recall.FETCH_PAGES,
    append: int = 0,
) -> list[list[set]]:
    """Which host columns each (layer, head) should hold on the device after recall, by plain loops:
    the last `w` window queries score (the largest probability any of them gives), and a host entry ranks
    by the best score of its page. Paged (`summary` "minmax" and more pages than a recall fetches): only the
    columns of the best pages by their summary's score are candidates (a partial last page is padded
    with its last column, which takes part in the softmax but is never chosen). A chosen entry's page
    scores at least `floor` (`recall_core.MIN_SCORE`). `append` > 0: the turn's append, `append` entries
    whatever they beat, the positions ranked over every pair first (`_shared_first`)."""
    kv_len = req.kv.kv_committed_len
    slots = p.r2t.req_to_token[0, :kv_len].long()
    n_sink = min(s.policy.config.sinks, s.slot_map.comp_slots)
    lo, hi = n_sink, s.slot_map.comp_slots
    length = s.slot_map.tokens_for(kv_len)
    e = s.recall.host.count
    r = append or min(R, hi - lo, e, cap)
    n_sel = max(-(-recall.FETCH * r // page), fetch)
    n_pg = -(-e // page)
    out = []
    for ly in range(L):
        q = p.store.get(0, ly, length)  # [Hq, W, D]
        per = []
        for h in range(H):
            hk_all = p.ctx.host.k[ly][s.recall.host.cols, h].float()
            if summary != "off" and n_pg > n_sel:
                qs = torch.cat([q[h * G + g, W - w :].float() for g in range(G)])
                sc = [_page_bound(qs, hk_all[pg * page : (pg + 1) * page], summary) for pg in range(n_pg)]
                chosen = sorted(sorted(range(n_pg), key=lambda pg: -sc[pg])[:n_sel])
                cand = [pg * page + j for pg in chosen for j in range(page)]
            else:
                cand = list(range(e))
            valid = [c < e for c in cand]
            cand = [min(c, e - 1) for c in cand]
            hk = hk_all[cand]
            rk = p.kv.get_key_buffer(ly)[slots, h].float()
            tot = torch.zeros(hk.shape[0] + kv_len)
            for g in range(G):
                for i in range(W - w, W):
                    logits = torch.cat([hk, rk]) @ q[h * G + g, i].float() / D**0.5
                    logits[hk.shape[0] + kv_len - W + i + 1 :] = float("-inf")
                    tot = torch.maximum(tot, torch.softmax(logits, 0))  # the most any query leans on it
            hs, ds = tot[: hk.shape[0]].clone(), tot[hk.shape[0] + lo : hk.shape[0] + hi]
            hs[~torch.tensor(valid)] = float("-inf")
            pm = [
                float(hs[c - c % page : c - c % page + page].max()) if valid[c] else -inf
                for c in range(hs.numel())
            ]
            hbest = sorted(range(hs.numel()), key=lambda c: (-pm[c], -float(hs[c])))[:r]
            if append:
                per.append((hs, cand, valid, hbest))
                continue
            hs = torch.tensor(pm)
            dworst = ds.argsort()[:r].tolist()
            per.append(
                {
                    int(s.recall.host.cols[cand[c]])
                    for c, d in zip(hbest, dworst, strict=True)
                    if hs[c] > ds[d] and hs[c] >= floor
                }
            )
        out.append(per)
    return _shared_first(s, out, length, append) if append else out


def _shared_first(s, scored: list[list[tuple]], tokens: int, a: int) -> list[list[set]]:
    """The append's choice from each pair's scores (`_reference_swaps`): a logical position scores the sum
    of its entries' scores over every (layer, head) pair holding it on the host (ties: the first position);
    the `a` best positions come back first, in every pair that holds them, then the pair's own best
    (`hbest`), `a` in all."""
    hpos = s.recall.host.positions
    total = [0.0] * tokens
    for ly, per in enumerate(scored):
        for h, (hs, cand, valid, _) in enumerate(per):
            for c in range(len(cand)):
                if valid[c] and hpos is not None:
                    total[int(hpos[ly, h, cand[c]])] += max(float(hs[c]), 0.0)
    best = sorted((t for t in range(tokens) if total[t] > 0), key=lambda t: (-total[t], t))[:a]
    rank = {t: a - i for i, t in enumerate(best)}
    out = []
    for ly, per in enumerate(scored):
        chosen = []
        for h, (_, cand, valid, hbest) in enumerate(per):
            shared = [
                c
                for c in range(len(cand))
                if valid[c] and hpos is not None and int(hpos[ly, h, cand[c]]) in rank
            ]
            shared.sort(key=lambda c: -rank[int(hpos[ly, h, cand[c]])])
            order = shared + [c for c in hbest if c not in shared]
            chosen.append({int(s.recall.host.cols[cand[c]]) for c in order[:a]})
        out.append(chosen)
    return out


def _assert_appended(p: Pools, comp: int, expect, host_k: list[torch.Tensor], cols_before) -> None:
    """Each head's R slots appended after the compacted history (`comp` slots) hold exactly the host
    entries `expect` names (branch columns, as they were before the append)."""
    new = p.r2t.req_to_token[0, comp : comp + R].long()
    for ly in range(L):
        for h in range(H):
            got = p.kv.get_key_buffer(ly)[new, h]
            picked = [int((cols_before == c).nonzero()) for c in expect[ly][h]]
            assert len(picked) == R
            assert torch.equal(got.sort(0).values, host_k[ly][picked, h].sort(0).values), (ly, h)


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "lagkv"])
@pytest.mark.parametrize("path", ["batched", "single"])
@pytest.mark.parametrize(("page", "fresh", "floor"), [(1, 0, 0.0), (4, 0, 0.0), (4, 3, 0.0), (1, 0, 0.1)])
def test_demote_then_recall_keeps_every_entry(
    pools: Pools, policy: str, path: str, page: int, fresh: int, floor: float, monkeypatch
):
    """`fresh` > 0: a decode-time recall, which scores with the queries of the last `fresh` steps only.
    `floor`: `recall_core.MIN_SCORE` (0: beating the displaced entry is enough). Every host key is scored;
    `test_paged_recall_*` covers the page summaries."""
    cfg = _tuning(monkeypatch, page=page, summary="off", min_score=floor)
    pools.ctx.settings = cfg
    p = pools
    batch, req, s, heads, orig_k, orig_v = _setup(p, policy)
    probe = torch.randn(D, generator=p.gen)
    want = _tags(orig_k, orig_v, probe)
    before_free = p.ctx.host.n_free
    with compressor.one_thread():
        if path == "batched":
            freed = engine.compress_batch([(req, "prefill")])[0]
        else:
            freed = compressor.compress(req, "prefill")
    assert freed > 0
    assert s.recall.host.count == freed and p.ctx.host.n_free == before_free - freed
    ks, vs = _held(p, req, s)
    assert torch.allclose(_tags(ks, vs, probe), want, atol=1e-4)  # nothing lost: device + host = the region
    cap = recall_core.step_swaps(fresh, page, _room(s)) if fresh else R
    expect = _reference_swaps(p, req, s, page, fresh or W, cap=cap, floor=floor)
    if floor:  # the floor is what holds some back: without it, more would come
        unfloored = _reference_swaps(p, req, s, page, fresh or W, cap=R)
        assert sum(len(x) for per in expect for x in per) < sum(len(x) for per in unfloored for x in per)
    host_k = [p.ctx.host.k[ly][s.recall.host.cols].clone() for ly in range(L)]
    s.recall.steps = fresh
    swapped = recall.recall(req, s)
    assert swapped == sum(len(x) for per in expect for x in per)
    assert swapped > 0
    kv_len = req.kv.kv_committed_len
    slots = p.r2t.req_to_token[0, :kv_len].long()
    for ly in range(L):  # the chosen host entries are on the device now
        dev = p.kv.get_key_buffer(ly)[slots]
        for h in range(H):
            for c in expect[ly][h]:
                j = int((s.recall.host.cols == c).nonzero())
                assert (dev[:, h] == host_k[ly][j, h]).all(-1).any()
    ks, vs = _held(p, req, s)
    assert torch.allclose(_tags(ks, vs, probe), want, atol=1e-4)  # still nothing lost, nothing duplicated
    assert s.recall.recalled == swapped and s.recall.bytes_moved == swapped * 2 * D * 4 * 2
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_the_host_pool_is_resident_once_built():
    """The tier's memory is committed when the pool is built (as SGLang's own KV pool is), not as columns
    are first written: an operator watching RSS sees its size at start, not a slow climb that looks like a
    leak. With `torch.empty` the pages would stay uncommitted and RSS would barely move here."""
    before = _rss_bytes()
    pool = host.HostPool(4, 2, 64, 64_000, torch.bfloat16)  # 2 x 4 x 64,001 x 2 x 64 x 2 bytes: 125 MiB
    grown = _rss_bytes() - before
    want = pool.k.nbytes + pool.v.nbytes
    assert grown >= 0.9 * want, (grown, want)


def test_host_pool_lru_takes_what_it_needs_from_the_least_recently_used():
    """The LRU takes whole branches, least recently used first, and from the last one only the newest
    columns still needed: it keeps the page summaries of the whole pages that remain and the positions
    of the entries that remain. It never takes the requester's, and drops nothing when it cannot fit."""
    pool = host.HostPool(1, 1, 4, 10, torch.float32)
    a, b, c = host.HostEntries(), host.HostEntries(), host.HostEntries()
    pool.append(a, pool.alloc(4), None)
    pool.append(b, pool.alloc(4), torch.arange(4).view(1, 1, 4))
    b.summaries = host.PageSummaries(None, None, torch.arange(2.0).view(2, 1, 1, 1), n=4, page=2)
    kept = b.cols[:1].clone()
    pool.touch(a)  # b is now the least recently used
    got = pool.alloc(5, keep=(c,))  # 2 free, 3 of b's
    assert got is not None and a.count == 4 and b.dropped == 3 and torch.equal(b.cols, kept)
    assert b.positions.tolist() == [[[0]]] and b.summaries.n == 0 and b.summaries.kmean.shape[0] == 0
    pool.append(c, got, None)
    assert pool.alloc(6, keep=(c,)) is None and a.count == 4 and b.count == 1  # cannot fit: nothing dropped
    got = pool.alloc(5, keep=(c,))
    assert got is not None and a.count == 0 and b.count == 0 and pool.totals.branches_dropped == 3
    pool.give_back(got)
    pool.release(c)
    assert pool.n_free == pool.size and sorted(pool.free_cols.tolist()) == list(range(10))


def test_a_copy_holds_the_same_entries_and_an_armed_recalls_entries_are_never_dropped():
    pool = host.HostPool(2, 3, 4, 12, torch.float32)
    a, b = host.HostEntries(), host.HostEntries()
    pool.append(a, pool.alloc(4), None)
    pool.k.normal_()
    pool.v.normal_()
    a.summaries = host.PageSummaries(None, None, torch.zeros(1), n=4, page=4)
    c = pool.copy(a)  # a stored history's entries, for the request continuing it
    assert c is not None and c.count == a.count and set(c.cols.tolist()).isdisjoint(a.cols.tolist())
    assert torch.equal(pool.k[:, c.cols], pool.k[:, a.cols]) and torch.equal(
        pool.v[:, c.cols], pool.v[:, a.cols]
    )
    assert c.summaries is not None and a.summaries is None and pool.totals.copied == 4
    pool.append(b, pool.alloc(4), None)  # the pool is full now; a is the least recently used
    pool.in_use[7] = a  # a recall armed for the next forward reads and writes a
    got = pool.alloc(4)
    assert got is not None and a.count == 4 and c.count == 0  # the LRU skipped a, took c
    assert pool.alloc(8) is None and pool.totals.demote_refused == 8 and a.count == 4 and b.count == 4
    pool.in_use[8] = b
    assert pool.copy(a) is None and pool.totals.demote_refused == 8  # a refused copy is no refused demotion
    pool.in_use.clear()
    pool.give_back(got)
    for e in (a, b):
        pool.release(e)
    assert pool.n_free == pool.size


def test_a_copy_takes_room_from_stored_histories_never_from_running_branches():
    """Copying a stored history (a request continuing it) takes room from the branches less recently
    used than it, least recently used first, but never from the entries running requests own (`busy`),
    the history it copies, a fork's history while one of its branches runs, or a session's latest
    history that nobody has continued yet (`awaits_next_turn`: its next turn is likely on its way); a
    fork branch's stored history is fair game. When that is not enough the copy is refused and nothing
    is dropped. A demotion still takes the least recently used branch, fork branches' first."""
    pool = host.HostPool(2, 3, 4, 12, torch.float32)
    a, b, old = host.HostEntries(), host.HostEntries(), host.HostEntries()
    for e in (old, b, a):
        pool.append(e, pool.alloc(4), None)  # full: old is the least recently used
    assert old.awaits_next_turn
    assert pool.copy(old) is None and a.count == b.count == 4  # both more recently used than old
    assert pool.copy(a) is None and old.count == b.count == 4  # sessions' latest: refused
    old.fork_branch = True  # stored by a branch of a fork: rarely continued
    assert pool.copy(a, busy=[old, b]) is None and old.count == b.count == 4  # running: refused
    c = pool.copy(a, busy=[b])  # old is a stored fork branch now (its request finished)
    assert c is not None and c.count == 4 and old.count == 0 and b.count == 4 and a.count == 4
    b.takers, b.running = 2, 1  # a fork's history, one of its branches running
    assert pool.copy(a, busy=[c]) is None and b.count == 4
    got = pool.alloc(4)  # a demotion still takes the least recently used branch, live or not
    assert got is not None and a.count == 0 and b.count == 4  # the fork's history goes last
    pool.give_back(got)
    for e in (b, c):
        pool.release(e)
    assert pool.n_free == pool.size
    late, early = host.HostEntries(), host.HostEntries(fork_branch=True)
    for e in (late, early):  # a session's latest is the least recently used
        pool.append(e, pool.alloc(6), None)
    got = pool.alloc(4)
    assert got is not None and early.count == 2 and late.count == 6  # a fork branch's goes first
    pool.give_back(got)
    pool.release(late)
    pool.release(early)
    assert pool.n_free == pool.size


def test_evicted_indices_are_the_complement():
    keep = torch.tensor([[[0, 2, 5]], [[1, 3, 4]]])
    assert demote.evicted_indices(keep, 6).tolist() == [[[1, 3, 4]], [[0, 2, 5]]]


def test_page_max_ranks_an_entry_by_its_pages_best():
    sc = torch.tensor([[[0.1, 0.9, 0.2, 0.3, 0.05, 0.0, 0.4]]])  # one layer, one head, 7 host entries
    vals, idx = recall_core.best_entries(sc, 1, 7)
    assert torch.equal(vals, sc.gather(-1, idx))  # pages of 1: an entry ranks by its own score
    want = torch.tensor([[[0.9, 0.9, 0.9, 0.3, 0.3, 0.3, 0.4]]])  # pages of 3, the last one partial
    vals, idx = recall_core.best_entries(sc, 3, 7)
    assert torch.equal(vals, want.gather(-1, idx))  # every entry ranks by its page's best
    vals, idx = recall_core.best_entries(sc, 3, 4)
    assert idx.tolist() == [[[1, 2, 0, 6]]]  # the attended entry brings its page, best first; then the next
    assert torch.allclose(vals, torch.tensor([[[0.9, 0.9, 0.9, 0.4]]]))
    padded = torch.tensor([[[0.1, 0.9, float("-inf")]]])  # a paged recall's padding of a partial page
    vals, idx = recall_core.best_entries(padded, 3, 3)
    assert idx.tolist() == [[[1, 0, 2]]] and vals[0, 0, 2] == float("-inf")  # ranked last, never swapped


def test_a_steps_pages_follow_the_displaceable_row():
    """A decode step moves at most a `ROW_SHARE`-th of the row it displaces from, in whole pages: one page
    at least (a small row still recalls), `MAX_PAGES_PER_STEP` at most (a step's bytes stay bounded),
    and as many times that as steps since the last recall."""
    page, share, most = 8, recall_core.ROW_SHARE, recall_core.MAX_PAGES_PER_STEP
    assert recall_core.step_swaps(1, page, 10) == page  # a row smaller than a share's page
    assert recall_core.step_swaps(1, page, 2 * share * page + page) == 2 * page
    assert recall_core.step_swaps(1, page, 1000 * page) == most * page
    assert recall_core.step_swaps(3, page, 2 * share * page) == 3 * 2 * page
    sizes = [recall_core.step_swaps(1, page, room) for room in range(0, 60 * page)]
    assert sizes == sorted(sizes) and all(x % page == 0 for x in sizes)  # never fewer for a larger row


@pytest.mark.parametrize(("e", "page", "r"), [(7, 3, 4), (64, 8, 8), (61, 8, 20), (200, 5, 64), (9, 1, 9)])
def test_best_entries_equal_a_sort_by_page_then_entry(e: int, page: int, r: int):
    """`best_entries` sorts only the `r` best pages; a naive sort of every entry by (its page's best, its
    own score) picks the same entries in the same order, with padding (-inf) last and never in range
    trouble. Distinct scores, so no tie decides."""
    g = torch.Generator().manual_seed(e * 31 + page)
    sc = torch.randperm(2 * 3 * e, generator=g).float().view(2, 3, e) / (6 * e)  # distinct
    sc[torch.rand(2, 3, e, generator=g) < 0.25] = float("-inf")  # padding anywhere
    vals, idx = recall_core.best_entries(sc, page, r)
    for lh in range(6):
        row = sc.view(6, e)[lh].tolist()
        page_of = [max(row[i // page * page : i // page * page + page]) for i in range(e)]
        key = [(page_of[i] if row[i] > float("-inf") else float("-inf"), row[i]) for i in range(e)]
        want = sorted(range(e), key=lambda i: key[i], reverse=True)[:r]
        got = idx.view(6, r)[lh].tolist()
        real = [i for i in want if row[i] > float("-inf")]
        assert got[: len(real)] == real
        assert all(0 <= i < e for i in got)
        assert vals.view(6, r)[lh].tolist() == [key[i][0] for i in real] + [float("-inf")] * (r - len(real))


@pytest.mark.parametrize(
    ("where", "calls_before"), [("host_swap", 0), ("host_swap", 2), ("refresh_pages", 1)]
)
def test_a_failure_inside_recall_changes_nothing(pools: Pools, monkeypatch, where: str, calls_before: int):
    """Recall is plan/commit: an exception at any point (here inside `kernels.host_swap` of the first or
    the last layer, before it writes, or inside a page-summary refresh after layer 1's swap) leaves the
    device row and the host columns as they were (the layers already swapped are swapped back), turns
    recall off for that request only, and is counted; the request keeps its compression."""
    pools.ctx.settings = _tuning(monkeypatch, page=4, fetch_pages=8)
    p = pools
    batch, req, s, heads, orig_k, orig_v = _setup(p, "snapkv")
    with compressor.one_thread():
        assert compressor.compress(req, "prefill") > 0
    # the paged path, summaries built before the failure
    assert recall._paged(s.ctx, s.recall.host, R)[0] is not None
    kv_len = req.kv.kv_committed_len
    slots = p.r2t.req_to_token[0, :kv_len].long()
    dev_before = [p.kv.get_key_buffer(ly)[slots].clone() for ly in range(L)]
    dev_v_before = [p.kv.get_value_buffer(ly)[slots].clone() for ly in range(L)]
    cols = s.recall.host.cols.clone()
    host_before = p.ctx.host.k[:, cols].clone()  # (unused columns hold uninitialised memory)
    host_v_before = p.ctx.host.v[:, cols].clone()
    real_swap, real_refresh = recall.K.host_swap, recall.K.refresh_pages
    swapped: list[int] = []  # entries each host_swap call moved (the rollback's calls included)
    refreshes: list[int] = []

    def swap(*args):
        if where == "host_swap" and len(swapped) == calls_before:
            swapped.append(-1)
            raise RuntimeError("injected")
        real_swap(*args)
        swapped.append(int(args[-1].sum()))

    def refresh(*args):
        refreshes.append(1)
        if where == "refresh_pages" and len(refreshes) == calls_before + 1:
            raise RuntimeError("injected")
        return real_refresh(*args)

    monkeypatch.setattr(recall.K, "host_swap", swap)
    monkeypatch.setattr(recall.K, "refresh_pages", refresh)
    s.recall.due = True
    assert recall.safe_recall(req) == 0
    before = swapped[: calls_before + (where == "refresh_pages")]  # the layers swapped before the failure
    assert (sum(before) > 0) == bool(before), swapped  # (then swapped back)
    assert s.recall.tokens == 0 and not demote.enabled(s) and p.ctx.host.totals.recall_failures == 1
    for ly in range(L):
        assert torch.equal(p.kv.get_key_buffer(ly)[slots], dev_before[ly]), ly
        assert torch.equal(p.kv.get_value_buffer(ly)[slots], dev_v_before[ly]), ly
    assert torch.equal(s.recall.host.cols, cols) and torch.equal(p.ctx.host.k[:, cols], host_before)
    assert torch.equal(p.ctx.host.v[:, cols], host_v_before)
    assert s.recall.host.summaries is None  # rebuilt from the columns by the next recall
    assert s.recall.recalled == 0 and s.recall.bytes_moved == 0 and not s.failed
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


@pytest.mark.parametrize(("page", "fresh", "fetch"), [(4, 0, 8), (2, 1, 8), (3, 0, 8), (2, 1, 3)])
def test_paged_recall_swaps_what_the_reference_picks(
    pools: Pools, page: int, fresh: int, fetch: int, monkeypatch
):
    """A recall over a host history of more pages than it fetches scores the pages' summaries, fetches
    the best pages' columns only, and swaps exactly what the loop reference picks among them; nothing is
    lost, and the summaries still describe the columns after the swap wrote into them (page 3: the last
    page is partial). `fetch`: the least pages fetched (`recall.FETCH_PAGES`)."""
    p = pools
    req, s, probe, want = _compressed(p, monkeypatch, _tuning(monkeypatch, page=page, fetch_pages=fetch))
    cap = recall_core.step_swaps(fresh, page, _room(s)) if fresh else R
    sums, n_sel = recall._paged(s.ctx, s.recall.host, min(R, cap))
    assert sums is not None and n_sel < -(-s.recall.host.count // page)  # fewer pages fetched than held
    assert n_sel == max(-(-recall.FETCH * min(R, cap) // page), fetch)
    expect = _reference_swaps(p, req, s, page, fresh or W, "minmax", cap, fetch=fetch)
    host_k = [p.ctx.host.k[ly][s.recall.host.cols].clone() for ly in range(L)]
    s.recall.steps = fresh
    swapped = recall.recall(req, s)
    assert swapped == sum(len(x) for per in expect for x in per) > 0
    kv_len = req.kv.kv_committed_len
    slots = p.r2t.req_to_token[0, :kv_len].long()
    ks, vs = _held(p, req, s)
    assert torch.allclose(_tags(ks, vs, probe), want, atol=1e-4)  # nothing lost, nothing duplicated
    sm = s.recall.host.summaries
    assert sm is not None and sm.n == s.recall.host.count
    assert sm.kmean is None  # bounds only
    for ly in range(L):
        fresh_min, fresh_max, _ = K.page_summaries_ref(p.ctx.host.k[ly][s.recall.host.cols], page)
        assert torch.equal(sm.kmin[:, ly], fresh_min) and torch.equal(sm.kmax[:, ly], fresh_max)
        dev = p.kv.get_key_buffer(ly)[slots]
        for h in range(H):
            for c in expect[ly][h]:  # the chosen host entries' keys are on the device now
                j = int((s.recall.host.cols == c).nonzero())
                assert (dev[:, h] == host_k[ly][j, h]).all(-1).any()
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


def test_paged_recall_equals_flat_when_it_would_fetch_every_page(pools: Pools, monkeypatch):
    """With no more pages than a paged recall fetches, recall scores every key exactly (no summaries)."""
    pools.ctx.settings = _tuning(monkeypatch, page=128)
    p = pools
    batch, req, s, heads, orig_k, orig_v = _setup(p, "snapkv")
    with compressor.one_thread():
        assert compressor.compress(req, "prefill") > 0
    assert recall._paged(s.ctx, s.recall.host, R) == (None, 0)
    expect = _reference_swaps(p, req, s, 128, W, "minmax")
    assert recall.recall(req, s) == sum(len(x) for per in expect for x in per) > 0
    assert s.recall.host.summaries is None
    s.recall.drop_host(s.ctx.host)


@pytest.mark.parametrize("policy", ["snapkv", "lagkv"])
@pytest.mark.parametrize(("summary", "page"), [("off", 1), ("off", 4), ("minmax", 4), ("minmax", 3)])
def test_append_brings_the_best_entries_into_fresh_slots(
    pools: Pools, policy: str, summary: str, page: int, monkeypatch
):
    """After the prefill compression, each (layer, head)'s best host entries go
    to fresh slots appended after the compacted history (the tail moves right), nothing is displaced,
    the row and the host still hold every entry of the region exactly once, the host gives back as many
    columns as were appended, and the counts say the row holds that many more slots for the same tokens.
    Paged: the summaries still describe the columns (the holes were refilled from the branch's end)."""
    cfg = _tuning(monkeypatch, page=page, summary=summary, fetch_pages=2)
    p = pools
    req, s, probe, want = _compressed(p, monkeypatch, cfg, policy)
    kv_len, comp, offset = req.kv.kv_committed_len, s.slot_map.comp_slots, s.slot_map.offset
    length, count, free = s.slot_map.tokens_for(kv_len), s.recall.host.count, p.ctx.host.n_free
    tail = p.r2t.req_to_token[0, comp:kv_len].clone()
    sums, _ = recall._paged(s.ctx, s.recall.host, R)
    assert (sums is None) == (summary == "off")
    assert s.recall.host.positions is not None  # tracked wherever the host tier is on: the append ranks them
    expect = _reference_swaps(p, req, s, page, W, summary if sums is not None else "off", fetch=2, append=R)
    host_k = [p.ctx.host.k[ly][s.recall.host.cols].clone() for ly in range(L)]
    cols_before = s.recall.host.cols.clone()
    s.recall.append_due = True
    assert recall.safe_append(req) == R
    assert (
        req.kv.kv_committed_len == kv_len + R
        and s.slot_map.comp_slots == comp + R
        and s.slot_map.offset == offset - R
    )
    assert s.slot_map.tokens_for(req.kv.kv_committed_len) == length and s.slot_map.appended == R
    assert torch.equal(p.r2t.req_to_token[0, comp + R : kv_len + R], tail)  # the tail moved right, whole
    assert s.recall.host.count == count - R and p.ctx.host.n_free == free + R
    _assert_appended(p, comp, expect, host_k, cols_before)
    ks, vs = _held(p, req, s)
    assert torch.allclose(_tags(ks, vs, probe), want, atol=1e-4)  # nothing lost, nothing duplicated
    assert s.recall.recalled == R * L * H and s.recall.bytes_moved == R * L * H * 2 * D * 4
    for d in s.policy_state.layers:
        if d.get("carried") is not None:
            assert d["carried"].shape[-1] == s.slot_map.comp_slots + (kv_len - comp)
            assert (d["carried"][..., comp : comp + R] == 0).all()
    sm = s.recall.host.summaries
    if sums is not None:
        assert sm is not None and sm.n <= s.recall.host.count
        for ly in range(L):
            ref = K.page_summaries_ref(p.ctx.host.k[ly][s.recall.host.cols[: sm.n]], page)
            mine, theirs = sm.kmin, ref[0]
            assert torch.allclose(mine[:, ly].float(), theirs, atol=1e-5)
        sm = recall.summaries(s.ctx, s.recall.host, page)  # brought up to the columns again
        assert sm.n == s.recall.host.count
    # the turn's decode budget holds the appended columns: no compression fires for them
    assert trigger.fires(req, s, "decode") is None
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


def test_a_turns_recall_scores_with_its_own_queries_only(pools: Pools, monkeypatch):
    """A turn whose own tokens are fewer than the window (a short question after a long answer): the
    append scores with the queries of the turn's tokens only, not the previous turn's tail the window
    also holds (those would bring back what that turn's answer read)."""
    cfg = _tuning(monkeypatch, page=1, summary="off")
    p = pools
    req, s, _, _ = _compressed(p, monkeypatch, cfg)
    kv_len, comp = req.kv.kv_committed_len, s.slot_map.comp_slots
    mine = W // 4
    s.recall.turn_start = s.slot_map.tokens_for(kv_len) - mine
    assert recall.own(s, s.slot_map.tokens_for(kv_len)) == mine
    expect = _reference_swaps(p, req, s, 1, mine, append=R)
    whole = _reference_swaps(p, req, s, 1, W, append=R)
    assert expect != whole, "the test needs the turn's queries to pick differently from the window's"
    host_k = [p.ctx.host.k[ly][s.recall.host.cols].clone() for ly in range(L)]
    cols_before = s.recall.host.cols.clone()
    s.recall.append_due = True
    assert recall.safe_append(req) == R
    _assert_appended(p, comp, expect, host_k, cols_before)
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


def test_append_rolls_back_on_a_failure(pools: Pools, monkeypatch):
    """A failure in the last layer of an append: the layers already appended are put back, the fresh
    slots are freed, the row and the host hold what they held, and recall is off for the request."""
    cfg = _tuning(monkeypatch, page=4, fetch_pages=8)
    pools.ctx.settings = cfg
    p = pools
    batch, req, s, heads, orig_k, orig_v = _setup(p, "snapkv")
    with compressor.one_thread():
        assert compressor.compress(req, "prefill") > 0
    kv_len = req.kv.kv_committed_len
    row = p.r2t.req_to_token[0, :kv_len].clone()
    cols = s.recall.host.cols.clone()
    host_k, host_v = p.ctx.host.k[:, cols].clone(), p.ctx.host.v[:, cols].clone()
    avail = p.alloc.available_size()
    real = recall.holes_filled
    calls: list[int] = []

    def fill(*args):
        calls.append(1)
        if len(calls) == L:
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(recall, "holes_filled", fill)
    s.recall.append_due = True
    assert recall.safe_append(req) == 0
    assert req.kv.kv_committed_len == kv_len and torch.equal(p.r2t.req_to_token[0, :kv_len], row)
    assert torch.equal(s.recall.host.cols, cols)
    assert torch.equal(p.ctx.host.k[:, cols], host_k) and torch.equal(p.ctx.host.v[:, cols], host_v)
    assert p.alloc.available_size() == avail and s.recall.tokens == 0 and s.slot_map.appended == 0
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


def test_a_paged_append_takes_no_more_than_its_fetched_pages_hold(pools: Pools, monkeypatch):
    """One fetched page of 16 columns may be the branch's partial last page (one real column): the append
    then takes one entry per head, never a padding column (which would duplicate a host entry)."""
    cfg = _tuning(monkeypatch, page=16, fetch_pages=1)
    p = pools
    req, s, probe, want = _compressed(p, monkeypatch, cfg)
    assert recall._paged(s.ctx, s.recall.host, R)[1] == 1  # one page fetched
    s.recall.append_due = True
    assert recall.safe_append(req) == 1
    ks, vs = _held(p, req, s)
    assert torch.allclose(_tags(ks, vs, probe), want, atol=1e-4)  # nothing lost, nothing duplicated
    s.recall.drop_host(s.ctx.host)
    assert p.ctx.host.n_free == p.ctx.host.size


def test_append_order_takes_the_shared_positions_first_then_the_heads_own() -> None:
    """A turn's append: entries of the positions ranked over every layer (higher rank first) wherever a
    head holds them on the host, then the head's own best by page; each entry once, and a ranked
    position that is only padding in a head (-inf) is not taken there. The positions' ranking too."""
    host_sc = torch.tensor([[0.9, 0.1, 0.2, 0.8, 0.05, 0.3], [0.1, 0.7, -torch.inf, 0.2, 0.6, 0.4]])
    shared = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 3.0, 0.0, 0.0, 0.0]])
    got = recall_core.append_order(host_sc, 1, 3, shared)
    assert got[0].tolist() == [1, 4, 0] and got[1].tolist() == [1, 4, 5]
    assert recall_core.append_order(host_sc, 1, 3, None)[0].tolist() == [0, 3, 5]
    # one pair over 6 positions: the 4 it attended, best first (-inf, padding, counts nothing)
    sc = torch.tensor([[0.0, 0.25, 0.75, -torch.inf, 0.125, 0.5]])
    ranks = recall_core.shared_positions([sc], [torch.arange(6).view(1, -1)], 6, 5)
    assert ranks.tolist() == [0, 2, 4, 0, 1, 3]
    # two pairs holding the positions in opposite columns: sums 0.5, 0.375, 0.75, 0.75, 0.375, 0.5
    two = recall_core.shared_positions(
        [sc, sc], [torch.arange(6).view(1, -1), torch.arange(5, -1, -1).view(1, -1)], 6, 3
    )
    assert two.tolist() == [1, 0, 3, 2, 0, 0]  # ties: the first position first


def test_fork_siblings_beyond_the_pools_room_read_the_history_where_it_is(pools: Pools) -> None:
    """Three fork siblings adopt one stored history (4 host columns) in a pool with room for one copy:
    the first takes a copy, the other two read the node's entries where they are (`borrowed`: no copy
    fits without dropping a live history). Borrowed entries are never evicted; their owner's release
    waits for the last reader; a history whose entries the LRU took is counted as missed, and a node
    that never held host entries is not."""
    batch = pools.batch(3, N, "snapkv", 48, {"window": W})
    pool = host.HostPool(L, H, D, 8, torch.float32)
    demote.attach(pools.ctx, pool)
    node = nodes.CompressedNode(0, "fp")
    node.host_entries = host.HostEntries()
    pool.append(node.host_entries, pool.alloc(4), None)
    held = node.host_entries
    states = [st.get(req) for req in batch.reqs]
    for s in states:
        s.recall.host_src = node
        demote.take(s)
    assert [0 if s.recall.host is None else s.recall.host.count for s in states] == [4, 0, 0]
    assert [s.recall.borrowed is held for s in states] == [False, True, True]
    assert demote.reading(states[2]) is held and held.readers == 2 and pool.totals.histories_borrowed == 2
    assert pool.alloc(8) is None and held.count == 4  # a demotion may take the copy, not what siblings read
    pool.release(held)  # the tree drops the node while two siblings still read its entries
    assert pool.n_free == 0 and held.count == 4
    states[1].recall.end_borrow(pool)
    assert pool.n_free == 0
    states[2].recall.drop_host(pool)  # the last reader: the columns go back now
    assert pool.n_free == 4 and held.count == 0 and states[2].recall.borrowed is None
    gone = nodes.CompressedNode(0, "fp")
    gone.host_entries = host.HostEntries(dropped=4)  # the LRU took them
    states[1].recall.host_src = gone
    demote.take(states[1])
    assert pool.totals.histories_missed == 1 and states[1].recall.borrowed is None
    states[1].recall.host_src = nodes.CompressedNode(0, "fp")  # recall was off when it was stored
    demote.take(states[1])
    assert pool.totals.histories_missed == 1
    pool.release(states[0].recall.host)
    assert pool.n_free == pool.size


def test_a_history_a_waiting_request_matched_is_kept_from_copies_and_demoted_over_last(pools: Pools) -> None:
    """A stored history that a waiting request has matched and not taken yet (`demote.awaited`: a fork's
    siblings before their first commit) is never dropped for another history's copy, and a demotion
    takes it only after every other branch, even when it is the least recently used."""
    batch = pools.batch(2, N, "snapkv", 48, {"window": W})
    pool = host.HostPool(L, H, D, 12, torch.float32)
    demote.attach(pools.ctx, pool)
    taker, waiting = (st.get(req) for req in batch.reqs)
    awaited, other, src = (nodes.CompressedNode(0, "fp") for _ in range(3))
    for node in (awaited, other, src):  # awaited is the least recently used
        node.host_entries = host.HostEntries(fork_branch=node is other)  # other: a fork branch stored it
        pool.append(node.host_entries, pool.alloc(4), None)
    waiting.recall.host_src = awaited
    assert demote.awaited(demote.others(taker)) == [awaited.host_entries]
    taker.recall.host_src = src
    demote.take(taker)  # a copy of src: room from `other` only
    assert taker.recall.host is not None and taker.recall.host.count == 4
    assert awaited.host_entries.count == 4 and other.host_entries.count == 0
    pool.touch(src.host_entries)  # awaited is the least recently used branch now
    cols = pool.alloc(
        4, keep=(taker.recall.host,), last=demote.awaited(demote.others(taker))
    )  # a demotion: src first
    assert cols is not None and src.host_entries.count == 0 and awaited.host_entries.count == 4
    pool.give_back(cols)
    waiting.recall.host_src = None
    taker.recall.drop_host(pool)
    pool.release(awaited.host_entries)
    assert pool.n_free == pool.size


def test_a_copied_history_goes_first_in_the_lru_unless_a_sibling_waits_for_it(pools: Pools) -> None:
    """After a copy, the node's entries are the pool's first LRU victims when nobody else continues them
    (the session goes on with the copy), and stay among its most recently used while a fork sibling
    that matched the node has not taken them yet (it needs them next)."""
    batch = pools.batch(2, N, "snapkv", 48, {"window": W})
    pool = host.HostPool(L, H, D, 16, torch.float32)
    demote.attach(pools.ctx, pool)
    other = host.HostEntries()  # an older stored history
    pool.append(other, pool.alloc(2), None)
    first, sibling = (st.get(req) for req in batch.reqs)
    for waiting in (False, True):
        node = nodes.CompressedNode(0, "fp")
        node.host_entries = held = host.HostEntries()
        pool.append(held, pool.alloc(2), None)
        first.recall.host_src = node
        sibling.recall.host_src = node if waiting else None
        demote.take(first)
        order = list(pool.lru.values())
        assert first.recall.host is not held and order[-1] is first.recall.host
        assert (order.index(held) > order.index(other)) == waiting, waiting
        first.recall.drop_host(pool)
        pool.release(held)
    sibling.recall.host_src = None
    pool.release(other)
    assert pool.n_free == pool.size


def test_a_sessions_next_turn_without_room_for_a_copy_takes_the_entries_unless_a_sibling_waits(
    pools: Pools,
) -> None:
    """The only request continuing a stored history, in a pool with no room for a copy, takes the node's
    entries (a borrow would leave its own stored history with only what it demotes itself: the session's
    next turn would lose the rest); the node keeps an empty set, and a later taker is counted as missed.
    A sibling that has matched the node and not taken it yet makes the request borrow instead."""
    batch = pools.batch(3, N, "snapkv", 48, {"window": W})
    pool = host.HostPool(L, H, D, 8, torch.float32)
    demote.attach(pools.ctx, pool)
    live = host.HostEntries(takers=2, running=1)  # a running fork's history: a copy may not drop it
    pool.append(live, pool.alloc(4), None)
    node = nodes.CompressedNode(0, "fp")
    node.host_entries = held = host.HostEntries()
    pool.append(held, pool.alloc(4), None)
    cols = held.cols.clone()
    first, waiting, late = (st.get(req) for req in batch.reqs)
    first.recall.host_src = node
    demote.take(first)
    assert first.recall.host is held and first.recall.borrowed is None and torch.equal(held.cols, cols)
    assert node.host_entries is not held and node.host_entries.count == 0
    assert held.takers == 0 and held.running == 0  # its own now: the turn after it takes them again
    assert not first.recall.continued_fork  # a session's next turn, not a fork's branch
    assert pool.totals.histories_moved == 1 and pool.totals.histories_borrowed == 0 and live.count == 4
    late.recall.host_src = node
    demote.take(late)
    assert late.recall.host is None and pool.totals.histories_missed == 1
    # the same, with a sibling that matched the node and waits: the request borrows
    node.host_entries = again = first.recall.host
    first.recall.host = None
    for s in (first, waiting):
        s.recall.host_src = node
    demote.take(first)
    assert first.recall.borrowed is again and node.host_entries is again and pool.totals.histories_moved == 1
    demote.take(waiting)
    assert waiting.recall.borrowed is again and again.readers == 2
    for s in (first, waiting):
        s.recall.drop_host(pool)
    pool.release(again)
    pool.release(live)
    assert pool.n_free == pool.size


def test_a_demotion_never_takes_a_running_requests_entries(pools: Pools) -> None:
    """A demotion (or a borrower's excerpt) under a full pool drops stored histories, never the entries
    another running request holds: that request's turn would go on without its history. When stored
    histories are not enough, the demotion is refused and the running request keeps everything."""
    batch = pools.batch(2, N, "snapkv", 48, {"window": W})
    me, running = (st.get(req) for req in batch.reqs)
    pool = host.HostPool(L, H, D, 8, torch.float32)
    demote.attach(pools.ctx, pool)
    pool.append(running.recall.entries(), pool.alloc(4), None)  # the least recently used branch
    stored = host.HostEntries()
    pool.append(stored, pool.alloc(4), None)
    cols = demote.columns(me, 4)
    assert cols is not None and stored.count == 0 and running.recall.host.count == 4
    pool.append(me.recall.entries(), cols, None)
    assert demote.columns(me, 2) is None and pool.totals.demote_refused == 2
    assert demote.columns(me, 2, count_refused=False) is None and pool.totals.demote_refused == 2
    assert running.recall.host.count == 4 and me.recall.host.count == 4
    for s in (me, running):
        s.recall.drop_host(pool)
    assert pool.n_free == pool.size


def test_a_demotion_never_takes_a_sessions_latest_history_stored_after_it_arrived(pools: Pools) -> None:
    """A request's demotions take a session's latest history only if it was stored before the request
    arrived (`RecallState.arrived`, the pool's clock at its first match): one stored since is for that
    session's next turn, on its way. A fork branch's stored history is fair game whenever it was
    stored, and a request arriving later may take the newer history."""
    batch = pools.batch(2, N, "snapkv", 48, {"window": W})
    me, later = (st.get(req) for req in batch.reqs)
    pool = host.HostPool(L, H, D, 12, torch.float32)
    demote.attach(pools.ctx, pool)
    old, new, fork = host.HostEntries(), host.HostEntries(), host.HostEntries(fork_branch=True)
    pool.append(old, pool.alloc(4), None)
    me.recall.arrived = pool.clock
    for e in (new, fork):  # stored while `me` runs
        pool.append(e, pool.alloc(4), None)
    assert demote.columns(me, 10) is None and old.count == new.count == fork.count == 4
    cols = demote.columns(me, 6)  # the fork branch's, then 2 of the old history's newest
    assert cols is not None and fork.count == 0 and old.count == 2 and new.count == 4
    pool.give_back(cols)
    pool.touch(old)  # used again since `me` arrived: kept from it too
    assert demote.columns(me, 8) is None and old.count == 2
    later.recall.arrived = pool.clock
    cols = demote.columns(later, 12)
    assert cols is not None and old.count == new.count == 0
    pool.give_back(cols)
    assert pool.n_free == pool.size


def test_a_request_waiting_in_the_queue_guards_the_history_it_will_adopt(pools: Pools) -> None:
    """A request that joined SGLang's waiting queue is matched on arrival (`demote.match_waiting`, once):
    the stored history it will adopt counts as awaited, so the sibling that runs first, finding no room
    for a copy, borrows the node's entries instead of moving them away from the one still waiting."""
    batch = pools.batch(1, N, "snapkv", 48, {"window": W, "scope": "branch"})
    first = batch.reqs[0]
    s = st.get(first)
    params = SamplingParams(max_new_tokens=8, custom_params=first.sampling_params.custom_params)
    waiting = Req("waiting", "", array("q", range(1000, 1024)), params)  # not seen by the tree yet
    pool = host.HostPool(L, H, D, 8, torch.float32)
    demote.attach(pools.ctx, pool)
    node, _ = pools.tree._insert_compressed(
        pools.tree.root_node, RadixKey(array("q", range(1000, 1020))), pools.alloc.alloc(8).long(), 0, s.fp
    )
    node.host_entries = held = host.HostEntries()
    pool.append(held, pool.alloc(4), None)
    other = host.HostEntries()  # the rest of the pool: no copy fits
    pool.append(other, pool.alloc(4), None)
    demote.match_waiting(pools.tree, [waiting])
    w = st.get(waiting)
    assert w is not None and w.recall.host_src is node
    assert demote.awaited(demote.others(s)) == [held]
    demote.match_waiting(pools.tree, [waiting])
    assert st.get(waiting) is w  # matched once; SGLang matches it again at admission
    s.recall.host_src = node
    demote.take(s)
    assert s.recall.borrowed is held and node.host_entries is held and pool.totals.histories_moved == 0
    s.recall.drop_host(pool)
    w.recall.host_src = None
    pool.release(held)
    pool.release(other)
    assert pool.n_free == pool.size


@pytest.mark.parametrize("summary", ["off", "minmax"])
def test_a_borrowed_history_is_appended_from_and_left_as_it_was(pools: Pools, monkeypatch, summary: str):
    """A request that borrows its stored history (the pool has no room for a copy) appends from it what
    a request holding the entries itself would (the same entries into the fresh slots), writes nothing
    to the borrowed columns, and stops reading them once the append ran."""
    cfg = _tuning(monkeypatch, page=4, summary=summary, fetch_pages=2)
    p = pools
    req, s, probe, want = _compressed(p, monkeypatch, cfg, "snapkv")
    pool, comp = p.ctx.host, s.slot_map.comp_slots
    expect = _reference_swaps(p, req, s, 4, W, summary, fetch=2, append=R)
    host_k = [pool.k[ly][s.recall.host.cols].clone() for ly in range(L)]
    node = nodes.CompressedNode(0, "fp")  # the history's entries belong to a stored node now
    node.host_entries, s.recall.host = s.recall.host, None
    cols, positions = node.host_entries.cols.clone(), node.host_entries.positions.clone()
    before = [buf[:, cols].clone() for buf in (pool.k, pool.v)]
    live = host.HostEntries(takers=2, running=1)  # a running fork's history fills the rest of the pool
    pool.append(live, pool.alloc(pool.n_free), None)
    node.host_entries.takers = 1  # a fork sibling continued it first: this branch must not take it away
    s.recall.host_src = node
    s.recall.append_due = True
    assert recall.safe_append(req) == R
    assert s.recall.borrowed is None and node.host_entries.readers == 0
    assert pool.totals.histories_borrowed == 1
    _assert_appended(p, comp, expect, host_k, cols)
    assert torch.equal(node.host_entries.cols, cols) and torch.equal(node.host_entries.positions, positions)
    assert all(torch.equal(buf[:, cols], b) for buf, b in zip((pool.k, pool.v), before, strict=True))
    assert s.slot_map.appended == R and s.recall.recalled == R * L * H
    # its excerpt: its own copy of the next best entries of each (layer, head), none of those appended
    mine = s.recall.host
    n_sel = max(-(-recall.FETCH * R // 4), recall.FETCH_PAGES)  # pages a paged append fetches per head
    ranked = cols.numel() if summary == "off" else (n_sel - 1) * 4 + 1
    assert mine.count == min(recall.EXCERPT * R, ranked - R) > 0 and mine.positions.shape[-1] == mine.count
    assert pool.totals.copied == mine.count  # the excerpt, not the history
    new = p.r2t.req_to_token[0, comp : comp + R].long()
    for ly in range(L):
        for h in range(H):
            got = pool.k[ly][mine.cols, h]
            held_k = before[0][ly][:, h]
            src = [int((held_k == k).all(-1).nonzero()[0]) for k in got]  # each is one of the history's
            assert torch.equal(mine.positions[ly, h], positions[ly, h, src])
            appended = p.kv.get_key_buffer(ly)[new, h]
            assert not (got[:, None] == appended[None]).all(-1).any(), (ly, h)
    s.recall.drop_host(pool)
    for e in (node.host_entries, live):
        pool.release(e)
    assert pool.n_free == pool.size


def test_the_lru_keeps_a_running_forks_history_after_the_others_until_its_branches_end() -> None:
    """A stored history two branches continued (a fork's) is dropped after the others while one of them
    runs, even when it is the less recently used, and a copy never drops it then (a sibling without room
    borrows instead). Once its branches are released it ages like any other: a finished session's fork
    must not outlive a live session's history."""
    pool = host.HostPool(L, H, D, 12, torch.float32)
    fork, once = host.HostEntries(), host.HostEntries()
    branches = [st.RecallState() for _ in range(2)]
    for e in (fork, once):
        pool.append(e, pool.alloc(4), None)
        pool.drop_first(e)  # both were copied: the first victims
    for r in branches:
        fork.takers += 1
        r.join(fork)
    assert all(r.continued_fork for r in branches)  # what they store is a fork branch's history
    once.takers = 1
    pool.touch(once)  # the more recently used
    pool.drop_first(once)
    live = host.HostEntries()  # a running request's own
    pool.append(live, pool.alloc(4), None)
    assert fork.live_fork and fork.running == 2
    got = pool.alloc(4, keep=(live,), copying=live)
    assert got is not None and once.count == 0 and fork.count == 4
    assert pool.alloc(4, keep=(live,), copying=live) is None and fork.count == 4  # stays for a copy
    pool.give_back(got)
    got = pool.alloc(8)
    assert got is not None and live.count == 0 and fork.count == 4  # a demotion: the others first
    pool.give_back(got)
    for r in branches:  # both branches finish
        r.leave()
        r.leave()  # a second release is a no-op
    assert fork.running == 0 and not fork.live_fork
    later = host.HostEntries()
    pool.append(later, pool.alloc(4), None)  # a live session's, more recent than the finished fork
    assert pool.alloc(8) is not None and fork.count == 0 and later.count == 4  # now least recently used
