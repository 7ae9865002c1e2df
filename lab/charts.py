"""The house style for altair charts, rendered so a saved report works offline: the
Vega/Vega-Lite/Vega-Embed bundle is written inline once per notebook (setup()), and each
chart is a div plus a call to it — no request leaves the page."""
from __future__ import annotations

import html
import json
import uuid

import altair as alt

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


def setup():
    """Call once at the top of a notebook: the house theme, and the chart library inline."""
    import vl_convert as vlc
    if hasattr(alt, "theme"):                 # altair >= 5.5
        alt.theme.register("lab", enable=True)(lambda: alt.theme.ThemeConfig(_theme()))
    else:
        alt.themes.register("lab", _theme)
        alt.themes.enable("lab")
    bundle = vlc.javascript_bundle("window.vegaEmbed = vegaEmbed;")
    return _Html(f"<script>(function(){{{bundle}}})();</script>"
                 "<span style='color:#888;font-size:11px'>charts: Vega-Lite, embedded for offline reading</span>")


def show(chart: alt.TopLevelMixin):
    """The chart as HTML that draws with the inline bundle (tooltips and all)."""
    spec = json.dumps(chart.to_dict())
    div = f"lab-chart-{uuid.uuid4().hex[:10]}"
    return _Html(f"<div id='{div}' class='lab-chart'></div><script>(function draw(){{"
                 f"if (!window.vegaEmbed) {{ setTimeout(draw, 30); return; }}"
                 f"vegaEmbed('#{div}', {spec}, {{actions: false, renderer: 'svg'}});}})();</script>")


def table(rows: list[dict], columns: list[str] | None = None, digits: int = 3):
    """A plain sortable HTML table (click a header to sort)."""
    columns = columns or list(rows[0]) if rows else []
    tid = f"lab-table-{uuid.uuid4().hex[:10]}"

    def fmt(v):
        return f"{v:.{digits}g}" if isinstance(v, float) else html.escape(str(v))
    head = "".join(f"<th style='cursor:pointer' onclick=\"labSort('{tid}',{i})\">{html.escape(c)}</th>"
                   for i, c in enumerate(columns))
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    script = ("<script>window.labSort=window.labSort||function(id,c){const t=document.getElementById(id);"
              "const rows=[...t.tBodies[0].rows];const d=t.dataset.dir==='a'?'d':'a';t.dataset.dir=d;"
              "rows.sort((x,y)=>{const a=x.cells[c].textContent,b=y.cells[c].textContent;const na=parseFloat(a),nb=parseFloat(b);"
              "const r=isNaN(na)||isNaN(nb)?a.localeCompare(b):na-nb;return d==='a'?r:-r;});rows.forEach(r=>t.tBodies[0].appendChild(r));};</script>")
    return _Html(f"{script}<table id='{tid}' class='lab-table'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
