"""Load a model by registry name, folder or GGUF path -> config, fp32 weights, tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .registry import ModelError, resolve
from .tiny import TINY, tiny_weights


@dataclass
class Loaded:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object | None        # a transformers tokenizer; None for tiny models
    folder: Path | None


def tokenizer_size(tok) -> int:
    """Tokens the tokenizer really has: a GGUF-built tokenizer pads its list to the
    embedding's rows with [PADnnnnnn] placeholders, which are never scored."""
    import re
    n = len(tok)
    pad = re.compile(r"\[PAD\d+\]")
    while n > 0 and pad.fullmatch(tok.convert_ids_to_tokens(n - 1) or ""):
        n -= 1
    return n


def load(name_or_path: str, seed: int = 0, tokenizer: bool = True) -> Loaded:
    if name_or_path in TINY:
        c = TINY[name_or_path]
        return Loaded(name_or_path, c, tiny_weights(c, seed), None, None)
    folder = resolve(name_or_path)
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors files")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(folder))
    import json
    hf = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf(hf, tokenizer_size=tokenizer_size(tok) if tok is not None else None)
    if tok is not None:
        eos = {i for i in (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
               if isinstance(i, int) and i >= 0 and i != tok.unk_token_id}
        config.eos_ids = sorted(set(config.eos_ids) | eos | ({tok.eos_token_id} if tok.eos_token_id is not None else set()))
    return Loaded(str(name_or_path), config, {k: v.float() for k, v in weights.items()}, tok, folder)
