"""Forks: each turn adds a shared document to the context, then forks several branches (different
questions) from it, as a frontend program does with `s.fork(n)`; branch 0 continues the session.

`frontend_program` is the same workload written in SGLang's frontend language, for users who want to
drive a server-wide policy from `sgl.function` code.
"""

from __future__ import annotations

from typing import Any

from .agent import WORDS
from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for

QUESTIONS = [
    "List the three most important points.",
    "What is the main risk mentioned?",
    "Write a title for this text.",
    "Which numbers appear most often?",
    "Summarize it for a manager.",
    "What should be done next?",
]


def _doc(r, tokens: int) -> str:
    return fill(
        r,
        tokens,
        lambda r: (
            f"Item {r.randint(1, 500)}: the {r.choice(WORDS)} {r.choice(WORDS)} changed by {r.randint(1, 99)} percent."
        ),
        chars_per_token=2.6,
    )


def build(cfg: ScenarioConfig) -> Scenario:
    sessions = []
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "forks", i)
        turns = []
        for _ in range(cfg.turns):
            doc = _doc(r, r.randint(cfg.tool_tokens_min, max(cfg.tool_tokens_min, cfg.tool_tokens_max)))
            qs = r.sample(QUESTIONS, k=min(cfg.branches, len(QUESTIONS)))
            turns.append(
                Turn(
                    inputs=[Message(role="user", content=f"Read this report:\n{doc}")],
                    branches=[[Message(role="user", content=q)] for q in qs],
                )
            )
        sessions.append(Session(id=f"forks-{i}", kind="forks", turns=turns))
    return Scenario(name="forks", seed=cfg.seed, sessions=sessions)


def frontend_program(url: str, session: Session, max_new_tokens: int = 32) -> list[list[str]]:
    """Run one forks session with SGLang's frontend language; returns each turn's branch answers.

    Reads `s.text()` before `fork` so that SGLang 0.5.23 commits the shared context and every branch
    hits the prefix cache (without it, `fork` can send the branches before the prefix is committed).
    """
    import sglang as sgl

    @sgl.function
    def program(s: Any, turns: list[Turn]) -> None:
        for t, turn in enumerate(turns):
            s += sgl.user("\n".join(m.content for m in turn.inputs))
            s += sgl.assistant("Read.")
            s.text()
            forks = s.fork(len(turn.branches))
            for f, branch in zip(forks, turn.branches, strict=True):
                f += sgl.user(branch[0].content)
                f += sgl.assistant(sgl.gen(f"answer_{t}", max_tokens=max_new_tokens, temperature=0))
            s[f"turn_{t}"] = [f[f"answer_{t}"] for f in forks]

    backend = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
    state = program.run(turns=session.turns, backend=backend)
    return [state[f"turn_{t}"] for t in range(len(session.turns))]
