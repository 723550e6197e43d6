"""One compression call per scheduler step: every request whose trigger fires, batched.

`compress_batch` takes the step's requests, decides on the host which ones compress and every count
that decides slots (region length, sinks, recent window, budget, so the kept count `k` per request), and
then runs the tensor work once for all of them wherever it can:

- *batched* (the common path): the region is the request's own (no tree-owned slot in it), the policy
  declares itself `batchable` and does not merge, and its window of captured queries is full when it
  needs attention. The policy's own `select_batch` (in its module under `policies/`) selects over a
  `BatchView`, `[requests, layers, heads, tokens]`, from host counts its `batch_counts` gave; this
  module knows no policy by name. Requests of different lengths are padded to the longest; every
  ragged index is built on the host from host-known lengths, so the step never reads a device value:
  no host synchronisation (`tests/test_engine_sync.py` counts them). Compaction moves each request's kept
  tokens into the first `k` slots of its region, one gather and one write per layer and buffer for all
  requests together, and the rest of the slots go back to the allocator in one call.
- *per request* (`compressor.run`): everything else (policies that are not batchable or that merge, the
  refiners among them, a region that starts in the tree, a capture window not yet full).

Plan / agree / commit is kept: the batched plan writes nothing; tensor-parallel ranks agree on its
success (one all-reduce for the batch); if it fails anywhere, every request of the batch goes through
the per-request path instead, which degrades only the request whose policy failed.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from sgl_kvevict.cache import capture, compressor, eviction, tp, trigger
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.trigger import Job
from sgl_kvevict.policies.base import BatchView, Phase

logger = logging.getLogger("sgl_kvevict")

# Bound on one chunk of window-attention logits (fp32 elements): requests are scored in chunks below it.
MAX_LOGITS = 1 << 26


def _policy_key(job: Job) -> str | None:
    """The batch group of a job, or None when it must take the per-request path."""
    pol = job.s.policy
    if not pol.batchable or job.own_start > job.a or pol.merges or "o_proj" in pol.needs:
        return None  # (a `BatchView` carries window attention, not W_O)
    if "attn" in pol.needs:
        w = pol.config.window
        if w > job.a + job.n or capture.count(job.s.ctx, job.req.kv.req_pool_idx, _length(job)) < w:
            return None
    cls = type(pol)
    return f"{cls.__module__}.{cls.__qualname__}" + json.dumps(
        pol.config.model_dump(mode="json"), sort_keys=True
    )


def _length(job: Job) -> int:
    """The request's logical length: the positions its captured queries are indexed by."""
    return job.s.slot_map.tokens_for(job.a + job.n)


def compress_batch(items: list[tuple[Any, Phase]], cap: int | None = None) -> list[int]:
    """Compress every request whose trigger fires; returns the slots each request freed (0 if none).

    A policy failure degrades only its request (as `compressor.safe_compress` does one at a time).
    `cap`: region tokens this step may compress (`--kv-compress-step-tokens`); see `_defer`."""
    freed = [0] * len(items)
    jobs: list[tuple[int, Job]] = []
    for i, (req, phase) in enumerate(items):
        try:
            job = trigger.prepare(req, phase)
        except Exception:
            compressor.degrade(req)
            continue
        if job is not None:
            jobs.append((i, job))
    if cap is not None:
        jobs = _defer(jobs, cap)
    groups: dict[str, list[tuple[int, Job]]] = {}
    single: list[tuple[int, Job]] = []
    for i, job in jobs:
        key = None if _split(job, cap) else _policy_key(job)
        (single if key is None else groups.setdefault(key, [])).append((i, job))
    for members in groups.values():
        done = None
        error = None
        try:
            done = _run_group([j for _, j in members])
        except Exception as e:
            error = e
        if not tp.agree(members[0][1].s.ctx.rt, error is None) or done is None:
            logger.warning("kvevict: batched compression failed (%s); per request instead", error)
            single.extend(members)
            continue
        for (i, _), f in zip(members, done, strict=True):
            freed[i] = f
    for i, job in single:
        freed[i] = compressor.safe_run(job)
    return freed


def _split(job: Job, cap: int | None) -> bool:
    """Whether the job plans only part of its layers this step: its region is larger than the step's
    cap (about `cap` region tokens' worth of layers run per step), or it is already under way."""
    if cap is None or (job.n <= cap and job.s.pending is None):
        return job.s.pending is not None
    job.layers = max(1, cap * job.s.ctx.rt.n_layers // max(1, job.n))
    return True


def _defer(jobs: list[tuple[int, Job]], cap: int) -> list[tuple[int, Job]]:
    """The jobs that run this step: split plans under way first (finishing them frees their memory
    soonest), then those that waited longest, until their regions cover `cap` tokens (at least one
    runs, so every step progresses). The rest wait; a job deferred right after prefill keeps its phase
    for the step that runs it."""
    order = sorted(jobs, key=lambda ij: (ij[1].s.pending is None, -ij[1].s.deferred))
    run, spent = [], 0
    for i, job in order:
        if run and spent >= cap:
            job.s.deferred += 1
            job.s.after_extend = job.phase == "prefill"
            job.s.ctx.rt.totals.compressions_deferred += 1
            continue
        job.s.deferred = 0
        spent += min(job.n, cap)  # a larger job plans only part of its layers (`_split`)
        run.append((i, job))
    return run


def _col(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).view(-1, 1).to(device, non_blocking=True)


def _run_group(jobs: list[Job]) -> list[int]:
    """Plan (select) for the group's requests at once, then commit: compaction and frees for all."""
    t0 = time.perf_counter()
    rt = jobs[0].s.ctx.rt
    rt.order_after_forward()
    pol = jobs[0].s.policy
    # kept counts and raw tails, host-only (a policy may refuse a request here: the group goes per request)
    counts = [pol.batch_counts(j.n, j.n_sink, j.n_recent, j.s.slot_map.comp_slots, j.budget) for j in jobs]
    if all(c.k >= j.n for c, j in zip(counts, jobs, strict=True)):
        return [0] * len(jobs)
    batch = _batch_view(jobs, counts)
    keep = pol.select_batch(batch)  # [R, L, H, Kmax], sorted, Nmax past each request's k
    ks = [c.k for c in counts]
    _commit_group(jobs, batch.slots, keep, ks)
    _bookkeeping(jobs, batch, keep, counts, t0)
    return [j.n - k for j, k in zip(jobs, ks, strict=True)]


def _batch_view(jobs: list[Job], counts: list) -> BatchView:
    """The group's regions as the policy's batched selection sees them (window attention included when
    the policy needs it): slots padded to the longest region, padding reading the row's first slot."""
    rt = jobs[0].s.ctx.rt
    dev = rt.req_to_token.device
    L = rt.n_layers  # noqa: N806
    ns = [j.n for j in jobs]
    nmax = max(ns)
    pad_pos = torch.arange(nmax, dtype=torch.int64).unsqueeze(0)
    n_col = torch.tensor(ns, dtype=torch.int64).view(-1, 1)
    anchors = torch.tensor([j.a for j in jobs], dtype=torch.int64).view(-1, 1)
    cols = (anchors + pad_pos.clamp(max=n_col - 1)).to(dev)
    slots_pad = rt.req_to_token[_col([j.req.kv.req_pool_idx for j in jobs], dev), cols].to(torch.int64)
    valid = (pad_pos < n_col).to(dev)  # [R, Nmax]
    batch = BatchView(
        slots=slots_pad,
        valid=valid,
        k_buffers=[rt.k_buffer(layer) for layer in range(L)],
        v_buffers=[rt.v_buffer(layer) for layer in range(L)],
        counts=counts,
        states=[j.s.policy_state.layers for j in jobs],
        stacks=[j.s.policy_state.carry_stack for j in jobs],
    )
    if "attn" in jobs[0].s.policy.needs:
        batch.attn = _window_attention(jobs, cols, valid)  # [R, L, H, Nmax]
    return batch


def _commit_group(jobs: list[Job], slots_pad: torch.Tensor, keep: torch.Tensor, ks: list[int]) -> None:
    """The group's commit: each request's evicted entries shown to its `eviction.Eviction` first (the
    host tier copies them), then `compressor.compact_own` for all requests at once (the commit the
    per-request path uses for a region of its own). Nothing here can fail on valid indices; a failure
    before it left everything as it was."""
    evs = [eviction.open_for(j.s) for j in jobs]
    for r, (j, k, ev) in enumerate(zip(jobs, ks, evs, strict=True)):
        if ev is not None:
            ev.evicting(j.a, slots_pad[r, : j.n], keep[r, :, :, :k])
    compressor.compact_own(jobs[0].s.ctx, slots_pad, keep, ks, [j.n for j in jobs])
    for ev in evs:
        if ev is not None:
            ev.close(True)


def _bookkeeping(jobs: list[Job], batch: BatchView, keep: torch.Tensor, counts: list, t0: float) -> None:
    """Host bookkeeping per request; the tensor state (carried scores, row offsets) in one op each."""
    rt = jobs[0].s.ctx.rt
    L, nmax = rt.n_layers, batch.slots.shape[1]  # noqa: N806
    ks = [c.k for c in counts]
    for j in jobs:
        if not j.s.policy_state.layers:
            j.s.policy_state.layers = [{} for _ in range(L)]
    if batch.scored is not None:  # the kept tokens' scores, carried to the next compression
        carried = batch.scored.gather(-1, keep.clamp(max=nmax - 1))  # [R, L, H, Kmax]
        for r, (j, k) in enumerate(zip(jobs, ks, strict=True)):
            per = carried[r, :, :, :k]
            for layer, d in enumerate(j.s.policy_state.layers):
                d.pop("scored", None)
                d["carried"] = per[layer]
            j.s.policy_state.carry_stack = per
    dt = (time.perf_counter() - t0) / len(jobs)
    offs = []
    for r, (j, c) in enumerate(zip(jobs, counts, strict=True)):
        kr = keep[r, :, :, : c.k] if st.tracks_positions(j.s.ctx) else None
        kv = j.req.kv
        kv.kv_committed_len = kv.kv_allocated_len = j.a + c.k
        offs.append(compressor.account(j, c.k, min(c.raw, c.k), kr, dt))
    rows = torch.tensor([j.req.kv.req_pool_idx for j in jobs], dtype=torch.int64)
    rt.tree.offsets[rows.to(rt.tree.offsets.device)] = torch.tensor(offs, dtype=rt.tree.offsets.dtype).to(
        rt.tree.offsets.device
    )


def _window_attention(jobs: list[Job], reg: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`kernels.window_attention(causal=True)` for every request and layer at once, restricted to each
    region: `[R, L, Hkv, Nmax]`, zeros in the padding. Keys are each request's whole row (prefix +
    region), padded; the causal mask and the padding come from host-known lengths. `reg`, `valid`: the
    group's padded region positions in each row and which of them are real."""
    rt = jobs[0].s.ctx.rt
    dev = rt.req_to_token.device
    R, L, H, Hq, D = len(jobs), rt.n_layers, rt.n_kv_heads, rt.n_q_heads, rt.head_dim  # noqa: N806
    g = Hq // H
    w = jobs[0].s.policy.config.window
    alls = [j.a + j.n for j in jobs]
    amax = max(alls)
    pos = torch.arange(amax, dtype=torch.int64).unsqueeze(0)
    all_col = torch.tensor(alls, dtype=torch.int64).view(-1, 1)
    rows = _col([j.req.kv.req_pool_idx for j in jobs], dev)
    slots = rt.req_to_token[rows, pos.clamp(max=all_col - 1).to(dev)].to(torch.int64).reshape(-1)  # [R*A]
    # query i of the window sits at position len - w + i and sees keys up to there; padding sees nothing
    limit = (all_col - w).view(R, 1, 1, 1) + torch.arange(w).view(1, 1, w, 1)  # [R, 1, W, 1]
    masked = (torch.arange(amax).view(1, 1, 1, amax) > limit).to(dev)  # [R, 1(G), W, A]
    # every request's last w queries, oldest first, in one gather out of the capture store
    q_all = jobs[0].s.ctx.capture.stacked(
        [j.req.kv.req_pool_idx for j in jobs], [_length(j) for j in jobs], w
    )
    nmax = reg.shape[1]  # `reg`: the region part of each row, a padded [R, Nmax] gather out of [R, A]
    out = torch.zeros(R, L, H, nmax, dtype=torch.float32, device=dev)
    step = max(1, MAX_LOGITS // max(1, H * g * w * amax))
    for layer in range(L):
        k = rt.k_buffer(layer).index_select(0, slots).float().view(R, amax, H, D)
        q = q_all[:, layer].float().view(R, w, H, g, D).permute(0, 2, 3, 1, 4)  # [R, H, G, W, D]
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            kh = k[r0:r1].permute(0, 2, 3, 1)  # [r, H, D, A]
            logits = torch.matmul(q[r0:r1].reshape(r1 - r0, H, g * w, D), kh).mul_(rt.scale)
            logits = logits.view(r1 - r0, H, g, w, amax).masked_fill_(
                masked[r0:r1].unsqueeze(1), float("-inf")
            )
            p = torch.softmax(logits, dim=-1).mean(dim=(2, 3))  # [r, H, A]
            out[r0:r1, layer] = p.gather(2, reg[r0:r1].unsqueeze(1).expand(r1 - r0, H, nmax))
    return out.masked_fill_(~valid.view(R, 1, 1, nmax), 0.0)
