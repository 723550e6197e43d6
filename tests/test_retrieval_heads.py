"""The model's retrieval heads (`cache/host_tier/retrieval_heads.py`), measured on the embedded SmolLM2-135M: few
heads copy from an earlier occurrence, none in the first layers, and the scores are measured once per
model and read back from disk after that."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_kvevict.cache.host_tier import retrieval_heads
from sgl_kvevict.model import default_model_path


@pytest.fixture(scope="module")
def scores_and_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads")
    return retrieval_heads.cached_scores(default_model_path(), folder), folder


def test_few_heads_copy_and_none_in_the_first_layers(scores_and_dir):
    scores, _ = scores_and_dir
    assert scores.shape == (30, 3)
    assert float(scores.min()) >= 0.0 and float(scores.max()) <= 1.0
    assert float(scores.max()) >= 0.5  # an induction head: most of its attention on the copied token
    picked = scores >= 0.1
    assert 0 < int(picked.sum()) < scores.numel() // 4
    assert not picked[:10].any()  # the first third of the layers only read locally


def test_the_scores_are_measured_once_per_model(scores_and_dir, monkeypatch):
    scores, folder = scores_and_dir
    (f,) = list(folder.glob("*.json"))
    assert json.loads(f.read_text())["kv_heads"] == scores.tolist()
    monkeypatch.setattr(retrieval_heads, "induction_scores", lambda *a, **k: pytest.fail("measured again"))
    assert torch.equal(retrieval_heads.cached_scores(default_model_path(), folder), scores)


def test_a_rank_takes_its_slice_of_the_kv_heads():
    scores = torch.tensor([[0.0, 0.5, 0.2, 0.05]])
    assert retrieval_heads.mask(scores, 0.1).tolist() == [[False, True, True, False]]
    assert retrieval_heads.mask(scores, 0.1, tp_rank=1, tp_size=2).tolist() == [[True, False]]
