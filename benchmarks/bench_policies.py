"""CPU time of one compression step per policy, next to one SmolLM2-135M decode step at the same context.

Why: on a CPU server the compression step runs between decode steps of the same scheduler, so its cost
only matters relative to a decode step; this prints that ratio, raw and amortized over the trigger period.

Data: SmolLM2's own post-RoPE K/V, last W=32 post-RoPE window queries and W_O slices (`[9, 64, 576]`),
from one HF prefill (bf16, DynamicCache) of a deterministic text (Python's pydoc topics), so scores and
D2O's merge count see real distributions. Each region of N tokens sits at random slots of a bf16 pool
`[2N, 3, 64]` per layer (a fragmented pool), with no protected prefix.

The timed step is the server's private-region path of `compressor.compress`: per layer a LayerView
(window attention via `kernels.window_attention(causal=True)` if the policy needs "attn", o_proj if it
needs "o_proj"), `compressor.select_layers` (the server's own selection loop), the policy's merge (D2O),
`kernels.compact` over all layers; one compression thread (KVEVICT_COMPRESS_THREADS).
Not timed: SGLang's slot freeing and request bookkeeping. The budget resolves like the server's
(`KvConfig.resolve_budget`, a ratio of the region). Median of --repeats after one warm-up, both columns,
in wall and in process CPU time (the CPU ratio is the steadier one on a shared machine).

Two steps per policy and N: `first` (a fresh region, as after prefill) and `decode` (the region's first
N - period tokens kept by a previous compression whose policy state it reuses, period new tokens), and
the peak resident memory a step adds above its start (its transient memory).

Run (from the repo root; results/compress-vs-decode-step.md holds both tables, torch's default decode threads and
one decode thread, since on a loaded 2-core machine the default can be many times slower):
    HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py --out results/compress-vs-decode-step.md
    HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py --decode-threads 1 --out results/compress-vs-decode-step.md --append
GraphKV and CriticalKV beside their earlier implementations (dense graph, recomputed norms), one run:
    HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py --sizes 8192 --policies snapkv graphkv criticalkv --side-by-side --decode-threads 1
CriticalKV with the per-slot ||v W_O||_1 statistic (`sgl_kvevict.cache.slotstats`, what the server runs):
    HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py --sizes 8192 --policies snapkv criticalkv --slot-stats --decode-threads 1
`criticalkv-slotstats` reads the norms the forward pass wrote (precomputed here, outside the timed step,
as the server's hook computes them when it writes each value) and moves them with compaction; the
second table is what that hook adds to a forward pass, per token, beside the decode step.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sgl_kvevict import kernels, policies
from sgl_kvevict.cache import slotstats
from sgl_kvevict.cache.compressor import select_layers
from sgl_kvevict.cache.threads import THREADS
from sgl_kvevict.config import KvConfig
from sgl_kvevict.model import default_model_path
from sgl_kvevict.policies import LayerView, Policy
from sgl_kvevict.policies import graphkv as graph_mod
from sgl_kvevict.policies.lagkv import LagKVPolicy

streamed_neighbors = graph_mod.source_neighbors
SIZES = (512, 2048, 8192)
W = 32
PREFILL_CHUNK = 1024
DTYPE = torch.bfloat16


def log(msg: str) -> None:
    print(f"[bench_policies {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wall_cpu_ms(
    fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None
) -> tuple[float, float]:
    """Medians of wall and process CPU time in ms over `repeats` runs after one warm-up.

    CPU time is what the step itself burns: on a machine shared with other jobs the wall time also counts
    the time the OS gave the core to someone else, so the CPU-time ratio is the steadier one."""
    walls, cpus = [], []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        if i:
            walls.append((time.perf_counter() - t0) * 1e3)
            cpus.append((time.process_time() - c0) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def exact_rss() -> bool:
    """Make every allocation >= 64 KiB its own mmap, returned to the OS when freed (glibc's M_MMAP_THRESHOLD,
    which also stops its dynamic threshold), so the process's peak RSS follows the live tensors."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16) == 1
    except OSError:
        return False


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_transient_bytes(fn: Callable[[], object]) -> int:
    """Peak RSS above the RSS before `fn`, during `fn` (Linux: /proc/self/clear_refs resets the peak)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS:")
    fn()
    return max(0, _status_bytes("VmHWM:") - base)


def corpus() -> str:
    """Deterministic English prose (Python's reference docs) long enough for 8k+ tokens."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@dataclass
class Region:
    """One layer's compressible region in a fragmented pool, plus what the server would hand the policy."""

    k_buffer: torch.Tensor  # [pool, Hkv, D]
    v_buffer: torch.Tensor
    q: torch.Tensor  # [Hq, W, D] window queries (the capture ring's content)


@dataclass
class Model:
    """The loaded HF model plus one prefill: cache, token ids and per-layer pre-RoPE queries."""

    model: torch.nn.Module
    cache: DynamicCache
    ids: torch.Tensor  # [T + 1]: the prefill and the token decoded next
    q_raw: list[torch.Tensor]  # per layer [T, Hq * D]


def prefill(max_n: int) -> Model:
    """Chunked prefill of `max_n` tokens, keeping each layer's q_proj output for the window queries."""
    path = default_model_path()  # follows KVEVICT_CACHE, converted once if needed
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE, attn_implementation="sdpa").eval()
    ids = tok(corpus(), return_tensors="pt").input_ids[0]
    if ids.numel() < max_n + 1:
        raise SystemExit(f"corpus has {ids.numel()} tokens, need {max_n + 1}")
    ids = ids[: max_n + 1]
    q_parts: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, out, li=li: q_parts[li].append(out[0]))
        for li, layer in enumerate(model.model.layers)
    ]
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, max_n, PREFILL_CHUNK):
            model(
                input_ids=ids[None, s : min(max_n, s + PREFILL_CHUNK)], past_key_values=cache, use_cache=True
            )
            log(f"prefill {min(max_n, s + PREFILL_CHUNK)}/{max_n} tokens ({time.perf_counter() - t0:.1f}s)")
    for h in hooks:
        h.remove()
    return Model(model, cache, ids, [torch.cat(p) for p in q_parts])


def window_queries(m: Model, layer: int, n: int) -> torch.Tensor:
    """Post-RoPE queries of positions n-W..n-1, `[Hq, W, D]` as the capture ring returns them."""
    cfg = m.model.config
    hq, d = cfg.num_attention_heads, cfg.head_dim
    q = m.q_raw[layer][n - W : n].view(1, W, hq, d).transpose(1, 2)  # [1, Hq, W, D]
    pos = torch.arange(n - W, n)[None]
    cos, sin = m.model.model.rotary_emb(q, position_ids=pos)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return q[0].to(DTYPE)


def regions(m: Model, n: int, gen: torch.Generator) -> tuple[list[Region], torch.Tensor]:
    """Per layer, the first `n` cached tokens scattered into a `[2n, Hkv, D]` pool; and their slots."""
    slots = torch.randperm(2 * n, generator=gen)[:n]
    out = []
    for layer, cl in enumerate(m.cache.layers):
        k = cl.keys[0, :, :n].transpose(0, 1)  # [n, Hkv, D]
        v = cl.values[0, :, :n].transpose(0, 1)
        kb = torch.zeros(2 * n, *k.shape[1:], dtype=DTYPE)
        vb = torch.zeros_like(kb)
        kb[slots], vb[slots] = k.to(DTYPE), v.to(DTYPE)
        out.append(Region(kb, vb, window_queries(m, layer, n)))
    return out, slots


def o_proj_slices(m: Model) -> list[torch.Tensor]:
    """`[Hq, D, hidden]` per layer, as `runtime.Runtime.o_proj` builds them."""
    cfg = m.model.config
    return [
        layer.self_attn.o_proj.weight.detach()
        .t()
        .reshape(cfg.num_attention_heads, cfg.head_dim, -1)
        .contiguous()
        for layer in m.model.model.layers
    ]


def compression_step(
    policy: Policy,
    regs: list[Region],
    slots: torch.Tensor,
    o_proj: list[torch.Tensor],
    budget: int,
    states: list[dict] | None = None,
    n_compacted: int = 0,
    stats: torch.Tensor | None = None,
) -> int:
    """One step on a private region, as `compressor.compress` runs it; returns the kept count.

    `states`: the per-layer policy state a previous compression left (the runner's `PolicyState.layers`);
    it is updated as the runner does (carried scores of the kept tokens). `stats`: the per-slot
    ||v W_O||_1 buffer `[layers, pool, Hkv]`, read, written back and compacted as the runner does."""
    n = int(slots.numel())
    cfg = policy.config
    n_sink = max(0, min(cfg.sinks, n))
    n_recent = max(0, min(cfg.recent, n - n_sink))
    scale = regs[0].q.shape[-1] ** -0.5
    needs = policy.needs
    views = [
        LayerView(
            layer=layer,
            k_buffer=r.k_buffer,
            v_buffer=r.v_buffer,
            slots=slots,
            n_sink=n_sink,
            n_recent=n_recent,
            n_compacted=n_compacted,
            attn=kernels.window_attention(r.q, r.k_buffer, slots, scale, causal=True)
            if "attn" in needs
            else None,
            o_proj=o_proj[layer] if "o_proj" in needs else None,
            vo=slotstats.read(stats, layer, slots) if stats is not None and "o_proj" in needs else None,
            state=states[layer] if states is not None else {},
        )
        for layer, r in enumerate(regs)
    ]
    keeps = select_layers(policy, views, budget)
    keep = torch.stack(keeps).to(torch.int64)
    if stats is not None:
        for v in views:
            if v.vo is not None:
                slotstats.write_back(stats, v.layer, slots, v.vo)
    for v, kp in zip(views, keeps, strict=True):  # as the runner: scores carried to the next step
        scored = v.state.pop("scored", None)
        if scored is not None:
            v.state["carried"] = scored.gather(1, kp.to(scored.device))
    if policy.merges:
        for v, kp in zip(views, keeps, strict=True):
            policy.merge(v, kp)
    kernels.compact([r.k_buffer for r in regs], [r.v_buffer for r in regs], slots, keep)
    if stats is not None:
        slotstats.compact(stats, slots, keep)
    return int(keep.shape[2])


def time_step(
    policy: Policy,
    regs: list[Region],
    slots: torch.Tensor,
    o_proj: list[torch.Tensor],
    budget: int,
    repeats: int,
    states: list[dict] | None = None,
    n_compacted: int = 0,
    stats: torch.Tensor | None = None,
) -> tuple[float, float, int, int]:
    """Medians of wall and CPU ms of `compression_step` on fresh copies of the pool (it compacts in place)
    and of `states` (and `stats`); the kept count; the peak transient memory of one more step (bytes)."""
    work: list[Region] = []
    st: list[list[dict] | None] = [None]
    sb: list[torch.Tensor | None] = [None]
    kept: list[int] = []

    def reset() -> None:
        work[:] = [Region(r.k_buffer.clone(), r.v_buffer.clone(), r.q) for r in regs]
        st[0] = [dict(d) for d in states] if states is not None else None
        sb[0] = stats.clone() if stats is not None else None

    def step() -> None:
        kept.append(compression_step(policy, work, slots, o_proj, budget, st[0], n_compacted, sb[0]))

    wall, cpu = wall_cpu_ms(step, repeats, reset)
    reset()
    peak = peak_transient_bytes(step)
    return wall, cpu, kept[-1], peak


def steady_state(
    policy: Policy,
    regs: list[Region],
    slots: torch.Tensor,
    o_proj: list[torch.Tensor],
    n: int,
    period: int,
    stats: torch.Tensor | None = None,
) -> tuple[list[dict], int, int] | None:
    """A decode-time step's input: the region's first n - period tokens were kept by the previous
    compression (its per-layer state is returned), `period` tokens arrived since; the budget keeps all
    but `period` candidates. None when the policy's trigger would not fire there."""
    cfg = policy.config
    n_sink = min(cfg.sinks, n)
    n_recent = min(cfg.recent, n - n_sink)
    n_prev = n - period
    budget = n - period - n_sink - n_recent
    if not policy.should_compress(n, n_sink, n_recent, n_prev, budget, "decode"):
        return None
    states: list[dict] = [{} for _ in regs]
    prev = [Region(r.k_buffer.clone(), r.v_buffer.clone(), r.q) for r in regs]
    # keeps all n_prev tokens (on a copy of `stats`, which it would otherwise compact)
    sc = stats.clone() if stats is not None else None
    compression_step(policy, prev, slots[:n_prev], o_proj, n_prev, states, stats=sc)
    return states, budget, n_prev


def written_stats(regs: list[Region], slots: torch.Tensor, o_proj: list[torch.Tensor]) -> torch.Tensor:
    """`[layers, pool, Hkv]` per-slot ||v W_O||_1 as the forward pass leaves it (NaN elsewhere): what
    `slotstats.before_attention` writes for each value, computed here once, outside the timed step."""
    pool, h = regs[0].v_buffer.shape[0], regs[0].v_buffer.shape[1]
    stats = torch.full((len(regs), pool, h), float("nan"))
    for layer, r in enumerate(regs):
        stats[layer, slots] = kernels.vo_norms_rows(r.v_buffer[slots], o_proj[layer].float()).t()
    return stats


def hook_ms(regs: list[Region], o_proj: list[torch.Tensor], tokens: int, repeats: int) -> tuple[float, float]:
    """Median wall and CPU ms of the statistic's forward-pass work for `tokens` new tokens on every layer
    (`slotstats.record`: norms of the values and one index copy per layer), as the hook runs it."""
    w = [x.float() for x in o_proj]  # the hook's cached fp32 slices (`slotstats.setup` on CPU)
    pool, h, d = regs[0].v_buffer.shape
    stats = torch.full((len(regs), pool, h), float("nan"))
    gen = torch.Generator().manual_seed(1)
    loc = torch.randperm(pool, generator=gen)[:tokens]
    vals = [r.v_buffer[loc].clone() for r in regs]

    def step() -> None:
        for layer in range(len(regs)):
            slotstats.record(stats, layer, vals[layer], loc, w[layer])

    return wall_cpu_ms(step, repeats)


def trigger_period(policy: Policy) -> tuple[int, str]:
    """Decode steps between two compressions in steady state, with a fixed token budget.

    Default trigger: `n_cand > budget + interval`, so interval + 1 tokens after the last step. LagKV (also
    as a refiner's base): its raw tail reaches 2L again L tokens after a step.
    """
    base = getattr(policy, "base", policy)
    if isinstance(base, LagKVPolicy):
        return base.config.lag, f"L={base.config.lag}"
    return policy.config.interval + 1, f"interval+1={policy.config.interval + 1}"


def decode_ms(m: Model, n: int, repeats: int) -> tuple[float, float]:
    """Median wall and CPU ms of one single-token forward with an n-token cache (cropped back after each)."""
    m.cache.crop(n - m.cache.get_seq_length())  # negative: drop tokens beyond n
    assert m.cache.get_seq_length() == n
    tok = m.ids[None, n : n + 1]

    def step() -> None:
        with torch.inference_mode():
            m.model(input_ids=tok, past_key_values=m.cache, use_cache=True)

    return wall_cpu_ms(step, repeats, setup=lambda: m.cache.crop(n - m.cache.get_seq_length()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="region sizes N (tokens)")
    parser.add_argument(
        "--budget", type=float, default=0.5, help="budget: ratio of the region (or tokens > 1)"
    )
    parser.add_argument("--policies", nargs="+", default=[p for p in policies.available() if p != "none"])
    parser.add_argument("--repeats", type=int, default=5, help="timed compression steps per cell")
    parser.add_argument("--decode-repeats", type=int, default=20, help="timed decode steps per size")
    parser.add_argument("--decode-threads", type=int, default=0, help="torch threads for decode (0: default)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    parser.add_argument("--append", action="store_true", help="append to --out instead of overwriting it")
    parser.add_argument("--no-steady", action="store_true", help="skip the decode-time (second) compression")
    parser.add_argument(
        "--slot-stats",
        action="store_true",
        help="also time criticalkv reading the per-slot ||v W_O||_1 the forward wrote ('criticalkv-slotstats', "
        "the server's path) and the forward-pass cost of writing it",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="also time the earlier implementations in the same run: graphkv's dense neighbour search "
        "('graphkv-dense') and criticalkv recomputing every norm at a decode-time step ('criticalkv-recompute')",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sizes = sorted(set(args.sizes))
    if sizes[0] < W + 64:
        raise SystemExit(f"sizes must be >= {W + 64}")
    default_threads = torch.get_num_threads()
    decode_threads = args.decode_threads or default_threads
    compress_threads = THREADS or default_threads
    load_before = os.getloadavg()
    rss_exact = exact_rss()

    torch.set_num_threads(decode_threads)
    m = prefill(sizes[-1])
    o_proj = o_proj_slices(m)
    gen = torch.Generator().manual_seed(0)
    data = {n: regions(m, n, gen) for n in sizes}
    dec: dict[int, tuple[float, float]] = {}
    for n in reversed(sizes):  # crop only shrinks the cache
        dec[n] = decode_ms(m, n, args.decode_repeats)
        log(
            f"decode step at {n} tokens: {dec[n][0]:.2f} ms wall, {dec[n][1]:.2f} ms CPU ({decode_threads} threads)"
        )

    torch.set_num_threads(compress_threads)
    rows: list[tuple[str, str, int, int, float, float, float, float, float, str]] = []
    names = list(args.policies)
    for base, old in (
        ("graphkv", "graphkv-dense"),
        ("criticalkv", "criticalkv-recompute"),
    ):
        if args.side_by_side and base in names:
            names.insert(names.index(base) + 1, old)
    if args.slot_stats and "criticalkv" in names:
        names.insert(names.index("criticalkv") + 1, "criticalkv-slotstats")
    for label in names:
        name = label.split("-")[0]
        graph_mod.source_neighbors = (
            graph_mod.source_neighbors_dense if label == "graphkv-dense" else streamed_neighbors
        )
        policy = policies.build(name)
        period, period_txt = trigger_period(policy)
        for n in sizes:
            regs, slots = data[n]
            budget = KvConfig(policy=name, budget=args.budget).resolve_budget(n)
            cfg = policy.config
            n_sink = min(cfg.sinks, n)
            dw, dc = dec[n]
            stats = written_stats(regs, slots, o_proj) if label == "criticalkv-slotstats" else None
            if label == "criticalkv-recompute":  # its first step is criticalkv's: nothing cached yet
                pass
            elif not policy.should_compress(n, n_sink, min(cfg.recent, n - n_sink), 0, budget, "prefill"):
                log(f"{label} N={n}: trigger does not fire; skipped")
            else:
                ms, cpu, kept, peak = time_step(
                    policy, regs, slots, o_proj, budget, args.repeats, stats=stats
                )
                rows.append(("first", label, n, kept, ms, cpu, peak / 2**20, ms / dw, cpu / dc, period_txt))
                log(
                    f"{label} N={n} first: {ms:.1f} ms ({cpu:.1f} CPU), kept {kept}/{n}, peak {peak / 2**20:.1f} MiB"
                )
            if args.no_steady:
                continue
            st = steady_state(policy, regs, slots, o_proj, n, period, stats)
            if st is None:
                log(f"{label} N={n}: no decode-time step with {period} new tokens; skipped")
                continue
            states, sbudget, n_prev = st
            if label == "criticalkv-recompute":
                states = [{k: v for k, v in d.items() if not k.startswith("vo")} for d in states]
            ms, cpu, kept, peak = time_step(
                policy, regs, slots, o_proj, sbudget, args.repeats, states, n_prev, stats
            )
            rows.append(("decode", label, n, kept, ms, cpu, peak / 2**20, ms / dw, cpu / dc, period_txt))
            log(
                f"{label} N={n} decode-time: {ms:.1f} ms ({cpu:.1f} CPU), kept {kept}/{n}, peak {peak / 2**20:.1f} MiB"
            )

    hook_rows: list[tuple[int, int, float, float]] = []
    if args.slot_stats:
        torch.set_num_threads(decode_threads)  # it runs inside the forward pass, on the decode's threads
        regs = data[sizes[-1]][0]
        for t in (1, PREFILL_CHUNK):
            hw, hc = hook_ms(regs, o_proj, t, max(5, args.decode_repeats))
            hook_rows.append((sizes[-1], t, hw, hc))
            log(f"slot statistic in the forward: {t} tokens x 30 layers: {hw:.2f} ms wall, {hc:.2f} ms CPU")
    load_after = os.getloadavg()
    command = " ".join(["HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py", *sys.argv[1:]])
    lines = [
        "# Compression step vs decode step (SmolLM2-135M, CPU)\n",
        f"Command: `{command}`\n",
        f"- torch {torch.__version__}, {os.cpu_count()} CPUs; compression threads {compress_threads}, "
        f"decode threads {decode_threads} (torch default {default_threads})",
        f"- load average (1, 5, 15 min): before {fmt_load(load_before)}, after {fmt_load(load_after)}",
        "- other load on the machine inflates the wall columns, the multi-threaded decode step most (its OpenMP "
        "threads wait on each other when a core is busy): compare with `--decode-threads 1`. The CPU columns "
        "(process CPU time) count only what the step itself ran, so their ratio is the steadier one under load",
        "- 30 layers, Hkv=3, Hq=9, D=64, bf16; real SmolLM2 K/V/queries/W_O (pydoc text); region = whole "
        f"context (no shared prefix); W={W}; default policy configs (graphkv and criticalkv over snapkv)",
        f"- step `first`: the first compression of a fresh region of N tokens (n_compacted=0), budget {args.budget} "
        "x N candidate tokens kept beyond sinks 4 + recent 32 (kept = per-head count after the step). Step "
        "`decode`: a decode-time compression: the region's first N - period tokens were kept by the previous "
        "compression (whose policy state, e.g. carried scores and CriticalKV's cached norms, it reuses) and "
        "period tokens arrived since; it evicts period tokens per head. lagkv has none at this period (its "
        "trigger is its 2L tail)",
        "- ms: median of one full step (window attention + select for 30 layers + merge (d2o) + compact); "
        "decode step: median single-token HF forward with a DynamicCache of N tokens",
        "- peak MiB: peak resident memory above the step's start during one step (glibc mmap threshold 64 KiB "
        f"so freed tensors leave RSS at once{'' if rss_exact else '; NOT set here, so an underestimate'}): "
        "window attention, scores, graph blocks, norms, compaction; the pool itself is not counted",
        "- period: default trigger `n_cand > budget + interval` fires every interval+1 = 17 decode steps with "
        "a fixed token budget; lagkv every L = 128 tokens. A ratio budget grows with the request and fires "
        "less often.\n",
        "| step | policy | region N | kept | ms (30 layers) | CPU ms | peak MiB | ratio to decode step (wall) "
        "| ratio (CPU) | period |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for step, name, n, kept_n, ms, cpu, peak_mib, ratio, cratio, ptxt in rows:
        lines.append(
            f"| {step} | {name} | {n} | {kept_n} | {ms:.1f} | {cpu:.1f} | {peak_mib:.1f} | {ratio:.2f} "
            f"| {cratio:.2f} | {ptxt} |"
        )
    lines.append("")
    lines.append("| region N | decode step ms (wall) | decode step CPU ms |")
    lines.append("|---:|---:|---:|")
    for n in sizes:
        lines.append(f"| {n} | {dec[n][0]:.2f} | {dec[n][1]:.2f} |")
    if hook_rows:
        lines.append("")
        lines.append(
            "Per-slot ||v W_O||_1 written in the forward pass (`slotstats.record` on 30 layers: the norms of "
            "the new values and one index copy per layer; decode threads), beside the decode step at N:"
        )
        lines.append("")
        lines.append(
            "| new tokens in the forward | ms (wall) | CPU ms | CPU ms per token | per token, in decode steps (CPU) |"
        )
        lines.append("|---:|---:|---:|---:|---:|")
        for n, t, hw, hc in hook_rows:
            lines.append(f"| {t} | {hw:.2f} | {hc:.2f} | {hc / t:.3f} | {hc / t / dec[n][1]:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + text)
        log(f"wrote {args.out}")


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
