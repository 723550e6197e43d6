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
(`KvConfig.resolve_budget`, a ratio of the region). Median of --repeats after one warm-up, both columns.

Run (from the repo root; results/bench_policies.md holds both tables, torch's default decode threads and
one decode thread, since on a loaded 2-core machine the default can be many times slower):
    HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py --out results/bench_policies.md
    HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py --decode-threads 1 --out results/bench_policies.md --append
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sgl_kvevict import kernels, policies
from sgl_kvevict.compressor import THREADS, select_layers
from sgl_kvevict.config import KvConfig
from sgl_kvevict.policies import LayerView, Policy
from sgl_kvevict.policies.lagkv import LagKVPolicy

MODEL = "/root/.cache/sgl-kvevict/models/SmolLM2-135M-Instruct-v1"
SIZES = (512, 2048, 8192)
W = 32
PREFILL_CHUNK = 1024
DTYPE = torch.bfloat16


def log(msg: str) -> None:
    print(f"[bench_policies {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_ms(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    """Median wall time in ms over `repeats` runs after one warm-up."""
    return statistics.median(times_ms(fn, repeats, setup))


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
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=DTYPE, attn_implementation="sdpa").eval()
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
    policy: Policy, regs: list[Region], slots: torch.Tensor, o_proj: list[torch.Tensor], budget: int
) -> int:
    """One step on a private region, as `compressor.compress` runs it; returns the kept count."""
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
            n_compacted=0,
            attn=kernels.window_attention(r.q, r.k_buffer, slots, scale, causal=True)
            if "attn" in needs
            else None,
            o_proj=o_proj[layer] if "o_proj" in needs else None,
            state={},
        )
        for layer, r in enumerate(regs)
    ]
    keeps = select_layers(policy, views, budget)
    keep = torch.stack(keeps).to(torch.int64)
    if policy.merges:
        for v, kp in zip(views, keeps, strict=True):
            policy.merge(v, kp)
    kernels.compact([r.k_buffer for r in regs], [r.v_buffer for r in regs], slots, keep)
    return int(keep.shape[2])


def time_step(
    policy: Policy,
    regs: list[Region],
    slots: torch.Tensor,
    o_proj: list[torch.Tensor],
    budget: int,
    repeats: int,
) -> tuple[float, int]:
    """Median ms of `compression_step` on fresh copies of the pool (it compacts in place); kept count."""
    work: list[Region] = []
    kept: list[int] = []

    def reset() -> None:
        work[:] = [Region(r.k_buffer.clone(), r.v_buffer.clone(), r.q) for r in regs]

    ms = median_ms(lambda: kept.append(compression_step(policy, work, slots, o_proj, budget)), repeats, reset)
    return ms, kept[-1]


def trigger_period(policy: Policy) -> tuple[int, str]:
    """Decode steps between two compressions in steady state, with a fixed token budget.

    Default trigger: `n_cand > budget + interval`, so interval + 1 tokens after the last step. LagKV (also
    as a refiner's base): its raw tail reaches 2L again L tokens after a step.
    """
    base = getattr(policy, "base", policy)
    if isinstance(base, LagKVPolicy):
        return base.config.lag, f"L={base.config.lag}"
    return policy.config.interval + 1, f"interval+1={policy.config.interval + 1}"


def decode_ms(m: Model, n: int, repeats: int) -> float:
    """Median time of one single-token forward with an n-token cache (cropped back after each)."""
    m.cache.crop(n - m.cache.get_seq_length())  # negative: drop tokens beyond n
    assert m.cache.get_seq_length() == n
    tok = m.ids[None, n : n + 1]

    def step() -> None:
        with torch.inference_mode():
            m.model(input_ids=tok, past_key_values=m.cache, use_cache=True)

    return median_ms(step, repeats, setup=lambda: m.cache.crop(n - m.cache.get_seq_length()))


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
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sizes = sorted(set(args.sizes))
    if sizes[0] < W + 64:
        raise SystemExit(f"sizes must be >= {W + 64}")
    default_threads = torch.get_num_threads()
    decode_threads = args.decode_threads or default_threads
    compress_threads = THREADS or default_threads
    load_before = os.getloadavg()

    torch.set_num_threads(decode_threads)
    m = prefill(sizes[-1])
    o_proj = o_proj_slices(m)
    gen = torch.Generator().manual_seed(0)
    data = {n: regions(m, n, gen) for n in sizes}
    dec: dict[int, float] = {}
    for n in reversed(sizes):  # crop only shrinks the cache
        dec[n] = decode_ms(m, n, args.decode_repeats)
        log(f"decode step at {n} tokens: {dec[n]:.2f} ms ({decode_threads} threads)")

    torch.set_num_threads(compress_threads)
    rows: list[tuple[str, int, int, float, float, float, float, str]] = []
    for name in args.policies:
        policy = policies.build(name)
        period, period_txt = trigger_period(policy)
        for n in sizes:
            regs, slots = data[n]
            budget = KvConfig(policy=name, budget=args.budget).resolve_budget(n)
            cfg = policy.config
            n_sink = min(cfg.sinks, n)
            if not policy.should_compress(n, n_sink, min(cfg.recent, n - n_sink), 0, budget, "prefill"):
                log(f"{name} N={n}: trigger does not fire; skipped")
                continue
            ms, kept = time_step(policy, regs, slots, o_proj, budget, args.repeats)
            ratio = ms / dec[n]
            rows.append((name, n, kept, ms, dec[n], ratio, ratio / period, period_txt))
            log(f"{name} N={n}: {ms:.1f} ms, kept {kept}/{n}, ratio {ratio:.2f}")

    load_after = os.getloadavg()
    command = " ".join(["HF_HUB_OFFLINE=1 python benchmarks/bench_policies.py", *sys.argv[1:]])
    lines = [
        "# Compression step vs decode step (SmolLM2-135M, CPU)\n",
        f"Command: `{command}`\n",
        f"- torch {torch.__version__}, {os.cpu_count()} CPUs; compression threads {compress_threads}, "
        f"decode threads {decode_threads} (torch default {default_threads})",
        f"- load average (1, 5, 15 min): before {fmt_load(load_before)}, after {fmt_load(load_after)}",
        "- other load on the machine inflates both columns, the multi-threaded decode step most (its OpenMP "
        "threads wait on each other when a core is busy): compare with `--decode-threads 1`",
        "- 30 layers, Hkv=3, Hq=9, D=64, bf16; real SmolLM2 K/V/queries/W_O (pydoc text); region = whole "
        f"context (no shared prefix); budget {args.budget} x N candidate tokens kept beyond sinks 4 + recent 32 "
        "(kept = per-head count after the step); "
        f"W={W}; default policy configs (graphkv and criticalkv over snapkv)",
        "- compress ms: median of one full step (window attention + select for 30 layers + merge (d2o) + "
        "compact), fresh region (first compression, n_compacted=0); decode step ms: median single-token "
        "HF forward with a DynamicCache of N tokens",
        "- amortized = ratio / trigger period, assuming a fixed token budget in steady decode and that a "
        "decode-time step costs what this step costs at the same N (it re-scores the whole region; it compacts "
        "fewer tokens). Period: default trigger `n_cand > budget + interval` fires every interval+1 = 17 decode "
        "steps; lagkv every L = 128 tokens, where a decode-time step scores one partition instead of all, so "
        "its amortized value is an upper bound. A ratio budget grows with the request and fires less often.\n",
        "| policy | region N | kept | compress ms (30 layers) | decode step ms | ratio (compress/decode) "
        "| period | amortized ratio per decode step |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, n, kept_n, ms, dms, ratio, amort, ptxt in rows:
        lines.append(
            f"| {name} | {n} | {kept_n} | {ms:.1f} | {dms:.2f} | {ratio:.2f} | {ptxt} | {amort:.4f} |"
        )
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
