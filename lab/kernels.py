"""The Python face of the C++ kernels: thread pools, activation quantization, matmul.

Every argument is checked here, so a wrong dtype, a non-contiguous or misaligned array,
a shape mismatch or a k out of range is a Python exception naming the argument, never a
crash in C++. Arrays pass to C++ zero-copy; the GIL is released while it runs.
"""
from __future__ import annotations

import numpy as np

from . import native
from .formats import ACT_EXP_MAX, ALIGN, BYTES_PER_BLOCK, QK, QTensor, QuantizationError, aligned_copy, aligned_empty

_QUANTIZED = ("q8", "q4")            # the formats the kernels take
_MM_ERRORS = {1: "unknown weight format", 2: "shapes do not match", 3: "k out of range",
              4: "kernel path not supported by this CPU"}


def check_array(a, name: str, dtype, ndim: int | None = None, align: int | None = None,
                writeable: bool = False) -> np.ndarray:
    """The checks a buffer passes before C++ touches it (writeable: C++ writes into it)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if align and a.ctypes.data % align:
        raise ValueError(f"{name} must start on a {align}-byte boundary (use lab.formats.aligned_copy)")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only: pass a writeable array (or none, for a new one)")
    return a


class Pool:
    """Persistent worker threads, each pinned to its own CPU (the caller is thread 0).

    threads: how many (default: every CPU this process may use); cpus: which CPUs, in
    thread order (default: the allowed CPUs in order); pin: False leaves placement to the OS.
    """

    def __init__(self, threads: int | None = None, cpus: list[int] | None = None, pin: bool = True):
        ns = native.lib()
        import os
        allowed = sorted(os.sched_getaffinity(0))
        n = len(cpus) if threads is None and cpus else (len(allowed) if threads is None else threads)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if n > len(allowed):
            raise ValueError(f"threads={n} is more than the {len(allowed)} CPUs this process may use "
                             f"({allowed}); oversubscribed spin barriers stall for whole scheduler ticks")
        if cpus is not None:
            cpus = [int(c) for c in cpus]
            if len(cpus) != n:
                raise ValueError(f"cpus lists {len(cpus)} CPUs for threads={n}")
            if len(set(cpus)) != n or any(c not in allowed for c in cpus):
                raise ValueError(f"cpus={cpus} must be distinct CPUs among those allowed: {allowed}")
        self.threads, self.cpus, self.pin = n, cpus or allowed[:n], pin
        vec = __import__("cppyy").gbl.std.vector["int"](self.cpus)
        self._pool = ns.ThreadPool(n, vec, pin)
        self.slowed: tuple[int, float] | None = None

    def slow(self, cpu: int, factor: float) -> "Pool":
        """Emulates a core `factor` times slower: the worker for `cpu` (pinned there, or in its
        place when unpinned) follows each piece of its work with a spin as long as (factor - 1)
        times the piece (lab.slowcore); factor 1 turns it off. -> self"""
        if cpu not in self.cpus:
            raise ValueError(f"cpu {cpu} is not one of this pool's CPUs {self.cpus}")
        from .slowcore import MAX_FACTOR
        if not 1 <= factor <= MAX_FACTOR:
            raise ValueError(f"a slow core's factor must be between 1 and {MAX_FACTOR}, got {factor}")
        self._pool.slow(self.cpus.index(cpu), float(factor))
        self.slowed = (cpu, float(factor)) if factor > 1 else None
        return self

    @property
    def shares(self) -> list[float]:
        """Each thread's share of the speed, as the weighted split (the guided split's small
        matrices) measured it over its recent calls; 0s until one ran."""
        return list(self._pool.shares())

    @property
    def redo_speeds(self) -> list[float]:
        """Each thread's speed over the first's, as the redo split measured it over its recent
        calls (1s until measured): each thread's share of a redo call follows them."""
        return list(self._pool.redo_speeds())

    def __repr__(self) -> str:
        slow = f", slowed={self.slowed}" if self.slowed else ""
        return f"Pool(threads={self.threads}, cpus={self.cpus}, pin={self.pin}{slow})"


def _pool_ptr(pool: Pool | None):
    if pool is None:
        import cppyy
        return cppyy.nullptr
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a lab.kernels.Pool or None, got {type(pool).__name__}")
    return pool._pool


class Acts:
    """k tokens of a matmul input, quantized once to 8-bit blocks by the C++ quantizer."""

    def __init__(self, x: np.ndarray, path: str | None = None):
        x = check_array(x, "x", np.float32)
        if x.ndim == 1:
            x = x.reshape(1, -1)
        if x.ndim != 2:
            raise ValueError(f"x must be [k, cols] or [cols], got shape {x.shape}")
        k, cols = x.shape
        if k < 1 or cols < QK or cols % QK:
            raise ValueError(f"x has shape {x.shape}: need k >= 1 and cols a positive multiple of {QK}")
        ns = native.lib()
        self.path = native.path_id(path)
        self._acts = ns.QActs()
        bad = np.zeros(1, np.int64)
        rc = self._acts.quantize(x, k, cols, self.path, bad)
        if rc == 1:
            i = int(bad[0])
            raise QuantizationError(f"x has {x.flat[i]} at token {i // cols}, column {i % cols}: NaN, inf "
                                    f"and values past 127 * 2^{ACT_EXP_MAX} cannot be quantized")
        if rc != 0:
            raise ValueError(f"x has shape {x.shape}: cannot quantize (code {rc})")
        self.k, self.cols = k, cols

    def blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The canonical blocks: int8 [k, nb, 32], fp32 scales [k, nb], int32 sums [k, nb]."""
        nb = self.cols // QK
        q = np.zeros((self.k, nb, QK), np.int8)
        d = np.zeros((self.k, nb), np.float32)
        s = np.zeros((self.k, nb), np.int32)
        self._acts.export_blocks(q, d, s)
        return q, d, s


def quantize_acts(x: np.ndarray, path: str | None = None) -> Acts:
    return Acts(x, path)


def check_qtensor(W: QTensor, name: str = "W") -> None:
    if not isinstance(W, QTensor):
        raise TypeError(f"{name} must be a lab.formats.QTensor, got {type(W).__name__}")
    if W.fmt not in _QUANTIZED:
        raise ValueError(f"{name}.fmt={W.fmt!r}: kernels take {', '.join(_QUANTIZED)}")
    rows, cols = W.shape
    if cols % QK or rows < 1:
        raise ValueError(f"{name}.shape={W.shape}: need rows >= 1 and cols a multiple of {QK}")
    nb = cols // QK
    check_array(W.d, f"{name}.d", np.uint16, align=ALIGN)
    check_array(W.q, f"{name}.q", np.uint8, align=ALIGN)
    if W.d.size != rows * nb:
        raise ValueError(f"{name}.d holds {W.d.size} scales; shape {W.shape} needs {rows * nb}")
    bad = np.flatnonzero((W.d & 0x7C00) == 0x7C00)
    if bad.size:
        raise ValueError(f"{name}.d[{bad[0]}] is a NaN or inf fp16 scale: the kernels take finite scales only")
    if W.q.size != rows * nb * BYTES_PER_BLOCK[W.fmt]:
        raise ValueError(f"{name}.q holds {W.q.size} bytes; shape {W.shape} in {W.fmt} needs "
                         f"{rows * nb * BYTES_PER_BLOCK[W.fmt]}")


def qmat(W: QTensor):
    check_qtensor(W)
    return native.lib().make_qmat(native.consts().formats[W.fmt], W.rows, W.cols, W.d, W.q)


class Packed:
    """A QTensor repacked for the kernels: tiles of 16 rows, one row per register lane."""

    def __init__(self, W: QTensor):
        ns = native.lib()
        self._packed = ns.Packed()
        rc = self._packed.pack(qmat(W))
        if rc:
            raise ValueError(f"cannot pack W: {_MM_ERRORS.get(rc, rc)}")
        self.fmt, self.shape, self.nbytes = W.fmt, W.shape, W.nbytes
        self.rows, self.cols = W.shape

    def view(self):
        return self._packed.view()


def pack(W: QTensor) -> Packed:
    return Packed(W)


def split_code(split: int | str) -> int:
    """How work on 16-row tiles is split over a pool, as the C++ takes it: 0 static halves,
    n > 0 hands out n tiles at a time, "guided" (the engine's) shares shrinking to the tuned
    guided_min_bytes of weights, and static ranges sized to each thread's measured speed
    (`Pool.shares`) for matrices under guided_from_bytes (lab.tune; `lab info` shows the
    values in force), "redo": each thread's share sized to its speed, in pieces either thread
    may compute, so a thread out of work computes those a worker holds too long, and "auto"
    (an engine's default): redo or guided, as the tuning's redo_split says."""
    if split in ("guided", "redo", "auto"):
        return int(getattr(native.lib(), f"SPLIT_{split.upper()}"))
    if isinstance(split, bool) or not isinstance(split, int) or split < 0:
        raise ValueError(f"split must be 0 (static), a positive tile count, 'guided', 'redo' or 'auto', got {split!r}")
    return split


def matmul(W, x, path: str | None = None, pool: Pool | None = None, chunk: int | str = 0,
           out: np.ndarray | None = None) -> np.ndarray:
    """y[t, r] = sum_c W[r, c] x[t, c] for k = 1..16 tokens in one pass over W -> [k, rows].

    W: a QTensor (packed on each call) or a Packed; x: float32 [k, cols] or an Acts.
    chunk: the split over the pool (see split_code); the result is the same for every split.
    """
    Wp = W if isinstance(W, Packed) else Packed(W)
    acts = x if isinstance(x, Acts) else Acts(x, path)
    p = native.path_id(path)
    if acts.cols != Wp.cols:
        raise ValueError(f"x has {acts.cols} columns but W has shape {Wp.shape}")
    top = native.consts().max_k
    if not 1 <= acts.k <= top:
        raise ValueError(f"x holds k={acts.k} tokens: one pass takes 1 to {top}")
    code = split_code(chunk)
    if out is None:
        out = np.empty((acts.k, Wp.rows), np.float32)
    check_array(out, "out", np.float32, ndim=2, writeable=True)
    if out.shape != (acts.k, Wp.rows):
        raise ValueError(f"out has shape {out.shape}, needs {(acts.k, Wp.rows)}")
    rc = native.lib().matmul(Wp.view(), acts._acts, out, Wp.rows, p, _pool_ptr(pool), code)
    if rc:
        raise ValueError(f"matmul: {_MM_ERRORS.get(rc, rc)}")
    return out


def quantize(x: np.ndarray, fmt: str, name: str = "x") -> QTensor:
    """The C++ quantizer (what export uses for speed); byte-identical to lab.formats.quantize."""
    if fmt not in _QUANTIZED:
        raise ValueError(f"fmt={fmt!r}: quantized formats are {', '.join(_QUANTIZED)}")
    x = check_array(np.asarray(x), name, np.float32, ndim=2)
    rows, cols = x.shape
    if cols % QK:
        raise ValueError(f"{name} has {cols} columns: block formats need a multiple of {QK}")
    nb = cols // QK
    d = aligned_empty((rows, nb), np.uint16)
    q = aligned_empty((rows, nb * BYTES_PER_BLOCK[fmt]), np.uint8)
    bad = np.zeros(1, np.int64)
    ns = native.lib()
    rc = (ns.quantize_q4(x, x.size, d, q, bad) if fmt == "q4"
          else ns.quantize_q8(x, x.size, d, q.view(np.int8), bad))
    if rc == 1:
        raise QuantizationError(f"{name} has a non-finite value at flat index {int(bad[0])}: "
                                f"NaN and inf cannot be quantized")
    if rc == 2:
        raise QuantizationError(f"{name}: the block at flat index {int(bad[0])} needs a scale past "
                                f"fp16's range; rescale the tensor or keep it in f32")
    return QTensor(fmt, (rows, cols), d, q)


def random_qtensor(fmt: str, rows: int, cols: int, seed: int = 0) -> QTensor:
    """A matrix of random quantized bytes and modest scales, made fast in C++ (for benchmarks)."""
    nb = cols // QK
    q = aligned_empty((rows, nb * BYTES_PER_BLOCK[fmt]), np.uint8)
    native.lib().fill_random(q, q.size, seed)
    rng = np.random.default_rng(seed)
    d = aligned_copy(rng.uniform(1e-3, 2e-2, (rows, nb)).astype(np.float16).view(np.uint16))
    return QTensor(fmt, (rows, cols), d, q)
