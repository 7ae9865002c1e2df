"""Writes the fuzzers' seed corpus: valid weights files of the tiny models.

Every tiny model of lab.models.TINY (qwen3 with q/k norms, qwen2 with qkv biases, llama,
tied and untied embeddings) is exported with lab.models.export.export under each scheme
(f32, q8, q4, q4-q8out), plus a trimmed draft (output_ids / output_trim) and a few
smaller models built here, so that every branch of the reader starts from a file it
accepts. Files larger than --max-bytes are skipped (libFuzzer mutates small inputs far
faster; the smallest file of each kind is what matters). Nothing here is committed: the
Makefile writes the corpus under build/fuzz/seeds.

usage: python fuzz/seeds.py OUT_DIR [--max-bytes N]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SCHEMES = ("f32", "q8", "q4", "q4-q8out")


def configs():
    from lab.models import TINY, ModelConfig
    small = {
        # one layer, a vocabulary of 8 in a 32-wide model: the smallest file of each kind
        "mini-qwen3": ModelConfig(arch="qwen3", vocab_size=8, hidden_size=32, intermediate_size=32,
                                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                  tie_embeddings=True, max_position=256, tokenizer_size=8, eos_ids=[7]),
        "mini-qwen2": ModelConfig(arch="qwen2", vocab_size=8, hidden_size=32, intermediate_size=32,
                                  num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                                  tie_embeddings=False, max_position=256, tokenizer_size=6, eos_ids=[5, 4]),
        "mini-llama": ModelConfig(arch="llama", vocab_size=16, hidden_size=32, intermediate_size=64,
                                  num_layers=2, num_heads=1, num_kv_heads=1, head_dim=32, rope_theta=10_000.0,
                                  rms_eps=1e-5, tie_embeddings=False, max_position=256, tokenizer_size=16),
    }
    return {**small, **TINY}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-bytes", type=int, default=160 << 10)
    a = ap.parse_args(argv)
    from lab.models import tiny_weights
    from lab.models import export as ex

    a.out.mkdir(parents=True, exist_ok=True)
    written = skipped = 0
    for name, c in configs().items():
        w = tiny_weights(c, seed=3)
        jobs = [(s, None) for s in SCHEMES]
        if name in ("mini-qwen2", "tiny-qwen2-draft"):                # a trimmed draft: output_ids
            jobs.append(("q4", list(range(0, c.tokenizer_size, 2))))
        for scheme, keep in jobs:
            path = a.out / f"{name}-{scheme}{'-trim' if keep else ''}.lab"
            ex.export(c, w, path, scheme, meta={"source": name}, keep=keep)
            if path.stat().st_size > a.max_bytes:
                path.unlink()
                skipped += 1
            else:
                ex.read(path)                  # each seed is one the readers accept
                written += 1
    print(f"seeds: {written} files in {a.out} ({skipped} over {a.max_bytes} bytes skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
