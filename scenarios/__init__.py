"""Multi-turn scenarios for the replay benchmark, deterministic from a seed (see `base.py`)."""

from __future__ import annotations

from collections.abc import Callable

from . import agent, chatloop, composed, forks, locomo, long, multikey, recall, sharegpt
from .base import Scenario, ScenarioConfig

BUILDERS: dict[str, Callable[[ScenarioConfig], Scenario]] = {
    "agent": agent.build,
    "recall": recall.build,
    "recall-code": recall.build_code,
    "forks": forks.build,
    "long": long.build,
    "sharegpt": sharegpt.build,
    "composed": composed.build,
    "composed-chat": composed.build_chat,
    "chatloop": chatloop.build,
    "multikey": multikey.build,
    "locomo": locomo.build,
}


def build(name: str, cfg: ScenarioConfig) -> Scenario:
    if name not in BUILDERS:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(BUILDERS)}")
    return BUILDERS[name](cfg)
