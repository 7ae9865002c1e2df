import os

import numpy as np
import pytest

from lab import native

# The kernels keep their default tuning in tests, and no test spends a minute measuring it
# (tests/test_tune.py sets it back where it tests tuning).
os.environ["LAB_TUNE"] = "0"


@pytest.fixture(scope="session")
def ns():
    return native.lib()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def simd_paths():
    """Every SIMD path this CPU runs (the scalar reference is what they are checked against)."""
    return [p for p in native.supported_paths() if p != "scalar"]


def path_attention():
    """(SIMD path, attention products) for each pair this CPU runs: every path in f32, and in
    bf16 where the path has it (head_dim 16, the tiny models')."""
    ns = native.lib()
    return [(p, a) for p in simd_paths() for a, m in native.consts().attention.items()
            if int(ns.attention_mode(native.consts().paths.index(p), m, 16)) == m]
