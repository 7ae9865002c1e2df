"""The native build: cached by sources, flags and compiler; rebuilt on an edit and only
then; clear errors for a missing compiler, a compile error and a forced path the CPU lacks."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from lab import native
from lab.errors import NativeBuildError

ROOT = native.SOURCE_DIR.parent


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A private copy of kernels_cpp/ and an empty cache."""
    src = tmp_path / "kernels_cpp"
    shutil.copytree(native.SOURCE_DIR, src)
    monkeypatch.setattr(native, "SOURCE_DIR", src)
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    return src


def test_cache_rebuilds_after_edit_and_not_otherwise(tree):
    first = native.build()
    stamp = first.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert native.build() == first                      # unchanged: found, not rebuilt
    assert time.perf_counter() - t0 < 0.5
    assert first.stat().st_mtime_ns == stamp
    with open(tree / "cpu.cpp", "a") as f:
        f.write("\n// an edit\n")
    second = native.build()
    assert second != first and second.exists() and first.exists()


def test_flags_are_part_of_the_key(tree, monkeypatch):
    key = native.build_key()
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ["-DLAB_EXTRA"])
    assert native.build_key() != key


def test_compile_error_is_reported(tree):
    (tree / "broken.cpp").write_text("int broken( { return 0; }\n")
    with pytest.raises(NativeBuildError, match=r"compiling kernels_cpp/ failed(.|\n)*broken\.cpp"):
        native.build()
    assert not list((native.cache_dir() / "native").glob("*/*.so"))   # nothing half-written kept


def test_no_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(NativeBuildError, match="no C\\+\\+ compiler found"):
        native.compiler()


def _lab_info(env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "lab.cli", "info", "--json"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)


class ScalarOnlyCPU:
    """The real C++ namespace, answering the path queries as a CPU without SIMD would: the
    lab's path logic for such a CPU, checked on any CPU."""

    def __init__(self, ns):
        self._ns = ns

    def __getattr__(self, name):
        return getattr(self._ns, name)

    def path_supported(self, path):
        return path == 0

    def best_path(self):
        return 0

    def active_path(self):
        return 0


@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_forced_lower_path(path):
    """A forced path the CPU runs becomes the active one; one it lacks is refused (either way
    the case checks something: scalar runs everywhere)."""
    r = _lab_info({"LAB_KERNEL_PATH": path})
    if path not in native.supported_paths():
        assert r.returncode == 2 and "lacks" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["active_path"] == path and info["kernels"]["matmul_q4"] == path
    assert info["kernels"]["sampling"] == ("scalar" if path == "scalar" else "avx2")


def test_forced_unknown_or_unsupported_path():
    r = _lab_info({"LAB_KERNEL_PATH": "sse9"})
    assert r.returncode == 2 and "not a kernel path" in r.stderr
    missing = [p for p in native.PATHS if p not in native.supported_paths()]
    if missing:
        r = _lab_info({"LAB_KERNEL_PATH": missing[0]})
        assert r.returncode == 2 and "lacks" in r.stderr


def test_a_path_the_cpu_lacks_is_refused_on_any_cpu(monkeypatch):
    cpu = ScalarOnlyCPU(native.lib())
    monkeypatch.setenv("LAB_KERNEL_PATH", "avx2")
    with pytest.raises(native.UnsupportedCPU, match="LAB_KERNEL_PATH='avx2' needs .* lacks; it runs: scalar$"):
        native._check_forced_path(cpu)
    monkeypatch.setenv("LAB_KERNEL_PATH", "scalar")
    native._check_forced_path(cpu)                          # the path every CPU runs passes
    monkeypatch.setattr(native, "lib", lambda: cpu)
    assert native.supported_paths() == ["scalar"] and native.path_id(None) == 0
    assert "lacks AVX2" in native.warn_if_slow()
    with pytest.raises(native.UnsupportedCPU, match="path='avx512vnni' needs .* lacks; it runs: scalar$"):
        native.path_id("avx512vnni")
    info = native.cpu()
    assert info["active_path"] == "scalar" and info["kernels"]["quantize_activations"] == "scalar"
    assert info["kernels"]["sampling"] == "scalar"


def test_cpu_report():
    info = native.cpu()
    assert info["logical_cpus"] >= 1
    assert info["active_path"] in info["supported_paths"]
    assert "scalar" in info["supported_paths"]
    if info["flags"]["avx2"] and info["flags"]["fma"] and info["flags"]["f16c"]:
        assert "avx2" in info["supported_paths"]


def test_no_avx2_message(monkeypatch):
    monkeypatch.setattr(native, "supported_paths", lambda: ["scalar"])
    assert "lacks AVX2" in native.warn_if_slow()
    monkeypatch.setattr(native, "supported_paths", lambda: ["scalar", "avx2"])
    assert native.warn_if_slow() is None


def test_gil_released_while_cpp_runs():
    """A kernel call on one thread does not stop Python on another."""
    import threading
    import numpy as np
    from lab import kernels
    W = kernels.pack(kernels.random_qtensor("q4", 4096, 4096))
    x = np.ones((16, 4096), np.float32)
    ticks, done = [], threading.Event()

    def run():
        for _ in range(20):
            kernels.matmul(W, x)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    while not done.is_set():
        ticks.append(1)
        time.sleep(0.001)
    t.join()
    assert len(ticks) > 5


def test_prefetch_knob_is_checked_and_keys_the_build(monkeypatch):
    monkeypatch.delenv("LAB_PREFETCH", raising=False)
    plain = native.build_key()
    monkeypatch.setenv("LAB_PREFETCH", "4096")
    assert "-DLAB_PREFETCH=4096" in native.flags() and native.build_key() != plain
    monkeypatch.setenv("LAB_PREFETCH", "lots")
    with pytest.raises(native.NativeBuildError, match="LAB_PREFETCH"):
        native.flags()
