"""The scenario data model: sessions of turns, replayed in order inside a session.

A turn appends `inputs` (user/tool messages, or a scripted assistant tool call) to the conversation,
then the model answers; the model's *own* answer becomes history, as in a real chat, so the next turn's
prompt extends the previous prompt + answer token for token and the server can reuse that history.
A turn with `branches` is a fork: each branch is sent concurrently from the same context; the first
branch's answer continues the session.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CHARS_PER_TOKEN = 4.0  # rough English/JSON average for a BPE tokenizer; sizes are targets, not exact


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: list[Message]
    branches: list[list[Message]] = Field(
        default_factory=list, description="fork: sent concurrently after inputs"
    )
    expect: str | None = Field(None, description="exact string the answer must contain (recall check)")
    references: list[str] = Field(
        default_factory=list,
        description="one reference answer per branch, scored by token F1 (a dataset's own metric) instead "
        "of `expect`",
    )
    reply: str | None = Field(
        None,
        description="client-composed turn: the client writes the assistant's reply; the request generates "
        "`max_new_tokens` (1 by default) and the history continues with this reply, not the model's "
        "(an empty reply: no assistant message at all, the next message follows the user's)",
    )
    max_new_tokens: int | None = Field(None, description="overrides the benchmark's default for this turn")
    min_new_tokens: int | None = Field(
        None, ge=1, description="the answer cap never goes below this, whatever the benchmark's default"
    )

    def answer_cap(self, default: int) -> int:
        """The answer length cap of this turn, given the benchmark's default.

        A recall question gets its own room whatever the turn length; a turn whose answer repeats a
        fact gets at least `min_new_tokens`, because an echo cut mid-value is a wrong copy of the fact
        in the history.
        """
        if (self.expect is not None or self.references) and self.max_new_tokens:
            return self.max_new_tokens
        if self.reply is not None:
            return self.max_new_tokens or 1
        return max(min(default, self.max_new_tokens or default), self.min_new_tokens or 1)


class Session(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    kind: str
    system: str | None = None
    api: Literal["generate", "chat"] = Field(
        "generate",
        description="generate: token ids through /generate; chat: messages through /v1/chat/completions",
    )
    turns: list[Turn]


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    seed: int
    sessions: list[Session]


class ScenarioConfig(BaseModel):
    """Sizes of the generated scenarios. Defaults fit a 2-core CPU; scale them up on a GPU."""

    model_config = ConfigDict(extra="forbid")

    sessions: int = Field(4, ge=1)
    turns: int = Field(
        4, ge=1, description="turns per session (agent: 4-8; recall: facts + filler + question)"
    )
    seed: int = 0
    system_tokens: int = Field(600, ge=0, description="shared system prompt (agent tool descriptions)")
    tool_tokens_min: int = Field(300, ge=1)
    tool_tokens_max: int = Field(2000, ge=1)
    filler_tokens: int = Field(200, ge=1, description="recall chat: size of each filler turn")
    branches: int = Field(3, ge=1, description="forks: branches per turn")
    question_forks: int = Field(
        1,
        ge=1,
        le=4,
        description="recall chat: the question as a fork of this many branches, each asking for the fact",
    )
    plant_room: int = Field(
        16,
        ge=0,
        le=4096,
        description="recall chat and long: answer tokens the plant's turn gets at least, whatever the benchmark's "
        "cap (0: the cap; an echo of the fact cut mid-value is a wrong copy of it)",
    )
    path: str | None = Field(None, description="sharegpt, locomo: the JSON/JSONL file or folder to load")
    conversations: str = Field(
        "6-10",
        pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        description="locomo: the dataset's conversations to replay, 1-based (e.g. 6-10)",
    )
    questions: int = Field(12, ge=1, le=200, description="locomo: questions asked per window at most")
    windows: int = Field(
        1,
        ge=1,
        le=32,
        description="locomo: consecutive stretches of each conversation replayed as separate sessions "
        "(each about `filler_tokens * turns` tokens of dialog, its own questions)",
    )


def rng_for(seed: int, *keys: object) -> random.Random:
    """A stream per (seed, keys): adding a session never changes the others."""
    return random.Random(f"{seed}:" + ":".join(str(k) for k in keys))


def fill(r: random.Random, target_tokens: int, unit, chars_per_token: float = CHARS_PER_TOKEN) -> str:
    """Concatenate `unit(r)` lines until about `target_tokens` tokens (logs/JSON: ~2 chars per token)."""
    lines: list[str] = []
    size = 0.0
    while size < target_tokens * chars_per_token:
        line = unit(r)
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)
