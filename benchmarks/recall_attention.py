"""Does the question's window find the planted fact? Offline, HF transformers, SmolLM2-135M, fp32.

Each recall-scenario session is flattened to ids the way `recall_probe.py` sends it (canned replies), one
forward gives every layer's post-RoPE keys and the last W=32 queries. Candidates: every position but the
4 sinks and the window. Per layer and KV head, the candidates are ranked by a score of the window's
causal attention, and the table gives the share of the planted value's (layer, head, token) entries in
the top R: "mean" (over the W queries and the query heads of the KV head, as the policies score), "max"
(the largest probability any of them gives), and pages of P positions ranked by their best entry under
either (an entry counts if its page is among the top R/P pages). The mean attention mass the window's
queries give the value's tokens is printed below.

    HF_HUB_OFFLINE=1 python benchmarks/recall_attention.py --sessions 6

`--answer "The vault code is"` appends the start of an answer, so the window ends where the model is
about to write the value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgl_kvevict.model import default_model_path  # noqa: E402
from sgl_kvevict.scenarios import recall as rs  # noqa: E402
from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402
from sgl_kvevict.tools import oracle  # noqa: E402

W, SINKS = 32, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--answer", default="", help="text appended after the question's generation prompt")
    a = ap.parse_args()
    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = oracle.load_model(path)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    g, scale = hq // hkv, (cfg.hidden_size // hq) ** -0.5

    def user(t: str) -> list[int]:
        return tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n")

    scenario = rs.build(ScenarioConfig(sessions=a.sessions, turns=a.turns, seed=0, filler_tokens=150))
    hits: dict[str, list[int]] = {}
    mass: list[float] = []
    for sess in scenario.sessions:
        ids = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
        fact: list[int] = []
        for i, t in enumerate(sess.turns):
            ids = ids + user(t.inputs[0].content)
            if i == 0:
                code = tok.encode(" " + sess.turns[-1].expect, add_special_tokens=False)
                start = next(j for j in range(len(ids)) if ids[j : j + len(code)] == code)
                fact = list(range(start, start + len(code)))
            if i < len(sess.turns) - 1:
                ids = ids + tok.encode(
                    "Got it.<|im_end|>\n" if i == 0 else "This note is about a topic.<|im_end|>\n"
                )
        ids = ids + (tok.encode(a.answer, add_special_tokens=False) if a.answer else [])
        cap = oracle.PastMask(capture_window=W)
        cache = DynamicCache()
        with torch.no_grad(), oracle.masking(cap):
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        n = len(ids)
        fact_t = torch.tensor(fact)
        for layer, kv in enumerate(cache.layers):
            k = kv.keys[0].float()  # [Hkv, n, D]
            q = cap.queries[layer].float().reshape(hkv, g * W, -1)
            logits = (torch.einsum("hwd,hnd->hwn", q, k) * scale).view(hkv, g, W, n)
            future = torch.arange(n).view(1, n) > torch.arange(n - W, n).view(W, 1)
            p = torch.softmax(logits.masked_fill(future, float("-inf")), -1)  # [Hkv, G, W, n]
            mass.append(float(p[..., fact].sum(-1).mean()))
            for agg, sc in (("mean", p.mean((1, 2))), ("max", p.amax((1, 2)))):
                cand = sc[:, SINKS : n - W]  # candidate i is position SINKS + i
                for r in (16, 64):
                    top = cand.topk(r, -1).indices + SINKS
                    h = hits.setdefault(f"{agg}, entries, R={r}", [0, 0])
                    h[0] += sum(int(torch.isin(fact_t, top[x]).sum()) for x in range(hkv))
                    h[1] += len(fact) * hkv
                    for page in (8, 16):
                        npg = cand.shape[1] // page
                        best = cand[:, : npg * page].reshape(hkv, npg, page).amax(-1)
                        pages = best.topk(min(max(1, r // page), npg), -1).indices
                        h = hits.setdefault(f"{agg}, pages of {page}, R={r}", [0, 0])
                        h[0] += sum(
                            sum(int((f - SINKS) // page in pages[x]) for f in fact) for x in range(hkv)
                        )
                        h[1] += len(fact) * hkv
        print(f"{sess.id}: {n} tokens", flush=True)
    print("\n| ranking | planted entries in the top R |\n|---|---|")
    for name, (got, tot) in hits.items():
        print(f"| {name} | {got}/{tot} = {got / tot:.2f} |")
    print(
        f"\nmean attention mass of a window query on the planted value's tokens: {sum(mass) / len(mass):.4f}"
    )


if __name__ == "__main__":
    main()
