"""The compressing radix cache: SGLang's `RadixCache` plus *compressed nodes*.

A compressed node holds a finished request's compacted history: its key is the full token ids it
covers, its value the (fewer) slots that survived compression. Three rules keep the tree honest:

- Atomic: a lookup enters a compressed node only when it matches *all* of its tokens; it is never
  split. Its uncompressed tail (the recent window) is an ordinary child node, which splits as usual.
- Separate keys: compressed children live in `children` under a per-node unique key, so SGLang's own
  insert/match code never walks into them, and a compressed and an uncompressed copy of the same
  tokens can coexist.
- Isolated: each compressed node carries the fingerprint of the config that produced it (policy,
  budget, policy config; `state.fingerprint`). A lookup enters it only for a request with the same
  fingerprint; every other request (and SGLang's own re-matches, which carry no request) sees only
  uncompressed KV. This is the same namespacing SGLang applies with `RadixKey.extra_key`, one level
  finer: a `none` request never reads lossy KV, and one tenant's budget never degrades another's prefix.
- Slots, not tokens, are counted: evictable/protected sizes use `len(node.value)`, which is what the
  idle memory check compares with the allocator.

A match that passes through a compressed node returns `device_prefix_len` in *tokens* (SGLang slices
fill ids with it) and `cache_protected_len` in *slots*; the difference is the request's position offset,
kept in its `ReqState` (see `state.py`) and applied by the hooks in `hooks.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_kvevict.cache import context, events
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import host
from sgl_kvevict.cache.nodes import CompressedNode, is_compressed

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger("sgl_kvevict")


class _Compressed:
    """Marker in a compressed child's dict key: (MARK, node id) never equals a token child key."""

    def __repr__(self) -> str:
        return "COMPRESSED"


MARK = _Compressed()
BRANCH_MIN = 16  # a child off the matched path with this many tokens is another branch (see _branch_start)


@dataclass
class Region:
    """Where a matched request's own region starts: after `anchor` (the branch point), reached by
    `anchor_tokens` tokens in `anchor_kv` slots; `first` is the region's first tree node, if any; the
    whole match covers `tokens` tokens in `kv` slots."""

    anchor: TreeNode
    anchor_tokens: int
    anchor_kv: int
    first: TreeNode | None
    tokens: int = 0
    kv: int = 0


class KvEvictRadixCache(RadixCache):
    """RadixCache that also stores and matches compressed request histories."""

    def __init__(self, params: Any, rows: int) -> None:
        # Nodes of a committed prefix (see `_mark_shared`): any node, SGLang's plain ones included, so a
        # set the tree owns rather than a field; it follows splits and deletions (`shared_leaks`).
        self.shared: set[TreeNode] = set()
        super().__init__(params)
        self.kv_events = events.KvEvictEventRecorder.replacing(self.kv_events)  # + compressed nodes
        # This server's state beyond the tree (runtime, host tier, capture, statistic, settings): the
        # one registered for its request-row pool, which a warm-up forward may have created already.
        self.ctx = context.for_pool(params.req_to_token_pool)
        # Logical-position offset of each request row (evicted tokens before its next token).
        self.offsets = torch.zeros(rows, dtype=torch.int64, device=self.device)
        # Called with each released request before its state is dropped: the serving side reports the
        # request's numbers there (a callback, so the cache never imports the serving side).
        self.release_report: Callable[[context.KvEvictContext, Req], None] | None = None

    def reset(self) -> None:
        """`/flush_cache`: the tree empties, and the C heap's free memory goes back to the OS."""
        stack = list(self.root_node.children.values()) if hasattr(self, "root_node") else []
        while stack:  # every compressed node's host entries go back to the host pool
            node = stack.pop()
            if is_compressed(node):
                host.release(self.ctx.host, node.host_entries)
                node.host_entries = None
            stack.extend(node.children.values())
        self.shared.clear()
        super().reset()
        if hasattr(self, "ctx") and self.ctx.rt is not None:  # SGLang's __init__ calls reset() first
            from sgl_kvevict.cache import runtime

            self.ctx.rt.totals.heap_mib_trimmed += runtime.trim_heap()

    # ---- sizes count slots ------------------------------------------------------------------------
    # SGLang's own lock methods move a node between evictable and protected as `len(node.key)` tokens;
    # here sizes are slots (`len(node.value)`, fewer than tokens in a compressed node), which is what
    # SGLang's idle memory check compares with the allocator. Its methods run as they are, and the
    # difference is corrected for the nodes whose lock they flip.
    def inc_lock_ref(self, node: TreeNode):
        extra = self._slots_over_tokens(node, lock_ref=0)
        return self._in_slots(super().inc_lock_ref(node), extra, protect=True)

    def dec_lock_ref(self, node: TreeNode, params: Any = None):
        extra = self._slots_over_tokens(node, lock_ref=1)
        return self._in_slots(super().dec_lock_ref(node, params), extra, protect=False)

    def _slots_over_tokens(self, node: TreeNode, lock_ref: int) -> int:
        """Slots minus tokens over the nodes from `node` up whose lock count is `lock_ref` (those a lock
        change moves between evictable and protected); 0 where every node holds a slot per token."""
        extra = 0
        while not self.disable and node != self.root_node:
            if node.lock_ref == lock_ref:
                extra += len(node.value) - len(node.key)
            node = node.parent
        return extra

    def _in_slots(self, result: Any, extra: int, protect: bool) -> Any:
        """SGLang's lock result and sizes, with `extra` (slots minus tokens of the flipped nodes) added."""
        if extra:
            moved = extra if protect else -extra
            self.evictable_size_ -= moved
            self.protected_size_ += moved
            result.delta -= moved
        return result

    def _delete_leaf(self, node: TreeNode) -> None:
        key = (MARK, node.id) if is_compressed(node) else node.key.child_key(self.page_size)
        v = node.parent.children.pop(key, None)
        assert v is node, f"parent does not hold child {key}"
        self.evictable_size_ -= len(node.value)
        self.evictable_leaves.discard(node)
        self._update_leaf_status(node.parent)
        self.shared.discard(node)
        if is_compressed(node):  # its host entries go with it
            host.release(self.ctx.host, node.host_entries)
            node.host_entries = None

    def take_leaves(self, nodes: list[TreeNode]) -> None:
        """Take `nodes` out of the tree, bottom-up (each a leaf once those below it are gone), keeping
        their slots: the caller (a compression taking back what only its request holds) now owns them."""
        for node in nodes:
            self._delete_leaf(node)

    # ---- match --------------------------------------------------------------------------------------
    def _compressed_children(self, node: TreeNode, first: Any) -> list[TreeNode]:
        return [
            c
            for k, c in node.children.items()
            if isinstance(k, tuple) and k and k[0] is MARK and c.key.child_key(self.page_size) == first
        ]

    def _candidates(self, node: TreeNode, key: RadixKey, fp: str | None) -> list[tuple[TreeNode, int]]:
        """Children a lookup may enter, with the tokens each matches: the token child (any prefix of it)
        and the compressed children of the same fingerprint whose whole key matches."""
        ck = key.child_key(self.page_size)
        out: list[tuple[TreeNode, int]] = []
        normal = node.children.get(ck)
        if normal is not None:
            m = normal.key.match(key, page_size=self.page_size)
            if m > 0:
                out.append((normal, m))
        if fp is not None:
            for c in self._compressed_children(node, ck):
                if c.fp == fp and len(c.key) <= len(key) and c.key.match(key) == len(c.key):
                    out.append((c, len(c.key)))
        return out

    def _reach(self, node: TreeNode, key: RadixKey, fp: str | None) -> int:
        """Tokens the best path below `node` matches (dry run: nothing is split)."""
        best = 0
        for child, m in self._candidates(node, key, fp) if len(key) else ():
            if m == len(child.key) and m < len(key):
                m += self._reach(child, key[m:], fp)
            best = max(best, m)
        return best

    def _walk(self, key: RadixKey, fp: str | None) -> tuple[list[TreeNode], TreeNode, int]:
        """Longest match for a request of fingerprint `fp`; returns (path nodes, last node, tokens).

        At each step the child whose path reaches furthest wins; on a tie the uncompressed child, then
        the shorter compressed one: a repeated request (or session) then runs exactly as its first run
        did while that KV is cached, and compresses to the same histories; a longer compressed history
        is taken only where it reaches further (the next turn of a conversation). Only a request of the same fingerprint sees a
        compressed child at all.
        """
        now = time.monotonic()
        node = self.root_node
        node.last_access_time = now
        path: list[TreeNode] = []
        tokens = 0
        while len(key) > 0:
            best, best_m, best_rank = None, 0, (-1, 0)
            for child, m in self._candidates(node, key, fp):
                reach = m + (self._reach(child, key[m:], fp) if m == len(child.key) and m < len(key) else 0)
                rank = (reach, -m if is_compressed(child) else 0)
                if rank > best_rank:
                    best, best_m, best_rank = child, m, rank
            if best is None:
                break
            best.last_access_time = now
            if best_m < len(best.key):  # ends inside a token node: split it, as SGLang does
                new_node = self._split_node(best.key, best, best_m)
                path.append(new_node)
                tokens += best_m
                node = new_node
                break
            path.append(best)
            tokens += best_m
            node = best
            key = key[best_m:]
        return path, node, tokens

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        s = st.ensure(params.req, self.ctx) if params.req is not None else None
        return self.match(params.key, s.fp if s is not None else None, params.req)

    def match(self, key: RadixKey, fp: str | None, req: Req | None = None) -> MatchResult:
        """Longest match as seen by a request of fingerprint `fp` (None: uncompressed KV only)."""
        key, _ = key.maybe_to_bigram_view(self.is_eagle)
        if self.disable or len(key) == 0:
            return self._empty_match_result
        path, node, tokens = self._walk(key, fp)
        kv = sum(len(n.value) for n in path)
        if req is not None:
            s = st.get(req)
            cut = self._branch_start(path, s.policy.config, req) if s.cfg.active else len(path)
            anchor = path[cut - 1] if cut > 0 else self.root_node
            st.on_match(
                req,
                self.ctx,
                Region(
                    anchor=anchor,
                    anchor_tokens=sum(len(n.key) for n in path[:cut]),
                    anchor_kv=sum(len(n.value) for n in path[:cut]),
                    first=path[cut] if cut < len(path) else None,
                    tokens=tokens,
                    kv=kv,
                ),
                self._path_positions(path) if st.tracks_positions(self.ctx) else None,
            )
            if st.DEBUG:  # the shared prefix before the branch point: compression must never change it
                s.trace.digest_kv = s.slot_map.anchor_kv
                s.trace.prefix_digest = self.prefix_digest(
                    self.path_device_indices(node)[: s.slot_map.anchor_kv]
                )
        if tokens == kv:
            return MatchResult(
                device_prefix_len=kv, last_device_node=node, last_host_node=node, best_match_node=node
            )
        return MatchResult(
            device_prefix_len=tokens,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            cache_protected_len=kv,
        )

    def _branch_start(self, path: list[TreeNode], cfg: Any, req: Req | None = None) -> int:
        """Index in `path` of the first node of the request's own region (`len(path)`: none of it).

        Request scope: the region is the new tokens only. Branch scope: everything after the deepest
        shared node, where shared means declared shared (a committed prefix, see `_mark_shared`), held
        by another running request (a `lock_ref` beyond the
        request's own lock, which a chunked prefill holds on its earlier chunks when it is matched
        again) or inside the declared
        `shared_prefix` (a normal node it cuts is split there), or with another branch below it (a
        child off the path with `BRANCH_MIN` tokens or more: another session on the same system
        prompt). Shorter children are not branches: a chat template that re-renders the end of a turn
        leaves such a stale remainder at every turn, and counting it would stop a session from ever
        re-compressing. The own region may
        start with one compressed node (the branch's history) and then holds only normal nodes; a
        later compressed node (another config's or scope's layout) moves the start to it.
        """
        if cfg.scope != "branch":
            return len(path)
        s = st.get(req) if req is not None else None
        keep = s is not None and s.recall_on
        start = self.last_shared(path, 0, cfg.shared_prefix, req, branches=True, keep_history=keep) + 1
        for i in range(len(path) - 1, start, -1):
            if is_compressed(path[i]):
                return i
        return start

    def last_shared(
        self,
        path: list[TreeNode],
        tokens: int,
        shared_prefix: int,
        req: Req | None,
        branches: bool,
        keep_history: bool = False,
    ) -> int:
        """The branch-point rule, in one place: index in `path` (tree nodes, top-down, the first reached
        after `tokens` tokens) of the deepest node the request must treat as shared, -1 when none.

        Shared: held by another running request (a `lock_ref` beyond the request's own lock), inside the
        declared `shared_prefix` (a normal node it cuts is split there, in `path` too), or a compressed
        node that starts inside it. With `branches` (at admission), also a node declared shared (a
        committed prefix, see `_mark_shared`) or with another branch below it (see `_branch_start`); at
        a compression check (`compressor`) the path is the request's own locked chain and those two do
        not apply.

        With `keep_history` (a request with recall on) the branch's stored history, the deepest compressed
        node on the path, and what follows it are shared only through the declared `shared_prefix`: a
        fork sibling that finds it held by another branch, or with other branches below, adopts it all
        the same (copied into its own slots before anything is written, its host entries copied), so
        that it can recall what the history evicted."""
        mine = self._locked_by(req)
        hist = next((n for n in reversed(path) if is_compressed(n)), None) if keep_history else None
        own = False  # past the history: only the declared prefix makes a node shared
        cut, i = -1, 0
        while i < len(path):
            n, start = path[i], tokens
            own = own or n is hist
            if start < shared_prefix < start + len(n.key) and not is_compressed(n):
                path[i : i + 1] = [self._split_node(n.key, n, shared_prefix - start), n]
                mine = self._locked_by(req)  # the new top node sits on the request's lock path too
                continue
            tokens += len(n.key)
            nxt = path[i + 1] if i + 1 < len(path) else None
            if (
                (not own and n.lock_ref > (id(n) in mine))
                or tokens <= shared_prefix
                or (is_compressed(n) and start < shared_prefix)
                or (
                    not own
                    and branches
                    and (
                        n in self.shared
                        or any(
                            c is not nxt and (len(c.key) >= BRANCH_MIN or c.children)
                            for c in n.children.values()
                        )
                    )
                )
            ):
                cut = i
            i += 1
        return cut

    def _locked_by(self, req: Req | None) -> set[int]:
        """Ids of the nodes the request's own tree lock holds."""
        mine = set()
        node = req.lock.node if req is not None and getattr(req, "lock", None) is not None else None
        while node is not None and node is not self.root_node:
            mine.add(id(node))
            node = node.parent
        return mine

    def _path_positions(self, path: list[TreeNode]) -> torch.Tensor | None:
        """`[L, H, slots]` logical positions held along a matched path (where tracked)."""
        rt = self.ctx.rt
        if rt is None:
            return None
        parts, t = [], 0
        for n in path:
            pos = n.positions if is_compressed(n) else None
            if pos is None:
                pos = torch.arange(t, t + len(n.value)).view(1, 1, -1).expand(rt.n_layers, rt.n_kv_heads, -1)
            parts.append(pos)
            t += len(n.key)
        if not parts:
            return torch.zeros(rt.n_layers, rt.n_kv_heads, 0, dtype=torch.int64)
        return torch.cat(parts, dim=-1)

    def prefix_digest(self, slots: torch.Tensor) -> str:
        """SHA-1 of the K/V rows of `slots` in every layer (debug: proves a shared prefix is untouched)."""
        import hashlib

        h = hashlib.sha1()
        rt = self.ctx.rt
        if rt is None or slots.numel() == 0:
            return ""
        for layer in range(rt.n_layers):
            for buf in (rt.k_buffer(layer), rt.v_buffer(layer)):
                h.update(buf[slots.to(torch.int64)].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        # The hooks lower prefix_len to slots around allocation; the whole path is the prefix.
        path = self.path_device_indices(req.last_node)
        return path[: req.prefix_len]

    # ---- insert -------------------------------------------------------------------------------------
    def _stored_history(self, parent: TreeNode, key: RadixKey, fp: str) -> TreeNode | None:
        """The compressed child of `parent` with exactly these tokens and this fingerprint, if stored."""
        for c in self._compressed_children(parent, key.child_key(self.page_size)):
            if c.fp == fp and len(c.key) == len(key) and c.key.match(key) == len(key):
                return c
        return None

    def _insert_compressed(
        self,
        parent: TreeNode,
        key: RadixKey,
        value: torch.Tensor,
        priority: int,
        fp: str,
        positions: torch.Tensor | None = None,
    ) -> tuple[TreeNode, bool] | None:
        """Hang a compressed node of fingerprint `fp` under `parent`. Returns (node, duplicate) or None
        if it cannot go in (the same tokens, same fingerprint, another slot count)."""
        c = self._stored_history(parent, key, fp)
        if c is not None:
            return (c, True) if len(c.value) == len(value) else None
        # debug only: the logical positions each (layer, head) slot holds
        node = CompressedNode(priority, fp, positions.clone() if positions is not None else None)
        node.parent = parent
        node.key = key
        node.value = value.clone()
        parent.children[(MARK, node.id)] = node
        self.evictable_size_ += len(value)
        self._update_leaf_status(parent)
        self._update_leaf_status(node)
        self.kv_events.record_store(node)
        return node, False

    def checkpoint(self, req: Req, *, up_to: int) -> None:
        s = st.get(req)
        if self.disable or s is None or s.slot_map.offset == 0:
            super().checkpoint(req, up_to=up_to)  # its re-match carries no request: normal only
            if s is not None and s.commit and req.finished():
                self._mark_shared(req.last_node)
            return
        # release_kv_cache passes a slot count (owned_kv_len); a running request's checkpoint its extend_end.
        kv_end = up_to if req.finished() or s.releasing else s.slot_map.slots_for(up_to)
        tokens_end = s.slot_map.tokens_for(kv_end)
        token_ids = req.full_untruncated_fill_ids[:tokens_end]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        priority = req.priority or 0
        node, kpos, tpos = s.slot_map.anchor, s.slot_map.anchor_kv, s.slot_map.anchor_tokens
        if node is None:
            node = self.root_node
        to_free: list[torch.Tensor] = []

        def rkey(a: int, b: int) -> RadixKey:
            return RadixKey(token_ids[a:b], req.extra_key, cache_salt=req.cache_salt)

        if (
            s.slot_map.comp_tokens > 0
            and s.recall.changed_history
            and self._stored_history(node, rkey(tpos, tpos + s.slot_map.comp_tokens), s.fp) is not None
        ):
            # a recall changed the adopted history in place: the node stored with its tokens holds what
            # it was before, so it is no duplicate of this one; the request keeps its own copy (and its
            # host entries), and the node stays as it was
            self.relock(req, node, kpos)
            return
        if s.slot_map.comp_tokens > 0:  # (may hold 0 slots: e.g. streaming keeps only the newest tokens)
            cval = row[kpos : kpos + s.slot_map.comp_slots].to(torch.int64)
            cpos = (
                st.row_positions(s, kpos + s.slot_map.comp_slots)[..., kpos:]
                if st.tracks_positions(self.ctx)
                else None
            )
            res = self._insert_compressed(
                node, rkey(tpos, tpos + s.slot_map.comp_tokens), cval, priority, s.fp, cpos
            )
            if res is None:  # a different history with the same tokens is stored: keep it, free ours
                s.recall.drop_host(s.ctx.host)
                self.relock(req, node, kpos)
                return
            cnode, dup = res
            if not dup:  # the policy's per-head state continues in the branch's next turn
                cnode.layer_state = st.copy_layer_state(s.policy_state.layers, s.slot_map.comp_slots)
            if req.finished() or s.releasing:
                self._hand_over_host(s, cnode)
            if dup:  # free our copy, never slots the tree owns (an adopted branch history is the node itself)
                own = (
                    torch.arange(kpos, kpos + s.slot_map.comp_slots, device=row.device)
                    >= req.kv.cache_protected_len
                )
                mask = (cnode.value != cval) & own
                if mask.any():
                    to_free.append(cval[mask].clone())
                row[kpos : kpos + s.slot_map.comp_slots] = cnode.value.to(row.dtype)
            node, kpos, tpos = cnode, kpos + s.slot_map.comp_slots, tpos + s.slot_map.comp_tokens
        if tokens_end > tpos:
            tval = row[kpos:kv_end].to(torch.int64)
            _, last = self._insert_helper(node, rkey(tpos, tokens_end), tval.clone(), priority, 0)
            tree_vals = self._path_between(node, last)
            own = torch.arange(kpos, kv_end, device=row.device) >= req.kv.cache_protected_len
            dup_mask = (tree_vals != tval) & own
            if dup_mask.any():
                to_free.append(tval[dup_mask])
            row[kpos:kv_end] = tree_vals.to(row.dtype)
            node = last
        for t in to_free:
            self.token_to_kv_pool_allocator.free(t)
        self.relock(req, node, kv_end)

    @staticmethod
    def _hand_over_host(s: st.ReqState, cnode: CompressedNode) -> None:
        """A stored history owns the host entries of the request that produced it (they move). A
        duplicate node keeps its own; the request's go back to the pool."""
        mine = s.recall.host
        s.recall.host = None
        if mine is None:
            return
        held = cnode.host_entries
        if held is not None and held is not mine and held.count:
            host.release(s.ctx.host, mine)
            return
        cnode.host_entries = mine
        mine.fork_branch = s.recall.continued_fork  # rarely continued: the host pool's first room
        if s.ctx.host is not None:
            s.ctx.host.touch(mine)

    def _mark_shared(self, node: TreeNode) -> None:
        """A committed prefix (a request that generates nothing, as SGLang's frontend sends before `fork`)
        is declared shared: branch scope never compresses it."""
        while node is not None and node is not self.root_node:
            self.shared.add(node)
            node = node.parent

    def _print_helper(self, node: TreeNode, indent: int) -> None:
        """SGLang prints the tree on out-of-memory; a compressed child sits under its own key, and a
        printer that asserted the usual key there would turn the report into a crash."""
        stack = [(node, indent)]
        while stack:
            cur, ind = stack.pop()
            note = f" compressed: {len(cur.value)} slots" if is_compressed(cur) else ""
            print(" " * ind, len(cur.key), cur.key.token_ids[:10], f"r={cur.lock_ref}{note}")
            stack.extend((child, ind + 2) for child in cur.children.values())

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        assert not is_compressed(child), "a compressed node is matched whole, never split"
        new = super()._split_node(key, child, split_len)
        if child in self.shared:  # the new top part is as shared as the node it came from
            self.shared.add(new)
        return new

    def shared_leaks(self) -> list[TreeNode]:
        """Nodes `shared` still holds that are no longer in the tree (none: it follows every split,
        deletion and reset)."""
        live, stack = set(), [self.root_node]
        while stack:
            node = stack.pop()
            live.add(node)
            stack.extend(node.children.values())
        return [n for n in self.shared if n not in live]

    def _path_between(self, top: TreeNode, bottom: TreeNode) -> torch.Tensor:
        vals = []
        while bottom is not top:
            vals.append(bottom.value)
            bottom = bottom.parent
        vals.reverse()
        return torch.cat(vals) if vals else self._empty_device_indices

    def relock(self, req: Req, node: TreeNode, protected: int) -> None:
        """Move the request's tree lock to `node`; the tree owns its row up to `protected`."""
        req.kv.cache_protected_len = protected
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        from sgl_kvevict.cache import capture

        row = req.kv.req_pool_idx
        if row is not None:
            self.offsets[row] = 0
            if self.ctx.host is not None:
                self.ctx.host.in_use.pop(row, None)
            capture.drop(self.ctx, row)
        s = st.get(req)
        if s is not None:
            s.pending = None  # a plan over slots the request gives up is never committed
            s.recall.end_borrow(self.ctx.host)  # a retraction too: its checkpoint stores what it holds
            s.recall.leave()  # no longer a running branch of the history it adopted
        if s is not None and not req.finished():
            return  # retraction: the request comes back, with its counters, failure flag and policy state
        if st.DEBUG and s is not None and s.slot_map.anchor is not None:
            s.trace.prefix_digest_end = self.prefix_digest(
                self.req_to_token_pool.req_to_token[row, : s.trace.digest_kv]
                if row is not None
                else self._empty_device_indices
            )
        if self.release_report is not None:
            try:
                self.release_report(self.ctx, req)
            except Exception:
                logger.exception("kvevict: could not report stats for request %s", req.rid)
        if s is not None:  # host entries no stored history took
            s.recall.drop_host(s.ctx.host)
        st.drop(req)
