"""The recall suite's task families (scenarios/composed, chatloop, multikey, locomo) and its table,
without a server: what each family plants, where, and what it asks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import recall_suite  # noqa: E402
import replay  # noqa: E402

from sgl_kvevict.scenarios import build, chatloop, locomo  # noqa: E402
from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402


def test_composed_history_is_written_by_the_client() -> None:
    sc = build("composed", ScenarioConfig(sessions=3, turns=6, filler_tokens=20))
    chat = build("composed-chat", ScenarioConfig(sessions=3, turns=6, filler_tokens=20))
    for s, c in zip(sc.sessions, chat.sessions, strict=True):
        assert (s.api, c.api) == ("generate", "chat")
        assert [t.inputs for t in s.turns] == [t.inputs for t in c.turns]  # the same sessions
        *history, question = s.turns
        assert all(t.reply is not None and t.answer_cap(24) == 1 for t in history)
        assert question.expect and question.expect in history[0].reply  # the echo holds the code
        assert all(t.reply == "" for t in history[1:])  # no reply between the filler messages
        assert question.reply is None and question.answer_cap(24) == 16
        assert all(len(t.inputs[0].content.split()) == 4 + 20 for t in history[1:])


@pytest.mark.parametrize("n_filler", [4, 10, 12])
def test_chatloop_plants_in_the_middle_or_last_third(n_filler: int) -> None:
    n = n_filler + 1
    middle, late = chatloop.plant_turn(0, n_filler), chatloop.plant_turn(1, n_filler)
    assert n / 3 <= middle < 2 * n / 3
    assert 2 * n / 3 <= late < n


def test_chatloop_filler_is_not_prose_and_the_fact_is_asked_last() -> None:
    sc = build("chatloop", ScenarioConfig(sessions=8, turns=12, filler_tokens=60))
    kinds = set()
    for i, s in enumerate(sc.sessions):
        texts = [t.inputs[0].content for t in s.turns]
        plants = [k for k, x in enumerate(texts) if x.startswith("Remember this:")]
        assert plants == [chatloop.plant_turn(i, 10)]
        assert s.turns[-1].expect in texts[plants[0]]
        kinds |= {x.split(":")[0].split(" (")[0] for x in texts[:-1] if not x.startswith("Remember")}
    assert kinds == {"Log excerpt", "Word list", "Code", "Tool output"}


def test_multikey_plants_three_shapes_and_asks_each_shape_at_each_position() -> None:
    sc = build("multikey", ScenarioConfig(sessions=9, turns=12, filler_tokens=40))
    asked = set()
    for i, s in enumerate(sc.sessions):
        texts = [t.inputs[0].content for t in s.turns]
        plants = [k for k, x in enumerate(texts) if x.startswith("Remember this:")]
        history = len(texts) - 1
        assert len(plants) == 3 and plants[0] == 0
        assert history / 3 <= plants[1] < 2 * history / 3 <= plants[2] < history  # middle, last third
        for k in plants:  # the client writes the reply to a plant: its value, never the model's echo
            assert s.turns[k].reply and s.turns[k].reply.split(" is ")[1].rstrip(".") in texts[k]
        value = s.turns[-1].expect
        where = [k for k in plants if value in texts[k]]
        assert where == [plants[i % 3]]  # session i asks the i % 3-th planted fact
        assert texts[-1].startswith("Forget the notes.")
        shape = "code" if value.isdigit() else "id" if "-" in value else "name"
        asked.add((i % 3, shape))
    assert len(asked) == 9  # nine sessions: every shape asked at every position


def _fake_locomo(tmp: Path) -> Path:
    """Ten conversations in LoCoMo's shape (the dataset itself is not shipped)."""
    data = []
    for n in range(10):
        conv = {"speaker_a": "Ann", "speaker_b": "Bob"}
        for k in (1, 2, 3):
            conv[f"session_{k}_date_time"] = f"day {k}"
            conv[f"session_{k}"] = [
                {"speaker": "Ann", "dia_id": f"D{k}:1", "text": f"In session {k} I adopted cat number {n}."},
                {"speaker": "Bob", "dia_id": f"D{k}:2", "text": "word " * 400},
            ]
        qa = [
            {"question": "Which cat?", "answer": f"cat {n}", "evidence": ["D1:1"], "category": 1},
            {"question": "Later?", "answer": "x", "evidence": ["D3:1"], "category": 2},
            {"question": "Trick?", "adversarial_answer": "y", "evidence": ["D1:1"], "category": 5},
        ]
        data.append(
            {
                "sample_id": f"conv-{[26, 30, 41, 42, 43, 44, 47, 48, 49, 50][n]}",
                "qa": qa,
                "conversation": conv,
            }
        )
    path = tmp / "locomo10.json"
    path.write_text(json.dumps(data[::-1]))  # out of order: the loader sorts by sample id
    return path


def test_locomo_holds_out_conversations_one_to_five(tmp_path: Path, monkeypatch) -> None:
    path = _fake_locomo(tmp_path)
    monkeypatch.delenv("KVEVICT_LOCOMO_HELD_OUT", raising=False)
    with pytest.raises(ValueError, match=r"held out"):
        build("locomo", ScenarioConfig(path=str(path), conversations="5-6"))
    sc = build("locomo", ScenarioConfig(path=str(path), conversations="6-10", turns=5, filler_tokens=300))
    assert [s.id for s in sc.sessions] == [f"locomo-{n}" for n in range(6, 11)]
    for n, s in zip(range(6, 11), sc.sessions, strict=True):
        *history, ask = s.turns
        assert len(history) == 2  # the third session would pass 5 x 300 tokens of dialog
        assert all(t.reply == "Noted." for t in history)
        # only the question whose evidence is in the replayed history, and never the adversarial one
        assert ask.references == [f"cat {n - 1}"] and len(ask.branches) == 1


def test_locomo_f1() -> None:
    assert locomo.f1("The cat, number 7.", "cat number 7") == 1.0
    assert locomo.f1("a dog", "cat") == 0.0
    assert locomo.f1("cat 7 and dog", "cat 7") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_suite_budget_and_table() -> None:
    assert recall_suite.budget_for(0.25, 2000, 64) == 500 - 64 - 36
    assert recall_suite.budget_for(0.01, 2000, 64) == recall_suite.MIN_BUDGET
    rows = {
        "none": {"composed": {"score": (12.0, 12), "full": (12.0, 12), "device": 1.0}},
        "snapkv 18%": {
            "composed": {"score": (9.0, 12), "full": (12.0, 12), "device": 0.181},
            "locomo": {"score": (0.07, 40), "full": (0.09, 40), "device": 0.2, "share": (0.78, 0.5, 1.1)},
        },
    }
    md = recall_suite.table(rows, ["composed", "locomo"], {"locomo"})
    assert "| snapkv 18% | 9/12 (12/12), 18% | 7.0 (9.0) 78% [50-110], 20% |" in md
    assert "| none | 12/12, 100% |  |" in md


def test_suite_f1_share_pairs_the_questions() -> None:
    """A run's F1 as a share of the full cache's, over the same questions, with a paired bootstrap
    interval: the same answers give 100% and no spread; losing half of every question's F1 gives 50%."""

    def run(f1s: list[float]) -> dict:
        turns = [
            {"session": "s", "turn": 1, "branch": i, "expect": "x", "error": None, "f1": f}
            for i, f in enumerate(f1s)
        ]
        return {"turns": turns}

    full = run([0.5, 0.0, 1.0, 0.25, 0.0, 0.75])
    assert recall_suite.f1_share(full, full) == (1.0, 1.0, 1.0)
    share, lo, hi = recall_suite.f1_share(full, run([0.25, 0.0, 0.5, 0.125, 0.0, 0.375]))
    assert share == lo == hi == pytest.approx(0.5)
    share, lo, hi = recall_suite.f1_share(full, run([0.5, 0.0, 0.0, 0.25, 0.0, 0.75]))
    assert share == pytest.approx(0.6) and lo < share < hi <= 1.0
    assert recall_suite.f1_share(run([0.0, 0.0]), run([0.5, 0.0])) is None


def test_suite_refuses_unknown_family(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        recall_suite.main(["--families", "composed,nope"])
    assert e.value.code == 2 and "valid: recall-code" in capsys.readouterr().err


def test_suite_runs_a_variant_without_recall_under_its_own_config(capsys) -> None:
    """`d2o#nomerge` keeps its `merge: false` in its run without recall (a spec of its own)."""
    args = ["--policies", "d2o,d2o#nomerge", "--policy-config", '{"d2o#nomerge": {"merge": false}}']
    a = argparse.Namespace(policies=args[1], policy_config=args[3])
    cfgs = recall_suite.policy_configs(a)
    assert cfgs["d2o#norecall"] == {"recall_tokens": 0}
    assert cfgs["d2o#nomerge-norecall"] == {"merge": False, "recall_tokens": 0}
    spec = replay.parse_spec(recall_suite.norecall_spec("d2o#nomerge") + "@branch=100")
    assert replay.policy_config(replay.BenchConfig(policy_configs=cfgs), spec) == {
        "merge": False,
        "recall_tokens": 0,
        "scope": "branch",
    }
    with pytest.raises(SystemExit) as e:
        recall_suite.main(["--families", "composed", "--policy-config", "[1]"])
    assert e.value.code == 2 and "maps a policy or variant" in capsys.readouterr().err


def test_suite_resume_reads_back_a_finished_run_only(tmp_path, monkeypatch) -> None:
    """`--resume` reuses a finished replay of the same spec and sessions; a partial one, or another spec's,
    runs again."""
    ran: list[str] = []

    def fake_main(cfg):  # the replay itself needs a server: only which runs would start is checked here
        ran.append(cfg.policies[0])
        return {"runs": [{"label": "new"}]}

    monkeypatch.setattr(recall_suite.replay, "main", fake_main)
    a = recall_suite.parser().parse_args(["--resume", "--policies", "snapkv"])
    folder = tmp_path / recall_suite.run_folder("snapkv 18% no recall")
    assert folder.name == "snapkv-18pct-no-recall"
    folder.mkdir()
    spec = "snapkv#norecall@branch=100"
    saved = {
        "config": {"policies": [spec], "scenario": {"sessions": 12}},
        "partial": False,
        "runs": [{"label": "old"}],
    }
    (folder / "replay.json").write_text(json.dumps(saved))
    assert recall_suite.run_one(a, "composed", "http://x", folder, spec, "t")["label"] == "old" and not ran
    assert recall_suite.run_one(a, "composed", "http://x", folder, "snapkv@branch=100", "t")["label"] == "new"
    (folder / "replay.json").write_text(json.dumps({**saved, "partial": True}))
    assert recall_suite.run_one(a, "composed", "http://x", folder, spec, "t")["label"] == "new"
    assert ran == ["snapkv@branch=100", spec]


def test_suite_report_prints_the_finished_runs_and_starts_nothing(tmp_path, monkeypatch, capsys) -> None:
    """`--report` reads back what is finished under `--out` (no server, no replay): a missing run is a
    blank cell, a family without its full cache's run is left out, rows keep the table's order."""
    monkeypatch.setattr(recall_suite.replay, "main", lambda cfg: pytest.fail("--report ran a replay"))
    turns = [
        {
            "expect": "7",
            "error": None,
            "correct": True,
            "f1": None,
            "prompt_tokens": 1000,
            "kv_tokens": 200,
            "peak_kv_tokens": None,
        }
    ]

    def save(folder: str, spec: str, budget: int | None) -> None:
        d = tmp_path / "composed" / folder
        d.mkdir(parents=True)
        run = {"turns": turns, "budget": budget}
        d.joinpath("replay.json").write_text(
            json.dumps({"config": {"policies": [spec], "scenario": {"sessions": 12}}, "runs": [run]})
        )

    b = recall_suite.budget_for(0.25, 1000, 64)
    save("none", "none", None)
    save("d2o-25pct", f"d2o@branch={b}", b)
    save("snapkv-25pct-no-recall", f"snapkv#norecall@branch={b}", b)
    args = ["--report", "--out", str(tmp_path), "--families", "composed,multikey", "--fractions", "0.25"]
    rows = recall_suite.main([*args, "--policies", "snapkv,d2o"])
    assert list(rows) == ["none", "snapkv 25% no recall", "d2o 25%"]
    out = capsys.readouterr().out
    assert "| d2o 25% | 1/1 (1/1), 20% |  |" in out and "multikey" in out


def test_suite_report_pools_the_same_run_under_another_schedule(tmp_path, monkeypatch, capsys) -> None:
    """`--report --pool DIR` sums each cell with the same run under DIR (full cache included); a run
    missing under DIR leaves its cell blank; `--pool` without `--report` exits 2."""
    monkeypatch.setattr(recall_suite.replay, "main", lambda cfg: pytest.fail("--report ran a replay"))
    b = recall_suite.budget_for(0.25, 1000, 64)

    def save(root: Path, folder: str, spec: str, correct: list[bool]) -> None:
        d = root / "multikey" / folder
        d.mkdir(parents=True)
        turns = [
            {"session": f"s{i}", "expect": "7", "error": None, "correct": c, "f1": None}
            | {"prompt_tokens": 1000, "kv_tokens": 200, "peak_kv_tokens": None}
            for i, c in enumerate(correct)
        ]
        run = {"turns": turns, "budget": None if spec == "none" else b}
        d.joinpath("replay.json").write_text(
            json.dumps({"config": {"policies": [spec], "scenario": {"sessions": 12}}, "runs": [run]})
        )

    four, one = tmp_path / "four", tmp_path / "one"
    for root, got, budget in ((four, [True, False], b), (one, [True, True], b + 3)):
        save(root, "none", "none", [True, True])  # `one`'s context differs a little: so does its budget
        save(root, "d2o-25pct", f"d2o@branch={budget}", got)
    save(four, "snapkv-25pct", f"snapkv@branch={b}", [True, True])  # not under `one`: left out
    args = ["--report", "--out", str(four), "--pool", str(one), "--families", "multikey"]
    rows = recall_suite.main([*args, "--fractions", "0.25", "--policies", "snapkv,d2o", "--no-recall-runs"])
    assert list(rows) == ["none", "d2o 25%"]
    assert "| d2o 25% | 3/4 (4/4), 20% |" in capsys.readouterr().out
    assert not (four / "suite.md").exists()  # printed only: the folder's own table is not rewritten
    with pytest.raises(SystemExit) as e:
        recall_suite.main(["--pool", str(one), "--families", "multikey"])
    assert e.value.code == 2


def test_locomo_windows_replay_the_next_stretch_with_its_own_questions(tmp_path: Path) -> None:
    """`windows` 2: the session the first window stopped before starts the second, whose questions are
    those with evidence in it (the session-3 question, not the session-1 one)."""
    path = _fake_locomo(tmp_path)
    cfg = ScenarioConfig(path=str(path), conversations="6-7", turns=5, filler_tokens=300, windows=2)
    sc = build("locomo", cfg)
    assert [s.id for s in sc.sessions] == ["locomo-6", "locomo-6-2", "locomo-7", "locomo-7-2"]
    first, second = sc.sessions[:2]
    assert len(first.turns) == 3 and first.turns[-1].references == ["cat 5"]
    assert len(second.turns) == 2 and second.turns[0].inputs[0].content.startswith("Chat on day 3")
    assert second.turns[-1].references == ["x"]
