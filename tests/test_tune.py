"""Tuning by measurement: whatever the tuner picks, every kernel gives the defaults' bits; the
cache round-trips, keyed by CPU, path and sources; a stale or foreign cache is ignored with a
note; LAB_TUNE=0 keeps the defaults; tune() finishes and picks from its candidates."""
import json
import re

import numpy as np
import pytest

from lab import cli, kernels, native, protocol, tune, tune_ab
from lab.kernel_bench import L2_SHAPE

from .conftest import simd_paths


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture
def restore():
    """Puts back the values and the record of where they came from after a test."""
    before, state = tune.current(), dict(tune._state)
    yield
    tune.apply(before)
    tune._state.update(state)


@pytest.fixture(autouse=True)
def small_cache(monkeypatch):
    """The tuner's working sets cycle past a last-level cache of 4 MB here, whatever this CPU's
    is: the cycling is tested, and a test need not fill twice a big L3."""
    monkeypatch.setattr(protocol, "llc_bytes", lambda: 4 << 20)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("LAB_TUNE", raising=False)
    tune._noted.clear()
    return tmp_path


def every_choice():
    """Each value the tuner can pick, one stage at a time, and every stage's extreme at once."""
    stages = tune.candidates()
    out = [sets for cands in stages.values() for sets in cands.values()]
    for pick in (min, max):
        combo = {}
        for cands in stages.values():
            combo.update(cands[pick(cands, key=lambda n: tuple(cands[n].values()))])
        out.append(combo)
    return out


def setting(key):
    """The setting a faked timing is for: its name, or a _by_code key's, (setting, token count)."""
    return key[0] if isinstance(key, tuple) else key


@pytest.mark.parametrize("path", simd_paths())
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_every_choice_keeps_every_bit(fmt, path, restore):
    rng = np.random.default_rng(7)
    # 2-4 MB: the split thresholds among the candidates put it in static halves or guided shares,
    # and "auto" takes redo's pieces or the guided split as redo_split says
    W = kernels.pack(kernels.quantize((rng.standard_normal((3600, 1024)) * 0.1).astype(np.float32), fmt))
    x = (rng.standard_normal((16, 1024)) * 3).astype(np.float32)
    pool = kernels.Pool(min(2, len(__import__("os").sched_getaffinity(0))))
    tune.apply(tune.defaults())
    want = [kernels.matmul(W, x[:k], path=path, pool=pool, chunk="guided") for k in range(1, 17)]
    for sets in every_choice():
        tune.apply({**tune.defaults(), **sets})
        for k in range(1, 17):
            got = kernels.matmul(W, x[:k], path=path, pool=pool, chunk="auto")
            assert np.array_equal(bits(got), bits(want[k - 1])), (sets, k)


def test_out_of_range_values_are_refused(restore):
    for field in ("prefetch_k1", "prefetch_k1_q8"):
        with pytest.raises(ValueError, match="out of range"):
            tune.apply({field: -64})
    assert tune.stream_counts() == (1, 2, 4)
    for streams in (0, 3, 8):       # the kernels read a share in 1, 2 or 4 streams
        with pytest.raises(ValueError, match="out of range"):
            tune.apply({"q4_streams": streams})
    with pytest.raises(ValueError, match="unknown"):
        tune.apply({"prefetch": 4096})
    assert tune.current() == tune.defaults()


def record(**over):
    values = {**tune.defaults(), "prefetch_k1": 4096, "guided_from_bytes": 2 << 20}
    return {"format": tune.CACHE_FORMAT, **tune.key(), "date": "2026-12-01T07:00", "values": values, **over}


def test_cache_round_trip(cache, restore):
    rec = record(read_gbps={"before": 78.4, "after": 44.1}, round_trip_ns={"before": 341.0, "after": 58.2})
    f = tune.save(rec)
    assert f.parent == cache / "native" / native.loaded_key() and json.loads(f.read_text()) == rec
    other = tune.save(record(sources="0" * 20))            # another build's tuning, kept beside it
    assert other != f and json.loads(f.read_text()) == rec
    assert tune.load() == rec
    tune.on_load(native.lib())
    assert tune.current() == rec["values"]
    d = tune.describe()
    assert d["source"] == "tuned at 2026-12-01T07:00" and d["file"] == str(f)
    assert any("prefetch_k1" in ln and "(default" in ln for ln in tune.lines(d))
    assert any("78.4 GB/s before, 44.1 after" in ln for ln in tune.lines(d))    # the state it was tuned in
    assert any("341 ns before, 58 after" in ln for ln in tune.lines(d))         # and where the threads sat
    assert any("moved from 78.4 to 44.1 GB/s" in ln for ln in tune.lines(d))    # a state it may not suit


@pytest.mark.parametrize("field, value, says", [("cpu", "Another CPU(R)", "another CPU"),
                                                ("path", "no-such-path", "another kernel path"),
                                                ("sources", "0" * 20, "another build"),
                                                ("format", 0, "another version")])
def test_stale_or_foreign_cache_is_ignored_with_a_note(cache, restore, capsys, field, value, says):
    rec = record(**{field: value})
    tune.cache_file(tune.key()).parent.mkdir(parents=True)
    tune.cache_file(tune.key()).write_text(json.dumps(rec))
    tune.apply(tune.defaults())
    assert tune.load() is None
    tune.on_load(native.lib())
    assert tune.current() == tune.defaults()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ignoring" in err[0] and says in err[0]


def test_unreadable_cache_is_ignored_with_a_note(cache, capsys):
    f = tune.cache_file(tune.key())
    f.parent.mkdir(parents=True)
    f.write_text("{not json")
    assert tune.load() is None
    assert "unreadable" in capsys.readouterr().err


def test_lab_tune_0_keeps_the_defaults_and_never_measures(cache, restore, monkeypatch):
    tune.save(record())
    monkeypatch.setenv("LAB_TUNE", "0")
    tune.apply(tune.defaults())
    tune.on_load(native.lib())
    assert tune.current() == tune.defaults() and tune.describe()["source"] == "LAB_TUNE=0"
    monkeypatch.setattr(tune, "tune", lambda **kw: pytest.fail("measured under LAB_TUNE=0"))
    tune.ensure()
    assert tune.current() == tune.defaults()


def test_first_use_measures_once_and_caches(cache, restore, monkeypatch):
    calls = []
    monkeypatch.setattr(tune, "tune", lambda **kw: calls.append(kw) or record())
    tune._state.update(source="default", file=None, tried=False)
    tune.ensure(progress=False)
    tune.ensure(progress=False)
    assert len(calls) == 1 and tune.current() == record()["values"]
    assert tune.load() == record()


def test_a_tuning_measured_across_a_change_of_bus_state_says_so(cache, restore, monkeypatch, capsys):
    moved = record(read_gbps={"before": 29.2, "after": 16.5}, seconds=50.0, threads=2, mb=64, measured={},
                   chosen={}, confirmed={})
    assert "29.2 to 16.5 GB/s" in tune.unsteady(moved) and "lab tune" in tune.unsteady(moved)
    assert tune.unsteady(record(read_gbps={"before": 29.2, "after": 30.1})) is None
    assert tune.unsteady(record()) is None
    monkeypatch.setattr(tune, "tune", lambda **kw: moved)
    tune._state.update(source="default", file=None, tried=False)
    tune.ensure(progress=False)                         # nothing cached: the first use measures
    assert "lab: note: the read ceiling moved from 29.2 to 16.5 GB/s" in capsys.readouterr().err
    assert cli.main(["tune"]) == 0
    assert "lab: note: the read ceiling moved from 29.2 to 16.5 GB/s" in capsys.readouterr().err


def test_lab_tune_says_how_many_rounds_each_head_to_head_took(cache, restore, monkeypatch, capsys):
    """A head to head timed twice says 20 rounds; a record from before that rule has its stages' rounds."""
    confirmed = {"q4_single_k1": [{"candidate": "false", "ratio": 0.968, "iqr": 0.09, "rounds": 20}],
                 "prefetch_k1": [{"candidate": "2048", "ratio": 0.8, "iqr": 0.04}]}
    rec = record(seconds=50.0, threads=2, mb=64, rounds=10, measured={}, chosen={}, confirmed=confirmed)
    monkeypatch.setattr(tune, "tune", lambda **kw: rec)
    assert cli.main(["tune"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"q4_single_k1 +false +0\.968 +0\.090 +\(timed again against the default, 20 rounds\)", out)
    assert re.search(r"prefetch_k1 +2048 +0\.800 +0\.040 +\(timed again against the default, 10 rounds\)", out)


def test_info_shows_the_values_and_their_source(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "tuning" in out and all(f in out for f in tune.FIELDS)
    assert "last level 4 MB" in out and "cycles through 8 MB" in out      # the small_cache fixture's


@pytest.mark.slow
def test_tune_on_a_small_working_set_picks_from_the_candidates(restore, capsys):
    before = tune.current()
    r = tune.tune(progress=True, mb=8, rounds=2, reps=1)
    bars = re.findall(r"(\d+)/(\d+) \[", capsys.readouterr().err)
    (done, total), first = map(int, bars[-1]), int(bars[0][1])
    again = [s for s in r["measured"] if tune.stage_of(s) != s]
    assert done == total == first + sum(tune._bar_rounds(tune.stage_of(s), c["rounds"], r["threads"])
                                        for s, tried in r["confirmed"].items() for c in tried) \
        + sum(tune._bar_rounds(tune.stage_of(s), 2, r["threads"]) for s in again)   # known up front
    assert tune.current() == before                       # measuring changes nothing in force
    stages = tune.candidates()
    assert {tune.stage_of(s) for s in r["chosen"]} <= set(stages)
    assert set(again) <= {f"{s} {tune.AGAIN}" for s in tune.SECOND_LOOK}
    for look, label in r["chosen"].items():
        stage = tune.stage_of(look)
        assert label in stages[stage] and set(r["measured"][look]) == set(stages[stage])
    last = {tune.stage_of(look): label for look, label in r["chosen"].items()}      # a second look's counts
    for stage, label in last.items():
        assert all(r["values"][f] == v for f, v in stages[stage][label].items())
    assert set(r["values"]) == set(tune.FIELDS) and r["seconds"] < 60
    assert all(1 < r["read_gbps"][w] < 10_000 for w in ("before", "after"))
    assert all((0 < r["round_trip_ns"][w] < 1e6) if r["threads"] > 1 else r["round_trip_ns"][w] is None
               for w in ("before", "after"))
    assert {k: r[k] for k in ("cpu", "path", "sources")} == tune.key()


@pytest.mark.parametrize("wins_again", [False, True])
def test_a_winner_is_kept_only_if_it_wins_again_head_to_head(restore, monkeypatch, wins_again):
    seen = []

    def times(stage, cands, b, base, rounds, bar):     # a candidate 10% faster, then maybe not
        default = tune._label(cands, base)
        other = max(n for n in cands if n != default)
        fast = stage not in seen or wins_again
        seen.append(stage)
        return {n: [0.9 if n == other and fast else 1.0] * rounds for n in cands}
    monkeypatch.setattr(tune, "_times", times)
    monkeypatch.setattr(tune, "SECOND_LOOK", ())    # one look a stage
    r = tune.tune(progress=False, mb=1, rounds=3)
    assert set(r["confirmed"]) == set(r["chosen"])
    for stage, label in r["chosen"].items():
        default = tune._label(tune.candidates()[stage], tune.defaults())
        [tried] = r["confirmed"][stage]                 # the only candidate that was faster
        assert tried["candidate"] != default
        assert label == (tried["candidate"] if wins_again else default)


def test_the_runner_up_is_timed_when_the_best_fails_head_to_head(restore, monkeypatch):
    """The best candidate 15% faster at first but not head to head, the runner-up 10% faster
    both times: the runner-up is kept; a third, 5% faster, is never timed again."""
    order = {}

    def times(stage, cands, b, base, rounds, bar):
        default = tune._label(cands, base)
        if stage not in order:                          # the first timing, of every candidate
            order[stage] = sorted(n for n in cands if n != default)
            ratio = dict(zip(order[stage], (0.85, 0.9, 0.95)))
        else:                                           # head to head: only the runner-up still wins
            ratio = {order[stage][1]: 0.9} if len(order[stage]) > 1 else {}
        return {n: [ratio.get(n, 1.0)] * rounds for n in cands}
    monkeypatch.setattr(tune, "_times", times)
    monkeypatch.setattr(tune, "SECOND_LOOK", ())    # one look a stage
    r = tune.tune(progress=False, mb=1, rounds=3)
    assert set(r["confirmed"]) == set(order) == set(r["measured"])
    for stage, ranked in order.items():
        assert [t["candidate"] for t in r["confirmed"][stage]] == ranked[:2]
        if len(ranked) > 1:
            assert r["chosen"][stage] == ranked[1]
        else:
            assert r["chosen"][stage] not in ranked


def test_a_noisy_winner_is_timed_again_and_kept_if_it_wins_clearly(restore, monkeypatch):
    """6% faster in the median but slower in 4 rounds of 12 at first (a bus shared with
    other work), then faster in every round head to head: kept. One only 1% faster: not timed again."""
    timings = []

    def times(stage, cands, b, base, rounds, bar):
        default = tune._label(cands, base)
        others = sorted(n for n in cands if n != default)
        again = stage in [s for s, _ in timings]
        timings.append((stage, len(cands)))
        if again:                                   # the head-to-head timing
            return {n: [1.0] * rounds if n == default else [0.94] * rounds for n in cands}
        noisy = [0.9] * 8 + [1.05] * 4
        return {n: [1.0] * 12 if n == default else noisy if n == others[0] else [0.99] * 12 for n in cands}
    monkeypatch.setattr(tune, "_times", times)
    monkeypatch.setattr(tune, "SECOND_LOOK", ())    # one look a stage
    r = tune.tune(progress=False, mb=1, rounds=12)
    for stage, label in r["chosen"].items():
        cands = tune.candidates()[stage]
        noisy = sorted(n for n in cands if n != tune._label(cands, tune.defaults()))[0]
        assert r["measured"][stage][noisy]["ratio"] == pytest.approx(0.9)
        assert label == noisy and [t["candidate"] for t in r["confirmed"][stage]] == [noisy]
    assert len(timings) == 2 * len(r["chosen"]) and all(n == 2 for _, n in timings[1::2])
    assert tune._nominee({"a": {"ratio": 1.0}, "b": {"ratio": 0.99}}, "a") == "a"


@pytest.mark.parametrize("then, kept", [(0.9, True), (1.05, False)])
def test_a_nominee_that_wins_head_to_head_on_the_median_only_is_timed_as_long_again(restore, monkeypatch,
                                                                                   then, kept):
    """10% faster at first; head to head 2.5% faster in the median but slower in 2 rounds of 4; then
    faster in every round (kept: judged on all 8) or slower in every round (not kept). A nominee
    that loses head to head on the median is not timed a third time."""
    timings = []

    def times(stage, cands, b, base, rounds, bar):
        default = tune._label(cands, base)
        other = max(n for n in cands if n != default)
        timings.append(stage)
        ratio = {1: [0.9] * 4, 2: [0.9, 0.9, 1.05, 1.05]}.get(timings.count(stage), [then] * 4)
        return {n: ratio if n == other else [1.0] * 4 for n in cands}
    monkeypatch.setattr(tune, "_times", times)
    monkeypatch.setattr(tune, "SECOND_LOOK", ())    # one look a stage
    r = tune.tune(progress=False, mb=1, rounds=4)
    for stage, label in r["chosen"].items():
        default = tune._label(tune.candidates()[stage], tune.defaults())
        [tried] = r["confirmed"][stage]
        assert tried["rounds"] == 8 and timings.count(stage) == 3
        assert label == (tried["candidate"] if kept else default)
    assert len(r["confirmed"]) > 10


def test_the_stream_counts_are_judged_again_under_the_schemes_chosen_after_them(restore, monkeypatch):
    """Four 4-bit streams win under the default one-token scheme; once the k >= 2 scheme has won for
    one token, one stream wins: the second look keeps one, and both looks are in the record."""
    bases = []

    def times(stage, cands, b, base, rounds, bar):
        faster = {}
        if stage == "q4_streams":
            bases.append(dict(base))
            faster = {"1": 0.9} if not base["q4_single_k1"] else {"4": 0.9}
        elif stage == "q4_single_k1":
            faster = {"false": 0.9}
        return {n: [faster.get(n, 1.0)] * rounds for n in cands}
    monkeypatch.setattr(tune, "_times", times)
    r = tune.tune(progress=False, mb=1, rounds=3)
    again = f"q4_streams {tune.AGAIN}"
    assert r["chosen"]["q4_streams"] == "4" and r["chosen"][again] == "1" and r["values"]["q4_streams"] == 1
    assert set(r["measured"][again]) == set(tune.candidates()["q4_streams"])
    assert f"q8_streams {tune.AGAIN}" not in r["measured"]      # nothing its one token runs had moved
    # each look timed all counts, then its winner head to head: the second under the k >= 2 scheme,
    # against the first look's count
    assert [(b["q4_single_k1"], b["q4_streams"]) for b in bases] == [(True, 1)] * 2 + [(False, 4)] * 2
    assert tune.stage_of(again) == "q4_streams" and tune.stage_of("q4_streams") == "q4_streams"


def test_each_round_reverses_the_order_the_candidates_run_in():
    calls = []
    cands = {n: (lambda n=n: calls.append(n) or [1.0]) for n in ("a", "b", "c")}
    bar = type("Bar", (), {"update": lambda self: None})()
    assert tune._per_round(cands, 3, bar) == {n: [1.0] * 3 for n in cands}
    assert "".join(calls) == "abccbaabc"


def test_loading_the_library_applies_the_cache_without_the_suite_s_lab_tune_0():
    """The suite runs with LAB_TUNE=0; a process without it loads the library, reads its
    cache key and applies any cache, measuring nothing."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "LAB_TUNE"}
    out = subprocess.run([sys.executable, "-c", "from lab import native, tune; native.lib(); print(tune.describe()['source'])"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(("default", "tuned at"))


@pytest.mark.parametrize("fragile_where", ["co-runner", "slowed"])
def test_the_split_chosen_holds_up_with_a_slow_core(monkeypatch, fragile_where):
    """A threshold 10% faster on quiet cores but 30% slower beside a co-runner, or with the last
    worker slowed, loses to one 3% faster under all three; both act on the pool's last CPU."""
    cands = tune.candidates()["guided_from_bytes"]
    base = tune.defaults()
    default = tune._label(cands, base)
    fragile, steady = [n for n in cands if n != default][:2]
    state = {"where": None}

    class FakeSlowCore:
        def __init__(self, cpu, duty):
            state["cpu"], state["duty"] = cpu, duty

        def __enter__(self):
            state["where"] = "co-runner"

        def __exit__(self, *exc):
            state["where"] = None

    class FakePool:
        cpus = [0, 5]

        def slow(self, cpu, factor):
            state["where"] = "slowed" if factor > 1 else None
            state["slowed"] = (cpu, max(factor, state.get("slowed", (0, 0))[1]))

    def threshold_times(b, base, cands, rounds, bar):
        t = {fragile: 1.3 if state["where"] == fragile_where else 0.9, steady: 0.97}
        return {n: [t.get(n, 1.0)] * rounds for n in cands}

    monkeypatch.setattr(tune, "SlowCore", FakeSlowCore)
    monkeypatch.setattr(tune, "_threshold_times", threshold_times)
    b = type("B", (), {"pool": FakePool()})()
    bar = type("Bar", (), {"total": 0})()
    times = tune._held_up(tune._threshold_times, b, base, cands, 4, bar)
    assert state["cpu"] == 5 and state["duty"] == tune.SLOW_DUTY
    assert state["slowed"] == (5, tune.SLOW_FACTOR) and state["where"] is None     # and back to full speed
    assert tune._bar_rounds("guided_from_bytes", 4) == 12          # the bar counts all three timings up front
    assert set(tune.SPLIT_TIMERS) == {"redo_split", "guided_from_bytes", "guided_min_bytes"}   # each judged so
    assert tune._pick(times, default)[0] == steady


# ----------------------------------------------------------------------------
# lab tune --ab: the cached tuning against the defaults on whole passes
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from lab.engine import Engine
    from lab.models import TINY, tiny_weights
    from lab.models import export as ex
    c = TINY["tiny-qwen2"]
    f = ex.export(c, tiny_weights(c, seed=1), tmp_path_factory.mktemp("ab") / "t.lab", "q4-q8out")
    return Engine(f, pool=kernels.Pool(1), max_context=256)


def test_ab_times_every_figure_under_both_values_and_puts_them_back(tiny_engine, restore):
    tuned = {**tune.defaults(), "prefetch_k1": 4096}
    tune.apply({**tune.defaults(), "prefetch_l2_k": 32768})      # in force before: must be so after
    before = tune.current()
    seen = []
    real = tune.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune, "apply", lambda v, ns=None: (seen.append(dict(v)), real(v, ns))[1])
        r = tune_ab.ab(tiny_engine, [32, 64], [1, 3], tuned, rounds=3, reps=1, progress=False)
    assert tune.current() == before
    assert r["changed"] == {"prefetch_k1": [tune.defaults()["prefetch_k1"], 4096]}
    assert [(x["context"], x["k"]) for x in r["results"]] == [(32, 1), (32, 3), (64, 1), (64, 3)]
    for x in r["results"]:
        assert x["default_ms"] > 0 and x["tuned_ms"] > 0 and x["q1"] <= x["ratio"] <= x["q3"]
        assert x["same_code"] == (not tune.moves(tune.defaults(), tuned, x["k"])) and (x["k"] > 1 or not x["same_code"])
        assert len(x["ratios"]) == 3 and x["slower"] == (not x["same_code"] and tune_ab.slower(x["ratios"]))
        assert x["undecided"] == (not x["same_code"] and tune_ab.undecided(x["ratios"]))
        assert x["v_default"] > 0 and x["v_tuned"] > 0 and (x["k"] > 1 or x["v_default"] == x["v_tuned"] == 1.0)
    # A B B A: each round's pair alternates which goes first, so neither always runs second
    order = ["tuned" if v == tuned else "default" for v in seen[:6]]
    assert order == ["default", "tuned", "tuned", "default", "default", "tuned"]
    assert len(seen) == 4 * 3 * 2 + 1           # two passes a round, and the values put back
    assert r["slower"] == [{"context": x["context"], "k": x["k"]} for x in r["results"] if x["slower"]]
    assert r["undecided"] == [{"context": x["context"], "k": x["k"]} for x in r["results"] if x["undecided"]]


def test_moves_says_which_passes_a_change_can_touch():
    d = {**tune.defaults(), "q4_single_k2": False, "q8_single_k2": True, "q4_single_k3": False, "q8_single_k3": False}
    cases = {   # changed fields -> the token counts whose kernels they touch, of 1, 2, 3, 4, 8
        (("prefetch_k1_q8", 4096),): {1, 2},                     # 8-bit takes the single-token scheme at 2
        (("prefetch_k1", 4096),): {1},
        (("q4_single_k1", False),): {1},                          # one 4-bit token takes the k >= 2 scheme
        (("q4_single_k1", False), ("prefetch_l1_k", 2048)): {1, 2, 3, 4, 8},
        (("q4_single_k1", False), ("prefetch_k1", 4096)): {1},   # one tuning still runs it at one token
        (("prefetch_l2_k", 32768),): {2, 3, 4, 8},               # 4-bit at 2 is multi-token
        (("prefetch_l1_k_q8", 4096),): {3, 4, 8},                # 8-bit at 2 is single-token here
        (("q8_mem_acc_k2", False),): {2},
        (("q4_single_k3", True),): {3},
        (("q8_streams", 4),): {1, 2, 3, 4, 8},                   # a stream count moves every token count
        (("guided_from_bytes", 1 << 20),): {1, 2, 3, 4, 8},
        (("att_split_k", 8),): {8},                              # attention's tasks from 8 tokens
        (("att_kv_l2_k", 2),): {2, 3, 4, 8},                     # attention's requests from 2 tokens
        (("att_kv_l2_k", 1),): {1, 2, 3, 4, 8},                  # and from one
        (("streams_k9", 2),): set(),                             # nine tokens and more only
        (("streams_k5", 2),): {8},                               # five to eight tokens only
        (("streams_k2", 4),): {2, 3, 4},                         # two to four tokens only
        (("two_groups_k", 8),): {8},                             # eight tokens in two groups, not one
        (("two_groups_k", 6),): {8},                             # and from six (none of the others)
        (("two_groups_k", 13),): set(),                          # 9 to 12 tokens in one group

        (): set(),
    }
    for changes, ks in cases.items():
        b = {**d, **dict(changes)}
        assert {k for k in (1, 2, 3, 4, 8) if tune.moves(d, b, k)} == ks, changes
        assert all(tune.moves(d, b, k) == tune.moves(b, d, k) for k in (1, 2, 3, 4, 8))


@pytest.mark.parametrize("ratios, says", [
    ([1.05] * 9 + [0.99], True),             # slower in 9 rounds of 10: p = 0.011
    ([1.05] * 8 + [0.99] * 2, False),        # 8 of 10 is p = 0.055: could be chance
    ([1.04, 1.03], False),                   # two rounds can never say it (read so on the same code)
    ([1.01] * 10, False),                    # always slower, but by less than SLOWER
    ([0.97] * 10, False),
])
def test_slower_means_clearly_and_consistently_slower(ratios, says):
    assert tune_ab.slower(ratios) is says


@pytest.mark.parametrize("ratios, says", [
    ([1.07, 1.04, 1.09, 1.10, 0.99, 1.06], True),   # slower by its median, 5 rounds of 6: p = 0.11
    ([1.05] * 9 + [0.99], False),                    # shown slower: decided
    ([1.01] * 10, False),                            # by less than SLOWER: not slower
    ([0.97, 1.03, 0.96], False),
])
def test_undecided_is_slower_by_the_median_in_too_few_rounds(ratios, says):
    assert tune_ab.undecided(ratios) is says


def test_ab_without_a_tuning_says_to_tune_first(cache, capsys):
    assert cli.main(["tune", "--ab", "--model", "tiny-qwen2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run `lab tune` first" in err[0]


@pytest.mark.parametrize("slow, unsure", [(False, False), (True, False), (False, True)])
def test_ab_exit_status_says_whether_any_figure_is_slower(cache, restore, capsys, monkeypatch, tmp_path, slow, unsure):
    """Slower exits 1; slower by the median in too few rounds exits 0 but says so, never "not slower"."""
    monkeypatch.setenv("LAB_MODELS", str(tmp_path))
    tune.save(record())
    def fake(e, contexts, ks, tuned, rounds, progress):
        rows = [{"context": c, "k": k, "default_ms": 1.0, "tuned_ms": 1.0, "ratio": 1.0, "q1": 1.0, "q3": 1.0,
                 "ratios": [1.0], "slower": slow and k == 2, "undecided": unsure and k == 2}
                for c in contexts for k in ks]
        return {"changed": {}, "rounds": rounds, "reps": 3, "results": rows,
                "slower": [{"context": x["context"], "k": x["k"]} for x in rows if x["slower"]],
                "undecided": [{"context": x["context"], "k": x["k"]} for x in rows if x["undecided"]]}
    monkeypatch.setattr(tune_ab, "ab", fake)
    rc = cli.main(["tune", "--ab", "--model", "tiny-qwen2", "--context", "32", "--k", "1,2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert rc == (1 if slow else 0)
    if slow:
        assert "slower: context 32 k 2" in out
    elif unsure:
        assert "context 32 k 2 read slower in too few of 1 rounds to tell" in out and "not slower on any" not in out
        assert "slower in too few rounds to tell" in out.splitlines()[-2]       # the figure's own row
    else:
        assert "not slower on any figure" in out


@pytest.mark.parametrize("stage", ["prefetch_k1", "q4_single_k1"])
def test_the_single_token_stages_hold_up_on_one_thread_too(restore, monkeypatch, stage):
    """A distance, or the one-token scheme itself, 5% faster on every thread but 10% slower on
    one (a core's own memory parallelism binding) loses to the default; the bar counts both timings."""
    cands = tune.candidates()[stage]
    default = tune._label(cands, tune.defaults())
    other = next(n for n in cands if n != default)
    b = tune._Bench(1, 1, 2)
    if b.pool.threads == 1:
        pytest.skip("one CPU: there is no second timing")
    calls = []

    def per_round(fns, rounds, bar):
        one = b.matmul_pool is b.one
        calls.append(one)
        return {n: [(1.1 if one else 0.95) if setting(n) == other else 1.0] * rounds for n in fns}
    monkeypatch.setattr(tune, "_per_round", per_round)
    one_token = {**tune.defaults(), **{f"q4_single_k{k}": False for k in tune.SINGLE_K if k > 1}}   # at k = 1 only
    times = tune._times(stage, cands, b, one_token, 3, None)
    assert calls == [False, False, True] and b.matmul_pool is b.pool     # the cached timing, then both from memory
    assert times[other] == [pytest.approx(1.1)] * 3 and times[default] == [1.0] * 3
    assert tune._pick(times, default)[0] == default
    assert tune._bar_rounds(stage, 3, 2, one_token) == 9 and tune._bar_rounds("prefetch_k", 3, 2) == 3


def test_a_single_token_distance_is_judged_at_every_token_count_it_moves(restore, monkeypatch):
    """The 8-bit distance moves two-token passes too where they take the single-token scheme
    (q8_single_k2): one that wins at one token but loses at two is not picked."""
    cands = tune.candidates()["prefetch_k1_q8"]
    base = {**tune.defaults(), "q8_single_k2": True, "q8_single_k3": False, "q8_single_k4": False}
    default = tune._label(cands, base)
    other = next(n for n in cands if n != default)
    b = tune._Bench(1, 1, 1)
    monkeypatch.setattr(b, "matmul", lambda fmt, k, call: [float(k)])        # its "seconds" say which k ran

    def per_round(fns, rounds, bar):
        return {n: [(0.95 if fn()[0] == 1 else 1.1) if setting(n) == other else 1.0] * rounds for n, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    assert tune.single_ks("q8", base) == [1, 2]
    assert tune.stream_timings("prefetch_k1_q8", {**base, "q8_single_k1": False, "q8_single_k2": False}) == [((1, None),)]
    times = tune._times("prefetch_k1_q8", cands, b, base, 3, None)
    assert times[other] == [pytest.approx(1.1)] * 3
    assert tune._pick(times, default)[0] == default
    assert tune._bar_rounds("prefetch_k1_q8", 3, 1, base) == 9     # two timings from memory and the cached one


def test_the_bench_s_walks_go_on_round_the_cycle_from_call_to_call():
    """Each timing starts where the last stopped: restarting at the first walk would read the
    same few walks every time, from the cache (past_llc is 8 MB here: 9 walks of just under 1 MB)."""
    b = tune._Bench(1, 3, 1)
    assert b.W["q4"].rows % b.walk["q4"] == 0 and b.W["q4"].rows // b.walk["q4"] >= 8
    for calls in (1, 2, 3):
        assert len(b.matmul("q4", 1)) == 3 and b._next["q4"] == 3 * calls
    b.slices(1 << 18, 0)
    assert b._next == {"q4": 12, "q8": 0}


def test_a_one_token_stream_is_timed_in_its_format_s_calls(restore, monkeypatch):
    """The 4-bit body's stream in calls the size of a layer's large matrices, where a scheme's
    start in each call counts; the 8-bit output layer's in one call."""
    b, seen = tune._Bench(1, 1, 1), []
    monkeypatch.setattr(b, "matmul", lambda fmt, k, call: seen.append((fmt, call)) or [1.0])
    monkeypatch.setattr(tune, "_per_round", lambda fns, rounds, bar: {n: fn() * rounds for n, fn in fns.items()})
    for stage in ("prefetch_k1", "q4_single_k1", "prefetch_k1_q8", "q8_single_k1"):
        tune._times(stage, tune.candidates()[stage], b, tune.defaults(), 1, None)
    assert {fmt: call for fmt, call in seen} == {"q4": tune.STREAM_CALL["q4"], "q8": None}


def test_a_stream_count_is_judged_on_one_token_in_the_calls_a_layer_makes(restore, monkeypatch):
    """A format's stream count binds at one token (from two the caps streams_k2, _k5 and _k9 are
    judged apart): one timing sums one-token walks in the calls a layer makes."""
    cands = tune.candidates()["q4_streams"]
    assert set(cands) == {"1", "2", "4"} and tune.STREAMS_K == (1,)
    b, seen = tune._Bench(1, 1, 1), []
    monkeypatch.setattr(b, "matmul", lambda fmt, k, call: seen.append((fmt, k, call)) or [float(k)])
    monkeypatch.setattr(b, "cached", lambda fmt, k: [float(k)])

    def per_round(fns, rounds, bar):
        return {n: [fn()[0] * (0.5 if setting(n) == "4" else 1.0)] * rounds for n, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    times = tune._times("q4_streams", cands, b, tune.defaults(), 2, None)
    calls = tune.STREAMS_CALLS["q4"]
    assert sorted(seen[:2]) == sorted(("q4", 1, call) for call in calls)   # one candidate's timing
    assert times == {"1": [1.0, 1.0], "2": [1.0, 1.0], "4": [0.5, 0.5]}   # ratios of 2 "seconds" each
    assert tune._bar_rounds("q4_streams", 3, 2) == 9


@pytest.mark.parametrize("stage, cached_ratio, judged", [
    ("prefetch_k1_q8", 1.04, 0.9), ("prefetch_k1_q8", 1.10, 0.9), ("prefetch_k1_q8", 1.2, 1.2),
    ("q8_single_k2", 1.10, 0.9), ("q8_single_k4", 1.10, 1.10)])
def test_a_candidate_much_slower_from_cache_loses(restore, monkeypatch, stage, cached_ratio, judged):
    """A choice 10% faster from memory is judged by its time on a cache-resident matrix too, where
    that is past its limit. Judged only below four tokens (one token's distance, two tokens' scheme),
    4% and 10% slower there do not count and 20% does (four 8-bit streams far ahead thrash L1 there);
    at four tokens 10% counts."""
    cands, base = tune.candidates()[stage], tune.defaults()
    default = tune._label(cands, base)
    other = next(n for n in cands if n != default)
    b = tune._Bench(1, 1, 1)
    monkeypatch.setattr(b, "matmul", lambda fmt, k, call=None: [1.0])
    monkeypatch.setattr(b, "cached", lambda fmt, k: [100.0])     # its "seconds" say it was the cached timing

    def per_round(fns, rounds, bar):
        factor = {True: cached_ratio, False: 0.9}
        return {n: [factor[fn()[0] >= 100] if setting(n) == other else 1.0] * rounds for n, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    assert tune.CACHED_LIMIT == 1.05
    assert tune.cached_limit((1, 2)) == tune.CACHED_LIMIT_FEW > tune.cached_limit((2, 4)) == tune.CACHED_LIMIT
    times = tune._times(stage, cands, b, base, 3, None)
    assert times[other] == [pytest.approx(judged)] * 3 and times[default] == [1.0] * 3
    assert tune._pick(times, default)[0] == (other if judged < 1 else default)


def test_a_candidate_at_the_cached_limit_is_judged_on_all_its_rounds():
    """Cached ratios either side of CACHED_LIMIT round by round: past it in half the rounds leaves
    every round's ratio from memory (a steady 0.9 that wins head to head), past it in three of
    four takes the cached ratio in every round where that is larger."""
    memory = {"a": [0.9] * 4, "b": [0.9] * 4}
    cached = {"a": [1.04, 1.06, 1.04, 1.06], "b": [1.06, 1.07, 1.04, 1.08]}
    judged = tune._past_limit(memory, cached)
    assert judged["a"] == [0.9] * 4
    assert judged["b"] == [1.06, 1.07, 1.04, 1.08]
    assert tune._pick({"default": [1.0] * 4, **judged}, "default")[0] == "a"


@pytest.mark.parametrize("slow_k, judged", [(None, 46.8 / 50.5), (7, 46.8 / 50.5), (12, 1.2), (16, 1.2)])
def test_one_group_much_slower_from_cache_at_any_token_count_loses(restore, monkeypatch, slow_k, judged):
    """two_groups_k: one group 10% faster from memory at each count, so up to 16 tokens it reads
    46.8 of the default's 50.5 (one group at 7 and 8 either way; both formats over the counts that
    tell the candidates apart), is judged by its cached timing at each token count it takes in one
    group where the defaults take two (9, 12 and 16), each apart: 20% slower there at one of them
    counts (summed with the others it would fall under CACHED_LIMIT). At seven tokens both run one
    group, the same code, timed once for both."""
    cands = tune.candidates()["two_groups_k"]
    assert tune.two_groups() == ((6, 8, 9, 10, 13, 17), (7, 8, 9, 12, 16))
    base = tune.defaults()
    default, other = tune._label(cands, base), "17"
    b, seen, codes = tune._Bench(1, 1, 1), [], []
    monkeypatch.setattr(b, "matmul", lambda fmt, k: seen.append((fmt, k)) or [float(k) if fmt == "q4" else 0.0])
    monkeypatch.setattr(b, "cached", lambda fmt, k: [100.0 + k])     # the cached timing, and its k

    def per_round(fns, rounds, bar):
        codes.append(len(fns))
        def secs(fn):
            s = fn()[0]
            k, one_group = s % 100, tune.current()["two_groups_k"] > s % 100    # as the timing ran
            if s < 100:
                return 0.9 * k if one_group else k
            return 1.2 if one_group and k == slow_k else 1.0
        return {n: [secs(fn)] * rounds for n, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    times = tune._times("two_groups_k", cands, b, base, 3, None)
    assert sorted(set(seen)) == sorted((fmt, k) for fmt in ("q4", "q8") for k in (7, 8, 9, 12, 16))
    assert codes == [2 * 5] + [2] * 10      # one group or two at each count, from memory and from cache
    assert times[other] == [pytest.approx(judged)] * 3 and times[default] == [1.0] * 3
    assert tune._bar_rounds("two_groups_k", 3) == 3 * 11


@pytest.mark.parametrize("stage, ks", [("streams_k2", (2, 4)), ("streams_k5", (5, 8)), ("streams_k9", (12, 16))])
@pytest.mark.parametrize("cached_ratio, judged", [(1.04, 0.9), (1.12, 1.12)])
def test_two_streams_much_slower_from_cache_lose(restore, monkeypatch, cached_ratio, judged, stage, ks):
    """The stream caps: two streams 10% faster from memory at their token counts (both formats)
    are judged by each format and token count's cached timing against the untuned defaults too:
    12% slower from cache counts, 4% does not."""
    cands = tune.candidates()[stage]
    base = tune.defaults()
    assert {"1", "2"} <= set(cands) and tune._label(cands, base) == "1" and tune._register_ks(stage) == ks
    b, seen = tune._Bench(1, 1, 1), []
    monkeypatch.setattr(b, "matmul", lambda fmt, k: seen.append((fmt, k)) or [1.0])
    monkeypatch.setattr(b, "cached", lambda fmt, k: [100.0 + k])

    def per_round(fns, rounds, bar):
        def ratio(n, secs):
            return (0.9 if secs < 100 else cached_ratio) if n == "2" else 1.0
        return {key: [ratio(setting(key), fn()[0])] * rounds for key, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    times = tune._times(stage, cands, b, base, 3, None)
    assert sorted(set(seen)) == sorted((fmt, k) for fmt in ("q4", "q8") for k in ks)
    assert times["2"] == [pytest.approx(judged)] * 3 and times["1"] == [1.0] * 3
    assert tune._pick(times, "1")[0] == ("2" if judged < 1 else "1")
    assert tune._bar_rounds(stage, 3) == 3 * (2 + 4)


@pytest.mark.parametrize("stage, ks", [("streams_k2", (2, 4)), ("streams_k5", (5, 8))])
def test_a_stream_cap_must_win_at_each_token_count(restore, monkeypatch, stage, ks):
    """Two streams 15% faster from memory at a cap's first token count and 5% slower at its last
    (summed, about 0.95) are judged by the worse: the cap stays at one stream."""
    cands = tune.candidates()[stage]
    base = tune.defaults()
    b = tune._Bench(1, 1, 1)
    monkeypatch.setattr(b, "matmul", lambda fmt, k: [float(k)])
    monkeypatch.setattr(b, "cached", lambda fmt, k: [100.0])
    rate = {ks[0]: 0.85, ks[1]: 1.05}

    def per_round(fns, rounds, bar):
        def ratio(n, secs):
            return rate[secs / 2] if n == "2" and secs < 100 else 1.0   # secs: k from each format
        return {key: [ratio(setting(key), fn()[0])] * rounds for key, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    times = tune._times(stage, cands, b, base, 3, None)
    assert times["2"] == [pytest.approx(1.05)] * 3
    assert tune._pick(times, "1")[0] == "1"


@pytest.mark.parametrize("stage, fmt, k", [("q8_single_k2", "q8", 2), ("q4_single_k5", "q4", 5),
                                           ("q4_mem_acc_k4", "q4", 4)])
@pytest.mark.parametrize("cached_ratio, judged", [(1.04, 0.9), (1.2, 1.2)])
def test_a_scheme_flag_much_slower_from_cache_loses(restore, monkeypatch, cached_ratio, judged, stage, fmt, k):
    """A scheme flag from two tokens on, 10% faster from memory at its format and token count, is
    judged by its cached timing there against the untuned defaults too: 20% slower from cache
    counts (the k >= 2 scheme's requests into L2 at two 8-bit tokens), 4% does not."""
    cands = tune.candidates()[stage]
    base = tune.defaults()
    default = tune._label(cands, base)
    other = next(n for n in cands if n != default)
    b, seen = tune._Bench(1, 1, 1), []
    monkeypatch.setattr(b, "matmul", lambda fmt, k: seen.append((fmt, k)) or [1.0])
    monkeypatch.setattr(b, "cached", lambda fmt, k: seen.append(("cached", fmt, k)) or [100.0])

    def per_round(fns, rounds, bar):
        def ratio(n, secs):
            return (0.9 if secs < 100 else cached_ratio) if n == other else 1.0
        return {n: [ratio(setting(n), fn()[0])] * rounds for n, fn in fns.items()}
    monkeypatch.setattr(tune, "_per_round", per_round)
    times = tune._times(stage, cands, b, base, 3, None)
    assert set(seen) == {(fmt, k), ("cached", fmt, k)}
    assert times[other] == [pytest.approx(judged)] * 3 and times[default] == [1.0] * 3
    assert tune._pick(times, default)[0] == (other if judged < 1 else default)
    assert tune._bar_rounds(stage, 3) == 6


def test_the_cached_timing_is_a_product_from_l2_on_one_thread():
    b = tune._Bench(1, 1, 2)
    secs = b.cached("q8", 1)
    assert len(secs) == tune.CACHED_CALLS and all(0 < s < 0.01 for s in secs)
    W, acts = b._cached["q8", 1]
    assert (W.rows, W.cols) == L2_SHAPE["q8"] and int(acts._acts.k()) == 1
