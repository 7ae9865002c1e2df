"""A model's next-token distributions with attention's products in f32 against bf16 and
amx (docs/tuning.md): perplexity of each over windows of Python's own standard library, the
KL divergence of each one's distribution from f32's per token, and how often the two pick
the same top token. The engines run in one process on the same pool, window by window;
amx where this CPU runs it.

    .venv/bin/python tools/attention_products.py --model qwen2.5-coder-1.5b --window 1024 --windows 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab import native  # noqa: E402
from lab.engine import Engine  # noqa: E402
from lab.kernels import Pool  # noqa: E402
from lab.models.export import engine_file  # noqa: E402
from lab.models.perplexity import stdlib_text, windows  # noqa: E402
from lab.models.registry import resolve  # noqa: E402


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(engines: dict, ws: list[list[int]]) -> dict:
    """-> perplexity per engine; against engines["f32"], for each other engine, KL(f32 || it)
    per token (mean, p99, max) and the share of equal top tokens."""
    nll = dict.fromkeys(engines, 0.0)
    others = [a for a in engines if a != "f32"]
    kl, same, n = {a: [] for a in others}, dict.fromkeys(others, 0), 0
    for w in ws:
        lp = {a: log_softmax(e.forward(w, 0)[:-1].astype(np.float64)) for a, e in engines.items()}
        target = np.array(w[1:])
        for a in engines:
            nll[a] -= lp[a][np.arange(target.size), target].sum()
        for a in others:
            kl[a].append((np.exp(lp["f32"]) * (lp["f32"] - lp[a])).sum(-1))
            same[a] += int((lp["f32"].argmax(-1) == lp[a].argmax(-1)).sum())
        n += target.size
    kl = {a: np.concatenate(v) for a, v in kl.items()}
    return {"predictions": n, "perplexity": {a: float(np.exp(v / n)) for a, v in nll.items()},
            "kl": {a: {"mean": float(v.mean()), "p99": float(np.quantile(v, 0.99)), "max": float(v.max())}
                   for a, v in kl.items()},
            "same_top": {a: v / n for a, v in same.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--windows", type=int, default=3, help="windows (default 3)")
    a = p.parse_args(argv)
    if a.window < 2 or a.windows < 1:
        raise SystemExit("--window: at least 2 tokens; --windows: at least 1")
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(resolve(a.model)))(stdlib_text())["input_ids"]
    ws = windows(ids, a.window, a.windows)
    if not ws:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than one window of {a.window}")
    pool = Pool()
    runs = ("f32", "bf16", "amx") if native.cpu()["kernels"]["attention"] == "amx" else ("f32", "bf16")
    engines = {m: Engine(engine_file(a.model), pool=pool, max_context=a.window, attention=m) for m in runs}
    r = compare(engines, ws)
    print(f"{a.model}: {len(ws)} windows of {a.window} tokens ({r['predictions']} predictions)")
    for m, ppl in r["perplexity"].items():
        print(f"  perplexity, {m} products: {ppl:.4f}")
    for m, k in r["kl"].items():
        print(f"  KL(f32 || {m}) per token: mean {k['mean']:.2e}, p99 {k['p99']:.2e}, max {k['max']:.2e}; "
              f"same top token: {r['same_top'][m]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
