"""Load users' own conversations: ShareGPT (`conversations: [{from, value}]`) or OpenAI messages
(`messages: [{role, content}]`, or a bare list of them), as a JSON array or JSONL.

Each user (or tool) message run becomes a turn; recorded assistant replies are dropped, since the model
answers itself during replay (its own answers become history). Scripted assistant tool calls that sit
between two non-assistant messages are kept as inputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .base import Message, Scenario, ScenarioConfig, Session, Turn

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def _messages(item: Any) -> list[Message]:
    if isinstance(item, dict):
        raw = item.get("messages", item.get("conversations", item.get("conversation")))
    else:
        raw = item
    if not isinstance(raw, list):
        raise ValueError(f"a conversation needs 'messages' or 'conversations' (got {type(item).__name__})")
    out = []
    for m in raw:
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"unsupported message {m!r}: need role/from in {sorted(ROLES)} and text content")
        out.append(Message(role=ROLES[role], content=content))
    return out


def to_session(sid: str, msgs: list[Message], max_turns: int | None = None) -> Session | None:
    system = None
    if msgs and msgs[0].role == "system":
        system, msgs = msgs[0].content, msgs[1:]
    turns: list[Turn] = []
    pending: list[Message] = []
    for i, m in enumerate(msgs):
        if m.role != "assistant":
            pending.append(m)
            continue
        nxt = msgs[i + 1].role if i + 1 < len(msgs) else None
        if pending and nxt == "tool":  # a recorded tool call inside the turn: keep it as input
            pending.append(m)
        elif pending:
            turns.append(Turn(inputs=pending))
            pending = []
    if pending:
        turns.append(Turn(inputs=pending))
    turns = turns[:max_turns] if max_turns else turns
    return Session(id=sid, kind="sharegpt", system=system, turns=turns) if turns else None


def load(path: str | Path, cfg: ScenarioConfig | None = None) -> Scenario:
    cfg = cfg or ScenarioConfig()
    text = Path(path).read_text()
    stripped = text.lstrip()
    items = (
        json.loads(text)
        if stripped.startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    sessions = []
    for n, item in enumerate(items):
        s = to_session(f"sharegpt-{n}", _messages(item), cfg.turns)
        if s is not None:
            sessions.append(s)
        if len(sessions) >= cfg.sessions:
            break
    return Scenario(name="sharegpt", seed=cfg.seed, sessions=sessions)


def build(cfg: ScenarioConfig) -> Scenario:
    if not cfg.path:
        raise ValueError("the sharegpt scenario needs a file: --scenario-path conversations.json")
    return load(cfg.path, cfg)
