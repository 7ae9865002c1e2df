"""The baselines study's bookkeeping, with stand-in systems: pairing, ratios, the equality
rule, the slow systems' share of prompts; and the step timings on a tiny engine."""
import pytest

from lab import speculative
from lab.baselines import Run, study
from lab.speculative import SpeculationMismatch


@pytest.fixture(autouse=True)
def long_runs(monkeypatch):
    """The stand-ins return at once; these tests follow brackets long enough to run once."""
    monkeypatch.setattr(speculative, "SHORT", 0.0)


def fixed(tokens, seconds, log=None, name=""):
    def run(ids):
        if log is not None:
            log.append(name)
        return Run(list(tokens), seconds)
    return run


PROMPTS = [({"id": i, "group": g}, [1, 2, 3]) for i, g in enumerate(["qa", "rag", "qa", "math"])]


def test_each_system_is_bracketed_by_its_plain_runs_and_paired_with_the_reference():
    log = []
    lab = study.System("lab", {"plain": fixed([1] * 10, 0.5, log, "lab plain"), "auto": fixed([1] * 10, 0.25, log, "lab auto")})
    ref = study.System("llama.cpp", {"plain": fixed([2] * 10, 1.0, log, "ref plain")})
    res = study.generation([lab, ref], PROMPTS[:1], progress=False)
    assert log == ["lab plain", "lab auto", "lab plain", "ref plain", "ref plain"]
    rows = {(r["system"], r["setting"]): r for r in res["rows"]}
    assert rows["lab", "plain"]["tokens_per_s"] == pytest.approx(20)
    assert rows["lab", "auto"]["speedup"] == pytest.approx(2)
    assert rows["lab", "auto"]["vs_reference"] == pytest.approx(4)
    assert rows["llama.cpp", "plain"]["vs_reference"] == pytest.approx(1)
    assert res["energy"]["available"] in (True, False)


def test_the_order_of_systems_rotates_from_prompt_to_prompt():
    log = []
    a = study.System("a", {"plain": fixed([1], 1, log, "a")})
    b = study.System("b", {"plain": fixed([1], 1, log, "b")})
    study.generation([a, b], PROMPTS[:2], progress=False)
    assert log == ["a", "a", "b", "b", "b", "b", "a", "a"]


def test_an_exact_system_that_differs_from_its_plain_run_raises_and_another_is_recorded():
    bad = {"plain": fixed([1, 2, 3], 1), "spec": fixed([1, 2, 4], 1)}
    with pytest.raises(SpeculationMismatch, match="lab spec on prompt 0"):
        study.generation([study.System("lab", bad)], PROMPTS[:1], progress=False)
    res = study.generation([study.System("transformers bf16", bad, exact=False)], PROMPTS[:1], progress=False)
    spec = [r for r in res["rows"] if r["setting"] == "spec"]
    assert spec[0]["equal_to_plain"] is False and spec[0]["same_prefix"] == 2
    summary = next(r for r in res["summary"] if r["setting"] == "spec")
    assert summary["all_equal"] is False and summary["equal_share"] == 0


def test_a_slow_system_runs_on_its_first_prompts_only_and_they_span_the_groups():
    log = []
    slow = study.System("slow", {"plain": fixed([1], 1, log, "slow")}, prompts=2)
    ordered = study.round_robin([p for p, _ in PROMPTS])
    assert [p["group"] for p in ordered] == ["qa", "rag", "math", "qa"]
    released = []
    slow.release = lambda: released.append(len(log))
    study.generation([slow], [(p, [1]) for p in ordered], progress=False)
    assert log == ["slow"] * 4
    assert released == [4]                 # once, right after its last prompt


def test_summary_and_best_setting_per_group():
    lab = study.System("lab", {"plain": fixed([1] * 4, 1.0), "a": fixed([1] * 4, 0.5), "b": fixed([1] * 4, 0.8)})
    res = study.generation([lab], PROMPTS, progress=False)
    s = res["summary"]
    overall = {r["setting"]: r for r in s if r["group"] == "overall"}
    assert overall["a"]["n"] == 4 and overall["a"]["speedup"] == pytest.approx(2)
    assert study.best_speculative(s, "lab")["setting"] == "a"
    assert {r["group"] for r in s} == {"qa", "rag", "math", "overall"}
    assert study.best_speculative(s, "nobody") is None


class FakePasses:
    """A second system for `steps`: each pass costs k times a one-token pass."""
    bytes_per_token = 1_000_000

    def __init__(self):
        self.filled = []

    def fill(self, ctx):
        self.filled.append(ctx)

    def pass_seconds(self, k, reps):
        return [0.001 * k] * reps


def test_steps_pair_each_system_with_its_own_one_token_pass():
    from lab.engine import Engine
    from lab.models.export import engine_file
    e = Engine(engine_file("tiny-qwen2"), threads=1, max_context=512)
    other = FakePasses()
    recs = study.steps(e, other, contexts=(16, 64), ks=(1, 2, 4), rounds=2, reps=2, mb=8, progress=False)
    assert [(r["system"], r["context"]) for r in recs] == [("lab", 16), ("llama.cpp", 16), ("lab", 64), ("llama.cpp", 64)]
    assert other.filled == [16, 64]
    fake = recs[1]
    assert fake["v"] == {1: pytest.approx(1), 2: pytest.approx(2), 4: pytest.approx(4)}
    assert fake["tokens_per_s"] == pytest.approx(1000) and fake["gbps"] == pytest.approx(1.0)
    lab = recs[0]
    assert lab["v"][1] == pytest.approx(1) and lab["bytes_per_token"] == e.weight_bytes
    assert 0 < lab["share_of_ceiling"] and lab["read_gbps"] > 0


@pytest.mark.slow
def test_lab_bench_baseline_runs_every_system_on_tiny_models(tmp_path):
    """The CLI end to end: steps for each system, every system's settings on each prompt,
    llama.cpp left out with its reason where llama-cpp-python is absent."""
    import json
    import os
    import subprocess
    import sys
    from lab.baselines import llamacpp
    env = dict(os.environ, LAB_MODELS=str(tmp_path / "m"))
    out = subprocess.run([sys.executable, "-m", "lab.cli", "bench", "baseline", "--json", "--model", "tiny-qwen2",
                          "--draft", "tiny-qwen2-draft", "--draft-vocab", "0", "--context", "32", "--max-k", "4",
                          "--rounds", "1", "--per-group", "1", "--max-new-tokens", "8", "--hf-prompts", "1",
                          "--hf-dtype", "fp32"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    systems = {x["system"] for x in r["generation"]["summary"]}
    assert {"lab", "transformers fp32"} <= systems
    assert ("llama.cpp" in systems) == (llamacpp.available() is None)
    assert r["llama_absent"] == llamacpp.available()
    assert [x["context"] for x in r["steps"]] == [32] * len(r["steps"]) and set(r["steps"][0]["v"]) == {"1", "2", "3", "4"}
    hf_rows = [x for x in r["generation"]["rows"] if x["system"] == "transformers fp32"]
    assert {x["id"] for x in hf_rows} == {r["generation"]["rows"][0]["id"]}      # the first prompt only
