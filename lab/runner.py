"""`lab run`: execute notebooks with papermill under a profile into outputs/<profile>/ —
each as an executed .ipynb, an HTML report (code hidden, charts embedded) and its results
as JSON — then write index.html linking them with their headline figures. A notebook that
fails does not stop the others, and never replaces an earlier good report."""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

import jinja2

from . import profiles
from .files import write_text_atomic
from .machine import machine

ROOT = Path(__file__).resolve().parent.parent
STYLE = ("body{font-family:Helvetica,Arial,sans-serif;margin:2em;max-width:70em}td,th{padding:.4em .8em;"
         "border-bottom:1px solid #ddd;text-align:left;vertical-align:top}")


_WIDGET = "application/vnd.jupyter.widget-view+json"

# index.html; autoescape: notebook names, figures and errors are text, never markup
INDEX = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True).from_string("""\
<!DOCTYPE html><html><head><meta charset="utf-8"><title>lab — {{ profile }}</title>
<style>{{ style }}</style></head><body>
<h1>Speculative decoding on a CPU — profile <i>{{ profile }}</i></h1>
<p>Machine: {{ m.cpu }}, {{ m.logical_cpus }} logical CPUs, kernel path {{ m.kernel_path }},
commit {{ m.commit }}, {{ m.date }}</p>
<table><tr><th>section</th><th>status</th><th>headline figures</th><th>seconds</th><th>run at</th></tr>
{% for e in entries %}
<tr><td>
{%- if e.status == "ok" %}<a href='{{ e.html }}'>{{ e.notebook }}</a>
{%- else %}{{ e.notebook }}{% if e.previous_report %} (<a href='{{ e.previous_report }}'>last good report</a>){% endif %}{% endif -%}
</td><td>
{%- if e.status == "ok" %}ok{% else %}<span style='color:#b00'>failed: {{ e.error }}</span>{% endif -%}
</td><td>
{%- for k, v in (e.headline or {}).items() %}{{ k }}: <b>{{ v }}</b>{% if not loop.last %}<br>{% endif %}{% endfor -%}
</td><td>{{ e.seconds }}</td><td>{{ e.started }}</td></tr>
{% endfor %}
</table></body></html>""")


def _quiet(nb):
    """The notebook without its stderr streams and widget views: progress bars and warnings
    belong on the batch run's console (the executed .ipynb keeps them), not in the report."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.get("name") == "stderr")
                            and _WIDGET not in o.get("data", {})]
    return nb


def _html(ipynb: Path, out: Path) -> None:
    import nbformat
    from nbconvert import HTMLExporter
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(_quiet(nbformat.read(str(ipynb), as_version=4)))
    # the template asks CDNs for require.js and MathJax; the reports need neither, and a
    # report must open with no network at all
    body = re.sub(r"""<script[^>]+src=["']https?://[^"']*["'][^>]*>\s*</script>""", "", body)
    out.write_text(body)


def run_one(nb: str, params: dict, out: Path, profile: str) -> dict:
    import papermill
    stage = out / ".staging" / nb
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    started = datetime.datetime.now()
    old = os.environ.get("LAB_RESULTS_DIR")
    os.environ["LAB_RESULTS_DIR"] = str(stage)
    entry = {"notebook": nb, "profile": profile, "started": started.isoformat(timespec="seconds")}
    try:
        papermill.execute_notebook(str(profiles.NOTEBOOKS / f"{nb}.ipynb"), str(stage / f"{nb}.ipynb"),
                                   parameters=params, cwd=str(profiles.NOTEBOOKS), progress_bar=True,
                                   kernel_name="python3")
        _html(stage / f"{nb}.ipynb", stage / f"{nb}.html")
        results = stage / f"{nb}.json"
        entry["headline"] = json.loads(results.read_text()).get("headline", {}) if results.exists() else {}
        install(stage, out)
        entry.update(status="ok", html=f"{nb}.html")
    except Exception as e:                               # noqa: BLE001 - reported in the index
        failed = stage / f"{nb}.ipynb"
        if failed.exists():
            os.replace(failed, out / f"{nb}.failed.ipynb")
        msg = str(e).strip().splitlines()
        entry.update(status="failed", error=(msg[-1] if msg else type(e).__name__)[:500])
        traceback.print_exc(file=sys.stderr)
    finally:
        if old is None:
            os.environ.pop("LAB_RESULTS_DIR", None)
        else:
            os.environ["LAB_RESULTS_DIR"] = old
        shutil.rmtree(stage, ignore_errors=True)
    entry["seconds"] = round((datetime.datetime.now() - started).total_seconds(), 1)
    return entry


def install(stage: Path, out: Path) -> None:
    """Moves a finished notebook's files into out, its page last: a kill in between leaves the old page."""
    for f in sorted(stage.iterdir(), key=lambda f: f.suffix == ".html"):
        os.replace(f, out / f.name)


def write_index(out: Path, entries: list[dict], profile: str, machine_info: dict | None = None) -> Path:
    """Merges this run's entries with earlier ones (notebooks not run keep their rows); machine_info
    is the machine they ran on (default: this one)."""
    idx = out / "index.json"
    prev = {e["notebook"]: e for e in json.loads(idx.read_text())["entries"]} if idx.exists() else {}
    for e in entries:
        if e["status"] == "failed" and e["notebook"] in prev and prev[e["notebook"]].get("status") == "ok":
            e["previous_report"] = prev[e["notebook"]].get("html")
        prev[e["notebook"]] = e
    m = machine_info or machine()
    write_text_atomic(idx, json.dumps({"profile": profile, "machine": m, "entries": list(prev.values())}, indent=1))
    page = INDEX.render(profile=profile, style=STYLE, m=m, entries=sorted(prev.values(), key=lambda e: e["notebook"]))
    write_text_atomic(out / "index.html", page)
    return out / "index.html"


def output_dir(pname: str, out_dir: str | None) -> Path:
    """--out or outputs/<profile>, made absolute: the notebooks run with notebooks/ as their working directory."""
    out = Path(out_dir).resolve() if out_dir else ROOT / "outputs" / pname
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(selected: list[str] | None, profile: str = "quick", overrides: dict | None = None,
        out_dir: str | None = None) -> Path:
    names = selected or profiles.notebooks()
    params = profiles.load(profile, names, overrides)       # every profile error before anything runs
    pname = Path(profile).stem
    out = output_dir(pname, out_dir)
    page = out / "index.html"
    for i, nb in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {nb} ({pname})", file=sys.stderr, flush=True)
        entry = run_one(nb, params[nb], out, pname)
        print(f"    {entry['status']} in {entry['seconds']} s", file=sys.stderr, flush=True)
        page = write_index(out, [entry], pname)      # after each: a killed run's finished reports stay linked
    return page
