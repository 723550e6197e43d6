"""Deterministic test inputs and small checks shared by the end-to-end tests."""

from __future__ import annotations

import functools
from collections.abc import Iterator

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios.text import log_text
from sgl_kvevict.serve.serverproc import Server

CHECKED_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
    "KVEVICT_DEBUG": "1",
    "KVEVICT_TEST_POLICIES": "1",
}
POOL = ["--max-total-tokens", "40000"]


def _server(args: list[str]) -> Iterator[Server]:
    srv = Server(args, env=CHECKED_ENV)
    srv.start()
    try:
        yield srv
    finally:
        alive = srv.alive()
        tail = srv.tail()
        srv.stop()
        assert alive, f"server died during the tests; log tail:\n{tail}"


@functools.cache
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_path())


def long_text(n_tokens: int, seed: int = 0) -> str:
    """A log-like text of `n_tokens` tokens (deterministic)."""
    return log_text(tokenizer(), n_tokens, seed)


def chat_ids(messages: list[dict]) -> list[int]:
    return tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def not_collapsed(output_ids: list[int]) -> bool:
    """Fluent enough: no long run of one token and a reasonable number of distinct tokens."""
    if len(output_ids) < 8:
        return True
    longest = run = 1
    for a, b in zip(output_ids, output_ids[1:], strict=False):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    return longest < 8 and len(set(output_ids)) >= min(10, len(output_ids) // 4)
