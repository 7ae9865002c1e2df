"""The draft being trained: the reference model, run over a whole sequence with gradients
and no cache, with the parameters a method trains — all of them, all but the embedding,
or low-rank adapters (LoRA) beside frozen projections.

With `qat` set to a scheme, the forward pass is the quantization twin's — weights in the
scheme's block formats, 8-bit activations at every quantized matmul — and gradients pass
straight through the rounding to the fp32 weights. The draft the engine runs is the
quantized one, so that is the one trained: fp32 updates smaller than a 4-bit grid step
would otherwise vanish at export. The latent fp32 weights start at the centres of their
rounding bins (the stock draft's quantized values): weights converted from an 8-bit file
sit on 4-bit rounding boundaries, where the smallest step would flip a quarter of them.

`scales` keeps every quantized weight's integer codes and trains its per-block scales (and
the fp32 norms and biases): a continuous knob on the exact grid the engine runs, so a few
minutes of training change the 4-bit draft at all.
"""
from __future__ import annotations

import math

import torch

from ..models.config import ModelConfig
from ..models.reference import Reference
from ..models.twin import fake_quant, fake_quant_weight, tensor_format, weight_blocks

METHODS = ("full", "frozen-emb", "lora", "scales")
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
        if method == "scales" and not qat:
            raise ValueError("method 'scales' trains the block scales of a quantized draft: give qat=<scheme>")
        super().__init__(config, {n: t.detach().clone() for n, t in weights.items()}, max_context=1)
        self.method, self.qat = method, qat
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scale = lora_alpha / rank
        self.quantized = {n for n in self.w if qat and tensor_format(n, qat) != "f32"}
        self.codes: dict[str, torch.Tensor] = {}        # scales: name -> int8 codes [rows, blocks, 32]
        self.base: dict[str, torch.Tensor] = {}         # scales: name -> the stock per-block scales [rows, blocks]
        self.scales: dict[str, torch.Tensor] = {}       # scales: name -> their relative change, trained
        self._rounded: dict[str, torch.Tensor] = {}     # full/lora under qat: the engine's weights now
        self._start_on_grid()
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

    def _start_on_grid(self) -> None:
        done = {}
        for n in sorted(self.quantized):
            t, fmt = self.w[n], tensor_format(n, self.qat)
            if (id(t), fmt) not in done:
                q, d = weight_blocks(t, fmt)
                done[(id(t), fmt)] = (q, d, (q * d[:, None]).reshape(t.shape))
            q, d, deq = done[(id(t), fmt)]
            rows = t.shape[0]
            if self.method == "scales":
                self.codes[n] = q.to(torch.int8).reshape(rows, -1, 32)
                self.base[n] = d.reshape(rows, -1)
                self.scales[n] = done.setdefault(("u", id(t), fmt), torch.zeros_like(self.base[n]))
            self.w[n] = deq

    def trainable(self) -> dict[str, torch.Tensor]:
        """name -> tensor, each tensor once (a tied embedding is one tensor under two names)."""
        if self.method == "lora":
            return {f"{n}.lora_{x}": t for n, (a, b) in self.lora.items() for x, t in (("a", a), ("b", b))}
        out, seen = {}, set()
        pairs = ([(n[:-7] + ".scales", t) for n, t in self.scales.items()] +
                 [(n, t) for n, t in self.w.items() if n not in self.quantized]) if self.method == "scales" \
            else [(n, t) for n, t in self.w.items() if not (self.method == "frozen-emb" and n in EMBEDDINGS)]
        for n, t in pairs:
            if id(t) not in seen:
                seen.add(id(t))
                out[n] = t
        return out

    def to_device(self, dev) -> None:
        """Moves everything (a tied tensor stays one tensor), keeping what trains a leaf."""
        train = {id(t) for t in self.trainable().values()}
        moved = {}

        def mv(t):
            if id(t) not in moved:
                moved[id(t)] = t.detach().to(dev).requires_grad_(id(t) in train)
            return moved[id(t)]
        self.w = {n: mv(t) for n, t in self.w.items()}
        self.scales = {n: mv(t) for n, t in self.scales.items()}
        self.base = {n: t.to(dev) for n, t in self.base.items()}
        self.codes = {n: t.to(dev) for n, t in self.codes.items()}
        self.lora = {n: (mv(a), mv(b)) for n, (a, b) in self.lora.items()}
        self.refresh()

    # -- quantization-aware training ------------------------------------------------------

    def _weight(self, name: str) -> torch.Tensor:
        """The weight the forward pass uses: adapters folded in; under qat the engine's values,
        differentiable (scales: codes x scales; otherwise straight through the rounding)."""
        n = name + ".weight"
        if n in self.scales:
            d = self.base[n] * (1 + self.scales[n])     # relative: Adam's steps suit scales of any size
            d = straight_through(d, d.detach().half().float())
            return (self.codes[n].float() * d[..., None]).reshape(self.w[n].shape)
        w = self.w[n]
        if name in self.lora:
            a, b = self.lora[name]
            w = w + (b @ a) * self.scale
        return straight_through(w, self._rounded[n]) if n in self._rounded else w

    @torch.no_grad()
    def refresh(self) -> None:
        """Rounds the quantized weights the optimizer moved (full and LoRA under qat); call
        after each step."""
        if not self.qat or self.method == "scales":
            return
        self._rounded = {}                      # cleared: _weight below gives the unrounded values
        done, rounded = {}, {}
        for n in self.quantized:
            fmt = tensor_format(n, self.qat)
            key = (id(self.w[n]), fmt) if n[:-7] not in self.lora else n      # a tied tensor rounds once
            if key not in done:
                done[key] = fake_quant_weight(self._weight(n[:-7]), fmt)
            rounded[n] = done[key]
        self._rounded = rounded

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name + ".weight" in self.quantized:
            x = straight_through(x, fake_quant(x.detach()))        # 8-bit activation blocks
        y = x @ self._weight(name).T
        bias = self.w.get(name + ".bias")
        return y + bias if bias is not None else y

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # a tied engine file embeds from the output layer's blocks
        name = "lm_head" if self.qat and self.config.tie_embeddings else "model.embed_tokens"
        return self._weight(name)[tokens]

    def attention(self, i: int, x: torch.Tensor, pos: int, cos, sin) -> torch.Tensor:
        q, k, v = self.qkv(i, x, cos, sin)           # the whole sequence: no cache to fill
        return self.attend(i, q, k, v, 0)

    def hidden(self, tokens) -> torch.Tensor:
        """Final normed hidden states [T, hidden] of a sequence from position 0 (as the output
        layer sees them: 8-bit blocks under qat)."""
        h = self.body(torch.as_tensor(tokens, dtype=torch.long).reshape(-1), 0)
        return straight_through(h, fake_quant(h.detach())) if "lm_head.weight" in self.quantized else h

    @property
    def output_matrix(self) -> torch.Tensor:
        """The rows of the output layer that are scored (up to the tokenizer's length)."""
        return self._weight("lm_head")[:self.config.tokenizer_size]

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named weights as the forward pass uses them (adapters folded in, under
        qat the engine's values), for export."""
        with torch.no_grad():
            out = {n: (self._weight(n[:-7]) if n.endswith(".weight") else t).detach().cpu().clone()
                   for n, t in self.w.items()}
        if self.config.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out
