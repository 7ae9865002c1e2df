"""The offline round simulator: hand-computed rounds; greedy rounds equal to the engine's
accepted counts on the same prompts; sampled rounds with the engine's mean tokens/round."""
import numpy as np
import pytest

from lab import spec
from lab.distill.teacher import teacher_forced
from lab.engine import Engine
from lab.kernels import Pool
from lab.models import TINY, tiny_weights
from lab.models import export as ex


def test_rounds_by_hand():
    m = [1, 1, 0, 1, 1, 1, 1, 0, 0, 1]
    # gamma 2: [1,1]+bonus(tok 2) | tok3,4 + bonus(5) | tok6 then reject at 7 | reject at 8 | tok9 last
    assert spec.simulate_rounds(m, 2) == [2, 2, 1, 0, 1]
    assert spec.simulate_rounds(m, 8) == [2, 4, 0, 1]
    assert spec.simulate_rounds([0, 0, 0], 4) == [0, 0, 0]
    assert spec.simulate_rounds([1] * 10, 4) == [4, 4]            # 5 + 5 tokens
    assert spec.simulate_rounds([1] * 7, 4) == [4, 2]             # the budget ends round 2 after 2 guesses
    assert spec.simulated_tau([1] * 10, 4) == 5.0
    with pytest.raises(ValueError, match="rng"):
        spec.simulate_rounds([0.5, 1.0], 2)
    with pytest.raises(ValueError, match="gamma"):
        spec.simulate_rounds([1], 0)


def test_sampled_rounds_average_to_tau():
    """Independent acceptance with probability a: tokens per round -> τ(a, γ) on a long text."""
    a, g = 0.7, 3
    est = spec.simulated_tau(np.full(20000, a), g, draws=4, seed=1)
    assert est == pytest.approx(spec.tau(a, g), rel=0.02)


def test_acceptance_metrics_by_formula():
    rng = np.random.default_rng(0)
    t, d = rng.normal(size=(7, 11)), rng.normal(size=(7, 11))
    x = rng.integers(0, 11, 7)
    r = spec.acceptance(t, d, x, temperature=0.8, chunk=3)
    p = np.exp(t / 0.8) / np.exp(t / 0.8).sum(-1, keepdims=True)
    q = np.exp(d / 0.8) / np.exp(d / 0.8).sum(-1, keepdims=True)
    np.testing.assert_allclose(r["beta"], 1 - 0.5 * np.abs(p - q).sum(-1), rtol=1e-12)
    np.testing.assert_allclose(r["accept"], np.minimum(1, q[np.arange(7), x] / p[np.arange(7), x]), rtol=1e-12)
    np.testing.assert_array_equal(r["match"], (t.argmax(-1) == d.argmax(-1)).astype(float))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("sim")
    pool = Pool(min(2, len(__import__("os").sched_getaffinity(0))))
    out = {}
    for name, mix in (("tiny-qwen2", 0.0), ("tiny-v16", 0.15)):
        c = TINY[name]
        tw, other = tiny_weights(c, seed=1), tiny_weights(c, seed=7)
        dw = {n: (1 - mix) * w + mix * other[n] for n, w in tw.items()}     # a draft that half agrees
        tf = ex.export(c, tw, d / f"{name}-t.lab", "q4-q8out")
        df = ex.export(c, dw, d / f"{name}-d.lab", "q4")
        out[name] = (Engine(tf, pool=pool, max_context=512), Engine(df, pool=pool, max_context=512))
    return out


def test_greedy_simulation_equals_the_engine(pair):
    target, draft = pair["tiny-qwen2"]
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(6):
        prompt = rng.integers(0, 380, int(rng.integers(2, 30))).tolist()
        for gamma in (1, 2, 4, 7):
            r = target.speculate(prompt, draft, gamma=gamma, max_new_tokens=40)
            acc = spec.acceptance(teacher_forced(target, prompt, r.tokens), teacher_forced(draft, prompt, r.tokens))
            assert spec.simulate_rounds(acc["match"], gamma) == [a for _, a in r.per_round]
            checked += len(r.per_round)
    assert checked > 100


def test_sampled_simulation_matches_the_engine_in_mean(pair):
    """At temperature 1: mean tokens per round over many seeds, engine against simulator
    along target-sampled text (the same seeds give the texts), within four standard errors."""
    target, draft = pair["tiny-v16"]
    prompt, n, gamma = [1, 2, 3], 24, 3
    eng, sim = [], []
    for seed in range(300):
        r = target.speculate(prompt, draft, gamma=gamma, max_new_tokens=n, temperature=1.0, seed=seed)
        eng.append(r.tokens_per_round)
        text = target.generate(prompt, n, temperature=1.0, seed=10_000 + seed).tokens
        acc = spec.acceptance(teacher_forced(target, prompt, text), teacher_forced(draft, prompt, text), text)
        sim.append(len(text) / len(spec.simulate_rounds(acc["accept"], gamma, np.random.default_rng(seed))))
    se = np.sqrt(np.var(eng) / len(eng) + np.var(sim) / len(sim))
    assert abs(np.mean(eng) - np.mean(sim)) < 4 * se, (np.mean(eng), np.mean(sim), se)
