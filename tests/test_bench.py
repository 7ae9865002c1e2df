"""`lab bench` prints what other tools read: the keys promised, with sane values."""
import json
import subprocess
import sys

import numpy as np
import pytest

from lab import ceilings, kernel_bench, kernels, native, protocol, speedups, steps
from lab.kernels import Pool

ROOT = native.SOURCE_DIR.parent


def run_lab(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "lab.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_summary_median_and_iqr():
    s = protocol.summary([5, 1, 3, 2, 4])
    assert s["median"] == 3 and s["q1"] == 2 and s["q3"] == 4 and s["iqr"] == 2


def test_interleave_alternates():
    order = []
    protocol.interleave({"a": lambda: order.append("a") or [1], "b": lambda: order.append("b") or [2]}, 3)
    assert order == ["a", "b"] * 3


def test_bandwidth_json():
    r = json.loads(run_lab("bench", "bandwidth", "--json", "--mb", "64", "--rounds", "1"))
    assert r["read_gbps"] > 0.5 and r["threads"] >= 1
    assert {x["kind"] for x in r["results"]} == {*ceilings.READ_KINDS, "copy", "triad"}
    assert r["read_gbps"] == max(x["gbps"] for x in r["results"] if x["kind"] in ceilings.READ_KINDS)
    assert r["machine"]["kernel_path"] in native.PATHS


def test_kernels_json():
    r = json.loads(run_lab("bench", "kernels", "--json", "--quick", "--k", "1,4", "--kernel", "q4"))
    recs = r["results"]
    assert {(x["working_set"], x["k"]) for x in recs} == {("dram", 1), ("dram", 4), ("l2", 1), ("l2", 4)}
    for x in recs:
        assert x["kernel"] == "q4" and x["threads"] >= 1
        for key in ("gmacs", "gbps", "share_of_bandwidth", "share_of_peak"):
            assert x[key] > 0, key
    assert r["dot_peak_gmacs"] > 0 and r["read_gbps"] > 0
    assert r["tuning"] == "LAB_TUNE=0"                  # what the kernels ran with (the tests keep the defaults)
    att = {(x["context"], x["k"]): x for x in r["attention"]}
    assert set(att) == {(c, k) for c in (256, 2048) for k in (1, 4, 8)}
    for (c, k), x in att.items():                       # the multiply-adds follow from the shape
        assert x["us"] > 0 and x["gmacs"] == pytest.approx(2 * x["group"] * k * c * x["head_dim"] / x["us"] / 1e3)
    assert att[2048, 1]["us"] > att[256, 1]["us"]        # eight times the positions cannot be free


@pytest.mark.parametrize("path", native.supported_paths())
def test_attention_bench_runs_every_path_and_refuses_bad_shapes(path):
    ns, pid = native.lib(), native.path_id(path)
    secs = np.zeros(2)
    assert ns.bench_attention(64, 7, 5, 100, pid, 2, secs) == 0 and (secs > 0).all()
    for bad in ((60, 7, 5, 100), (64, 0, 5, 100), (64, 7, 0, 100), (64, 7, 99, 100), (64, 7, 5, 0)):
        assert ns.bench_attention(*bad, pid, 2, secs) == 1, bad
    pool = Pool(min(2, len(__import__("os").sched_getaffinity(0))))
    for cycle in (0, 1 << 20):                          # 3 layers, or the 12 that fill 1 MB
        stage = ns.AttentionStage()
        assert stage.init(64, 7, 2, 5, 100, 3, cycle, pid) == 0
        for _ in range(3):                              # the stages go on round the cycle
            secs[:] = 0
            assert stage.time(pool._pool, 2, secs) == 0 and (secs > 0).all()
    for bad in ((64, 7, 0, 5, 100, 3, 0), (64, 7, 2, 5, 100, 0, 0), (60, 7, 2, 5, 100, 3, 0), (64, 7, 2, 5, 100, 3, -1)):
        stage = ns.AttentionStage()
        assert stage.init(*bad, pid) == 1 and stage.time(pool._pool, 2, secs) == 1, bad


def test_the_read_ceiling_is_the_fastest_read_loop(monkeypatch):
    """Each READ_LOOPS loop runs on the real buffer; the passes kept are those of the loop with
    the lowest median, whichever it is."""
    buf, _owner = protocol.read_buffer(4 << 20)
    pool, ns = Pool(1), native.lib()
    for ahead, streams in protocol.READ_LOOPS:
        secs = np.zeros(2)
        assert ns.bench_read(buf, buf.size, pool._pool, 2, secs, ahead, streams) == 0
        assert (secs > 0).all(), (ahead, streams)
    assert ns.bench_read(buf, buf.size, pool._pool, 2, secs, 0, 3) == 1      # no such loop
    for fastest in protocol.READ_LOOPS:
        class Fake:
            @staticmethod
            def bench_read(b, n, p, reps, secs, ahead, streams, fastest=fastest):
                secs[:] = [1.0, 3.0, 2.0] if (ahead, streams) == fastest else [2.5, 2.0, 9.0]
        monkeypatch.setattr(native, "lib", lambda: Fake)
        assert protocol.read_passes(buf, buf.size, None, 3) == [1.0, 3.0, 2.0], fastest


def test_a_read_pass_refuses_a_buffer_it_would_crash_on():
    """The read loops load whole aligned lines: a misaligned buffer or a length past its end
    is a ValueError, never a signal inside C++."""
    buf, _owner = protocol.read_buffer(4 << 20)
    with pytest.raises(ValueError, match="64-byte boundary"):
        protocol.read_passes(buf[1:], buf.size - 1, None, 1)
    for nbytes in (0, buf.size + 64):
        with pytest.raises(ValueError, match="nbytes must be in"):
            protocol.read_passes(buf, nbytes, None, 1)


def test_the_last_level_cache_is_read_from_linux(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "480M"), ("index9", "junk")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert protocol.llc_bytes(tmp_path) == 480 << 20
    assert protocol.llc_bytes(tmp_path / "absent") == 0          # none reported: the sizes asked for stand
    assert protocol.past_llc(1 << 30) >= 1 << 30


def test_working_sets_past_the_cache_fit_the_memory_available(tmp_path, monkeypatch):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    assert protocol.available_bytes(info, ()) == 2000000 << 10
    assert protocol.available_bytes(tmp_path / "absent", ()) is None
    limit, used, unlimited = tmp_path / "max", tmp_path / "current", tmp_path / "v2max"
    limit.write_text("1073741824\n"), used.write_text("268435456\n"), unlimited.write_text("max\n")
    assert protocol.available_bytes(info, ((limit, used),)) == 768 << 20         # a container's limit binds
    assert protocol.available_bytes(info, ((unlimited, used),)) == 2000000 << 10
    assert protocol.available_bytes(tmp_path / "absent", ((limit, used),)) == 768 << 20
    monkeypatch.setattr(protocol, "llc_bytes", lambda: 480 << 20)
    for room, want in ((None, 960 << 20), (16 << 30, 960 << 20), (4 << 30, 512 << 20)):
        monkeypatch.setattr(protocol, "available_bytes", lambda room=room: room)
        assert protocol.past_llc(0) == want, room
        assert protocol.past_llc(600 << 20) == max(600 << 20, want), room     # what is asked for stands


def test_matmul_walks_cycle_through_the_matrix_slice_by_slice():
    """Walk r multiplies W's r-th walk of rows (cycling), slice by slice: the last slice's
    product is left in y, equal to the whole matrix's rows there."""
    ns, tile, path = native.lib(), native.consts().tile, native.path_id(None)
    W = kernels.random_qtensor("q4", 6 * tile, 256, seed=3)
    acts = kernels.Acts(np.random.default_rng(0).standard_normal((2, 256), dtype=np.float32))
    whole = kernels.matmul(W, acts)
    P, pool, secs = kernels.pack(W), Pool(1), np.zeros(4)
    # 3 walks of 2 slices: walk 0, 1, then 0 again; from walk 1 or 2 on, as a caller's next call goes on
    for reps, first, last in ((1, 0, 1), (2, 0, 3), (4, 0, 1), (1, 1, 3), (2, 2, 1), (1, 5, 5)):
        y = np.zeros((2, tile), np.float32)
        assert ns.bench_matmul(P.view(), 2, 1, acts._acts, y, path, pool._pool, 0, reps, secs, first) == 0
        np.testing.assert_array_equal(y, whole[:, last * tile:(last + 1) * tile])
    assert ns.bench_matmul(P.view(), 2, 1, acts._acts, y, path, pool._pool, 0, 1, secs, -1) == int(ns.MM_SHAPE)
    assert len(protocol.matmul_samples(P, acts, pool, path, 0, 3, 2 * tile, tile)) == 3
    y = np.zeros((2, 6 * tile), np.float32)
    for walk, part in ((7, 1), (2, 3), (2, 0), (4, 2)):     # past W, a slice past its walk, none; 4 of 6 is fine
        assert ns.bench_matmul(P.view(), walk, part, acts._acts, y, path, pool._pool, 0, 1, secs) == \
            (0 if walk == 4 else int(ns.MM_SHAPE)), (walk, part)


def test_decode_stages_json(tmp_path):
    """decode --stages: every stage timed, the streaming ones with a rate against the ceiling."""
    import os
    env = dict(os.environ, LAB_MODELS=str(tmp_path))
    r = json.loads(run_lab("bench", "decode", "--json", "--model", "tiny-qwen3", "--context", "32",
                           "--rounds", "2", "--stages", env=env))
    for key in ("tokens_per_s", "bytes_per_token", "read_gbps", "share_of_ceiling"):
        assert r[key] > 0, key
    st = {x["stage"]: x for x in r["stages"]}
    assert set(st) == {"serial", "quantize", "qkv", "attention", "o", "gate_up", "swiglu", "down", "output"}
    assert all(0 < x["part"] < 1 for x in st.values())
    assert 0.9 < sum(x["part"] for x in st.values()) < 1.1          # medians of each round's parts
    assert sum(x["bytes"] for x in st.values()) == r["bytes_per_pass"] == r["bytes_per_token"]
    for name in ("qkv", "o", "gate_up", "down", "output"):
        assert st[name]["ms"] > 0 and st[name]["gbps"] > 0 and st[name]["share_of_ceiling"] > 0, name
    assert "gbps" not in st["attention"]
    m, shares = r["matrices"], [st[n]["share_of_ceiling"] for n in ("qkv", "o", "gate_up", "down", "output")]
    assert 0.9 * min(shares) <= m["share_of_ceiling"] <= 1.1 * max(shares)     # their bytes over their time
    between = sum(x["ms"] for x in st.values() if not x["bytes"])
    assert m["between_ms"] == pytest.approx(between, rel=0.5) and 0 < m["between_part"] < 1
    trip = r["round_trip_ns"]                   # where the threads sit: none to time on one CPU
    if r["threads"] > 1:
        assert all(0 < trip[w] < 1e6 for w in ("before", "after"))
    else:
        assert trip == {"before": None, "after": None}


def test_decode_stages_of_a_k_token_pass(tmp_path):
    """decode --k 4: four tokens a pass, each stage of the verification pass timed; the weights
    are read once a pass, so a token's share of them is a quarter."""
    import os
    env = dict(os.environ, LAB_MODELS=str(tmp_path))
    r = json.loads(run_lab("bench", "decode", "--json", "--model", "tiny-qwen3", "--context", "32",
                           "--rounds", "2", "--stages", "--k", "4", env=env))
    assert r["k"] == 4 and r["bytes_per_token"] == r["bytes_per_pass"] / 4
    assert r["tokens_per_s"] == pytest.approx(4e3 / r["ms_per_pass"])
    assert sum(x["bytes"] for x in r["stages"]) == r["bytes_per_pass"]
    assert all(x["ms"] > 0 for x in r["stages"] if x["stage"] in ("qkv", "attention", "gate_up", "down"))



@pytest.mark.parametrize("path", ["scalar", "avx2", "avxvnni", "avx512vnni", "vnni256evex"])
def test_no_kernel_beats_the_issue_peak(path):
    """The issue peak is a ceiling: no kernel from L2 goes faster (5% allowed for noise), and
    the peak is the fastest of its loops whatever order they are listed in."""
    if path not in native.supported_paths():
        pytest.skip(f"this CPU has no {path}")
    peak = ceilings.dot_peak(path, n=4_000_000, reps=5)
    rows = peak["variants"]
    assert peak["gmacs"] == max(r["gmacs"] for r in rows) > 0
    assert ceilings.best_variant(rows[::-1])["variant"] == ceilings.best_variant(rows)["variant"] == peak["variant"]
    assert {r["form"] for r in rows if r["op"] == "vpdpbusd"} in ({"reg", "bcst"}, set())
    ks, rounds, reps = ((1, 16), 3, 2) if path == "scalar" else ((1, 2, 4, 8, 16), 9, 10)
    for fmt in ("q4", "q8"):
        for r in kernel_bench.l2_records(fmt, ks, native.path_id(path), peak, rounds, reps):
            assert r["share_of_peak"] <= 1.05, (fmt, r["k"], r["share_of_peak"], peak["variant"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a tiny draft Engine on one pool: what the benches are handed."""
    from lab.engine import Engine
    from lab.kernels import Pool
    from lab.models import TINY, tiny_weights
    from lab.models import export as ex
    d = tmp_path_factory.mktemp("bench")
    c = TINY["tiny-qwen2"]
    pool = Pool(1)
    return [Engine(ex.export(c, tiny_weights(c, seed=s), d / f"{s}.lab", "q4-q8out"), pool=pool, max_context=256)
            for s in (1, 2)]


def test_gamma_bench_predicts_every_group_drafter_and_gamma(pair):
    t, d = pair
    prompts = [("a", [1, 2, 3, 1, 2, 3, 1, 2]), ("b", [5, 6, 7, 5, 6, 7])]
    g = speedups.gamma_bench(t, d, prompts, gammas=(1, 2), max_new_tokens=8, context=32, rounds=1)
    assert len(g["runs"]) == 2 * 2 * 2 and set(g["v"]) == {1, 2, 3} and g["c"] > 0
    cells = [(r["group"], r["drafter"], r["gamma"]) for r in g["table"]]
    assert cells == [(grp, dr, gm) for grp in "ab" for dr in ("draft", "lookup") for gm in (1, 2)]
    assert all(r["predicted"] > 0 and r["measured"] > 0 for r in g["table"])


def test_vk_bench_reads_the_ceiling_beside_each_context(pair):
    """Each context's records say which bandwidth state they were measured in."""
    from lab.costs import vk_bench
    t, d = pair
    r = vk_bench(t, {"q4-q8out": d}, (16, 32), (1, 2), rounds=1, reps=1)
    assert {(x["kind"], x["context"]) for x in r["records"]} == {(k, c) for k in ("v", "c") for c in (16, 32)}
    assert all(x["read_gbps_before"] > 0 and x["read_gbps_after"] > 0 for x in r["records"])
    multi = t.pool.threads > 1                 # and where the threads sat: no round trip on one CPU
    assert all((x["round_trip_ns"] > 0) if multi else x["round_trip_ns"] is None for x in r["records"])


def test_checked_runs_stop_on_a_speculative_output_that_differs(pair):
    """The speed-up benches refuse a speculative run whose greedy output is not plain's, with
    the project's mismatch error, whichever bench asked."""
    from types import SimpleNamespace
    from lab.speculative import SpeculationMismatch
    t, d = pair

    class Off:                                    # speculation whose last token is wrong
        def __getattr__(self, name):
            return getattr(t, name)

        def speculate(self, ids, draft, **kw):
            r = t.speculate(ids, draft, **kw)
            return SimpleNamespace(tokens=r.tokens[:-1] + [r.tokens[-1] + 1])
    runs = speedups.checked_runs(Off(), {"draft": d}, [("a", [1, 2, 3])], (2,), 8)
    with pytest.raises(SpeculationMismatch, match="differs from plain on a .draft, gamma 2."):
        list(runs)


def test_threads_bench_hands_the_engines_back(pair):
    """Every configuration times the three phases; the engines keep their own pool afterwards."""
    t, d = pair
    pools = (t.pool, d.pool)
    rows = steps.threads_bench(t, d, context=16, gamma=2, rounds=1, reps=1, max_threads=1)
    assert [r["phase"] for r in rows] == ["draft step", "target step", "verification (k=3)"]
    assert all(r["ms"] > 0 for r in rows) and (t.pool, d.pool) == pools


def test_threads_bench_times_every_configuration_beside_a_slow_core(pair):
    """Each condition (no co-runner, one at full duty on the last CPU, the last worker slowed) times
    every configuration, with its slow-down measured; `holds_up` names one split per phase."""
    import os
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a slow core beside a fast one needs two CPUs")
    t, d = pair
    rows = steps.threads_bench(t, d, context=16, gamma=2, rounds=1, reps=1, max_threads=2, duties=(0.0, 1.0),
                               factors=(3.0,))
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    assert conds == ["no co-runner", "co-runner 100%", "a core at 1/3 speed"]
    assert len(rows) == 3 * 3 * (1 + 2 * len(steps.SPLITS))
    assert {r["slowdown"] for r in rows if r["condition"] == "no co-runner"} == {1.0}
    assert all(r["slowdown"] > 0 for r in rows)
    assert {r["slowdown"] for r in rows if r["condition"] == "a core at 1/3 speed"}.pop() > 1.5
    # two cores share the work, so the ideal beats one thread alone on either
    one = {(r["phase"], r["condition"]): r["ms"] for r in rows if r["threads"] == 1}
    assert all(0 < r["ideal_ms"] < one[r["phase"], r["condition"]] for r in rows)
    held = steps.holds_up(rows)
    assert len(held) == 3 * len(steps.SPLITS) and sum(r.get("holds_up", False) for r in held) == 3
    assert all(r["worst"] >= 1.0 and r["worst"] == max(r[c] for c in conds) for r in held)
    assert all(r["worst_vs_ideal"] > 0 for r in held)


def test_the_ideal_shares_the_work_by_speed():
    """A core twice as fast takes two thirds of the work: 10 ms and 20 ms alone make 6.67 ms;
    a split's worst time over it is its largest ratio under any condition."""
    ideal = steps._ideal_ms({("alone", 0, "step"): {"ms": 10.0}, ("alone", 1, "step"): {"ms": 20.0}})
    assert ideal == {"step": pytest.approx(20 / 3)}
    rows = [{"phase": "step", "threads": 2, "pinned": True, "split": s, "condition": c, "ms": ms, "ideal_ms": i}
            for s, c, ms, i in [("static", "quiet", 5.5, 5.0), ("static", "slow", 10.0, 20 / 3),
                                ("guided", "quiet", 5.2, 5.0), ("guided", "slow", 7.0, 20 / 3)]]
    held = {r["split"]: r for r in steps.holds_up(rows)}
    assert held["static"]["worst_vs_ideal"] == pytest.approx(1.5)
    assert held["guided"]["worst_vs_ideal"] == pytest.approx(1.05) and held["guided"].get("holds_up")
