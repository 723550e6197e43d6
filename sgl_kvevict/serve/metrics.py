"""The plugin's counters on SGLang's Prometheus `/metrics` endpoint (`--enable-metrics`).

SGLang runs prometheus_client in multiprocess mode: the launcher sets `PROMETHEUS_MULTIPROC_DIR`
before any process starts, each scheduler writes its metric files there, and the HTTP server's
`/metrics` collects them all. The scheduler process that owns the compressing tree creates these
metrics the same way SGLang's own scheduler collector does, with the same `sglang:` prefix and the
model/rank labels, so they appear beside SGLang's and sum across data-parallel schedulers.

Counters follow `runtime.Totals` (published as increments since the last publish); the gauge is the KV
the tree's compressed nodes hold right now. With the host tier on (`--kv-recall-tokens`), the host
series follow the host pool's totals (`HostPool.stats()`, the same numbers `/server_info` shows under
`host`), and each finished turn that recalled observes its recall time (`recall_seconds` of its report).
"""

from __future__ import annotations

from typing import Any

# (Totals field, metric name, help). Counter names end in `_total` as SGLang's do.
COUNTERS: list[tuple[str, str, str]] = [
    ("compressions", "sglang:kvevict_compressions_total", "KV compression steps run."),
    (
        "tokens_evicted",
        "sglang:kvevict_tokens_evicted_total",
        "Tokens evicted from requests' KV by compression.",
    ),
    ("slots_freed", "sglang:kvevict_slots_freed_total", "KV slots returned to the allocator by compression."),
    ("tokens_merged", "sglang:kvevict_tokens_merged_total", "Evicted tokens merged into kept ones (D2O)."),
    ("seconds_compressing", "sglang:kvevict_compression_seconds_total", "Seconds spent compressing."),
    ("requests_compressed", "sglang:kvevict_requests_compressed_total", "Requests compressed at least once."),
    (
        "policy_failures",
        "sglang:kvevict_policy_failures_total",
        "Compressions skipped because a policy raised.",
    ),
    (
        "compressions_deferred",
        "sglang:kvevict_compressions_deferred_total",
        "Compression checks postponed to a later scheduler step: the step's --kv-compress-step-tokens was spent.",
    ),
    (
        "compressions_split",
        "sglang:kvevict_compressions_split_total",
        "Scheduler steps that planned part of a compression larger than --kv-compress-step-tokens.",
    ),
]
GAUGES: list[tuple[str, str, str]] = [
    (
        "compressed_kv_tokens",
        "sglang:kvevict_compressed_kv_tokens",
        "KV slots held by compressed tree nodes.",
    ),
    ("compressed_nodes", "sglang:kvevict_compressed_nodes", "Compressed nodes in the radix tree."),
]


# The host tier's (`--kv-recall-tokens`): (key of `HostPool.stats()`, metric name, help).
HOST_COUNTERS: list[tuple[str, str, str]] = [
    (
        "demoted",
        "sglang:kvevict_host_demoted_total",
        "Host columns written by compressions: evicted entries (one token's K/V in every layer and KV head) "
        "demoted to host memory instead of dropped.",
    ),
    (
        "recalled",
        "sglang:kvevict_host_recalled_total",
        "(layer, KV head) entries recall brought back from the host tier to the device.",
    ),
    (
        "bytes_moved",
        "sglang:kvevict_host_bytes_moved_total",
        "Bytes recall moved between host and device (both directions of an exchange).",
    ),
    ("recalls", "sglang:kvevict_recalls_total", "Recalls run (a turn's, or a decode step's)."),
    (
        "histories_borrowed",
        "sglang:kvevict_host_histories_borrowed_total",
        "Requests that read their stored history's host entries without a copy of their own (no room for "
        "one): their decode steps recall from an excerpt of it and what they demoted themselves.",
    ),
    (
        "histories_moved",
        "sglang:kvevict_host_histories_moved_total",
        "Requests that took their stored history's host entries from its node (a session's next turn, no "
        "room for a copy, nobody else continuing it): the node keeps none for a later sibling or retry.",
    ),
    (
        "histories_missed",
        "sglang:kvevict_host_histories_missed_total",
        "Requests whose stored history's host entries the LRU had taken back.",
    ),
    (
        "recall_failures",
        "sglang:kvevict_recall_failures_total",
        "Recalls that failed; their requests went on without recall.",
    ),
]
HOST_GAUGES: list[tuple[str, str, str]] = [
    ("host_bytes", "sglang:kvevict_host_bytes", "Bytes of K/V held on the host tier now (used columns)."),
    ("host_used", "sglang:kvevict_host_columns", "Host tier columns in use now."),
]
RECALL_SECONDS = (
    "sglang:kvevict_turn_recall_seconds",
    "Seconds one finished turn spent in recall: arming its history, its prefill's recall over both tiers "
    "and its recall after the prefill's compression.",
)
RECALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Prometheus counters/gauges of one scheduler process."""

    def __init__(self, labels: dict[str, str], host: bool = False) -> None:
        # Imported here: prometheus_client must be imported after PROMETHEUS_MULTIPROC_DIR is set.
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)
        self.labels = labels
        self.counters = {f: Counter(name=n, documentation=d, labelnames=names) for f, n, d in COUNTERS}
        self.gauges = {
            f: Gauge(name=n, documentation=d, labelnames=names, multiprocess_mode="livesum")
            for f, n, d in GAUGES
        }
        # host tier: only on a server that has one (`host`)
        self.host_counters = (
            {f: Counter(name=n, documentation=d, labelnames=names) for f, n, d in HOST_COUNTERS}
            if host
            else {}
        )
        self.host_gauges = (
            {
                f: Gauge(name=n, documentation=d, labelnames=names, multiprocess_mode="livesum")
                for f, n, d in HOST_GAUGES
            }
            if host
            else {}
        )
        self.recall_seconds = (
            Histogram(
                name=RECALL_SECONDS[0],
                documentation=RECALL_SECONDS[1],
                labelnames=names,
                buckets=RECALL_BUCKETS,
            )
            if host
            else None
        )
        self._published: dict[str, float] = {f: 0.0 for f, _, _ in (*COUNTERS, *HOST_COUNTERS)}
        every = (*self.counters.values(), *self.gauges.values(), *self.host_counters.values())
        for m in (*every, *self.host_gauges.values(), *([self.recall_seconds] if host else [])):
            m.labels(**labels)  # a labelled series exists only once touched: show zeros from the start

    def _count(self, counters: dict[str, Any], values: dict[str, float]) -> None:
        """Counters follow running totals: each publish adds what grew since the last one."""
        for f, c in counters.items():
            now = float(values.get(f, 0))
            delta = now - self._published[f]
            if delta > 0:
                c.labels(**self.labels).inc(delta)
                self._published[f] = now

    def publish(self, totals: Any, gauges: dict[str, float], host: dict[str, float] | None = None) -> None:
        """`totals`: the server's `runtime.Totals`; `gauges`: the compressed nodes' counts; `host`: the
        host pool's `stats()` with `host_bytes`, None without a host tier."""
        self._count(self.counters, {f: getattr(totals, f) for f in self.counters})
        for f, g in self.gauges.items():
            g.labels(**self.labels).set(gauges.get(f, 0))
        if host is not None:
            self._count(self.host_counters, host)
            for f, g in self.host_gauges.items():
                g.labels(**self.labels).set(host.get(f, 0))

    def observe_turn(self, report: dict[str, Any]) -> None:
        """A finished turn's report (`meta_info["kvevict"]`): its recall time, when it recalled."""
        if self.recall_seconds is not None and "recall_seconds" in report:
            self.recall_seconds.labels(**self.labels).observe(float(report["recall_seconds"]))


def labels_for(server_args: Any, tp_rank: int) -> dict[str, str]:
    """The label set SGLang's scheduler metrics carry (model, engine type, ranks)."""
    labels = {
        "model_name": str(getattr(server_args, "served_model_name", None) or server_args.model_path),
        "engine_type": "unified",
        "tp_rank": str(tp_rank),
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    try:  # the scheduler's own parallel context (dp_rank is set under --dp-size > 1)
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        labels["pp_rank"] = str(par.pp_rank)
        labels["moe_ep_rank"] = str(getattr(par, "moe_ep_rank", 0))
        if par.dp_rank is not None:
            labels["dp_rank"] = str(par.dp_rank)
    except Exception:  # not set up (e.g. a tree built outside a scheduler): keep the defaults
        pass
    extra = getattr(server_args, "extra_metric_labels", None)
    if extra:
        labels.update({str(k): str(v) for k, v in extra.items()})
    return labels
