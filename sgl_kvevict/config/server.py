"""Server-wide settings every process knows (`ServerSettings`, carried in `KVEVICT_SERVER_SETTINGS`).

A separate model from `KvConfig` because `KvConfig` is also what a request sends: what a request may
override (`--kv-overrides`), the host tier (`--kv-recall-tokens` and its sizes), the compression step cap,
and what the launcher derives at start (the weights' quantization, the window-query buffer's size).
"""

from __future__ import annotations

import functools
import os
from typing import ClassVar

from pydantic import Field

from sgl_kvevict.config.base import Published
from sgl_kvevict.config.policy import MAX_CAPTURE, OverridePolicy
from sgl_kvevict.config.recall import (
    DEFAULT_HOST_TOKENS,
    MAX_HOST_GIB,
    MAX_HOST_TOKENS,
    MAX_RECALL_TOKENS,
    MIN_HOST_GIB,
    RecallTuning,
)

SETTINGS_ENV_VAR = "KVEVICT_SERVER_SETTINGS"
MAX_STEP_TOKENS = 1 << 24
DEFAULT_CAPTURE_SLOTS = 128  # capture slots when --max-running-requests is not given


class ServerSettings(Published):
    """Server-wide settings known to every process (HTTP and scheduler); the fields with a `flag` are the
    launcher's flags (see `FLAGS`), the others are derived at start."""

    ENV: ClassVar[str] = SETTINGS_ENV_VAR

    overrides: OverridePolicy = Field(
        default_factory=OverridePolicy,
        description="what a request may override: off, or a JSON object with the keys below",
        json_schema_extra={"flag": "--kv-overrides"},
    )
    quantization: str | None = Field(
        None, description="how the weights are quantized (which flag), if at all; derived"
    )
    step_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_STEP_TOKENS,
        description="cap on the region tokens compressed in one scheduler step (e.g. 4096): once a step has "
        "compressed that many, other requests' compressions wait for the next steps, so several large "
        "compressions do not stall the batch in the same step (one always runs; default: no cap)",
        json_schema_extra={"flag": "--kv-compress-step-tokens"},
    )

    capture_window: int | None = Field(
        None,
        ge=1,
        le=MAX_CAPTURE,
        description="the most window queries a request may score with (the server policy's window, at least "
        "32, or the operator's overrides max_window); None: no request of this server captures queries",
    )
    capture_slots: int = Field(
        DEFAULT_CAPTURE_SLOTS,
        ge=1,
        le=MAX_CAPTURE,
        description="requests that can capture window queries at once (--max-running-requests, else 128)",
    )

    recall_tokens: int = Field(
        0,
        ge=0,
        le=MAX_RECALL_TOKENS,
        description="host tier: evicted entries go to host memory, and each turn recalls up to this many per "
        "layer and KV head into its kept history (0: off)",
        json_schema_extra={"flag": "--kv-recall-tokens"},
    )
    host_tokens: int = Field(
        DEFAULT_HOST_TOKENS,
        ge=1,
        le=MAX_HOST_TOKENS,
        description="host tier capacity in columns (one evicted entry per layer and KV head each; needs "
        "--kv-recall-tokens); branches are dropped least-recently-used beyond it",
        json_schema_extra={"flag": "--kv-host-tokens"},
    )
    host_gib: float | None = Field(
        None,
        ge=MIN_HOST_GIB,
        le=MAX_HOST_GIB,
        description="host tier capacity in GiB per rank instead of --kv-host-tokens (not with it): "
        "turned into columns at start from the model's layers x KV heads x head dim x dtype bytes x 2 (K and "
        "V), which must come to [1, 2097152] columns (needs --kv-recall-tokens; default: none, "
        "--kv-host-tokens sizes the tier)",
        json_schema_extra={"flag": "--kv-host-gib"},
    )
    recall: RecallTuning = Field(
        default_factory=RecallTuning,
        description="recall's tuning knobs as a JSON object with the keys below (needs --kv-recall-tokens)",
        json_schema_extra={"flag": "--kv-recall-config"},
    )


def server_settings() -> ServerSettings:
    """The operator's override rules in this process (from the launcher's environment; parsed once per
    value). A server's cache keeps the ones it started with (`cache.context.KvEvictContext.settings`)."""
    return _settings_from(os.environ.get(SETTINGS_ENV_VAR))


@functools.lru_cache(maxsize=8)
def _settings_from(raw: str | None) -> ServerSettings:
    return ServerSettings.from_env(raw)
