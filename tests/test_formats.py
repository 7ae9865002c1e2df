"""The block formats: C++ and NumPy quantizers produce identical bytes, edge cases included."""
import numpy as np
import pytest

from lab import formats, kernels, native
from lab.formats import QuantizationError


def edge_matrix(rng, cols=96):
    """Rows that probe each rounding rule."""
    rows = [
        np.zeros(cols),                                        # all-zero blocks
        np.where(np.arange(cols) % 2, -0.0, 0.0),              # signed zeros
        np.tile(np.linspace(-127, 127, 32), cols // 32) / 7,   # ties of q at .5 (w/d = k + .5)
        np.array([-3.0, 3.0] * (cols // 2)),                   # equal magnitudes: the first wins
        np.array([3.0, -3.0] * (cols // 2)),
        -np.abs(rng.standard_normal(cols)) * 1e3,              # largest magnitude negative
        rng.standard_normal(cols) * 1e-30,                     # scales underflow in fp16
        np.full(cols, 4000.0),                                 # q4 scale near fp16's limit
        (np.arange(cols) - cols / 2) * 0.5,                    # exact halves
    ]
    m = np.stack(rows).astype(np.float32)
    m[5, 7] = -np.float32(np.finfo(np.float16).max) * 7.9    # the largest allowed q4 scale, negative
    return m


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_cpp_and_numpy_bytes_identical_random(fmt, rng):
    for scale in (1e-3, 1.0, 50.0):
        x = (rng.standard_normal((37, 160)) * scale).astype(np.float32)
        a, b = kernels.quantize(x, fmt), formats.quantize(x, fmt)
        assert a.d.tobytes() == b.d.tobytes()
        assert a.q.tobytes() == b.q.tobytes()


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_cpp_and_numpy_bytes_identical_edges(fmt, rng):
    x = edge_matrix(rng)
    a, b = kernels.quantize(x, fmt), formats.quantize(x, fmt)
    assert a.d.tobytes() == b.d.tobytes()
    assert a.q.tobytes() == b.q.tobytes()


def test_rounding_rules_by_hand():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3] = 127.0, 0.5, -0.5, 1.5             # d = 1: halves go away from zero
    d, q = formats.quantize_q8(x)
    assert formats.fp16_to_f32(d)[0] == 1.0
    assert list(q[0, :4]) == [127, 1, -1, 2]
    x = np.zeros(32, np.float32)
    x[0], x[1], x[16] = -8.0, 4.0, 7.0                         # q4: d = -8/-8 = 1
    d, q = formats.quantize_q4(x)
    assert formats.fp16_to_f32(d)[0] == 1.0
    assert q[0, 0] & 15 == 0 and q[0, 1] & 15 == 12 and q[0, 0] >> 4 == 15   # 7+8.5 -> 15
    x[0] = 8.0                                                 # largest positive: d = -1
    d, q = formats.quantize_q4(x)
    assert formats.fp16_to_f32(d)[0] == -1.0 and q[0, 0] & 15 == 0


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_dequantize_matches_cpp(fmt, rng, ns):
    x = rng.standard_normal((5, 64)).astype(np.float32)
    W = formats.quantize(x, fmt)
    out = np.zeros(x.size, np.float32)
    if fmt == "q8":
        ns.dequantize_q8(W.d, W.q.view(np.int8), x.size, out)
    else:
        ns.dequantize_q4(W.d, W.q, x.size, out)
    assert np.array_equal(out.reshape(x.shape), W.dequantize())
    step = np.abs(formats.fp16_to_f32(W.d)).reshape(5, -1, 1)
    err = np.abs(W.dequantize() - x).reshape(5, -1, 32)
    # half a step (a whole one at q4's clamped edge), plus the scale's own fp16 rounding
    bound = (0.5 + 127 * 2.0**-11) if fmt == "q8" else (1.0 + 8 * 2.0**-11)
    assert (err <= step * bound + 1e-6).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_nonfinite_rejected(fmt, bad):
    x = np.ones((2, 64), np.float32)
    x[1, 33] = bad
    for quant in (formats.quantize, kernels.quantize):
        with pytest.raises(QuantizationError, match="non-finite.*97"):
            quant(x, fmt, "x")


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_scale_overflow_rejected(fmt):
    x = np.ones((1, 32), np.float32)
    x[0, 0] = 3e38
    for quant in (formats.quantize, kernels.quantize):
        with pytest.raises(QuantizationError, match="fp16"):
            quant(x, fmt)


def test_fp16_conversion_matches_numpy(ns, rng):
    h = np.arange(1 << 16, dtype=np.uint16)
    back = h.view(np.float16).astype(np.float32)
    cpp = np.array([ns.f16_to_f32(int(v)) for v in h[::97]], np.float32)
    assert np.array_equal(cpp.view(np.uint32)[~np.isnan(cpp)], back[::97].view(np.uint32)[~np.isnan(cpp)])
    # float -> half around every boundary: subnormals, ties, overflow
    f = np.concatenate([
        rng.standard_normal(3000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 3000),
        (h[:2048].view(np.float16).astype(np.float32) * np.float32(1.5)),       # subnormal ties
        np.array([65504, 65519.99, 65520, 65536, 2**-25, 2**-24, 2**-26, 1e-8, 0.0, -0.0], np.float32),
    ]).astype(np.float32)
    cpp = np.array([ns.f32_to_f16(float(v)) for v in f], np.uint16)
    with np.errstate(over="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    assert np.array_equal(cpp, want)
    for path in native.supported_paths():                  # the KV cache's row conversion
        row = np.zeros(f.size, np.uint16)
        ns.f32_to_f16_row(f, f.size, row, native.path_id(path))
        assert np.array_equal(row, want), path


def test_activation_blocks_identical_on_every_path(rng):
    x = (rng.standard_normal((3, 224)) * 4).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = np.linspace(-127, 127, 32) / 11
    x[2, 5] = -1e-40                                          # a subnormal input
    want = formats.quantize_acts(x)
    from lab import native
    for path in native.supported_paths():
        got = kernels.Acts(x, path).blocks()
        for g, w in zip(got, want):
            assert g.tobytes() == w.tobytes(), path


def test_activation_scales_are_the_least_powers_of_two(rng, ns):
    """Each block's scale is the smallest 2^e with max|x| <= 127 * 2^e, e clamped below, on
    every path; the exponent limits are the engine's own."""
    assert (formats.ACT_EXP_MIN, formats.ACT_EXP_MAX) == (int(ns.ACT_EXP_MIN), int(ns.ACT_EXP_MAX))
    amax = np.array([127, 128, 127.5, 63.5, 63.49, 1.0, 1e-40, 1e-30, 127 * 2.0**112], np.float32)
    x = (rng.uniform(-1, 1, (amax.size, 32)) * amax[:, None] * 0.99).astype(np.float32)
    x[:, 9] = amax
    q, d, _ = formats.quantize_acts(x)
    assert d[:, 0].tolist() == [1, 2, 2, 0.5, 0.5, 2.0**-6, 2.0**-100, 2.0**-100, 2.0**112]
    assert np.abs(q).max() <= 127
    for path in native.supported_paths():
        for g, w in zip(kernels.Acts(x, path).blocks(), (q, d)):
            assert g.tobytes() == w.tobytes(), path


def test_activation_scales_at_every_exponent_and_mantissa_edge():
    """The engine reads a block's exponent from amax's bits; numpy's frexp and ldexp define it.
    Every float exponent up to the largest scale, at the mantissas around 127 * 2^e."""
    edge = 63 << 17                                             # m * 2^7 <= 127 up to here
    mant = np.array([0, 1, edge - 1, edge, edge + 1, (1 << 23) - 1], np.uint32)
    bits = (np.arange(0, 127 + 120, dtype=np.uint32)[:, None] << 23 | mant).ravel()
    amax = bits.view(np.float32)
    amax = amax[(amax > 0) & (amax <= np.float32(127 * 2.0**112))]
    x = np.zeros((amax.size, 32), np.float32)
    x[:, 3] = amax
    x[:, 7] = -amax / 3
    want = formats.quantize_acts(x)
    for path in native.supported_paths():
        for g, w in zip(kernels.Acts(x, path).blocks(), want):
            assert g.tobytes() == w.tobytes(), path


@pytest.mark.parametrize("path", native.supported_paths())
def test_activation_past_the_largest_scale_rejected(path):
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nextafter(np.float32(127 * 2.0**112), np.float32(np.inf))
    with pytest.raises(QuantizationError, match="token 1, column 40"):
        kernels.Acts(x, path)
    with pytest.raises(QuantizationError, match="flat index 104"):
        formats.quantize_acts(x)


def test_activation_nonfinite_rejected():
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    with pytest.raises(QuantizationError, match="token 1, column 40"):
        kernels.Acts(x)


def test_activation_blocks_in_groups_identical_on_every_path(rng):
    """The AVX-512 quantizer takes sixteen blocks at once: many blocks, each at its own scale,
    with exact ties (n + 1/2 times the scale) and values just under them, zero and subnormal
    blocks among them, and a row whose block count leaves a tail."""
    k, nb = 3, 16 * 5 + 7
    e = rng.integers(-60, 60, (k, nb))
    x = (rng.uniform(-127, 127, (k, nb, 32)) * np.exp2(e)[..., None]).astype(np.float32)
    x[..., 0] = 127 * np.exp2(e)                                    # the scale is 2^e
    ties = (rng.integers(-127, 127, (k, nb, 8)) + 0.5) * np.exp2(e)[..., None]
    x[..., 1:9] = ties.astype(np.float32)
    x[..., 9:17] = np.nextafter(x[..., 1:9], np.float32(0))         # just under a tie
    x[0, 3] = 0.0
    x[1, 20] = 1e-40 * rng.uniform(-1, 1, 32)
    x = x.reshape(k, nb * 32)
    want = formats.quantize_acts(x)
    for path in native.supported_paths():
        for g, w in zip(kernels.Acts(x, path).blocks(), want):
            assert g.tobytes() == w.tobytes(), path


@pytest.mark.parametrize("path", native.supported_paths())
@pytest.mark.parametrize("column", [5 * 32 + 7, 15 * 32 + 31, 16 * 32])
def test_activation_rejected_at_its_first_bad_value_inside_a_group(path, column):
    x = np.ones((2, 40 * 32), np.float32)
    x[1, column] = np.inf
    x[1, column + 40] = np.nan
    with pytest.raises(QuantizationError, match=f"token 1, column {column}\\b"):
        kernels.Acts(x, path)


def test_split_layout_regions():
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    W = formats.quantize(x, "q4")
    scales, data = W.regions()
    assert len(scales) == 2 * 2 * 2 and len(data) == 2 * 2 * 16
    assert W.d.ctypes.data % 64 == 0 and W.q.ctypes.data % 64 == 0
