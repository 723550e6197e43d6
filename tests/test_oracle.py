"""The eviction-path oracle's HF side, without a server: mask rows from timelines, and masking == a
physically compacted cache (what the server does) on the real model."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from sgl_kvevict.model import default_model_path
from sgl_kvevict.tools import oracle

from .helpers import long_text, tokenizer


def _naive(timeline, n, layer, hkv):
    m = torch.zeros(hkv, n, n, dtype=torch.bool)
    for p in range(n):
        ev = None
        for e in timeline:  # the last event (in list order) at or before p
            if e["tokens"] <= p:
                ev = e
        for h in range(hkv):
            for k in range(p + 1):
                m[h, p, k] = ev is None or k >= ev["tokens"] or k in ev["positions"][layer][h]
    return m


TIMELINE = [
    # admission: 3 matched tokens, the matched prefix (compressed earlier) holds 0 and 2 / 1 and 2
    {"tokens": 3, "positions": [[[0, 2], [1, 2]], [[0, 1], [0, 2]]]},
    # after prefill up to 9: per-head choices
    {"tokens": 9, "positions": [[[0, 4, 8], [2, 5, 7]], [[0, 1, 8], [3, 6, 8]]]},
    # decode compression after 13 tokens
    {"tokens": 13, "positions": [[[0, 10, 12], [7, 11, 12]], [[1, 8, 12], [6, 9, 12]]]},
    # a re-admission (retraction) at 11: rows >= 11 follow it
    {"tokens": 11, "positions": [[[0, 4, 8, 10], [2, 5, 7, 9]], [[0, 1, 8, 9], [3, 6, 8, 10]]]},
]


@pytest.mark.parametrize("layer", [0, 1])
def test_visibility_follows_the_last_event_rule(layer: int):
    n = 16
    got = oracle.visibility(TIMELINE, n, layer, 2)
    assert torch.equal(got, _naive(TIMELINE, n, layer, 2))
    if layer:
        return
    # spot checks of the rule itself (layer 0)
    assert got[0, 2].tolist()[:3] == [True, True, True]  # before the admission: plain causal
    assert got[1, 5, :6].tolist() == [False, True, True, True, True, True]
    assert got[0, 12, :13].tolist() == [True, False, False, False, True, False, False, False, True, False, True, True, True]  # fmt: skip
    assert not got[:, 4, 5:].any()  # never the future


def test_validate_rejects_malformed_events():
    ok = [{"tokens": 2, "positions": [[[0, 1]]]}]
    oracle.validate(ok, 1, 1)
    bad = {
        "layers": ([{"tokens": 2, "positions": [[[0]], [[0]]]}], "2 layers"),
        "heads": ([{"tokens": 2, "positions": [[[0], [1]]]}], "2 KV heads"),
        "order": ([{"tokens": 3, "positions": [[[1, 0]]]}], "ascending"),
        "range": ([{"tokens": 2, "positions": [[[0, 2]]]}], r"outside \[0, 2\)"),
        "keys": ([{"tokens": 2}], "positions"),
    }
    for tl, msg in bad.values():
        with pytest.raises(ValueError, match=msg):
            oracle.validate(tl, 1, 1)


def test_admission_must_equal_what_the_previous_turn_kept():
    prev = [TIMELINE[0], {"tokens": 20, "positions": [[[0, 5, 17, 18, 19]]]}]
    assert oracle.admission_mismatch(prev, {"tokens": 19, "positions": [[[0, 5, 17, 18]]]}) is None
    assert "head 0" in oracle.admission_mismatch(prev, {"tokens": 19, "positions": [[[0, 6, 17, 18]]]})
    # tokens appended after the last event count as held (no finish compression)
    assert (
        oracle.admission_mismatch(prev, {"tokens": 22, "positions": [[[0, 5, 17, 18, 19, 20, 21]]]}) is None
    )
    assert "differ at [20]" in oracle.admission_mismatch(
        prev, {"tokens": 22, "positions": [[[0, 5, 17, 18, 19, 21]]]}
    )
    assert "only 22" in oracle.admission_mismatch(prev, {"tokens": 23, "positions": [[[0]]]}, computed=22)
    assert oracle.compose([prev, [TIMELINE[1]]]) == [*prev, TIMELINE[1]]


@pytest.fixture(scope="module")
def models():
    masked = oracle.load_model()
    eager = AutoModelForCausalLM.from_pretrained(
        default_model_path(), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return masked, eager


def _gather(cache: DynamicCache, held: list[list[list[int]]], keep: list[list[list[int]]]) -> DynamicCache:
    """A new cache holding, per layer and KV head, only the kept positions (in position order), as the
    server's compaction does."""
    out = DynamicCache()
    for li, layer in enumerate(cache.layers):
        idx = [[held[li][h].index(p) for p in keep[li][h]] for h in range(len(keep[li]))]
        idx_t = torch.tensor(idx).unsqueeze(0).unsqueeze(-1).expand(1, -1, -1, layer.keys.shape[-1])
        out.update(layer.keys.gather(2, idx_t), layer.values.gather(2, idx_t), li)
    return out


def test_masking_equals_a_compacted_cache(models):
    """Simulate the server with HF's own eager attention and a physically shrunk cache (per-head
    choices, true positions): prefill, evict, decode, evict again, decode. One masked forward over the
    whole sequence with the resulting timeline must give the same logits at every position."""
    masked, eager = models
    cfg = eager.config
    n_layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    ids = tokenizer()(long_text(80, seed=5)).input_ids[:80]
    t0, t1, n = 48, 64, len(ids)
    rng = random.Random(0)
    timeline = []
    with torch.no_grad():
        out = eager(input_ids=torch.tensor([ids[:t0]]), use_cache=True)
        ref = [out.logits[0].float()]
        cache = out.past_key_values
        held = [[list(range(t0)) for _ in range(hkv)] for _ in range(n_layers)]
        for p in range(t0, n):
            if p in (t0, t1):  # compress: 24 then 20 positions per head, sinks 0-1 always kept
                k = 24 if p == t0 else 20
                keep = [[[0, 1, *sorted(rng.sample(hh[2:], k - 2))] for hh in hl] for hl in held]
                cache = _gather(cache, held, keep)
                timeline.append({"tokens": p, "positions": keep})
                held = [[list(x) for x in hl] for hl in keep]
            out = eager(
                input_ids=torch.tensor([[ids[p]]]),
                position_ids=torch.tensor([[p]]),
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            for hl in held:
                for hh in hl:
                    hh.append(p)
            ref.append(out.logits[0].float())
    ref_logits = torch.cat(ref)
    got = oracle.timeline_logits(masked, ids, timeline)
    assert got.shape == ref_logits.shape
    torch.testing.assert_close(got, ref_logits, atol=2e-4, rtol=0)
    # and the masks matter: without the timeline the decode logits differ clearly
    plain = oracle.timeline_logits(masked, ids, [])
    assert (plain[t0:] - ref_logits[t0:]).abs().max() > 0.1
    torch.testing.assert_close(plain[:t0], ref_logits[:t0], atol=2e-4, rtol=0)


def test_check_tokens_allows_only_near_ties():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0005, 0.0], [3.0, 1.0, 0.0]])
    ids = [9, 1, 0, 1]  # outputs 1, 0, 1 predicted at positions 0, 1, 2
    res = oracle.check_tokens(logits, [0, 1, 2], ids, tol=1e-3)
    assert res.compared == 3
    assert [p for p, _ in res.ties] == [1]  # 0 instead of 1: 5e-4 apart
    assert [(p, a, b) for p, a, b, _ in res.mismatches] == [(2, 1, 0)]  # 2 logits apart: a real mismatch
    assert not res.ok
    lp = logits.log_softmax(-1)
    good = [float(lp[0, 1]), float(lp[1, 0]), float(lp[2, 1])]
    res = oracle.check_tokens(logits[:2], [0, 1], ids, 1e-3, good[:2])
    assert res.ok and res.max_logprob_diff < 1e-6
    res = oracle.check_tokens(logits[:2], [0, 1], ids, 1e-3, [good[0] + 0.01, good[1]])
    assert [p for p, _ in res.logprob_errors] == [0]


def test_nan_fails_every_comparison():
    """A NaN error is worse than any number and is kept (`max(0.0, nan)` is 0.0 and would hide it)."""
    nan = float("nan")
    assert math.isnan(oracle.worse(0.0, nan)) and math.isnan(oracle.worse(nan, 1.0))
    assert math.isnan(functools.reduce(oracle.worse, [0.1, nan, 0.2], 0.0))  # the Triton check's reduction
    assert oracle.worse(0.1, 0.2) == 0.2 and oracle.worse(0.2, 0.1) == 0.2
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0005, 0.0]])
    lp = logits.log_softmax(-1)
    ids = [9, 1, 0]
    res = oracle.check_tokens(logits, [0, 1], ids, 1e-3, [nan, float(lp[1, 0])])
    assert not res.ok and [p for p, _ in res.logprob_errors] == [0]
    assert math.isnan(res.max_logprob_diff)
    assert math.isnan(oracle.TokenCheck().merge(res).max_logprob_diff)
    res = oracle.check_tokens(logits, [0, 1], ids, 1e-3, [float(lp[0, 1]), nan])  # NaN after a good one
    assert not res.ok and math.isnan(res.max_logprob_diff)
