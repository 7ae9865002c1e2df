"""The reference against transformers on real weights (skipped, with the reason, when they
are not in the cache: `lab models fetch smollm2-135m qwen2.5-coder-0.5b`)."""
import pytest

from lab.models import registry
from lab.models.compare import against_transformers

pytestmark = [pytest.mark.weights, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_reference_matches_transformers_on_real_weights(name):
    if not registry.hf_dir(name).exists():
        pytest.skip(f"{name} is not in the cache ({registry.models_dir()}): run `lab models fetch {name}`")
    r = against_transformers(name)
    assert r["max_abs_logit_diff"] < 1e-3 * r["max_abs_logit"], r
    assert r["top1_equal"] and r["greedy_equal"], r
