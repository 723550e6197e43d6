"""The policy a request runs (`KvConfig`: the server-wide one, or a request's own) and what the operator
lets a request change (`OverridePolicy`, the `--kv-overrides` setting).

The server-wide `KvConfig` comes from `--kv-policy`, `--kv-budget`, `--kv-scope`, `--kv-policy-config` and
travels from the launcher to the scheduler process in `KVEVICT_SERVER_CONFIG` (SGLang drops unknown CLI
fields and its `ServerArgs` is a frozen-schema msgspec struct).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from sgl_kvevict import policies
from sgl_kvevict.config.base import Published
from sgl_kvevict.config.budget import (
    DEFAULT_BUDGET,
    MAX_BUDGET_TOKENS,
    parse_budget,
    parse_min_budget,
    spelling,
)
from sgl_kvevict.config.recall import MAX_RECALL_TOKENS
from sgl_kvevict.policies import short

ENV_VAR = "KVEVICT_SERVER_CONFIG"
MAX_CAPTURE = 4096  # bound on the capture buffer's window and slots (the buffer is their product)


class KvConfig(Published):
    """Which policy compresses a request, with what budget and policy config."""

    ENV: ClassVar[str] = ENV_VAR

    policy: str = Field(
        "none",
        description="KV compression policy for each request's own suffix",
        json_schema_extra={"flag": "--kv-policy", "choices": "policies"},
    )
    budget: int | float = Field(
        DEFAULT_BUDGET,
        description="tokens kept per KV head beyond sinks+recent window (e.g. 256), or a percent of the "
        'suffix (e.g. 50%; 0.5 works too); the bare 1 is refused as ambiguous: write 100% or {"tokens": 1}',
        json_schema_extra={"flag": "--kv-budget", "parse": "budget"},
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="policy config as JSON, e.g. '{\"lag\": 64}'",
        json_schema_extra={"flag": "--kv-policy-config"},
    )
    recall_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_RECALL_TOKENS,
        description="host entries per layer and KV head a turn may bring back (None: the server's "
        "--kv-recall-tokens; 0: no recall); at most the server's",
    )

    @field_validator("recall_tokens", mode="before")
    @classmethod
    def _recall(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"must be an integer in [0, {MAX_RECALL_TOKENS}], got {short(v)}")
        return v

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> int | float:
        return parse_budget(v)

    @field_serializer("budget")
    def _dump_budget(self, v: int | float) -> int | float | dict[str, int]:
        return spelling(v)

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in policies.REGISTRY:
            raise ValueError(
                f"unknown KV policy {short(v)}; valid choices: {', '.join(policies.available())}"
            )
        return v

    def build(self) -> policies.Policy:
        """Validate the policy config too (raises PolicyConfigError naming the field).

        A ratio budget also sets LagKV's per-partition retention when its config asks (`ratio_from_budget`).

        Attention-based policies score with the last `window` queries against the request's keys under a
        causal mask that puts those queries on the last `window` slots of the row. That holds only while
        the recent window, never evicted, covers them: `window <= recent`.
        """
        pol = policies.build(self.policy, self.config)
        if isinstance(self.budget, float) and self.budget < 1.0:
            pol = pol.for_budget_ratio(self.budget)  # LagKV: a ratio budget may be its per-partition ratio
        c = pol.config
        if "attn" in pol.needs and c.window > c.recent:
            raise policies.PolicyConfigError(
                f"invalid config for KV policy {self.policy!r}: field 'window' ({c.window}) must be <= "
                f"'recent' ({c.recent}): the scored queries must be among the never-evicted recent tokens"
            )
        return pol

    def resolve_budget(self, suffix_tokens: int, always_kept: int = 0) -> int:
        """Candidate tokens to keep per head, beyond the `always_kept` sinks and recent window.

        Tokens: exactly that many beyond the windows. A ratio: of the request's own (unshared) tokens,
        windows included, so that a request holds about `ratio` of its suffix once it is long enough.
        """
        if isinstance(self.budget, int):
            return self.budget
        return max(0, int(round(self.budget * suffix_tokens)) - always_kept)

    @property
    def active(self) -> bool:
        return self.policy != "none"


class OverridePolicy(BaseModel):
    """What the operator lets a request override (`custom_params.kvevict`): the `--kv-overrides` setting.

    The server's own policy and budget are always allowed. A budget is judged only against a minimum of
    the same kind: tokens against `min_budget_tokens`, a ratio against `min_budget_ratio`. A request
    budget of a kind the operator gave no minimum for is denied when the operator gave a minimum of the
    other kind (a ratio cannot be compared with a token count before the request's length is known).
    `min_budget` writes both at once: `"256"`, `"25%"` or `"256,25%"` (see `parse_min_budget`).
    """

    model_config = ConfigDict(extra="forbid")
    # keys `_spellings` turns into fields (`--help` lists them beside the fields)
    SPELLINGS: ClassVar[dict[str, str]] = {
        "min_budget": "both minimums in one budget spelling: 256, 25% or 256,25% (sets min_budget_tokens "
        "and min_budget_ratio)"
    }

    enabled: bool = Field(True, description="false: deny every custom_params.kvevict (HTTP 400)")
    policies: list[str] | None = Field(
        None, description="policies an override may name, a list or comma-separated; null: all"
    )
    min_budget_tokens: int | None = Field(
        None, ge=1, le=MAX_BUDGET_TOKENS, description="smallest token budget an override may ask for"
    )
    min_budget_ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="smallest ratio budget an override may ask for"
    )
    max_window: int | None = Field(
        None,
        ge=1,
        le=MAX_CAPTURE,
        description="the most window queries a request may score with (default: the server policy's "
        "window, at least 32); a larger per-request window is HTTP 400",
    )

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: Any) -> Any:
        """`"off"` is `{"enabled": false}`; `min_budget` is the two minimums in one budget spelling."""
        if isinstance(data, str) and data.strip() == "off":
            return {"enabled": False}
        if isinstance(data, dict) and "min_budget" in data:
            data = dict(data)
            text = data.pop("min_budget")
            if "min_budget_tokens" in data or "min_budget_ratio" in data:
                raise ValueError("give min_budget, or min_budget_tokens / min_budget_ratio, not both")
            if isinstance(text, bool) or not isinstance(text, (str, int, float)):
                raise ValueError(
                    f"min_budget: give tokens (256), a ratio (25%) or both (256,25%), not {short(text)}"
                )
            try:
                data["min_budget_tokens"], data["min_budget_ratio"] = parse_min_budget(str(text))
            except ValueError as e:
                raise ValueError(f"min_budget: {e}") from None
        return data

    @field_validator("policies", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("policies")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one policy name")
        bad = [p for p in v if p not in policies.REGISTRY]
        if bad:
            raise ValueError(
                f"unknown KV policy {short(bad[0])}; valid choices: {', '.join(policies.available())}"
            )
        return sorted(set(v))

    @model_validator(mode="after")
    def _useful(self) -> OverridePolicy:
        if not self.enabled:
            given = [
                k
                for k in ("policies", "min_budget_tokens", "min_budget_ratio", "max_window")
                if getattr(self, k) is not None
            ]
            if given:
                raise ValueError(
                    f"{given[0]} has no effect when overrides are off (enabled: false): drop one"
                )
        return self

    @property
    def has_min_budget(self) -> bool:
        return self.min_budget_tokens is not None or self.min_budget_ratio is not None


def server_config() -> KvConfig:
    """The server-wide config in this process (from the launcher's environment)."""
    return KvConfig.from_env(os.environ.get(ENV_VAR))
