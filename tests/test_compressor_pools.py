"""The compressor on SGLang's real pools and radix cache, without a server.

Two "tensor-parallel ranks" hold different KV heads of the same request (as `--tp 2` would shard them):
the compressor must decide the same slot counts, rows and tree keys on both without communicating.
And a failure at any point of a compression step must leave the request's row, its lengths, its tree
lock and the tree exactly as before.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_kvevict.cache import capture, compressor
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.tree import KvEvictRadixCache, Region, is_compressed
from sgl_kvevict.tools.pools import runtime_for

L, HKV, GROUP, D = 2, 4, 2, 16  # layers, KV heads (2 per rank), query heads per KV head, head dim
POOL, PROMPT, DECODE = 1024, 160, 40
POLICIES = [
    ("streaming", {}),
    ("knorm", {}),
    ("h2o", {}),
    ("snapkv", {}),
    ("lagkv", {"lag": 16}),
    ("d2o", {}),
    ("d2o", {"merge": True}),
    ("graphkv", {}),
    ("graphkv", {"base": "lagkv", "base_config": {"lag": 16}}),
    ("criticalkv", {}),
]


class Rank:
    """One rank's pools, tree and runtime, holding KV heads `heads` of the full model."""

    def __init__(self, heads: slice, dtype: torch.dtype = torch.float32) -> None:
        self.heads = heads
        h = heads.stop - heads.start
        self.r2t = ReqToTokenPool(4, 512, "cpu", False)
        self.kv = MHATokenToKVPool(POOL, 1, dtype, h, D, L, "cpu", False)
        self.alloc = TokenToKVPoolAllocator(POOL, dtype, "cpu", self.kv, False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=1
        )
        self.tree = KvEvictRadixCache(params, self.r2t.req_to_token.shape[0])
        w = torch.Generator().manual_seed(7)
        w_o = torch.randn(HKV * GROUP, D, 32, generator=w).to(dtype)  # [Hq, D, hidden] of the whole model
        qs = slice(heads.start * GROUP, heads.stop * GROUP)
        rt = runtime_for(
            self.tree, self.alloc, self.kv, h * GROUP, {lay: w_o[qs].contiguous() for lay in range(L)}
        )
        self.rt = rt
        self.store = capture.Store(
            self.r2t.req_to_token.shape[0], L, 8, h * GROUP, D, 4, torch.float32, "cpu"
        )

    def activate(self) -> None:
        self.tree.ctx.rt, self.tree.ctx.capture = self.rt, self.store


def _kvq(pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic full-model K, V `[L, HKV, D]` and queries `[L, HKV*GROUP, D]` of token `pos`."""
    g = torch.Generator().manual_seed(1000 + pos)
    k = torch.randn(L, HKV, D, generator=g) * (1 + (pos % 7) / 3)
    v = torch.randn(L, HKV, D, generator=g)
    q = torch.randn(L, HKV * GROUP, D, generator=g)
    return k, v, q


def _req(policy: str, config: dict, n_tokens: int) -> SimpleNamespace:
    ids = list(range(100, 100 + n_tokens))
    req = SimpleNamespace(
        rid=f"r-{policy}",
        kv=ReqKvInfo(),
        sampling_params=SimpleNamespace(
            custom_params={"kvevict": {"policy": policy, "budget": 48, "config": {"window": 8, **config}}}
        ),
        extra_key=None,
        cache_salt=None,
        priority=0,
        origin_input_ids=ids[:PROMPT],
        full_untruncated_fill_ids=ids,
        lock=None,
        last_node=None,
        done=False,
    )
    req.finished = lambda: req.done
    return req


def _append(rank: Rank, req: SimpleNamespace, pos: int) -> None:
    """Allocate one slot at the end of the request's row and write token `pos` of this rank's heads."""
    kv = req.kv
    slot = rank.alloc.alloc(1)
    rank.r2t.req_to_token[kv.req_pool_idx, kv.kv_committed_len] = slot[0].to(torch.int32)
    k, v, q = _kvq(pos)
    for layer in range(L):
        rank.kv.get_key_buffer(layer)[slot] = k[layer, rank.heads].unsqueeze(0).to(rank.kv.dtype)
        rank.kv.get_value_buffer(layer)[slot] = v[layer, rank.heads].unsqueeze(0).to(rank.kv.dtype)
    if kv.req_pool_idx in rank.store.entries:
        qs = slice(rank.heads.start * GROUP, rank.heads.stop * GROUP)
        for layer in range(L):
            rank.store.put(kv.req_pool_idx, layer, q[layer, qs].unsqueeze(0), torch.tensor([pos]))
    kv.kv_committed_len += 1
    kv.kv_allocated_len = kv.kv_committed_len


def _start(rank: Rank, policy: str, config: dict, share_prompt: bool) -> SimpleNamespace:
    """Admit a request, prefill its prompt; with `share_prompt` the prompt is checkpointed into the tree
    first (SGLang does this after prefill so that others can share it)."""
    rank.activate()
    req = _req(policy, config, PROMPT + DECODE)
    req.kv.req_pool_idx = 0
    req.lock = rank.tree.lock(rank.tree.root_node)
    req.last_node = rank.tree.root_node
    s = st.ensure(req, rank.tree.ctx)
    st.on_match(req, rank.tree.ctx, Region(rank.tree.root_node, 0, 0, None))
    if "attn" in s.policy.needs:
        assert rank.store.ensure(0, s.policy.config.window, 0)
    for pos in range(PROMPT):
        _append(rank, req, pos)
    if share_prompt:
        rank.tree.checkpoint(req, up_to=PROMPT)
    return req


def _tree_keys(tree: KvEvictRadixCache) -> list[tuple[bool, tuple[int, ...], int]]:
    out, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            out.append((is_compressed(child), tuple(child.key.token_ids), len(child.value)))
            stack.append(child)
    return sorted(out)


def _run(rank: Rank, policy: str, config: dict, share_prompt: bool) -> dict:
    req = _start(rank, policy, config, share_prompt)
    s = st.get(req)
    freed = [compressor.compress(req, "prefill")]
    for pos in range(PROMPT, PROMPT + DECODE - 1):
        rank.activate()
        _append(rank, req, pos)
        freed.append(compressor.compress(req, "decode"))
    req.done = True
    freed.append(compressor.compress(req, "finish"))
    kv_len = req.kv.kv_committed_len
    row = rank.r2t.req_to_token[0, :kv_len].clone()
    rank.tree.checkpoint(req, up_to=kv_len)
    return {
        "freed": freed,
        "counts": (
            s.slot_map.comp_slots,
            s.slot_map.comp_tokens,
            s.slot_map.own_evicted,
            s.slot_map.offset,
            kv_len,
        ),
        "row": row.tolist(),
        "tree": _tree_keys(rank.tree),
        "available": rank.alloc.available_size(),
        "failed": s.failed,
    }


@pytest.mark.parametrize("share_prompt", [False, True], ids=["own", "tree-shared"])
@pytest.mark.parametrize("policy,config", POLICIES, ids=[f"{p}{c or ''}" for p, c in POLICIES])
def test_two_head_shards_agree(policy: str, config: dict, share_prompt: bool) -> None:
    a = _run(Rank(slice(0, 2)), policy, config, share_prompt)
    b = _run(Rank(slice(2, 4)), policy, config, share_prompt)
    assert sum(a["freed"]) > 0, "the scenario must evict something"
    assert not a["failed"] and not b["failed"]
    for field in ("freed", "counts", "row", "tree", "available"):
        assert a[field] == b[field], f"{field} differs between the two head shards"
    assert any(c for c, _, _ in a["tree"]), "a compressed node was stored"


def _snapshot(rank: Rank, req: SimpleNamespace) -> tuple:
    kv = req.kv
    return (
        rank.r2t.req_to_token[0].clone(),
        kv.kv_committed_len,
        kv.kv_allocated_len,
        kv.cache_protected_len,
        req.lock.node,
        rank.alloc.available_size(),
        rank.tree.evictable_size(),
        rank.tree.protected_size(),
        _tree_keys(rank.tree),
        [rank.kv.get_key_buffer(layer).clone() for layer in range(L)],
    )


def _same(x: tuple, y: tuple) -> bool:
    return all(
        torch.equal(a, b)
        if isinstance(a, torch.Tensor)
        else all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
        else a == b
        for a, b in zip(x, y, strict=True)
    )


@pytest.mark.parametrize("where", ["select", "merge", "compact"])
@pytest.mark.parametrize("share_prompt", [False, True], ids=["own", "tree-shared"])
def test_failed_step_changes_nothing(monkeypatch, where: str, share_prompt: bool) -> None:
    rank = Rank(slice(0, 4))
    req = _start(rank, "d2o", {"merge": True}, share_prompt)
    before = _snapshot(rank, req)

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure in {where}")

    s = st.get(req)
    if where == "select":
        monkeypatch.setattr(s.policy, "select", boom)
    elif where == "merge":
        monkeypatch.setattr(s.policy, "merge", boom)
    else:
        monkeypatch.setattr(compressor.kernels, "compact", boom)
    assert compressor.safe_compress(req, "prefill") == 0
    assert s.failed and rank.rt.totals.policy_failures == 1
    assert _same(before, _snapshot(rank, req))


def test_full_pool_takes_back_its_own_tree_nodes() -> None:
    """A tree-shared prompt, a pool with no free slot: compression still runs, by taking back the tree
    nodes only this request holds, and nothing leaks."""
    rank = Rank(slice(0, 4))
    req = _start(rank, "snapkv", {}, share_prompt=True)
    hog = rank.alloc.alloc(rank.alloc.available_size())
    assert rank.alloc.available_size() == 0 and rank.tree.evictable_size() == 0
    freed = compressor.compress(req, "prefill")
    assert freed > 0 and req.kv.cache_protected_len == 0
    assert rank.alloc.available_size() == freed
    _finish_and_check_no_leak(rank, req, hog)


def _finish_and_check_no_leak(rank: Rank, req: SimpleNamespace, hog: torch.Tensor) -> None:
    """The request finishes (its history stored in the tree), the hogged slots come back, everything is
    evicted: the whole pool must be free again."""
    req.done = True
    rank.tree.checkpoint(req, up_to=req.kv.kv_committed_len)
    rank.tree.unlock(req.lock)
    rank.alloc.free(hog)
    rank.tree.evict(EvictParams(num_tokens=10**6))
    assert rank.alloc.available_size() == POOL
    assert not rank.tree.shared and rank.tree.shared_leaks() == []


def test_declared_shared_prefix_is_kept_on_a_first_turn() -> None:
    """Nothing was matched on a first turn, so the match could not place the declared prefix; the first
    compression does, on the prompt checkpointed after prefill (splitting the node it cuts)."""
    rank = Rank(slice(0, 4))
    req = _start(rank, "knorm", {"shared_prefix": 40, "scope": "branch"}, share_prompt=True)
    row_before = rank.r2t.req_to_token[0, :40].clone()
    assert compressor.compress(req, "prefill") > 0
    s = st.get(req)
    assert s.slot_map.anchor_tokens == 40 and s.slot_map.anchor_kv == 40 and len(s.slot_map.anchor.key) == 40
    assert torch.equal(rank.r2t.req_to_token[0, :40], row_before)  # the declared prefix was not compacted
    assert req.kv.cache_protected_len == 40


def test_finishing_batch_does_not_count_on_eviction() -> None:
    """The last compression of a turn runs inside SGLang's free group, where slots freed by eviction come
    back only when the group ends. With no free slot and only another prompt's evictable cache, the step
    must not ask eviction for slots (that raised out of memory): it takes back its own tree nodes."""
    rank = Rank(slice(0, 4))
    req = _start(rank, "snapkv", {}, share_prompt=True)
    other = rank.alloc.alloc(200).to(torch.int64)
    rank.tree.insert(InsertParams(key=RadixKey(list(range(10_000, 10_200))), value=other))
    hog = rank.alloc.alloc(rank.alloc.available_size())
    assert rank.alloc.available_size() == 0 and rank.tree.evictable_size() == 200
    rank.alloc.free_group_begin()
    freed = compressor.compress(req, "decode")
    rank.alloc.free_group_end()
    assert freed > 0 and req.kv.cache_protected_len == 0
    assert rank.tree.evictable_size() == 200  # the other prompt stayed cached
    _finish_and_check_no_leak(rank, req, hog)


def test_out_of_memory_report_prints_compressed_nodes(capsys) -> None:
    """SGLang prints the tree when an allocation fails; compressed nodes must not break that report."""
    rank = Rank(slice(0, 4))
    req = _start(rank, "snapkv", {}, share_prompt=False)
    assert compressor.compress(req, "prefill") > 0
    kv_len = req.kv.kv_committed_len
    req.done = True
    rank.tree.checkpoint(req, up_to=kv_len)
    assert any(is_compressed(n) for n in _all_nodes(rank.tree))
    rank.tree.pretty_print()
    assert "compressed:" in capsys.readouterr().out
    rank.tree.unlock(req.lock)
    rank.tree.evict(EvictParams(num_tokens=10**6))
    assert rank.alloc.available_size() == POOL


def _all_nodes(tree: KvEvictRadixCache) -> list:
    out, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


@pytest.mark.parametrize("policy", ["knorm", "snapkv"])
def test_demotion_records_each_entrys_logical_position_after_a_shared_prefix(
    policy: str, monkeypatch
) -> None:
    """A region that starts after a 40-token shared prefix, compressed at prefill and again after its
    decode tokens (so that row indices no longer equal positions): every entry a compression demotes to
    the host tier records the logical position of its token in the conversation (what the oracle
    replays under KVEVICT_DEBUG), not its index in the region or the row. Each host column's K must be
    the K of the token at the position it records, in every layer and head."""
    from sgl_kvevict.cache.host_tier import demote, host
    from sgl_kvevict.config import ServerSettings

    monkeypatch.setattr(st, "DEBUG", True)
    rank = Rank(slice(0, 4))
    rank.tree.ctx.settings = ServerSettings(recall_tokens=8)
    demote.attach(rank.tree.ctx, host.HostPool(L, 4, D, 512, torch.float32))
    req = _start(rank, policy, {"shared_prefix": 40, "scope": "branch"}, share_prompt=True)
    s = st.get(req)
    s.recall.tokens = 8
    assert compressor.compress(req, "prefill") > 0
    assert s.slot_map.anchor_tokens == 40  # the region starts after the prefix
    first = s.recall.host.count
    for p in range(PROMPT, PROMPT + DECODE):
        _append(rank, req, p)
    assert compressor.compress(req, "decode") > 0
    e = s.recall.host
    assert e.count > first  # the second compression demoted entries of a compacted row too
    assert e is not None and e.count > 0 and e.positions is not None
    pos = e.positions[..., : e.count]  # [L, H, count]
    assert int(pos.min()) >= 40 and int(pos.max()) < PROMPT + DECODE  # in the region, from the start
    for layer in range(L):
        keys = rank.tree.ctx.host.k[layer][e.cols]  # [count, H, D]
        for h in range(4):
            for j in range(e.count):
                want = _kvq(int(pos[layer, h, j]))[0][layer, h]
                assert torch.allclose(keys[j, h], want), (layer, h, j, int(pos[layer, h, j]))
    s.recall.drop_host(rank.tree.ctx.host)


def test_own_region_copies_a_tree_held_history_into_own_slots() -> None:
    """A request whose region still sits in the tree (its compression did not fire: a short question
    turn) gets its own copy before a recall writes into it: new slots with the same K and V, the tree's
    copy untouched, and the allocator short by exactly the copy (a failure inside the copy once leaked
    the slots it had taken)."""
    rank = Rank(slice(0, 4))
    req = _start(rank, "lagkv", {"lag": 16}, share_prompt=True)
    s = st.get(req)
    assert req.kv.cache_protected_len == PROMPT > s.slot_map.anchor_kv  # the tree holds the region
    before = rank.r2t.req_to_token[0, :PROMPT].clone().long()
    keys = [rank.kv.get_key_buffer(layer)[before].clone() for layer in range(L)]
    free0, tree0 = rank.alloc.available_size(), _tree_keys(rank.tree)
    assert compressor.own_region(req, s)
    after = rank.r2t.req_to_token[0, :PROMPT].long()
    assert not set(after.tolist()) & set(before.tolist())  # the request's own slots now
    assert rank.alloc.available_size() == free0 - PROMPT
    assert _tree_keys(rank.tree) == tree0
    for layer in range(L):
        assert torch.equal(rank.kv.get_key_buffer(layer)[after], keys[layer])
        assert torch.equal(rank.kv.get_key_buffer(layer)[before], keys[layer])
    assert compressor.own_region(req, s)  # already its own: nothing more is copied
    assert rank.alloc.available_size() == free0 - PROMPT


def _composed_turn(rank: Rank, n_tokens: int, config: dict) -> tuple[int, int]:
    """One turn of a client-composed session (its prompt the session's first `n_tokens` tokens) as
    SGLang serves a turn that finishes in its prefill step (one generated token): matched against the
    tree, its new tokens prefilled, then released. Its one compression is the release's last one, which
    runs before SGLang's release checkpoints the row: the prompt never went into the tree before it.
    Returns (prefix slots, device KV slots) at the end of the turn; afterwards the server is idle."""
    rank.activate()
    req = _req("knorm", config, n_tokens)
    req.origin_input_ids = req.full_untruncated_fill_ids
    res = rank.tree.match_prefix(MatchPrefixParams(key=RadixKey(req.full_untruncated_fill_ids), req=req))
    node = res.last_device_node
    held = rank.tree.path_device_indices(node)
    kv = req.kv
    kv.req_pool_idx = 0
    req.lock, req.last_node = rank.tree.lock(node), node
    rank.r2t.req_to_token[0, : len(held)] = held.to(torch.int32)
    kv.kv_committed_len = kv.kv_allocated_len = kv.cache_protected_len = len(held)
    for pos in range(res.device_prefix_len, n_tokens):
        _append(rank, req, pos)
    req.done = True
    compressor.compress(req, "finish")
    s, end = st.get(req), kv.kv_committed_len
    out = (s.slot_map.anchor_kv, end)
    rank.tree.checkpoint(req, up_to=end)  # SGLang's release: checkpoint, free the rest, unlock
    if end > kv.cache_protected_len:
        rank.alloc.free(rank.r2t.req_to_token[0, kv.cache_protected_len : end].to(torch.int64))
    rank.tree.unlock(req.lock)
    req.lock = None
    rank.tree.on_release(req, checkpointed=True)
    # SGLang's idle memory check: every slot is free or evictable cache
    assert rank.tree.protected_size() == 0
    assert rank.alloc.available_size() + rank.tree.evictable_size() == POOL
    return out


def test_a_compressed_first_turn_leaves_only_the_declared_prefix_shared() -> None:
    """A session's first turn longer than the budget compresses in its release, before its prompt was
    ever checkpointed. The declared `shared_prefix` must still stay out of its compressed history (and go
    into the tree uncompressed, for the other sessions): a history that started inside the prefix would
    be shared whole, and every later turn would hold it beside its own budget (about twice the budget on
    the device). Each later turn re-compresses what the previous one stored: its device KV stays the
    prefix plus the budget and the windows."""
    budget, sp, cfg = 48, 16, {"shared_prefix": 16, "scope": "branch"}
    rank = Rank(slice(0, 4))
    bound = sp + budget + 4 + 32  # the prefix, the budget, the sinks and the recent window at most
    for turn, n_tokens in enumerate((PROMPT, 2 * PROMPT, 3 * PROMPT)):
        prefix, kv_len = _composed_turn(rank, n_tokens, cfg)
        assert prefix == sp, f"turn {turn}: the prefix it left uncompressed is {prefix} slots, not {sp}"
        assert kv_len <= bound, f"turn {turn}: {kv_len} slots on the device, above {bound}"
    probe = rank.tree.match(RadixKey([*range(100, 100 + sp), 7]), None)
    assert probe.device_prefix_len == sp  # another session finds the declared prefix, uncompressed
    rank.tree.evict(EvictParams(num_tokens=10**6))
    assert rank.alloc.available_size() == POOL
    assert rank.tree.shared_leaks() == []
