"""tools/reprice.py, tools/call_overhead.py and tools/prefetch_states.py, which the tuning
diary's per-state costs, call costs and prefetch distances come from: the rows are priced
again from their own rounds, the error bands say which way each band misses, the call timer
compiles against the engine's pool and times, and the prefetch probe bands steady rounds by
their read ceiling and leaves the tuning as it found it."""
import json
import sys
from pathlib import Path

import pytest

from lab import policy as P, speculative as S
from lab.kernels import Pool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import call_overhead  # noqa: E402
import prefetch_states as ps  # noqa: E402
import reprice  # noqa: E402


def costs(c: float) -> P.Costs:
    v = [0.0] + [1 + 0.1 * (k - 1) for k in range(1, 12)]
    return P.Costs(machine={}, target="t", draft="d", contexts=[256], v=[v], c=[c], o=0.0, o_sampled=0.0)


def row(plain: float, speedup: float) -> dict:
    return {"plain_tokens_per_s": plain, "speedup": speedup, "rounds": 2, "per_round": [[2, 2], [2, 1]],
            "kinds": ["draft", "draft"], "prompt_tokens": 10, "new_tokens": 5}


def test_rows_are_priced_again_from_their_own_rounds():
    r = row(40.0, 1.0)
    cheap, dear = costs(0.1), costs(0.4)
    run = type("Run", (), {"rounds": 2, "per_round": r["per_round"], "kinds": r["kinds"], "prompt_tokens": 10,
                           "tokens": [0] * 5})()
    assert reprice.repredict(r, cheap) == pytest.approx(S.predicted(run, cheap))
    assert reprice.repredict(r, cheap) > reprice.repredict(r, dear)


def test_bands_say_which_way_each_plain_rate_misses():
    rows = [row(40.0, 2.0), row(42.0, 2.0), row(70.0, 1.0), row(65.0, 1.0)]
    lines = reprice.bands(rows, [1.8, 1.8, 1.1, 1.1])
    assert lines[0].startswith("correlation") and float(lines[0].split(": ")[1]) > 0.9
    assert "2 turns, median error -0.100" in lines[1] and "2 turns, median error +0.100" in lines[2]


def test_bands_by_prompt_length():
    rows = [row(40.0, 2.0), row(42.0, 2.0), row(70.0, 1.0)]
    rows[2]["prompt_tokens"] = 800
    lines = reprice.bands(rows, [1.8, 1.8, 1.1], "prompt_tokens", reprice.PROMPT_BANDS, "prompt tokens")
    assert "2 turns, median error -0.100" in lines[1] and "1 turns, median error +0.100" in lines[2]


def test_a_table_loads_from_a_cache_file_or_a_results_cost_tables(tmp_path):
    c = costs(0.3)
    (tmp_path / "cache.json").write_text(c.model_dump_json())
    (tmp_path / "entry.json").write_text(json.dumps({"draft": c.model_dump()}))
    assert reprice.load_costs(str(tmp_path / "cache.json")) == c == reprice.load_costs(str(tmp_path / "entry.json"))


def test_the_call_timer_times_the_engines_pool():
    pool = Pool(min(2, len(__import__("os").sched_getaffinity(0))))
    assert 0 < call_overhead.parallel_for_us(pool, 200, 0) < 1e4
    assert 0 < call_overhead.parallel_for_us(pool, 200, 64) < 1e4


def test_call_overhead_reports_each_slice_size_per_bus_state():
    S = call_overhead.SLICES
    r = lambda read, after, secs: {"read_before": read, "read_after": after, "secs": dict(zip(S, secs))}
    total = 2 * 10**8
    rounds = [r(30, 31, [0.010] * len(S)), r(32, 30, [0.012] * len(S)),      # slow: 31 GB/s median
              r(55, 54, [0.006] * (len(S) - 1) + [0.004]),                   # fast, the largest slices faster
              r(30, 55, [1.0] * len(S))]                                      # a flip: left out
    slow, fast = call_overhead.by_state(rounds, [40.0], total)
    assert (slow["rounds"], fast["rounds"]) == (2, 1)
    assert slow["sizes"][S[0]]["secs"] == pytest.approx(0.011)
    assert slow["read_gbps"] == pytest.approx(30.75)
    assert slow["sizes"][S[0]]["share"] == pytest.approx(total / 0.011 / 1e9 / 30.75)
    assert fast["sizes"][S[-1]]["us_a_call"] == pytest.approx(0.004 / (total / S[-1]) * 1e6)
    assert fast["sizes"][S[0]]["share"] < fast["sizes"][S[-1]]["share"]


def test_the_tools_refuse_bands_that_are_not_numbers(capsys):
    with pytest.raises(SystemExit):
        ps.main(["--bands", "40,fast"])
    assert "GB/s, comma-separated" in capsys.readouterr().err


def test_prefetch_states_bands_steady_rounds_by_their_read():
    r = lambda read, after, ms: {"read_before": read, "read_after": after, "ms": ms}
    rounds = [r(40, 41, {8192: 20.0, 16384: 22.0}), r(42, 40, {8192: 21.0, 16384: 21.0}),
              r(70, 72, {8192: 14.0, 16384: 12.6}), r(40, 70, {8192: 30.0, 16384: 10.0})]   # the last unsteady
    slow, fast = ps.bands(rounds, [60.0], 8192, weight_bytes=10**9)
    assert (slow["rounds"], fast["rounds"]) == (2, 1)
    assert slow["values"][16384]["ratio"] == pytest.approx((1.1 + 1.0) / 2)
    assert fast["values"][16384]["ratio"] == pytest.approx(0.9)
    assert fast["values"][8192]["share"] == pytest.approx(1e9 / 0.014 / 1e9 / 71)


def test_prefetch_states_times_each_value_and_restores_the_tuning():
    from lab import tune
    from lab.engine import Engine
    from lab.models.export import engine_file
    before = tune.current()
    e = Engine(engine_file("tiny-qwen2"), threads=1, max_context=128)
    rounds = ps.measure(e, "prefetch_k1", [4096, 8192], 2, 32, read_mb=8, progress=False)
    assert tune.current() == before
    assert [sorted(x["ms"]) for x in rounds] == [[4096, 8192]] * 2
    assert sorted(ps.measure(e, "q4_single_k2", [False, True], 1, 32, read_mb=8, progress=False)[0]["ms"]) \
        == [False, True]
    assert all(x["read_before"] > 0 and all(v > 0 for v in x["ms"].values()) for x in rounds)


def test_prefetch_states_sweeps_on_a_base_and_restores_the_tuning():
    from lab import tune
    from lab.engine import Engine
    from lab.models.export import engine_file
    before = tune.current()
    e = Engine(engine_file("tiny-qwen2"), threads=1, max_context=128)
    base = {"q4_single_k2": not before["q4_single_k2"]}
    assert len(ps.measure(e, "prefetch_k1", [8192], 1, 32, read_mb=8, progress=False, base=base)) == 1
    assert tune.current() == before
    assert ps.parse_value("q4_single_k2", "false") is False and ps.parse_value("prefetch_k1", "4096") == 4096
    for field, text in (("q4_single_k2", "no"), ("prefetch_k1", "4k"), ("not_a_field", "1")):
        with pytest.raises((KeyError, ValueError)):
            ps.parse_value(field, text)


def test_placement_times_a_round_trip_and_bands_steady_rounds():
    import placement
    r = lambda read, after, ns: {"read_before": read, "read_after": after, "round_trip_ns": ns}
    rounds = [r(30, 31, 70.0), r(31, 30, 80.0), r(50, 52, 340.0), r(30, 50, 200.0)]   # the last unsteady
    slow, fast = placement.bands(rounds, [40.0])
    assert (slow["rounds"], fast["rounds"]) == (2, 1)
    assert slow["round_trip_ns"] == pytest.approx(75.0) and fast["round_trip_ns"] == pytest.approx(340.0)
    if len(__import__("os").sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no round trip to time")
    got = placement.measure(1, read_mb=8, trips=1000, progress=False)[0]
    assert 0 < got["round_trip_ns"] < 1e6 and got["read_before"] > 0
