"""KV events for the compressing tree, in SGLang's schema (`BlockStored` / `BlockRemoved`).

SGLang's tree reports every node it stores or evicts (`--kv-events-config`), so a KV-aware router can
follow each worker's cache. The compressing tree reports its compressed nodes the same way:

- Hashes and tokens are exactly those SGLang would publish for the node's tokens (one block per page,
  chained to the parent's last block), so a consumer that follows token hashes sees that this worker
  can serve the prefix; it can, since a request matching all of the node's tokens reuses it.
- A compressed node holds fewer KV slots than tokens. Its events carry that count in one added
  optional field, `kv_slots`; the event tag stays `BlockStored`/`BlockRemoved`, and SGLang's event
  structs omit unset optional fields, so ordinary events are byte-for-byte SGLang's and a consumer
  that does not know the field ignores it. Ordinary blocks hold `block_size` slots each.
- A compressed node is atomic (matched whole or not at all): its store is one event that is never
  coalesced with its neighbours, so a consumer can treat its hashes as one unit.

Known gap: the tree may hold a compressed and an uncompressed copy of the same tokens at once; their
hashes are equal, so a consumer that does not count references sees the prefix gone when one of the
two copies is evicted (a conservative error: it only stops preferring this worker).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.kv_events import (
    BlockRemoved,
    BlockStored,
    StorageMedium,
    namespaced_block_hash,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.utils import hash_str_to_int64


class CompressedBlockStored(BlockStored, tag="BlockStored"):
    """`BlockStored` of a compressed node: its tokens' blocks, held in `kv_slots` KV slots."""

    kv_slots: int | None = None


class CompressedBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    """`BlockRemoved` of a compressed node, which freed `kv_slots` KV slots."""

    kv_slots: int | None = None


def _compressed(node: Any) -> bool:
    return getattr(node, "kvevict_compressed", False)


def event_slots(event: Any, page_size: int = 1) -> int:
    """KV slots an event's blocks hold: `kv_slots` for a compressed node, else one page per block."""
    slots = getattr(event, "kv_slots", None)
    return slots if slots is not None else len(event.block_hashes) * page_size


class KvEvictEventRecorder(KVCacheEventRecorder):
    """SGLang's recorder, plus compressed nodes (see the module docstring).

    It sees every compressed node stored and evicted, events on or off, so it also keeps the count of
    KV slots the tree's compressed nodes hold (`compressed_slots`, exported as a metric).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.compressed_slots = 0
        self.compressed_nodes = 0

    @classmethod
    def replacing(cls, old: KVCacheEventRecorder) -> KvEvictEventRecorder:
        return cls(
            enabled=old.enabled,
            page_size=old.page_size,
            dynamo_format=old.dynamo_format,
            lora_names=old.lora_names,
        )

    def record_all_cleared(self) -> None:
        self.compressed_slots = self.compressed_nodes = 0  # the tree was reset
        super().record_all_cleared()

    def enqueue(self, event: Any) -> None:
        tail = self._queue[-1] if self._queue else None
        if isinstance(event, (CompressedBlockStored, CompressedBlockRemoved)) or isinstance(
            tail, (CompressedBlockStored, CompressedBlockRemoved)
        ):
            self._queue.append(event)  # atomic units: never merged with a neighbour
            return
        super().enqueue(event)

    def _hashes(self, node: Any) -> tuple[list[int], bytes | None]:
        values = self._node_event_hash_values(node)
        seed = self._namespace_seed(node)
        n_pages = -(-len(node.key) // self.page_size)
        return [
            namespaced_block_hash(hash_str_to_int64(h), namespace_seed=seed) for h in values[:n_pages]
        ], seed

    def record_store(self, node: Any, medium: Any = None, *, session_id: str | None = None) -> None:
        if not _compressed(node):
            return super().record_store(node, medium, session_id=session_id)
        self.compressed_slots += len(node.value)
        self.compressed_nodes += 1
        if not self.enabled:
            return
        hashes, seed = self._hashes(node)
        parent = self._parent_block_hash(node)
        if parent is not None:
            parent = namespaced_block_hash(parent, namespace_seed=seed)
        raw = node.key.token_ids
        tokens = (
            [(raw[j], raw[j + 1]) for j in range(len(node.key))]
            if node.key.is_bigram
            else list(raw[: len(node.key)])
        )
        extra = node.key.extra_key
        self.enqueue(
            CompressedBlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.page_size,
                lora_id=None,
                medium=medium or StorageMedium.GPU,
                cache_salt=node.key.cache_salt,
                session_id=session_id,
                lora_name=self.lora_names.resolve(extra)
                if self.dynamo_format
                else self.lora_names.get(extra),
                kv_slots=len(node.value),
            )
        )

    def record_remove(self, node: Any, medium: Any = None) -> None:
        if not _compressed(node):
            return super().record_remove(node, medium)
        self.compressed_slots -= len(node.value)
        self.compressed_nodes -= 1
        if not self.enabled:
            return
        hashes, _ = self._hashes(node)
        if hashes:
            self.enqueue(
                CompressedBlockRemoved(
                    block_hashes=hashes, medium=medium or StorageMedium.GPU, kv_slots=len(node.value)
                )
            )
