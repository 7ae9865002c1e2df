"""A `lab bench speculative --json` result's predictions, binned by how fast its plain runs went,
and priced again with other cost tables (docs/tuning.md, "Costs per bandwidth state").

The rows keep the rounds each run made, so any cost table can price them again. Without --costs
the rows' own predictions are binned; each --costs FILE (a Costs JSON: a cache file under
~/.cache/lab/costs/, or one entry of a result's "cost_tables", name -> Costs) prices every row.

    .venv/bin/python tools/reprice.py bench.json
    .venv/bin/python tools/reprice.py bench.json --costs ~/.cache/lab/costs/<key>.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab.policy import Costs  # noqa: E402
from lab.speculative import predicted  # noqa: E402

BANDS = (0, 45, 52, 60, float("inf"))     # plain tokens/s
PROMPT_BANDS = (0, 600, float("inf"))      # prompt tokens: long prompts (summarization, RAG) apart


def load_costs(path: str) -> Costs:
    d = json.loads(Path(path).expanduser().read_text())
    return Costs(**(d if "v" in d else next(iter(d.values()))))


def repredict(row: dict, costs: Costs) -> float:
    run = SimpleNamespace(rounds=row["rounds"], per_round=row["per_round"], kinds=row["kinds"],
                          prompt_tokens=row["prompt_tokens"], tokens=[0] * row["new_tokens"])
    return predicted(run, costs)


def bands(rows: list[dict], preds: list[float], key: str = "plain_tokens_per_s", edges=BANDS,
          what: str = "plain tokens/s") -> list[str]:
    """The prediction errors' correlation with rows[key], and their median in each band of it."""
    x = np.array([r[key] for r in rows])
    err = np.array([p / r["speedup"] - 1 for p, r in zip(preds, rows)])
    out = [f"correlation of {what} and prediction error: {np.corrcoef(x, err)[0, 1]:.2f}"]
    for lo, hi in zip(edges, edges[1:]):
        m = (x >= lo) & (x < hi)
        if m.any():
            out.append(f"  {what} {lo:>3}-{hi:<4}: {m.sum():3d} turns, median error {np.median(err[m]):+.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a lab bench speculative --json output")
    ap.add_argument("--costs", action="append", default=[], help="a cost table to price the rows with")
    a = ap.parse_args()
    rows = json.loads(Path(a.result).read_text())["rows"]
    print(f"{a.result}: the rows' own predictions")
    print("\n".join(bands(rows, [r["predicted"] for r in rows])))
    print("\n".join(bands(rows, [r["predicted"] for r in rows], "prompt_tokens", PROMPT_BANDS, "prompt tokens")))
    for path in a.costs:
        c = load_costs(path)
        print(f"{path} (c at 512: {c.at(512)[1]:.3f}, v(4) at 2048: {c.at(2048)[0][4]:.3f})")
        print("\n".join(bands(rows, [repredict(r, c) for r in rows])))


if __name__ == "__main__":
    main()
