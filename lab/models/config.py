"""The architecture of a model, in the few numbers the reference and the engine need."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

ARCHS = ("qwen3", "qwen2", "llama")
_HF_ARCH = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
HF_CLASS = {v: k for k, v in _HF_ARCH.items()}


@dataclass
class ModelConfig:
    arch: str                   # qwen3 | qwen2 | llama
    vocab_size: int             # rows of the embedding
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int               # from the config, not hidden // heads (Qwen3: 128)
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position: int = 32768
    attention_bias: bool = False   # biases on q, k, v (Qwen2 has them)
    tokenizer_size: int | None = None   # tokens the tokenizer knows; rows past it are never scored
    eos_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one the lab knows: {', '.join(ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.tokenizer_size is None:
            self.tokenizer_size = self.vocab_size

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2" or self.attention_bias

    @classmethod
    def from_hf(cls, hf: dict, tokenizer_size: int | None = None) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None) or {
            "qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}.get(hf.get("model_type"))
        if arch is None:
            raise ValueError(f"architecture {archs or hf.get('model_type')!r} is not one the lab knows: "
                             f"{', '.join(_HF_ARCH)}")
        rope = hf.get("rope_parameters") or {}
        theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
        eos = hf.get("eos_token_id")
        return cls(
            arch=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rope_theta=float(theta), rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position=int(hf.get("max_position_embeddings", 32768)),
            attention_bias=bool(hf.get("attention_bias", False)) and arch == "llama",
            tokenizer_size=tokenizer_size,
            eos_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    def to_hf(self) -> dict:
        """A transformers config dict for the same architecture (for tests against transformers)."""
        d = {
            "architectures": [HF_CLASS[self.arch]], "model_type": self.arch,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_embeddings, "max_position_embeddings": self.max_position,
            "hidden_act": "silu", "attention_dropout": 0.0, "use_cache": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.arch == "qwen2":
            d["use_sliding_window"] = False
        return d

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "ModelConfig":
        return cls(**json.loads(s))

    @classmethod
    def load(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(folder) / "config.json").read_text()))
