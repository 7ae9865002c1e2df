"""The cost model: tau, the speedup formula, and alpha recovered from accepted counts."""
import pytest

from lab import spec


def test_tau_by_hand():
    assert spec.tau(0.0, 4) == 1.0
    assert spec.tau(1.0, 4) == 5.0
    assert spec.tau(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_speedup_textbook_and_cpu():
    v1 = {k: 1.0 for k in range(1, 10)}
    assert spec.speedup(0.8, 3, 0.0, v1, 0.0) == pytest.approx(spec.tau(0.8, 3))
    vcpu = {k: 1 + 0.1 * (k - 1) for k in range(1, 10)}
    assert spec.speedup(0.8, 3, 0.3, vcpu, 0.02) == pytest.approx(spec.tau(0.8, 3) / (0.9 + 1.3 + 0.02))


def test_best_gamma_by_hand():
    vcpu = {k: 1 + 0.1 * (k - 1) for k in range(1, 10)}
    # τ(0.8, γ) / (1.02 + 0.4γ) is 1.8/1.42, 2.44/1.82, 2.952/2.22 for γ = 1, 2, 3, then falls
    g, s = spec.best_gamma(0.8, 0.3, vcpu, 0.02)
    assert g == 2 and s == pytest.approx(2.44 / 1.82)
    assert spec.best_gamma(0.8, 0.3, vcpu, 0.02, gammas=(3, 5)) == (3, pytest.approx(2.952 / 2.22))
    assert spec.best_gamma(0.8, 1.0, vcpu, 0.02)[0] == 1                 # a draft as dear as the target
    free = {k: 1.0 for k in range(1, 10)}
    assert spec.best_gamma(0.8, 0.0, free, 0.0)[0] == 8                  # free drafts: the longest round
    assert spec.best_gamma(0.8, 0.0, {k: 1.0 for k in range(1, 5)}, 0.0)[0] == 3   # γ needs v(γ + 1)


@pytest.mark.parametrize("alpha", [0.05, 0.4, 0.73, 0.95])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_alpha_round_trip(alpha, gamma):
    assert spec.alpha_from_accepted(spec.tau(alpha, gamma) - 1, gamma) == pytest.approx(alpha, abs=1e-9)


def test_best_gammas_per_group_and_overall():
    table = [{"group": grp, "drafter": "draft", "gamma": g, "measured": m, "predicted": m + 0.1}
             for grp, ms in (("a", {1: 1.1, 2: 1.3}), ("b", {1: 1.2, 2: 0.9})) for g, m in ms.items()]
    best = {(b["group"], b["drafter"]): b for b in spec.best_gammas(table, [1, 2])}
    assert best[("a", "draft")]["best γ"] == 2 and best[("b", "draft")]["best γ"] == 1
    assert best[("overall", "draft")]["best γ"] == 1                    # √(1.1·1.2) > √(1.3·0.9)
    assert best[("overall", "draft")]["predicted"] == pytest.approx((1.2 * 1.3) ** 0.5)
