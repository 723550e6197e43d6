"""The offline check behind the value-dedup variant (not kept): with the full context in HF transformers
(fp32, SmolLM2-135M), how the question turn's own queries rank the planted value's tokens among the
history positions a budget-256 device would not hold (a stand-in device: the 4 sinks and the last 252
positions before the question, plus the question), per layer and KV head, by the largest probability any
query gives a position (recall's rule): "own"; "dedup": that score times 1 minus the position's value's
closest cosine to a device value; "dedup95": positions whose value has a device twin above 0.95 dropped;
"vnorm": the score times the value's norm. Filler answers are the model's own (greedy, full context).

    HF_HUB_OFFLINE=1 python results/recall-issue-scenario-variants/value-dedup/offline_ranks.py
"""

import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import recall_probe as rp  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from sgl_kvevict.model import default_model_path  # noqa: E402
from sgl_kvevict.scenarios import recall as rs  # noqa: E402
from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402
from tests.helpers import tokenizer  # noqa: E402

torch.set_grad_enabled(False)
tok = tokenizer()
m = AutoModelForCausalLM.from_pretrained(
    default_model_path(), dtype=torch.float32, attn_implementation="eager"
)
hkv, g = m.config.num_key_value_heads, m.config.num_attention_heads // m.config.num_key_value_heads
pairs = m.config.num_hidden_layers * hkv  # (layer, KV head) pairs
scenario = rs.build(ScenarioConfig(sessions=3, turns=14, seed=0, filler_tokens=150))
for sess in scenario.sessions:
    ids, parts, start = rp.hf_session(m, sess)
    fact = rp.fact_positions(sess)
    o = m(torch.tensor([ids]), output_attentions=True, output_hidden_states=False, use_cache=True)
    T = len(ids)
    print(sess.id, "T", T, "question from", start, "fact", sorted(fact), flush=True)
    dev = list(range(4)) + list(range(start - 252, T))
    host = list(range(4, start - 252))
    for name in ("own", "dedup", "dedup95", "vnorm"):
        ranks = []
        top = collections.Counter()
        partc = collections.Counter()
        for L, a in enumerate(o.attentions):
            a = a[0]  # [Hq, T, T]
            rows = a[:, start:T, :start]  # history keys only
            sc = rows.amax(1).view(hkv, g, start).amax(1)  # [Hkv, start]
            v = o.past_key_values.layers[L].values[0]  # [Hkv, T, D]
            sc = sc[:, host]
            hv, dv = v[:, host], v[:, dev]
            if name.startswith("dedup"):
                cos = torch.nn.functional.normalize(hv, dim=-1) @ torch.nn.functional.normalize(
                    dv, dim=-1
                ).transpose(1, 2)
                mx = cos.amax(-1)
                sc = sc * (1 - mx).clamp_min(0) if name == "dedup" else sc.masked_fill(mx > 0.95, 0)
            if name == "vnorm":
                sc = sc * hv.norm(dim=-1)
            for h in range(hkv):
                order = [host[i] for i in sc[h].argsort(descending=True).tolist()]
                r = min(order.index(p) for p in fact)
                ranks.append(r)
                for p in order[:8]:
                    top[repr(tok.decode([ids[p]]))] += 1
                    partc[parts[p]] += 1
        ranks.sort()
        print(
            f"  {name}: fact's best rank per layer/head: median {ranks[len(ranks) // 2]}, <8: {sum(r < 8 for r in ranks)}/{pairs}, <64: {sum(r < 64 for r in ranks)}/{pairs}",
            flush=True,
        )
        print("   top-8 tokens:", top.most_common(12), flush=True)
        print("   top-8 parts:", dict(partc), flush=True)
