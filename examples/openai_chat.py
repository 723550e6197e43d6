"""A multi-turn chat with the `openai` client against an SGLang server running sgl-kvevict, each request
asking for its own KV policy, printing what compression did to each turn.

Start a server (`make serve POLICY=lagkv PORT=30000`), then:

    python examples/openai_chat.py --url http://127.0.0.1:30000 --policy snapkv --budget 128

The policy travels in `extra_body`: `custom_params.kvevict` is the per-request override (SGLang passes
`custom_params` of `/v1/chat/completions` to the request's sampling parameters), and
`return_meta_info: true` makes SGLang return each choice's `meta_info`, where the plugin's report is
`meta_info["kvevict"][0]`. Needs only `openai` (`pip install openai`).
"""

from __future__ import annotations

import argparse
import json
import random

from openai import OpenAI


def log_lines(n: int, seed: int) -> str:
    """A service log of `n` lines: something long enough for compression to evict from."""
    rng = random.Random(seed)
    hosts, states = ["web-1", "web-2", "db-1", "cache-1"], ["ok", "ok", "ok", "slow", "error"]
    return "\n".join(
        f"12:{i // 60:02d}:{i % 60:02d} {rng.choice(hosts)} status={rng.choice(states)} "
        f"latency_ms={rng.randint(3, 900)}"
        for i in range(n)
    )


QUESTIONS = [
    "Here is the first part of today's log:\n{log}\nWhich host reports errors most often?",
    "The next part:\n{log}\nDid the slow requests cluster on one host?",
    "And the last part:\n{log}\nSummarise the day in one sentence.",
    "Which host would you restart first, and why?",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the SGLang server")
    p.add_argument("--policy", default="snapkv", help="the KV policy this chat asks for")
    p.add_argument("--budget", default="128", help='KV tokens kept per request (256) or a percent ("50%%")')
    p.add_argument("--turns", type=int, default=3, help=f"user turns (at most {len(QUESTIONS)})")
    p.add_argument("--lines", type=int, default=40, help="log lines per pasted part")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()

    client = OpenAI(base_url=a.url.rstrip("/") + "/v1", api_key="none")
    budget = int(a.budget) if a.budget.isdigit() else a.budget
    override = {"policy": a.policy, "budget": budget}
    messages = [{"role": "system", "content": "You are a concise operations assistant."}]
    for turn, question in enumerate(QUESTIONS[: a.turns], start=1):
        messages.append({"role": "user", "content": question.format(log=log_lines(a.lines, seed=turn))})
        resp = client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=a.max_tokens,
            temperature=0,
            extra_body={"custom_params": {"kvevict": override}, "return_meta_info": True},
        )
        choice = resp.choices[0]
        meta = choice.model_dump().get("meta_info") or {}
        stats = (meta.get("kvevict") or [{}])[0]
        answer = choice.message.content or ""
        messages.append({"role": "assistant", "content": answer})
        print(
            f"turn {turn}: policy={stats.get('policy')} budget={stats.get('budget')} scope={stats.get('scope')} "
            f"kv_tokens={stats.get('kv_tokens')} logical_tokens={stats.get('logical_tokens')} "
            f"evicted={stats.get('evicted')} reused_evicted={stats.get('reused_evicted')} "
            f"cached_tokens={meta.get('cached_tokens')}"
        )
        print(f"  answer: {answer.strip()[:160]!r}")
        scalars = {k: v for k, v in stats.items() if not isinstance(v, list | dict)}  # debug lists left out
        print(f"  meta_info.kvevict: {json.dumps(scalars, sort_keys=True)}")


if __name__ == "__main__":
    main()
