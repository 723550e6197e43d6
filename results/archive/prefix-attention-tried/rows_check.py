"""Whether a shifted-mask SDPA over an extend's own queries gives SGLang's padded-square rows bitwise
(bf16, 9 query / 3 KV heads of 64): per seed, every sequence length 2-199 with 1, 2, 3 or 5 new tokens.

    python results/archive/prefix-attention-tried/rows_check.py > results/archive/prefix-attention-tried/rows_check.txt
"""

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


def padded_square(q, k, v, p):  # what SGLang's torch_native extend computes for the new rows
    qr = torch.zeros(q.shape[0], k.shape[1], q.shape[2], dtype=q.dtype)
    qr[:, p:] = q
    return sdpa(qr[None], k[None], v[None], enable_gqa=True, is_causal=True, scale=0.125)[0][:, p:]


def shifted_mask(q, k, v, p):  # the reverted short path
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(diagonal=p)
    return sdpa(q[None], k[None], v[None], enable_gqa=True, attn_mask=mask, scale=0.125)[0]


cases = differ = 0
for seed in range(3):
    torch.manual_seed(seed)
    for n in range(2, 200):
        for e in (1, 2, 3, 5):
            if n - e < e:
                continue
            q = torch.randn(9, e, 64).bfloat16()
            k, v = torch.randn(3, n, 64).bfloat16(), torch.randn(3, n, 64).bfloat16()
            cases += 1
            differ += not torch.equal(shifted_mask(q, k, v, n - e), padded_square(q, k, v, n - e))
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads: {differ} of {cases} cases differ")
