"""The kvpress half of `benchmarks/kvpress_check.py`; runs in kvpress's own venv (`scripts/kvpress_env.sh`).

It imports nothing from this project (kvpress needs transformers<5.3; the project pins a newer one). Each
prompt is prefilled once while every attention layer's call is recorded; each press then runs its *own*
`forward_hook` on those recorded calls over a fresh copy of the full cache, which is exactly what
`with press(model): model(prompt)` does (compression during prefill only), without a prefill per press.
Nothing of a press is re-implemented: the kept positions are read back by matching each kept (key, value)
row to the uncompressed rows byte for byte. It also answers the question on the press's compressed cache,
with true position ids as kvpress's pipeline does, so the project side's masked evaluation of the same
kept sets can be checked against kvpress's own decoding.

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


def kept_positions(
    k_in: torch.Tensor, v_in: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
) -> torch.Tensor:
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


def record_prefill(
    model: Any, ids: list[int]
) -> tuple[dict[int, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One plain prefill: each attention layer's call (module, kwargs, output), as a press's forward hook
    would receive it, and the full K/V. Every press then runs its own hook on these same arguments."""
    from transformers import DynamicCache

    calls: dict[int, Any] = {}

    def hook(module, args, kwargs, output):  # noqa: ANN001
        calls[module.layer_idx] = (module, dict(kwargs), output)

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    cache = DynamicCache()
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    full = [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in range(len(layers))]
    return calls, full


def run_case(
    model: Any, case: dict[str, Any], prompt: dict[str, Any], rec: Any
) -> tuple[torch.Tensor, list[int]]:
    """The press's own `forward_hook` on every layer's recorded call, over a fresh copy of the full cache
    (what `with press(model): model(...)` does, without a prefill per press); then the question and
    greedy decoding on the compressed cache with true position ids, as kvpress's pipeline decodes."""
    from transformers import DynamicCache

    calls, full = rec
    press = make_press(case["press"], case["ratio"], case.get("kwargs", {}))
    press.post_init_from_model(model)
    lm = model.model
    for layer in lm.layers:  # what press.__call__ sets up before hooking
        layer.self_attn.rotary_emb = lm.rotary_emb
    cache = DynamicCache()
    for i, (k, v) in enumerate(full):
        cache.update(k.clone(), v.clone(), i)
    with torch.no_grad():
        for i in sorted(calls):
            module, kwargs, output = calls[i]
            press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
    kept = torch.stack(
        [kept_positions(k, v, cache.layers[i].keys, cache.layers[i].values) for i, (k, v) in enumerate(full)]
    )
    n = len(prompt["ids"])
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
    return kept, answer


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
    recorded: dict[str, Any] = {}
    for case in job["cases"]:
        name = case["prompt"]
        if name not in recorded:
            recorded = {name: record_prefill(model, job["prompts"][name]["ids"])}  # one prompt held at a time
        kept, answer = run_case(model, case, job["prompts"][name], recorded[name])
        res["kept"][case["id"]] = kept
        res["answer"][case["id"]] = answer
        print(f"[kvpress] {case['id']}: kept {kept.shape[-1]} per head", file=sys.stderr, flush=True)
    torch.save(res, sys.argv[2])


if __name__ == "__main__":
    main()
