"""Policy registry: names (for `--kv-policy`) to classes. One policy per module.

A new policy needs only `@register` on its class and an import below; the CLI's choices come from here.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .base import LayerView, Policy, PolicyConfig, topk_keep

REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(REGISTRY)


class PolicyConfigError(ValueError):
    """A bad policy name or config; the message names the valid choices or the field at fault."""


def build(name: str, config: dict[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy from a JSON-like config, validating it."""
    if name not in REGISTRY:
        raise PolicyConfigError(f"unknown KV policy {name!r}; valid choices: {', '.join(available())}")
    cls = REGISTRY[name]
    try:
        cfg = cls.Config.model_validate(config or {})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        raise PolicyConfigError(f"invalid config for KV policy {name!r}: field {loc!r}: {err['msg']}") from None
    return cls(cfg)


# Importing the modules registers the policies.
from . import none as _none  # noqa: E402,F401

__all__ = ["REGISTRY", "LayerView", "Policy", "PolicyConfig", "PolicyConfigError", "available", "build", "register", "topk_keep"]
