"""`cache/segments.py`: how a turn's prefill scores logical positions and which segments its append
brings back whole (pure tensor math; the server side is in tests/test_recall_e2e.py)."""

import torch

from sgl_kvevict.cache import segments


def test_add_sums_each_entrys_best_attention_at_its_logical_position() -> None:
    pos = torch.tensor([[5, 9, 2], [9, 1, 5]])  # [H, C]: each head holds other positions
    best = torch.tensor([[0.5, 0.25, 0.125], [0.5, 1.0, 0.25]])
    got = segments.add(None, pos, best, tokens=12)
    want = torch.zeros(12)
    want[5], want[9], want[2], want[1] = 0.75, 0.75, 0.125, 1.0
    torch.testing.assert_close(got, want)
    again = segments.add(got, pos[:1], best[:1], tokens=16)  # a later layer, a longer history
    assert again.shape == (16,)
    assert float(again[5]) == 1.25 and float(again[15]) == 0.0


def test_choose_takes_the_best_segments_each_with_the_next() -> None:
    s = torch.zeros(100)
    s[37] = 3.0  # segment 2 of 16 positions
    s[81] = 1.0  # segment 5
    s[90] = 0.5  # segment 5 too: a segment ranks by its best position, not its sum
    s[65] = 0.9  # segment 4
    chosen = segments.choose(s, size=16, count=2)
    assert chosen.tolist() == [False, False, True, True, False, True, True]


def test_choose_never_picks_the_sinks_or_what_nobody_attended() -> None:
    s = torch.zeros(64)
    s[:4] = 10.0  # the attention sinks: attended by habit, evidence of nothing
    s[40] = 0.5
    chosen = segments.choose(s, size=16, count=2)
    assert chosen.tolist() == [False, False, True, True]  # one segment scored: its next, and no other


def test_members_are_every_layer_and_heads_entries_inside_a_chosen_segment() -> None:
    chosen = torch.tensor([False, True, False])
    pos = torch.tensor([[[3, 17, 31], [40, 16, 15]]])  # [L=1, H=2, C=3]
    assert segments.members(pos, chosen, 16).tolist() == [[[False, True, True], [False, True, False]]]


def test_members_leave_out_entries_past_what_the_prefill_scored() -> None:
    # the compression after a turn's prefill demotes the turn's own tokens: positions the scores never
    # covered; the last scored segment being chosen must not bring all of them back with it
    chosen = torch.tensor([False, False, True])  # positions 0..47 scored, segment 2 chosen
    pos = torch.tensor([[[20, 40, 47, 48, 90, 200]]])
    assert segments.members(pos, chosen, 16).tolist() == [[[False, True, True, False, False, False]]]


def test_contrast_keeps_what_only_this_turn_attends() -> None:
    habit = torch.tensor([5.0, 1.0, 2.0, 0.5])  # the previous turn: a template at 0, its question at 2
    scores = torch.tensor([5.5, 3.0, 2.0, 0.25, 4.0])  # this turn: the fact at 1, the last answer at 4
    got = segments.contrast(scores, habit)
    torch.testing.assert_close(got, torch.tensor([0.5, 2.0, 0.0, 0.0, 0.0]))  # past the habit: no baseline
    assert float(habit[0]) == 5.0  # the habit is not written
