"""The house style for altair charts and tables, rendered so a saved report works offline:
the Vega/Vega-Lite/Vega-Embed bundle and itables' DataTables bundle are written inline once
per notebook (setup()), and each chart or table is an element plus a call to them — no
request leaves the page."""
from __future__ import annotations

import json
import math
import uuid

import altair as alt
from itables import JavascriptFunction

PALETTE = ["#3b6ea8", "#d1603d", "#5b9e6b", "#8a62a8", "#c9a13b", "#4b8f9e"]


def _theme():
    return {"config": {
        "view": {"continuousWidth": 520, "continuousHeight": 280, "stroke": None},
        "font": "Helvetica, Arial, sans-serif",
        "range": {"category": PALETTE},
        "axis": {"labelFontSize": 11, "titleFontSize": 12, "gridColor": "#e6e6e6", "domainColor": "#888"},
        "legend": {"labelFontSize": 11, "titleFontSize": 12},
        "title": {"fontSize": 14, "anchor": "start"},
        "point": {"filled": True, "size": 60},
        "line": {"strokeWidth": 2},
    }}


class _Html:
    def __init__(self, body: str):
        self.body = body

    def _repr_html_(self) -> str:
        return self.body


def setup() -> None:
    """Call once at the top of a notebook: the house theme, and the chart and table libraries
    inline, displayed here rather than returned so they reach the report wherever the call
    sits in its cell."""
    import itables
    import vl_convert as vlc
    from IPython.display import display
    if hasattr(alt, "theme"):                 # altair >= 5.5
        alt.theme.register("lab", enable=True)(lambda: alt.theme.ThemeConfig(_theme()))
    else:
        alt.themes.register("lab", _theme)
        alt.themes.enable("lab")
    bundle = vlc.javascript_bundle("window.vegaEmbed = vegaEmbed;")
    display(_Html(f"<script>(function(){{{bundle}}})();</script>"
                  "<span style='color:#888;font-size:11px'>charts: Vega-Lite, embedded for offline reading</span>"))
    itables.init_notebook_mode(all_interactive=False, connected=False)


def show(chart: alt.TopLevelMixin):
    """The chart as HTML that draws with the inline bundle (tooltips and all)."""
    spec = json.dumps(chart.to_dict())
    div = f"lab-chart-{uuid.uuid4().hex[:10]}"
    return _Html(f"<div id='{div}' class='lab-chart'></div><script>(function draw(){{"
                 f"if (!window.vegaEmbed) {{ setTimeout(draw, 30); return; }}"
                 f"vegaEmbed('#{div}', {spec}, {{actions: false, renderer: 'svg'}});}})();</script>")


def _value(v, digits: int):
    """A cell: floats cut to digits significant digits but kept numbers, so they sort as numbers."""
    if isinstance(v, float) and math.isfinite(v):
        return float(f"{v:.{digits}g}")
    return str(v) if isinstance(v, (bool, list, dict, tuple)) or v is None else v


def _column(rows: list[dict], c: str, digits: int) -> list:
    """A column's cells; a missing one is NaN in a numeric column (blanked on display) so it stays numeric."""
    present = [r[c] for r in rows if c in r]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present)
    return [_value(r[c], digits) if c in r else math.nan if numeric else "" for r in rows]


# NaN, a numeric column's missing cell, shows blank
_BLANK_NAN = {"targets": "_all", "render": JavascriptFunction(
    "function (d, type) { return type === 'display' && Number.isNaN(d) ? '' : d; }")}


def table(rows: list[dict], columns: list[str] | None = None, digits: int = 3):
    """A sortable, searchable table (DataTables through itables), its library inlined by setup()."""
    import pandas as pd
    from itables import to_html_datatable
    columns = columns or (list(rows[0]) if rows else [])
    df = pd.DataFrame({c: _column(rows, c, digits) for c in columns}, columns=columns)
    # every row on one page, none dropped: a report is read whole
    return _Html(to_html_datatable(df, connected=False, paging=False, maxBytes=0, showIndex=False,
                                   format_floats_in_python=False, display_logo_when_loading=False,
                                   columnDefs=[_BLANK_NAN]))
