"""Policy registry: names (for `--kv-policy`) to classes. One policy per module.

A new policy is one module: its class with `@register` (from `.registry`), and one import line below;
the CLI's choices come from the registry.
"""

from __future__ import annotations

# Importing the modules registers the policies.
from . import criticalkv as _criticalkv  # noqa: E402,F401
from . import d2o as _d2o  # noqa: E402,F401
from . import graphkv as _graphkv  # noqa: E402,F401
from . import h2o as _h2o  # noqa: E402,F401
from . import knorm as _knorm  # noqa: E402,F401
from . import lagkv as _lagkv  # noqa: E402,F401
from . import none as _none  # noqa: E402,F401
from . import snapkv as _snapkv  # noqa: E402,F401
from . import streaming as _streaming  # noqa: E402,F401
from .base import BatchView, Kept, LayerView, Policy, PolicyConfig, Refiner, compacted_len, short, topk_keep
from .registry import REGISTRY, PolicyConfigError, available, build, build_base, register

__all__ = [
    "REGISTRY",
    "BatchView",
    "Kept",
    "LayerView",
    "Policy",
    "PolicyConfig",
    "PolicyConfigError",
    "Refiner",
    "available",
    "build",
    "build_base",
    "compacted_len",
    "register",
    "short",
    "topk_keep",
]
