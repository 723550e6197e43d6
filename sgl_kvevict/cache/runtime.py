"""What the scheduler process knows once the tree is built: pools, model shapes, `o_proj`, totals."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_kvevict.cache.counts import LazyCount

logger = logging.getLogger("sgl_kvevict")


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
    recall_forward_seconds: float = 0.0  # in the forward's recall hooks (prefill over both tiers, ...)
    started: float = field(default_factory=time.time)

    @property
    def tokens_merged(self) -> int:
        return self.merged.value()

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_merged"] = d.pop("merged").value()
        d["seconds_compressing"] = round(d["seconds_compressing"], 4)
        d["step_seconds_max"] = round(d["step_seconds_max"], 4)
        d["recall_forward_seconds"] = round(d["recall_forward_seconds"], 4)
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
        self.metrics: Any = None  # set by the serving side when `--enable-metrics` (serve.metrics.Metrics)

    def compressed_kv(self) -> dict[str, int]:
        """KV held by the tree's compressed nodes (counted by its event recorder)."""
        rec = self.tree.kv_events
        return {
            "compressed_kv_tokens": int(getattr(rec, "compressed_slots", 0)),
            "compressed_nodes": int(getattr(rec, "compressed_nodes", 0)),
        }

    def publish_metrics(self, host: Any = None) -> None:
        """Publish the totals to the metrics (when `--enable-metrics`); `host`: the server's host pool
        (`KvEvictContext.host`), whose totals feed the host tier's series."""
        if self.metrics is None:
            return
        values = None
        if host is not None:  # the host totals, and the bytes its used columns hold (K and V)
            values = host.stats()
            values["host_bytes"] = (
                values["host_used"] * host.layers * host.heads * host.dim * 2 * host.k.element_size()
            )
        self.metrics.publish(self.totals, self.compressed_kv(), values)

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


def _host_ram_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's `struct mallinfo2` (2.33+), every field a size_t
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_stats() -> dict[str, float]:
    """The C heap by glibc's own count, MiB, summed over its arenas: what is in use, what is free but kept
    (fragmentation: `malloc_trim` can give back only whole free pages of it) and what is mmapped (blocks
    over the mmap threshold, unmapped when freed). Empty where glibc has no `mallinfo2`.

    It tells where a CPU server's RSS growth is: in-use growing is live native memory (a cache or a leak),
    free growing is the allocator keeping what was freed."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2 if name else None
    except (OSError, AttributeError):
        fn = None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    m = fn()
    mib = 1 << 20
    return {
        "heap_in_use_mib": round(m.uordblks / mib, 1),
        "heap_free_mib": round(m.fordblks / mib, 1),
        "heap_mmapped_mib": round(m.hblkhd / mib, 1),
        "heap_arena_mib": round(m.arena / mib, 1),
    }


def attach(cache: Any, ctx: Any) -> Runtime:
    """Build the scheduler's `Runtime` over the tree `cache` (SGLang's factory context `ctx`), with the
    buffers compression needs (the window-query capture, the per-slot statistic), all kept in the
    cache's own context (`cache.ctx`). The serving side checks the model and its hooks before calling
    this."""
    from sgl_kvevict.cache import capture, slotstats

    kv = cache.ctx
    rt = kv.rt = Runtime(cache, ctx)
    capture.build(
        kv,
        int(rt.req_to_token.shape[0]),
        rt.n_layers,
        rt.n_q_heads,
        rt.head_dim,
        ctx.tp_worker.model_runner.dtype,
        rt.req_to_token.device,
        rt.start_layer,
    )
    cfg, settings = kv.server, kv.settings
    if settings.recall_tokens > 0 and cfg.active:
        from sgl_kvevict import kernels as K
        from sgl_kvevict import sizing
        from sgl_kvevict.cache.host_tier import decode_recall, demote, host

        k0 = rt.k_buffer(0)
        shape = sizing.Shape("", rt.n_layers, rt.n_q_heads, rt.n_kv_heads, rt.head_dim, k0.element_size())
        total = _host_ram_bytes()
        if settings.host_gib is not None:  # this rank's exact shape and KV dtype (the launcher estimated)
            columns = sizing.columns_for_bytes(settings.host_gib * sizing.GIB, shape)
            given = f"--kv-host-gib {settings.host_gib:g} ({columns} columns)"
        elif settings.host_tokens is not None:
            columns, given = settings.host_tokens, f"--kv-host-tokens {settings.host_tokens}"
        else:
            pool = int(rt.allocator.size)
            columns = sizing.default_columns(pool, shape, total)
            given = f"default host tier ({columns} columns for a device pool of {pool} tokens)"
        need = sizing.host_bytes(shape, columns)
        if total is not None and need > total // 2:  # committed at start (`host.HostPool`)
            raise RuntimeError(
                f"sgl-kvevict: {given} needs {need / 2**30:.1f} GiB of host "
                f"memory, more than half of this machine's {total / 2**30:.1f} GiB: lower it"
            )
        demote.attach(kv, host.build(rt.n_layers, rt.n_kv_heads, rt.head_dim, columns, k0.dtype, k0.device))
        if decode_recall.fused_on_cpu(k0):
            K.recall_layer_cpu_warm(rt.n_kv_heads, rt.n_q_heads // rt.n_kv_heads, rt.head_dim)
        logger.info(
            "sgl-kvevict: %s: host tier %.1f MiB; on %s: page summaries up to %.1f MiB (page %d), "
            "capture buffer %.1f MiB",
            given,
            need / sizing.MIB,
            k0.device,
            sizing.summary_bytes(shape, columns, settings.recall.page) / sizing.MIB,
            settings.recall.page,
            (kv.capture.nbytes if kv.capture is not None else 0) / sizing.MIB,
        )
    kv.slot_stats = slotstats.setup(rt) if slotstats.needed(cfg, settings) else None
    logger.info(
        "sgl-kvevict: KV policy %r active (budget %s, config %s); compressing radix cache on %d layers x %d KV heads; "
        "attention scale %.6g",
        cfg.policy,
        cfg.budget,
        cfg.config,
        rt.n_layers,
        rt.n_kv_heads,
        rt.scale,
    )
    return rt
