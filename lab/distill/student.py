"""The draft being trained: the reference model, run over a whole sequence with gradients
and no cache, with the parameters a method trains — all of them, all but the embedding,
or low-rank adapters (LoRA) beside frozen projections.

With `qat` set to a scheme, the forward pass is the quantization twin's — weights in the
scheme's block formats, 8-bit activations at every quantized matmul — and gradients pass
straight through the rounding to the fp32 weights. The draft the engine runs is the
quantized one, so that is the one trained: fp32 updates smaller than a 4-bit grid step
would otherwise vanish at export.
"""
from __future__ import annotations

import math

import torch

from ..models.config import ModelConfig
from ..models.reference import Reference
from ..models.twin import fake_quant, fake_quant_weight, tensor_format

METHODS = ("full", "frozen-emb", "lora")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


class _StraightThrough(torch.autograd.Function):
    """Forward: the rounded value; backward: the gradient as if no rounding happened."""

    @staticmethod
    def forward(ctx, x, rounded):
        return rounded.view_as(rounded)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return _StraightThrough.apply(x, rounded.detach())


class Student(Reference):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], method: str = "full",
                 rank: int = 16, lora_alpha: float = 32.0, seed: int = 0, qat: str | None = None):
        if method not in METHODS:
            raise ValueError(f"method {method!r}: choose one of {', '.join(METHODS)}")
        super().__init__(config, {n: t.detach().clone() for n, t in weights.items()}, max_context=1)
        self.method, self.qat = method, qat
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scale = lora_alpha / rank
        self._rounded: dict[str, torch.Tensor] = {}
        if method == "lora":
            g = torch.Generator().manual_seed(seed)
            for name in self.w:
                if name.endswith(".weight") and any(p in name for p in PROJECTIONS):
                    out_f, in_f = self.w[name].shape
                    a = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
                    self.lora[name[:-7]] = (a, torch.zeros(out_f, rank))       # B = 0: starts as the stock draft
        for t in self.trainable().values():
            t.requires_grad_(True)
        self.refresh()

    def trainable(self) -> dict[str, torch.Tensor]:
        """name -> tensor, each tensor once (a tied embedding is one tensor under two names)."""
        if self.method == "lora":
            return {f"{n}.lora_{x}": t for n, (a, b) in self.lora.items() for x, t in (("a", a), ("b", b))}
        out, seen = {}, set()
        for n, t in self.w.items():
            if id(t) in seen or (self.method == "frozen-emb" and n in EMBEDDINGS):
                continue
            seen.add(id(t))
            out[n] = t
        return out

    def to_device(self, dev) -> None:
        """Moves weights and adapters (a tied tensor stays one tensor), keeping what trains a leaf."""
        train = {id(t) for t in self.trainable().values()}
        moved = {}
        for n, t in self.w.items():
            if id(t) not in moved:
                moved[id(t)] = t.detach().to(dev).requires_grad_(id(t) in train)
            self.w[n] = moved[id(t)]
        self.lora = {n: (a.detach().to(dev).requires_grad_(True), b.detach().to(dev).requires_grad_(True))
                     for n, (a, b) in self.lora.items()}
        self.refresh()

    # -- quantization-aware training ------------------------------------------------------

    def _weight(self, name: str) -> torch.Tensor:
        """A weight with its adapter folded in (differentiable)."""
        w = self.w[name + ".weight"]
        if name in self.lora:
            a, b = self.lora[name]
            w = w + (b @ a) * self.scale
        return w

    @torch.no_grad()
    def refresh(self) -> None:
        """Rounds every quantized weight to its format once; call after each optimizer step."""
        if not self.qat:
            return
        done = {}
        for n, t in self.w.items():
            fmt = tensor_format(n, self.qat)
            if fmt != "f32":
                key = (id(t), fmt) if n[:-7] not in self.lora else n
                if key not in done:
                    done[key] = fake_quant_weight(self._weight(n[:-7]), fmt)
                self._rounded[n] = done[key]

    def _quantized(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        w = self._weight(name)
        if name + ".weight" not in self._rounded:
            return x, w
        return straight_through(x, fake_quant(x.detach())), straight_through(w, self._rounded[name + ".weight"])

    # -- the model --------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x, w = self._quantized(x, name)
        y = x @ w.T
        bias = self.w.get(name + ".bias")
        return y + bias if bias is not None else y

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        name = "model.embed_tokens.weight"
        if self.qat and self.config.tie_embeddings:
            name = "lm_head.weight"                  # the engine embeds from the output layer's blocks
        w = self.w[name]
        return straight_through(w, self._rounded[name])[tokens] if name in self._rounded else w[tokens]

    def attention(self, i: int, x: torch.Tensor, pos: int, cos, sin) -> torch.Tensor:
        q, k, v = self.qkv(i, x, cos, sin)           # the whole sequence: no cache to fill
        return self.attend(i, q, k, v, 0)

    def hidden(self, tokens) -> torch.Tensor:
        """Final normed hidden states [T, hidden] of a sequence from position 0 (as the output
        layer sees them: 8-bit blocks under qat)."""
        h = self.body(torch.as_tensor(tokens, dtype=torch.long).reshape(-1), 0)
        return straight_through(h, fake_quant(h.detach())) if "lm_head.weight" in self._rounded else h

    @property
    def output_matrix(self) -> torch.Tensor:
        """The rows of the output layer that are scored (up to the tokenizer's length)."""
        w = self.w["lm_head.weight"]
        if "lm_head.weight" in self._rounded:
            w = straight_through(w, self._rounded["lm_head.weight"])
        return w[:self.config.tokenizer_size]

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named weights with the adapters folded in, for export."""
        out = {n: t.detach().clone() for n, t in self.w.items()}
        for name in self.lora:
            out[name + ".weight"] = self._weight(name).detach().clone()
        if self.config.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out
