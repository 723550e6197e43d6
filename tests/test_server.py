"""The foundation, end to end: the real SGLang server on the embedded SmolLM2, over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from sgl_kvevict.model import default_model_path
from sgl_kvevict.serve.serverproc import Server

from .helpers import POOL, _server, chat_ids, tokenizer

pytestmark = pytest.mark.server

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "What is 2+2?"}],
]
N_NEW = 24


@pytest.fixture(scope="module")
def none_server() -> Iterator[Server]:
    yield from _server([*POOL, "--dtype", "float32", "--kv-policy", "none"])


def hf_greedy(ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(
        default_model_path(), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer().eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def server_greedy(srv: Server, ids: list[int], n: int) -> list[int]:
    out = srv.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True)
    return out["output_ids"]


def test_model_folder_is_a_plain_hf_model():
    path = default_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).exists()
    assert tokenizer().chat_template  # the chat template came with it


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_tokens_equal_hf_transformers(plain_server: Server, i: int):
    ids = chat_ids(PROMPTS[i])
    want = hf_greedy(ids, N_NEW)
    got = server_greedy(plain_server, ids, N_NEW)
    assert got == want, f"server {tokenizer().decode(got)!r} != HF {tokenizer().decode(want)!r}"


@pytest.mark.long
def test_kv_policy_none_is_plain_sglang(plain_server: Server, none_server: Server):
    for msgs in PROMPTS:
        ids = chat_ids(msgs)
        assert server_greedy(none_server, ids, N_NEW) == server_greedy(plain_server, ids, N_NEW)
    info = none_server.server_info()["internal_states"][0]
    assert info.get("radix_cache_backend") in (None, "")  # no compressing cache with `none`
    assert "kvevict" not in info


def test_prefix_cache_reports_cached_tokens(plain_server: Server):
    ids = chat_ids([{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hi"}])
    plain_server.generate(input_ids=ids, max_new_tokens=2)
    again = plain_server.generate(input_ids=ids, max_new_tokens=2)
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 2
