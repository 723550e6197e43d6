"""What the scheduler process knows once the tree is built: pools, model shapes, `o_proj`, totals."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("sgl_kvevict")


class LazyCount:
    """A count that grows by device tensors without reading them (a read inside the compression step is
    a host sync that stalls a GPU stream): the sync happens once, where the count is reported.

    Pending tensors are summed on the device every `FOLD` additions, so memory stays bounded when
    nobody reads the count for a long time."""

    FOLD = 64

    def __init__(self) -> None:
        self.known = 0
        self.pending: list[torch.Tensor] = []

    def add(self, x: int | float | torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            self.known += int(x)
            return
        self.pending.append(x.detach().reshape(()).to(torch.int64))
        if len(self.pending) >= self.FOLD:
            self.pending = [torch.stack(self.pending).sum()]

    def value(self) -> int:
        if self.pending:
            self.known += int(torch.stack(self.pending).sum())
            self.pending = []
        return self.known


@dataclass
class Totals:
    """Server-wide counters, reported in `/server_info` (internal_states[i]["kvevict"])."""

    compressions: int = 0
    tokens_evicted: int = 0
    slots_freed: int = 0
    merged: LazyCount = field(default_factory=LazyCount)  # D2O: read as `tokens_merged`, where reported
    seconds_compressing: float = 0.0
    requests_compressed: int = 0
    policy_failures: int = 0
    compressions_deferred: int = 0  # compression checks postponed a step (--kv-compress-step-tokens spent)
    compressions_split: int = 0  # steps that planned part of a compression and left the rest for later
    heap_mib_trimmed: float = 0.0  # RSS given back to the OS by malloc_trim at /flush_cache (see trim_heap)
    overlap_drained_steps: int = (
        0  # overlapped steps whose previous results were processed first (a compression was due)
    )
    capture_refused: int = 0  # requests left uncompressed: no window-query capture slot was free
    step_seconds_max: float = 0.0  # the longest a scheduler step (or a release) spent compressing: its stall
    started: float = field(default_factory=time.time)

    @property
    def tokens_merged(self) -> int:
        return self.merged.value()

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_merged"] = d.pop("merged").value()
        d["seconds_compressing"] = round(d["seconds_compressing"], 4)
        d["step_seconds_max"] = round(d["step_seconds_max"], 4)
        d["heap_mib_trimmed"] = round(d["heap_mib_trimmed"], 1)
        return d


def attention_scale(model: Any, head_dim: int) -> float:
    """The softmax scale the model's own attention uses (`RadixAttention.scaling`).

    Models differ (Gemma's query_pre_attn_scalar, MLA's scaled rope dims, yarn's mscale), so scores must
    use the model's value; 1/sqrt(head_dim) only when no RadixAttention is found, said in the log.
    """
    from sglang.srt.layers.radix_attention import RadixAttention

    scales = [float(m.scaling) for m in model.modules() if isinstance(m, RadixAttention)]
    if not scales:
        logger.warning(
            "sgl-kvevict: no RadixAttention module in the model; scoring with 1/sqrt(head_dim=%d)", head_dim
        )
        return 1.0 / math.sqrt(head_dim)
    if any(not math.isclose(x, scales[0], rel_tol=1e-6) for x in scales):
        logger.warning(
            "sgl-kvevict: attention scales differ across layers %s; scoring with the first", set(scales)
        )
    return scales[0]


class Runtime:
    def __init__(self, cache: Any, ctx: Any) -> None:
        self.tree = cache
        self.req_to_token = ctx.params.req_to_token_pool.req_to_token
        self.allocator = ctx.params.token_to_kv_pool_allocator
        self.kv_pool = self.allocator.get_kvcache()
        self.model = ctx.tp_worker.model_runner.model
        cfg = ctx.model_config.hf_config
        self.n_layers = int(cfg.num_hidden_layers)
        tp = max(1, int(ctx.tp_size))
        self.tp_size = tp
        self.n_q_heads = int(cfg.num_attention_heads) // tp
        self.n_kv_heads = max(1, int(cfg.num_key_value_heads) // tp)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scale = attention_scale(self.model, self.head_dim)
        self.start_layer = int(getattr(self.kv_pool, "start_layer", 0) or 0)
        self._o_proj: dict[int, torch.Tensor] = {}
        self.forward_stream = getattr(ctx.tp_worker.model_runner, "forward_stream", None)
        self.totals = Totals()
        self.metrics = None
        if getattr(ctx.params, "enable_metrics", False):
            from sgl_kvevict.serve.metrics import Metrics, labels_for

            self.metrics = Metrics(labels_for(ctx.server_args, int(ctx.tp_rank)))

    def compressed_kv(self) -> dict[str, int]:
        """KV held by the tree's compressed nodes (counted by its event recorder)."""
        rec = self.tree.kv_events
        return {
            "compressed_kv_tokens": int(getattr(rec, "compressed_slots", 0)),
            "compressed_nodes": int(getattr(rec, "compressed_nodes", 0)),
        }

    def publish_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.publish(self.totals, self.compressed_kv())

    def order_after_forward(self) -> None:
        """Queue what follows (a compression's reads and writes of K/V) behind every forward launched so
        far, on the GPU, without waiting on the host.

        Under the overlap scheduler the scheduler prepares step N (our compression included) while
        forward N-1 still runs on the model runner's stream, writing the K/V and the window queries a
        compression reads and moves; SGLang's next forward waits for the scheduler's stream, so the
        order forward N-1 -> compression -> forward N holds. A no-op on CPU (every op is synchronous)."""
        fs = self.forward_stream
        if fs is None or not torch.cuda.is_available() or self.req_to_token.device.type != "cuda":
            return
        cur = torch.cuda.current_stream()
        if cur != fs:
            cur.wait_stream(fs)

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.kv_pool.get_key_buffer(layer + self.start_layer)

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.kv_pool.get_value_buffer(layer + self.start_layer)

    def o_proj(self, layer: int) -> torch.Tensor:
        """`[Hq, D, hidden]` per-query-head slices of this rank's W_O (cached)."""
        if layer not in self._o_proj:
            w = self.model.model.layers[layer].self_attn.o_proj.weight  # [hidden, Hq*D] (row-parallel shard)
            self._o_proj[layer] = w.detach().t().reshape(self.n_q_heads, self.head_dim, -1).contiguous()
        return self._o_proj[layer]


RT: Runtime | None = None


def trim_heap() -> float:
    """Give the C heap's free memory back to the OS (glibc `malloc_trim`); returns the MiB the process's
    RSS fell by, 0 where unavailable.

    Compression allocates many short-lived tensors of varying sizes; glibc keeps freed blocks in its
    arenas, so a CPU server's RSS climbs to its high-water mark and stays there even when nothing is
    held. Called when the cache is flushed: an operator's RSS then shows what the server really holds."""
    import ctypes
    import ctypes.util

    import psutil

    name = ctypes.util.find_library("c")
    if not name:
        return 0.0
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return 0.0
    proc = psutil.Process()
    before = proc.memory_info().rss
    trim(0)
    return max(0.0, (before - proc.memory_info().rss) / (1 << 20))


def attach(cache: Any, ctx: Any) -> None:
    global RT
    from sgl_kvevict.cache import capture, slotstats
    from sgl_kvevict.config import server_config, server_settings
    from sgl_kvevict.serve import hooks, modelcheck

    hf = ctx.model_config.hf_config
    why = modelcheck.refusal(hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)))
    if why:  # the launcher refuses these from config.json; this catches models it could not read
        raise RuntimeError(f"sgl-kvevict: a compressing KV policy cannot serve {why}")
    RT = Runtime(cache, ctx)
    capture.build(
        int(RT.req_to_token.shape[0]),
        RT.n_layers,
        RT.n_q_heads,
        RT.head_dim,
        ctx.tp_worker.model_runner.dtype,
        RT.req_to_token.device,
        RT.start_layer,
    )
    missing = hooks.verify_installed()
    if missing:
        raise RuntimeError(f"sgl-kvevict: hooks failed to apply (see the log above): {missing}")
    cfg = server_config()
    slotstats.reset()
    if slotstats.needed(cfg, server_settings()):
        slotstats.setup(RT)
    logger.info(
        "sgl-kvevict: KV policy %r active (budget %s, config %s); compressing radix cache on %d layers x %d KV heads; "
        "attention scale %.6g",
        cfg.policy,
        cfg.budget,
        cfg.config,
        RT.n_layers,
        RT.n_kv_heads,
        RT.scale,
    )
