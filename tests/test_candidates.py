"""The two-candidate replay (lab.candidates) on crafted outcomes, priced by hand."""
import numpy as np
import pytest

from lab.candidates import Answer, replay, study

V = {k: 1 + 0.1 * (k - 1) for k in range(1, 10)}
FLAT = {k: 1.0 for k in range(1, 10)}


def lookup_right_draft_wrong(n=10):
    return Answer(np.zeros(n, int), [(3, 4, 4)] * n)


def test_the_draft_alone_pays_a_pass_and_a_draft_step_a_round():
    assert replay(lookup_right_draft_wrong(), "draft", 1, V, 0.2, 0.0) == pytest.approx(10 / 13)


def test_both_keeps_lookups_run_and_pays_the_wider_pass_and_the_drafts_catch_up():
    # two rounds of 4 + 1 tokens: v(6) + c v(1), then v(6) + c v(5) (the draft saw a wrong chain)
    assert replay(lookup_right_draft_wrong(), "both", 1, V, 0.2, 0.0, look=4) == pytest.approx(10 / 3.48)


def test_both_is_never_worse_than_the_draft_when_width_is_free():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = 30
        run = np.zeros(n + 1, int)
        for j in range(n - 1, -1, -1):
            run[j] = run[j + 1] + 1 if rng.random() < 0.7 else 0
        looks = [(int(rng.integers(0, 4)),) + ((p := int(rng.integers(0, 5))), int(rng.integers(0, p + 1)))
                 for _ in range(n)]
        a = Answer(run[:-1], looks)
        for g in (1, 2, 4):
            assert replay(a, "both", g, FLAT, 0.0, 0.0) >= replay(a, "draft", g, FLAT, 0.0, 0.0) - 1e-12


def test_study_picks_each_strategy_at_its_best():
    rows = {r["strategy"]: r for r in study([lookup_right_draft_wrong()], V, 0.2, 0.0)}
    assert rows["draft"]["gamma"] == 1                     # a wrong draft: the shortest round
    assert rows["both"]["speedup"] > rows["draft"]["speedup"]


def test_the_rule_takes_lookup_on_a_long_enough_match_and_the_draft_otherwise():
    a = lookup_right_draft_wrong()                         # every match is 3 long
    assert replay(a, "rule", 1, V, 0.2, 0.0, min_n=3, look=4) == pytest.approx(replay(a, "lookup", 1, V, 0.2, 0.0, look=4))
    assert replay(a, "rule", 1, V, 0.2, 0.0, min_n=4, look=4) == pytest.approx(replay(a, "draft", 1, V, 0.2, 0.0))
