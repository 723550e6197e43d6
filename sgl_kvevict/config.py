"""User-facing configuration: the server-wide KV policy and the per-request override, both validated.

Server-wide settings come from `--kv-policy`, `--kv-budget`, `--kv-policy-config`. They travel from the
launcher to the scheduler process in the environment variable `KVEVICT_SERVER_CONFIG` (SGLang drops unknown
CLI fields and its `ServerArgs` is a frozen-schema msgspec struct).
A request may override them with `custom_params={"kvevict": {"policy": ..., "budget": ..., "config": {...}}}`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sgl_kvevict import policies

ENV_VAR = "KVEVICT_SERVER_CONFIG"
REQUEST_KEY = "kvevict"
DEFAULT_BUDGET = 0.5


def parse_budget(text: str | int | float) -> int | float:
    """`256` -> 256 tokens; `0.5` -> half of the request's own suffix. Raises ValueError when out of range."""
    if isinstance(text, bool):
        raise ValueError("budget must be a number")
    if isinstance(text, str):
        s = text.strip()
        try:
            val: int | float = int(s)
        except ValueError:
            try:
                val = float(s)
            except ValueError:
                raise ValueError(
                    f"budget {text!r} is not a number: give tokens (e.g. 256) or a ratio in (0, 1] (e.g. 0.5)"
                ) from None
    else:
        val = text
    if isinstance(val, float) and val.is_integer() and val > 1:
        val = int(val)
    if isinstance(val, int):
        if val < 1:
            raise ValueError(f"budget {val} out of range: tokens must be >= 1, or a ratio in (0, 1]")
        return val
    if not (0.0 < val <= 1.0):
        raise ValueError(f"budget {val} out of range: a ratio must be in (0, 1], or give tokens >= 1")
    return float(val)


class KvConfig(BaseModel):
    """Which policy compresses a request, with what budget and policy config."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "none"
    budget: int | float = Field(
        DEFAULT_BUDGET, description="tokens kept per head beyond sinks+recent, or a ratio of the suffix"
    )
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> int | float:
        return parse_budget(v)

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in policies.REGISTRY:
            raise ValueError(f"unknown KV policy {v!r}; valid choices: {', '.join(policies.available())}")
        return v

    def build(self) -> policies.Policy:
        """Validate the policy config too (raises PolicyConfigError naming the field)."""
        return policies.build(self.policy, self.config)

    def resolve_budget(self, suffix_tokens: int, always_kept: int = 0) -> int:
        """Candidate tokens to keep per head, beyond the `always_kept` sinks and recent window.

        Tokens: exactly that many beyond the windows. A ratio: of the request's own (unshared) tokens,
        windows included, so that a request holds about `ratio` of its suffix once it is long enough.
        """
        if isinstance(self.budget, int):
            return self.budget
        return max(0, int(round(self.budget * suffix_tokens)) - always_kept)

    def to_env(self) -> str:
        return self.model_dump_json()

    @property
    def active(self) -> bool:
        return self.policy != "none"


def server_config() -> KvConfig:
    """The server-wide config in this process (from the launcher's environment)."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return KvConfig()
    return KvConfig.model_validate(json.loads(raw))


def request_override(custom_params: dict[str, Any] | None, base: KvConfig) -> KvConfig | None:
    """The request's own config, or None when it gives none. Raises ValueError with a readable message."""
    if not custom_params or REQUEST_KEY not in custom_params:
        return None
    raw = custom_params[REQUEST_KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"custom_params.{REQUEST_KEY} must be an object with policy/budget/config")
    unknown = set(raw) - {"policy", "budget", "config"}
    if unknown:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}: unknown field(s) {sorted(unknown)}; valid: policy, budget, config"
        )
    merged = {
        "policy": base.policy,
        "budget": base.budget,
        "config": base.config if "policy" not in raw else {},
    }
    merged.update(raw)
    try:
        cfg = KvConfig.model_validate(merged)
        cfg.build()
    except policies.PolicyConfigError as e:
        raise ValueError(f"custom_params.{REQUEST_KEY}: {e}") from None
    except Exception as e:  # pydantic ValidationError
        errs = getattr(e, "errors", None)
        if errs:
            err = errs()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"custom_params.{REQUEST_KEY}.{loc}: {err['msg']}") from None
        raise ValueError(f"custom_params.{REQUEST_KEY}: {e}") from None
    return cfg
