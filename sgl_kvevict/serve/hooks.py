"""Scheduler-side hooks (HookRegistry), installed only when a policy other than `none` is active.

Each hook is one of the places where SGLang assumes "one KV slot per token", which a compressed request breaks:

- `alloc_for_extend` (AROUND): a request that matched a compressed node has fewer prefix slots than
  prefix tokens; lengths are lowered to slots around the allocation, and window-query capture starts.
- `prepare_for_extend` (AFTER): `orig_seq_lens` in slots too.
- `check_decode_mem` (BEFORE): compression runs here, before SGLang decides whether the next decode
  step fits (so a request about to shrink is not retracted) and before the next slot is allocated;
  the batch's carried `seq_lens` tensors shrink with the requests. `prepare_for_decode` (BEFORE)
  compresses instead when the memory check did not run.
- `ForwardBatch.init_new` (AFTER): positions become logical: slot position + evicted tokens.
- `release_kv_cache` (BEFORE): a last compression when the turn ends, so the stored history is small.
- `Req.owned_kv_len`, `_release_overallocated_kv_indices` (AROUND): slot counts for compressed requests.
- `RadixAttention.forward` (BEFORE, three hooks): capture the last W queries for attention-based policies;
  write the per-slot ||v W_O||_1 statistic of the values being written (`slotstats`, CriticalKV); a decode
  step's recall of host entries, layer by layer (`recall.before_attention`).
- `Scheduler.get_next_batch_to_run`, `process_batch_result` (AROUND): under the overlap scheduler, a
  step in which a compression is due processes the previous step's results first (overlap off for that
  step only); a finished request gives back the slot of its in-flight last token before its last
  compression. Both make overlap on and off compress the same. With a host tier, the requests that
  joined the waiting queue are matched as they arrive (`demote.match_waiting`), so the host pool
  knows which histories they wait for.
- meta_info and `/server_info` reporting.
Every hook guards itself: an exception in our code must never take the scheduler down.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_kvevict.cache import (
    capture,
    compressor,
    context,
    engine,
    report,
    runtime,
    slotstats,
    threads,
    trigger,
)
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.context import KvEvictContext
from sgl_kvevict.cache.host_tier import demote, exact_prefill, recall
from sgl_kvevict.cache.tree import KvEvictRadixCache
from sgl_kvevict.config import KvConfig

logger = logging.getLogger("sgl_kvevict")
META_KEY = "kvevict"
STREAM_KEY = "kvevict_stream"  # streamed responses: per-token list, the stats in the last entry
_SB = "sglang.srt.managers.schedule_batch"


def _context(tree_cache: Any) -> KvEvictContext | None:
    """The context of a scheduler's tree (`tree.ctx`), None when that tree is not a compressing one."""
    return tree_cache.ctx if isinstance(tree_cache, KvEvictRadixCache) else None


def _offset(req: Any) -> int:
    s = st.get(req)
    return s.slot_map.offset if s is not None else 0


def alloc_for_extend(original, batch, *args, **kwargs):
    reqs = batch.reqs
    offs = [_offset(r) for r in reqs]
    if any(offs):
        batch.prefix_lens = [p - d for p, d in zip(batch.prefix_lens, offs, strict=True)]
        delta = torch.tensor(offs, dtype=batch.seq_lens_cpu.dtype)
        batch.seq_lens_cpu = batch.seq_lens_cpu - delta
        batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device)
        for r, d in zip(reqs, offs, strict=True):
            r.prefix_len -= d
    try:
        return original(batch, *args, **kwargs)
    finally:
        for r, d in zip(reqs, offs, strict=True):
            r.prefix_len += d
        try:
            _after_extend_alloc(_context(batch.tree_cache), reqs, offs)
        except Exception:
            logger.exception("kvevict: bookkeeping after extend allocation failed")


def _after_extend_alloc(ctx: KvEvictContext | None, reqs: list, offs: list[int]) -> None:
    if ctx is None or ctx.rt is None:
        return
    rt = ctx.rt
    for r, d in zip(reqs, offs, strict=True):
        row = r.kv.req_pool_idx
        if row is None:
            continue
        rt.tree.offsets[row] = d
        s = st.get(r)
        if s is None:
            continue
        s.ran = True
        if s.recall.turn_start is None:  # the turn's first chunk: what it matched is the history before it
            s.recall.turn_start = int(r.prefix_len)
        if not s.active:
            continue
        s.after_extend = True
        s.recall.due = s.recall.tokens > 0
        s.recall.append_due = s.recall.tokens > 0
        s.recall.steps = 0
        needs_window = "attn" in s.policy.needs or s.recall.tokens > 0
        if needs_window and not capture.ensure(ctx, row, s.policy.config.window, r.prefix_len):
            if "attn" not in s.policy.needs:  # only recall needed the queries: compress without it
                s.recall.tokens = 0
                s.recall.due = False
                continue
            s.failed = True  # no capture slot: nothing to score with, so no compression at all
            rt.totals.capture_refused += 1
            logger.warning(
                "kvevict: request %s runs uncompressed: no window-query capture slot (all %d in use, or window "
                "%d above the buffer's); raise --max-running-requests / --kv-overrides max_window",
                r.rid,
                ctx.capture.slots if ctx.capture is not None else 0,
                s.policy.config.window,
            )
            continue
        if s.recall.due:
            t0 = time.perf_counter()
            recall.arm(r, s)  # its prefill attends over both tiers, layer by layer
            s.counters.recall_seconds += time.perf_counter() - t0
            if s.counters.recall_mark is None:  # the forward's recall hooks count from here (`_recall_time`)
                s.counters.recall_mark = rt.totals.recall_forward_seconds


def prepare_for_extend(result, batch, *args, **kwargs):
    offs = [_offset(r) for r in batch.reqs]
    if any(offs) and getattr(batch, "orig_seq_lens", None) is not None:
        batch.orig_seq_lens = batch.orig_seq_lens - torch.tensor(
            offs, dtype=batch.orig_seq_lens.dtype, device=batch.orig_seq_lens.device
        )
    return result


def _compress_batch(batch, ctx: KvEvictContext | None = None) -> None:
    """Compress the requests whose trigger fires; shrink the batch's carried lengths.

    With `--kv-compress-step-tokens C`, once this step's compressions cover C region tokens the other
    requests wait for later steps (`engine.compress_batch`), so several large first compressions after a
    batched prefill are spread over steps instead of stalling the whole batch in one. The cap is lifted
    when the pool is nearly full: deferring then would make SGLang retract instead."""
    ctx = ctx if ctx is not None else _context(batch.tree_cache)
    reqs, rt = batch.reqs, ctx.rt
    cap = ctx.settings.step_tokens
    if cap is not None and rt.allocator.available_size() + rt.tree.evictable_size() < 2 * len(reqs):
        cap = None
    items = []
    for r in reqs:
        s = st.get(r)
        phase = "prefill" if s is not None and s.after_extend else "decode"
        if s is not None:
            s.after_extend = False
        items.append((r, phase))
    t0 = time.perf_counter()
    with threads.one_thread():
        freed = engine.compress_batch(items, cap)
        for i, (r, (_, phase)) in enumerate(zip(reqs, items, strict=True)):  # after the compressions
            t1 = time.perf_counter()
            freed[i] -= recall.after_compress(r, phase == "decode")  # a recall may append slots
            s = st.get(r)
            if s is not None:
                s.counters.kv_peak = max(s.counters.kv_peak, int(r.kv.kv_committed_len))
                if s.recall.tokens > 0:
                    _recall_time(s, rt, time.perf_counter() - t1)
    rt.totals.step_seconds_max = max(rt.totals.step_seconds_max, time.perf_counter() - t0)
    if any(freed):
        delta = torch.tensor(freed, dtype=batch.seq_lens_cpu.dtype)
        batch.seq_lens_cpu = batch.seq_lens_cpu - delta
        batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device)
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens = batch.orig_seq_lens - delta.to(
                batch.orig_seq_lens.device, batch.orig_seq_lens.dtype
            )
        batch.seq_lens_sum = None


def _recall_time(s: st.ReqState, rt: Any, seconds: float) -> None:
    """Add a recall stage's `seconds` to the request's turn, and the forward's recall hooks' time since
    its prefill was armed (every turn in a batched prefill counts the batch's)."""
    s.counters.recall_seconds += seconds
    if s.counters.recall_mark is not None:
        s.counters.recall_seconds += rt.totals.recall_forward_seconds - s.counters.recall_mark
        s.counters.recall_mark = None


def _timed_forward_hook(fn, at: int):
    """A recall hook on `RadixAttention.forward` (its forward batch the argument `at`), its time added to
    the server's `Totals.recall_forward_seconds` (on servers with a host tier)."""

    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            fb = args[at] if len(args) > at else kwargs.get("forward_batch")
            ctx = context.of_forward(fb) if fb is not None else None
            if ctx is not None and ctx.host is not None and ctx.rt is not None:
                ctx.rt.totals.recall_forward_seconds += dt

    wrapped.__name__ = fn.__name__
    return wrapped


_DONE = "_kvevict_compressed_this_step"


def check_decode_mem(batch, selected_indices=None, *args, **kwargs):
    """Compress before SGLang checks whether the next decode step fits: a request about to give slots
    back is not retracted for memory it would have freed in the same step."""
    ctx = _context(batch.tree_cache)
    if ctx is None or ctx.rt is None or selected_indices is not None:
        return None
    _compress_batch(batch, ctx)
    setattr(batch, _DONE, True)
    return None


def prepare_for_decode(batch, *args, **kwargs):
    """Compression runs here only when the scheduler skipped its memory check this step. Then, with the
    batch final (retractions done), its armed decode recalls become the forward's plan."""
    ctx = _context(batch.tree_cache)
    if ctx is None or ctx.rt is None:
        return None
    if getattr(batch, _DONE, False):
        setattr(batch, _DONE, False)
    else:
        _compress_batch(batch, ctx)
    recall.plan_step(ctx, batch.reqs)
    return None


def init_new(result, cls, batch, model_runner, *args, **kwargs):
    """Logical positions: every token of a compressed request moves by its offset."""
    ctx = context.find(model_runner.req_to_token_pool)
    rt = None if ctx is None else ctx.rt
    if rt is None or result.positions is None:
        return result
    # No `offs.any()` shortcut: reading it back would stall the host on every forward; adding zeros
    # does not. The offsets tensor lives beside the row pool, so this is one gather and one add.
    offs = rt.tree.offsets[result.req_pool_indices.to(rt.tree.offsets.device)]
    offs = offs.to(result.positions.device, result.positions.dtype)
    if result.forward_mode.is_decode():
        result.positions = result.positions + offs
    elif result.forward_mode.is_extend():
        lens_cpu = getattr(result, "extend_seq_lens_cpu", None)  # host lengths: no read back for the size
        result.positions = result.positions + torch.repeat_interleave(
            offs,
            result.extend_seq_lens.to(offs.device).long(),
            output_size=int(sum(lens_cpu)) if lens_cpu is not None else None,
        )
    return result


def release_kv_cache(req, tree_cache, *args, **kwargs):
    """A finished turn gets one last compression before its history goes into the tree.

    A compressed request released unfinished (retraction under memory pressure) is checkpointed too:
    its compressed history goes into the tree, so when it is re-admitted it matches that history and
    resumes compressed instead of re-prefilling and holding everything it had evicted.
    """
    s = st.get(req)
    if s is None or not req.kv.holds_kv:
        return None
    if req.finished():
        recall.drop_finished(req, s)
        # An aborted or disconnected request's history is not worth a last compression: nobody continues it.
        if s.active and not isinstance(req.finished_reason, FINISH_ABORT):
            _drop_in_flight_token(req, s)
            t0 = time.perf_counter()
            compressor.safe_compress(req, "finish")
            if s.ctx.rt is not None:
                tot = s.ctx.rt.totals
                tot.step_seconds_max = max(tot.step_seconds_max, time.perf_counter() - t0)
        return None
    if s.slot_map.offset > 0 and not kwargs.get("checkpoint", True) and not req.skip_radix_cache_insert:
        s.releasing = True
        return (req, tree_cache, *args), {**kwargs, "checkpoint": True}
    return None


def _drop_in_flight_token(req: Any, s: st.ReqState) -> None:
    """Under the overlap scheduler a request is found finished only after its next step was prepared:
    it already holds a slot for its last output token (whose K/V that step computes). Without overlap
    that slot never exists. Give it back before the last compression, so the compressed history, and
    what a next turn reuses, are the same with overlap on or off."""
    rt, kv = s.ctx.rt, req.kv
    if rt is None or not req.output_ids or kv.kv_allocated_len != kv.kv_committed_len:
        return
    keep = s.slot_map.slots_for(len(req.origin_input_ids) + len(req.output_ids) - 1)
    if not kv.cache_protected_len <= keep < kv.kv_committed_len:
        return
    row = kv.req_pool_idx
    rt.allocator.free(rt.req_to_token[row, keep : kv.kv_committed_len].to(torch.int64))
    kv.kv_committed_len = kv.kv_allocated_len = keep


class Drained:
    """Stands in the overlap scheduler's result queue for a step whose results were processed early:
    SGLang's loop pops one entry per step, and reads the queued batch's requests (none here)."""

    reqs: tuple = ()

    def is_empty(self) -> bool:
        return True

    def batch_size(self) -> int:
        return 0


DRAINED = Drained()


def get_next_batch_to_run(original, scheduler, *args, **kwargs):
    """Overlap off for exactly the steps that compress: when a request of the step whose results are
    still pending is due to compress (`trigger.due`), process those results first, as the
    non-overlapped loop does, then prepare the next step. Its compression then sees the same requests
    (finished ones gone) and the same tree (a prefill's prompt inserted, so a shared prefix stays
    uncompressed and reusable) as without overlap; every other step keeps overlapping, a decode step
    that recalls included (its records are read when its own results are: `recall.finish_step`)."""
    q = getattr(scheduler, "result_queue", None)
    ctx = _context(getattr(scheduler, "tree_cache", None))
    if q and ctx is not None and ctx.rt is not None and q[0][0] is not DRAINED:
        try:
            drain = any(trigger.due(r) for r in q[0][0].reqs)
        except Exception:
            logger.exception("kvevict: compression check before an overlapped step failed")
            drain = False
        if drain:
            batch, result = q.popleft()
            scheduler.process_batch_result(batch, result)
            q.appendleft((DRAINED, None))
            ctx.rt.totals.overlap_drained_steps += 1
    if ctx is not None and ctx.host is not None:
        try:
            demote.match_waiting(scheduler.tree_cache, scheduler.waiting_queue)
        except Exception:
            logger.exception("kvevict: matching the waiting requests failed")
    return original(scheduler, *args, **kwargs)


def process_batch_result(original, scheduler, batch, *args, **kwargs):
    if batch is DRAINED:  # processed already, before this step was prepared
        return None
    ctx = _context(getattr(scheduler, "tree_cache", None))
    mode = getattr(batch, "forward_mode", None)
    if ctx is not None and mode is not None and mode.is_decode():
        recall.finish_step(ctx)  # the step's recall, read before its requests finish
    return original(scheduler, batch, *args, **kwargs)


def owned_kv_len(original, req, *args, **kwargs):
    s = st.get(req)
    if s is None or s.slot_map.offset == 0 or req.finished_len is None:
        return original(req, *args, **kwargs)
    owned_tokens = len(req.origin_input_ids) + len(req.output_ids_through_stop)
    return min(req.kv.kv_committed_len, s.slot_map.slots_for(owned_tokens))


def release_overallocated(original, req, start_p, end_p, tree_cache, *args, **kwargs):
    if _offset(req) == 0:
        return original(req, start_p, end_p, tree_cache, *args, **kwargs)
    if start_p < end_p:  # the original's assert compares token counts with slot counts
        tree_cache.free_kv_row(req.kv, [(start_p, end_p)])
    return None


def on_release_report(ctx: KvEvictContext, req: Any) -> None:
    if ctx.rt is not None:
        ctx.rt.publish_metrics(ctx.host)
    stats = report.stats(req)
    if stats is None:
        return
    if ctx.rt is not None and ctx.rt.metrics is not None:
        ctx.rt.metrics.observe_turn(stats)
    if req.customized_info is None:
        req.customized_info = {}
    if req.stream:
        # SGLang sends request-level info only with a stream's first chunk; a per-token list whose last
        # entry is the stats reaches the final chunk instead.
        req.customized_info[STREAM_KEY] = [None] * (len(req.output_ids) - 1) + [stats]
    else:
        req.customized_info[META_KEY] = [stats]


def request_level_key(original, self, key, *args, **kwargs):
    return key == META_KEY or original(self, key, *args, **kwargs)


def internal_state(result, *args, **kwargs):
    scheduler = getattr(args[0], "scheduler", None) if args else None
    ctx = _context(getattr(scheduler, "tree_cache", None))
    rt = None if ctx is None else ctx.rt
    if rt is not None and getattr(result, "internal_state", None) is not None:
        pool = {
            "max_total_tokens": int(rt.allocator.size),
            "available_tokens": int(rt.allocator.available_size()),
            "evictable_tokens": int(rt.tree.evictable_size()),
            "protected_tokens": int(rt.tree.protected_size()),
        }
        result.internal_state[META_KEY] = {
            "policy": ctx.server.policy,
            **rt.totals.as_dict(),
            **pool,
            **rt.compressed_kv(),
            # per-request objects alive now: with no request running they must be 0 (see bench_soak)
            "live_request_states": len(st.LIVE),
            "capture_rings": capture.live(ctx),
            **({"host": ctx.host.stats()} if ctx.host is not None else {}),
            **runtime.heap_stats(),  # where the scheduler's RSS is (bench_soak_rss.py samples it)
        }
        if st.DEBUG or os.environ.get("KVEVICT_COUNT_OBJECTS") == "1":  # a soak's leak check (~0.1 s)
            result.internal_state[META_KEY]["python_objects"] = len(gc.get_objects())
        if st.DEBUG and args:  # the tests' watchdog reads it when a request runs past its expected time
            result.internal_state[META_KEY]["queues"] = queues(scheduler)
        rt.publish_metrics(ctx.host)
    return result


def _req_view(req: Any) -> dict[str, Any]:
    """One request as the scheduler holds it: enough to tell a starved request from a stuck one."""
    s = st.get(req)
    kv = getattr(req, "kv", None)
    view: dict[str, Any] = {
        "rid": str(req.rid),
        "input": len(req.origin_input_ids),
        "output": len(req.output_ids),
        "max_new": req.sampling_params.max_new_tokens,
        "finished": req.finished(),
        "to_finish": repr(req.to_finish) if req.to_finish else None,
        "retracted": bool(getattr(req, "is_retracted", False)),
        "retractions": int(getattr(req, "retraction_count", 0)),
        "kv_committed": int(kv.kv_committed_len) if kv is not None else None,
        "kv_allocated": int(kv.kv_allocated_len) if kv is not None else None,
    }
    if s is not None:
        view["kvevict"] = {
            "policy": s.cfg.policy,
            "pending": s.pending is not None,
            "deferred": s.deferred,
            "compressions": s.counters.compressions,
            "failed": s.failed,
            "offset": s.slot_map.offset,
        }
    return view


def queues(scheduler: Any) -> dict[str, Any] | None:
    """The scheduler's running batch, waiting queue, chunked request and pending result (KVEVICT_DEBUG=1)."""
    if scheduler is None:
        return None
    out: dict[str, Any] = {"forward_ct": int(getattr(scheduler, "forward_ct", -1))}
    try:
        running = getattr(scheduler, "running_batch", None)
        out["running"] = [_req_view(r) for r in (running.reqs if running is not None else [])]
        out["waiting"] = [_req_view(r) for r in getattr(scheduler, "waiting_queue", [])]
        chunked = getattr(scheduler, "chunked_req", None)
        out["chunked"] = _req_view(chunked) if chunked is not None else None
        last = getattr(scheduler, "last_batch", None)
        mode = None if last is None else getattr(last.forward_mode, "name", str(last.forward_mode))
        out["last_batch"] = None if last is None else {"mode": mode, "size": len(last.reqs)}
        out["result_queue"] = len(getattr(scheduler, "result_queue", ()) or ())
    except Exception as e:  # a debug view must never fail the /server_info call
        out["error"] = repr(e)
    return out


def _guard(fn, kind: HookType):
    """Wrap a BEFORE/AFTER hook so that an exception in it is logged and SGLang proceeds as if it were
    absent. AROUND hooks stay as they are: they call the original themselves and are kept small."""
    if kind is HookType.AROUND:
        return fn
    name = fn.__name__

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            logger.exception("kvevict: hook %s failed; continuing without it for this call", name)
            return args[0] if kind is HookType.AFTER else None

    wrapped.__name__ = name
    return wrapped


HOOKS: list[tuple[str, Any, HookType]] = [
    ("sglang.srt.mem_cache.allocation.alloc_for_extend", alloc_for_extend, HookType.AROUND),
    (f"{_SB}.ScheduleBatch.prepare_for_extend", prepare_for_extend, HookType.AFTER),
    (f"{_SB}.ScheduleBatch.check_decode_mem", check_decode_mem, HookType.BEFORE),
    (f"{_SB}.ScheduleBatch.prepare_for_decode", prepare_for_decode, HookType.BEFORE),
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", init_new, HookType.AFTER),
    ("sglang.srt.mem_cache.common.release_kv_cache", release_kv_cache, HookType.BEFORE),
    (f"{_SB}.Req.owned_kv_len", owned_kv_len, HookType.AROUND),
    ("sglang.srt.mem_cache.common._release_overallocated_kv_indices", release_overallocated, HookType.AROUND),
    ("sglang.srt.layers.radix_attention.RadixAttention.forward", capture.before_attention, HookType.BEFORE),
    ("sglang.srt.layers.radix_attention.RadixAttention.forward", slotstats.before_attention, HookType.BEFORE),
    (
        "sglang.srt.layers.radix_attention.RadixAttention.forward",
        _timed_forward_hook(recall.before_attention, 4),
        HookType.BEFORE,
    ),
    (
        "sglang.srt.layers.radix_attention.RadixAttention.forward",
        _timed_forward_hook(exact_prefill.after_attention, 5),
        HookType.AFTER,
    ),
    ("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", get_next_batch_to_run, HookType.AROUND),
    ("sglang.srt.managers.scheduler.Scheduler.process_batch_result", process_batch_result, HookType.AROUND),
    (
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key",
        request_level_key,
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        internal_state,
        HookType.AFTER,
    ),
]


def install(cfg: KvConfig) -> None:
    for target, fn, kind in HOOKS:
        HookRegistry.register(target, _guard(fn, kind), kind)


def verify_installed() -> list[str]:
    """Targets that failed to patch (HookRegistry only logs such failures)."""
    return [t for t, _, _ in HOOKS if t not in HookRegistry._patched]


def build_tree_cache(ctx: Any) -> Any:
    """Factory registered as `--radix-cache-backend kvevict` (chosen automatically by `--kv-policy`): the
    compressing tree and its runtime, once the model and the hooks are known to fit."""
    from sgl_kvevict.serve import modelcheck

    params = ctx.params
    if params.page_size != 1:
        raise ValueError(f"sgl-kvevict compacts per token and needs --page-size 1 (got {params.page_size})")
    hf = ctx.model_config.hf_config
    why = modelcheck.refusal(hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)))
    if why:  # the launcher refuses these from config.json; this catches models it could not read
        raise RuntimeError(f"sgl-kvevict: a compressing KV policy cannot serve {why}")
    missing = verify_installed()
    if missing:
        raise RuntimeError(f"sgl-kvevict: hooks failed to apply (see the log above): {missing}")
    cache = KvEvictRadixCache(params, params.req_to_token_pool.req_to_token.shape[0])
    cache.release_report = on_release_report
    rt = runtime.attach(cache, ctx)
    if getattr(params, "enable_metrics", False):
        from sgl_kvevict.serve.metrics import Metrics, labels_for

        rt.metrics = Metrics(labels_for(ctx.server_args, int(ctx.tp_rank)), host=cache.ctx.host is not None)
    return cache
