"""The policy registry: names (for `--kv-policy`) to classes, and building a policy from its config.

A leaf below every policy module: a policy registers itself with `@register` from here, and the package
`__init__` imports each policy module (which runs the registration), so nothing imports in a circle.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .base import Policy, PolicyConfig, short

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
        raise PolicyConfigError(f"unknown KV policy {short(name)}; valid choices: {', '.join(available())}")
    cls = REGISTRY[name]
    try:
        cfg = cls.Config.model_validate(config or {})
    except ValidationError as e:
        err = e.errors()[0]
        loc = short(".".join(str(x) for x in err["loc"]), 60)
        if not loc:  # a whole-model check (e.g. a refiner's base): its message names what is wrong
            cause = err.get("ctx", {}).get("error")
            raise PolicyConfigError(f"invalid config for KV policy {name!r}: {cause or err['msg']}") from None
        raise PolicyConfigError(f"invalid config for KV policy {name!r}: field {loc}: {err['msg']}") from None
    return cls(cfg)


SHARED_FIELDS = tuple(PolicyConfig.model_fields)


def build_base(wrapper: str, cfg: PolicyConfig, base: str, base_config: dict[str, Any]) -> Policy:
    """Build the policy a refiner (graphkv, criticalkv) wraps.

    The runner reads the shared fields (sinks, recent, interval, window) from the wrapper, so they are
    passed down from it; setting one in `base_config` is an error rather than a silent mismatch.
    """
    shared = sorted(set(base_config) & set(SHARED_FIELDS))
    if shared:
        raise PolicyConfigError(f"{wrapper}: set {', '.join(shared)} on {wrapper} itself, not in base_config")
    return build(base, {**base_config, **{f: getattr(cfg, f) for f in SHARED_FIELDS}})
