"""The emulated efficiency core: the co-runner starts and stops with its block, slows what
shares its CPU, and the threads section's conditions follow the CPU's core types."""
import os
import time

import pytest

from lab import slowcore

CPUS = sorted(os.sched_getaffinity(0))


def spin_on(cpu: int):
    """A probe: a fixed amount of Python work pinned to `cpu` -> its seconds. It lasts tens of
    milliseconds: a few-ms probe can finish inside one scheduler slice before the spinner runs."""
    def probe():
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
        try:
            t0 = time.perf_counter()
            x = 0
            for i in range(2_000_000):
                x += i
            return time.perf_counter() - t0
        finally:
            os.sched_setaffinity(0, before)
    return probe


def test_the_co_runner_runs_only_inside_its_block():
    with slowcore.SlowCore(CPUS[-1], 0.5) as s:
        proc = s._proc
        assert proc.poll() is None
    assert proc.poll() is not None and s._proc is None
    with slowcore.SlowCore(CPUS[-1], 0.0) as s:       # duty 0: nothing to start
        assert s._proc is None


def test_the_co_runner_does_not_outlive_a_killed_parent():
    """A process killed outright (kill -9) inside a SlowCore block leaves no spinner behind: it
    stops within a period once its parent is gone (a leftover one had taken a CPU for half an hour)."""
    import subprocess
    import sys
    outer = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {slowcore._SPIN!r}, '0', '0.5', '0.004'], stdout=subprocess.PIPE)\n"
        "p.stdout.readline(); print(p.pid, flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    spinner = int(outer.stdout.readline())
    outer.kill()
    outer.wait()
    deadline = time.time() + 5
    while time.time() < deadline and _running(spinner):
        time.sleep(0.05)
    assert not _running(spinner)


def _running(pid: int) -> bool:
    """Whether pid is a live process (an exited one nobody has reaped yet is not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("cpu, duty, match", [(CPUS[-1], 1.5, "duty"), (CPUS[-1], -0.1, "duty"),
                                              (max(CPUS) + 1, 0.5, "not among")])
def test_a_bad_duty_or_cpu_is_refused(cpu, duty, match):
    with pytest.raises(ValueError, match=match):
        slowcore.SlowCore(cpu, duty)


def test_a_full_duty_co_runner_slows_its_cpu():
    assert slowcore.factor(CPUS[-1], 0.0, spin_on(CPUS[-1])) == 1.0
    assert slowcore.factor(CPUS[-1], 1.0, spin_on(CPUS[-1]), rounds=3) > 1.3


def test_conditions_use_real_core_types_on_a_hybrid_cpu():
    conds = slowcore.conditions(["performance", "performance", "efficiency", "efficiency"], [1, 2, 3],
                                factors=(2.0,))
    assert conds == [{"label": "a performance and an efficiency core", "duty": 0.0, "factor": 1.0, "cpus": [1, 2],
                      "slow_cpu": 2}]
    emulated = slowcore.conditions(None, [0, 1], duties=(0.0, 0.5), factors=(2.0,))
    assert [(c["label"], c["duty"], c["factor"], c["slow_cpu"]) for c in emulated] == [
        ("no co-runner", 0.0, 1.0, 1), ("co-runner 50%", 0.5, 1.0, 1), ("a core at 1/2 speed", 0.0, 2.0, 1)]


@pytest.mark.parametrize("factor", [1.0, 0.5, 17.0])
def test_a_bad_factor_is_refused(factor):
    with pytest.raises(ValueError, match="factor must be above 1"):
        slowcore.conditions(None, [0, 1], factors=(factor,))
