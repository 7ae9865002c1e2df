"""The from-scratch PyTorch reference for Qwen3, Qwen2 and Llama (docs/science.md §6).

Written to be read: one function per idea, an explicit KV cache laid out like the
engine's ([layer][kv_head][position][head_dim]), and forward(tokens[k], pos) serving
decoding, verification and prompt processing alike. Weights keep Hugging Face's names.
The twin subclasses it and changes only `linear`, `store_kv` and `attention_operand`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [heads, k, head_dim]: element i pairs with i + head_dim/2."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Reference(torch.nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_context: int = 2048):
        super().__init__()
        self.config = config
        self.w = {name: t.float() for name, t in weights.items()}
        if config.tie_embeddings or "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self._check_weights()
        self.max_context = max_context
        c = config
        shape = (c.num_layers, c.num_kv_heads, max_context, c.head_dim)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self.pos = 0                      # tokens in the cache

    def _check_weights(self) -> None:
        c, missing = self.config, []
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
            if c.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            if c.qkv_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        missing = [n for n in names if n not in self.w]
        if missing:
            raise ValueError(f"weights for {c.arch} lack {len(missing)} tensors, e.g. {missing[:3]}")

    # -- the two places the twin differs ------------------------------------------------

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y + bias if bias is not None else y

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w["model.embed_tokens.weight"][tokens]

    def store_kv(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        self.k_cache[layer, :, pos:pos + n] = k
        self.v_cache[layer, :, pos:pos + n] = v

    # -- the model ------------------------------------------------------------------------

    def reset(self, pos: int = 0) -> None:
        """Roll the cache back (or clear it): attention only ever reads below `pos`."""
        self.pos = pos

    def qkv(self, i: int, x: torch.Tensor, cos, sin):
        """Queries [heads, k, dim], and keys and values [kv_heads, k, dim], rotated."""
        c, p, k = self.config, f"model.layers.{i}.self_attn.", x.shape[0]
        q = self.linear(x, p + "q_proj").view(k, c.num_heads, c.head_dim).transpose(0, 1)
        kk = self.linear(x, p + "k_proj").view(k, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = self.linear(x, p + "v_proj").view(k, c.num_kv_heads, c.head_dim).transpose(0, 1)
        if c.qk_norm:
            q = rms_norm(q, self.w[p + "q_norm.weight"], c.rms_eps)
            kk = rms_norm(kk, self.w[p + "k_norm.weight"], c.rms_eps)
        return rotate(q, cos, sin), rotate(kk, cos, sin), v

    def attend(self, i: int, q, keys, values, pos: int) -> torch.Tensor:
        """Causal attention of k queries at pos.. over keys/values for positions 0..pos+k-1."""
        c, k = self.config, q.shape[1]
        group = c.num_heads // c.num_kv_heads
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
        q, keys, values = (self.attention_operand(t) for t in (q, keys, values))
        scores = (q @ keys.transpose(1, 2)) * (c.head_dim ** -0.5)
        causal = torch.arange(pos + k)[None, :] > (pos + torch.arange(k))[:, None]
        scores = scores.masked_fill(causal, float("-inf"))
        out = self.attention_operand(torch.softmax(scores.float(), dim=-1)) @ values
        return self.linear(out.transpose(0, 1).reshape(k, c.num_heads * c.head_dim), f"model.layers.{i}.self_attn.o_proj")

    def attention_operand(self, x: torch.Tensor) -> torch.Tensor:
        """An operand of attention's products (queries, keys, values, probabilities) as they
        are multiplied: here, as it is."""
        return x

    def attention(self, i: int, x: torch.Tensor, pos: int, cos, sin) -> torch.Tensor:
        q, kk, v = self.qkv(i, x, cos, sin)
        self.store_kv(i, pos, kk, v)
        k = x.shape[0]
        return self.attend(i, q, self.k_cache[i, :, :pos + k], self.v_cache[i, :, :pos + k], pos)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        return self.linear(F.silu(self.linear(x, p + "gate_proj")) * self.linear(x, p + "up_proj"), p + "down_proj")

    def body(self, tokens: torch.Tensor, pos: int, hidden: list | None = None) -> torch.Tensor:
        """The final normed hidden states [k, hidden] of tokens at pos.. (grad-enabled)."""
        c = self.config
        cos, sin = rope_tables(c.head_dim, c.rope_theta, torch.arange(pos, pos + tokens.numel()))
        x = self.embed(tokens)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            x = x + self.attention(i, rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_eps), pos, cos, sin)
            x = x + self.mlp(i, rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_eps))
            if hidden is not None:
                hidden.append(x.clone())
        return rms_norm(x, self.w["model.norm.weight"], c.rms_eps)

    @torch.no_grad()
    def forward(self, tokens, pos: int | None = None, hidden: list | None = None) -> torch.Tensor:
        """Logits [k, vocab] for k tokens placed at positions pos..pos+k-1 (default: after the
        cache). With `hidden` a list, appends the hidden state after every layer."""
        c = self.config
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        pos = self.pos if pos is None else pos
        k = tokens.numel()
        if k == 0:
            raise ValueError("forward needs at least one token")
        if pos + k > self.max_context:
            raise ValueError(f"positions {pos}..{pos + k - 1} run past the cache's {self.max_context}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        x = self.body(tokens, pos, hidden)
        self.pos = pos + k
        return self.linear(x, "lm_head")

    @torch.no_grad()
    def greedy(self, prompt, n: int, chunk: int | None = None) -> list[int]:
        """Greedy continuation: the prompt in chunks (all at once by default), then token by token."""
        prompt = list(prompt)
        self.reset()
        chunk = chunk or len(prompt)
        for s in range(0, len(prompt), chunk):
            logits = self.forward(prompt[s:s + chunk])
        out = []
        for _ in range(n):
            t = int(logits[-1, :self.config.tokenizer_size].argmax())
            out.append(t)
            logits = self.forward([t])
        return out
