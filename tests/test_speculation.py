"""Speculation that chooses for itself: a vocabulary-trimmed draft keeps greedy output equal
to plain and sampling exact; the automatic policy's decisions follow its costs and
calibration; calibration and cost files refuse other models and machines; the speculative
benchmark's pairing and equality check can fail."""
import json

import numpy as np
import pytest

from lab import native, policy as P, speculative as S, vocab
from lab.engine import Engine
from lab.kernels import Pool
from lab.models import TINY, tiny_weights
from lab.models import export as ex

from .test_engine import _joint2, chi2, chi2_critical, prompts

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def pool():
    return Pool(min(2, len(__import__("os").sched_getaffinity(0))))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    c = TINY["tiny-qwen2"]
    out = {"target": ex.export(c, tiny_weights(c, seed=1), d / "t.lab", "q4-q8out"),
           "full": ex.export(c, tiny_weights(c, seed=1), d / "f.lab", "q8")}
    for fmt in ("q8", "q4"):     # the target's own weights, its output cut to every third token
        out[f"trim-{fmt}"] = ex.export(c, tiny_weights(c, seed=1), d / f"trim-{fmt}.lab", "q8",
                                       keep=list(range(0, 380, 3)), keep_fmt=fmt)
    v16 = TINY["tiny-v16"]
    out["v16"] = ex.export(v16, tiny_weights(v16, seed=1), d / "v16.lab", "f32")
    out["v16-trim"] = ex.export(v16, tiny_weights(v16, seed=7), d / "v16-trim.lab", "f32",
                                keep=[0, 2, 3, 4, 5, 6, 7, 9], keep_fmt="q8")
    return out


def costs_for_test(target, draft, c=0.2, slope=0.05, o=0.01) -> P.Costs:
    """Crafted costs: v(k) = 1 + slope (k - 1) everywhere, a draft step c."""
    vk = int(native.lib().VK)
    v = [0.0] + [1 + slope * (k - 1) for k in range(1, vk)]
    return P.Costs(machine=P.machine_id(target.pool.threads), target=P._content(target), draft=P._content(draft),
                   contexts=[64, 256], v=[v, v], c=[c, c], o=o, o_sampled=o)


def table(draft_p=0.5, first=0.5, nxt=0.5, alpha=0.5) -> P.Table:
    bins, nmax = int(native.lib().CAL_BINS), int(native.lib().NGRAM_MAX)
    dp = draft_p if isinstance(draft_p, list) else [draft_p] * bins
    return P.Table(draft_p=dp, draft_next=dp, lookup_first=[first] * (nmax + 1), lookup_next=nxt, draft_alpha=alpha,
                   positions=1)


# ----------------------------------------------------------------------------
# The trimmed draft
# ----------------------------------------------------------------------------

def test_trimmed_logits_are_the_full_models_on_the_kept_rows(files, pool):
    full = Engine(files["full"], pool=pool, max_context=128)
    trim = Engine(files["trim-q8"], pool=pool, max_context=128)
    assert trim.trimmed and not full.trimmed
    p = [5, 6, 7, 8, 9]
    want, got = full.forward(p, 0), trim.forward(p, 0)
    kept = np.isfinite(got)
    assert (kept.sum(1) == 127).all() and np.array_equal(np.flatnonzero(kept[0]), np.arange(0, 380, 3))
    np.testing.assert_array_equal(got[kept], want[kept])
    assert trim.set_extra_rows([1, 2, 3, 4]) == 3               # 3 is kept already
    got = trim.forward(p, 0)
    kept = np.isfinite(got[0])
    assert kept[[1, 2, 4]].all() and kept.sum() == 130
    np.testing.assert_array_equal(got[:, kept], want[:, kept])  # gathered rows: the same bytes
    assert trim.set_extra_rows([7]) == 1 and np.isfinite(trim.forward(p, 0)[0]).sum() == 128   # replaced
    assert trim.weight_bytes < full.weight_bytes


def test_a_bad_trim_is_refused(tmp_path):
    c = TINY["tiny-qwen2"]
    with pytest.raises(ex.ModelFileError, match="distinct token ids"):
        ex.export(c, tiny_weights(c), tmp_path / "x.lab", "q8", keep=[1, 1, 2])
    with pytest.raises(ex.ModelFileError, match="distinct token ids"):
        ex.export(c, tiny_weights(c), tmp_path / "x.lab", "q8", keep=[1, 999])


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_trimmed_draft_keeps_greedy_output_equal_to_plain(files, pool, fmt):
    target = Engine(files["target"], pool=pool, max_context=512)
    draft = Engine(files[f"trim-{fmt}"], pool=pool, max_context=512)
    forcing = P.Policy(costs_for_test(target, draft, c=0.01, slope=0.0), table(0.99, 0.99, 0.99, 0.99), 6)
    for p in prompts(TINY["tiny-qwen2"], 4, seed=3) + [[5, 6, 7, 5, 6, 7, 5, 6]]:
        plain = target.generate(p, 40).tokens
        for gamma in (1, 3, 8):
            assert target.speculate(p, draft, gamma=gamma, max_new_tokens=40).tokens == plain
        r = target.speculate(p, draft, policy=forcing, max_new_tokens=40)
        assert r.tokens == plain and "draft" in r.kinds


@pytest.mark.parametrize("mode", ["fixed", "auto"])
def test_trimmed_draft_samples_the_targets_distribution(files, pool, mode):
    """The draft proposes only 8 of 16 tokens (q is 0 on the rest, which the target can
    emit): the engine's samples of the next two tokens still follow the target's joint
    distribution, enumerated in PyTorch."""
    T, prompt = 1.5, [3, 9, 1]
    joint = _joint2(TINY["tiny-v16"], prompt, T)
    target = Engine(files["v16"], pool=pool, max_context=64)
    draft = Engine(files["v16-trim"], pool=pool, max_context=64)
    assert set(draft.kept_ids) == {0, 2, 3, 4, 5, 6, 7, 9}
    assert joint.sum(1)[[1, 8, 11, 15]].min() > 0.04 and joint.sum(0)[[10, 14]].min() > 0.1   # never proposed
    forcing = P.Policy(costs_for_test(target, draft, c=0.01, slope=0.0), table(0.99, 0.0, 0.0, 0.99), 3)
    counts = np.zeros((16, 16))
    for seed in range(8000):
        kw = dict(gamma=(seed % 3) + 1) if mode == "fixed" else dict(policy=forcing)
        t = target.speculate(prompt, draft, max_new_tokens=2, temperature=T, seed=seed, **kw).tokens
        counts[t[0], t[1]] += 1
    stat, df = chi2(counts.ravel(), joint.ravel())
    assert stat < chi2_critical(df), (stat, df)


# ----------------------------------------------------------------------------
# The policy's decisions
# ----------------------------------------------------------------------------

def _plan(costs, rate=1.0, context=100):
    pol = P.Policy(costs, table(), 8).native()
    return native.lib().RoundPlan(pol, context, rate), pol


def test_a_guess_is_taken_while_it_pays_for_itself(files, pool):
    t = Engine(files["target"], pool=pool, max_context=64)
    plan, keep = _plan(costs_for_test(t, t, c=0.2, slope=0.05))
    assert plan.worth(0.26, True) and not plan.worth(0.24, True)       # 0.25 = c + v(2) - v(1)
    assert plan.worth(0.06, False) and not plan.worth(0.04, False)     # a lookup guess: only v's step
    plan.take(0.5, True)
    assert plan.g == 1 and plan.reach == pytest.approx(0.5) and plan.tokens == pytest.approx(1.5)
    assert not plan.worth(0.4, True)                                    # 0.5 * 0.4 < 0.25
    fast, keep2 = _plan(costs_for_test(t, t, c=0.2, slope=0.05), rate=2.0)
    assert not fast.worth(0.4, True)                                    # a run making 2 tokens a step wants 0.5


def test_costs_follow_the_context(files, pool):
    t = Engine(files["target"], pool=pool, max_context=64)
    c = costs_for_test(t, t)
    c.c = [0.1, 0.3]
    c.v[1] = [0.0] + [1 + 0.25 * (k - 1) for k in range(1, len(c.v[1]))]
    for ctx, want_c, want_v2 in ((10, 0.1, 1.05), (160, 0.2, 1.15), (999, 0.3, 1.25)):
        plan, keep = _plan(c, context=ctx)
        assert plan.c == pytest.approx(want_c) and plan.v[2] == pytest.approx(want_v2)


def test_the_round_loop_picks_lookup_draft_or_plain(files, pool):
    target = Engine(files["target"], pool=pool, max_context=512)
    draft = Engine(files["trim-q8"], pool=pool, max_context=512)
    p = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    plain = target.generate(p, 32).tokens
    costs = costs_for_test(target, draft, c=0.3)
    never = target.speculate(p, draft, policy=P.Policy(costs, table(0.0, 0.0, 0.0, 0.0), 6), max_new_tokens=32)
    assert set(never.kinds) == {"plain"} and never.tokens == plain
    drafts = target.speculate(p, draft, policy=P.Policy(costs, table(1.0, 0.0, 0.0, 1.0), 6), max_new_tokens=32)
    assert drafts.kinds[0] == "draft" and drafts.tokens == plain       # calibrated sure: rounds of max_gamma
    assert all(g == 6 for (g, _), k in zip(drafts.per_round[:-1], drafts.kinds) if k == "draft")
    looks = target.speculate(p, draft, policy=P.Policy(costs, table(0.1, 0.95, 0.95, 0.1), 6), max_new_tokens=32)
    assert looks.kinds[0] == "lookup" and looks.tokens == plain
    alone = target.speculate(p, None, policy=P.Policy(costs_for_test(target, None), table(0.0, 0.95, 0.95), 6),
                             max_new_tokens=32)
    assert "draft" not in alone.kinds and alone.kinds[0] == "lookup" and alone.tokens == plain


def test_isotonic_calibration_never_falls():
    y = np.array([0.1, 0.5, 0.3, 0.2, 0.9, 0.8])
    fit = P.isotonic(y, np.ones(6))
    assert (np.diff(fit) >= -1e-12).all()
    assert fit.mean() == pytest.approx(y.mean())
    assert P._binned(np.array([0.05, 0.05, 0.95]), np.array([1.0, 1.0, 0.0]), 4) == pytest.approx([0.5] * 4, abs=0.3)


# ----------------------------------------------------------------------------
# Calibration and cost files
# ----------------------------------------------------------------------------

def test_calibration_round_trips_and_refuses_other_models(files, pool, tmp_path):
    target = Engine(files["target"], pool=pool, max_context=512)
    draft = Engine(files["trim-q8"], pool=pool, max_context=512)
    samples = [(p, target.generate(p, 24).tokens) for p in prompts(TINY["tiny-qwen2"], 3, seed=5)]
    cal = P.calibrate(target, draft, samples, progress=False)
    assert set(cal.tables) == {"0.0", "0.7", "1.0"} and cal.tables["0.0"].positions == 72
    path = P.save_calibration(cal, target, draft)
    assert path.parent == draft.file.parent and path.exists()
    assert P.load_calibration(path, target, draft) == cal
    assert cal.table(0.8) == cal.tables["0.7"] and cal.table(0.0) == cal.tables["0.0"]
    other = Engine(files["full"], pool=pool, max_context=512)
    with pytest.raises(P.PolicyFileError, match=r"made for target .* this is target"):
        P.load_calibration(path, other, draft)
    path.write_text("{not json")
    with pytest.raises(P.PolicyFileError, match="not a calibration file"):
        P.load_calibration(path, target, draft)


def test_costs_from_another_machine_are_refused(files, pool, tmp_path):
    target = Engine(files["target"], pool=pool, max_context=512)
    c = costs_for_test(target, None)
    path = tmp_path / "costs.json"
    P._save(path, c)
    assert P.load_costs(path, target, None) == c
    c.machine = {**c.machine, "cpu": "Some Other CPU"}
    P._save(path, c)
    with pytest.raises(P.PolicyFileError, match="measured on .*Some Other CPU.* this is"):
        P.load_costs(path, target, None)


def test_measured_costs_are_cached_per_machine_and_pair(files, pool, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    target = Engine(files["target"], pool=pool, max_context=256)
    draft = Engine(files["trim-q4"], pool=pool, max_context=256)
    c = P.costs_for(target, draft, progress=False)
    assert c.contexts and len(c.v[0]) == 10 and c.v[0][1] == 1.0 and 0 < c.c[0]
    assert P.costs_path(target, draft).exists() and P.costs_for(target, draft, progress=False) == c
    again = c.model_copy(update={"o": c.o + 1.0})
    monkeypatch.setattr(P, "measure_costs", lambda *a, **k: again)
    assert P.costs_for(target, draft, progress=False) == c                  # the cache answers
    assert P.costs_for(target, draft, progress=False, fresh=True) == again  # --fresh-costs measures
    assert P.costs_for(target, draft, progress=False) == again              # ... and refreshes the cache


def test_a_cached_table_that_does_not_say_its_bandwidth_state_is_measured_again(files, pool, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    target = Engine(files["target"], pool=pool, max_context=256)
    c = P.costs_for(target, None, progress=False)
    assert len(c.step_ms) == len(c.contexts) and all(s > 0 for s in c.step_ms)
    P._save(P.costs_path(target, None), c.model_copy(update={"step_ms": []}))    # as tables were before
    again = c.model_copy(update={"o": c.o + 1.0})
    monkeypatch.setattr(P, "measure_costs", lambda *a, **k: again)
    assert P.costs_for(target, None, progress=False) == again


@pytest.mark.parametrize("ends_at, tables", [({32: 10.5, 64: 9.5}, 1), ({32: 15.0, 64: 15.0}, 2),
                                             ({32: 10.0, 64: 15.0}, 2)])
def test_a_table_measured_across_a_flip_is_measured_again(files, pool, monkeypatch, ends_at, tables):
    """The target's step at each context, taken again when the table is done, says whether the
    bus stayed in one state; when one moved by more than STATE_GAP the table is measured again."""
    target = Engine(files["target"], pool=pool, max_context=256)
    measured = []

    def costs_at(t, drafts, ctx, *a):
        measured.append(ctx)
        return [0.0] + [1.0] * 9, {}, 10.0
    monkeypatch.setattr(P, "costs_at", costs_at)
    monkeypatch.setattr(P, "step_ms", lambda t, ctx: ends_at[ctx])
    c = P.measure_costs(target, None, contexts=(32, 64), progress=False)
    assert measured == [32, 64] * tables and c.step_ms == [10.0, 10.0]


def test_costs_are_measured_again_for_another_engine_build_or_tuning(files, pool, monkeypatch):
    from lab import native, tune
    target = Engine(files["target"], pool=pool, max_context=256)
    here = P.costs_path(target, None)
    other = "bf16" if target.attention == "f32" else "f32"
    monkeypatch.setattr(target, "attention", other)          # other products run at other speeds
    assert P.costs_path(target, None) != here
    monkeypatch.undo()
    monkeypatch.setattr(native, "loaded_key", lambda: "another build")
    assert P.costs_path(target, None) != here
    monkeypatch.undo()
    before = tune.current()
    try:
        tune.apply({**before, "prefetch_k1": before["prefetch_k1"] + 4096})
        assert P.costs_path(target, None) != here
    finally:
        tune.apply(before)
    assert P.costs_path(target, None) == here


# ----------------------------------------------------------------------------
# The vocabulary ranking
# ----------------------------------------------------------------------------

def test_ranking_puts_frequent_then_low_ids_first():
    freq = vocab.counts([[5, 5, 5, 2], [2, 9]], 12)
    r = vocab.rank(freq, always=[11])
    assert r.tolist()[:4] == [11, 5, 2, 9] and r.tolist()[4:] == [0, 1, 3, 4, 6, 7, 8, 10]
    assert vocab.keep(r, 3) == [2, 5, 11]
    assert vocab.coverage([2, 5], [([9], [5, 9, 1, 2])]) == 0.75
    with pytest.raises(ValueError):
        vocab.keep(r, 0)


# ----------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------

class FakeRun:
    def __init__(self, tokens, tps):
        self.tokens, self.tokens_per_s = tokens, tps
        self.tokens_per_round, self.acceptance, self.rounds, self.prompt_tokens = 2.0, 0.5, 1, 4
        self.per_round, self.kinds = [(1, 1)], ["draft"]


class FakeTarget:
    """Plain runs at the speeds given in turn; speculative runs at 60 tokens/s."""

    def __init__(self, plain_speeds, spec_tokens=None, spec_speeds=None):
        self.speeds, self.spec_tokens, self.calls = list(plain_speeds), spec_tokens, []
        self.spec_speeds = list(spec_speeds or [])

    def generate(self, ids, n, **kw):
        self.calls.append("plain")
        return FakeRun([1, 2, 3], self.speeds.pop(0))

    def speculate(self, ids, d, **kw):
        self.calls.append("spec")
        return FakeRun(self.spec_tokens or [1, 2, 3], self.spec_speeds.pop(0) if self.spec_speeds else 60.0)


PROMPT = [{"id": 1, "group": "qa", "turns": ["a question"]}]


@pytest.fixture
def long_runs(monkeypatch):
    """The fakes return at once; these tests are about brackets long enough to run once."""
    monkeypatch.setattr(S, "SHORT", 0.0)


def test_bench_brackets_each_run_with_plain_runs(long_runs):
    t = FakeTarget([40.0, 40.0])
    res = S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2)], target_name="tiny-qwen2", progress=False)
    assert t.calls == ["plain", "spec", "plain"]
    assert res["rows"][0]["speedup"] == pytest.approx(1.5) and res["rows"][0]["tries"] == 1
    assert res["summary"][-1]["group"] == "overall" and res["summary"][-1]["speedup"] == pytest.approx(1.5)


def test_each_setting_is_paired_with_the_plain_runs_beside_it(long_runs):
    """Two settings: plain, setting 1, plain, setting 2, plain -- the bus slowing after the first
    setting moves the second's plain runs with it, not the first's speedup."""
    t = FakeTarget([40.0, 40.0, 36.0], spec_speeds=[60.0, 57.0])
    res = S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2), S.Setting("lookup", 4)],
                target_name="tiny-qwen2", progress=False)
    assert t.calls == ["plain", "spec", "plain", "spec", "plain"]
    first, second = res["rows"]
    assert first["speedup"] == pytest.approx(1.5) and first["plain_tokens_per_s"] == pytest.approx(40)
    assert second["speedup"] == pytest.approx(57 / 38) and second["plain_spread"] == pytest.approx(40 / 36 - 1)


def test_a_bandwidth_flip_reruns_the_bracket(long_runs):
    """Plain at 46 then 72 tokens/s around the speculative run: not a pair to trust."""
    t = FakeTarget([46.0, 72.0, 50.0, 50.0])
    res = S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2)], target_name="tiny-qwen2", progress=False)
    assert t.calls == ["plain", "spec", "plain"] * 2
    assert res["rows"][0]["tries"] == 2 and res["rows"][0]["speedup"] == pytest.approx(1.2)


def test_a_stall_in_a_short_bracket_does_not_decide_the_row():
    """A second-long run stalled once (20 tokens/s against 60): the median of three brackets."""
    t = FakeTarget([40.0, 40.0, 40.0, 35.0], spec_speeds=[60.0, 20.0, 60.0])
    res = S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2)], target_name="tiny-qwen2", progress=False)
    assert t.calls == ["plain"] + ["spec", "plain"] * S.REPEATS      # a repeat starts from the last plain run
    assert res["rows"][0]["tries"] == 3 and res["rows"][0]["speedup"] == pytest.approx(1.5)


def test_a_short_answer_behind_a_long_prompt_still_repeats(monkeypatch):
    """Whether a bracket is short is read off its generation, not its wall time: a long prompt's
    prefill (here a sleep in each plain run) must not hide a second-long answer's stall."""
    import time
    monkeypatch.setattr(S, "SHORT", 0.5)
    t = FakeTarget([40.0] * 4, spec_speeds=[60.0, 20.0, 60.0])
    slow_generate = t.generate
    monkeypatch.setattr(t, "generate", lambda *a, **kw: (time.sleep(0.3), slow_generate(*a, **kw))[1])
    res = S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2)], target_name="tiny-qwen2", progress=False)
    assert t.calls == ["plain"] + ["spec", "plain"] * S.REPEATS and res["rows"][0]["speedup"] == pytest.approx(1.5)


def test_a_long_answer_runs_once_however_fast_the_calls_return():
    """600 tokens at 40 tokens/s is 15 s of generation: one bracket, though the fakes return at once."""
    t = FakeTarget([40.0, 40.0])
    t.spec_tokens = list(range(600))
    t.generate = lambda ids, n, **kw: (t.calls.append("plain"), FakeRun(list(range(600)), t.speeds.pop(0)))[1]
    res = S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2)], target_name="tiny-qwen2", progress=False)
    assert t.calls == ["plain", "spec", "plain"] and res["rows"][0]["tries"] == 1


def test_bench_fails_loudly_when_speculation_differs(long_runs):
    t = FakeTarget([40.0, 40.0], spec_tokens=[1, 2, 4])
    with pytest.raises(S.SpeculationMismatch, match="differs from plain at token 2"):
        S.run(t, {"draft": None}, PROMPT, [S.Setting("lookup", 2)], target_name="tiny-qwen2", progress=False)


def test_multiturn_prompts_see_their_own_answers():
    conv = S.Conversation("tiny-qwen2")
    one = conv.ids(["ab"], [])
    two = conv.ids(["ab", "c"], [[7, 8]])
    assert two[:len(one)] == one and two[len(one):len(one) + 2] == [7, 8]


def test_lab_bench_speculative_runs_tiny_models(tmp_path):
    import os
    import subprocess
    import sys
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": t}) for i, (c, t) in
                           enumerate([("qa", ["1 2 3 1 2 3 1 2"]), ("writing", ["5 6 7", "again 5 6 7"])])))
    env = dict(os.environ, LAB_MODELS=str(tmp_path / "m"), LAB_CACHE=str(tmp_path / "c"))
    r = subprocess.run([sys.executable, "-m", "lab.cli", "bench", "speculative", "--model", "tiny-qwen2",
                        "--draft", "tiny-qwen2-draft", "--prompts", str(p), "--gamma", "1,3",
                        "--max-new-tokens", "10", "--json"], capture_output=True, text=True, env=env, timeout=600,
                       cwd=native.SOURCE_DIR.parent)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["rows"]) == 6 and {x["turn"] for x in res["rows"]} == {1, 2}
    assert all(x["equal_to_plain"] for x in res["rows"])
    assert {x["group"] for x in res["summary"]} == {"qa", "multiturn", "overall"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    r = subprocess.run([sys.executable, "-m", "lab.cli", "bench", "speculative", "--model", "tiny-qwen2",
                        "--draft", "lookup", "--prompts", str(bad), "--gamma", "2"], capture_output=True,
                       text=True, env=env, timeout=600, cwd=native.SOURCE_DIR.parent)
    assert r.returncode == 2 and "bad.jsonl:1: a prompt needs question_id, category and turns" in r.stderr


def test_prediction_counts_each_rounds_cost():
    """v(k) = 1 + 0.1 (k - 1), c = 0.2, o = 0: a draft round of 2 guesses all accepted (the
    draft then lacks 2 tokens), a lookup round of 3 with 1 accepted (it lacks 4), a draft
    round of 1 (catching up 4 tokens costs c · v(4))."""
    v = [0.0] + [1 + 0.1 * (k - 1) for k in range(1, 12)]
    costs = P.Costs(machine={}, target="t", draft="d", contexts=[256], v=[v], c=[0.2], o=0.0, o_sampled=0.0)
    run = FakeRun([0] * 6, 1.0)
    run.per_round, run.kinds, run.rounds = [(2, 2), (3, 1), (1, 0)], ["draft", "lookup", "draft"], 3
    want = 6 / ((1.2 + 0.2 * 2) + 1.3 + (1.1 + 0.2 * 1.3))
    assert S.predicted(run, costs) == pytest.approx(want)


def test_costs_between_measured_contexts_are_interpolated():
    costs = P.Costs(machine={}, target="t", draft="d", contexts=[128, 512, 2048],
                    v=[[0, 1, 1.1], [0, 1, 1.2], [0, 1, 1.6]], c=[0.2, 0.3, 0.4], o=0.0, o_sampled=0.0)
    assert costs.at(1280) == ({1: 1.0, 2: pytest.approx(1.4)}, pytest.approx(0.35))   # halfway 512..2048
    assert costs.at(64) == ({1: 1.0, 2: 1.1}, 0.2) and costs.at(9000) == ({1: 1.0, 2: 1.6}, 0.4)


def test_a_long_catch_up_is_priced_past_the_measured_k():
    from lab.speculative import _pass
    v = {k: 1 + 0.1 * (k - 1) for k in range(1, 10)}            # measured to k = 9
    assert _pass(v, 5) == pytest.approx(1.4)
    assert _pass(v, 12) == pytest.approx(2.1)                     # the slope carries on past 9
    assert _pass(v, 40) == pytest.approx(2 * 2.5 + 1.7)           # chunks of MAX_K = 16: 16 + 16 + 8


def state_table(step_ms: float, c: float = 0.2) -> dict:
    """One draft's costs, measured while the target's step took step_ms at every context."""
    v = [0.0] + [1 + 0.1 * (k - 1) for k in range(1, 12)]
    return {"draft": P.Costs(machine={}, target="t", draft="d", contexts=[256], v=[v], c=[c], o=0.0,
                             o_sampled=0.0, step_ms=[step_ms])}


def test_each_bracket_is_priced_with_costs_from_its_bandwidth_state():
    measured = []

    def measure():
        measured.append(15.0)
        return state_table(15.0, c=0.3)
    states = S.CostStates(state_table(10.0), measure)
    assert states.pick(10.5, 256) == 0 and not measured           # within STATE_GAP of the first table
    assert states.pick(14.0, 256) == 1 and measured == [15.0]     # another state: measured there and then
    assert states.pick(15.5, 256) == 1 and states.pick(9.8, 256) == 0 and len(measured) == 1
    assert states.costs(1, "draft").c == [0.3] and states.costs(0, "stock").c == [0.2]   # any name: the table's
    flipped = S.CostStates(state_table(10.0), lambda: state_table(15.0))
    assert flipped.pick(14.0, 256) == 1 and flipped.pick(20.0, 256) == 1   # measured, but 20 matches none
    back = S.CostStates(state_table(10.0), lambda: state_table(30.0))       # the bus flipped back meanwhile
    assert back.pick(13.0, 256) == 0 and len(back.tables) == 2


def test_tables_are_not_measured_without_end():
    """Plain runs that match no table however often it is measured stop at MAX_TABLES; a table
    that does not say its state, or no way to measure, keeps the first."""
    states = S.CostStates(state_table(10.0), lambda: state_table(10.0))
    for _ in range(10):
        states.pick(30.0, 256)
    assert len(states.tables) == S.MAX_TABLES
    assert S.CostStates(state_table(10.0)).pick(30.0, 256) == 0
    old = {"draft": state_table(10.0)["draft"].model_copy(update={"step_ms": []})}
    assert S.CostStates(old, lambda: pytest.fail("measured")).pick(30.0, 256) == 0
    assert S.CostStates({}).pick(30.0, 256) == -1 and S.CostStates({}).costs(-1, "draft") is None


def test_the_bench_rows_name_the_table_their_predictions_used(long_runs):
    """Plain runs at 100 tokens/s (10 ms a token), then at 50 (20 ms): the second prompt's
    prediction comes from a table measured in its state, and both tables are in the result."""
    prompts = [{"id": 1, "group": "qa", "turns": ["a question"]}, {"id": 2, "group": "qa", "turns": ["another"]}]
    t = FakeTarget([100.0, 100.0, 50.0, 50.0])
    res = S.run(t, {"draft": None}, prompts, [S.Setting("lookup", 2)], costs=state_table(10.0),
                target_name="tiny-qwen2", progress=False, measure_costs=lambda: state_table(20.0))
    assert [r["costs_table"] for r in res["rows"]] == [0, 1]
    assert [tb["draft"]["step_ms"] for tb in res["cost_tables"]] == [[10.0], [20.0]]


def test_the_automatic_policy_plans_with_the_costs_of_its_brackets_state(long_runs):
    """The second prompt's plain runs are twice as slow: its automatic run plans with the table
    measured in that state, the first prompt's with the cached one."""
    prompts = [{"id": 1, "group": "qa", "turns": ["a question"]}, {"id": 2, "group": "qa", "turns": ["another"]}]
    t = FakeTarget([100.0, 100.0, 50.0, 50.0])
    planned = []
    t.speculate = lambda ids, d, policy, **kw: planned.append(policy.costs.c) or FakeRun([1, 2, 3], 60.0)
    pol = P.Policy(state_table(10.0)["draft"], table=None)      # the fake target never reads it
    S.run(t, {"draft": None}, prompts, [S.Setting("auto")], costs=state_table(10.0), policies={"draft": pol},
          target_name="tiny-qwen2", progress=False, measure_costs=lambda: state_table(20.0, c=0.3))
    assert planned == [[0.2], [0.3]]


def test_each_draft_is_priced_with_its_own_costs_state():
    """A table's two drafts were measured minutes apart, across a flip: a bracket takes the
    table whose costs for its own draft match its plain runs."""
    def two(a_ms, b_ms):
        return {"a": state_table(a_ms, c=0.2)["draft"], "b": state_table(b_ms, c=0.3)["draft"]}
    states = S.CostStates(two(10.0, 20.0), lambda: two(20.0, 10.0))
    assert states.pick(20.0, 256, "a") == 1 and len(states.tables) == 2     # a's first costs: another state
    assert states.pick(20.0, 256, "b") == 0 and states.pick(10.0, 256, "b") == 1
    assert states.pick(10.0, 256, "lookup") == 0                           # no costs of its own: the first's
