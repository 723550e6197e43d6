"""The decode step's recall in fixed shapes (`cache/host_tier/decode_recall.py`) on SGLang's real pools: it swaps
exactly what the per-request recall swaps for the same query, its op sequence depends on its shapes
only (what a CUDA graph needs) with no host sync, and a failure inside it puts everything back."""

from __future__ import annotations

import pytest
import torch

from sgl_kvevict import kernels
from sgl_kvevict.cache import compressor, slotstats
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import decode_recall, demote, host, recall, recall_core
from sgl_kvevict.config import RecallTuning, ServerSettings
from sgl_kvevict.tools.pools import Pools, SyncCounter

L, H, G, D, N, W, R = 3, 2, 2, 16, 160, 16, 6


@pytest.fixture(autouse=True)
def _exact(monkeypatch) -> None:
    """Every host key scored (the per-request recall compared with fetches every page) and no score floor
    unless a test sets one (`recall_core.MIN_SCORE`)."""
    monkeypatch.setattr(recall, "FETCH_PAGES", 1 << 30)
    monkeypatch.setattr(recall_core, "MIN_SCORE", 0.0)


def _ready(
    n_reqs: int,
    page: int,
    seed: int = 0,
    recalls: tuple[int, ...] = (R, 3),
    dtype: torch.dtype = torch.float32,
):
    """`n_reqs` requests, each compressed once (its evictions demoted to the host), and per layer a
    decode step's queries `[B, Hq, D]`. fp32 pools take the torch form of a layer; bf16 pools on a CPU
    take `kernels.recall_layer_cpu`."""
    p = Pools(layers=L, kv_heads=H, group=G, head_dim=D, max_reqs=4, max_len=256, dtype=dtype, seed=seed)
    p.ctx.settings = ServerSettings(recall_tokens=R, recall=RecallTuning(page=page, every=1))
    batch = p.batch(n_reqs, N, "snapkv", 48, {"window": W})
    demote.attach(p.ctx, host.HostPool(L, H, D, 1024, dtype))
    with compressor.one_thread():
        for req, r in zip(batch.reqs, recalls, strict=False):
            s = st.get(req)
            s.recall.tokens = r
            if st.DEBUG:  # the row's logical positions, as a server's match sets them
                s.trace.pos, s.trace.tokens = torch.arange(N).expand(L, H, N).clone(), N
            assert compressor.compress(req, "prefill") > 0
    q = torch.randn(L, n_reqs, H * G, D, generator=torch.Generator().manual_seed(seed + 7)) * 3
    return p, batch.reqs, q


def _with_slot_stats(p: Pools) -> None:
    """A per-slot statistic buffer (`slotstats`), written everywhere, for the recalls to mark stale."""
    slots = p.kv.get_key_buffer(0).shape[0]
    p.ctx.slot_stats = slotstats.SlotStats(torch.ones(L, slots, H), [], 0, torch.float32)


def _bounds(req) -> tuple[int, int, int]:
    """`(lo, hi, r)` of a decode step's recall, as `recall.arm` computes them (one step since the last)."""
    s = st.get(req)
    lo, hi = recall._displaceable(s)
    return lo, hi, recall.swaps(s, lo, hi, 1)


def _held(p: Pools, reqs) -> list[torch.Tensor]:
    """Every request's row (K and V) and its branch's host columns, for comparing two runs."""
    out = []
    for i, req in enumerate(reqs):
        slots = p.r2t.req_to_token[i, : req.kv.kv_committed_len].long()
        cols = st.get(req).recall.host.cols
        for ly in range(L):
            out += [p.kv.get_key_buffer(ly)[slots], p.kv.get_value_buffer(ly)[slots]]
            out += [p.ctx.host.k[ly][cols], p.ctx.host.v[ly][cols]]
    return out


def _step(p: Pools, reqs, q: torch.Tensor) -> decode_recall.StepPlan:
    for req in reqs:
        decode_recall.arm(req, st.get(req), *_bounds(req))
    one = decode_recall.plan(p.ctx, reqs)
    for ly in range(L):
        one.layer(p.ctx, ly, q[ly])
    return one


@pytest.mark.parametrize(
    ("n_reqs", "page", "floor", "debug"),
    [(1, 1, 0.0, False), (2, 3, 0.0, True), (2, 5, 0.05, False), (1, 5, 0.0, True)],
)
def test_a_step_swaps_what_the_per_request_recall_swaps(
    n_reqs: int, page: int, floor: float, debug: bool, monkeypatch
):
    """Two identical pool sets: on one, each request's recall runs alone (`recall.Recall`, the query of
    the step over its row); on the other, one fixed-shape step for the batch. Rows, host columns and
    counters end equal, and entries did move (the comparison is not of two no-ops). With KVEVICT_DEBUG,
    the logical positions the row and the host hold (what the oracle replays) end equal too."""
    monkeypatch.setattr(st, "DEBUG", debug)
    monkeypatch.setattr(recall_core, "MIN_SCORE", floor)
    ref, reqs_ref, q = _ready(n_reqs, page)
    _with_slot_stats(ref)
    for i, req in enumerate(reqs_ref):  # one query head per request leans on its branch's last host entry:
        s = st.get(req)  # its page, partial when the count is not a multiple of `page`, ranks first
        assert s.recall.host.count % page or page == 1
        q[0, i, 0] = ref.ctx.host.k[0][s.recall.host.cols[-1], 0].float() * 4
    for i, req in enumerate(reqs_ref):
        s = st.get(req)
        m = int(req.kv.kv_committed_len)
        one = recall.Recall.start(req, s, m, s.slot_map.tokens_for(m), *_bounds(req))
        for ly in range(L):
            one.layer(ly, q[ly, i][:, None])
        one.finish()
    p, reqs, _ = _ready(n_reqs, page)
    _with_slot_stats(p)
    # padded host columns read the scratch column, which is never written before (uninitialised memory,
    # NaN here): the step's padding must keep whatever it holds out of the softmax
    for buf in (p.ctx.host.k, p.ctx.host.v):
        buf[:, p.ctx.host.scratch] = float("nan")
    before = [x.clone() for x in _held(p, reqs)]
    one = _step(p, reqs, q)
    assert decode_recall.finish(p.ctx, one) == sum(st.get(r).recall.recalled for r in reqs_ref) > 0
    for a, b in zip(_held(ref, reqs_ref), _held(p, reqs), strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(before, _held(p, reqs), strict=True))
    for r_ref, r in zip(reqs_ref, reqs, strict=True):
        a, b = st.get(r_ref), st.get(r)
        assert (a.recall.recalled, a.recall.bytes_moved) == (b.recall.recalled, b.recall.bytes_moved)
        if debug:
            assert a.recall.host.positions is not None and torch.equal(
                a.recall.host.positions, b.recall.host.positions
            )
            assert a.trace.timeline[-1] == b.trace.timeline[-1]
    assert not p.ctx.host.in_use  # the step's hold on the branches ends with it
    # a moved slot's ||v W_O|| statistic is another value's: stale (NaN) in the moved (layer, slot, head)s
    # only, as the per-request recall marks them
    stale = p.ctx.stats.isnan()
    assert torch.equal(stale, ref.ctx.stats.isnan())
    assert int(stale.sum()) == int(one.moved.sum()) == sum(st.get(r).recall.recalled for r in reqs)
    for i, req in enumerate(reqs):  # no padded host column moved
        moved_cols = one.hidx[:, i][one.moved[:, i]]
        assert int(moved_cols.max()) < st.get(req).recall.host.count
    if n_reqs == 2:  # the second request's r = 3 bounded its swaps per layer and head
        assert int(one.moved[:, 1].sum(-1).max()) <= 3


@pytest.mark.skipif(
    not kernels.recall_layer_cpu_supports(torch.zeros(1, dtype=torch.bfloat16)), reason="no numba"
)
@pytest.mark.parametrize(("n_reqs", "page", "floor"), [(1, 1, 0.0), (2, 3, 0.0), (2, 8, 0.05), (1, 5, 0.0)])
def test_the_cpu_kernel_decides_and_exchanges_as_the_torch_form(
    n_reqs: int, page: int, floor: float, monkeypatch
):
    """Two identical bf16 pool sets, one decode step each: the torch form (`choose`, `host_swap`) on one,
    `kernels.recall_layer_cpu` on the other. The records (where a pair moved: which entries; everywhere:
    the slots and columns exchanged, 0 and the scratch column elsewhere), the rows, the host columns and
    the counters end equal, and entries did move."""
    monkeypatch.setattr(recall_core, "MIN_SCORE", floor)
    runs = []
    for kernel in ("torch", ""):
        monkeypatch.setenv("KVEVICT_RECALL_KERNEL", kernel)
        p, reqs, q = _ready(n_reqs, page, dtype=torch.bfloat16)
        assert decode_recall.fused_on_cpu(p.kv.get_key_buffer(0)) == (kernel == "")
        for i, req in enumerate(reqs):  # a query head leans on the branch's last host entry, as above
            q[0, i, 0] = p.ctx.host.k[0][st.get(req).recall.host.cols[-1], 0].float() * 4
        for buf in (p.ctx.host.k, p.ctx.host.v):  # padding reads the scratch column: NaN stays out
            buf[:, p.ctx.host.scratch] = float("nan")
        one = _step(p, reqs, q)
        records = [x.clone() for x in (one.pos, one.hidx, one.dev_slots, one.host_cols, one.moved)]
        n = decode_recall.finish(p.ctx, one)
        runs.append((records, n, _held(p, reqs), [st.get(r).recall.bytes_moved for r in reqs]))
    (ref, n_ref, held_ref, bytes_ref), (got, n_got, held_got, bytes_got) = runs
    moved = ref[4]
    assert torch.equal(moved, got[4]) and n_ref == n_got == int(moved.sum()) > 0
    for a, b in zip(ref[:2], got[:2], strict=True):
        assert torch.equal(a[moved], b[moved])
    for a, b in zip(ref[2:4], got[2:4], strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(held_ref, held_got, strict=True))
    assert bytes_ref == bytes_got


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a step dispatches, with their tensor arguments' shapes and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        sig = tuple((tuple(x.shape), x.dtype) for x in flat if isinstance(x, torch.Tensor))
        self.ops.append((str(func), sig))
        return func(*args, **(kwargs or {}))


def test_the_op_sequence_follows_the_shapes_not_the_data():
    """What a CUDA graph replays is fixed at capture: the step must dispatch the same ops on the same
    shapes whatever the data decides (here: other keys and queries, so other entries and other counts
    move, and one request whose r is smaller), and read nothing back on the host."""
    runs = []
    for seed, recalls in ((0, (R, R)), (1, (R, 1))):
        p, reqs, q = _ready(2, 4, seed=seed, recalls=recalls)
        for req in reqs:
            decode_recall.arm(req, st.get(req), *_bounds(req))
        one = decode_recall.plan(p.ctx, reqs)
        ops, syncs = _Ops(), SyncCounter()
        with syncs, ops:
            for ly in range(L):
                one.layer(p.ctx, ly, q[ly])
        assert syncs.total == 0, syncs.counts
        runs.append((ops.ops, one.moved.clone(), (one.width, one.bounds.cols.shape, one.bounds.swaps)))
        decode_recall.finish(p.ctx, one)
    (ops_a, moved_a, shape_a), (ops_b, moved_b, shape_b) = runs
    assert shape_a == shape_b
    assert not torch.equal(moved_a, moved_b)  # the data did decide differently
    assert ops_a == ops_b


@pytest.mark.parametrize(
    ("dtype", "fault"), [(torch.float32, "swap"), (torch.float32, "index"), (torch.bfloat16, "index")]
)
def test_a_failure_inside_the_step_puts_everything_back(dtype: torch.dtype, fault: str, monkeypatch):
    """An exception at the last layer (after the first layers swapped): `decode_recall.fail` swaps those
    back, so rows and host columns hold what they held, and counts the failure once; the step's requests
    keep recall but run it alone from then on (`recall.safe_recall`, after their compressions), where a
    failure is one request's own. Nothing is counted as recalled by the failed step. The fault: the
    exchange raising, or an index outside the host store (on bf16 pools, in the CPU kernel, which checks
    every index before it moves anything)."""
    p, reqs, q = _ready(2, 2, dtype=dtype)
    before = [x.clone() for x in _held(p, reqs)]
    for req in reqs:
        decode_recall.arm(req, st.get(req), *_bounds(req))
    one = decode_recall.plan(p.ctx, reqs)
    for ly in range(L - 1):
        one.layer(p.ctx, ly, q[ly])
    assert one.moved[: L - 1].any()
    if fault == "swap":
        monkeypatch.setattr(
            decode_recall.K, "host_swap", lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
        )
    else:  # a host index outside the store: the torch gather and the CPU kernel both refuse it
        one.buf.host_ids[1, 0, 0] = p.ctx.host.k.shape[1] * H
    with pytest.raises((RuntimeError, IndexError)):
        one.layer(p.ctx, L - 1, q[L - 1])
    monkeypatch.undo()
    decode_recall.fail(p.ctx, one)
    assert decode_recall.finish(p.ctx, one) == 0
    for a, b in zip(before, _held(p, reqs), strict=True):
        assert torch.equal(a, b)
    assert p.ctx.host.totals.recall_failures == 1 and not p.ctx.host.in_use
    for req in reqs:
        s = st.get(req)
        assert demote.enabled(s) and s.recall.alone and s.recall.recalled == 0 and not s.failed
        s.recall.steps = 1
        assert recall.after_compress(req, decode=True) == 0  # alone: recalled now, not armed
        assert req.kv.req_pool_idx not in p.ctx.decode_armed and s.recall.recalled > 0


def _layer_inputs(p: Pools, one: decode_recall.StepPlan, q: torch.Tensor) -> tuple:
    """`choose`'s arguments at layer 0, gathered as `StepPlan.layer` gathers them."""
    slots, keys_row, keys_host = one.gather(p.ctx, 0)
    return q[0], keys_row, keys_host, slots, one.bounds, p.ctx.rt.scale


def _one_layer(one: decode_recall.StepPlan, ctx, layer: int, q_layer: torch.Tensor) -> None:
    one.layer(ctx, layer, q_layer)


def test_a_layer_compiles_to_one_graph_equal_to_eager():
    """A layer of the step (`StepPlan.layer`: the gather from both pools, every decision, the exchange and
    its records) traced whole by `torch.compile(fullgraph=True)`: a Python branch on a tensor's value would
    break the graph and fail here. On two identical pool sets, the compiled step leaves the rows, host
    columns and records equal to the eager step's, and entries did move."""
    runs = []
    for compiled in (False, True):
        p, reqs, q = _ready(2, 3, recalls=(R, 2))
        for req in reqs:
            decode_recall.arm(req, st.get(req), *_bounds(req))
        one = decode_recall.plan(p.ctx, reqs)
        torch._dynamo.reset()
        step = torch.compile(_one_layer, fullgraph=True, backend="aot_eager") if compiled else _one_layer
        for ly in range(L):
            step(one, p.ctx, ly, q[ly])
        runs.append((_held(p, reqs), one.moved.clone(), one.host_cols.clone(), one.dev_slots.clone()))
        decode_recall.finish(p.ctx, one)
    (held_e, *rec_e), (held_c, *rec_c) = runs
    assert rec_e[0].any() and not rec_e[0].all()
    for x, y in zip(held_e + rec_e, held_c + rec_c, strict=True):
        assert torch.equal(x, y)


def test_the_graph_check_catches_a_planted_branch_on_a_value():
    """The check above can fail: a layer's decision (`choose`) with a Python branch on a tensor's value (what a
    per-request recall does: stop when nothing beats the row) does not compile to one graph. (A host
    read alone may compile, as an unbacked size: the sync count above is that check.)"""
    p, reqs, q = _ready(1, 3)
    decode_recall.arm(reqs[0], st.get(reqs[0]), *_bounds(reqs[0]))
    args = _layer_inputs(p, decode_recall.plan(p.ctx, reqs), q)

    def with_branch(*a):
        ex = decode_recall.choose(*a)
        return ex if ex.moved.any() else ex._replace(dev_slots=ex.dev_slots * 0)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)graph break|data.dependent|item|unsupported"):
        torch.compile(with_branch, fullgraph=True, backend="aot_eager", dynamic=False)(*args)


def test_plans_of_one_bucket_refill_the_same_tensors(monkeypatch):
    """A graph captured for a bucket replays on fixed addresses: a second plan of the same bucket (batch,
    row width, host columns, swaps) refills the first one's tensors, inputs and records, and still
    exchanges what the per-request recall would (the first test); another batch size gets its own; a
    server keeps at most `MAX_BUCKETS` of them."""
    p, reqs, q = _ready(2, 3)
    first = _step(p, reqs, q)
    decode_recall.finish(p.ctx, first)
    ptrs = [x.data_ptr() for x in (first.buf.rows, first.buf.cols, first.buf.r, first.moved, first.host_cols)]
    second = _step(p, reqs, -q)
    assert second.buf is first.buf and second.layers_done == L
    assert [
        x.data_ptr() for x in (second.buf.rows, second.buf.cols, second.buf.r, second.moved, second.host_cols)
    ] == ptrs
    decode_recall.finish(p.ctx, second)
    monkeypatch.setattr(decode_recall, "MAX_BUCKETS", 1)
    decode_recall.arm(reqs[0], st.get(reqs[0]), *_bounds(reqs[0]))
    alone = decode_recall.plan(p.ctx, reqs[:1])
    assert alone.buf is not first.buf and alone.batch == 1
    assert list(p.ctx.step_buffers.values()) == [[alone.buf]]


def _steps(p: Pools, reqs, qs: list[torch.Tensor], overlap: bool) -> tuple[list, list[torch.Tensor]]:
    """Decode steps through the scheduler's calls (`recall.plan_step`, the forward's layers,
    `recall.finish_step`). With `overlap`, as SGLang's overlap scheduler orders them: step k+1 is planned
    and run before step k's results are processed. Returns the plans and each step's records as the
    step left them."""
    plans, records = [], []
    for k, q in enumerate(qs):
        for req in reqs:
            decode_recall.arm(req, st.get(req), *_bounds(req))
        recall.plan_step(p.ctx, reqs)
        one = p.ctx.step_plan
        for ly in range(L):
            one.layer(p.ctx, ly, q[ly])
        plans.append(one)
        records += [x.clone() for x in (one.moved, one.pos, one.hidx)]
        if overlap and k > 0:
            recall.finish_step(p.ctx)  # step k-1's results
            rows = {req.kv.req_pool_idx for req in reqs}
            assert set(p.ctx.host.in_use) == rows, "the step in flight lost its hold on the host entries"
        if not overlap:
            recall.finish_step(p.ctx)
    if overlap:
        recall.finish_step(p.ctx)
        assert all(
            torch.equal(a, b) for a, b in zip(records[-3:], (one.moved, one.pos, one.hidx), strict=True)
        )
    return plans, records


def test_overlapped_steps_recall_as_sequential_steps_do():
    """Under the overlap scheduler a decode step is planned and run before the previous step's records
    are read: each step in flight gets its own buffers (the first step's records survive the second), the
    second step's hold on the host entries survives the first one's finish, and pools, records and
    counts end as with the steps one after another. The overlapped steps are counted as such."""
    runs = []
    for overlap in (False, True):
        p, reqs, q = _ready(2, 2)
        plans, records = _steps(p, reqs, [q, -q], overlap)
        if overlap:  # and the first step's records were read after the second step ran
            assert plans[0].buf is not plans[1].buf and torch.equal(plans[0].moved, records[0])
        counts = [st.get(r).recall.recalled for r in reqs]
        runs.append((_held(p, reqs), records, counts, p.ctx.host.totals.decode_steps_overlapped))
        assert not p.ctx.host.in_use and not p.ctx.steps_in_flight and p.ctx.step_plan is None
    (held_a, rec_a, n_a, over_a), (held_b, rec_b, n_b, over_b) = runs
    assert rec_a[0].any() and rec_a[3].any(), "a step moved nothing: the check would be empty"
    assert n_a == n_b and (over_a, over_b) == (0, 1)
    for a, b in zip(held_a + rec_a, held_b + rec_b, strict=True):
        assert torch.equal(a, b)


def test_a_request_found_finished_gets_its_overlapped_step_undone():
    """The overlap scheduler finds a request finished only after its next step ran: that step's exchanges
    for it go back (`recall.drop_finished`, before its last compression), so its row and host columns
    hold what they held after its real last step; the other request's exchanges stand."""
    p, reqs, q = _ready(2, 2)
    for req in reqs:
        decode_recall.arm(req, st.get(req), *_bounds(req))
    recall.plan_step(p.ctx, reqs)
    for ly in range(L):
        p.ctx.step_plan.layer(p.ctx, ly, q[ly])
    per_req = 4 * L  # `_held` lists each request's row and host columns, in request order
    after_first = [x.clone() for x in _held(p, reqs)[:per_req]]
    for req in reqs:
        decode_recall.arm(req, st.get(req), *_bounds(req))
    recall.plan_step(p.ctx, reqs)
    second = p.ctx.step_plan
    for ly in range(L):
        second.layer(p.ctx, ly, -q[ly])
    assert second.moved[:, 0].any() and second.moved[:, 1].any(), "the second step moved nothing"
    other = [x.clone() for x in _held(p, reqs)[per_req:]]
    recall.finish_step(p.ctx)
    recall.drop_finished(reqs[0], st.get(reqs[0]))
    for a, b in zip(after_first + other, _held(p, reqs), strict=True):
        assert torch.equal(a, b)
    assert second.arms[0] is None and not second.moved[:, 0].any()
    recall.finish_step(p.ctx)
    assert not p.ctx.steps_in_flight


def _changed_pairs(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[tuple[int, int]]:
    """The (layer, KV head) pairs where a request's row or its host columns changed (`_held`'s order:
    per request, per layer, row K, row V, host K, host V)."""
    changed = set()
    for k, (b, a) in enumerate(zip(before, after, strict=True)):
        layer = (k // 4) % L
        changed |= {(layer, h) for h in range(H) if not torch.equal(a[:, h], b[:, h])}
    return changed


EVERY_PAIR = {(layer, h) for layer in range(L) for h in range(H)}


def test_a_step_recalls_in_every_layer_and_head():
    """A decode step scores and exchanges in every (layer, KV head) pair: each pair moved entries (its
    records say so, and its row and host columns changed), and the host keys read are every layer's."""
    p, reqs, q = _ready(2, 3)
    before = [x.clone() for x in _held(p, reqs)]
    read = p.ctx.host.totals.keys_read
    one = _step(p, reqs, q)
    assert one.layers_done == L
    assert bool(one.moved.any(dim=-1).any(dim=1).all()), one.moved.any(dim=-1).any(dim=1)  # [L, H]
    assert _changed_pairs(before, _held(p, reqs)) == EVERY_PAIR
    cols = sum(int(a.cols.numel()) for a in one.arms if a is not None)
    decode_recall.finish(p.ctx, one)
    pool = p.ctx.host
    assert pool.totals.keys_read - read == cols * H * D * pool.k.element_size() * L


def test_a_request_recalling_alone_during_decode_recalls_in_every_head():
    """The other decode-time path (a request that recalls alone after a failure, or every request once a
    CUDA graph ran without the hook: `recall.recall` after the step's compression) recalls in every
    (layer, KV head) pair too: each pair's row and host columns changed."""
    p, reqs, _ = _ready(1, 2)
    before = [x.clone() for x in _held(p, reqs)]
    s = st.get(reqs[0])
    s.recall.alone, s.recall.steps = True, 1
    assert recall.after_compress(reqs[0], decode=True) == 0 and s.recall.recalled > 0
    assert _changed_pairs(before, _held(p, reqs)) == EVERY_PAIR
