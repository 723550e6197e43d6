"""Offline: how the answer's own decode-step queries find the planted value, with the full context in HF
transformers (fp32, SmolLM2-135M, the recall scenario in raw ChatML as `benchmarks/recall_probe.py` sends
it: 3 sessions of 14 turns). For each of the answer's first 8 tokens, the query that chooses the next token
scores the history positions a budget-256 device would not hold (a stand-in device: the 4 sinks and the
last 252 positions before the question) by recall's rule, the largest probability any query head of a KV
head gives a position. Per (layer, KV head) pair it reports the value's best rank, whether its page of 8
positions ranks first, whether its score reaches the default floor (`--kv-recall-min-score` 0.05), and how
much attention the value gets (its positions' summed probability, the best query head).

    HF_HUB_OFFLINE=1 python results/recall-probe/decode_ranks.py > results/recall-probe/decode_ranks.txt
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import recall_probe as rp  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from sgl_kvevict.model import default_model_path  # noqa: E402
from sgl_kvevict.scenarios import recall as rs  # noqa: E402
from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402
from tests.helpers import tokenizer  # noqa: E402

PAGE, FLOOR, STEPS = 8, 0.05, 8

torch.set_grad_enabled(False)
tok = tokenizer()
m = AutoModelForCausalLM.from_pretrained(
    default_model_path(), dtype=torch.float32, attn_implementation="eager"
)
hkv, g = m.config.num_key_value_heads, m.config.num_attention_heads // m.config.num_key_value_heads
scenario = rs.build(ScenarioConfig(sessions=3, turns=14, seed=0, filler_tokens=150))
for sess in scenario.sessions:
    ids, _, start = rp.hf_session(m, sess)  # start: the question's first position
    q_end = len(ids)
    ans = m.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, q_end:].tolist()
    ids = ids + ans
    fact = sorted(rp.fact_positions(sess))
    attn = m(torch.tensor([ids]), output_attentions=True).attentions
    host = list(range(4, start - 252))
    at = {p: i for i, p in enumerate(host)}
    fidx = [at[p] for p in fact if p in at]
    words = [tok.decode([ids[p]]) for p in fact]
    print(f"{sess.id}: answer {tok.decode(ans)!r}; value positions {fact} {words}", flush=True)
    for j in range(min(len(ans) - 1, STEPS)):
        pos = q_end + j  # the query of the answer's j-th token, which chooses token j + 1
        ranks, top_page, floor, mass = [], 0, 0, []
        for a in attn:
            row = a[0, :, pos, :]  # [Hq, T]
            sc = row[:, host].view(hkv, g, -1).amax(1)  # [Hkv, host positions]
            got = row[:, fact].sum(-1).view(hkv, g).amax(1)
            pages = torch.nn.functional.pad(sc, (0, (-sc.shape[1]) % PAGE)).view(hkv, -1, PAGE).amax(-1)
            for h in range(hkv):
                order = sc[h].argsort(descending=True)
                rank = torch.empty_like(order)
                rank[order] = torch.arange(order.numel())
                ranks.append(int(rank[fidx].min()))
                top_page += int(pages[h].argmax()) in {i // PAGE for i in fidx}
                floor += bool(sc[h, fidx].max() >= FLOOR)
                mass.append(float(got[h]))
        ranks.sort()
        k = len(ranks)
        print(
            f"  step {j}: {tok.decode([ids[pos]])!r} -> {tok.decode([ids[pos + 1]])!r}: best rank median "
            f"{ranks[k // 2]}, first in {sum(r < 1 for r in ranks)}/{k}, top 8 in {sum(r < 8 for r in ranks)}/{k}; "
            f"its page first in {top_page}/{k}; score >= {FLOOR} in {floor}/{k}; "
            f"attention > 0.2 in {sum(x > 0.2 for x in mass)}/{k} (max {max(mass):.2f})",
            flush=True,
        )
