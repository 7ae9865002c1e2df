import numpy as np
import pytest

from lab import native


@pytest.fixture(scope="session")
def ns():
    return native.lib()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def simd_paths():
    """Every SIMD path this CPU runs (the scalar reference is what they are checked against)."""
    return [p for p in native.supported_paths() if p != "scalar"]
