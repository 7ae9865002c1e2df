"""Crafted and corrupt weights files: each is refused with a message that names the
problem, by the C++ reader (Engine) and the Python reader alike -- never a signal."""
from pathlib import Path

import numpy as np
import pytest

from lab.engine import Engine, EngineError
from lab.errors import LabError
from lab.kernels import matmul, quantize
from lab.models import TINY, tiny_weights
from lab.models import export as ex

U64 = 2 ** 64


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    c = TINY[next(iter(TINY))]
    return ex.export(c, tiny_weights(c), tmp_path_factory.mktemp("crafted") / "good.lab", "q4-q8out")


def crafted(good, tmp_path, **fields):
    """The good file with some header fields replaced."""
    raw = bytearray(good.read_bytes())
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    hd.update(fields)
    ex.HEADER.pack_into(raw, 0, *hd.values())
    out = tmp_path / "crafted.lab"
    out.write_bytes(bytes(raw))
    return out


def refused(path, match):
    with pytest.raises(EngineError, match=match):
        Engine(path, threads=1, max_context=64)
    with pytest.raises(ex.ModelFileError, match=match):
        ex.read(path)


def test_good_file_loads(good):
    assert Engine(good, threads=1, max_context=64).vocab > 0


@pytest.mark.parametrize("fields, match", [
    (dict(num_kv_heads=0), "num_kv_heads = 0"),                         # was SIGFPE
    (dict(num_heads=0, num_kv_heads=0), "num_heads = 0"),
    (dict(head_dim=0), "head_dim = 0"),
    (dict(num_layers=2 ** 31), "num_layers"),                           # was std::bad_alloc
    (dict(tokenizer_size=10 ** 6), "tokenizer_size"),                   # was SIGSEGV
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(n_eos=9), "n_eos"),
    (dict(dir_offset=U64 - 64, n_tensors=2 ** 32 - 1), "tensor directory"),   # was SIGSEGV: the sum wrapped
    (dict(dir_offset=U64 - 64), "tensor directory"),
    (dict(data_offset=U64 - 64), "data region"),
    (dict(data_size=U64 - 1), "data region"),
])
def test_crafted_header_is_refused(good, tmp_path, fields, match):
    refused(crafted(good, tmp_path, **fields), match)


def test_tokenizer_a_little_past_vocab_is_refused(good, tmp_path):
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(good.read_bytes())))
    refused(crafted(good, tmp_path, tokenizer_size=hd["vocab_size"] + 1), "tokenizer_size")


def test_all_zero_header_is_refused(good, tmp_path):
    raw = bytearray(good.read_bytes())
    raw[:ex.HEADER.size] = bytes(ex.HEADER.size)
    (tmp_path / "z.lab").write_bytes(bytes(raw))
    refused(tmp_path / "z.lab", "not a lab model file")


def _entry_patched(good, tmp_path, i, **fields):
    raw = bytearray(good.read_bytes())
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    keys = "name fmt ndim rows cols offset scales_bytes data_bytes".split()
    at = hd["dir_offset"] + i * ex.ENTRY.size
    e = dict(zip(keys, ex.ENTRY.unpack_from(raw, at)))
    e.update(fields)
    ex.ENTRY.pack_into(raw, at, *e.values())
    (tmp_path / "e.lab").write_bytes(bytes(raw))
    return tmp_path / "e.lab"


@pytest.mark.parametrize("fields, match", [
    (dict(cols=2 ** 62), "shape"),
    (dict(rows=3), "1-D but has 3 rows"),
    (dict(offset=U64 - 64), "outside the data region"),
    (dict(data_bytes=U64 - 1), "sizes do not match"),
    (dict(fmt=9), "format 9"),
])
def test_crafted_tensor_entry_is_refused(good, tmp_path, fields, match):
    refused(_entry_patched(good, tmp_path, 1, **fields), match)


def test_metadata_that_disagrees_with_the_header_is_refused(good, tmp_path):
    raw = good.read_bytes()
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    blob = raw[hd["meta_offset"]:hd["meta_offset"] + hd["meta_size"]]
    n = str(hd["num_layers"]).encode()
    bad = blob.replace(b'"num_layers": ' + n, b'"num_layers": ' + (b"9" * len(n)))
    assert bad != blob
    (tmp_path / "m.lab").write_bytes(raw[:hd["meta_offset"]] + bad + raw[hd["meta_offset"] + len(blob):])
    with pytest.raises(ex.ModelFileError, match="disagree on num_layers"):
        ex.read(tmp_path / "m.lab")


def test_a_flipped_data_byte_is_caught_on_load(good, tmp_path):
    raw = bytearray(good.read_bytes())
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    raw[hd["data_offset"] + hd["data_size"] // 2] ^= 0x10
    (tmp_path / "f.lab").write_bytes(bytes(raw))
    with pytest.raises(ex.ModelFileError, match="content hash mismatch"):
        Engine(tmp_path / "f.lab", threads=1, max_context=64)
    Engine(tmp_path / "f.lab", threads=1, max_context=64, verify=False)   # the impatient's way


def test_a_nan_or_inf_weight_scale_is_refused_on_load(good, tmp_path):
    """The AVX-512 kernel scales by adding exponents, exact for finite scales only."""
    raw = bytearray(good.read_bytes())
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    entries = (ex.ENTRY.unpack_from(raw, hd["dir_offset"] + i * ex.ENTRY.size) for i in range(hd["n_tensors"]))
    name, _, _, _, cols, off, _, _ = next(e for e in entries if e[0].rstrip(b"\0") == b"layers.0.gate_up")
    raw[off + 2 * 5:off + 2 * 6] = (0x7c00).to_bytes(2, "little")    # the first block's scale of row 5
    (tmp_path / "s.lab").write_bytes(bytes(raw))
    nb = cols // 32
    with pytest.raises(EngineError, match=rf"gate_up has a NaN or inf scale \(block {5 * nb}\): .*export it again"):
        Engine(tmp_path / "s.lab", threads=1, max_context=64, verify=False)


def test_verification_is_remembered_per_version_of_the_file(good, tmp_path, monkeypatch):
    p = tmp_path / "r.lab"
    p.write_bytes(good.read_bytes())
    assert ex.verify_once(p) is True
    assert ex.verify_once(p) is False                      # same size, mtime, inode: not hashed again
    p.write_bytes(good.read_bytes())                       # a new version (new mtime) is hashed again
    assert ex.verify_once(p) is True


def test_a_context_past_memory_is_a_message(good):
    with pytest.raises(EngineError, match="shorter max_context"):
        Engine(good, threads=1, max_context=2 ** 31 - 1)
    with pytest.raises(EngineError, match="max_context"):
        Engine(good, threads=1, max_context=2 ** 40)


def test_matmul_refuses_a_read_only_out(tmp_path):
    w = quantize(np.ones((32, 64), np.float32), "q8", "w")
    acts = np.ones((1, 64), np.float32)
    out = np.memmap(tmp_path / "o.bin", np.float32, "w+", shape=(1, 32))
    ro = np.memmap(tmp_path / "o.bin", np.float32, "r", shape=(1, 32))
    matmul(w, acts, out=out)
    with pytest.raises(ValueError, match="read-only"):
        matmul(w, acts, out=ro)


# ----------------------------------------------------------------------------
# Exports that fail or are killed
# ----------------------------------------------------------------------------

def test_a_failed_export_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_MODELS", str(tmp_path))
    with pytest.raises(LabError, match="unknown model"):
        ex.engine_file("no-such-model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_export_is_finished_by_the_rerun_and_the_done_one_kept(tmp_path, monkeypatch):
    """kill -9 mid-export leaves the finished file and the next one's .partial: a rerun
    redoes only the unfinished one (the finished file keeps its inode and mtime)."""
    from lab import cli
    monkeypatch.setenv("LAB_MODELS", str(tmp_path))
    done = ex.engine_file("tiny-qwen3", progress=False)
    before = done.stat()
    torn = tmp_path / "tiny-llama" / "q4-q8out.lab.partial"
    torn.parent.mkdir()
    torn.write_bytes(b"LABMODEL" + bytes(100))                # what a killed write leaves
    assert cli.main(["models", "export", "tiny-qwen3", "tiny-llama"]) == 0
    after = done.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not torn.exists()
    Engine(tmp_path / "tiny-llama" / "q4-q8out.lab", threads=1, max_context=64)


def test_no_verify_skips_the_hash_and_says_so(tmp_path, monkeypatch, capsys):
    from lab import cli
    monkeypatch.setenv("LAB_MODELS", str(tmp_path))
    monkeypatch.delenv("LAB_VERIFY", raising=False)
    f = ex.engine_file("tiny-qwen2", progress=False)
    raw = bytearray(f.read_bytes())
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    raw[hd["data_offset"] + 7] ^= 0x01
    f.write_bytes(bytes(raw))
    run = ["generate", "--model", "tiny-qwen2", "1 2 3", "--max-new-tokens", "2"]
    assert cli.main(run) == 2
    assert "content hash mismatch" in capsys.readouterr().err
    assert cli.main(["--no-verify", *run]) == 0
    assert "hashes are not checked" in capsys.readouterr().err


CRASHES = sorted((Path(__file__).parent.parent / "fuzz" / "crashes").glob("*"))


@pytest.mark.parametrize("path", CRASHES, ids=[p.name for p in CRASHES])
def test_every_input_the_fuzzers_crashed_on_is_now_a_message(path, tmp_path):
    f = tmp_path / "in.lab"
    f.write_bytes(path.read_bytes())
    try:                               # the engine ignores the JSON part, so some of these load there
        Engine(f, threads=1, max_context=64)
    except (EngineError, ex.ModelFileError):
        pass
    with pytest.raises(ex.ModelFileError):
        ex.read(f)


def test_a_weight_matrix_stored_as_ids_is_refused(tmp_path):
    """An i32 tensor where a matrix belongs would be read as q8 tiles, past its bytes."""
    c = TINY["tiny-qwen3"]
    f32 = ex.export(c, tiny_weights(c), tmp_path / "f32.lab", "f32")        # i32 has f32's sizes
    raw = f32.read_bytes()
    hd = dict(zip(ex.HEADER_KEYS, ex.HEADER.unpack_from(raw)))
    names = [ex.ENTRY.unpack_from(raw, hd["dir_offset"] + i * ex.ENTRY.size)[0].rstrip(b"\0").decode()
             for i in range(hd["n_tensors"])]
    with pytest.raises(EngineError, match="embed is not a weight matrix"):
        Engine(_entry_patched(f32, tmp_path, names.index("embed"), fmt=3), threads=1, max_context=64)
    with pytest.raises(EngineError, match="norm is not an f32 vector"):
        Engine(_entry_patched(f32, tmp_path, names.index("norm"), fmt=3), threads=1, max_context=64)


def test_pythons_header_layout_is_the_engines():
    """Python writes the header with struct; every field must sit where lab::FileHeader has it."""
    import re
    import struct
    import cppyy
    from lab import native
    native.lib()
    offsets, at = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", ex.HEADER.format.lstrip("<")):
        n, width = int(count or 1), struct.calcsize("<" + code)
        fields = [(at, n)] if code == "s" else [(at + j * width, 1) for j in range(n)]
        offsets += [o for o, _ in fields]
        at += n * width
    assert at == ex.HEADER.size == 256
    cpp = {"sha256": "content_sha256", "e0": "eos"}
    for key, off in zip(ex.HEADER_KEYS, offsets):
        if key in ("e1", "e2", "e3"):                     # eos[1..3] follow eos[0]
            continue
        name = cpp.get(key, key)
        cppyy.cppdef(f"size_t lab_test_off_{name}() {{ return offsetof(lab::FileHeader, {name}); }}")
        assert getattr(cppyy.gbl, f"lab_test_off_{name}")() == off, key
