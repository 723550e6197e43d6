"""The compressing radix cache on SGLang's real pools (ReqToTokenPool, MHATokenToKVPool, allocator)."""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_kvevict.cache.nodes import CompressedNode
from sgl_kvevict.cache.tree import KvEvictRadixCache, is_compressed

POOL = 512
FP = "fp-a"  # the fingerprint of the config that compressed the history in `build_history`


def key(ids) -> RadixKey:
    return RadixKey(array("q", list(ids)))


@pytest.fixture()
def tree() -> KvEvictRadixCache:
    r2t = ReqToTokenPool(8, 256, "cpu", False)
    kv = MHATokenToKVPool(POOL, 1, torch.bfloat16, 3, 64, 2, "cpu", False)
    alloc = TokenToKVPoolAllocator(POOL, torch.bfloat16, "cpu", kv, False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
    )
    return KvEvictRadixCache(params, r2t.req_to_token.shape[0])


def build_history(t: KvEvictRadixCache):
    """prefix P = tokens 0..9 (10 slots) -> compressed C = tokens 10..29 in 8 slots -> tail = 30..34."""
    alloc = t.token_to_kv_pool_allocator
    p_slots = alloc.alloc(10).to(torch.int64)
    t.insert(InsertParams(key=key(range(10)), value=p_slots))
    p_node = t.match_prefix(MatchPrefixParams(key=key(range(10)))).last_device_node
    c_slots = alloc.alloc(8).to(torch.int64)
    c_node, dup = t._insert_compressed(p_node, key(range(10, 30)), c_slots, 0, FP)
    assert not dup and is_compressed(c_node)
    tail_slots = alloc.alloc(5).to(torch.int64)
    _, tail = t._insert_helper(c_node, key(range(30, 35)), tail_slots, 0, 0)
    return p_node, c_node, tail, torch.cat([p_slots, c_slots, tail_slots])


def test_full_match_reports_tokens_and_slots(tree):
    _, _, tail, slots = build_history(tree)
    res = tree.match(key([*range(35), 99]), FP)
    assert res.device_prefix_len == 35  # tokens: SGLang slices fill ids with it
    assert res.cache_protected_len == 23  # slots on the path
    assert res.last_device_node is tail
    assert torch.equal(tree.path_device_indices(tail), slots)


def test_compressed_node_is_atomic(tree):
    p_node, c_node, _, _ = build_history(tree)
    res = tree.match(key([*range(20), 77]), FP)
    assert res.device_prefix_len == 10 and res.cache_protected_len is None
    assert res.last_device_node is p_node
    assert len(c_node.key) == 20 and len(c_node.value) == 8  # never split


def test_uncompressed_tail_splits_like_any_node(tree):
    _, c_node, _, slots = build_history(tree)
    res = tree.match(key([*range(32), 55]), FP)
    assert res.device_prefix_len == 32 and res.cache_protected_len == 20
    node = res.last_device_node
    assert node.parent is c_node and len(node.key) == 2
    assert torch.equal(tree.path_device_indices(node), slots[:20])


def test_sizes_count_slots_and_eviction_frees_everything(tree):
    _, _, tail, _ = build_history(tree)
    alloc = tree.token_to_kv_pool_allocator
    assert tree.evictable_size() == 23 and tree.protected_size() == 0
    assert alloc.available_size() + tree.evictable_size() == POOL
    lock = tree.lock(tail)
    assert tree.protected_size() == 23 and tree.evictable_size() == 0
    tree.unlock(lock)
    assert tree.evictable_size() == 23
    tree.evict(EvictParams(num_tokens=1000))
    assert tree.evictable_size() == 0 and alloc.available_size() == POOL


def test_the_shared_mark_follows_splits_deletions_and_reset(tree):
    """`_mark_shared` marks any node (SGLang's plain ones too) in a set the tree owns: a split's new top
    part is marked as its node was, a deleted node leaves the set, and nothing stays behind."""
    p_node, c_node, tail, _ = build_history(tree)
    tree._mark_shared(tail)
    assert tree.shared == {p_node, c_node, tail}
    top = tree.match(key(range(4)), None).last_device_node  # ends inside the prefix: splits it
    assert top is not p_node and top.parent is tree.root_node and top in tree.shared
    assert tree.shared_leaks() == []
    tree.evict(EvictParams(num_tokens=1000))
    assert not tree.shared and tree.shared_leaks() == []
    build_history(tree)
    tree._mark_shared(tree.match(key(range(10)), None).last_device_node)
    tree.shared.add(TreeNode())  # a planted entry for a node not in the tree: the check sees it
    assert len(tree.shared_leaks()) == 1
    tree.reset()
    assert not tree.shared


def test_a_compressed_node_is_its_own_type_and_never_split(tree):
    """Its fields live on its own type (`CompressedNode`), which SGLang's split would not carry over."""
    p_node, c_node, _, _ = build_history(tree)
    assert isinstance(c_node, CompressedNode) and c_node.fp == FP and c_node.host_entries is None
    assert not is_compressed(p_node) and type(p_node) is TreeNode
    with pytest.raises(AssertionError, match="never split"):
        tree._split_node(c_node.key, c_node, 3)


def test_compressed_and_uncompressed_copies_coexist(tree):
    p_node, c_node, _, _ = build_history(tree)
    alloc = tree.token_to_kv_pool_allocator
    tree.insert(
        InsertParams(
            key=key(range(15)),
            value=torch.cat([tree.path_device_indices(p_node), alloc.alloc(5).to(torch.int64)]),
        )
    )
    # The uncompressed branch covers 5 tokens after P, the compressed one 20: the longer wins.
    res = tree.match(key([*range(30), 1]), FP)
    assert res.last_device_node is c_node and res.device_prefix_len == 30
    res = tree.match(key([*range(15), 88]), FP)
    assert res.device_prefix_len == 15 and res.cache_protected_len is None
    assert not is_compressed(res.last_device_node)
    tree.evict(EvictParams(num_tokens=1000))
    assert alloc.available_size() == POOL


def test_duplicate_compressed_history_is_reused(tree):
    p_node, c_node, _, _ = build_history(tree)
    other = tree.token_to_kv_pool_allocator.alloc(8).to(torch.int64)
    node, dup = tree._insert_compressed(p_node, key(range(10, 30)), other, 0, FP)
    assert dup and node is c_node
    assert (
        tree._insert_compressed(p_node, key(range(10, 30)), other[:6], 0, FP) is None
    )  # same tokens, other KV


def test_compressed_history_is_seen_only_by_its_own_fingerprint(tree):
    p_node, c_node, tail, _ = build_history(tree)
    probe = key([*range(35), 99])
    # Another config, `none` (fp None) and SGLang's own request-less lookups see uncompressed KV only.
    for fp in ("fp-b", None):
        res = tree.match(probe, fp)
        assert res.last_device_node is p_node and res.device_prefix_len == 10
        assert res.cache_protected_len is None
    assert tree.match_prefix(MatchPrefixParams(key=probe)).last_device_node is p_node
    assert tree.match(probe, FP).last_device_node is tail


def test_same_tokens_other_fingerprint_is_another_node(tree):
    p_node, c_node, _, _ = build_history(tree)
    alloc = tree.token_to_kv_pool_allocator
    other = alloc.alloc(4).to(torch.int64)
    node, dup = tree._insert_compressed(p_node, key(range(10, 30)), other, 0, "fp-b")
    assert not dup and node is not c_node and len(node.value) == 4
    assert tree.match(key([*range(30), 5]), "fp-b").last_device_node is node
    assert tree.match(key([*range(30), 5]), FP).last_device_node is c_node
    assert tree.evictable_size() == 10 + 8 + 5 + 4
    tree.evict(EvictParams(num_tokens=1000))
    assert alloc.available_size() == POOL


def test_uncompressed_copy_wins_for_other_configs_even_when_shorter(tree):
    """A `none` request must get the full KV of the tokens it shares, never the lossy copy."""
    p_node, c_node, _, _ = build_history(tree)
    alloc = tree.token_to_kv_pool_allocator
    full = torch.cat([tree.path_device_indices(p_node), alloc.alloc(20).to(torch.int64)])
    tree.insert(InsertParams(key=key(range(30)), value=full))
    res = tree.match(key([*range(30), 1]), None)
    assert res.device_prefix_len == 30 and res.cache_protected_len is None
    assert not is_compressed(res.last_device_node)
    assert torch.equal(tree.path_device_indices(res.last_device_node), full)
    # on a tie even the producer's config takes the full copy (a repeat runs as its first run did)...
    assert tree.match(key([*range(30), 1]), FP).last_device_node is res.last_device_node
    # ...and the compressed history where it reaches further
    assert tree.match(key([*range(32), 1]), FP).last_device_node.parent is c_node


# ---- branch scope: where a request's own region starts ---------------------------------------------
def branch_req(scope: str = "branch", shared_prefix: int = 0):
    from types import SimpleNamespace

    from sgl_kvevict.cache import state as st
    from sgl_kvevict.cache.context import KvEvictContext

    kv = {"policy": "snapkv", "budget": 8, "config": {"scope": scope, "shared_prefix": shared_prefix}}
    req = SimpleNamespace(rid="r", lock=None, sampling_params=SimpleNamespace(custom_params={"kvevict": kv}))
    return req, st.ensure(req, KvEvictContext())


def two_nodes(t: KvEvictRadixCache):
    alloc = t.token_to_kv_pool_allocator
    t.insert(InsertParams(key=key(range(10)), value=alloc.alloc(10).to(torch.int64)))
    t.insert(
        InsertParams(
            key=key(range(30)),
            value=torch.cat(
                [
                    t.path_device_indices(t.match(key(range(10)), None).last_device_node),
                    alloc.alloc(20).to(torch.int64),
                ]
            ),
        )
    )
    a = t.match(key(range(10)), None).last_device_node
    return a, t.match(key(range(30)), None).last_device_node


def test_branch_region_starts_at_the_root_of_an_unshared_history(tree):
    two_nodes(tree)
    req, s = branch_req()
    tree.match(key([*range(30), 7]), s.fp, req)
    assert s.slot_map.anchor is tree.root_node and (
        s.slot_map.anchor_tokens,
        s.slot_map.anchor_kv,
        s.slot_map.offset,
    ) == (0, 0, 0)
    req, s = branch_req("request")
    tree.match(key([*range(30), 7]), s.fp, req)
    assert s.slot_map.anchor_tokens == 30  # request scope: only the new tokens


def test_branch_region_starts_after_what_others_hold_or_declared_shared(tree):
    a, b = two_nodes(tree)
    lock = tree.lock(a)  # another running request holds the first 10 tokens
    req, s = branch_req()
    tree.match(key([*range(30), 7]), s.fp, req)
    assert s.slot_map.anchor is a and s.slot_map.anchor_tokens == 10
    tree.unlock(lock)
    req.lock = tree.lock(b)  # the request's own lock (a chunked prefill re-matched) is not "another"
    tree.match(key([*range(30), 7]), s.fp, req)
    assert s.slot_map.anchor is tree.root_node
    tree.unlock(req.lock)
    req, s = branch_req(shared_prefix=4)  # a declared shared prefix splits the node it cuts
    tree.match(key([*range(30), 7]), s.fp, req)
    assert (
        s.slot_map.anchor_tokens == 4
        and len(s.slot_map.anchor.key) == 4
        and s.slot_map.anchor.parent is tree.root_node
    )


def test_branch_region_adopts_the_branch_compressed_history(tree):
    req, s = branch_req()
    alloc = tree.token_to_kv_pool_allocator
    tree.insert(InsertParams(key=key(range(10)), value=alloc.alloc(10).to(torch.int64)))
    p_node = tree.match(key(range(10)), None).last_device_node
    c_node, _ = tree._insert_compressed(p_node, key(range(10, 30)), alloc.alloc(8).to(torch.int64), 0, s.fp)
    c_node.layer_state = [{"carried": torch.ones(3, 8), "tau": torch.zeros(3)}]
    tree._insert_helper(c_node, key(range(30, 35)), alloc.alloc(5).to(torch.int64), 0, 0)
    tree.match(key([*range(35), 1]), s.fp, req)
    # the compressed node is the region's first node: its slots and evictions become the request's own
    assert s.slot_map.anchor is p_node and s.slot_map.anchor_tokens == 10
    assert (s.slot_map.comp_slots, s.slot_map.comp_tokens, s.slot_map.own_evicted, s.slot_map.offset) == (
        8,
        20,
        12,
        12,
    )
    assert torch.equal(s.policy_state.layers[0]["carried"], torch.ones(3, 8))
    assert s.policy_state.layers[0]["carried"] is not c_node.layer_state[0]["carried"]  # a copy
    assert s.slot_map.reused_evicted == 12 and s.slot_map.inherited_evicted == 12


def _events_tree(radix_cls):
    r2t = ReqToTokenPool(8, 256, "cpu", False)
    kv = MHATokenToKVPool(POOL, 1, torch.bfloat16, 3, 64, 2, "cpu", False)
    alloc = TokenToKVPoolAllocator(POOL, torch.bfloat16, "cpu", kv, False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=r2t,
        token_to_kv_pool_allocator=alloc,
        page_size=1,
        enable_kv_cache_events=True,
    )
    return (
        radix_cls(params, r2t.req_to_token.shape[0]) if radix_cls is KvEvictRadixCache else radix_cls(params)
    )


def test_kv_events_cover_compressed_nodes_and_add_up_to_slots():
    import msgspec
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sgl_kvevict.cache.events import event_slots

    t = _events_tree(KvEvictRadixCache)
    _, c_node, _, _ = build_history(t)
    stored = t.take_events()
    assert all(isinstance(e, BlockStored) for e in stored)
    comp = [e for e in stored if getattr(e, "kv_slots", None) is not None]
    assert len(comp) == 1 and comp[0].kv_slots == len(c_node.value) == 8  # the compressed node, its slots
    assert comp[0].token_ids == list(range(10, 30)) and len(comp[0].block_hashes) == 20
    # Every event together: the slots the tree holds (P 10 + C 8 + tail 5), as the allocator sees them.
    assert sum(event_slots(e) for e in stored) == t.evictable_size() == 23
    assert sum(len(e.token_ids) for e in stored) == 35
    # The hashes are the ones SGLang's own tree publishes for the same 35 tokens, chained in order.
    plain = _events_tree(RadixCache)
    plain.insert(
        InsertParams(key=key(range(35)), value=plain.token_to_kv_pool_allocator.alloc(35).to(torch.int64))
    )
    ref = [h for e in plain.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert [h for e in stored for h in e.block_hashes] == ref
    assert comp[0].parent_block_hash == ref[9] and stored[-1].parent_block_hash == ref[29]
    # On the wire it is SGLang's BlockStored (same tag) with one extra optional field.
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=stored))
    decoded = msgspec.msgpack.decode(wire, type=KVEventBatch).events
    assert [type(e) for e in decoded] == [BlockStored] * len(stored)
    raw = msgspec.msgpack.decode(wire)[1]
    assert [e.get("kv_slots") for e in raw] == [None, 8, None] and {e["type"] for e in raw} == {"BlockStored"}
    # Eviction reports every node, compressed included, and frees the same slots.
    t.evict(EvictParams(num_tokens=1000))
    removed = t.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sum(event_slots(e) for e in removed) == 23
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(ref)
    assert [e.kv_slots for e in removed if getattr(e, "kv_slots", None) is not None] == [8]
