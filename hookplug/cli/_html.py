"""The ``hookplug profile --html`` page: one self-contained file (inline CSS, inline SVG,
a few lines of inline script to sort the table; no URL), drawn from the run document."""
from __future__ import annotations

import html
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hookplug._stats import is_log2_edges

from ._report import (_grad_path, _int, _num, _ms_per_step, _summary_lines, fmt_float, fmt_si, has_grads,
                      has_primary, profile_table, table_values)

__all__ = ["render_html"]

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _fmt_edge(v: Any) -> str:
    f = _num(v)
    if f is None:
        try:
            return "∞" if float(v) > 0 else "−∞"
        except (TypeError, ValueError):
            return "?"
    if f == 0:
        return "0"
    m, e = math.frexp(abs(f))
    sign = "−" if f < 0 else ""
    if m == 0.5:
        return f"{sign}2{str(e - 1).translate(_SUPERSCRIPT)}"
    return f"{sign}{abs(f):.2g}"


def _edge_formatter(edges: Sequence[Any], log2: bool):
    """How a histogram's edges are labelled: log2's outermost edges as infinity and its
    innermost as 0 (those buckets hold every larger magnitude, +-Inf, and every smaller one,
    down to the subnormals); a linear histogram's with the digits that tell its edges apart."""
    if log2:
        outer, inner = abs(float(edges[-1])), abs(float(edges[len(edges) // 2]))

        def fmt(v: Any) -> str:
            f = _num(v)
            if f is not None and abs(f) == outer:
                return "∞" if f > 0 else "−∞"
            return "0" if f is not None and abs(f) == inner else _fmt_edge(v)
        return fmt
    finite = sorted({f for f in map(_num, edges) if f is not None})
    digits = next((d for d in range(2, 18) if len({f"{f:.{d}g}" for f in finite}) == len(finite)), 17)

    def fmt(v: Any) -> str:
        f = _num(v)
        if f is None:
            return _fmt_edge(v)
        return "0" if f == 0 else ("−" if f < 0 else "") + f"{abs(f):.{digits}g}"
    return fmt


def _hist_bars(counts: Sequence[int], edges: Sequence[Any]) -> List[Tuple[Optional[float], Optional[float], int]]:
    """``[(lo, hi, count), ...]`` trimmed to the non-empty range."""
    counts = [_int(c) for c in counts]
    if len(edges) == len(counts) + 1:
        spans = [(edges[i], edges[i + 1]) for i in range(len(counts))]
    elif len(edges) == len(counts):  # upper limits only
        spans = [(edges[i - 1] if i else None, edges[i]) for i in range(len(counts))]
    else:
        spans = [(None, None)] * len(counts)
    nz = [i for i, c in enumerate(counts) if c]
    if not nz:
        return []
    lo, hi = nz[0], nz[-1]
    return [(spans[i][0], spans[i][1], counts[i]) for i in range(lo, hi + 1)]


def _is_pow2(v: Any) -> bool:
    f = _num(v)
    return f is not None and f != 0 and math.frexp(abs(f))[0] == 0.5


def _log2_exp(v: Any) -> Optional[int]:
    return math.frexp(abs(float(v)))[1] - 1 if _is_pow2(v) else None


def _hist_items(bars, log2: bool, min_gap: int = 4) -> List[Tuple[str, Any, Any, int, float]]:
    """Bars as ``(kind, lo, hi, count, slot width)``; on a log2 axis a run of ``min_gap`` or
    more empty buckets inside the range becomes one narrow ``"gap"`` (a break in the axis)."""
    items: List[Tuple[str, Any, Any, int, float]] = []
    i = 0
    while i < len(bars):
        lo, hi, c = bars[i]
        if log2 and c == 0:
            j = i
            while j < len(bars) and bars[j][2] == 0:
                j += 1
            if j - i >= min_gap:
                items.append(("gap", lo, bars[j - 1][1], 0, 1.6))
                i = j
                continue
        items.append(("bar", lo, hi, c, 1.0))
        i += 1
    return items


def _no_bars_why(stats: Optional[Dict[str, Any]], edges: Sequence[Any]) -> str:
    """What an empty histogram says: a linear one leaves out the finite values outside its
    range, which may be all of them (log2 buckets hold every finite value)."""
    if not stats:
        return "no values recorded"
    if not (stats.get("hist_counts") or []):
        return "no histogram (bins=0)"
    finite = _int(stats.get("numel")) - _int(stats.get("nan_count")) - _int(stats.get("inf_count"))
    if finite > 0 and len(edges) > 1 and not is_log2_edges(edges):
        return f"{finite:,} finite values, all outside [{float(edges[0]):g}, {float(edges[-1]):g}]"
    return "no finite values"


def _hist_svg(name: str, stats: Optional[Dict[str, Any]], width: int = 300, height: int = 120,
              cls: str = "hist") -> str:
    """One module's histogram as inline SVG: one bar per bucket in order (for log2 buckets:
    sign and binary exponent, long empty runs drawn as a break in the axis), bar heights on a
    log scale, the exact count of each bucket in its tooltip."""
    esc = html.escape
    pad_l, pad_r, pad_t, pad_b = 8, 8, 6, 20
    pw, ph = width - pad_l - pad_r, height - pad_t - pad_b
    base = pad_t + ph
    qname = esc(name, quote=True)
    parts = [f'<svg class="{cls}" data-module="{qname}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="histogram of {qname}">']
    edges = (stats or {}).get("hist_edges") or []
    bars = _hist_bars((stats or {}).get("hist_counts") or [], edges)
    parts.append(f'<line x1="{pad_l}" y1="{base}" x2="{pad_l + pw}" y2="{base}" class="axis"/>')
    if not bars:
        why = esc(_no_bars_why(stats, edges))
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">{why}</text></svg>')
        return "".join(parts)
    log2 = is_log2_edges(edges)
    fmt_edge = _edge_formatter(edges, log2)
    items = _hist_items(bars, log2)
    unit = pw / sum(w for *_, w in items)
    top = math.log1p(max(c for _, _, _, c, _ in items))
    ticks: List[Tuple[int, float, str]] = []  # (priority, x, label)
    x = float(pad_l)
    for k, (kind, lo, hi, c, w) in enumerate(items):
        bw = w * unit
        flo, fhi = _num(lo), _num(hi)
        spans_zero = flo is not None and fhi is not None and flo < 0 < fhi
        if kind == "gap":
            mid = x + bw / 2
            parts.append(f'<path class="axis" d="M{mid - 3:.2f},{base + 4} l2.5,-8 '
                         f'M{mid:.2f},{base + 4} l2.5,-8"/>'
                         f'<rect class="gap" x="{x:.2f}" y="{pad_t}" width="{bw:.2f}" height="{ph}">'
                         f"<title>{esc(f'no values from {fmt_edge(lo)} to {fmt_edge(hi)}')}</title></rect>")
            if spans_zero:
                ticks.append((1, mid, "0"))
            else:
                ticks.append((2, x, fmt_edge(lo)))
                ticks.append((2, x + bw, fmt_edge(hi)))
        else:
            h = 0.0 if c == 0 else max(1.0, ph * math.log1p(c) / top)
            if spans_zero or (flo == 0 and fhi == 0):
                cls = "zero"
            elif flo is not None and fhi is not None:
                cls = "neg" if (flo + fhi) / 2 < 0 else "pos"
            else:
                cls = "pos"
            if lo is None and hi is None:
                tip = f"{c:,}"
            elif cls == "zero" and log2:
                tip = f"zero: {c:,}"
            else:
                tip = f"{fmt_edge(lo)} to {fmt_edge(hi)}: {c:,}"
            parts.append(f'<rect class="{cls}" x="{x:.2f}" y="{base - h:.2f}" width="{max(bw - 0.6, 0.6):.2f}" '
                         f'height="{h:.2f}"><title>{esc(tip)}</title></rect>')
            if spans_zero:
                ticks.append((1, x + bw / 2, "0"))
        if k == 0 and lo is not None and not (kind == "gap" and spans_zero):
            ticks.append((0, x, fmt_edge(lo)))
        if k == len(items) - 1 and hi is not None and not (kind == "gap" and spans_zero):
            ticks.append((0, x + bw, fmt_edge(hi)))
        if kind == "bar" and k > 0 and lo is not None:
            e = _log2_exp(lo) if log2 else None
            if (log2 and e is not None and e % 4 == 0) or (not log2 and k % max(1, len(items) // 4) == 0):
                ticks.append((3, x, fmt_edge(lo)))
        x += bw
    placed: List[Tuple[float, str]] = []
    for _, tx, label in sorted(ticks, key=lambda t: t[0]):
        if all(abs(tx - px) >= 34 and label != pl for px, pl in placed):  # one tick per label (log2: 3 edges read 0)
            placed.append((tx, label))
    for tx, label in sorted(placed):
        anchor = "start" if tx <= pad_l + 10 else ("end" if tx >= pad_l + pw - 10 else "middle")
        parts.append(f'<line x1="{tx:.2f}" y1="{base}" x2="{tx:.2f}" y2="{base + 3}" class="axis"/>'
                     f'<text x="{tx:.2f}" y="{height - 5}" text-anchor="{anchor}">{esc(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _flops_svg(doc: Dict[str, Any], width: int = 1100) -> str:
    esc = html.escape
    items = [(n, _int((m.get("flops") or {}).get("flops")), _int((m.get("flops") or {}).get("backward_flops")))
             for n, m in doc["modules"].items()]
    label_w, value_w, row_h, pad_t = 230, 170, 20, 6
    height = pad_t * 2 + row_h * max(len(items), 1) + 4
    plot_w = width - label_w - value_w
    top = max([f + b for _, f, b in items] + [1])
    parts = [f'<svg class="flops-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="FLOPs per module">']
    for i, (name, f, b) in enumerate(items):
        y = pad_t + i * row_h
        label = name or "(root)"
        short = label if len(label) <= 34 else "…" + label[-33:]
        parts.append(f'<text class="label" x="{label_w - 8}" y="{y + row_h * 0.68:.1f}" text-anchor="end">'
                     f'<title>{esc(label)}</title>{esc(short)}</text>')
        fw = plot_w * f / top
        bw = plot_w * b / top
        parts.append(f'<rect class="fwd" x="{label_w}" y="{y + 3}" width="{fw:.2f}" height="{row_h - 6}">'
                     f'<title>{esc(label)}: {f:,} FLOPs forward</title></rect>')
        if b:
            parts.append(f'<rect class="bwd" x="{label_w + fw:.2f}" y="{y + 3}" width="{bw:.2f}" '
                         f'height="{row_h - 6}">'
                         f'<title>{esc(label)}: {b:,} FLOPs backward</title></rect>')
        value = f"{fmt_si(f)} fwd + {fmt_si(b)} bwd" if b else fmt_si(f, " FLOPs")
        parts.append(f'<text class="value" x="{label_w + fw + bw + 6:.2f}" y="{y + row_h * 0.68:.1f}">'
                     f'{esc(value)}</text>')
    parts.append("</svg>")
    return "".join(parts)


_CSS = """
:root{--fg:#1f2328;--muted:#59636e;--border:#d1d9e0;--panel:#f6f8fa;--pos:#3b6fb6;--neg:#d0652b;
--zero:#8c959f;--fwd:#7c5cc4;--bwd:#c4b5ec;--bad:#cf222e}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;color:var(--fg);
background:#fff;margin:0 auto;max-width:1200px;padding:24px 20px 40px}
h1{font-size:22px;margin:0 0 6px}
h2{font-size:16px;margin:30px 0 10px;padding-bottom:5px;border-bottom:1px solid var(--border)}
h2 small{font-weight:400;color:var(--muted);font-size:12.5px;margin-left:6px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:12.5px}
.chips span{display:inline-block;background:var(--panel);border:1px solid var(--border);border-radius:12px;
padding:1px 10px;margin:3px 6px 3px 0;font-size:12.5px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(128px,1fr));gap:10px;margin-top:16px}
.card{border:1px solid var(--border);border-radius:8px;padding:10px 12px;background:var(--panel)}
.card b{display:block;font-size:20px;font-variant-numeric:tabular-nums}
.card small{color:var(--muted)}
.card.bad b{color:var(--bad)}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:4px 9px;border-bottom:1px solid var(--border);white-space:nowrap;text-align:left}
th{background:var(--panel);cursor:pointer;user-select:none}
th:hover{background:#eaeef2}
.num{text-align:right;font-variant-numeric:tabular-nums}
td.name{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:12.5px}
td.bad{color:var(--bad);font-weight:700}
tfoot td{font-weight:600;border-top:2px solid var(--fg);border-bottom:none}
.hists{display:grid;grid-template-columns:repeat(auto-fill,minmax(318px,1fr));gap:12px}
.hist-card{border:1px solid var(--border);border-radius:8px;padding:8px 8px 4px}
.hist-card h3{font:600 12.5px/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;
margin:0;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.hist-card h3 span{font-weight:400;color:var(--muted)}
.hist-card p{margin:2px 0 4px;color:var(--muted);font-size:11.5px}
svg text{font-size:10px;fill:var(--muted)}
svg .axis{stroke:#afb8c1;stroke-width:1}
svg rect.pos{fill:var(--pos)} svg rect.neg{fill:var(--neg)} svg rect.zero{fill:var(--zero)}
svg rect.fwd{fill:var(--fwd)} svg rect.bwd{fill:var(--bwd)}
svg rect:hover{opacity:.75}
svg rect.gap{fill:transparent}
.flops-chart text.label{font:11.5px ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",
monospace;fill:var(--fg)}
.flops-chart text.value{font-size:11px}
.legend{color:var(--muted);font-size:12px;margin:0 0 8px}
.legend i{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;vertical-align:-1px;border-radius:2px}
.notes{color:var(--muted);font-size:12.5px}
.warn{color:var(--bad)}
footer{margin-top:32px;color:var(--muted);font-size:12px}
"""

_JS = """
document.querySelectorAll("table.sortable").forEach(function(table){
  table.querySelectorAll("thead th").forEach(function(th, i){
    th.title = "sort";
    th.addEventListener("click", function(){
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var dir = th.getAttribute("data-dir") === "asc" ? -1 : 1;
      th.setAttribute("data-dir", dir > 0 ? "asc" : "desc");
      rows.sort(function(a, b){
        var x = a.cells[i].getAttribute("data-v"), y = b.cells[i].getAttribute("data-v");
        if (x === null || y === null) { x = a.cells[i].textContent; y = b.cells[i].textContent;
          return x.localeCompare(y) * dir; }
        return (parseFloat(x) - parseFloat(y)) * dir || 0;
      });
      rows.forEach(function(r){ body.appendChild(r); });
    });
  });
});
"""


def render_html(doc: Dict[str, Any]) -> str:
    """One self-contained page: per-module table, a histogram per module, FLOPs per module.
    Inline CSS, inline SVG and a few lines of inline script (table sorting); no URL."""
    esc = html.escape
    active = doc.get("plugins_active") or []
    has_stats, has_flops = "stats" in doc.get("kinds", []), "flops" in doc.get("kinds", [])
    t, m = doc["totals"], doc["model"]
    title = f"{m['class']} ({m['label']})" if m["label"] != m["class"] else m["class"]
    out: List[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>hookplug profile · {esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>hookplug profile · {esc(title)}</h1>",
        '<div class="chips">',
    ]
    chips = [
        ("model", m["spec"]),
        ("input", doc["input"]["description"] + ("" if doc["input"]["source"] == "random"
                                                   else f" from {doc['input']['source']}")),
        ("device", doc["device"]),
        ("mode", "forward + backward" if doc.get("backward") else "forward"),
        ("steps", str(doc.get("steps", 1))),
        ("seed", str(doc.get("seed"))),
        ("selector", doc["selector"]),
        ("plugins", ", ".join(active) or "none"),
    ]
    for k, v in chips:
        out.append(f"<span><b>{esc(k)}</b> <code>{esc(str(v))}</code></span>")
    out.append("</div>")

    cards = [("modules selected", f"{t['modules']:,}", f"of {m['modules']:,} in the model", False),
             ("parameters", fmt_si(t["params"]), f"selected · {fmt_si(m['params'])} in the model", False)]
    if has_flops:
        cards.append(("FLOPs / step", fmt_si(t.get("flops")), "selected modules", False))
        if doc.get("backward"):
            cards.append(("backward FLOPs", fmt_si(t.get("backward_flops")), "selected modules", False))
    if has_stats and has_primary(doc):
        cards.append(("NaN values", f"{_int(t.get('nan_count')):,}", "in selected outputs",
                      bool(_int(t.get("nan_count")))))
        cards.append(("Inf values", f"{_int(t.get('inf_count')):,}", "in selected outputs",
                      bool(_int(t.get("inf_count")))))
    if has_stats and has_grads(doc):
        bad = _int(t.get("grad_nan_count")) + _int(t.get("grad_inf_count"))
        cards.append(("NaN/Inf gradients", f"{bad:,}", "in output gradients", bool(bad)))
    ms = _ms_per_step(doc)
    if ms is not None:
        cards.append(("time / step", f"{ms:.1f} ms", "median, hooks attached", False))
    out.append('<div class="cards">')
    for label, value, sub, bad in cards:
        out.append(f'<div class="card{" bad" if bad else ""}"><small>{esc(label)}</small>'
                   f"<b>{esc(value)}</b><small>{esc(sub)}</small></div>")
    out.append("</div>")

    # the table
    cols, rows, total, bad = profile_table(doc)
    out.append('<h2>Modules<small>click a column to sort</small></h2><div class="scroll">'
               '<table class="sortable modules"><thead><tr>')
    for title_, align in cols:
        out.append(f'<th class="{"num" if align == "right" else ""}">{esc(title_)}</th>')
    out.append("</tr></thead><tbody>")
    raw_keys = _raw_sort_values(doc, cols)
    for (name, mod), row, is_bad, raw in zip(doc["modules"].items(), rows, bad, raw_keys):
        out.append(f'<tr data-module="{esc(name, quote=True)}">')
        for (title_, align), cell, v in zip(cols, row, raw):
            classes = []
            if align == "right":
                classes.append("num")
            if title_ == "module":
                classes.append("name")
            if title_ in ("NaN", "Inf") and cell not in ("0", "-"):
                classes.append("bad")
            attr = f' data-v="{v}"' if v is not None else ""
            out.append(f'<td class="{" ".join(classes)}"{attr}>{esc(cell)}</td>')
        out.append("</tr>")
    out.append("</tbody><tfoot><tr>")
    for (title_, align), cell in zip(cols, total):
        out.append(f'<td class="{"num" if align == "right" else ""}">{esc(cell)}</td>')
    out.append("</tr></tfoot></table></div>")

    groups = [("Output distributions", "hist", lambda mod: mod.get("primary"))] if has_stats and has_primary(doc) else []
    if has_stats and has_grads(doc):
        groups.append(("Gradient distributions", "hist grad", lambda mod: _grad_path(mod.get("stats") or {})))
    for heading, cls, path_of in groups:
        edges = [((m.get("stats") or {}).get(path_of(m) or "") or {}).get("hist_edges") or []
                 for m in doc["modules"].values()]
        kind = ("log2 histogram: one bucket per sign and binary exponent" if any(map(is_log2_edges, edges))
                else "histogram: equal buckets over its range (values outside it, NaN and ±Inf not counted)")
        out.append(f'<h2>{heading}<small>{kind}; '
                   'bar height on a log scale; hover a bar for its count</small></h2>')
        out.append('<p class="legend"><i style="background:var(--neg)"></i>negative'
                   '<i style="background:var(--zero)"></i>zero<i style="background:var(--pos)"></i>positive</p>')
        out.append('<div class="hists">')
        for name, mod in doc["modules"].items():
            path = path_of(mod)
            stats = (mod.get("stats") or {}).get(path or "")
            info = ""
            if stats:
                info = esc(f"numel {_int(stats.get('numel')):,} · zeros {_int(stats.get('zero_count')):,} · "
                           f"absmax {fmt_float(stats.get('absmax'))}")
                if _int(stats.get("nan_count")) or _int(stats.get("inf_count")):
                    info += (f' · <span class="warn">NaN {_int(stats.get("nan_count")):,} · '
                             f'Inf {_int(stats.get("inf_count")):,}</span>')
            path_txt = f" {path}" if path and path not in ("output", "grad") else ""
            out.append(f'<div class="hist-card"><h3 title="{esc(name or "(root)", quote=True)}">'
                       f'{esc(name or "(root)")}{esc(path_txt)} <span>{esc(mod["class"])}</span></h3>'
                       f"<p>{info or '&nbsp;'}</p>{_hist_svg(name, stats, cls=cls)}</div>")
        out.append("</div>")

    if has_flops:
        out.append("<h2>FLOPs per module<small>per step, each module inclusive of its children; "
                   "counted at the aten level as torch.utils.flop_counter does (FLOPs = 2 × MACs)</small></h2>")
        if doc.get("backward"):
            out.append('<p class="legend"><i style="background:var(--fwd)"></i>forward'
                       '<i style="background:var(--bwd)"></i>backward</p>')
        out.append(f'<div class="scroll">{_flops_svg(doc)}</div>')

    notes = _summary_lines(doc)
    out.append('<h2>Summary</h2><ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    out.append(f'<footer>hookplug {esc(doc.get("hookplug_version", ""))} · '
               f'{esc(doc.get("created", ""))}</footer>')
    out.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(out) + "\n"


def _raw_sort_values(doc: Dict[str, Any], cols) -> List[List[Optional[str]]]:
    """Numbers behind the table's cells (``data-v``), so sorting is numeric."""
    out = []
    for name, m in doc["modules"].items():
        shape = m.get("output_shape")
        vals = {"output": math.prod(shape) if shape else None, "params": m["params"], **table_values(doc, name)}
        out.append([repr(float(vals[t])) if _num(vals.get(t)) is not None else None for t, _ in cols])
    return out
