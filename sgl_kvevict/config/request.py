"""A request's own config (`custom_params.kvevict`): merged over the server's, judged by the operator's rules.

One function for the HTTP check (a refusal is HTTP 400) and the scheduler (which falls back to the server
policy), so both judge an override the same way.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sgl_kvevict.config.base import first_error
from sgl_kvevict.config.budget import spelling
from sgl_kvevict.config.policy import KvConfig
from sgl_kvevict.config.server import ServerSettings, server_settings
from sgl_kvevict.policies import short

REQUEST_KEY = "kvevict"


def _check_operator_rules(
    raw: dict[str, Any], cfg: KvConfig, base: KvConfig, settings: ServerSettings
) -> None:
    """Raise ValueError naming the server flag that denies this override."""
    rules = settings.overrides
    if "policy" in raw and cfg.policy != base.policy and rules.policies is not None:
        if cfg.policy not in rules.policies:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.policy: {cfg.policy!r} is not allowed on this server "
                f"(--kv-overrides policies {','.join(rules.policies)}; the server's own {base.policy!r} is too)"
            )
    same_budget = (type(cfg.budget), cfg.budget) == (type(base.budget), base.budget)  # 1 token != ratio 1.0
    if "budget" in raw and not same_budget and rules.has_min_budget:
        b = cfg.budget
        if isinstance(b, int):
            floor, kind = rules.min_budget_tokens, "tokens"
        else:
            floor, kind = rules.min_budget_ratio, "a ratio"
        if floor is None:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.budget: {b} is {kind}, but this server sets a minimum only for "
                f"the other kind (--kv-overrides min_budget "
                f"{rules.min_budget_tokens if rules.min_budget_tokens is not None else rules.min_budget_ratio})"
            )
        if b < floor:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.budget: {b} is below this server's minimum {floor} "
                f"(--kv-overrides min_budget)"
            )
    if cfg.active and settings.capture_window is not None:
        pol = cfg.build()
        if "attn" in pol.needs and pol.config.window > settings.capture_window:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.config.window: {pol.config.window} is above this server's "
                f"window-query buffer ({settings.capture_window}; --kv-overrides max_window)"
            )
    if cfg.recall_tokens and cfg.recall_tokens > settings.recall_tokens:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}.recall_tokens: {cfg.recall_tokens} is above this server's "
            f"{settings.recall_tokens} (--kv-recall-tokens)"
        )
    if settings.quantized_o_proj(cfg):
        raise ValueError(
            f"custom_params.{REQUEST_KEY}.policy: {cfg.policy!r} reads o_proj's weights, which are "
            f"quantized on this server ({settings.quantization})"
        )


def request_override(
    custom_params: dict[str, Any] | None, base: KvConfig, settings: ServerSettings | None = None
) -> KvConfig | None:
    """The request's own config, or None when it gives none. Raises ValueError with a readable message.

    The operator's rules (`settings`, by default this server's) apply here, so the HTTP check (400) and
    the scheduler (which falls back to the server policy) judge an override the same way.
    """
    if not custom_params:
        return None
    if not isinstance(custom_params, dict):
        raise ValueError(f"custom_params must be an object, got {type(custom_params).__name__}")
    if REQUEST_KEY not in custom_params:
        return None
    settings = settings if settings is not None else server_settings()
    if not settings.overrides.enabled:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}: per-request overrides are disabled on this server "
            "(--kv-overrides off)"
        )
    raw = custom_params[REQUEST_KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"custom_params.{REQUEST_KEY} must be an object with policy/budget/config")
    unknown = set(raw) - {"policy", "budget", "config", "recall_tokens"}
    if unknown:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}: unknown field(s) {sorted(short(k, 30) for k in unknown)}; "
            "valid: policy, budget, config, recall_tokens"
        )
    merged = {
        "policy": base.policy,
        "budget": spelling(base.budget),
        "config": base.config if "policy" not in raw else {},
    }
    merged.update(raw)
    try:
        cfg = KvConfig.model_validate(merged)
        cfg.build()
    except ValidationError as e:
        raise ValueError(first_error(e, f"custom_params.{REQUEST_KEY}")) from None
    except Exception as e:  # PolicyConfigError, or whatever a policy's build raises: HTTP 400, never 500
        raise ValueError(f"custom_params.{REQUEST_KEY}: {e}") from None
    _check_operator_rules(raw, cfg, base, settings)
    return cfg
