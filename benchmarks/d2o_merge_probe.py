"""Where D2O's merge lands on a planted fact (a diagnostic, not a test).

In request scope a fact planted in turn 1 is compressed only in that turn: later turns match it as a
stored prefix. This replays turn 1 of each `recall-code` session offline (HF transformers, fp32)
through the two compressions the server runs for it at a budget ratio: after the prefill, and at the
turn's finish with the answer's tokens appended (their K/V from the full-cache forward: an
approximation). Per compression it counts, over (layer, KV head), the evicted entries that merge, the
merges that land on the fact's digit entries and on the sinks, and how far the receiving entries move
(cosine of K and V before and after).

    HF_HUB_OFFLINE=1 python benchmarks/d2o_merge_probe.py --variants '{"d2o": {"merge": true}, "mean": {"merge": true, "threshold": "mean"}}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay_client  # noqa: E402

from sgl_kvevict import policies  # noqa: E402
from sgl_kvevict.kernels import window_attention  # noqa: E402
from sgl_kvevict.model import default_model_path  # noqa: E402
from sgl_kvevict.policies.base import LayerView  # noqa: E402
from sgl_kvevict.scenarios import build  # noqa: E402
from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402
from sgl_kvevict.tools import oracle  # noqa: E402

SINKS, RECENT, WINDOW = 4, 32, 32
# the module, not the function `sgl_kvevict.kernels` exports under its name: its match and threshold
d2o_merge = importlib.import_module("sgl_kvevict.kernels.d2o_merge")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1))


class Replayer:
    """The model and tokenizer, and the two forwards the probe needs."""

    def __init__(self, answer_tokens: int) -> None:
        path = str(default_model_path())
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = oracle.load_model(path)
        cfg = self.model.config
        self.kv_heads = cfg.num_key_value_heads
        self.scale = (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
        self.chat = replay_client.ChatIds(self.tok)
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.answer_tokens = answer_tokens

    def forward(self, ids: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list]:
        """Per layer (K, V) as [tokens, KV heads, dim], and the window's queries per layer."""
        capture = oracle.PastMask(capture_window=WINDOW)
        with torch.no_grad(), oracle.masking(capture):
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        kv = [
            (layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
            for layer in out.past_key_values.layers
        ]
        return kv, capture.queries

    def answer(self, ids: list[int]) -> list[int]:
        """Greedy tokens with the stop token suppressed, as the replay's min_new_tokens does."""
        out, cur = [], list(ids)
        for _ in range(self.answer_tokens):
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([cur])).logits[0, -1]
            logits[self.end] = -1e9
            out.append(int(logits.argmax()))
            cur.append(out[-1])
        return out


def compress_layer(rp: Replayer, pol, state: dict, kb, vb, queries, budget: int, fact: set[int], pos) -> dict:
    """One layer's selection and merge, with the merge's own match and threshold read before it runs."""
    n = kb.shape[0]
    slots = torch.arange(n)
    attn = window_attention(queries, kb, slots, rp.scale, causal=True)
    view = LayerView(0, kb, vb, slots, SINKS, RECENT, 0, attn=attn, state=state)
    keep = pol.select(view, budget)
    kf = kb.float()
    unit = (kf / kf.norm(dim=-1, keepdim=True).clamp_min(1e-12)).contiguous()
    keep64, evicted, tau = d2o_merge._prepare(slots, keep, state.get("tau"), rp.kv_heads)
    sim, nearest = d2o_merge._match_ref(unit, evicted, keep64)
    tau_new = d2o_merge._threshold(sim, tau, pol.config.beta, state.get("tau") is None, pol.config.threshold)
    merges = (sim >= tau_new[:, None]) if pol.config.merge else torch.zeros_like(sim, dtype=torch.bool)
    before_k, before_v = kb.clone(), vb.clone()
    pol.merge(view, keep)
    row = {
        "merged": int(merges.sum()),
        "evicted": merges.numel(),
        "on_fact": 0,
        "on_sinks": 0,
        "cos_k": [],
        "cos_v": [],
    }
    for h in range(rp.kv_heads):
        kept = keep64[h].tolist()
        for col, slot in enumerate(kept):
            landed = int(((nearest[h] == col) & merges[h]).sum())
            if not landed:
                continue
            if slot < SINKS:
                row["on_sinks"] += landed
            if int(pos[h, slot]) in fact:
                row["on_fact"] += landed
                row["cos_k"].append(cosine(before_k[slot, h], kb[slot, h]))
                row["cos_v"].append(cosine(before_v[slot, h], vb[slot, h]))
    scored = state.pop("scored", None)
    if scored is not None:
        state["carried"] = scored.gather(1, keep64)
    return {**row, "keep": keep64}


def probe_session(rp: Replayer, session, variant: dict, ratio: float) -> list[dict]:
    prompt = (
        rp.chat.start(None) + rp.chat.message("user", session.turns[0].inputs[0].content) + rp.chat.gen_prompt
    )
    fact = {i for i, t in enumerate(prompt) if rp.tok.decode([t]).strip().isdigit()}
    full = prompt + rp.answer(prompt)
    kv_prompt, q_prompt = rp.forward(prompt)
    kv_full, q_full = rp.forward(full)
    pol = policies.build(
        "d2o", {"sinks": SINKS, "recent": RECENT, "window": WINDOW, **variant}
    ).for_budget_ratio(ratio)
    layers = len(kv_prompt)
    states: list[dict] = [{} for _ in range(layers)]
    bufs = [(k.clone(), v.clone()) for k, v in kv_prompt]
    pos = [torch.arange(len(prompt)).expand(rp.kv_heads, -1).clone() for _ in range(layers)]
    evicted_so_far, rows = 0, []
    for phase, queries in (("prefill", q_prompt), ("finish", q_full)):
        if phase == "finish":
            for li in range(layers):
                k_new, v_new = kv_full[li][0][len(prompt) :], kv_full[li][1][len(prompt) :]
                bufs[li] = (torch.cat([bufs[li][0], k_new]), torch.cat([bufs[li][1], v_new]))
                new_pos = torch.arange(len(prompt), len(full)).expand(rp.kv_heads, -1)
                pos[li] = torch.cat([pos[li], new_pos], 1)
        n = bufs[0][0].shape[0]
        budget = max(0, round(ratio * (n + evicted_so_far)) - SINKS - RECENT)
        if not pol.should_compress(n, SINKS, RECENT, 0, budget, phase):
            continue
        total = {
            "phase": phase,
            "merged": 0,
            "evicted": 0,
            "on_fact": 0,
            "on_sinks": 0,
            "cos_k": [],
            "cos_v": [],
        }
        for li in range(layers):
            kb, vb = bufs[li]
            row = compress_layer(rp, pol, states[li], kb, vb, queries[li], budget, fact, pos[li])
            keep = row.pop("keep")
            for key in ("merged", "evicted", "on_fact", "on_sinks", "cos_k", "cos_v"):
                total[key] += row[key]
            heads = torch.arange(rp.kv_heads)[:, None]
            bufs[li] = (
                kb[keep, heads].transpose(0, 1).contiguous(),
                vb[keep, heads].transpose(0, 1).contiguous(),
            )
            pos[li] = pos[li].gather(1, keep)
        evicted_so_far += n - bufs[0][0].shape[0]
        rows.append(total)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default='{"d2o": {"merge": true}}', help="JSON: label -> d2o config")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--out", help="JSON file for the per-session rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rp = Replayer(args.answer_tokens)
    scenario = build("recall-code", ScenarioConfig(sessions=args.sessions, turns=14, filler_tokens=150))
    report = {}
    for label, variant in json.loads(args.variants).items():
        report[label] = []
        for s in scenario.sessions:
            rows = probe_session(rp, s, variant, args.ratio)
            report[label].append({"session": s.id, "compressions": rows})
            for r in rows:
                low_v = min(r["cos_v"], default=1.0)
                print(
                    f"{label} {s.id} {r['phase']}: merged {r['merged']}/{r['evicted']}, onto the fact "
                    f"{r['on_fact']} (lowest cos V {low_v:.3f}), onto the sinks {r['on_sinks']}",
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
