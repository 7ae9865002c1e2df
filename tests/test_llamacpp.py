"""llama.cpp beside the lab (lab.baselines.llamacpp), on the tiny models: the GGUF it writes
is Q4_0 with a Q8_0 output and, unquantized, computes what transformers does; speculation
and prompt lookup give plain decoding's tokens; v(k)'s timings come back; the file is made
once; a missing or broken file is a one-line LabError. Skipped when llama-cpp-python is
not installed."""
import os

import numpy as np
import pytest

from lab.baselines import llamacpp_files as files
from lab.baselines import llamacpp as lc
from lab.errors import LabError
from lab.models import registry

if lc.available():
    pytest.skip(lc.available(), allow_module_level=True)

THREADS = 1                                     # gentle on a small machine; the tests time nothing
REAL_MODELS = registry.models_dir()             # before the module's fixture points LAB_MODELS elsewhere


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A model cache of the module's own, so the tests neither use nor leave real files."""
    d = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_MODELS", str(d))
        yield d


@pytest.fixture(scope="module")
def target(models):
    with lc.LlamaCpp(lc.gguf_for("tiny-qwen2"), THREADS, n_ctx=256) as m:
        yield m


@pytest.fixture(scope="module")
def draft(models):
    with lc.LlamaCpp(lc.gguf_for("tiny-qwen2-draft"), THREADS, n_ctx=256) as m:
        yield m


PROMPT = [11, 42, 7, 300, 5, 99, 123, 64]


def test_the_tiny_gguf_is_q4_0_with_a_q8_0_output(target, draft):
    import gguf
    for m, out in ((target, "output.weight"), (draft, "token_embd.weight")):    # the draft ties them
        tensors = gguf.GGUFReader(str(m.path)).tensors
        assert files.tensors(m.path) == [(t.name, t.tensor_type, tuple(map(int, t.shape)), t.n_bytes) for t in tensors]
        types = {t.name: t.tensor_type.name for t in tensors}
        assert types[out] == "Q8_0"
        body = {n: t for n, t in types.items() if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n}
        assert body and set(body.values()) == {"Q4_0"}, types
        assert {t for n, t in types.items() if "norm" in n or n.endswith(".bias")} == {"F32"}
    assert (target.n_vocab, target.n_scored) == (384, 380)
    assert 0 < target.bytes_per_token < target.model_bytes                  # untied: the embedding is a lookup
    assert draft.bytes_per_token == draft.model_bytes                        # tied: it is the output layer
    assert target.is_eog(379) and not target.is_eog(5)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_the_unquantized_gguf_computes_what_transformers_does(name, tmp_path):
    import torch

    from lab.models.tiny import TINY, hf_model, tiny_weights
    c = TINY[name]
    files.write_tiny(name, tmp_path / "f32.gguf")
    ids = PROMPT[:6]
    with lc.LlamaCpp(tmp_path / "f32.gguf", THREADS, n_ctx=64) as m:
        got = m.logits(ids)
    with torch.no_grad():
        want = hf_model(c, tiny_weights(c, 0))(torch.tensor([ids])).logits[0, :, :c.tokenizer_size].numpy()
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()              # f16 KV cache
    assert (got.argmax(1) == want.argmax(1)).all()


@pytest.fixture(scope="module")
def drafts(models, draft, tmp_path_factory):
    """Drafts that agree never (a random one), mostly (the target unquantized) and always
    (the target itself), so rounds end at the first guess, in the middle and past the last."""
    f32 = tmp_path_factory.mktemp("f32") / "tiny-qwen2-f32.gguf"
    files.write_tiny("tiny-qwen2", f32)
    with lc.LlamaCpp(f32, THREADS, n_ctx=256) as near, lc.LlamaCpp(lc.gguf_for("tiny-qwen2"), THREADS, 256) as same:
        yield {"random": draft, "f32": near, "itself": same}


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_speculation_gives_plain_decodings_tokens(target, drafts, gamma):
    plain = target.generate(PROMPT, 40)
    assert plain.rounds == len(plain.tokens) and (len(plain.tokens) == 40 or plain.tokens[-1] == 379)
    for kind, d in drafts.items():
        spec = target.speculate(PROMPT, d, gamma, 40)
        assert spec.tokens == plain.tokens, kind
        assert spec.rounds <= len(spec.tokens) and spec.drafted == gamma * spec.rounds
        assert 0 <= spec.accepted <= spec.drafted and spec.seconds > 0 and spec.extra["kind"] == "draft"
        if kind == "itself":                    # all taken but where the budget cut the last round
            assert spec.accepted >= spec.drafted - gamma
        if kind == "f32":
            assert 0 < spec.accepted < spec.drafted


def test_lookup_gives_plain_decodings_tokens(target):
    prompt = [5, 6, 7, 8, 9, 10] * 4 + [5, 6, 7]
    plain = target.generate(prompt, 30)
    for gamma, ngram in ((4, 3), (2, 1)):
        look = target.lookup(prompt, gamma, 30, ngram=ngram)
        assert look.tokens == plain.tokens
        assert look.drafted > 0 and look.accepted <= look.drafted


def test_lookup_guesses_follow_the_latest_match():
    assert lc._lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3, 2) == [8, 1]
    assert lc._lookup([4, 5, 1, 2, 7, 2], 3, 4) == [7, 2]           # down to one token
    assert lc._lookup([1, 2, 3], 3, 4) == []


def test_forward_seconds_are_positive(target):
    for k in (1, 4):
        t = target.forward_seconds(16, k, 3)
        assert len(t) == 3 and all(x > 0 for x in t)
    assert target.generate(PROMPT, 5).tokens == target.generate(PROMPT, 5).tokens   # the cache was left clean


def test_gguf_for_makes_the_file_once(models, target):
    p = lc.gguf_for("tiny-qwen2")
    assert p == target.path and p.parent == models / "tiny-qwen2"
    before = p.stat().st_mtime_ns
    assert lc.gguf_for("tiny-qwen2").stat().st_mtime_ns == before
    assert not [f for f in p.parent.iterdir() if "partial" in f.name]


def test_a_missing_or_broken_gguf_is_a_one_line_error(tmp_path, target):
    import gguf
    cases = {tmp_path / "none.gguf": "no such", tmp_path / "bad.gguf": "not a GGUF",
             tmp_path / "cut.gguf": "not within the file bounds", tmp_path / "junk.gguf": "not a readable GGUF",
             tmp_path / "arch.gguf": "cannot load"}
    (tmp_path / "bad.gguf").write_bytes(b"not a model at all")
    (tmp_path / "cut.gguf").write_bytes(target.path.read_bytes()[:5000])
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + os.urandom(2000))
    w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "no-such-architecture")     # readable, refused by llama.cpp
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path, words in cases.items():
        with pytest.raises(LabError, match=words) as e:
            lc.LlamaCpp(path, THREADS, n_ctx=64)
        assert isinstance(e.value, lc.LlamaCppError) and "\n" not in str(e.value)


def test_a_broken_or_missing_source_gguf_is_a_one_line_error(models):
    src = registry.gguf_path("qwen2.5-coder-0.5b")
    assert str(src).startswith(str(models))
    with pytest.raises(lc.LlamaCppError, match="lab models fetch"):
        lc.gguf_for("qwen2.5-coder-0.5b")
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(b"GGUF" + bytes(3000))
    try:
        with pytest.raises(lc.LlamaCppError, match="could not quantize") as e:
            lc.gguf_for("qwen2.5-coder-0.5b")
        assert "\n" not in str(e.value)
        assert sorted(f.name for f in src.parent.iterdir()) == [src.name]     # nothing half-made
    finally:
        src.unlink()


def test_bad_requests_are_errors(target, draft):
    with pytest.raises(lc.LlamaCppError, match="exceed"):
        target.generate(PROMPT, 1000)
    with pytest.raises(lc.LlamaCppError, match="empty"):
        target.generate([], 4)
    with pytest.raises(lc.LlamaCppError, match="outside 0..383"):
        target.speculate([1, 2, 384], draft, 2, 4)
    with pytest.raises(lc.LlamaCppError, match="no tokenizer"):
        target.tokenize("hello")


@pytest.mark.slow
@pytest.mark.weights
def test_real_models_speculate_like_plain(monkeypatch):
    """Qwen2.5-Coder 1.5B with 0.5B as the draft: 32 greedy tokens alike (makes the
    llama.cpp files once, which takes a minute)."""
    monkeypatch.setenv("LAB_MODELS", str(REAL_MODELS))
    names = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    missing = [n for n in names if not registry.gguf_path(n).exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in the cache ({registry.models_dir()}): run `lab models fetch`")
    threads = min(2, len(os.sched_getaffinity(0)))
    with lc.LlamaCpp(lc.gguf_for(names[0]), threads, 1024) as t, lc.LlamaCpp(lc.gguf_for(names[1]), threads, 1024) as d:
        ids = t.tokenize("<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
                         "<|im_start|>assistant\n")
        plain = t.generate(ids, 32)
        spec = t.speculate(ids, d, 4, 32)
        assert spec.tokens == plain.tokens and spec.accepted > 0
        assert 5e8 < t.bytes_per_token <= t.model_bytes
