"""Peer cross-check against NVIDIA's kvpress: the kept sets and the fidelity of knorm, streaming, snapkv,
lagkv and criticalkv, side by side with kvpress's presses of the same name, on the same SmolLM2 text.

    make bench-kvpress        # = scripts/kvpress_env.sh, then this script in the project's venv

Design. kvpress needs transformers<5.3, so it runs in its own venv (`scripts/kvpress_env.sh`) as a
subprocess (`benchmarks/kvpress_side.py`): it prefills each prompt under each press exactly as kvpress
does and writes, per layer and KV head, the positions the press kept (read from the press's own output).
This side prefills the same token ids once with HF transformers (fp32, the oracle's eager attention,
capturing the last window queries), runs the project's policies on those K/V exactly as the server's
compressor does (`LayerView`, `select`), and then evaluates *both* kept sets the same way: the cache is
masked to the kept positions (true positions, as kvpress's pipeline keeps them), the question plus the
full-cache greedy answer are teacher-forced, and the table gives the mean KL(full || compressed) of the
next-token distributions over those positions, and whether the greedy answer still has the fact.

Each policy is compared twice: `default` (each side's own defaults, the budget read as each side reads a
ratio) and `matched` (the project's config set to kvpress's definition: its sinks, window, ratio
semantics), so a disagreement in `default` that vanishes in `matched` is explained by the named setting.
Overlap = |project kept & kvpress kept| / max(sizes), per layer and KV head; mean and min over them.

Prompts: `chat`, a recall chat rendered with the chat template (a fact in the first user turn, filler
notes after it, each answered "Noted."), and `log`, fidelity.py's operations log (a vault code planted in
its second line). SmolLM2-135M loses a chat fact after a few filler turns even with the full cache, so
the chat is short (`--filler-turns 3`); the full-cache row says whether the fact is recalled at all.

`--recall-sessions N` adds the LagKV recall study: N operations logs (each its own lines and vault code,
`--study-tokens` long) compressed once query-agnostically; kvpress's LagKV with its own decoding, the
same kept sets under the masked evaluation, the project's lagkv, and the variants that isolate the
difference (no chunk recursion; kvpress's per-partition count), with the share of the fact's tokens kept.

Options: --ratios 0.5,0.25, --policies knorm,..., --tokens, --filler-turns, --recall-sessions,
--study-tokens, --out DIR (default results/kvpress-crosscheck: table.md and check.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity  # noqa: E402  (the generic operations-log prompt and the masked forwards)

from sgl_kvevict import policies as P  # noqa: E402
from sgl_kvevict.kernels import window_attention  # noqa: E402
from sgl_kvevict.model import default_model_path  # noqa: E402
from sgl_kvevict.policies.base import LayerView  # noqa: E402
from sgl_kvevict.scenarios import recall  # noqa: E402
from sgl_kvevict.scenarios.base import fill, rng_for  # noqa: E402
from sgl_kvevict.tools import oracle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(default_model_path())
ANSWER_TOKENS = 12  # teacher-forced answer length for the KL, and greedy length for recall
POLICIES = ["knorm", "streaming", "snapkv", "lagkv", "criticalkv"]
# kvpress's defaults (read from kvpress 0.5.5's source): SnapKV window 64, kernel 5; sinks 4 for
# StreamingLLM and LagKV, none for Knorm/SnapKV/CriticalKV; LagKV lag 128; CriticalKV first stage 0.5.
KV_WINDOW, KV_SINKS, KV_LAG = 64, 4, 128


# -- prompts --------------------------------------------------------------------------------------------


def recall_chat(
    tok: Any, session: int, filler_turns: int = 12, filler_tokens: int = 150, variant: str = "noted"
) -> dict[str, Any]:
    """A recall chat rendered with the model's chat template: the fact in the first user turn, filler
    notes after it (each answered with a fixed short reply, so nothing is generated), then the question.
    Returns the context ids (compressed), the question ids (never compressed) and the expected value."""
    r = rng_for(0, "kvpress-recall", session)
    statement, question, value = recall._fact(r)
    msgs = [
        {"role": "user", "content": f"Remember this: {statement}."},
        {"role": "assistant", "content": "Okay, I will remember that."},
    ]
    for _ in range(filler_turns):
        topic = r.choice(recall.TOPICS)
        text = fill(r, filler_tokens, lambda r, t=topic: r.choice(recall.SENTENCES).format(t=t))
        if variant == "topic":
            msgs.append(
                {"role": "user", "content": f"Here is a note:\n{text}\nWhat is the topic of this note?"}
            )
            msgs.append({"role": "assistant", "content": f"The topic is {topic}."})
        else:
            msgs.append({"role": "user", "content": f"Here is a note to read:\n{text}"})
            msgs.append({"role": "assistant", "content": "Noted."})
    ctx = tok.apply_chat_template(msgs, tokenize=False)
    full = tok.apply_chat_template(
        [*msgs, {"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    if not full.startswith(ctx):
        raise RuntimeError("the chat template does not extend the history as a prefix")
    return {
        "ids": tok(ctx, add_special_tokens=False).input_ids,
        "question": tok(full[len(ctx) :], add_special_tokens=False).input_ids,
        "expect": value,
    }


def generic_prompt(tok: Any, tokens: int, session: int | None = None) -> dict[str, Any]:
    """fidelity.py's deterministic operations log (a vault code planted in its second line) and its
    question. `session` varies the log and the code (the recall study); None is fidelity.py's own text."""
    expect = fidelity.FACT
    seed = 1234
    if session is not None:
        seed = 1234 + 1 + session
        expect = str(rng_for(0, "kvpress-code", session).randint(1000, 9999))
    text, n_lines = "", 20
    while len(tok(text).input_ids) < tokens:
        n_lines += 10
        text = fidelity.make_context(random.Random(seed), n_lines).replace(fidelity.FACT, expect)
    return {
        "ids": tok(text).input_ids[:tokens],
        "question": tok(fidelity.QUESTION, add_special_tokens=False).input_ids,
        "expect": expect,
    }


# -- the two sides ----------------------------------------------------------------------------------------


def kvpress_python() -> str:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/kvpress_env.sh")], check=True, capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[-1]


def run_kvpress(
    py: str, prompts: dict[str, dict[str, Any]], cases: list[dict[str, Any]], dtype: str
) -> dict[str, Any]:
    """One subprocess in kvpress's venv for all cases; returns its kept sets and own answers."""
    with tempfile.TemporaryDirectory() as d:
        job = Path(d) / "job.json"
        out = Path(d) / "out.pt"
        sent = {k: {**v, "answer_tokens": ANSWER_TOKENS} for k, v in prompts.items()}
        job.write_text(json.dumps({"model": MODEL, "dtype": dtype, "prompts": sent, "cases": cases}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
        subprocess.run(
            [py, str(ROOT / "benchmarks/kvpress_side.py"), str(job), str(out)], check=True, env=env
        )
        return torch.load(out)


class Prefilled:
    """One prompt prefilled once: post-RoPE K/V per layer, the last window queries, W_O slices."""

    def __init__(self, model: Any, prompt: dict[str, Any], window: int) -> None:
        cfg = model.config
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.hq
        ids = torch.tensor([prompt["ids"]])
        self.n = ids.shape[1]
        cap = oracle.PastMask(capture_window=window)
        with torch.no_grad(), oracle.masking(cap):
            out = model(input_ids=ids, use_cache=True)
        self.kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self.queries = cap.queries
        self.o_proj = [
            layer.self_attn.o_proj.weight.detach().T.reshape(self.hq, self.hd, -1).contiguous()
            for layer in model.model.layers
        ]
        self.q_ids = torch.tensor([prompt["question"]])
        self.answer = fidelity.greedy(model, self.kv, self.q_ids, None, ANSWER_TOKENS)
        self.suffix = torch.cat([self.q_ids, torch.tensor([self.answer])], dim=1)
        self.ref_logp = fidelity.forward_suffix(model, self.kv, self.suffix, None).log_softmax(-1)

    def select(self, name: str, cfg: dict[str, Any], budget: int) -> torch.Tensor:
        """[L, Hkv, k] kept positions under the project's policy, as the compressor computes them."""
        pol = P.build(name, cfg)
        c = pol.config
        out = []
        for li, (k, v) in enumerate(self.kv):
            kb = k[0].transpose(0, 1).contiguous()  # [N, Hkv, D]
            vb = v[0].transpose(0, 1).contiguous()
            slots = torch.arange(self.n)
            attn = None
            if "attn" in pol.needs:
                q = self.queries[li][:, -c.window :]
                attn = window_attention(q, kb, slots, self.hd**-0.5, causal=True)
            view = LayerView(li, kb, vb, slots, c.sinks, c.recent, 0, attn=attn, o_proj=self.o_proj[li])
            if pol.should_compress(self.n, c.sinks, c.recent, 0, budget, "prefill"):
                out.append(pol.select(view, budget))
            else:
                out.append(torch.arange(self.n).expand(self.hkv, -1))
        return torch.stack(out)

    def evaluate(self, model: Any, tok: Any, kept: torch.Tensor, expect: str) -> dict[str, Any]:
        masks = []
        for keep in kept:
            m = torch.zeros(self.hkv, self.n, dtype=torch.bool)
            m.scatter_(1, keep, True)
            masks.append(m)
        logp = fidelity.forward_suffix(model, self.kv, self.suffix, masks).log_softmax(-1)
        kl = (self.ref_logp.exp() * (self.ref_logp - logp)).sum(-1)
        ans = tok.decode(fidelity.greedy(model, self.kv, self.q_ids, masks, ANSWER_TOKENS))
        return {"kl": float(kl.mean()), "answer": ans, "recall": recall.correct(ans, expect)}


def overlap(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[float, float]:
    """Per layer and head |a & b| / max(|a|, |b|): (mean, min)."""
    ma = torch.zeros(*a.shape[:2], n, dtype=torch.bool).scatter_(2, a, True)
    mb = torch.zeros(*b.shape[:2], n, dtype=torch.bool).scatter_(2, b, True)
    o = (ma & mb).sum(-1).float() / max(a.shape[-1], b.shape[-1])
    return float(o.mean()), float(o.min())


# -- the cases ---------------------------------------------------------------------------------------------


def lag_partition_keep(n: int, n_kept: int) -> tuple[int, int]:
    """kvpress LagKV at `n_kept` tokens: (full rank levels kept in every scored partition, tokens of the
    partial level). Its scores are within-partition ranks / lag, sinks and the tail score 1, and one
    global top-k over the sequence keeps the same top ranks in every partition."""
    parts = (n - KV_SINKS) // KV_LAG - 1  # scored partitions (the last full one is the tail's reference)
    tail = n - KV_SINKS - parts * KV_LAG
    m = max(0, n_kept - KV_SINKS - tail)
    return m // max(1, parts), m % max(1, parts)


def lag_matched(n: int, n_kept: int) -> tuple[dict[str, Any], int]:
    """The project's lagkv set to kvpress's selection at `n_kept`: no recent window beyond LagKV's own
    tail, k per partition; k = 0 (sinks and tail already fill the budget) is a zero budget."""
    k, _ = lag_partition_keep(n, n_kept)
    if k == 0:
        return {"recent": 0}, 0
    return {"recent": 0, "ratio": (k + 0.5) / KV_LAG, "cap_to_budget": False}, n


def cases_for(
    policy: str, ratio: float, n: int
) -> list[tuple[str, dict[str, Any], dict[str, Any], int, str]]:
    """(variant, kvpress kwargs, project config, project budget, why they may differ)."""
    n_kept = max(1, int(n * ratio))  # kvpress: int(k_len * (1 - compression_ratio))
    default_budget = max(
        0, round(ratio * n) - 4 - 32
    )  # the server's ratio budget, default sinks 4 + recent 32
    if policy == "knorm":
        return [
            (
                "default",
                {},
                {},
                default_budget,
                "project keeps sinks 4 + recent 32 unscored; kvpress scores all",
            ),
            ("matched", {}, {"sinks": 0, "recent": 0}, n_kept, "same definition"),
        ]
    if policy == "streaming":
        return [
            ("default", {}, {}, default_budget, "round vs int of ratio*N (at most 1 token)"),
            ("matched", {}, {}, n_kept - 36, "same definition"),
        ]
    if policy in ("snapkv", "criticalkv"):
        matched_cfg: dict[str, Any] = {"sinks": 0, "recent": KV_WINDOW, "window": KV_WINDOW}
        b = n_kept - KV_WINDOW
        why = "pooling edge: kvpress pools the scores of the first N-64 tokens only (zero-padded)"
        if policy == "criticalkv":
            # kvpress's stage 1 takes int(0.5 * n_kept) of all N, the 64 window tokens (top scores) included
            stage1 = int(n_kept * 0.5) - KV_WINDOW
            matched_cfg["alpha"] = min(1.0, max(0.0, (stage1 + 0.5) / max(1, b)))
            why += "; stage 1 = int(0.5 n_kept) - 64 window tokens (alpha set to match)"
        return [
            ("default", {}, {}, default_budget, "window 32 + sinks 4 vs kvpress window 64, no sinks"),
            ("matched", {}, matched_cfg, b, why),
        ]
    if policy == "lagkv":
        k, extra = lag_partition_keep(n, n_kept)
        cfg, budget = lag_matched(n, n_kept)
        return [
            (
                "default",
                {},
                {},
                default_budget,
                "project: int(0.5 L) per partition whatever the budget, then chunk recursion to the budget; "
                "kvpress: one global top-k of within-partition ranks, sinks and the raw tail served first",
            ),
            (
                "matched",
                {},
                cfg,
                budget,
                f"k={k} per partition both sides; kvpress adds {extra} tokens of the next rank level"
                if n_kept >= n - (n - KV_SINKS) // KV_LAG * KV_LAG + KV_LAG
                else "budget below sinks + raw tail: kvpress keeps n_kept of them in top-k tie order, "
                "no scored token; the project keeps sinks + tail",
            ),
        ]
    raise ValueError(policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratios", default="0.5,0.25")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--tokens", type=int, default=1536, help="operations-log prompt length")
    ap.add_argument("--filler-turns", type=int, default=3, help="recall chat: filler turns after the fact")
    ap.add_argument("--recall-sessions", type=int, default=12, help="LagKV recall study (0: skip)")
    ap.add_argument("--study-tokens", type=int, default=1024, help="LagKV recall study: log length")
    ap.add_argument("--skip-table", action="store_true", help="only the LagKV recall study")
    ap.add_argument("--out", default=str(ROOT / "results/kvpress-crosscheck"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    ratios = [float(x) for x in args.ratios.split(",")]
    pols = [p for p in args.policies.split(",") if p]
    bad = sorted(set(pols) - set(POLICIES))
    if bad:
        raise SystemExit(f"unknown policy {bad[0]!r}; valid: {', '.join(POLICIES)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    py = kvpress_python()
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = oracle.load_model(MODEL)
    prompts = {"chat": recall_chat(tok, 0, args.filler_turns), "log": generic_prompt(tok, args.tokens)}

    rows: list[dict[str, Any]] = []
    versions: dict[str, str] = {}
    if not args.skip_table:
        rows, versions = table(py, model, tok, prompts, pols, ratios)
    study = None
    if args.recall_sessions:
        study = lagkv_study(py, model, tok, args.recall_sessions, args.study_tokens, ratios)
    if study is not None:
        versions = versions or study.pop("_versions")
        study.pop("_versions", None)
    meta = {
        "versions": versions,
        "seconds": round(time.time() - t0),
        "model": "SmolLM2-135M-Instruct fp32",
    }
    (out_dir / "check.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "lagkv_recall": study}, indent=1)
    )
    report = render(rows, study, meta)
    (out_dir / "table.md").write_text(report)
    print(report)


def table(
    py: str, model: Any, tok: Any, prompts: dict[str, Any], pols: list[str], ratios: list[float]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The overlap/KL table: one kvpress press per (prompt, policy, ratio), two project variants each."""
    # kvpress side: one press per (prompt, policy, ratio); both variants compare against it
    kcases = [
        {"id": f"{pn}/{pol}/{r}", "prompt": pn, "press": pol, "ratio": r, "kwargs": {}}
        for pn in prompts
        for pol in pols
        for r in ratios
    ]
    print(f"[check] kvpress side: {len(kcases)} presses ...", flush=True)
    kv = run_kvpress(py, prompts, kcases, "float32")

    rows = []
    for pn, prompt in prompts.items():
        pre = Prefilled(model, prompt, KV_WINDOW)
        print(f"[check] {pn}: {pre.n} tokens; full-cache answer {tok.decode(pre.answer)!r}", flush=True)
        full = pre.evaluate(
            model, tok, torch.arange(pre.n).expand(len(pre.kv), pre.hkv, -1), prompt["expect"]
        )
        rows.append(
            {"prompt": pn, "policy": "none", "ratio": 1.0, "variant": "-", "n": pre.n, "kv": full, "pj": full}
        )
        for pol in pols:
            for r in ratios:
                kid = f"{pn}/{pol}/{r}"
                kkept = kv["kept"][kid]
                kv_eval = pre.evaluate(model, tok, kkept, prompt["expect"])
                kv_eval["own_answer"] = tok.decode(kv["answer"][kid])
                kv_eval["own_recall"] = recall.correct(kv_eval["own_answer"], prompt["expect"])
                for variant, _kw, cfg, budget, why in cases_for(pol, r, pre.n):
                    pkept = pre.select(pol, cfg, budget)
                    pj = pre.evaluate(model, tok, pkept, prompt["expect"])
                    mean, worst = overlap(pkept, kkept, pre.n)
                    row = {
                        "prompt": pn,
                        "policy": pol,
                        "ratio": r,
                        "variant": variant,
                        "n": pre.n,
                        "config": cfg,
                        "budget": budget,
                        "why": why,
                        "kept_kvpress": int(kkept.shape[-1]),
                        "kept_project": int(pkept.shape[-1]),
                        "overlap_mean": mean,
                        "overlap_min": worst,
                        "kv": kv_eval,
                        "pj": pj,
                    }
                    rows.append(row)
                    print(
                        f"  {pn:<7} {pol:<10} {r:<4} {variant:<7} kept {row['kept_project']}/{row['kept_kvpress']} "
                        f"overlap {mean:.3f} (min {worst:.3f})  KL pj {pj['kl']:.4f} kv {kv_eval['kl']:.4f}  "
                        f"recall pj {pj['recall']} kv {kv_eval['recall']} (kvpress own {kv_eval['own_recall']})",
                        flush=True,
                    )
    return rows, kv["versions"]


# -- the LagKV recall study ------------------------------------------------------------------------------


def lagkv_study(
    py: str, model: Any, tok: Any, sessions: int, tokens: int, ratios: list[float]
) -> dict[str, Any]:
    """Recall over `sessions` operations logs (each its own lines and vault code), compressed once,
    query-agnostic: kvpress's LagKV (its own decoding) vs the project's lagkv and the variants that
    isolate the difference."""
    prompts = {f"s{i}": generic_prompt(tok, tokens, i) for i in range(sessions)}
    kcases = [
        {"id": f"{s}/{r}", "prompt": s, "press": "lagkv", "ratio": r, "kwargs": {}}
        for s in prompts
        for r in ratios
    ]
    print(f"[study] kvpress LagKV on {sessions} operations logs ...", flush=True)
    kv = run_kvpress(py, prompts, kcases, "float32")
    tally: dict[str, list[int]] = {}
    kept_frac: dict[str, list[float]] = {}
    fact_kept: dict[str, list[float]] = {}

    def add(
        label: str, kept: torch.Tensor, pre: Prefilled, prompt: dict[str, Any], fact_pos: list[int]
    ) -> None:
        ev = pre.evaluate(model, tok, kept, prompt["expect"])
        tally.setdefault(label, []).append(int(ev["recall"]))
        kept_frac.setdefault(label, []).append(kept.shape[-1] / pre.n)
        m = torch.zeros(*kept.shape[:2], pre.n, dtype=torch.bool).scatter_(2, kept, True)
        fact_kept.setdefault(label, []).append(
            float(m[:, :, fact_pos].float().mean()) if fact_pos else float("nan")
        )

    for s, prompt in prompts.items():
        pre = Prefilled(model, prompt, KV_WINDOW)
        fact_pos = value_positions(tok, prompt)
        add("full cache", torch.arange(pre.n).expand(len(pre.kv), pre.hkv, -1), pre, prompt, fact_pos)
        for r in ratios:
            kid = f"{s}/{r}"
            own = recall.correct(tok.decode(kv["answer"][kid]), prompt["expect"])
            tally.setdefault(f"kvpress LagKVPress {r:.0%} (its own decoding)", []).append(int(own))
            add(f"kvpress LagKVPress {r:.0%} (masked)", kv["kept"][kid], pre, prompt, fact_pos)
            budget = max(0, round(r * pre.n) - 36)
            add(f"project lagkv {r:.0%} (default)", pre.select("lagkv", {}, budget), pre, prompt, fact_pos)
            add(
                f"project lagkv {r:.0%}, no chunk recursion",
                pre.select("lagkv", {"cap_to_budget": False}, budget),
                pre,
                prompt,
                fact_pos,
            )
            cfg, b = lag_matched(pre.n, max(1, int(pre.n * r)))
            add(
                f"project lagkv {r:.0%}, kvpress's per-partition k",
                pre.select("lagkv", cfg, b),
                pre,
                prompt,
                fact_pos,
            )
        print(f"[study] {s}: {pre.n} tokens, {tally['full cache'][-1]} full-cache recall", flush=True)
    out: dict[str, Any] = {
        label: {
            "recall": sum(v),
            "sessions": len(v),
            "kept": (sum(kept_frac[label]) / len(kept_frac[label])) if label in kept_frac else None,
            "fact_kept": (sum(fact_kept[label]) / len(fact_kept[label])) if label in fact_kept else None,
        }
        for label, v in tally.items()
    }
    out["_versions"] = kv["versions"]
    return out


def value_positions(tok: Any, prompt: dict[str, Any]) -> list[int]:
    """Context positions of the tokens spelling the planted value (first occurrence)."""
    ids = prompt["ids"]
    want = prompt["expect"]
    for i in range(len(ids)):
        for j in range(i + 1, min(len(ids), i + 8) + 1):
            text = tok.decode(ids[i:j])
            if want in text:
                lo = i
                while tok.decode(ids[lo + 1 : j]).find(want) >= 0:
                    lo += 1
                return list(range(lo, j))
    return []


def render(rows: list[dict[str, Any]], study: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    v = meta["versions"]
    lines = [
        f"kvpress {v.get('kvpress')} (transformers {v.get('transformers')}, torch {v.get('torch')}) vs this project, "
        f"{meta['model']}, {meta['seconds']} s under shared load.",
    ]
    if rows:
        lines += [
            "",
            "| prompt | policy | kept | variant | kept/head pj / kv | overlap mean (min) | KL pj | KL kv | recall pj / kv / kv own | why they differ |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    yn = {True: "y", False: "n"}
    for r in rows:
        if r["policy"] == "none":
            lines.append(
                f"| {r['prompt']} ({r['n']} tok) | full cache | 100% | - | - | - | 0 | 0 | {yn[r['pj']['recall']]} | |"
            )
            continue
        kvr = r["kv"]
        lines.append(
            f"| {r['prompt']} | {r['policy']} | {r['ratio']:.0%} | {r['variant']} | {r['kept_project']} / {r['kept_kvpress']} | "
            f"{r['overlap_mean']:.3f} ({r['overlap_min']:.3f}) | {r['pj']['kl']:.4f} | {kvr['kl']:.4f} | "
            f"{yn[r['pj']['recall']]} / {yn[kvr['recall']]} / {yn[kvr['own_recall']]} | {r['why']} |"
        )
    if study:
        lines += ["", "LagKV recall study (operations logs compressed once, query-agnostic):", ""]
        lines += ["| selection | recall | kept KV | fact tokens kept (layers x heads) |", "|---|---|---|---|"]
        for label, s in study.items():
            kept = f"{s['kept']:.1%}" if s["kept"] is not None else "(same as masked)"
            fk = s["fact_kept"]
            fk_s = f"{fk:.1%}" if fk is not None and not math.isnan(fk) else "-"
            lines.append(f"| {label} | {s['recall']}/{s['sessions']} | {kept} | {fk_s} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
