"""One decode step's attention (30 layers) for 18 requests of 300-650 tokens in SmolLM2-135M's shape
(3 KV heads, 9 query heads, head_dim 64, bf16 pool): SGLang's torch_native loop (one bf16 SDPA call per
request and layer) against one batched call padded to the longest request, in fp64 and in fp32.
The largest difference from the loop's output and the fraction of equal bf16 values are printed last.

    python results/decode-attention/batched_vs_loop.py
"""

import time

import torch

torch.set_num_threads(2)
F = torch.nn.functional
g = torch.Generator().manual_seed(0)
P, HKV, G, D, B = 12000, 3, 3, 64, 18
kc = torch.randn(P, HKV, D, generator=g).bfloat16()
vc = torch.randn(P, HKV, D, generator=g).bfloat16()
lens = torch.randint(300, 650, (B,), generator=g)
r2t = torch.zeros(64, 2048, dtype=torch.int32)
perm = torch.randperm(P - 1, generator=g) + 1
o = 0
for b in range(B):
    r2t[b, : lens[b]] = perm[o : o + lens[b]]
    o += int(lens[b])
rows = torch.arange(B)
q = torch.randn(B, HKV * G, D, generator=g).bfloat16()


def loop() -> torch.Tensor:
    """SGLang's `_run_sdpa_forward_decode` in its essentials."""
    out, qq = torch.empty_like(q), q.movedim(0, 1)
    for i in range(B):
        t = r2t[rows[i], : lens[i]]
        k, v = kc[t].movedim(0, 1), vc[t].movedim(0, 1)
        o = F.scaled_dot_product_attention(
            qq[:, i : i + 1].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True, scale=0.125
        )
        out[i : i + 1] = o.squeeze(0).movedim(1, 0)
    return out


def batched(dt: torch.dtype = torch.float64) -> torch.Tensor:
    n = int(lens.max())
    idx = r2t[rows, :n].long()
    valid = torch.arange(n)[None, :] < lens[:, None]
    k, v = kc[idx].to(dt), vc[idx].to(dt)  # [B, n, H, D]
    s = torch.einsum("bhgd,blhd->bhgl", q.to(dt).view(B, HKV, G, D), k) * 0.125
    p = s.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhgl,blhd->bhgd", p, v).reshape(B, HKV * G, D).to(q.dtype)


for name, fn in (
    ("loop, bf16", loop),
    ("batched, fp64", batched),
    ("batched, fp32", lambda: batched(torch.float32)),
):
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(30):
        fn()
    print(f"{name}: {time.perf_counter() - t:.3f} s for 30 layers")
a, b = loop(), batched()
print(
    f"fp64 batched vs loop: max |diff| {(a.float() - b.float()).abs().max().item():.4g}, equal {(a == b).float().mean().item():.3f}"
)
