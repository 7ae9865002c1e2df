"""The reference against transformers on real weights (skipped, with the reason, when
they are not in the cache: `lab models fetch smollm2-135m qwen2.5-coder-0.5b`)."""
import pytest
import torch

from lab.models import Reference, registry
from lab.models.load import load

pytestmark = [pytest.mark.weights, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def _need(name):
    if not registry.status(name)["present"] or not registry.hf_dir(name).exists():
        pytest.skip(f"{name} is not in the cache ({registry.models_dir()}): run `lab models fetch {name}`")


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_reference_matches_transformers_on_real_weights(name):
    _need(name)
    from transformers import AutoModelForCausalLM
    m = load(name)
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ids = m.tokenizer(text)["input_ids"]
    ref = Reference(m.config, m.weights, max_context=256)
    logits = ref.forward(ids, 0)
    hf = AutoModelForCausalLM.from_pretrained(str(m.folder), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    diff = (logits - want).abs().max().item()
    assert diff < 1e-3 * want.abs().max().item(), diff
    n = m.config.tokenizer_size
    assert torch.equal(logits[:, :n].argmax(-1), want[:, :n].argmax(-1))
    out = ref.greedy(ids, 24)
    gen = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                      pad_token_id=0, suppress_tokens=list(range(n, m.config.vocab_size)))
    assert out == gen[0, len(ids):].tolist()
