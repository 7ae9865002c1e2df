"""GGUF files for llama.cpp, read and written without llama.cpp: the tiny models built in code
written as GGUF (llama.cpp's tensor names, no vocabulary: token ids go in directly), and a
small header reader that lists a file's tensors in a fraction of a second (gguf's own reader
takes some 20 s on the 1.5B)."""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

from ..errors import LabError


_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes


class LlamaCppError(LabError):
    """llama.cpp cannot make, load or run a model."""


def _gguf_name(hf: str) -> str:
    """A Hugging Face tensor name under llama.cpp's name."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)            # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_HF_TO_GGUF[module]}.{kind}"


def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows from Hugging Face's rotate-half order to the interleaved pairs llama.cpp's
    llama architecture rotates (what convert_hf_to_gguf.py does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny(name: str, path: Path) -> None:
    """A tiny model's seed-0 weights (as lab.models.load builds them) as an f32 GGUF with no
    tokenizer: token ids go in directly. The eos id and the scored vocabulary ride along
    as metadata, since llama.cpp reads neither for a vocabulary of type none."""
    import gguf

    from ..models.tiny import TINY, tiny_weights
    c = TINY[name]
    w = gguf.GGUFWriter(str(path), c.arch)
    w.add_name(name)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("none")
    if c.eos_ids:
        w.add_eos_token_id(c.eos_ids[0])
    w.add_uint32("lab.tokenizer_size", c.tokenizer_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for hf, t in tiny_weights(c, 0).items():
        a = t.numpy().astype(np.float32)
        if c.arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            a = _rope_permute(a, c.num_heads if ".q_proj." in hf else c.num_kv_heads)
        w.add_tensor(_gguf_name(hf), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def streamed_bytes(tensors: list, total: int) -> int:
    """Bytes one decode step reads: every tensor, less the token embedding when a separate
    output matrix exists (then the embedding is a one-row lookup)."""
    size = {name: n for name, _, _, n in tensors}
    return total - size.get("token_embd.weight", 0) if "output.weight" in size else total


# ----------------------------------------------------------------------------
# Reading a GGUF and placing its weights
# ----------------------------------------------------------------------------

BODY = r"^blk\.[0-9]+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$"


class _Cursor:
    """Walks a GGUF's header (little-endian), skipping what it does not need."""

    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return v if len(v) > 1 else v[0]

    def string(self) -> bytes:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at])

    def skip(self, kind: int) -> None:
        """Past one value of a GGUF type; a string array (a 150k-token vocabulary) in a tight loop."""
        if kind == 8:
            self.string()
        elif kind != 9:
            self.at += _SCALAR[kind]
        else:
            item, n = self.take("IQ")
            if item in _SCALAR:
                self.at += n * _SCALAR[item]
            elif item == 8:
                length = struct.Struct("<Q").unpack_from
                for _ in range(n):
                    self.at += 8 + length(self.buf, self.at)[0]
            else:
                for _ in range(n):
                    self.skip(item)


def tensors(path: Path) -> list[tuple[str, int, tuple, int]]:
    """The GGUF's tensor directory: (name, ggml type, shape in ggml order, bytes) each.
    Read here since gguf.GGUFReader takes 20 s over the 1.5B model's vocabulary."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            c = _Cursor(m)
            magic, version, n_tensors, n_kv = c.take("4sIQQ")
            if magic != b"GGUF" or version < 2:
                raise ValueError(f"magic {magic!r}, version {version}")
            for _ in range(n_kv):
                c.skip(8)                       # the key
                c.skip(c.take("I"))
            out = []
            for _ in range(n_tensors):
                name = c.string().decode()
                shape = tuple(c.take("Q") for _ in range(c.take("I")))
                kind, _ = c.take("IQ")
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                out.append((name, kind, shape, int(np.prod(shape)) // block * size))
            return out
    except Exception as e:                      # a truncated or garbled file fails in many ways
        raise LlamaCppError(f"{path} is not a readable GGUF ({type(e).__name__}: {e}); "
                            f"delete it and make it again") from None


def check(path: Path) -> None:
    """A one-line error for a file that is missing or is not a GGUF, before llama.cpp sees it."""
    if not path.is_file():
        raise LlamaCppError(f"no such GGUF file: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise LlamaCppError(f"{path} is not a GGUF file (no GGUF magic); delete it and make it again")


# ----------------------------------------------------------------------------
# A model and its context
# ----------------------------------------------------------------------------
