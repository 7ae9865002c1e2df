"""tools/attention_products.py, where the diary's figures on bf16 attention's cost in quality
come from: on a tiny model (the scalar reference runs every mode's products on any CPU),
two engines with the same products agree exactly, and bf16 or amx against f32 moves the
distributions a little but not by nothing."""
import sys
from pathlib import Path

import numpy as np
import pytest

from lab.engine import Engine
from lab.kernels import Pool
from lab.models import TINY, tiny_weights
from lab.models import export as ex

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import attention_products  # noqa: E402


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    c = TINY["tiny-qwen3"]
    return ex.export(c, tiny_weights(c, seed=1), tmp_path_factory.mktemp("m") / "q.lab", "f32")


def test_the_comparison_tells_products_apart(model_file):
    pool = Pool(1)
    ws = [list(np.random.default_rng(s).integers(0, TINY["tiny-qwen3"].tokenizer_size, 48)) for s in (1, 2)]
    make = {a: Engine(model_file, pool=pool, max_context=64, path="scalar", attention=a) for a in ("f32", "bf16", "amx")}
    same = attention_products.compare({"f32": make["f32"], "bf16": make["f32"]}, ws)
    assert same["kl"]["bf16"]["max"] == 0 and same["same_top"]["bf16"] == 1 and same["predictions"] == 94
    r = attention_products.compare(make, ws)
    for m in ("bf16", "amx"):
        assert 0 < r["kl"][m]["mean"] < 1e-2 and r["same_top"][m] > 0.9
        assert abs(r["perplexity"][m] / r["perplexity"]["f32"] - 1) < 0.01
