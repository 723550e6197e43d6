"""Kernels over SGLang's paged KV pool. Each op has a torch reference and a Triton kernel of identical
signature and semantics; `use_triton()` picks Triton on CUDA tensors (or when KVEVICT_TRITON=1, e.g.
under TRITON_INTERPRET=1 on CPU) and the torch reference otherwise.

Pool layout (SGLang MHATokenToKVPool, one tensor per layer): `k_buffer`, `v_buffer` are `[pool_slots, Hkv, D]`.
A request's tokens are addressed by slot ids taken from its `req_to_token` row.

API (implemented in the modules below; this list is the contract the policies and the runner use):

- window_attention(q, k_buffer, slots, scale, causal=False, reduce="mean") -> [Hkv, N] float32
    q: [Hq, W, D] post-RoPE window queries; slots: [N] int64, *all* of the request's tokens.
    softmax(q k^T * scale) per query over the N tokens, mean over the W queries, then mean over the
    G = Hq // Hkv query heads of each KV head (query head h reads KV head h // G). Each row sums to 1.
    causal=True: the queries are the last W tokens (query i at position N - W + i) and do not see
    later keys, as in the real forward pass (needs W <= N). reduce="max": the largest probability over
    the W queries and the G heads instead of the mean.
- lag_scores(buf, slots, lag) -> [H, P-1, lag] float32
    slots: [P*lag] (P >= 2); partition p (tokens p*lag..) is min-max normalised per channel with the
    min/max of partition p+1, std over channels (unbiased), softmax over the partition's tokens.
    eps = 1e-6 in the denominator for constant channels.
- compact(k_buffers, v_buffers, slots, keep) -> None   (in place, every layer in the lists)
    keep: [L_layers, Hkv, b] int64 sorted ascending region indices per layer and head.
    For each layer l, head h, i < b: buf[slots[i], h] = old buf[slots[keep[l, h, i]], h]. Source and
    destination overlap (keep[l,h,i] >= i); results must equal a gather-then-write.
- d2o_merge(k_buffer, v_buffer, slots, keep, tau, beta, init, stats=None) -> new tau [Hkv] float32   (in place)
    keep: [Hkv, b] sorted region indices; evicted = the complement per head. For each evicted e, nearest
    kept c by key cosine similarity u; threshold tau' = mean(u) if init else beta*max(u)+(1-beta)*tau
    per head; evicted with u >= tau' merge into c: Z_c = e + sum exp(u_e), k_c <- (e*k_c + sum exp(u_e) k_e)/Z_c,
    same weights for v. Written back into the kept slots (before compaction). tau: [Hkv] tensor, float or
    None (ignored when init); with nothing evicted it is returned unchanged (zeros for None). If `stats` (a dict) is given, it receives "merged" (evicted tokens merged, over
    all heads, a 0-dim device tensor: no host sync in the op) and "evicted" (an int, over all heads). The paper reading is in d2o_merge.py.
- vo_norms(v_buffer, slots, o_proj) -> [Hkv, N] float32
    o_proj: [Hq, D, hidden]; || v_{h_kv} @ o_proj[h_q] ||_1 per token and query head, mean over the group.
    `vo_norms_rows(v, o_proj)`: the same for `[T, Hkv, D]` rows not in the pool (`-> [Hkv, T]`).

- page_summaries(keys, page) -> (kmin, kmax, kmean) each [ceil(e/page), Hkv, D] float32
    keys: [e, Hkv, D] one layer's host-tier columns; the last page may be partial.
    `page_summaries_append(kmin, kmax, kmean, n_old, keys_new, page)` extends them when demotion appends
    columns; `refresh_pages(...)` rewrites the pages a swap changed (torch only).
- page_scores(q, kmin, kmax, kmean, mode, scale, agg="max") -> [Hkv, p] float32
    q: [W, Hq, D]. mode "minmax": Quest bound sum_d max(q_d min_d, q_d max_d); "mean": q . kmean; scaled,
    then max (a sound bound) or sum over the W queries and the G query heads of each KV head.
    `select_pages(scores, n) -> [Hkv, n]` ascending page ids, `gather_columns(ids, page, n_cols)` -> column
    ids and validity (torch only, no host sync).
- host_swap(k_buffers, v_buffers, dev_slots, host_k, host_v, host_cols, counts=None) -> None   (in place)
    dev_slots, host_cols: [L, Hkv, r]; host_k/v: [L, cols, Hkv, D]. Exchanges dev[l][slot, h] with
    host[l, col, h] for K and V; with counts ([L, Hkv]) only each head's first counts[l, h] pairs.
    `host_fetch`: the same ids, host to device only.
- recall_layer_cpu(q, k_dev, v_dev, k_host, v_host, ...) -> None   (in place; CPU, bf16, numba)
    A decode step's recall at one layer, decided and exchanged in one compiled loop: the CPU form of
    `cache/host_tier/decode_recall.choose` followed by `host_swap` (its reference; there is no Triton
    form: on a GPU the torch form is what a CUDA graph captures). `recall_layer_cpu_supports(k_dev)`.

Every op except `recall_layer_cpu` also exists as `<op>_ref` (torch, fp32 accumulation, bf16 or fp32
buffers) and `<op>_triton`.
The re-exported functions shadow their modules' names here: reach a module (e.g. to tune a chunk size)
with `importlib.import_module("sgl_kvevict.kernels.vo_norms")`.
"""

from ._pool import flat_rows
from .compact import compact, compact_ref, compact_triton
from .d2o_merge import d2o_merge, d2o_merge_ref, d2o_merge_triton
from .dispatch import use_triton
from .host_swap import (
    host_fetch,
    host_fetch_ref,
    host_fetch_triton,
    host_swap,
    host_swap_ref,
    host_swap_triton,
)
from .lag_scores import lag_scores, lag_scores_ref, lag_scores_triton
from .page_scores import (
    gather_columns,
    n_pages,
    page_scores,
    page_scores_ref,
    page_scores_triton,
    page_summaries,
    page_summaries_append,
    page_summaries_ref,
    page_summaries_triton,
    refresh_pages,
    select_pages,
)
from .recall_layer_cpu import recall_layer_cpu
from .recall_layer_cpu import supports as recall_layer_cpu_supports
from .recall_layer_cpu import warm as recall_layer_cpu_warm
from .vo_norms import vo_norms, vo_norms_ref, vo_norms_rows, vo_norms_triton
from .window_attention import window_attention, window_attention_ref, window_attention_triton

__all__ = [
    "recall_layer_cpu",
    "recall_layer_cpu_supports",
    "recall_layer_cpu_warm",
    "compact",
    "compact_ref",
    "compact_triton",
    "d2o_merge",
    "d2o_merge_ref",
    "d2o_merge_triton",
    "gather_columns",
    "flat_rows",
    "host_fetch",
    "host_fetch_ref",
    "host_fetch_triton",
    "host_swap",
    "host_swap_ref",
    "host_swap_triton",
    "lag_scores",
    "lag_scores_ref",
    "lag_scores_triton",
    "n_pages",
    "page_scores",
    "page_scores_ref",
    "page_scores_triton",
    "page_summaries",
    "page_summaries_append",
    "page_summaries_ref",
    "page_summaries_triton",
    "refresh_pages",
    "select_pages",
    "use_triton",
    "vo_norms",
    "vo_norms_ref",
    "vo_norms_rows",
    "vo_norms_triton",
    "window_attention",
    "window_attention_ref",
    "window_attention_triton",
]
