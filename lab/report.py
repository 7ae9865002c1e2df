"""What a notebook leaves behind: its results as JSON, with the machine and headline figures."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .files import write_text_atomic
from .machine import machine

ROOT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """Where `lab run` asked for results ($LAB_RESULTS_DIR), else outputs/interactive/."""
    return Path(os.environ.get("LAB_RESULTS_DIR") or ROOT / "outputs" / "interactive")


def save(name: str, results: dict, headline: dict) -> Path:
    d = results_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    return write_text_atomic(path, json.dumps({"notebook": name, "machine": machine(), "headline": headline,
                                               "results": results}, indent=1, default=float))
