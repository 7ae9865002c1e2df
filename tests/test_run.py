"""`lab run`: profiles are checked before anything runs; a failing notebook is reported in
the index while the others complete and earlier good reports stay."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab import profiles, runner


def _nb(path, body, default="1"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    p = nbformat.v4.new_code_cell(f"n = {default}")
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, str(path))


def make_collection(tmp_path, monkeypatch, notebooks: dict[str, str], profile: str):
    """Notebooks (name -> the cell after the parameters) and a profile p.yaml, put where the
    runner looks."""
    nbs, params = tmp_path / "notebooks", tmp_path / "params"
    nbs.mkdir()
    params.mkdir()
    for name, body in notebooks.items():
        _nb(nbs / f"{name}.ipynb", body)
    (params / "p.yaml").write_text(profile)
    monkeypatch.setattr(profiles, "NOTEBOOKS", nbs)
    monkeypatch.setattr(profiles, "PARAMS", params)
    return tmp_path


@pytest.fixture
def collection(tmp_path, monkeypatch):
    return make_collection(tmp_path, monkeypatch, {
        "good": "from lab import report\nreport.save('good', {'n': n}, {'n squared': n * n})",
        "bad": "raise RuntimeError(f'broken on purpose, n={n}')"},
        "description: test\nshared: {}\nnotebooks:\n  good: {n: 3}\n  bad: {n: 2}\n")


def test_failing_notebook_is_reported_and_the_rest_complete(collection):
    out = collection / "out"
    index = runner.run(None, "p", out_dir=str(out))
    entries = {e["notebook"]: e for e in json.loads((out / "index.json").read_text())["entries"]}
    assert entries["good"]["status"] == "ok" and entries["good"]["headline"] == {"n squared": 9}
    assert entries["bad"]["status"] == "failed" and "broken on purpose, n=2" in entries["bad"]["error"]
    assert (out / "good.html").exists() and (out / "good.json").exists() and (out / "bad.failed.ipynb").exists()
    page = index.read_text()
    assert "good.html" in page and "broken on purpose" in page
    # a later failure of a notebook that once worked keeps its good report
    _nb(profiles.NOTEBOOKS / "good.ipynb", "raise ValueError('now broken')")
    runner.run(["good"], "p", out_dir=str(out))
    assert (out / "good.html").exists()
    assert "last good report" in (out / "index.html").read_text()


def test_bad_profiles_are_rejected_before_running(collection):
    p = collection / "params"
    (p / "typo.yaml").write_text("notebooks:\n  good: {nn: 3}\n")
    with pytest.raises(profiles.ProfileError, match=r"typo.yaml.*notebooks.good.nn is not a parameter of good"):
        profiles.load("typo")
    (p / "type.yaml").write_text("notebooks:\n  good: {n: three}\n")
    with pytest.raises(profiles.ProfileError, match=r"type.yaml.*n must be int"):
        profiles.load("type")
    (p / "nb.yaml").write_text("notebooks:\n  nosuch: {}\n")
    with pytest.raises(profiles.ProfileError, match="no notebook named"):
        profiles.load("nb")
    (p / "top.yaml").write_text("notbooks: {}\n")
    with pytest.raises(profiles.ProfileError, match="unknown top-level"):
        profiles.load("top")
    with pytest.raises(profiles.ProfileError, match="no profile"):
        profiles.load("missing")
    with pytest.raises(profiles.ProfileError, match=r"--set.*n must be int"):
        profiles.load("p", overrides=profiles.parse_set(["n=abc"]))


def test_saving_reports_imports_no_native_code():
    """lab.report and lab.runner import nothing that builds or loads the C++: lab.machine asks
    the native library about the CPU only when a machine is described."""
    code = ("import sys, lab.report, lab.runner; "
            "print(sorted(m for m in ('lab.native', 'lab.kernels', 'cppyy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def test_shipped_profiles_are_valid():
    for name in ("quick", "default", "qwen3"):
        assert set(profiles.load(name)) == set(profiles.notebooks())


def test_a_relative_out_folder_gets_the_results(collection, monkeypatch):
    """The notebooks run in their own folder: a relative --out must still collect their JSON."""
    monkeypatch.chdir(collection)
    runner.run(["good"], "p", out_dir="rel/out")
    assert (collection / "rel" / "out" / "good.json").exists()
    assert json.loads((collection / "rel" / "out" / "index.json").read_text())["entries"][0]["headline"] == {"n squared": 9}


def test_a_run_cut_short_keeps_its_finished_reports_in_the_index(collection, monkeypatch):
    """The index is written after each notebook, so a kill during the next one loses nothing
    that finished."""
    out = collection / "out"
    real = runner.run_one

    def killed_at_bad(nb, *args):
        if nb == "bad":
            raise KeyboardInterrupt                       # where a kill -9 would stop the run
        return real(nb, *args)
    monkeypatch.setattr(runner, "run_one", killed_at_bad)
    with pytest.raises(KeyboardInterrupt):
        runner.run(["good", "bad"], "p", out_dir=str(out))
    entries = {e["notebook"]: e for e in json.loads((out / "index.json").read_text())["entries"]}
    assert entries["good"]["status"] == "ok" and "bad" not in entries
    assert "good.html" in (out / "index.html").read_text()


def test_reports_hold_the_argument_not_progress_bars_or_warnings(collection):
    body = ("import sys, warnings\nfrom tqdm.auto import tqdm\nfrom lab import report\n"
            "for _ in tqdm(range(3), desc='teacher distributions'):\n    pass\n"
            "warnings.warn('IProgress not found')\nprint('the finding, n =', n)\n"
            "report.save('noisy', {'n': n}, {'n': n})")
    _nb(profiles.NOTEBOOKS / "noisy.ipynb", body)
    (profiles.PARAMS / "p.yaml").write_text("description: test\nshared: {}\nnotebooks:\n  noisy: {n: 4}\n")
    out = collection / "out"
    runner.run(["noisy"], "p", out_dir=str(out))
    page = (out / "noisy.html").read_text()
    assert "the finding, n = 4" in page
    for noise in ("teacher distributions", "it/s", "IProgress", "Warning"):
        assert noise not in page, noise
    executed = (out / "noisy.ipynb").read_text()                 # the executed notebook keeps them
    assert "IProgress" in executed
