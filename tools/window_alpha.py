"""Greedy α of the trimmed draft with windowed attention (docs/tuning.md).

Teacher-forced along the target's cached greedy answers to the Spec-Bench development
prompts (first turns), as the policy notebook's α against N is, once per (sink, window):
`Engine.set_window`. Prints α per group for each window, each prompt's hit rate averaged
(the notebook pools positions instead); window 0 is the draft as it runs.

    .venv/bin/python tools/window_alpha.py --per-group 16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab import vocab  # noqa: E402
from lab.distill.pipeline import specbench_samples  # noqa: E402
from lab.engine import Engine  # noqa: E402
from lab.kernels import Pool  # noqa: E402
from lab.models.export import engine_file  # noqa: E402

WINDOWS = ((32, 0), (32, 512), (32, 256), (32, 128), (64, 256), (128, 128))   # (sink, window)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--per-group", type=int, default=16, help="dev prompts per group (default 16: all)")
    a = p.parse_args(argv)
    pool = Pool(2)
    t = Engine(engine_file(a.target, "q4-q8out"), pool=pool, max_context=4096)
    samples = specbench_samples(t, a.target, a.per_group, 128)
    d = Engine(vocab.trimmed_draft_file(a.draft, a.target, vocab.DEFAULT_N), pool=pool, max_context=4096)
    hits: dict[tuple, dict[str, list[float]]] = {w: {} for w in WINDOWS}
    for s in samples:
        for sink, window in WINDOWS:
            d.set_window(window, sink=sink)
            hits[(sink, window)].setdefault(s.source, []).append(float(vocab.greedy_hits(d, s.prompt, s.answer).mean()))
    groups = sorted({s.source for s in samples})
    print("sink/window  " + "  ".join(f"{g[:13]:>13}" for g in groups) + "            all")
    for w, by in hits.items():
        every = [x for v in by.values() for x in v]
        print(f"{w[0]:>4}/{w[1]:<6}  " + "  ".join(f"{np.mean(by[g]):13.3f}" for g in groups) + f"  {np.mean(every):13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
