"""Files written whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> Path:
    """Writes beside path and renames, so a kill leaves the old file or the new one, never a
    torn one (the process id keeps two writers' temporary files apart)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
