"""Build the C++ in kernels_cpp/ into a shared library, cache it, and load it with cppyy.

The library is cached under a key made of the sources, the flags and the compiler's
version, so an edit rebuilds and an unchanged tree loads in a fraction of a second.
`lib()` returns the `lab` C++ namespace; numpy arrays pass to its pointers zero-copy.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

from .errors import NativeBuildError, UnsupportedCPU

SOURCE_DIR = Path(__file__).resolve().parent.parent / "kernels_cpp"
HEADER = "lab.h"
# -ffp-contract=off: no fused multiply-add behind our back, so the scalar reference and
# the SIMD paths round identically. No -ffast-math, ever: exactness tests depend on it
# (docs/science.md §3).
FLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-fno-fast-math", "-Wall", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]
# Functions that run long enough to want the GIL released while they do.
_RELEASE_GIL = ("matmul", "Packed::pack", "bench_read", "bench_copy", "bench_triad", "bench_dot_peak",
                "bench_matmul", "quantize_q8", "quantize_q4", "dequantize_q8", "dequantize_q4",
                "fill_random", "bench_forward", "Model::forward", "Model::load", "Generator::run")


def cache_dir() -> Path:
    """Where built libraries (and, later, weights) live: $LAB_CACHE or ~/.cache/lab."""
    root = os.environ.get("LAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lab")
    return Path(root)


def flags() -> list[str]:
    """The build flags; LAB_PREFETCH=<bytes> overrides the SIMD kernels' default single-token
    prefetch distance in a 4-bit stream (Tuning in kernels_cpp/lab.h; 0: no request), for
    sweeps: each value is its own cached build."""
    v = os.environ.get("LAB_PREFETCH")
    if not v:
        return FLAGS
    if not v.isdigit() or not 0 <= int(v) <= 1 << 16:
        raise NativeBuildError(f"LAB_PREFETCH={v!r}: give a distance in bytes, 0..65536")
    return [*FLAGS, f"-DLAB_PREFETCH={int(v)}"]


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx or not shutil.which(cxx):
        raise NativeBuildError(
            "no C++ compiler found: install one (Debian/Ubuntu: apt-get install g++) "
            "or point the CXX environment variable at it")
    return cxx


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeBuildError(f"the C++ compiler {cxx!r} does not run: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else cxx


CHECKOUT = ("the lab runs from a checkout of its repository (make setup installs it editable); "
            "a plain `pip install .` copies only the Python package")


def _sources() -> list[Path]:
    if not SOURCE_DIR.is_dir():
        raise NativeBuildError(f"no kernels_cpp/ at {SOURCE_DIR}: {CHECKOUT}")
    files = sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h", ".inc"))
    if not any(p.suffix == ".cpp" for p in files):
        raise NativeBuildError(f"no C++ sources in {SOURCE_DIR}")
    return files


def build_key(cxx: str | None = None) -> str:
    """A hash of every source, the flags and the compiler version."""
    cxx = cxx or compiler()
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(flags()).encode() + b"\0" + _compiler_version(cxx).encode())
    return h.hexdigest()[:20]


def build(verbose: bool = False) -> Path:
    """Compile (or find in the cache) the shared library; returns its path."""
    cxx = compiler()
    out_dir = cache_dir() / "native" / build_key(cxx)
    lib_path = out_dir / "liblab.so"
    if lib_path.exists():
        return lib_path
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:      # two processes building at once wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib_path.exists():
            return lib_path
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        cmd = [cxx, *flags(), "-o", tmp, *[str(p) for p in _sources() if p.suffix == ".cpp"]]
        if verbose:
            print(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
            raise NativeBuildError(
                f"compiling kernels_cpp/ failed ({cxx}, exit {proc.returncode}):\n"
                + "\n".join((errors or proc.stderr.splitlines())[:20])
                + "\nfix the C++ above; the previous build stays cached under its own key")
        os.replace(tmp, lib_path)                   # never a half-written library in place
    return lib_path


def __getattr__(name: str):
    if name == "PATHS":                     # the kernel paths' names, in C++ Path order
        return consts().paths
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def consts() -> SimpleNamespace:
    """The C++ constants Python needs, read once through cppyy so none is retyped here."""
    ns = lib()
    return SimpleNamespace(
        max_k=int(ns.MAX_K),
        tile=int(ns.TILE),
        formats={"f32": int(ns.FMT_F32), "q8": int(ns.FMT_Q8), "q4": int(ns.FMT_Q4), "i32": int(ns.FMT_I32)},
        logits={"none": int(ns.LOGITS_NONE), "last": int(ns.LOGITS_LAST), "all": int(ns.LOGITS_ALL)},
        paths=_path_names(ns),
        archs={"qwen3": int(ns.ARCH_QWEN3), "qwen2": int(ns.ARCH_QWEN2), "llama": int(ns.ARCH_LLAMA)},
        attention={"f32": int(ns.ATT_F32), "bf16": int(ns.ATT_BF16), "amx": int(ns.ATT_AMX)},
        file_version=int(ns.MODEL_FILE_VERSION),
        window_block=int(ns.ATT_WINDOW_BLOCK),
        max_streams=int(ns.MAX_STREAMS),
        two_groups=(int(ns.TWO_GROUPS_FIRST), int(ns.TWO_GROUPS_LAST)),
        streams_k5_from=int(ns.STREAMS_K5_FROM),
        streams_k9_from=int(ns.STREAMS_K9_FROM))


def _path_names(ns) -> tuple[str, ...]:
    return tuple(str(ns.path_name(i)) for i in range(int(ns.PATH_COUNT)))


def loaded_key() -> str:
    """The build key of the library lib() loaded (its cache folder's name), without hashing the
    sources or asking the compiler again."""
    if "key" not in _LOADED:                # set by lib() before it applies the tuning cache
        lib()
    return _LOADED["key"]


_LOADED: dict = {}


@functools.cache
def lib():
    """The loaded `lab` C++ namespace (built on first use)."""
    path = build()
    try:
        import cppyy
    except ImportError as e:
        raise NativeBuildError("cppyy is not installed: run `make test` or pip install cppyy") from e
    cppyy.add_include_path(str(SOURCE_DIR))
    cppyy.include(HEADER)
    cppyy.load_library(str(path))
    ns = cppyy.gbl.lab
    for name in _RELEASE_GIL:
        owner = ns
        for part in name.split("::"):
            owner = getattr(owner, part)
        owner.__release_gil__ = True
    _check_forced_path(ns)
    _LOADED["key"] = path.parent.name
    from . import tune
    tune.on_load(ns)                        # the cached tuning goes in force; nothing is measured
    return ns


def _check_forced_path(ns) -> None:
    forced = os.environ.get("LAB_KERNEL_PATH")
    if not forced:
        return
    p = ns.path_from_name(forced)
    if p < 0:
        raise UnsupportedCPU(f"LAB_KERNEL_PATH={forced!r} is not a kernel path; use one of {', '.join(_path_names(ns))}")
    if not ns.path_supported(p):
        runs = [name for i, name in enumerate(_path_names(ns)) if ns.path_supported(i)]
        raise UnsupportedCPU(
            f"LAB_KERNEL_PATH={forced!r} needs instructions this CPU lacks; it runs: {', '.join(runs)}")


def supported_paths() -> list[str]:
    ns = lib()
    return [name for i, name in enumerate(consts().paths) if ns.path_supported(i)]


def path_id(name: str | None) -> int:
    """A path name (None: the active path) as the engine's number, checked against the CPU."""
    ns = lib()
    if name is None:
        return ns.active_path()
    if name not in consts().paths:
        raise ValueError(f"path={name!r} is not a kernel path; use one of {', '.join(consts().paths)}")
    p = consts().paths.index(name)
    if not ns.path_supported(p):
        raise UnsupportedCPU(f"path={name!r} needs instructions this CPU lacks; it runs: "
                             f"{', '.join(supported_paths())}")
    return p


def active_path() -> str:
    return consts().paths[lib().active_path()]


def cpu() -> dict:
    """What cpuid says, plus the kernel path each operation uses."""
    ns = lib()
    c = ns.cpu_info()
    flags = {f: bool(getattr(c, f)) for f in (
        "sse42", "avx", "avx2", "fma", "f16c", "avxvnni", "avx512f", "avx512dq", "avx512bw", "avx512vl",
        "avx512vnni", "avx512bf16", "amx_tile", "amx_bf16", "os_avx", "os_avx512", "os_amx", "hybrid")}
    n = int(c.logical_cpus)
    types = {0x40: "performance", 0x20: "efficiency"}
    cores = [types.get(int(ns.core_type(i)), "uniform") for i in range(n)] if flags["hybrid"] else None
    active = ns.active_path()
    path = consts().paths[active]
    return {
        "vendor": bytes(c.vendor).split(b"\0")[0].decode(errors="replace"),
        "model": bytes(c.brand).split(b"\0")[0].decode(errors="replace").strip(),
        "logical_cpus": n,
        "flags": flags,
        "core_types": cores,
        "best_path": consts().paths[ns.best_path()],
        "active_path": path,
        "supported_paths": supported_paths(),
        "kernels": {"matmul_q4": path, "matmul_q8": path,
                    "quantize_activations": "scalar" if path == "scalar" else
                    ("avx512" if path in ("avx512vnni", "vnni256evex") else "avx2"),
                    "sampling": str(ns.sampler_name(active)),
                    # the products attention runs by default, for heads of 128 (Qwen's)
                    "attention": next(n for n, m in consts().attention.items()
                                      if m == int(ns.attention_mode(active, -1, 128)))},
    }


def warn_if_slow() -> str | None:
    """A sentence for the user when the CPU forces the scalar path."""
    if "avx2" not in supported_paths():
        return ("this CPU lacks AVX2/FMA/F16C: the lab runs on the scalar reference kernels, "
                "which are correct but far slower than the ceilings it reports")
    return None
