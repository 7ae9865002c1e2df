"""Transformers as a baseline (lab.baselines.hf) on the tiny models: plain greedy matches
the lab's reference, assisted and lookup generation match plain, EOS stops all three the
same way, bf16 runs. One check on real weights is marked weights+slow."""
import dataclasses

import pytest
import torch

from lab.baselines import hf
from lab.models import registry
from lab.models.load import load as lab_load
from lab.models.reference import Reference

PROMPT = [5, 17, 42, 99, 5, 17, 42, 3, 250, 11, 5, 17]   # repeats, so lookup finds matches
N = 24


@pytest.fixture(scope="module", autouse=True)
def _threads():
    """load() sets torch's process-wide thread count: give it back to the rest of the suite."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return hf.load("tiny-qwen2", threads=1)


@pytest.fixture(scope="module")
def draft():
    return hf.load("tiny-qwen2-draft", threads=1)


def test_load_holds_eval_model_dtype_eos_and_threads(target):
    assert not target.model.training and target.dtype == "fp32" and target.threads == 1
    assert torch.get_num_threads() == 1
    assert next(target.model.parameters()).dtype == torch.float32
    assert target.eos_ids == [379] and target.tokenizer_size == 380
    with pytest.raises(ValueError, match="dtype"):
        hf.load("tiny-qwen2", dtype="fp16")


def test_plain_matches_the_reference_greedy_decode(target):
    m = lab_load("tiny-qwen2")
    ref = Reference(m.config, m.weights).greedy(PROMPT, N)      # never stops at EOS
    r = hf.generate(target, PROMPT, N)
    assert r.tokens == ref[:len(r.tokens)]
    assert len(r.tokens) == N or r.tokens[-1] in target.eos_ids
    assert r.seconds > 0 and r.extra["total_s"] > r.seconds and r.extra["prefill_s"] > 0
    assert (r.rounds, r.drafted, r.accepted) == (0, 0, 0)


@pytest.mark.parametrize("gamma", [3, None])
def test_assisted_equals_plain_in_fp32(target, draft, gamma):
    plain = hf.generate(target, PROMPT, N)
    r = hf.assisted(target, draft, PROMPT, N, gamma=gamma)
    assert r.tokens == plain.tokens and r.extra["equal_to_plain"] is True
    assert r.seconds > 0 and r.rounds > 0 and 0 <= r.accepted <= r.drafted
    assert r.accepted == len(r.tokens) - r.rounds
    if gamma is not None:
        assert r.drafted <= gamma * r.rounds


def test_lookup_equals_plain_in_fp32_and_finds_guesses(target):
    plain = hf.generate(target, PROMPT, N)
    r = hf.lookup(target, PROMPT, N, n=4)
    assert r.tokens == plain.tokens and r.extra["equal_to_plain"] is True
    assert r.seconds > 0 and r.drafted > 0 and r.drafted <= 4 * r.rounds
    assert r.accepted == len(r.tokens) - r.rounds


def test_speculative_runs_compare_with_plain_even_when_plain_was_not_run():
    fresh = hf.load("tiny-qwen2", threads=1)
    r = hf.lookup(fresh, PROMPT, 8, n=2)
    assert r.extra["equal_to_plain"] is True and (tuple(PROMPT), 8) in fresh.plain


def test_all_three_stop_at_eos_and_keep_it(draft):
    t = hf.load("tiny-qwen2", threads=1)
    full = hf.generate(t, PROMPT, N).tokens
    stop = full[6]                                  # pretend this token is the end of sequence
    t = dataclasses.replace(t, eos_ids=[stop], plain={})
    hf._quiet_config(t)                             # the generation config carries the EOS ids
    want = full[:full.index(stop) + 1]
    assert hf.generate(t, PROMPT, N).tokens == want
    assert hf.assisted(t, draft, PROMPT, N, gamma=3).tokens == want
    assert hf.lookup(t, PROMPT, N, n=4).tokens == want


def test_bf16_loads_and_runs():
    t = hf.load("tiny-qwen2", dtype="bf16", threads=1)
    d = hf.load("tiny-qwen2-draft", dtype="bf16", threads=1)
    assert next(t.model.parameters()).dtype == torch.bfloat16 and t.dtype == "bf16"
    plain = hf.generate(t, PROMPT, N)
    assert plain.seconds > 0 and (len(plain.tokens) == N or plain.tokens[-1] in t.eos_ids)
    assert all(0 <= x < t.tokenizer_size for x in plain.tokens)
    for r in (hf.assisted(t, d, PROMPT, N, gamma=3), hf.lookup(t, PROMPT, N, n=4)):
        assert r.seconds > 0 and isinstance(r.extra["equal_to_plain"], bool)
        assert r.extra["dtype"] == "bf16"


@pytest.mark.weights
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_real_weights_assisted_and_lookup_equal_plain():
    """Qwen2.5-Coder 1.5B with its 0.5B draft, fp32, 2 threads, 32 tokens (run with -s to
    see the tokens/s)."""
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        if not registry.hf_dir(name).exists():
            pytest.skip(f"{name} is not in the cache ({registry.models_dir()}): run `lab models fetch {name}`")
    from transformers import AutoTokenizer

    from lab.models.compare import CODE
    t = hf.load("qwen2.5-coder-1.5b", threads=2)
    d = hf.load("qwen2.5-coder-0.5b", threads=2)
    ids = AutoTokenizer.from_pretrained(str(registry.resolve("qwen2.5-coder-1.5b")))(CODE)["input_ids"]
    runs = {}
    for k, go in (("plain", lambda: hf.generate(t, ids, 32)), ("assisted", lambda: hf.assisted(t, d, ids, 32)),
                  ("lookup", lambda: hf.lookup(t, ids, 32))):
        r = runs[k] = go()                              # printed as it goes: a slow stage shows itself
        print(f"{k}: {len(r.tokens)} tokens, {r.tokens_per_s:.2f} tokens/s, rounds {r.rounds}, "
              f"drafted {r.drafted}, accepted {r.accepted}, {r.extra}", flush=True)
    assert runs["assisted"].extra["equal_to_plain"] and runs["lookup"].extra["equal_to_plain"]
