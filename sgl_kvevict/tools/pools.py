"""SGLang's real KV pools, request rows and radix cache, without a server: for the engine benchmark and
the test that keeps the compression step free of host synchronisation.

Everything here is SGLang's own classes (`MHATokenToKVPool`, `ReqToTokenPool`, `TokenToKVPoolAllocator`,
this plugin's `KvEvictRadixCache`); only the scheduler is absent, so a batch of decoding requests is
built by hand: each request holds an own (not tree-shared) region of `n` tokens with random K/V, and,
for attention-based policies, a full window of captured queries.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from sgl_kvevict.cache import capture
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.runtime import Runtime, Totals
from sgl_kvevict.cache.syncs import SyncCounter

__all__ = ["Pools", "SyncCounter"]


def runtime_for(tree: Any, alloc: Any, kv: Any, q_heads: int, o_proj: dict[int, torch.Tensor]) -> Runtime:
    """The plugin's `Runtime` over pools built by hand (no model runner): shapes from the KV pool,
    `o_proj` as `[q_heads, head_dim, hidden]` per layer."""
    rt = object.__new__(Runtime)
    rt.tree, rt.req_to_token, rt.allocator, rt.kv_pool = tree, tree.req_to_token_pool.req_to_token, alloc, kv
    rt.model, rt.metrics, rt.forward_stream = None, None, None
    rt.n_layers, rt.n_q_heads, rt.n_kv_heads, rt.head_dim = kv.layer_num, q_heads, kv.head_num, kv.head_dim
    rt.scale, rt.start_layer, rt.tp_size, rt.totals = 1 / math.sqrt(kv.head_dim), 0, 1, Totals()
    rt._o_proj = o_proj
    return rt


class Pools:
    """One rank's real pools and tree, its runtime in the tree's context (`tree.ctx`), sized for `max_reqs` rows of `max_len`."""

    def __init__(
        self,
        layers: int = 30,
        kv_heads: int = 2,
        group: int = 4,
        head_dim: int = 64,
        max_reqs: int = 64,
        max_len: int = 1024,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from sgl_kvevict.cache.tree import KvEvictRadixCache

        size = max_reqs * max_len
        self.layers, self.kv_heads, self.q_heads, self.head_dim = layers, kv_heads, kv_heads * group, head_dim
        self.r2t = ReqToTokenPool(max_reqs, max_len, "cpu", False)
        self.kv = MHATokenToKVPool(size, 1, dtype, kv_heads, head_dim, layers, "cpu", False)
        self.alloc = TokenToKVPoolAllocator(size, dtype, "cpu", self.kv, False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=1
        )
        self.tree = KvEvictRadixCache(params, max_reqs)
        g = torch.Generator().manual_seed(seed)
        for layer in range(layers):  # random K/V everywhere once; compaction only moves rows around
            self.kv.get_key_buffer(layer).copy_(torch.randn(size + 1, kv_heads, head_dim, generator=g))
            self.kv.get_value_buffer(layer).copy_(torch.randn(size + 1, kv_heads, head_dim, generator=g))
        w_o = torch.randn(self.q_heads, head_dim, 128, generator=g)
        self.rt = runtime_for(self.tree, self.alloc, self.kv, self.q_heads, dict.fromkeys(range(layers), w_o))
        self.gen = g
        # every row may capture, with a window of up to 64 queries (the tests' and benchmarks' largest)
        self.store = capture.Store(max_reqs + 1, layers, 64, self.q_heads, head_dim, max_reqs, dtype, "cpu")
        self.ctx = self.tree.ctx
        self.ctx.rt = self.rt

    def batch(self, n_reqs: int, n_tokens: int, policy: str, budget: Any, config: dict | None = None) -> Any:
        """A fresh decode batch of `n_reqs` requests, each holding an own region of `n_tokens` slots (the
        previous batch's slots and rings are dropped first). Returns an object with SGLang's
        `ScheduleBatch` fields the compression hook reads (`reqs`, `seq_lens`, `seq_lens_cpu`)."""
        from sgl_kvevict.cache.tree import Region

        self.ctx.rt = self.rt
        self.alloc.clear()
        self.r2t.req_to_token.zero_()
        self.store.clear()
        self.ctx.capture, self.ctx.capture_conf = self.store, (self.store.window, self.store.slots)
        self.tree.offsets.zero_()
        slots = self.alloc.alloc(n_reqs * n_tokens).view(n_reqs, n_tokens)
        reqs = []
        for i in range(n_reqs):
            req = SimpleNamespace(
                rid=f"bench-{i}",
                kv=_kv_info(),
                sampling_params=SimpleNamespace(
                    custom_params={"kvevict": {"policy": policy, "budget": budget, "config": config or {}}},
                    max_new_tokens=64,
                ),
                extra_key=None,
                cache_salt=None,
                priority=0,
                origin_input_ids=list(range(n_tokens)),
                full_untruncated_fill_ids=list(range(n_tokens)),
                lock=self.tree.lock(self.tree.root_node),
                last_node=self.tree.root_node,
                finished=lambda: False,
            )
            req.kv.req_pool_idx = i
            self.r2t.req_to_token[i, :n_tokens] = slots[i].to(torch.int32)
            req.kv.kv_committed_len = req.kv.kv_allocated_len = n_tokens
            s = st.ensure(req, self.ctx)
            st.on_match(req, self.ctx, Region(self.tree.root_node, 0, 0, None))
            if "attn" in s.policy.needs:
                w = s.policy.config.window
                assert capture.ensure(self.ctx, i, w, 0)
                q = torch.randn(self.layers, w, self.q_heads, self.head_dim, generator=self.gen)
                pos = torch.arange(n_tokens - w, n_tokens)
                for layer in range(self.layers):
                    self.store.put(i, layer, q[layer], pos)
            reqs.append(req)
        lens = torch.full((n_reqs,), n_tokens, dtype=torch.int64)
        return SimpleNamespace(
            reqs=reqs,
            seq_lens=lens.clone(),
            seq_lens_cpu=lens.clone(),
            orig_seq_lens=None,
            tree_cache=self.tree,
        )


def _kv_info() -> Any:
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    return ReqKvInfo()
