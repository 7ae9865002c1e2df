"""The kernels: every SIMD path equals the scalar reference bit for bit and a float64
NumPy reference within float32 rounding; a k-token call equals k single-token calls; the
thread split never changes a bit; bad arguments are exceptions, not crashes."""
import numpy as np
import pytest

from lab import formats, kernels, native

from .conftest import simd_paths
from .test_native import ScalarOnlyCPU

SHAPES = [(1, 32), (7, 96), (33, 544), (64, 512), (19, 1056), (130, 2080)]   # odd rows, partial groups


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def reference64(W, x):
    """float64 result of the quantized inputs, and a bound on float32 rounding along the sum."""
    q, d, _ = formats.quantize_acts(x)
    A = (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(x.shape)
    Wd = W.dequantize().astype(np.float64)
    y = A @ Wd.T
    bound = 4 * (W.cols // 32 + 8) * 2.0**-24 * (np.abs(A) @ np.abs(Wd).T) + 1e-30
    return y, bound


@pytest.fixture(params=["q4", "q8"])
def fmt(request):
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [1, 3, 16])
def test_scalar_reference_against_float64(fmt, shape, k, rng):
    W = formats.quantize(rng.standard_normal(shape).astype(np.float32), fmt)
    x = rng.standard_normal((k, shape[1])).astype(np.float32)
    y = kernels.matmul(W, x, path="scalar")
    want, bound = reference64(W, x)
    assert (np.abs(y - want) <= bound).all()


@pytest.mark.parametrize("path", simd_paths())
@pytest.mark.parametrize("shape", SHAPES)
def test_simd_equals_scalar_bit_for_bit(fmt, path, shape, rng):
    W = formats.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), fmt)
    for k in (1, 2, 5, 16):
        x = (rng.standard_normal((k, shape[1])) * 3).astype(np.float32)
        want = kernels.matmul(W, x, path="scalar")
        got = kernels.matmul(W, x, path=path)
        assert np.array_equal(bits(got), bits(want)), (path, k)
        ref, bound = reference64(W, x)
        assert (np.abs(got - ref) <= bound).all()


@pytest.mark.parametrize("path", native.supported_paths())
def test_k_tokens_equal_k_single_calls(fmt, path, rng):
    W = formats.quantize(rng.standard_normal((45, 608)).astype(np.float32), fmt)
    x = rng.standard_normal((16, 608)).astype(np.float32)
    singles = np.stack([kernels.matmul(W, x[t:t + 1], path=path)[0] for t in range(16)])
    for k in range(1, 17):
        got = kernels.matmul(W, x[:k], path=path)
        assert np.array_equal(bits(got), bits(singles[:k])), k


@pytest.mark.parametrize("path", native.supported_paths())
@pytest.mark.parametrize("rows", [257, 16001])  # guided: static under 4 MB; shrinking shares over
def test_thread_split_changes_nothing(fmt, path, rows, rng):
    W = formats.quantize(rng.standard_normal((rows, 512)).astype(np.float32), fmt)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    one = kernels.matmul(W, x, path=path)
    threads = min(2, len(__import__("os").sched_getaffinity(0)))
    pool = kernels.Pool(threads)
    for chunk in (0, 1, 16, 1000, "guided", "redo"):
        got = kernels.matmul(W, x, path=path, pool=pool, chunk=chunk)
        assert np.array_equal(bits(got), bits(one)), chunk
    unpinned = kernels.Pool(threads, pin=False)
    assert np.array_equal(bits(kernels.matmul(W, x, path=path, pool=unpinned)), bits(one))


def two_cpus():
    cpus = sorted(__import__("os").sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("a slow worker beside a fast one needs two CPUs")
    return cpus[:2]


def slowed_3x(fmt, path, rng, rows, cols):
    """A matrix, 4 tokens, their one-thread product, and a 2-thread pool whose worker is slowed 3x."""
    W = formats.quantize(rng.standard_normal((rows, cols)).astype(np.float32), fmt)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    cpus = two_cpus()
    return W, x, kernels.matmul(W, x, path=path), kernels.Pool(2, cpus=cpus).slow(cpus[1], 3.0)


@pytest.mark.parametrize("path", native.supported_paths())
def test_a_slow_worker_changes_nothing_but_its_share(fmt, path, rng):
    """With one worker slowed 3x, the guided split's small matrices go in ranges sized to the
    threads' speeds (SPLIT_WEIGHTED): the fast thread's share grows, and every result stays
    bit for bit the one-thread result."""
    W, x, one, pool = slowed_3x(fmt, path, rng, 257, 512)
    assert pool.shares == [0.0, 0.0]
    for i in range(300):    # a call whose worker came late (another process on its CPU) measures nothing
        assert np.array_equal(bits(kernels.matmul(W, x, path=path, pool=pool, chunk="guided")), bits(one))
        if i >= 29 and pool.shares[0] > 0:
            break
    assert pool.shares[0] > 0.6 and sum(pool.shares) == pytest.approx(1.0)
    for chunk in (0, 1, 16, "redo"):
        assert np.array_equal(bits(kernels.matmul(W, x, path=path, pool=pool, chunk=chunk)), bits(one)), chunk


@pytest.mark.parametrize("path", native.supported_paths())
def test_redo_measures_a_slowed_worker(fmt, path, rng):
    """Under "redo", with one worker slowed 3x, the pool's timing of each thread's pieces puts
    the slowed one at about a third of the first thread's speed (which its share of a redo call
    follows), and every result stays bit for bit the one-thread result. About a third: on a
    shared host each CPU's own speed moves it (0.32-0.61 on one), far from the 1.0 that a
    dropped report leaves."""
    W, x, one, pool = slowed_3x(fmt, path, rng, 4097, 4096)     # pieces long enough to time, past L2
    assert pool.redo_speeds == [1.0, 1.0]
    for _ in range(30):     # a static call between: a parallel_for job between redo jobs, as a pass makes
        for chunk in ("redo", 0):
            assert np.array_equal(bits(kernels.matmul(W, x, path=path, pool=pool, chunk=chunk)), bits(one))
    assert pool.redo_speeds[0] == 1.0 and 0.1 < pool.redo_speeds[1] < 0.75, pool.redo_speeds


def test_weighted_ranges_follow_the_threads_speeds():
    """SPLIT_WEIGHTED: equal ranges until the pool has measured its threads, then ranges in
    proportion to their speeds: with the second worker 3x slower, the first takes about 3/4."""
    import cppyy
    native.lib()
    if not hasattr(cppyy.gbl, "labtest_weighted"):
        cppyy.cppdef("""
        #include <chrono>
        // the ranges each thread got from one SPLIT_WEIGHTED call over n items of 2 us each
        std::vector<int> labtest_weighted(lab::ThreadPool* pool, int n) {
            std::vector<int> got(2 * pool->size(), -1);
            pool->parallel_for(n, lab::SPLIT_WEIGHTED, [](void* ctx, int b, int e, int tid) {
                auto& g = *static_cast<std::vector<int>*>(ctx);
                g[2 * tid] = b;
                g[2 * tid + 1] = e;
                const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(2 * (e - b));
                while (std::chrono::steady_clock::now() < end) {}
            }, &got);
            return got;
        }""")
    cpus = two_cpus()
    pool = kernels.Pool(2, cpus=cpus)
    assert list(cppyy.gbl.labtest_weighted(pool._pool, 100)) == [0, 50, 50, 100]
    pool.slow(cpus[1], 3.0)
    for _ in range(30):
        got = list(cppyy.gbl.labtest_weighted(pool._pool, 100))
    assert got[0] == 0 and got[3] == 100 and got[1] == got[2] and 65 <= got[1] <= 85, got


def test_a_slowed_worker_takes_longer():
    """Pool.slow makes each piece of the worker's work take `factor` times as long: a one-thread
    pool slowed 4x takes well over twice as long, and factor 1 turns it off."""
    import time
    W = kernels.pack(formats.quantize(np.ones((16 * 64, 1024), np.float32), "q8"))
    x = np.ones((1, 1024), np.float32)
    cpu = two_cpus()[1]
    pool = kernels.Pool(1, cpus=[cpu])

    def secs():
        t0 = time.perf_counter()
        for _ in range(50):
            kernels.matmul(W, x, pool=pool)
        return time.perf_counter() - t0
    secs()
    alone = min(secs() for _ in range(3))
    assert min(secs() for _ in range(3)) < 1.5 * alone      # the same, a second time
    pool.slow(cpu, 4.0)
    assert pool.slowed == (cpu, 4.0) and min(secs() for _ in range(3)) > 2 * alone
    pool.slow(cpu, 1.0)
    assert pool.slowed is None and min(secs() for _ in range(3)) < 1.5 * alone


def test_a_bad_slow_worker_is_refused():
    pool = kernels.Pool(1)
    with pytest.raises(ValueError, match="not one of this pool's CPUs"):
        pool.slow(10_000, 2.0)
    for bad in (0.5, 17.0):
        with pytest.raises(ValueError, match="between 1 and 16"):
            pool.slow(pool.cpus[0], bad)


def test_extreme_activations_stay_exact(fmt, rng):
    """Saturated int8 activations and the largest nibbles: no int16 overflow on any path."""
    w = np.where(rng.random((8, 256)) < 0.5, -1.0, 1.0).astype(np.float32)
    w[:, ::32] = -8.0 if fmt == "q4" else 127.0
    W = formats.quantize(w, fmt)
    x = np.where(rng.random((3, 256)) < 0.5, -127.0, 127.0).astype(np.float32)
    want = kernels.matmul(W, x, path="scalar")
    ref, bound = reference64(W, x)
    assert (np.abs(want - ref) <= bound).all()
    for path in simd_paths():
        assert np.array_equal(bits(kernels.matmul(W, x, path=path)), bits(want)), path


@pytest.mark.parametrize("e", [formats.ACT_EXP_MIN, -1, 0, formats.ACT_EXP_MAX - 30])
def test_zero_and_extreme_weight_scales_at_every_activation_exponent(fmt, e, rng):
    """The AVX-512 kernel scales by adding the activations' exponent to the weights' scales, so
    zero, the largest and the smallest fp16 scales must still give the product bit for bit."""
    W = formats.quantize((rng.standard_normal((40, 256)) * 0.1).astype(np.float32), fmt)
    d = W.d.reshape(40, -1)
    d[0] = 0                                                  # zero scales beside live nibbles
    d[1] = 0x8000                                             # -0
    d[2, ::2], d[2, 1::2] = 0x7bff, 0xfbff                    # fp16's largest, both signs
    d[3, ::2], d[3, 1::2] = 0x0001, 0x8001                    # its smallest subnormals
    x = (rng.uniform(-1, 1, (3, 256)) * 127 * 2.0**e).astype(np.float32)
    x[:, ::32] = 127 * 2.0**e                                 # every block's scale is 2^e
    assert (formats.quantize_acts(x)[1] == np.float32(2.0**e)).all()
    want = kernels.matmul(W, x, path="scalar")
    assert np.isfinite(want).all() and (want[:, :2] == 0).all()
    for path in simd_paths():
        assert np.array_equal(bits(kernels.matmul(W, x, path=path)), bits(want)), path


@pytest.mark.parametrize("h", [0x7c00, 0xfc00, 0x7e00])
def test_a_nan_or_inf_weight_scale_is_refused(h, rng):
    W = formats.quantize(rng.standard_normal((20, 64)).astype(np.float32), "q4")
    W.d.reshape(-1)[37] = h
    with pytest.raises(ValueError, match=r"W.d\[37\] is a NaN or inf"):
        kernels.matmul(W, np.ones((1, 64), np.float32))


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------

@pytest.fixture
def W(rng):
    return formats.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q4")


def test_wrong_dtype(W):
    with pytest.raises(TypeError, match="x must be float32"):
        kernels.matmul(W, np.ones((1, 64), np.float64))
    with pytest.raises(TypeError, match="W.d must be uint16"):
        kernels.matmul(formats.QTensor("q4", (8, 64), W.d.view(np.int16), W.q), np.ones((1, 64), np.float32))


def test_non_contiguous(W):
    x = np.ones((1, 128), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        kernels.matmul(W, x)


def test_misaligned(W):
    raw = formats.aligned_empty((W.q.size + 1,), np.uint8)
    q = raw[1:].reshape(W.q.shape)
    q[...] = W.q
    with pytest.raises(ValueError, match="W.q must start on a 64-byte boundary"):
        kernels.matmul(formats.QTensor("q4", W.shape, W.d, q), np.ones((1, 64), np.float32))


def test_mismatched_shapes(W):
    with pytest.raises(ValueError, match="x has 96 columns but W has shape"):
        kernels.matmul(W, np.ones((1, 96), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.matmul(W, np.ones((1, 70), np.float32))
    with pytest.raises(ValueError, match="W.q holds"):
        kernels.matmul(formats.QTensor("q4", (8, 64), W.d, W.q[:4]), np.ones((1, 64), np.float32))
    with pytest.raises(ValueError, match="out has shape"):
        kernels.matmul(W, np.ones((2, 64), np.float32), out=np.empty((1, 8), np.float32))


@pytest.mark.parametrize("k", [17, 40])
def test_k_out_of_range(W, k):
    with pytest.raises(ValueError, match="k=.*1 to 16"):
        kernels.matmul(W, np.ones((k, 64), np.float32))


def test_too_many_threads():
    import os
    n = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="threads=.*more than"):
        kernels.Pool(n + 1)
    with pytest.raises(ValueError, match="cpus="):
        kernels.Pool(1, cpus=[10_000])


def test_bad_path_and_chunk(W, monkeypatch):
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="not a kernel path"):
        kernels.matmul(W, x, path="neon")
    for bad in (-1, "fast", True, 2.0):
        with pytest.raises(ValueError, match="split"):
            kernels.matmul(W, x, chunk=bad)
    real = native.lib()
    monkeypatch.setattr(native, "lib", lambda: ScalarOnlyCPU(real))     # a CPU without SIMD, on any CPU
    with pytest.raises(native.UnsupportedCPU, match="path='avxvnni' needs .* lacks; it runs: scalar$"):
        kernels.matmul(W, x, path="avxvnni")
    assert np.array_equal(bits(kernels.matmul(W, x)), bits(kernels.matmul(W, x, path="scalar")))


@pytest.mark.parametrize("path", native.supported_paths())
def test_forced_path_is_the_default(W, path, monkeypatch, rng):
    """LAB_KERNEL_PATH sets the path a call without path= takes, read at each call (scalar
    runs on every CPU, so this runs everywhere)."""
    monkeypatch.setenv("LAB_KERNEL_PATH", path)
    assert native.active_path() == path
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(bits(kernels.matmul(W, x)), bits(kernels.matmul(W, x, path=path)))


def test_cpp_guards_without_python_checks(ns, W):
    """The C++ entry point refuses bad shapes on its own (for callers that skip lab.kernels)."""
    acts = kernels.Acts(np.ones((1, 96), np.float32))
    y = np.zeros((1, 8), np.float32)
    assert ns.matmul(kernels.pack(W).view(), acts._acts, y, 8, 0, __import__("cppyy").nullptr, 0) == ns.MM_SHAPE
    assert ns.QActs().quantize(np.ones(40, np.float32), 1, 40, 0, np.zeros(1, np.int64)) == ns.Q_BAD_SHAPE
