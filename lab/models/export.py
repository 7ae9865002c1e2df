"""The engine's weights file: write it from a model, read it back, check its hash.

Layout (kernels_cpp/lab.h, FileHeader and TensorEntry): a 256-byte header with the
architecture, a directory of 128-byte tensor entries, a JSON blob for Python, then a
64-byte-aligned data region. Each quantized tensor is one region in the kernels' tile
layout (formats.pack_tiles), so the engine maps the file and runs on it as is. q/k/v are fused into one matrix, and gate/up into another.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import formats, native
from ..errors import LabError
from ..files import write_text_atomic
from .config import ModelConfig
from .twin import quantize_weights

MAGIC = b"LABMODEL"
# The layout of kernels_cpp/lab.h's FileHeader and TensorEntry (a test compares every field's
# offset with the C++ struct's); version, architecture and format ids are read from C++.
HEADER = struct.Struct("<8sII12II4iIddQQQQQ32s80s")
ENTRY = struct.Struct("<80sIIQQQQQ")
assert HEADER.size == 256 and ENTRY.size == 128


class ModelFileError(LabError):
    """A weights file that is not what the engine expects."""


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a


def _cat_rows(parts):
    if all(isinstance(p, formats.QTensor) for p in parts):
        fmt = parts[0].fmt
        d = np.concatenate([p.d for p in parts])
        q = np.concatenate([p.q for p in parts])
        return formats.QTensor(fmt, (d.shape[0], parts[0].cols), formats.aligned_copy(d), formats.aligned_copy(q))
    return torch.cat([p if isinstance(p, torch.Tensor) else torch.from_numpy(p.dequantize()) for p in parts])


def engine_tensors(config: ModelConfig, weights: dict, scheme: str) -> dict:
    """Weights under the engine's names, fused, each a QTensor or an fp32 tensor."""
    c = config
    if c.tie_embeddings or "lm_head.weight" not in weights:
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    qw = quantize_weights(weights, scheme)
    out = {"embed": qw["lm_head.weight"] if c.tie_embeddings else qw["model.embed_tokens.weight"],
           "norm": qw["model.norm.weight"]}
    if not c.tie_embeddings:
        out["output"] = qw["lm_head.weight"]
    for i in range(c.num_layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        out[e + "attn_norm"] = qw[p + "input_layernorm.weight"]
        out[e + "ffn_norm"] = qw[p + "post_attention_layernorm.weight"]
        out[e + "qkv"] = _cat_rows([qw[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if c.qkv_bias:
            out[e + "qkv_bias"] = torch.cat([qw[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        if c.qk_norm:
            out[e + "q_norm"] = qw[p + "self_attn.q_norm.weight"]
            out[e + "k_norm"] = qw[p + "self_attn.k_norm.weight"]
        out[e + "o"] = qw[p + "self_attn.o_proj.weight"]
        out[e + "gate_up"] = _cat_rows([qw[p + "mlp.gate_proj.weight"], qw[p + "mlp.up_proj.weight"]])
        out[e + "down"] = qw[p + "mlp.down_proj.weight"]
    return out


def _fmt(name: str) -> int:
    return native.consts().formats[name]


def _region(t) -> tuple[int, bytes, tuple[int, int], int]:
    """-> (format id, the packed tiles or the floats, (rows, cols), ndim)."""
    if isinstance(t, formats.QTensor):
        return _fmt(t.fmt), formats.pack_tiles(t).tobytes(), t.shape, 2
    if isinstance(t, np.ndarray) and t.dtype == np.int32:     # token ids
        return _fmt("i32"), t.astype("<i4").tobytes(), (1, t.size), 1
    a = np.ascontiguousarray(t, np.float32) if isinstance(t, np.ndarray) else t.detach().float().contiguous().numpy()
    shape = (1, a.shape[0]) if a.ndim == 1 else a.shape
    return _fmt("f32"), a.astype("<f4").tobytes(), shape, a.ndim


def export(config: ModelConfig, weights: dict, path: str | Path, scheme: str = "q4-q8out",
           meta: dict | None = None, keep: list[int] | None = None, keep_fmt: str = "q4") -> Path:
    """Quantizes Hugging Face-named weights under `scheme` and writes the engine's file.
    keep: a trimmed draft, whose logits cover only these token ids (its output rows in
    keep_fmt; the full output layer stays for the rows a request adds)."""
    tensors = engine_tensors(config, weights, scheme)
    meta = {"scheme": scheme, **(meta or {})}
    if keep is not None:
        tensors.update(trimmed_output(config, weights, keep, keep_fmt))
        meta.update(draft_vocab=len(keep), draft_vocab_format=keep_fmt)
    return write(config, tensors, path, meta)


def trimmed_output(config: ModelConfig, weights: dict, keep: list[int], fmt: str = "q4") -> dict:
    """A trimmed draft's output: the kept tokens' rows of the output layer, and their ids."""
    ids = np.asarray(keep, np.int64)
    if ids.size < 1 or ids.min() < 0 or ids.max() >= config.tokenizer_size or np.unique(ids).size != ids.size:
        raise ModelFileError(f"a trimmed vocabulary needs distinct token ids in [0, {config.tokenizer_size})")
    if fmt not in ("q8", "q4"):
        raise ModelFileError(f"a trimmed output layer is q8 or q4, not {fmt!r}")
    head = weights["model.embed_tokens.weight" if config.tie_embeddings or "lm_head.weight" not in weights
                   else "lm_head.weight"]
    from ..kernels import quantize
    rows = np.ascontiguousarray(head[torch.from_numpy(ids)].float().numpy())
    return {"output_trim": quantize(rows, fmt, "output_trim"), "output_ids": ids.astype(np.int32)}


def _write_data(tmp: Path, data_offset: int, data_size: int, chunks) -> bytes:
    """The data region (header space left zero) -> its sha256."""
    with open(tmp, "wb") as f:
        f.write(b"\0" * data_offset)
        for start, blob in chunks:
            f.seek(start)
            f.write(blob)
        f.truncate(data_offset + data_size)
    h = hashlib.sha256()
    with open(tmp, "rb") as f:
        f.seek(data_offset)
        while block := f.read(1 << 24):
            h.update(block)
    return h.digest()


def write(config: ModelConfig, tensors: dict, path: str | Path, meta: dict | None = None) -> Path:
    """Writes engine-named tensors (beside the target first, then renamed) -> the path."""
    path = Path(path)
    meta_blob = json.dumps({**(meta or {}), "config": json.loads(config.to_json())}, sort_keys=True).encode()
    n = len(tensors)
    dir_offset = HEADER.size
    meta_offset = dir_offset + n * ENTRY.size
    data_offset = _align(meta_offset + len(meta_blob))
    entries, chunks, off = [], [], data_offset
    for name, t in tensors.items():
        if len(name.encode()) >= 80:
            raise ValueError(f"tensor name {name!r} is too long for the file's 80-byte field")
        fmt, region, (rows, cols), ndim = _region(t)
        scales, data = 0, len(region)
        if isinstance(t, formats.QTensor):          # the scales' and the bytes' shares of the tiles
            ns = native.lib()
            scales, data = ns.packed_scale_count(rows, cols) * t.d.itemsize, ns.packed_byte_count(fmt, rows, cols)
        entries.append(ENTRY.pack(name.encode(), fmt, ndim, rows, cols, off, scales, data))
        chunks.append((off, region))
        off = _align(off + len(region))
    data_size = off - data_offset
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:                                   # an error leaves neither a file nor a half-written one
        digest = _write_data(tmp, data_offset, data_size, chunks)
        c = config
        eos = (list(c.eos_ids) + [-1] * 4)[:4]
        ids = native.consts()
        header = HEADER.pack(MAGIC, ids.file_version, ids.archs[c.arch], c.vocab_size, c.hidden_size, c.intermediate_size,
                             c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.tokenizer_size,
                             c.max_position, int(c.tie_embeddings), int(c.qk_norm), int(c.qkv_bias),
                             min(len(c.eos_ids), 4), *eos, n, c.rope_theta, c.rms_eps, dir_offset, meta_offset,
                             len(meta_blob), data_offset, data_size, digest, b"")
        with open(tmp, "r+b") as f:
            f.write(header)
            f.write(b"".join(entries))
            f.write(meta_blob)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    remember_verified(path)
    return path


@dataclass
class ModelFile:
    path: Path
    header: dict
    config: ModelConfig
    meta: dict
    tensors: dict          # name -> QTensor (split layout) or np.ndarray (fp32)


HEADER_KEYS = ("magic version arch vocab_size hidden_size intermediate_size num_layers num_heads num_kv_heads "
               "head_dim tokenizer_size max_position tie_embeddings qk_norm qkv_bias n_eos e0 e1 e2 e3 n_tensors "
               "rope_theta rms_eps dir_offset meta_offset meta_size data_offset data_size sha256 reserved").split()


def read(path: str | Path) -> ModelFile:
    """Reads a weights file back (quantized tensors unpacked to the split layout). The
    header, directory and tensor extents are checked by the engine's own reader first, so
    both sides refuse the same files; the JSON part, which only Python reads, is checked here."""
    path = Path(path)
    open_native(path)
    raw = path.read_bytes()
    hd = dict(zip(HEADER_KEYS, HEADER.unpack_from(raw)))
    try:
        meta = json.loads(raw[hd["meta_offset"]:hd["meta_offset"] + hd["meta_size"]])
        config = ModelConfig(**meta["config"])
    except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError) as e:
        raise ModelFileError(f"{path}: its metadata is not readable ({type(e).__name__}: {e}): export it again")
    differ = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                          "num_kv_heads", "head_dim", "tokenizer_size") if getattr(config, k) != hd[k]]
    if differ:
        raise ModelFileError(f"{path}: its metadata and header disagree on {', '.join(differ)}: export it again")
    tensors = {}
    for i in range(hd["n_tensors"]):
        name, fmt, ndim, rows, cols, off, sb, db = ENTRY.unpack_from(raw, hd["dir_offset"] + i * ENTRY.size)
        name = name.rstrip(b"\0").decode(errors="replace")
        if fmt in (0, 3):
            a = np.frombuffer(raw, "<f4" if fmt == 0 else "<i4", rows * cols, off)
            tensors[name] = a.reshape((cols,) if ndim == 1 else (rows, cols)).copy()
        else:
            fname = {1: "q8", 2: "q4"}[fmt]
            region = np.frombuffer(raw, np.uint8, formats.packed_nbytes(fname, (rows, cols)), off)
            tensors[name] = formats.unpack_tiles(fname, (rows, cols), region)
    return ModelFile(path, hd, config, meta, tensors)


def verify(path: str | Path) -> str:
    """Recomputes the data region's sha256; raises if it differs from the header's."""
    path = Path(path)
    with open(path, "rb") as f:
        hd = HEADER.unpack(f.read(HEADER.size))
        data_offset, data_size, want = hd[-4], hd[-3], hd[-2]
        f.seek(data_offset)
        h, left = hashlib.sha256(), data_size
        while left > 0 and (block := f.read(min(1 << 24, left))):
            h.update(block)
            left -= len(block)
    if h.digest() != want:
        raise ModelFileError(f"{path}: content hash mismatch (header {want.hex()[:12]}…, data {h.hexdigest()[:12]}…): "
                             f"the file is corrupt or changed since export; export or fetch it again")
    return want.hex()


def _verified_path() -> Path:
    from .. import native
    return native.cache_dir() / "verified.json"


def _stamp(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, content_id(path)]


def _verified() -> dict:
    try:
        rec = json.loads(_verified_path().read_text())
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def remember_verified(path: str | Path) -> None:
    """Notes that this version of the file (size, mtime, inode, hash) holds what its hash says."""
    path = Path(path).resolve()
    rec = {k: v for k, v in _verified().items() if os.path.exists(k)}     # forget deleted files
    rec[str(path)] = _stamp(path)
    _verified_path().parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(_verified_path(), json.dumps(rec))


def verify_once(path: str | Path) -> bool:
    """Checks the content hash the first time each version of a file is loaded (True: it
    hashed now), so a flipped byte is caught while later loads stay fast."""
    path = Path(path).resolve()
    if _verified().get(str(path)) == _stamp(path):
        return False
    verify(path)
    remember_verified(path)
    return True


def _header(path: str | Path) -> tuple | None:
    """A weights file's header fields (reads 256 bytes); None where it is no weights file."""
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    return HEADER.unpack(raw) if len(raw) == HEADER.size and raw[:8] == MAGIC else None


def content_id(path: str | Path) -> str:
    """The data region's sha256 as the header records it (cheap: reads 256 bytes), so caches
    built from a file follow its content, not its name."""
    hd = _header(path)
    if hd is None:
        raise ModelFileError(f"{path} is not a lab model file")
    return hd[-2].hex()


def up_to_date(path: str | Path) -> bool:
    """Whether a cached weights file can be used as is: it exists and is of the version this
    engine reads. A file that is no weights file at all counts as up to date, so that opening
    it says what is wrong instead of an export overwriting it."""
    try:
        hd = _header(path)
    except FileNotFoundError:
        return False
    return hd is None or hd[1] == native.consts().file_version


def engine_file(name: str, scheme: str = "q4-q8out", progress: bool = True) -> Path:
    """The engine's file for a registry model (or tiny model) under a scheme, exported
    into the model cache once, and again when the engine reads a newer file version."""
    import sys
    from .load import load
    from .registry import models_dir
    out = models_dir() / name / f"{scheme}.lab"
    if up_to_date(out):
        return out
    if progress:
        again = " again (its file is of an older version)" if out.exists() else ""
        print(f"exporting {name} as {scheme}{again} ...", file=sys.stderr)
    m = load(name, tokenizer=True)
    meta = {"source": name, "tokenizer": str(m.folder) if m.folder else None}
    return export(m.config, m.weights, out, scheme, meta)


def open_native(path: str | Path):
    """The C++ side's view of a file (memory-mapped, header checked) -> lab::ModelFile."""
    from .. import native
    mf = native.lib().ModelFile()
    if not mf.open(str(path)):
        raise ModelFileError(str(mf.error()))
    return mf
