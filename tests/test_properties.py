"""Property tests (hypothesis) for two rules everything else leans on.

Block formats: for any float32 matrix with a multiple of 32 columns -- zeros and signed
zeros, subnormal and huge magnitudes, a single outlier, halves that tie -- the C++
quantizer (lab.kernels.quantize) and the NumPy one (lab.formats.quantize) give the same
bytes, or both refuse the same block with a QuantizationError.

The acceptance rule (kernels_cpp/sampling.cpp, accept_or_resample): the draft's token x ~ q
is accepted with probability min(1, p(x)/q(x)); on rejection the token comes from
max(0, p - q) normalised; so the token emitted is distributed as p. The engine's Rng is
xoshiro256** with its state in the open, so each test sets the state to give exactly the
uniform numbers it wants and reads the rule's pieces off the C++ itself:
  - the accepted set of u for x, whose size over 2^53 is the acceptance probability;
  - which token each u yields on rejection, i.e. the residual distribution.
Those pieces, put together analytically, must give back p (no sampling, no chi-square:
tests/test_engine.py has the statistical test of the same rule). `ns` is conftest's fixture.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lab import formats, kernels
from lab.formats import QuantizationError

QK = 32
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------
# Block formats: C++ and NumPy quantizers agree byte for byte
# ----------------------------------------------------------------------------

SCALES = [0.0, 1e-38, 1e-30, 1e-10, 1e-5, 1e-3, 1.0, 100.0, 4000.0, 6.0e4, 5.2e5, 8.3e6, 1e7, 1e30, 3e38]
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def block_matrices(draw):
    rows = draw(st.integers(1, 5))
    cols = QK * draw(st.integers(1, 4))
    shape = (rows, cols)
    kind = draw(st.sampled_from(["any", "scaled", "zeros", "outlier", "ties", "constant"]))
    if kind == "any":                       # every float32 hypothesis likes: subnormals, extremes
        return draw(arrays(np.float32, shape, elements=finite32))
    unit = draw(arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    scale = draw(st.sampled_from(SCALES))
    if kind == "scaled":
        return (unit.astype(np.float64) * scale).astype(np.float32)
    if kind == "zeros":                     # +0 and -0
        signs = draw(arrays(np.bool_, shape))
        return np.where(signs, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    if kind == "outlier":                   # one value far from the rest
        x = (unit.astype(np.float64) * draw(st.sampled_from([0.0, 1e-6, 1e-3, 1.0]))).astype(np.float32)
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        x[r, c] = np.float32(draw(st.sampled_from([-1.0, 1.0])) * draw(st.sampled_from(SCALES[1:])))
        return x
    if kind == "ties":                      # w/d lands on .5: the rounding rules decide
        k = draw(arrays(np.int32, shape, elements=st.integers(-255, 255)))
        return (k.astype(np.float64) / 2 * min(max(scale, 1e-3), 1e30) / 7).astype(np.float32)
    v = draw(finite32)                      # one value everywhere (equal magnitudes: first wins)
    signs = draw(arrays(np.bool_, shape))
    return np.where(signs, -v, v).astype(np.float32)


def outcome(quantize, x: np.ndarray, fmt: str):
    """('ok', scales bytes, q bytes) or ('error', kind, flat block index)."""
    try:
        W = quantize(x, fmt)
    except QuantizationError as e:
        msg = str(e)
        m = re.search(r"block (\d+)", msg)            # NumPy: block b; C++: flat index of its first value
        block = int(m.group(1)) if m else int(re.search(r"flat index (\d+)", msg).group(1)) // QK
        return ("error", "non-finite" if "non-finite" in msg else "fp16", block)
    assert W.shape == x.shape and W.d.shape == (x.shape[0], x.shape[1] // QK)
    return ("ok", W.d.tobytes(), W.q.tobytes())


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@FAST
@given(x=block_matrices())
def test_quantizers_agree_byte_for_byte(fmt, x):
    cpp, ref = outcome(kernels.quantize, x, fmt), outcome(formats.quantize, x, fmt)
    assert cpp == ref
    if np.abs(x.astype(np.float64)).max() < 5e5:            # below both formats' fp16 limit
        assert cpp[0] == "ok"


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@settings(max_examples=60, deadline=None)
@given(x=block_matrices(), where=st.integers(0, 10**6), bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_quantizers_both_refuse_nonfinite(fmt, x, where, bad):
    x = x.copy()
    x.flat[where % x.size] = bad
    for quantize in (kernels.quantize, formats.quantize):
        with pytest.raises(QuantizationError):
            quantize(x, fmt)


# ----------------------------------------------------------------------------
# The acceptance rule
# ----------------------------------------------------------------------------

ONE = 1 << 53                     # Rng::uniform() is k / 2^53 for a 53-bit k
M64 = (1 << 64) - 1
INV5, INV9 = pow(5, -1, 1 << 64), pow(9, -1, 1 << 64)


def _rotr(x: int, k: int) -> int:
    return ((x >> k) | (x << (64 - k))) & M64


def _s1_for(out: int) -> int:
    """The s[1] for which xoshiro256**'s next output, rotl(s1 * 5, 7) * 9, is `out`."""
    return (_rotr((out * INV9) & M64, 7) * INV5) & M64


def rng_giving(ns, k1: int, k2: int = 0):
    """An engine Rng whose next two uniform() calls return k1 / 2^53 and k2 / 2^53.
    next() outputs from s[1], then s[1] ^= s[2] ^ s[0]: so s[0] = 0, s[2] = s1 ^ s1'."""
    r = ns.Rng(0)
    a, b = _s1_for(k1 << 11), _s1_for(k2 << 11)
    r.s[0], r.s[1], r.s[2], r.s[3] = 0, a, a ^ b, 1
    return r


def accepted_count(px: float, qx: float) -> int:
    """How many u = k / 2^53 pass the rule's test u * q(x) < p(x), in the engine's double
    arithmetic (Python floats are the same IEEE doubles). The test is monotone in k."""
    if not qx > 0:
        return 0
    lo, hi = 0, ONE                       # the first k that fails lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if (mid * 2.0**-53) * qx < px:
            lo = mid + 1
        else:
            hi = mid
    return lo


@st.composite
def distributions(draw):
    """(p, q) float32, each summing to 1 (to rounding), in shapes that stress the rule:
    disjoint supports, p == q, one-hot, near-zero entries, over several draw blocks."""
    n = draw(st.sampled_from([1, 2, 3, 5, 8, 17, 40, 257, 300]))
    weight = st.one_of(st.just(0.0), st.floats(1e-6, 1.0), st.floats(1e-30, 1e-6))
    wp = draw(arrays(np.float64, n, elements=weight))
    wq = draw(arrays(np.float64, n, elements=weight))
    kind = draw(st.sampled_from(["random", "equal", "disjoint", "one_hot_p", "one_hot_q", "scaled"]))
    if kind == "equal":
        wq = wp.copy()
    elif kind == "disjoint" and n > 1:
        cut = draw(st.integers(1, n - 1))
        wp[cut:], wq[:cut] = 0, 0
    elif kind == "one_hot_p":
        wp[:] = 0
        wp[draw(st.integers(0, n - 1))] = 1
    elif kind == "one_hot_q":
        wq[:] = 0
        wq[draw(st.integers(0, n - 1))] = 1
    elif kind == "scaled":                # q a sharpened p: the draft over-confident
        wq = wp ** 3
    for w in (wp, wq):
        if not w.sum() > 0:
            w[draw(st.integers(0, n - 1))] = 1.0
    return (wp / wp.sum()).astype(np.float32), (wq / wq.sum()).astype(np.float32)


def residual_weights(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What the engine draws from on rejection: max(0, p - q) in float32, or p itself when
    that is zero everywhere (p <= q: then p == q, and the branch is taken with probability 0)."""
    r = np.maximum(np.float32(0), p - q)
    return r if r.astype(np.float64).sum() > 0 else np.where(p > 0, p, np.float32(0))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pq=distributions())
def test_acceptance_probability_is_min_one_p_over_q(ns, pq):
    """For each token x the draft can propose, the accepted set of u has measure
    min(1, p(x)/q(x)) (to 2^-52), and the engine's decision switches exactly there."""
    p, q = pq
    n, path = p.size, ns.active_path()
    acc = np.zeros(1, np.bool_)
    for x in np.flatnonzero(q > 0):
        px, qx = float(p[x]), float(q[x])
        k = accepted_count(px, qx)
        assert abs(k / ONE - min(1.0, px / qx)) <= 2.0**-52
        if p[x] >= q[x]:
            assert k == ONE                # always accepted
        if p[x] == 0:
            assert k == 0                  # never accepted
        if k > 0:                          # the last accepted u
            assert ns.accept_or_resample(p, q, n, int(x), rng_giving(ns, k - 1), acc, path) == x and acc[0]
        if k < ONE:                        # the first rejected u
            ns.accept_or_resample(p, q, n, int(x), rng_giving(ns, k), acc, path)
            assert not acc[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pq=distributions(), pick=st.integers(0, 10**6))
def test_rejection_resamples_the_normalised_residual(ns, pq, pick):
    """On rejection the token is the inverse CDF of max(0, p - q) / its sum at the second
    uniform: only tokens with p > q come out, each over a share of u equal to its weight."""
    p, q = pq
    n, path = p.size, ns.active_path()
    can_reject = [x for x in np.flatnonzero(q > 0) if accepted_count(float(p[x]), float(q[x])) < ONE]
    if not can_reject:                     # p >= q wherever q > 0: nothing is ever rejected
        return
    x = int(can_reject[pick % len(can_reject)])
    k1 = accepted_count(float(p[x]), float(q[x]))          # the first rejected u
    w = residual_weights(p, q)
    positive = np.flatnonzero(w > 0)
    if (p - q > 0).any():
        assert (p[positive] > q[positive]).all()          # support: only where p > q
    w64 = w.astype(np.float64)
    cum, total = np.cumsum(w64), w64.sum()
    acc = np.zeros(1, np.bool_)

    def token(k2: int) -> int:
        t = ns.accept_or_resample(p, q, n, x, rng_giving(ns, k1, k2), acc, path)
        assert not acc[0]
        return t

    thick = [i for i in positive if w64[i] / total >= 1e-9]   # shares wide enough to aim at in doubles
    assert token(0) == positive[0]                         # u = 0: the first token with weight
    # u -> 1: the last token, or past rounding of shares ~1e-16 wide, one with weight after the
    # last wide share (the running sum in order and the total in lanes round apart)
    last = token(ONE - 1)
    assert last in set(positive.tolist()) and last >= thick[-1]
    for i in thick:                                        # the middle of each token's share
        u = (cum[i] - w64[i] / 2) / total
        assert token(int(u * ONE)) == i


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pq=distributions())
def test_emitted_distribution_is_the_target(ns, pq):
    """Put together from the pieces the two tests above read off the engine -- draft
    x ~ q / sum(q), accepted with the measured probability a(x), else a draw from the
    normalised residual r -- the token emitted has P(y) = q(y) a(y) + (1 - sum q a) r(y),
    which must equal p(y)."""
    p, q = pq
    p64, q64 = p.astype(np.float64), q.astype(np.float64)
    qn = q64 / q64.sum()                                   # sample() draws q / its sum
    a = np.array([accepted_count(float(p[x]), float(q[x])) / ONE for x in range(p.size)])
    r = residual_weights(p, q).astype(np.float64)
    r /= r.sum()
    emitted = qn * a + (1.0 - (qn * a).sum()) * r
    np.testing.assert_allclose(emitted, p64 / p64.sum(), rtol=0, atol=2e-6)
    assert abs(emitted.sum() - 1.0) < 1e-9
