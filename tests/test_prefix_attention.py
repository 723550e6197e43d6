"""The extend attention over a cached prefix (`cpu_compat/prefix_attention.py`) against SGLang's own
`TorchNativeAttnBackend._run_sdpa_forward_extend`, on the real function and a synthetic paged pool: the
rows must be bitwise SGLang's, over batches that mix short-path and SGLang-path requests."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_kvevict.cpu_compat import bf16_linear, prefix_attention

STOCK = TorchNativeAttnBackend._run_sdpa_forward_extend
HQ, HKV, D = 9, 3, 64


def _batch(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict:
    """Requests of (cached prefix, new tokens) in a shuffled pool of slots, as SGLang hands them over."""
    g = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in shapes)
    pool = total + 7
    slots = torch.randperm(pool, generator=g)[:total]
    req_to_token = torch.zeros(len(shapes) + 2, max(p + e for p, e in shapes) + 5, dtype=torch.int32)
    at = 0
    for i, (p, e) in enumerate(shapes):
        req_to_token[i + 1, : p + e] = slots[at : at + p + e]
        at += p + e
    n_new = sum(e for _, e in shapes)
    return dict(
        query=torch.randn(n_new, HQ, D, generator=g).to(dtype),
        k_cache=torch.randn(pool, HKV, D, generator=g).to(dtype),
        v_cache=torch.randn(pool, HKV, D, generator=g).to(dtype),
        req_to_token=req_to_token,
        req_pool_indices=torch.arange(1, len(shapes) + 1),
        seq_lens=torch.tensor([p + e for p, e in shapes]),
        extend_prefix_lens=torch.tensor([p for p, _ in shapes]),
        extend_seq_lens=torch.tensor([e for _, e in shapes]),
    )


def _run(fn, b: dict, hook: bool) -> torch.Tensor:
    out = torch.full_like(b["query"], float("nan"))
    args = (b["query"], out, b["k_cache"], b["v_cache"], b["req_to_token"], b["req_pool_indices"])
    args += (b["seq_lens"], b["extend_prefix_lens"], b["extend_seq_lens"], None)
    kw = dict(scaling=D**-0.5, enable_gqa=True, causal=True, is_cross_attn=False, sliding_window_size=None)
    if hook:
        prefix_attention.apply(STOCK, None, *args, **kw)
    else:
        STOCK(None, *args, **kw)
    return out


@pytest.mark.skipif(bf16_linear.native_bf16(), reason="registered only on CPUs without native bf16")
@pytest.mark.parametrize(
    "shapes",
    [
        [(1500, 1)],
        [(1500, 150)],
        [(2000, 40), (0, 300), (767, 1)],
        [(300, 700), (1024, 1024), (64, 3)],
        [(37, 5), (0, 1), (511, 512), (4000, 17)],
    ],
)
def test_rows_are_bitwise_sglangs(shapes: list[tuple[int, int]]) -> None:
    b = _batch(shapes)
    mine, stock = _run(STOCK, b, hook=True), _run(STOCK, b, hook=False)
    assert not mine.isnan().any(), "every row written"
    assert torch.equal(mine, stock)


def test_other_inputs_go_to_sglang_untouched() -> None:
    """fp32, a sliding window or no long prefix: SGLang's function is called once with the batch as is."""
    calls: list[int] = []

    def spy(backend, query, output, *args, **kwargs):
        calls.append(query.shape[0])
        return output

    kw = dict(scaling=None, enable_gqa=True, causal=True, is_cross_attn=False)
    b32 = _batch([(1500, 10)], dtype=torch.float32)
    args = list(b32.values())
    out = torch.empty_like(b32["query"])
    prefix_attention.apply(spy, None, args[0], out, *args[1:], None, sliding_window_size=None, **kw)
    b = _batch([(1500, 10)])
    args = list(b.values())
    prefix_attention.apply(spy, None, args[0], out.bfloat16(), *args[1:], None, sliding_window_size=8, **kw)
    short = _batch([(10, 500)])
    args = list(short.values())
    prefix_attention.apply(spy, None, args[0], torch.empty_like(short["query"]), *args[1:], None, **kw)
    assert calls == [10, 10, 500]


def test_the_hook_is_registered_where_the_cpu_lacks_bf16() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_kvevict.serve import plugin

    plugin.load()
    hooks = [h for _, h, _ in HookRegistry._hooks.get(prefix_attention.TARGET, [])]
    assert (prefix_attention.apply in hooks) == (not bf16_linear.native_bf16())
