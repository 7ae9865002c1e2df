"""The draft being trained: the reference model, run over a whole sequence with gradients
and no cache, with the parameters a method trains — all of them, all but the embedding,
or low-rank adapters (LoRA) beside frozen projections."""
from __future__ import annotations

import math

import torch

from ..models.config import ModelConfig
from ..models.reference import Reference

METHODS = ("full", "frozen-emb", "lora")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


class Student(Reference):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], method: str = "full",
                 rank: int = 16, lora_alpha: float = 32.0, seed: int = 0):
        if method not in METHODS:
            raise ValueError(f"method {method!r}: choose one of {', '.join(METHODS)}")
        super().__init__(config, {n: t.detach().clone() for n, t in weights.items()}, max_context=1)
        self.method = method
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scale = lora_alpha / rank
        if method == "lora":
            g = torch.Generator().manual_seed(seed)
            for name in self.w:
                if name.endswith(".weight") and any(p in name for p in PROJECTIONS):
                    out_f, in_f = self.w[name].shape
                    a = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
                    self.lora[name[:-7]] = (a, torch.zeros(out_f, rank))       # B = 0: starts as the stock draft
        for t in self.trainable().values():
            t.requires_grad_(True)

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

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = super().linear(x, name)
        if name in self.lora:
            a, b = self.lora[name]
            y = y + (x @ a.T) @ b.T * self.scale
        return y

    def attention(self, i: int, x: torch.Tensor, pos: int, cos, sin) -> torch.Tensor:
        q, k, v = self.qkv(i, x, cos, sin)           # the whole sequence: no cache to fill
        return self.attend(i, q, k, v, 0)

    def hidden(self, tokens) -> torch.Tensor:
        """Final normed hidden states [T, hidden] of a sequence from position 0."""
        return self.body(torch.as_tensor(tokens, dtype=torch.long).reshape(-1), 0)

    @property
    def output_matrix(self) -> torch.Tensor:
        """The rows of the output layer that are scored (up to the tokenizer's length)."""
        return self.w["lm_head.weight"][:self.config.tokenizer_size]

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named weights with the adapters folded in, for export."""
        out = {n: t.detach().clone() for n, t in self.w.items()}
        for name, (a, b) in self.lora.items():
            out[name + ".weight"] += (b @ a).detach() * self.scale
        if self.config.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out
