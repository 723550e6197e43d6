"""Extend attention over a cached prefix without the prefix's redundant queries (SGLang's CPU backend).

SGLang's `torch_native` attention backend computes an extend (a prefill, or a turn that reuses a cached
history) per request by padding the request's new queries to the whole sequence and running causal SDPA
over all L x L query-key pairs, the prefix's rows thrown away. A 150-token turn over a 1,500-token
history pays for 1,650 queries in every layer; a one-token extend over 1,500 cached tokens pays for 1,501.

Here a request whose cached prefix P is at least as long as its E new tokens runs SDPA on its own E queries,
with an explicit causal mask shifted by P (query i sees keys 0..P+i). Every other request goes to SGLang's
own function unchanged. On a CPU without native bf16 the bf16 rows come out bitwise equal to SGLang's
(`tests/test_prefix_attention.py` compares them with SGLang's function over mixed batches), so nothing
downstream changes but the time: `python benchmarks/prefix_attention.py` times both
(`results/prefix-attention/times.txt`).

Registered by the plugin's entry point where `bf16_linear.native_bf16()` is False (the CPUs where the
equality was checked, and where the time matters); only bf16 causal self-attention without encoder or
sliding window takes the new path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend"


def takes_short_path(prefix: int, extend: int) -> bool:
    """A prefix at least as long as the extend: the masked product is the cheaper one (below that, SGLang's
    causal kernel over the padded square is as fast or faster)."""
    return prefix > 0 and prefix >= extend


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scaling: Any, enable_gqa: bool
) -> torch.Tensor:
    """SDPA of `q` `[H, E, D]` over `k`, `v` `[Hkv, P + E, D]`, query i seeing keys up to `prefix + i`."""
    e, n = q.shape[1], k.shape[1]
    mask = torch.ones(e, n, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
    out = scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=enable_gqa, scale=scaling
    )
    return out.squeeze(0)


def apply(
    original: Any,
    backend: Any,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling: Any = None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """AROUND hook: requests with a long cached prefix on the short path, the rest to SGLang's function."""
    opts = dict(scaling=scaling, enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn)
    plain = (
        encoder_lens is None
        and causal
        and not is_cross_attn
        and sliding_window_size is None
        and query.dtype == torch.bfloat16
        and query.device.type == "cpu"
    )
    prefixes, extends = extend_prefix_lens.tolist(), extend_seq_lens.tolist()
    if not plain or not any(takes_short_path(p, e) for p, e in zip(prefixes, extends, strict=True)):
        return original(
            backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            extend_prefix_lens, extend_seq_lens, encoder_lens, sliding_window_size=sliding_window_size, **opts,
        )  # fmt: skip
    start = 0
    for i, (p, e) in enumerate(zip(prefixes, extends, strict=True)):
        rows = slice(start, start + e)
        start += e
        if not takes_short_path(p, e):
            one = slice(i, i + 1)
            original(
                backend, query[rows], output[rows], k_cache, v_cache, req_to_token, req_pool_indices[one],
                seq_lens[one], extend_prefix_lens[one], extend_seq_lens[one], None, **opts,
            )  # fmt: skip
            continue
        tokens = req_to_token[req_pool_indices[i], : p + e]
        k, v = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
        q = query[rows].movedim(0, 1)
        output[rows] = attend(q, k.to(q.dtype), v.to(q.dtype), p, scaling, enable_gqa).movedim(1, 0)
    return output
