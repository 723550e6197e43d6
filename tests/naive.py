"""The naive references of the scoring formulas, one copy for every test that checks them.

Written from the formulas of `docs/policies.md` and the policies' docstrings, in plain torch loops and
float64: one query head, one window query and one token partition at a time, with the softmax and the
standard deviation spelled out. Nothing here calls `policies/` or `kernels/`, so a test comparing the
two checks the implementation against the formula, not against itself.
"""

from __future__ import annotations

import torch


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """exp(x - max) over its sum: a 1-D float64 vector."""
    e = (x - x.max()).exp()
    return e / e.sum()


def window_attention(
    q: torch.Tensor, keys: torch.Tensor, scale: float, causal: bool = False, reduce: str = "mean"
) -> torch.Tensor:
    """`[Hkv, n]` float64: what each KV head's tokens got from the observation window's queries.

    `q` `[Hq, W, D]`: W window queries of Hq query heads, G = Hq / Hkv of them per KV head (GQA: query
    head h reads KV head h // G); `keys` `[n, Hkv, D]`. Each (query head, window query) gives a softmax of
    q . k * scale over the tokens it sees: all n, or with `causal` the window's query i is token n - W + i
    and sees tokens 0 .. n - W + i (the later ones get 0). A KV head's score per token is the mean over
    its G heads and W queries (`reduce="mean"`) or the largest of them (`"max"`)."""
    hq, w, _ = q.shape
    n, hkv, _ = keys.shape
    g = hq // hkv
    out = torch.zeros(hkv, n, dtype=torch.float64)
    for h in range(hq):
        k = keys[:, h // g].double()
        for i in range(w):
            seen = n - w + i + 1 if causal else n
            p = _softmax(k[:seen] @ q[h, i].double() * scale)
            row = out[h // g, :seen]
            if reduce == "max":
                row.copy_(torch.maximum(row, p))
            else:
                row += p / (g * w)
    return out


def lag_score(z: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`[m]` float64: LagKV's score (Eqs. 7-10) of the tokens `z` `[m, D]` against the next partition
    `ref` `[r, D]`: each token min-max normalised per channel by the reference's min and max (eps 1e-6),
    the unbiased standard deviation over its D channels, then a softmax over z's tokens."""
    z, ref = z.double(), ref.double()
    d = z.shape[1]
    lo = torch.stack([ref[:, c].min() for c in range(d)])
    hi = torch.stack([ref[:, c].max() for c in range(d)])
    stds = []
    for t in z:
        x = (t - lo) / (hi - lo + 1e-6)
        stds.append((((x - x.sum() / d) ** 2).sum() / (d - 1)).sqrt())
    return _softmax(torch.stack(stds))
