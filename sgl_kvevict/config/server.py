"""Server-wide settings every process knows (`ServerSettings`, carried in `KVEVICT_SERVER_SETTINGS`).

A separate model from `KvConfig` because `KvConfig` is also what a request sends: what a request may
override (`--kv-overrides`), the host tier (`--kv-recall-tokens` and its sizes), the compression step cap,
and what the launcher derives at start (the weights' quantization, the window-query buffer's size).

`Launch` is the server as the launcher starts it, the policy and the settings together: its validators
are the rules that relate two settings (the scope's default, what needs `--kv-recall-tokens`, the
window-query buffer's size, ...), each with its error, so the plugin only builds it and reports a refusal.
"""

from __future__ import annotations

import functools
import os
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sgl_kvevict import policies
from sgl_kvevict.config.base import Published
from sgl_kvevict.config.policy import MAX_CAPTURE, KvConfig, OverridePolicy
from sgl_kvevict.config.recall import (
    MAX_HOST_GIB,
    MAX_HOST_TOKENS,
    MAX_RECALL_TOKENS,
    MIN_HOST_GIB,
    RecallTuning,
)
from sgl_kvevict.policies.base import PolicyConfig

SETTINGS_ENV_VAR = "KVEVICT_SERVER_SETTINGS"
MAX_STEP_TOKENS = 1 << 24
DEFAULT_CAPTURE_SLOTS = 128  # capture slots when --max-running-requests is not given
SCOPE = PolicyConfig.model_fields["scope"].annotation  # the policy config's scopes: what --kv-scope takes


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
    host_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_HOST_TOKENS,
        description="host tier capacity in columns (one evicted entry per layer and KV head each; needs "
        "--kv-recall-tokens); branches are dropped least-recently-used beyond it (default: none, twice the "
        "device KV pool's tokens as SGLang's HiCache sizes its host pool, at most a quarter of the RAM)",
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

    def quantized_o_proj(self, cfg: KvConfig) -> bool:
        """Whether `cfg`'s policy reads o_proj's weights (CriticalKV), which are quantized on this server."""
        return bool(self.quantization) and cfg.active and "o_proj" in cfg.build().needs


def server_settings() -> ServerSettings:
    """The operator's override rules in this process (from the launcher's environment; parsed once per
    value). A server's cache keeps the ones it started with (`cache.context.KvEvictContext.settings`)."""
    return _settings_from(os.environ.get(SETTINGS_ENV_VAR))


@functools.lru_cache(maxsize=8)
def _settings_from(raw: str | None) -> ServerSettings:
    return ServerSettings.from_env(raw)


def capture_needed(cfg: KvConfig, settings: ServerSettings) -> bool:
    """Whether some request of this server may capture window queries (so it allocates the buffer).

    Attention-free policies (streaming, knorm, lagkv, a refiner over lagkv) never capture. A request
    override could ask for an attention-based policy, so overrides count too: the buffer is left out
    only when none can ask for one (any may, when `--kv-overrides` names no `policies`; a refiner's
    base may be attention-based). CUDA graphs stay on either way (the capture is graph-safe)."""
    if "attn" in cfg.build().needs or settings.recall_tokens > 0:  # recall scores with the window too
        return True
    if not settings.overrides.enabled:
        return False
    names = settings.overrides.policies
    if names is None:
        return True
    return any(
        "attn" in policies.REGISTRY[n].needs or issubclass(policies.REGISTRY[n], policies.Refiner)
        for n in names
    )


def _flag(field: str) -> str:
    """The launcher flag of a `ServerSettings` field, as its refusals name it."""
    return ServerSettings.model_fields[field].json_schema_extra["flag"]  # type: ignore[index]


class Launch(BaseModel):
    """The server as its launcher starts it: the policy every request inherits (`kv`), the settings every
    process shares (`settings`), and the flags that only shape them (`scope`, SGLang's
    `max_running_requests`). Each rule that relates two settings is one validator here, with its error;
    the plugin builds this model from the flags given and reports the first error (exit 2).

    The rules live here, not on `ServerSettings`, for two reasons: some relate the policy to the settings,
    and some are about which flags were given (`settings.model_fields_set`), which only the launcher
    knows (the published settings carry every field). After validation `kv` and `settings` are what the
    launcher publishes: the scope written into the policy config, the window-query buffer sized.
    """

    model_config = ConfigDict(extra="forbid")

    kv: KvConfig
    settings: ServerSettings  # given as the dict of the flags given: its fields set are what was given
    scope: SCOPE | None = Field(None, description="--kv-scope: another spelling of the policy config's scope")
    max_running_requests: int | None = Field(
        None, description="SGLang's --max-running-requests: every running request may capture"
    )

    @model_validator(mode="after")
    def _host_tier_needs_recall(self) -> Launch:
        """The host tier's size and tuning do nothing without the tier: refused, not ignored."""
        if not self.settings.recall_tokens:
            for field in ("host_tokens", "host_gib", "recall"):
                if field in self.settings.model_fields_set:
                    raise ValueError(
                        f"{_flag(field)} shapes the host tier, which is on only with --kv-recall-tokens N (N >= 1)"
                    )
        return self

    @model_validator(mode="after")
    def _one_host_size(self) -> Launch:
        if {"host_gib", "host_tokens"} <= self.settings.model_fields_set:
            raise ValueError("--kv-host-gib and --kv-host-tokens both size the host tier: give one")
        return self

    @model_validator(mode="after")
    def _scope(self) -> Launch:
        """`--kv-scope` and `--kv-policy-config '{"scope": ...}'` (the spelling a request uses) are one
        field: given both ways, they must agree. Given neither way, it is `branch` on a server that recalls:
        one budget caps a conversation's whole history, and what an earlier turn lost comes back from the
        host when a later turn asks for it. The policy's default scope is written as no scope."""
        conf = dict(self.kv.config)
        if self.scope is None and "scope" not in conf and self.settings.recall_tokens and self.kv.active:
            conf["scope"] = "branch"
        if self.scope is not None:
            if conf.get("scope", self.scope) != self.scope:
                raise ValueError(
                    f"argument --kv-scope: {self.scope!r} contradicts --kv-policy-config's scope "
                    f"{conf['scope']!r}: give the scope once"
                )
            if self.scope != PolicyConfig.model_fields["scope"].default:
                conf["scope"] = self.scope
        self.kv = self.kv.model_copy(update={"config": conf})
        return self

    @model_validator(mode="after")
    def _policy_config(self) -> Launch:
        """The policy config, scope included, is checked against the policy's own model."""
        try:
            self.kv.build()
        except policies.PolicyConfigError as e:
            raise ValueError(f"argument --kv-policy-config: {e}") from None
        return self

    @model_validator(mode="after")
    def _recall_needs_policy(self) -> Launch:
        if self.settings.recall_tokens and not self.kv.active:
            raise ValueError(
                "--kv-recall-tokens recalls what a compressing policy evicted: give --kv-policy too"
            )
        return self

    @model_validator(mode="after")
    def _o_proj_unquantized(self) -> Launch:
        if self.settings.quantized_o_proj(self.kv):
            raise ValueError(
                f"--kv-policy {self.kv.policy} reads o_proj's weights, which are quantized "
                f"({self.settings.quantization}); use another policy or an unquantized model"
            )
        return self

    @model_validator(mode="after")
    def _capture(self) -> Launch:
        """The window-query buffer's size when some request may capture (`capture_needed`), else none.

        Its window is the server policy's (at least the default 32), or the operator's `--kv-overrides`
        `max_window`; its slots are `--max-running-requests` (every running request can capture), else 128."""
        if not self.kv.active or not capture_needed(self.kv, self.settings):
            return self
        pol = self.kv.build()
        own = pol.config.window if "attn" in pol.needs or self.settings.recall_tokens else 0
        window = self.settings.overrides.max_window
        if window is None:
            window = max(own, PolicyConfig.model_fields["window"].default)
        elif own > window:
            raise ValueError(f"--kv-overrides max_window {window} is below the server policy's window {own}")
        if window > MAX_CAPTURE:
            raise ValueError(
                f"--kv-policy-config window {own} is above {MAX_CAPTURE}, the most window queries a server "
                "captures per request"
            )
        running = self.max_running_requests
        slots = min(running, MAX_CAPTURE) if running else DEFAULT_CAPTURE_SLOTS
        self.settings = self.settings.model_copy(update={"capture_window": window, "capture_slots": slots})
        return self
