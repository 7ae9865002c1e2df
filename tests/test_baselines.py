"""The baselines study's bookkeeping, with stand-in systems: pairing, ratios, the equality
rule, the slow systems' share of prompts; and the step timings on a tiny engine."""
import pytest

from lab.baselines import Run, study
from lab.speculative import SpeculationMismatch


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
    assert spec[0]["equal_to_plain"] is False
    assert next(r for r in res["summary"] if r["setting"] == "spec")["all_equal"] is False


def test_a_slow_system_runs_on_its_first_prompts_only_and_they_span_the_groups():
    log = []
    slow = study.System("slow", {"plain": fixed([1], 1, log, "slow")}, prompts=2)
    ordered = study.round_robin([p for p, _ in PROMPTS])
    assert [p["group"] for p in ordered] == ["qa", "rag", "math", "qa"]
    study.generation([slow], [(p, [1]) for p in ordered], progress=False)
    assert log == ["slow"] * 4


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
