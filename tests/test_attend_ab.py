"""tools/attend_ab.py, the A/B the tuning diary's attention figures come from: it builds, an
identical variant and one without a part both time, and a part that cannot be dropped is refused."""
import subprocess
import sys
from pathlib import Path

import pytest

from lab import native

ROOT = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(ROOT / "tools" / "attend_ab.py")]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("avx512vnni" not in native.supported_paths(),
                                 reason="the A/B times the AVX-512 path's attention, which this CPU lacks")]


BF16 = int(native.lib().attention_mode(native.consts().paths.index("avx512vnni"), native.consts().attention["bf16"],
                                       128)) >= 0 if "avx512vnni" in native.supported_paths() else False


@pytest.mark.parametrize("args", [[], ["--drop", "softmax"],
                                  pytest.param(["--bf16"], marks=pytest.mark.skipif(not BF16, reason="no AVX512_BF16"))])
def test_the_ab_builds_and_times_both(args):
    out = subprocess.run([*TOOL, *args, "--calls", "5", "--context", "100"], capture_output=True, text=True,
                         check=True).stdout
    peak, *lines = out.strip().splitlines()
    assert peak.startswith("float FMA peak") and float(peak.split(": ")[1].split()[0]) > 0
    assert [x.split()[0] for x in lines] == ["k=1", "k=5", "k=8"]
    assert all(float(x.split("B/A median ")[1].split()[0]) > 0 for x in lines)


def test_a_part_the_kernel_no_longer_calls_once_is_refused(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import attend_ab
    v = tmp_path / "v.inc"
    v.write_text((native.SOURCE_DIR / "attend.inc").read_text().replace("softmax_rows(a, scores", "norm(a, scores"))
    with pytest.raises(SystemExit, match="--drop softmax: attend.inc no longer makes that part"):
        attend_ab.variant_source(v, "softmax")
    r = subprocess.run([*TOOL, "--drop", "nothing"], capture_output=True, text=True)
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_memory_mode_cycles_past_the_last_level_cache():
    sys.path.insert(0, str(ROOT / "tools"))
    import attend_ab
    llc = attend_ab.last_level_cache_bytes()
    out = subprocess.run([*TOOL, "--memory", "--calls", "2", "--context", "100"], capture_output=True, text=True,
                         check=True).stdout
    sets = [float(x.split("heads, ")[1].split()[0]) * 1e6 for x in out.splitlines()[1:]]
    assert len(sets) == 3 and all(b >= 4 * llc - 1000 for b in sets)   # printed to the kilobyte
