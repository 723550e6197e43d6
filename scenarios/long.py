"""Long agent sessions: many short turns, so the memory a session holds is its *history*, not one turn.

Turn 1 plants a fact ("Remember this: the vault code is 4817."); then `turns - 2` turns that are either a
short user message (a follow-up question, a few words) or a short task with a scripted tool call and a
tool output of mixed length (`tool_tokens_min`..`tool_tokens_max`, e.g. 50-600: logs, JSON, file
listings, search results); the last turn asks for the fact (checked with `recall.correct`).

Why: with short turns each request compresses little on its own (sinks and the recent window are most
of a 150-token turn), so per-request budgets let the session grow linearly with the number of turns;
only a budget over the branch's whole history bounds it. The early fact measures what re-compressing old
turns with the newest turn's queries costs.

The system prompt is the agent scenario's (same seed: a prefix shared by every session). With a full
cache SmolLM2-135M usually loses a fact planted 30 turns earlier (see `recall.py`); recall here is
relative: compare each run with `none` from the same replay.
"""

from __future__ import annotations

import random

from . import agent, recall
from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for

FOLLOW_UPS = [
    "Is {svc} healthy now? Answer yes or no.",
    "Thanks. Anything else to watch on {svc}?",
    "Which team owns {svc}? Guess in a few words.",
    "Should we page someone about {svc}? One word.",
    "Summarise the {svc} findings in one sentence.",
    "Ok. What should I check next on {svc}?",
]
TOOL_TURN_SHARE = 0.6  # the rest are short follow-ups without a tool call


def _middle_turn(r: random.Random, cfg: ScenarioConfig) -> Turn:
    svc = r.choice(agent.SERVICES)
    if r.random() >= TOOL_TURN_SHARE:
        return Turn(inputs=[Message(role="user", content=r.choice(FOLLOW_UPS).format(svc=svc))])
    tool, task, unit = r.choice(agent.KINDS)
    size = r.randint(cfg.tool_tokens_min, max(cfg.tool_tokens_min, cfg.tool_tokens_max))
    output = fill(r, size, lambda r, u=unit, s=svc: u(r, s), chars_per_token=2.0)
    return Turn(
        inputs=[
            Message(role="user", content=task.format(svc=svc)),
            Message(role="assistant", content=f"TOOL({tool}, service={svc})"),
            Message(role="tool", content=output),
        ]
    )


def build(cfg: ScenarioConfig) -> Scenario:
    if cfg.turns < 2:
        raise ValueError(f"the long scenario needs turns >= 2 (plant + question), got {cfg.turns}")
    system = agent.system_prompt(cfg)
    sessions = []
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "long", i)
        statement, question, value = recall.fact(r)
        turns = [recall.plant(statement, cfg)]
        turns += [_middle_turn(r, cfg) for _ in range(cfg.turns - 2)]
        turns.append(Turn(inputs=[Message(role="user", content=question)], expect=value, max_new_tokens=16))
        sessions.append(Session(id=f"long-{i}", kind="long", system=system, turns=turns))
    return Scenario(name="long", seed=cfg.seed, sessions=sessions)
