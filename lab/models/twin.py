"""The quantization twin: the reference with weights in the lab's block formats,
activations fake-quantized to 8-bit blocks at every matmul input, and the KV cache
rounded to fp16 (to bf16, with attention's other operands, where the engine multiplies in bf16) —
so PyTorch predicts what the engine computes (docs/science.md §6: closely,
never elementwise)."""
from __future__ import annotations

import numpy as np
import torch

from .. import formats
from .config import ModelConfig
from .reference import Reference

SCHEMES = ("f32", "q8", "q4", "q4-q8out")


def tensor_format(name: str, scheme: str) -> str:
    """The format a weight takes under a scheme: 1-D tensors stay f32; the output layer
    (and the embedding it may share) is q8 under q4-q8out."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}: choose one of {', '.join(SCHEMES)}")
    if not name.endswith(".weight") or any(s in name for s in ("norm.", "layernorm")):
        return "f32"
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        return "q8" if scheme == "q4-q8out" else scheme
    return "q4" if scheme == "q4-q8out" else scheme


def round_away_t(v: torch.Tensor) -> torch.Tensor:
    t = torch.trunc(v)
    return t + torch.where((v - t).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))


def act_scales_t(amax: torch.Tensor) -> torch.Tensor:
    """lab.formats.act_scales in torch: each block's power-of-two scale (0 for 0)."""
    _, ex = torch.frexp(amax)
    e = torch.where(torch.ldexp(amax, (7 - ex).float()) <= 127, ex - 7, ex - 6).clamp(min=formats.ACT_EXP_MIN)
    s = torch.ldexp(torch.ones_like(amax), e.float())
    return torch.where(amax == 0, torch.zeros_like(amax), s)


def quantize_acts_t(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit activation blocks along the last axis -> (q [..., nb, 32] int8, d [..., nb] fp32);
    the same bytes as lab.formats.quantize_acts and the C++ quantizer."""
    xb = x.float().reshape(*x.shape[:-1], -1, formats.QK)
    d = act_scales_t(xb.abs().amax(-1))
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.clamp(round_away_t(xb / safe[..., None]), -127, 127)
    q = torch.where(d[..., None] == 0, torch.zeros_like(q), q)
    return q.to(torch.int8), d


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    q, d = quantize_acts_t(x)
    return (q.float() * d[..., None]).reshape(x.shape)


def weight_blocks(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in q8 or q4 blocks, in torch -> (integer codes [blocks, 32] as floats, centred:
    q for q8, q - 8 for q4; scales [blocks], fp16-rounded). The same numbers as lab.formats."""
    wb = w.detach().float().reshape(-1, formats.QK)
    if fmt == "q8":
        s = wb.abs().amax(1) / 127.0
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.where(s[:, None] == 0, torch.zeros_like(wb), torch.clamp(round_away_t(wb / safe[:, None]), -127, 127))
    elif fmt == "q4":
        i = wb.abs().argmax(1, keepdim=True)                    # first value of largest magnitude
        s = wb.gather(1, i)[:, 0] / -8.0
        s = torch.where(wb.abs().amax(1) == 0, torch.zeros_like(s), s)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.where(s[:, None] == 0, torch.zeros_like(wb), torch.clamp(torch.floor(wb / safe[:, None] + 8.5), 0, 15) - 8)
    else:
        raise ValueError(f"no blocks for format {fmt!r}")
    return q, s.half().float()


def fake_quant_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """A weight [rows, cols] quantized to q8 or q4 blocks and back: the engine's values."""
    if fmt == "f32":
        return w
    q, d = weight_blocks(w, fmt)
    return (q * d[:, None]).reshape(w.shape)


def quantize_weights(weights: dict[str, torch.Tensor], scheme: str) -> dict[str, formats.QTensor | torch.Tensor]:
    """Each weight in its scheme's format: QTensor for q8/q4, the fp32 tensor otherwise."""
    from ..kernels import quantize        # the C++ quantizer: the same bytes, much faster
    out = {}
    for name, w in weights.items():
        fmt = tensor_format(name, scheme)
        out[name] = w.float() if fmt == "f32" else quantize(
            np.ascontiguousarray(w.float().numpy()), fmt, name)
    return out


def quantized_reference_weights(config: ModelConfig, weights: dict[str, torch.Tensor], scheme: str):
    """-> (the weights in their formats, the same dequantized as fp32 tensors). A tied model's
    one tensor serves both ends, in the output layer's format."""
    if config.tie_embeddings or "lm_head.weight" not in weights:
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    quantized = quantize_weights(weights, scheme)
    deq = {n: (torch.from_numpy(q.dequantize()) if isinstance(q, formats.QTensor) else q)
           for n, q in quantized.items()}
    if config.tie_embeddings:
        deq["model.embed_tokens.weight"] = deq["lm_head.weight"]
    return quantized, deq


class Twin(Reference):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], scheme: str = "q4-q8out",
                 max_context: int = 2048, attention: str = "f32"):
        if attention not in ("f32", "bf16", "amx"):
            raise ValueError(f"attention={attention!r}: the engine's products are 'f32', 'bf16' or 'amx'")
        # amx: bf16's operands, summed by tiles in an order of their own (within float rounding)
        self.scheme, self.attention_products = scheme, "bf16" if attention == "amx" else attention
        self.quantized, deq = quantized_reference_weights(config, weights, scheme)
        super().__init__(config, deq, max_context)
        self.quantized_names = {n for n, q in self.quantized.items() if isinstance(q, formats.QTensor)}

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name + ".weight" in self.quantized_names:
            x = fake_quant(x)
        return super().linear(x, name)

    def store_kv(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache = torch.bfloat16 if self.attention_products == "bf16" else torch.half
        super().store_kv(layer, pos, k.to(cache).float(), v.to(cache).float())

    def attention_operand(self, x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float() if self.attention_products == "bf16" else x
