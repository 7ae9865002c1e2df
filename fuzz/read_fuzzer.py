"""atheris harness over Python's weights-file reader, lab.models.export.read.

Each input is the bytes of a weights file (the seed corpus: fuzz/seeds.py). They go into
a memfd and its /proc/self/fd path goes to lab.models.export.read. The reader must
either return a ModelFile or raise lab.models.export.ModelFileError (a LabError); any
other exception -- TypeError, ValueError, KeyError, IndexError, RecursionError, ... --
is a bug in lab/ and atheris stops with its traceback and writes the input as a crash
file. lab/ is instrumented for coverage (torch, numpy and the C++ library behind
open_native are not: the C++ side has its own harness, fuzz/model_file_fuzzer.cpp).

usage (libFuzzer's flags, as `make fuzz` passes them):
    .venv/bin/python fuzz/read_fuzzer.py -max_total_time=30 build/fuzz/corpus-py build/fuzz/seeds
    .venv/bin/python fuzz/read_fuzzer.py CRASH_FILE          # replays one input

FUZZ_PY_IGNORE: while a bug already reported is not fixed, fuzzing can go on past it:
a comma-separated list of signatures "ExceptionType@file.py:function" (the innermost
frame under lab/, as the harness prints for each failure) that count as refusals. Empty
(the default, and what CI runs) accepts ModelFileError only.
"""
from __future__ import annotations

import os
import shlex
import sys
import traceback
from pathlib import Path

import atheris

# Heavy, uninstrumented dependencies first: only lab/ gets coverage hooks.
import numpy  # noqa: F401
import torch  # noqa: F401

with atheris.instrument_imports(include=["lab"]):
    from lab.models import export as ex
    from lab import native

LAB = str(Path(ex.__file__).resolve().parent.parent)
IGNORE = {s.strip() for s in os.environ.get("FUZZ_PY_IGNORE", "").split(",") if s.strip()}
ignored: dict[str, int] = {}


def signature(e: BaseException) -> str:
    """ExceptionType@file.py:function of the innermost frame under lab/ ('?' if none)."""
    where = "?"
    for fr in traceback.extract_tb(e.__traceback__):
        if fr.filename.startswith(LAB):
            where = f"{os.path.basename(fr.filename)}:{fr.name}"
    return f"{type(e).__name__}@{where}"


_fd = os.memfd_create("lab-fuzz-read", 0)
PATH = f"/proc/self/fd/{_fd}"


def TestOneInput(data: bytes) -> None:
    os.ftruncate(_fd, 0)
    os.pwrite(_fd, data, 0)
    try:
        ex.read(PATH)
    except ex.ModelFileError:
        pass
    except Exception as e:
        sig = signature(e)
        if sig in IGNORE:
            if sig not in ignored:
                print(f"FUZZ_PY_IGNORE: {sig} ({type(e).__name__}: {e})", file=sys.stderr)
            ignored[sig] = ignored.get(sig, 0) + 1
            return
        print(f"\n== read() raised {sig} -- not a ModelFileError ==", file=sys.stderr)
        raise


def main() -> None:
    native.lib()                    # build/load the C++ library before the clock starts
    # libFuzzer re-runs argv[0] through the shell for -minimize_crash, -fork and -merge:
    # make that this interpreter on this script, whatever the script's mode bits.
    argv0 = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"
    atheris.Setup([argv0, *sys.argv[1:]], TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
