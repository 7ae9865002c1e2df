"""Tiny random Qwen3, Qwen2 and Llama models built in code (seeded): for tests and the
quick profile. Every width is a multiple of 32 so the block formats apply."""
from __future__ import annotations

import torch

from .config import ModelConfig

TINY = {
    "tiny-qwen3": ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=160,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                              rope_theta=1_000_000.0, tie_embeddings=True, max_position=4096,
                              tokenizer_size=370, eos_ids=[369]),
    "tiny-qwen2": ModelConfig(arch="qwen2", vocab_size=384, hidden_size=64, intermediate_size=128,
                              num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                              rope_theta=1_000_000.0, tie_embeddings=False, max_position=4096,
                              tokenizer_size=380, eos_ids=[379]),
    "tiny-llama": ModelConfig(arch="llama", vocab_size=320, hidden_size=96, intermediate_size=192,
                              num_layers=2, num_heads=6, num_kv_heads=3, head_dim=16,
                              rope_theta=10_000.0, rms_eps=1e-5, tie_embeddings=False,
                              max_position=4096, tokenizer_size=320, eos_ids=[2]),
    # a smaller model with tiny-qwen2's vocabulary: its draft (quick distillation)
    "tiny-qwen2-draft": ModelConfig(arch="qwen2", vocab_size=384, hidden_size=32, intermediate_size=64,
                                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    rope_theta=1_000_000.0, tie_embeddings=True, max_position=4096,
                                    tokenizer_size=380, eos_ids=[379]),
    # vocabulary of 16: every length-2 continuation can be enumerated (sampling tests)
    "tiny-v16": ModelConfig(arch="qwen2", vocab_size=16, hidden_size=32, intermediate_size=64,
                            num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                            rope_theta=10_000.0, tie_embeddings=False, max_position=512,
                            tokenizer_size=16, eos_ids=[]),
}


def tiny_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names, scaled so activations stay O(1) and the
    logits are far from ties (so greedy continuations are a sharp test)."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def mat(rows, cols, gain=1.0):
        return torch.randn(rows, cols, generator=g) * (gain / cols ** 0.5)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g),
         "model.norm.weight": norm(c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = norm(c.hidden_size)
        w[p + "self_attn.q_proj.weight"] = mat(q_dim, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = mat(kv_dim, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = mat(kv_dim, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(c.hidden_size, q_dim, 0.5)
        w[p + "mlp.gate_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(c.hidden_size, c.intermediate_size, 0.5)
        if c.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(c.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(c.head_dim)
        if c.qkv_bias:
            for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                w[p + f"self_attn.{x}_proj.bias"] = 0.1 * torch.randn(n, generator=g)
    if not c.tie_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, c.hidden_size, 4.0)
    return w


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """The same model in transformers (fp32, eager attention), for comparisons."""
    import transformers
    cls = getattr(transformers, {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "llama": "LlamaForCausalLM"}[config.arch])
    cfg_cls = getattr(transformers, {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig"}[config.arch])
    cfg = cfg_cls(**{k: v for k, v in config.to_hf().items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings:
        model.tie_weights()
    return model
