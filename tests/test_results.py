"""`lab results`: a profile's outputs rendered as Markdown, one section per machine, and the
README block between the markers regenerated from them."""
import argparse
import json

import nbformat
import pytest

from lab import results
from lab.errors import LabError

MACHINE = {"cpu": "Test CPU 9000", "vendor": "GenuineTest", "logical_cpus": 4, "kernel_path": "avx2",
           "commit": "abc1234", "date": "2026-12-01T10:20:30"}


def _executed(path, params: dict):
    """An executed notebook as papermill leaves it: a parameters cell and the injected values."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell('target = "tiny-qwen2"\ndraft = "tiny-qwen2-draft"\nscheme = "q4-q8out"')
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    nb.metadata["papermill"] = {"parameters": params}
    nbformat.write(nb, str(path))


@pytest.fixture
def outputs(tmp_path):
    """outputs/default as `lab run` leaves it: two notebooks from one machine, and the index."""
    out = tmp_path / "outputs" / "default"
    out.mkdir(parents=True)
    notebooks = {
        "vk": {"v(2)": 1.2, "c | o": "0.93 | 0.05"},
        "quant_ppl": {"qwen2.5-coder-1.5b f32": 6.59, "qwen2.5-coder-1.5b q4-q8out": 7.04},
    }
    for nb, headline in notebooks.items():
        results_ = {"models": ["qwen2.5-coder-1.5b"]} if nb == "quant_ppl" else {}
        (out / f"{nb}.json").write_text(json.dumps({"notebook": nb, "machine": MACHINE, "headline": headline,
                                                    "results": results_}))
    _executed(out / "vk.ipynb", {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b"})
    entries = [{"notebook": nb, "status": "ok", "html": f"{nb}.html"} for nb in notebooks]
    (out / "index.json").write_text(json.dumps({"profile": "default", "machine": MACHINE, "entries": entries}))
    return out


def _args(out, readme=None):
    return argparse.Namespace(profile="default", out=str(out), readme=readme and str(readme))


def test_one_section_per_machine_with_commit_command_and_weights(outputs):
    text = results.render(results.records(outputs, "default"), "default")
    assert text.count("### Test CPU 9000, 4 logical CPUs, kernel path avx2") == 1
    assert text.index("#### quant_ppl") < text.index("#### vk")
    assert "`lab run vk --profile default`" in text and "`lab run quant_ppl --profile default`" in text
    assert text.count("Commit abc1234, 2026-12-01") == 2
    assert "target qwen2.5-coder-1.5b, draft qwen2.5-coder-0.5b, scheme q4-q8out" in text   # injected over defaults
    assert "| c \\| o | 0.93 \\| 0.05 |" in text
    assert "- qwen2.5-coder-1.5b: Qwen2.5-Coder-1.5B-Instruct (target), GGUF Q4_K_M from the package index" in text
    assert "f32 are the GGUF weights above dequantized" in text


def test_rendering_is_deterministic(outputs):
    recs = results.records(outputs, "default")
    assert results.render(recs, "default") == results.render(list(reversed(recs)), "default")


def test_the_readme_block_is_replaced_idempotently(outputs, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{results.BEGIN}\nhand-written, stale\n{results.END}\nafter\n")
    results.cmd_results(_args(outputs, readme))
    once = readme.read_text()
    assert "stale" not in once and "#### vk" in once
    assert once.startswith("# title\n\nbefore\n") and once.endswith(f"{results.END}\nafter\n")
    results.cmd_results(_args(outputs, readme))
    assert readme.read_text() == once


def test_missing_markers_and_outputs_are_one_line_errors(outputs, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    with pytest.raises(LabError, match="results:begin") as e:
        results.cmd_results(_args(outputs, readme))
    assert "\n" not in str(e.value) and readme.read_text() == "# no markers here\n"
    with pytest.raises(LabError, match="lab run --profile default") as e:
        results.cmd_results(_args(tmp_path / "nowhere"))
    assert "\n" not in str(e.value)
