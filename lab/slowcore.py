"""An emulated efficiency core, two ways: a co-runner that spins on one CPU for a set share of
each period, so whatever else runs there gets less of it; or the engine's own worker slowed by
a factor (`kernels.Pool.slow`).

A CPU without performance and efficiency cores cannot show how a split of the work holds up
when one worker is slower than the other. Sharing one core with a duty-cycled spinner makes
that worker slower by a factor `factor()` measures (with the default priority, at most about
2x: the scheduler halves the core while both run), but by taking the core away for whole
scheduler slices, as other programs do on a busy machine: the worker is gone, not slow. A
slowed worker follows each piece of its work with a spin as long as (factor - 1) times the
piece, so every piece takes `factor` times as long, as on a slower core. A hybrid CPU needs
neither: its core types come from cpuid (`native.cpu()["core_types"]`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Callable

import numpy as np

MAX_FACTOR = 16         # the slowest a slowed worker may be made (kernels.Pool.slow)
PERIOD_S = 0.004        # long beside a kernel call, short beside a decode step: every step sees it

_SPIN = """
import os, sys, time
cpu, duty, period = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
os.sched_setaffinity(0, {cpu})
on, off = duty * period, (1 - duty) * period
parent = os.getppid()
print("ready", flush=True)
while os.getppid() == parent:     # a parent killed outright (kill -9) leaves no spinner behind
    end = time.perf_counter() + on
    while time.perf_counter() < end:
        pass
    if off > 0:
        time.sleep(off)
"""


class SlowCore:
    """`with SlowCore(cpu, duty):` -- a spinner on `cpu`, busy `duty` of every PERIOD_S,
    for as long as the block runs (duty 0: nothing runs)."""

    def __init__(self, cpu: int, duty: float, period: float = PERIOD_S):
        if not 0 <= duty <= 1:
            raise ValueError(f"duty must be between 0 and 1, got {duty}")
        if cpu not in os.sched_getaffinity(0):
            raise ValueError(f"cpu {cpu} is not among this process's CPUs {sorted(os.sched_getaffinity(0))}")
        self.cpu, self.duty, self.period, self._proc = cpu, duty, period, None

    def __enter__(self) -> "SlowCore":
        if self.duty > 0:
            self._proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(self.cpu), str(self.duty),
                                           str(self.period)], stdout=subprocess.PIPE, text=True)
            if self._proc.stdout.readline().strip() != "ready":     # it runs before the block does
                self.__exit__()
                raise RuntimeError("the co-runner did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


@contextmanager
def slowed(pool, cpu: int, factor: float):
    """`with slowed(pool, cpu, factor):` -- the pool's worker for `cpu` runs `factor` times
    slower (`kernels.Pool.slow`) for as long as the block runs."""
    pool.slow(cpu, factor)
    try:
        yield pool
    finally:
        pool.slow(cpu, 1.0)


def factor(cpu: int, duty: float, probe: Callable[[], float], rounds: int = 5) -> float:
    """How much slower `probe` (seconds of work pinned to `cpu`) runs beside the co-runner:
    the median ratio over rounds, each pairing a run beside it with one alone."""
    if duty == 0:
        return 1.0
    ratios = []
    for _ in range(rounds):
        alone = probe()
        with SlowCore(cpu, duty):
            slowed = probe()
        ratios.append(slowed / alone)
    return float(np.median(ratios))


def conditions(core_types: list[str] | None, allowed: list[int], duties=(0.0, 0.5, 1.0),
               factors=()) -> list[dict]:
    """What the threads section runs each configuration under: on a hybrid CPU, a performance
    and an efficiency core, as they are; elsewhere the first CPUs, the last of them slowed by
    each co-runner's duty, then by each factor (its worker slowed, `kernels.Pool.slow`).
    -> [{"label", "duty", "factor", "cpus" (None: the pool's default), "slow_cpu"}]"""
    if core_types and {"performance", "efficiency"} <= set(core_types):
        p, e = (next(c for c in allowed if core_types[c] == t) for t in ("performance", "efficiency"))
        return [{"label": "a performance and an efficiency core", "duty": 0.0, "factor": 1.0, "cpus": [p, e],
                 "slow_cpu": e}]
    for f in factors:
        if not 1 < f <= MAX_FACTOR:
            raise ValueError(f"a slow core's factor must be above 1 and at most {MAX_FACTOR}, got {f}")
    return ([{"label": "no co-runner" if d == 0 else f"co-runner {d:.0%}", "duty": float(d), "factor": 1.0,
              "cpus": None, "slow_cpu": allowed[-1]} for d in duties]
            + [{"label": f"a core at 1/{f:g} speed", "duty": 0.0, "factor": float(f), "cpus": None,
                "slow_cpu": allowed[-1]} for f in factors])
