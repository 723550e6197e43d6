"""A prefill chunk over both tiers (`cache/exact_prefill.attend`): pure tensor math against a plain
reference, the full cache's attention over the same keys in position order."""

from __future__ import annotations

import pytest
import torch

from sgl_kvevict.cache.host_tier import exact_prefill


def _reference(q, k_all, v_all, visible, scale):
    """Per query head: softmax over the visible keys of its KV head, in float64."""
    n, hq, d = q.shape
    h = k_all.shape[1]
    out = torch.empty(n, hq, v_all.shape[-1], dtype=torch.float64)
    for i in range(n):
        for qh in range(hq):
            kv = qh // (hq // h)
            idx = visible[i].nonzero().squeeze(1)
            s = (k_all[idx, kv].double() @ q[i, qh].double()) * scale
            out[i, qh] = torch.softmax(s, 0) @ v_all[idx, kv].double()
    return out


@pytest.mark.parametrize(("c", "m", "n"), [(0, 5, 4), (7, 0, 3), (13, 9, 6), (40, 30, 300)])
def test_a_chunk_attends_like_the_full_cache(c: int, m: int, n: int, monkeypatch):
    """The history is split between the host (`c` entries, scattered positions) and the row (`m` slots);
    the chunk's `n` tokens follow. The output equals attention over the whole history in position order,
    causal within the chunk, for every query head of a grouped KV head; 300 queries cross the block size,
    here cut to 7 queries by the bound on the scores' bytes."""
    monkeypatch.setattr(exact_prefill, "QUERY_BLOCK", 128)
    monkeypatch.setattr(exact_prefill, "SCORE_BYTES", 4 * 6 * (c + m + n) * (7 if n == 300 else 128))
    g = torch.Generator().manual_seed(c + m + n)
    h, group, d = 2, 3, 8
    hist = c + m
    k_all = torch.randn(hist + n, h, d, generator=g)
    v_all = torch.randn(hist + n, h, d, generator=g)
    q = torch.randn(n, h * group, d, generator=g) * 2
    perm = torch.randperm(hist, generator=g)  # which history positions went to the host
    host, row = perm[:c], perm[c:]
    row_idx = torch.cat([row, torch.arange(hist, hist + n)])
    got = exact_prefill.attend(q, k_all[row_idx], v_all[row_idx], k_all[host], v_all[host], 0.3)
    ar = torch.arange(hist + n)
    visible = ar.unsqueeze(0) <= (hist + torch.arange(n)).unsqueeze(1)
    want = _reference(q, k_all, v_all, visible, 0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_host_entry_changes_the_output():
    """The host entries are attended, not ignored: a key on the host that every query favours moves the
    output toward its value."""
    g = torch.Generator().manual_seed(3)
    q = torch.rand(2, 2, 4, generator=g) + 0.5  # every query has a positive product with the host key
    k_row, v_row = torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g)
    none = exact_prefill.attend(q, k_row, v_row, k_row[:0], v_row[:0], 1.0)
    k_host = torch.full((1, 1, 4), 10.0)
    v_host = torch.full((1, 1, 4), 7.0)
    got = exact_prefill.attend(q, k_row, v_row, k_host, v_host, 1.0)
    assert (got - 7).abs().max() < (none - 7).abs().min()
