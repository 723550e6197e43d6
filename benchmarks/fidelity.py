"""Fidelity of each policy's selection on a real model: next-token distributions with evicted positions
masked out vs the full cache (SmolLM2-135M-Instruct, HF transformers, fp32, CPU).

Why masking: it isolates the *choice* of tokens (and D2O's merged K/V) from the serving machinery. True
position ids are kept (the cache is never shortened), exactly as the server keeps logical positions.

Protocol: a deterministic ~2K-token operations log (generated below from a seeded RNG, with one fact
planted early) is prefilled; post-RoPE K/V come from the cache, the last `window` queries of each layer
are captured inside the attention function (window attention is causal). Every policy then selects, on every layer, 50% of the
context (sinks + recent 32 + candidate budget; LagKV keeps what its per-partition ratio gives, capped by the
same budget, as on the server), question-agnostically (the question is not seen). The question plus the full-cache
greedy answer are then teacher-forced over the masked cache; the table reports the mean KL(full || policy)
over those positions, the top-1 agreement with the full cache, and whether the policy's greedy answer
still contains the planted fact.

    HF_HUB_OFFLINE=1 /root/.cache/sgl-kvevict/venv-dca1c6560ddb/bin/python benchmarks/fidelity.py

Options: --tokens (context length, default 2048), --ratio (kept fraction, default 0.5), --policies a,b.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from sgl_kvevict import policies as P
from sgl_kvevict.kernels import window_attention
from sgl_kvevict.model import default_model_path
from sgl_kvevict.policies.base import LayerView
from sgl_kvevict.tools import oracle

MODEL = str(default_model_path())
SINKS, RECENT, WINDOW = 4, 32, 32

POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("none", "none", {}),
    ("streaming", "streaming", {}),
    ("knorm", "knorm", {}),
    ("h2o", "h2o", {}),
    ("snapkv", "snapkv", {}),
    ("lagkv", "lagkv", {}),
    ("lagkv sinks=16", "lagkv", {"sinks": 16}),
    ("lagkv r=budget", "lagkv", {"ratio_from_budget": True}),
    ("lagkv no-cap", "lagkv", {"cap_to_budget": False}),
    ("lagkv L=64", "lagkv", {"lag": 64}),
    ("d2o", "d2o", {}),
    ("d2o no-merge", "d2o", {"merge": False}),
    ("d2o accumulated", "d2o", {"scores": "accumulated"}),
    ("d2o thr=mean", "d2o", {"threshold": "mean"}),
    ("graphkv/snapkv", "graphkv", {}),
    ("graphkv/knorm", "graphkv", {"base": "knorm"}),
    ("graphkv/lagkv", "graphkv", {"base": "lagkv"}),
    ("criticalkv/snapkv", "criticalkv", {}),
    ("criticalkv/h2o", "criticalkv", {"base": "h2o"}),
]

# -- the deterministic prompt -------------------------------------------------------------------------

NAMES = ["alice", "bruno", "chen", "dana", "emeka", "farah", "goran", "hana", "ivan", "juno", "kofi", "lena"]
HOSTS = ["db-1", "db-2", "web-3", "web-4", "cache-5", "queue-6", "batch-7", "auth-8"]
EVENTS = [
    "{u} restarted the {h} service after a failed health check",
    "{u} rotated the TLS certificate on {h}",
    "backup of {h} finished in {n} seconds",
    "{u} opened ticket #{n} about slow queries on {h}",
    "disk usage on {h} reached {p} percent",
    "{u} deployed build {n} to {h}",
    "alert on {h}: p99 latency {n} ms",
    "{u} closed ticket #{n}; root cause was a stale DNS entry for {h}",
    "cron job on {h} skipped because the lock file was present",
    "{u} increased the connection pool on {h} to {p}",
]


def make_context(rng: random.Random, n_lines: int) -> str:
    lines = [
        "Operations log of the Northwind cluster. Read it carefully; questions follow.",
        "Note from the on-call lead: the emergency vault code for this week is 4817, keep it private.",
    ]
    for i in range(n_lines):
        ev = rng.choice(EVENTS).format(
            u=rng.choice(NAMES), h=rng.choice(HOSTS), n=rng.randint(10, 9999), p=rng.randint(40, 99)
        )
        lines.append(f"[day {1 + i // 40} {8 + (i % 40) // 4:02d}:{(i * 7) % 60:02d}] {ev}.")
    return "\n".join(lines) + "\n"


QUESTION = "\nQuestion: what is the emergency vault code for this week?\nAnswer: The emergency vault code is"
FACT = "4817"


# -- masked attention: sgl_kvevict.tools.oracle (shared with the eviction-path oracle test) ----------------------


def cache_from(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    return cache


def forward_suffix(
    model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor, masks: Any
) -> torch.Tensor:
    with torch.no_grad(), oracle.masking(oracle.PastMask(masks)):
        out = model(input_ids=ids, past_key_values=cache_from(kv), use_cache=True)
    return out.logits[0].float()


def greedy(
    model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], prompt: torch.Tensor, masks: Any, steps: int
) -> list[int]:
    """Greedy continuation of `prompt` over the (masked) context cache."""
    cache = cache_from(kv)
    ids, out = prompt, []
    with torch.no_grad(), oracle.masking(oracle.PastMask(masks)):
        for _ in range(steps):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--policies", default="", help="comma-separated labels (default: all)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=NAME:JSON",
        help="an extra row, e.g. 'graphkv clamp=graphkv:{\"clamp_similarity\": true}' (repeatable)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = oracle.load_model(MODEL)
    cfg = model.config
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    text, n_lines = "", 20
    while len(tok(text).input_ids) < args.tokens:  # same seed each time: a prefix-stable log
        n_lines += 10
        text = make_context(random.Random(1234), n_lines)
    ctx = torch.tensor([tok(text).input_ids[: args.tokens]])
    n = ctx.shape[1]
    q_ids = torch.tensor([tok(QUESTION, add_special_tokens=False).input_ids])
    print(f"context {n} tokens, question {q_ids.shape[1]} tokens; prefill ...", flush=True)

    t0 = time.time()
    capture = oracle.PastMask(capture_window=WINDOW)  # no masks: the last W queries of every layer
    with torch.no_grad(), oracle.masking(capture):
        out = model(input_ids=ctx, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    print(f"prefill done in {time.time() - t0:.1f}s; {len(kv)} layers", flush=True)

    answer = greedy(model, kv, q_ids, None, 12)
    print(f"full-cache answer: {tok.decode(answer)!r}", flush=True)
    suffix = torch.cat([q_ids, torch.tensor([answer])], dim=1)
    ref = forward_suffix(model, kv, suffix, None)
    ref_logp = ref.log_softmax(-1)

    o_proj = [
        layer.self_attn.o_proj.weight.detach().T.reshape(hq, hd, -1).contiguous()
        for layer in model.model.layers
    ]
    scale = hd**-0.5
    wanted = {x.strip() for x in args.policies.split(",") if x.strip()}

    # LagKV at the same kept fraction: solve r from Eq. 13 (k = int(r*L) per partition)
    lag = 128
    parts = (n - SINKS) // lag
    k = max(1, round((args.ratio * n - SINKS - lag - (n - SINKS) % lag) / max(1, parts - 1)))
    policies = [*POLICIES, (f"lagkv r={k}/{lag}", "lagkv", {"ratio": (k + 0.5) / lag})]
    for spec in args.variant:
        label, _, rest = spec.partition("=")
        name, _, js = rest.partition(":")
        policies.append((label, name, json.loads(js or "{}")))
        if wanted:  # a --policies filter still runs the variants asked for
            wanted.add(label)

    rows = []
    for label, name, pcfg in policies:
        if wanted and label not in wanted and name not in wanted:
            continue
        t1 = time.time()
        pol = P.build(name, {"sinks": SINKS, "recent": RECENT, "window": WINDOW, **pcfg}).for_budget_ratio(
            args.ratio
        )
        sinks = pol.config.sinks
        cand_budget = max(0, round(args.ratio * n) - sinks - RECENT)
        masks, new_kv, kept = [], [], 0
        for li, (k, v) in enumerate(kv):
            kb = k[0].transpose(0, 1).contiguous()  # [N, Hkv, D]
            vb = v[0].transpose(0, 1).contiguous()
            slots = torch.arange(n)
            attn = (
                window_attention(capture.queries[li], kb, slots, scale, causal=True)
                if "attn" in pol.needs
                else None
            )
            view = LayerView(li, kb, vb, slots, sinks, RECENT, 0, attn=attn, o_proj=o_proj[li])
            if name == "none" or not pol.should_compress(n, sinks, RECENT, 0, cand_budget, "prefill"):
                keep = torch.arange(n).expand(hkv, -1)
            else:
                keep = pol.select(view, cand_budget)
                pol.merge(view, keep)
            mask = torch.zeros(hkv, n, dtype=torch.bool)
            mask.scatter_(1, keep, True)
            masks.append(mask)
            kept += keep.shape[1]
            new_kv.append((kb.transpose(0, 1).unsqueeze(0), vb.transpose(0, 1).unsqueeze(0)))
        logits = forward_suffix(model, new_kv, suffix, masks)
        logp = logits.log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
        ans = tok.decode(greedy(model, new_kv, q_ids, masks, 6))
        frac = kept / (len(kv) * hkv * n) * hkv
        rows.append((label, frac, float(kl.mean()), float(kl.max()), float(agree), FACT in ans, ans))
        print(
            f"  {label:<18} kept {frac:6.1%}  KL {float(kl.mean()):.4f}  top1 {float(agree):.3f}  answer {ans!r}  ({time.time() - t1:.1f}s)",
            flush=True,
        )

    print(
        f"\nSmolLM2-135M-Instruct fp32, context {n} tokens, budget {args.ratio:.0%} (sinks {SINKS}, recent {RECENT}, window {WINDOW})"
    )
    print(f"positions scored: {suffix.shape[1]} (question + full-cache greedy answer)\n")
    print(f"| {'policy':<18} | kept   | mean KL | max KL | top-1 agree | recalls {FACT} |")
    print(f"|{'-' * 20}|--------|---------|--------|-------------|---------------|")
    for label, frac, kl_m, kl_x, ag, ok, _ in rows:
        print(
            f"| {label:<18} | {frac:6.1%} | {kl_m:7.4f} | {kl_x:6.3f} | {ag:11.3f} | {'yes' if ok else 'no':<13} |"
        )


if __name__ == "__main__":
    main()
