"""A report opened in a real headless browser with the network blocked: it renders, its
charts draw, and it asks for nothing outside the page (skipped, with the reason, where no
Chromium is installed; .ci/run installs Debian's)."""
import re
import shutil
import subprocess

import pytest

from lab import runner

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)")


def dump_dom(page, tmp_path):
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
                        "--virtual-time-budget=8000", "--dump-dom", f"file://{page}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_report_renders_offline_with_charts(tmp_path):
    out = tmp_path / "out"
    index = runner.run(["bandwidth"], "quick", out_dir=str(out))
    page = (out / "bandwidth.html").read_text()
    external = re.findall(r"""<(?:script|link|img)[^>]+(?:src|href)=["']https?://""", page)
    assert not external, f"the report loads {len(external)} resources from the network"
    dom = dump_dom(out / "bandwidth.html", tmp_path)
    placed = re.findall(r'id="lab-chart-[0-9a-f]+"', dom)
    drawn = re.findall(r'id="lab-chart-[0-9a-f]+"[^>]*>\s*<svg', dom)
    assert len(placed) >= 2 and len(drawn) == len(placed), f"{len(drawn)} of {len(placed)} charts drew"
    assert "What the ceiling allows" in dom
    idx = dump_dom(index, tmp_path)
    assert "bandwidth.html" in idx and "read ceiling" in idx
