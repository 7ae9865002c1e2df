"""What every result is recorded with: the machine, the commit and the date.

The native library loads only when machine() asks it about the CPU, so importing this
module (and lab.report, lab.runner with it) builds no C++."""
from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    """The CPU as the engine sees it (its cpuid and kernel path), the Python, the commit and the date."""
    from . import native
    c = native.cpu()
    return {
        "cpu": c["model"], "vendor": c["vendor"], "logical_cpus": c["logical_cpus"],
        "flags": [f for f, on in c["flags"].items() if on], "hybrid": c["flags"]["hybrid"],
        "kernel_path": c["active_path"], "python": platform.python_version(),
        "commit": commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
