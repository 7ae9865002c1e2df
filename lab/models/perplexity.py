"""Perplexity over a text corpus in fixed, non-overlapping windows."""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch

# A code corpus every machine has: modules of Python's own standard library, in this order.
STDLIB_FILES = ("textwrap.py", "argparse.py", "json/decoder.py", "json/encoder.py", "shlex.py",
                "fnmatch.py", "statistics.py", "heapq.py", "bisect.py", "string.py")


def stdlib_text(max_chars: int | None = None) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((root / f).read_text() for f in STDLIB_FILES)
    return text[:max_chars] if max_chars else text


def windows(ids: list[int], window: int, count: int | None = None) -> list[list[int]]:
    out = [ids[s:s + window] for s in range(0, len(ids) - window + 1, window)]
    return out[:count] if count else out


@torch.no_grad()
def nll(model, window: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens 1.. of a window given what precedes them."""
    model.reset()
    logits = model.forward(window)[:-1, :model.config.tokenizer_size]
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(window[1:])
    return float(-logp[torch.arange(len(target)), target].sum()), len(target)


def perplexity(model, ids: list[int], window: int = 256, count: int | None = None, progress: bool = False) -> float:
    ws = windows(ids, window, count)
    if not ws:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one window of {window}")
    if progress:
        from tqdm.auto import tqdm
        ws = tqdm(ws, desc="perplexity", unit="window")
    total, n = 0.0, 0
    for w in ws:
        s, k = nll(model, w)
        total, n = total + s, n + k
    return math.exp(total / n)


VARIANTS = ("f32", "q8", "q4", "q4-q8out", "twin-q8", "twin-q4-q8out", "twin-q4-q8out-bf16")


def build(variant: str, config, weights, max_context: int = 2048):
    """f32: the reference; q8/q4/q4-q8out: the reference on quantized weights only;
    twin-*: the full twin (weights, 8-bit activations, fp16 KV cache), and with a -bf16
    suffix its KV cache in bf16 and attention's other operands rounded to bf16, as the
    engine's bf16 products round them."""
    from .reference import Reference
    from .twin import SCHEMES, Twin, quantized_reference_weights
    if variant == "f32":
        return Reference(config, weights, max_context)
    if variant.startswith("twin-"):
        scheme, bf16 = variant[5:].removesuffix("-bf16"), variant.endswith("-bf16")
        if scheme not in SCHEMES:
            raise ValueError(f"variant={variant!r}: choose from {', '.join(VARIANTS)}")
        return Twin(config, weights, scheme, max_context, attention="bf16" if bf16 else "f32")
    if variant not in SCHEMES:
        raise ValueError(f"variant={variant!r}: choose from {', '.join(VARIANTS)}")
    _, deq = quantized_reference_weights(config, weights, variant)
    return Reference(config, deq, max_context)


def table(config, weights, ids: list[int], variants=VARIANTS, window: int = 256, count: int | None = None,
          progress: bool = False) -> list[dict]:
    """Perplexity of each variant over the same windows; one model in memory at a time."""
    rows = []
    for v in variants:
        model = build(v, config, weights, max_context=window)
        rows.append({"variant": v, "perplexity": perplexity(model, ids, window, count, progress),
                     "window": window, "windows": len(windows(ids, window, count))})
        del model
    return rows
