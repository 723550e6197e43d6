"""The kvpress half of `benchmarks/kvpress_check.py`; runs in kvpress's own venv (`scripts/kvpress_env.sh`).

It imports nothing from this project (kvpress needs transformers<5.3; the project pins a newer one). For
each case of a job file it prefills the prompt under the named press exactly as kvpress does (forward
hooks on every attention layer, compression during prefill only), then reads which positions each layer
and KV head kept. The press's own `compress` is wrapped, not re-implemented: the kept positions are found
by matching each kept (key, value) row to the uncompressed rows byte for byte, so what is reported is what
the press really kept. It also answers the question on its own compressed cache, with true position ids
as kvpress's pipeline does, so the masked evaluation on the project side can be checked against it.

    python benchmarks/kvpress_side.py JOB.json OUT.pt
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch


def make_press(name: str, ratio: float, kw: dict[str, Any]) -> Any:
    """A kvpress press by the project's policy name; `ratio` is the fraction *kept* (kvpress: 1 - ratio)."""
    import kvpress

    cr = 1.0 - ratio
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=cr, **kw)
    if name == "streaming":
        return kvpress.StreamingLLMPress(compression_ratio=cr, **kw)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=cr, **kw)
    if name == "lagkv":
        return kvpress.LagKVPress(compression_ratio=cr, **kw)
    if name == "criticalkv":
        return kvpress.CriticalKVPress(kvpress.SnapKVPress(compression_ratio=cr, **kw))
    raise SystemExit(f"unknown press {name!r}; valid: knorm, streaming, snapkv, lagkv, criticalkv")


def row_bytes(x: torch.Tensor) -> np.ndarray:
    """[N, D] float rows -> N opaque byte strings (exact equality of whole rows)."""
    a = np.ascontiguousarray(x.detach().float().cpu().numpy())
    return a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).ravel()


def kept_positions(k_in: torch.Tensor, v_in: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> torch.Tensor:
    """[B=1, H, N, D] before and [1, H, M, D] after -> [H, M] sorted positions kept per head."""
    out = []
    for h in range(k_in.shape[1]):
        src = row_bytes(torch.cat([k_in[0, h], v_in[0, h]], dim=-1))
        dst = row_bytes(torch.cat([k_out[0, h], v_out[0, h]], dim=-1))
        where: dict[bytes, int] = {}
        for i, r in enumerate(src):
            where.setdefault(r.tobytes(), i)
        idx = [where.get(r.tobytes(), -1) for r in dst]
        if -1 in idx:
            raise RuntimeError("a kept row matches no input row: the press changed K/V (merging press?)")
        out.append(sorted(idx))
    return torch.tensor(out, dtype=torch.long)


def run_case(model: Any, case: dict[str, Any], prompt: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    from transformers import DynamicCache

    press = make_press(case["press"], case["ratio"], case.get("kwargs", {}))
    kept: dict[int, torch.Tensor] = {}
    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):  # noqa: ANN001
        k2, v2 = inner(module, hidden_states, keys, values, attentions, kwargs)
        kept[module.layer_idx] = kept_positions(keys, values, k2, v2)
        return k2, v2

    press.compress = compress  # instance attribute: the press's forward hook calls self.compress
    ctx = torch.tensor([prompt["ids"]])
    n = ctx.shape[1]
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
    # the question, then greedy decoding, on the compressed cache with true positions (kvpress pipeline)
    q = torch.tensor([prompt["question"]])
    pos = torch.arange(n, n + q.shape[1]).unsqueeze(0)
    answer: list[int] = []
    with torch.no_grad():
        logits = model(input_ids=q, past_key_values=cache, position_ids=pos).logits[0, -1]
        p = n + q.shape[1]
        for _ in range(prompt["answer_tokens"]):
            nxt = int(logits.argmax())
            answer.append(nxt)
            logits = model(
                input_ids=torch.tensor([[nxt]]), past_key_values=cache, position_ids=torch.tensor([[p]])
            ).logits[0, -1]
            p += 1
    return torch.stack([kept[i] for i in sorted(kept)]), answer


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from importlib.metadata import version

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(job.get("threads", 2)))
    dtype = getattr(torch, job.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype, attn_implementation="sdpa").eval()
    res: dict[str, Any] = {
        "kept": {},
        "answer": {},
        "versions": {p: version(p) for p in ("kvpress", "transformers", "torch")},
    }
    for case in job["cases"]:
        kept, answer = run_case(model, case, job["prompts"][case["prompt"]])
        res["kept"][case["id"]] = kept
        res["answer"][case["id"]] = answer
        print(f"[kvpress] {case['id']}: kept {kept.shape[-1]} per head", file=sys.stderr, flush=True)
    torch.save(res, sys.argv[2])


if __name__ == "__main__":
    main()
