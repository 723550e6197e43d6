"""Agent sessions: one shared system prompt with tool descriptions, then turns of
user task -> scripted tool call -> long tool output (logs, JSON, file listings, search results) -> answer."""

from __future__ import annotations

import json
import random

from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for

TOOLS = {
    "read_logs": "Return the last lines of a service log. Args: service (string), lines (int).",
    "query_api": "Call an internal HTTP API and return its JSON body. Args: path (string).",
    "list_files": "List a directory recursively with sizes. Args: path (string), depth (int).",
    "web_search": "Search the web and return result titles, urls and snippets. Args: query (string).",
}
SERVICES = ["billing", "auth", "search", "payments", "inventory", "gateway", "mailer", "scheduler"]
LEVELS = ["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"]
EVENTS = [
    "request served in {n} ms",
    "cache miss for key user:{n}",
    "retrying upstream call (attempt {k})",
    "connection pool at {k}0% capacity",
    "slow query took {n} ms on table orders",
    "worker {k} heartbeat ok",
    "timeout talking to {svc} after {n} ms",
    "queue depth is {n}",
]
WORDS = "alpha beta gamma delta kernel cache server token policy budget shard replica cluster node index vector stream batch latency".split()


def system_prompt(cfg: ScenarioConfig) -> str:
    """The same for every session (seeded by cfg.seed only) so it is a shared radix prefix."""
    r = rng_for(cfg.seed, "system")
    head = "You are an operations agent. You can call these tools by writing TOOL(name, args):\n"
    head += "\n".join(f"- {name}: {desc}" for name, desc in TOOLS.items())
    rules = fill(
        r,
        max(0, cfg.system_tokens - len(head) // 4),
        lambda r: (
            f"Rule {r.randint(1, 999)}: when a {r.choice(SERVICES)} check reports {r.choice(WORDS)} "
            f"issues, prefer {r.choice(list(TOOLS))} and summarise in at most {r.randint(2, 5)} sentences."
        ),
    )
    return head + "\nOperating rules:\n" + rules


def _log(r: random.Random, svc: str) -> str:
    ev = r.choice(EVENTS).format(n=r.randint(2, 9000), k=r.randint(1, 9), svc=r.choice(SERVICES))
    return f"2025-0{r.randint(1, 9)}-1{r.randint(0, 9)}T{r.randint(10, 23)}:{r.randint(10, 59)}:{r.randint(10, 59)}Z {r.choice(LEVELS)} {svc} {ev}"


def _json_row(r: random.Random, svc: str) -> str:
    return json.dumps(
        {
            "id": r.randint(1000, 99999),
            "service": svc,
            "status": r.choice(["ok", "degraded", "down"]),
            "p99_ms": r.randint(5, 900),
        }
    )


def _file(r: random.Random, svc: str) -> str:
    return f"{r.randint(1, 99999):>7}  src/{svc}/{r.choice(WORDS)}/{r.choice(WORDS)}_{r.randint(1, 99)}.py"


def _search(r: random.Random, svc: str) -> str:
    return f"- {svc} {r.choice(WORDS)} {r.choice(WORDS)} guide | https://docs.example.com/{svc}/{r.randint(1, 999)} | how to tune {r.choice(WORDS)} for {r.choice(WORDS)}"


KINDS = [
    ("read_logs", "Why is {svc} slow today?", _log),
    ("query_api", "What is the status of the {svc} service?", _json_row),
    ("list_files", "Which files in the {svc} repository are the largest?", _file),
    ("web_search", "Find documentation on tuning {svc}.", _search),
]


def build(cfg: ScenarioConfig) -> Scenario:
    system = system_prompt(cfg)
    sessions = []
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "agent", i)
        turns = []
        for _ in range(cfg.turns):
            tool, task, unit = r.choice(KINDS)
            svc = r.choice(SERVICES)
            size = r.randint(cfg.tool_tokens_min, max(cfg.tool_tokens_min, cfg.tool_tokens_max))
            output = fill(r, size, lambda r, u=unit, s=svc: u(r, s), chars_per_token=2.0)
            turns.append(
                Turn(
                    inputs=[
                        Message(role="user", content=task.format(svc=svc)),
                        Message(role="assistant", content=f"TOOL({tool}, service={svc})"),
                        Message(role="tool", content=output),
                    ]
                )
            )
        sessions.append(Session(id=f"agent-{i}", kind="agent", system=system, turns=turns))
    return Scenario(name="agent", seed=cfg.seed, sessions=sessions)
