"""Does the question's window find the planted fact? Offline, HF transformers, SmolLM2-135M, fp32.

Each recall-scenario session is flattened to ids the way `recall_probe.py` sends it (canned replies), one
forward gives every layer's post-RoPE keys and the last W=32 queries. Candidates: every position but the
4 sinks and the window. Per layer and KV head, the candidates are ranked by a score of the window's
causal attention, and the table gives the share of the planted value's (layer, head, token) entries in
the top R: "mean" (over the W queries and the query heads of the KV head, as the policies score), "max"
(the largest probability any of them gives), and pages of P positions ranked by their best entry under
either (an entry counts if its page is among the top R/P pages). The mean attention mass the window's
queries give the value's tokens is printed below.

"coherent" rows rank positions once for the whole model and select the same R positions in every layer
and KV head (R entries per (layer, head), as per-head R): "votes" = in how many (layer, head) pairs the
position is in that head's top R by max (ties by "norm"), "norm" = the sum over (layer, head) of the max
score divided by the head's largest, "rank" = the sum of the position's per-head rank points (Borda).
With pages of 8 the same three rank pages (a head's page score is its best position, votes count the
head's top R/8 pages) and R/8 pages are selected; each session's line gives the rank of the value's best
entry and best page in the "norm" order. A second column gives the share of the planted turn's
entries (the tokens of the first user message's text, "Remember this: the vault code is 4817.") in the
top R under the same ranking.

    HF_HUB_OFFLINE=1 python benchmarks/recall_attention.py --sessions 6 [--turns 14]

R is 16, 64 and 128.

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


def coherent(x: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top k items (columns) of per-head scores x [heads, items] by a vote over all heads, three ways."""
    k = min(k, x.shape[1])
    norm = (x / x.amax(-1, keepdim=True).clamp_min(1e-30)).sum(0)
    votes = torch.zeros(x.shape[1]).index_add_(
        0, x.topk(k, -1).indices.flatten(), torch.ones(x.numel() // x.shape[1] * k)
    )
    rank = (x.argsort(-1).argsort(-1).float()).sum(0)  # 0 for a head's lowest item
    tie = norm / (norm.max() + 1)  # < 1: breaks ties in votes only
    return {n: v.topk(k).indices for n, v in (("votes", votes + tie), ("norm", norm), ("rank", rank))}


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
    head, tail = len(tok.encode("<|im_start|>user\n")), len(tok.encode("<|im_end|>\n<|im_start|>assistant\n"))
    hits: dict[str, list[int]] = {}  # ranking -> [value hits, value entries, turn hits, turn entries]
    mass: list[float] = []

    def count(
        name: str, sel: list[torch.Tensor], item, targets: tuple[list[int], list[int]], heads: int
    ) -> None:
        """sel: the selected items of each of the `heads` heads; item: position -> item."""
        h = hits.setdefault(name, [0, 0, 0, 0])
        for j, tg in enumerate(targets):
            h[2 * j] += sum(int(item(t) in s) for s in sel for t in tg)
            h[2 * j + 1] += len(tg) * heads

    for sess in scenario.sessions:
        ids = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
        fact: list[int] = []
        turn: list[int] = []
        for i, t in enumerate(sess.turns):
            b = len(ids)
            ids = ids + user(t.inputs[0].content)
            if i == 0:
                code = tok.encode(" " + sess.turns[-1].expect, add_special_tokens=False)
                start = next(j for j in range(len(ids)) if ids[j : j + len(code)] == code)
                fact = list(range(start, start + len(code)))
                turn = list(range(b + head, len(ids) - tail))  # the message's text, not its chat markup
                assert set(fact) <= set(turn), tok.decode(ids[turn[0] : turn[-1] + 1])
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
        targets = (fact, turn)
        maxes = []
        for layer, kv in enumerate(cache.layers):
            k = kv.keys[0].float()  # [Hkv, n, D]
            q = cap.queries[layer].float().reshape(hkv, g * W, -1)
            logits = (torch.einsum("hwd,hnd->hwn", q, k) * scale).view(hkv, g, W, n)
            future = torch.arange(n).view(1, n) > torch.arange(n - W, n).view(W, 1)
            p = torch.softmax(logits.masked_fill(future, float("-inf")), -1)  # [Hkv, G, W, n]
            mass.append(float(p[..., fact].sum(-1).mean()))
            for agg, sc in (("mean", p.mean((1, 2))), ("max", p.amax((1, 2)))):
                cand = sc[:, SINKS : n - W]  # candidate i is position SINKS + i
                if agg == "max":
                    maxes.append(cand)
                for r in (16, 64, 128):
                    top = cand.topk(r, -1).indices
                    count(f"{agg}, entries, R={r}", list(top), lambda t: t - SINKS, targets, hkv)
                    for page in (8, 16):
                        npg = cand.shape[1] // page
                        best = cand[:, : npg * page].reshape(hkv, npg, page).amax(-1)
                        pages = best.topk(min(max(1, r // page), npg), -1).indices
                        count(
                            f"{agg}, pages of {page}, R={r}",
                            list(pages),
                            lambda t, page=page: (t - SINKS) // page,
                            targets,
                            hkv,
                        )
        x = torch.cat(maxes)  # [layers * Hkv, candidates]
        npg = x.shape[1] // 8
        xp = x[:, : npg * 8].reshape(x.shape[0], npg, 8).amax(-1)
        for r in (16, 64, 128):
            for how, sel in coherent(x, r).items():
                count(
                    f"coherent {how}, entries, R={r}",
                    [sel] * x.shape[0],
                    lambda t: t - SINKS,
                    targets,
                    x.shape[0],
                )
            for how, sel in coherent(xp, r // 8).items():
                count(
                    f"coherent {how}, pages of 8, R={r}",
                    [sel] * x.shape[0],
                    lambda t: (t - SINKS) // 8,
                    targets,
                    x.shape[0],
                )
        # where the value lands in the coherent "norm" order: rank of its best entry and of its best page
        order = [(v / v.amax(-1, keepdim=True)).sum(0).argsort(descending=True).tolist() for v in (x, xp)]
        rk = [min(o.index((t - SINKS) // d) for t in fact) + 1 for o, d in zip(order, (1, 8), strict=True)]
        print(
            f"{sess.id}: {n} tokens, planted turn {len(turn)} tokens, value {len(fact)}; coherent norm rank"
            f" of the value's best entry {rk[0]}/{x.shape[1]}, best page of 8 {rk[1]}/{npg}",
            flush=True,
        )
    print(
        "\n| ranking | planted value entries in the top R | planted turn entries in the top R |\n|---|---|---|"
    )
    for name, (got, tot, tgot, ttot) in sorted(hits.items(), key=lambda kv: int(kv[0].rsplit("=", 1)[1])):
        print(f"| {name} | {got}/{tot} = {got / tot:.2f} | {tgot}/{ttot} = {tgot / ttot:.2f} |")
    print(
        f"\nmean attention mass of a window query on the planted value's tokens: {sum(mass) / len(mass):.4f}"
    )


if __name__ == "__main__":
    main()
