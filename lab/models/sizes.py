"""Bytes one decode step reads, per model and weights scheme (from the config alone)."""
from __future__ import annotations

from .config import ModelConfig
from .twin import tensor_format

_BYTES = {"q8": 34 / 32, "q4": 18 / 32, "f32": 4.0}


def _matrix(rows: int, cols: int, fmt: str) -> int:
    if fmt == "f32":
        return rows * cols * 4
    return int(-(-rows // 16) * 16 * cols * _BYTES[fmt])


def bytes_per_token(c: ModelConfig, scheme: str) -> int:
    """Every matrix of every layer once, and the output layer's tokenizer rows."""
    body = tensor_format("model.layers.0.mlp.down_proj.weight", scheme)
    out = tensor_format("lm_head.weight", scheme)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = (_matrix(q + 2 * kv, c.hidden_size, body) + _matrix(c.hidden_size, q, body)
             + _matrix(2 * c.intermediate_size, c.hidden_size, body) + _matrix(c.hidden_size, c.intermediate_size, body))
    return c.num_layers * layer + _matrix(c.tokenizer_size, c.hidden_size, out)
