"""The plugin's counters on SGLang's Prometheus `/metrics` endpoint (`--enable-metrics`).

SGLang runs prometheus_client in multiprocess mode: the launcher sets `PROMETHEUS_MULTIPROC_DIR`
before any process starts, each scheduler writes its metric files there, and the HTTP server's
`/metrics` collects them all. The scheduler process that owns the compressing tree creates these
metrics the same way SGLang's own scheduler collector does, with the same `sglang:` prefix and the
model/rank labels, so they appear beside SGLang's and sum across data-parallel schedulers.

Counters follow `runtime.Totals` (published as increments since the last publish); the gauge is the KV
the tree's compressed nodes hold right now.
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


class Metrics:
    """Prometheus counters/gauges of one scheduler process."""

    def __init__(self, labels: dict[str, str]) -> None:
        # Imported here: prometheus_client must be imported after PROMETHEUS_MULTIPROC_DIR is set.
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self.labels = labels
        self.counters = {f: Counter(name=n, documentation=d, labelnames=names) for f, n, d in COUNTERS}
        self.gauges = {
            f: Gauge(name=n, documentation=d, labelnames=names, multiprocess_mode="livesum")
            for f, n, d in GAUGES
        }
        self._published: dict[str, float] = {f: 0.0 for f, _, _ in COUNTERS}
        for m in (*self.counters.values(), *self.gauges.values()):
            m.labels(**labels)  # a labelled series exists only once touched: show zeros from the start

    def publish(self, totals: Any, gauges: dict[str, float]) -> None:
        for f, c in self.counters.items():
            now = float(getattr(totals, f))
            delta = now - self._published[f]
            if delta > 0:
                c.labels(**self.labels).inc(delta)
                self._published[f] = now
        for f, g in self.gauges.items():
            g.labels(**self.labels).set(gauges.get(f, 0))


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
