"""A model's configuration by name, without loading its weights."""
from __future__ import annotations

import json

from .config import ModelConfig
from .registry import resolve
from .tiny import TINY


def config_of(name: str) -> ModelConfig:
    if name in TINY:
        return TINY[name]
    folder = resolve(name)
    tok = None
    if (folder / "tokenizer.json").exists():
        from transformers import AutoTokenizer
        from .load import tokenizer_size
        tok = tokenizer_size(AutoTokenizer.from_pretrained(str(folder)))
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), tokenizer_size=tok)
