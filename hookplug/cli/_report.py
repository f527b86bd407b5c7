"""Reports of a ``hookplug profile`` run: the run document (JSON), the terminal table (rich
or plain text) and the ``select``/``plugins`` listings; the HTML page is in ``_html``.

:func:`build_document` turns a run into one JSON-able dict that every renderer reads: each
plugin's own section (``session.report_sections()``: stats merged on the device, FLOPs, the
CLI's output shapes) and the telemetry records a sink collected. Kinds of data no plugin
gave leave their columns out; nothing here knows a plugin by name.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import json
import math
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["build_document", "to_json", "print_profile", "print_plugins", "print_selection",
           "profile_table"]

# what the document keeps of each telemetry record (histograms are in the module totals)
_RECORD_KEYS = ("step", "module", "site", "phase", "rank", "numel", "nan_count", "inf_count",
                "zero_count", "calls", "min", "max", "mean", "std", "absmax", "l2", "rms",
                "zero_fraction", "first_nonfinite")
_KINDS = ("outputs", "stats", "flops")  # section keys the renderers draw; others go to "extra"

# -- host numbers ----------------------------------------------------------------------------

def _num(v: Any) -> Optional[float]:
    """A finite float, or None."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def _jsonable(obj: Any, depth: int = 0) -> Any:
    """Any plugin result as JSON-able data (big tensors become a shape/dtype summary)."""
    if depth > 8:
        return repr(obj)
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            if obj.numel() <= 64:
                return _clean_floats(obj.detach().cpu().tolist())
            return {"tensor": {"shape": list(obj.shape), "dtype": str(obj.dtype).replace("torch.", "")}}
    except ImportError:  # pragma: no cover
        pass
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return _jsonable(obj.to_dict(), depth + 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v, depth + 1) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "item"):
        try:
            return _jsonable(obj.item(), depth + 1)
        except (TypeError, ValueError):
            pass
    return repr(obj)


def _clean_floats(obj: Any) -> Any:
    """NaN and +-Inf (not valid JSON) become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, list):
        return [_clean_floats(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _clean_floats(v) for k, v in obj.items()}
    return obj




# -- the run document ------------------------------------------------------------------------

def _top_level(names: Sequence[str]) -> List[str]:
    """The names with no selected ancestor (so inclusive counts add up without overlap)."""
    chosen = set(names)
    if "" in chosen:
        return [""]
    out = []
    for n in names:
        parts = n.split(".")
        if not any(".".join(parts[:i]) in chosen for i in range(1, len(parts))):
            out.append(n)
    return out


def _primary_path(paths: Dict[str, Any]) -> Optional[str]:
    """The output site the table's stat columns show (under an ``output`` heading, beside
    output totals): None where only inputs or gradients were measured."""
    if "output" in paths:
        return "output"
    return next((p for p in paths if not p.startswith(("input", "grad"))), None)




def _per_step(row: Optional[Dict[str, Any]], steps: int) -> Optional[Dict[str, Any]]:
    """Session counts (all steps ran the same input shape) as counts per step."""
    if row is None:
        return None
    return {k: v if k == "params" else _int(v) // steps for k, v in row.items()}


def _flops_total(sections: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A section's ``flops_total`` (each op counted once over the session), if one gives it:
    the top-level modules' sum misses the children of a container that never runs itself
    (a selected ``ModuleList`` counts 0)."""
    return next((s["flops_total"] for s in sections.values() if isinstance(s.get("flops_total"), dict)), None)


def build_document(session, records: Sequence[Dict[str, Any]], meta: Dict[str, Any],
                   hidden: Sequence[str] = ()) -> Dict[str, Any]:
    """The whole run as one JSON-able dict: ``meta`` (what the CLI knows), the plugins'
    report sections and the telemetry ``records``. ``hidden``: plugin names the CLI added."""
    import hookplug

    sections = {n: s for n, s in session.report_sections().items() if isinstance(s, dict)}
    data: Dict[str, Dict[str, Any]] = {}
    for sec in sections.values():
        for kind in _KINDS:
            if isinstance(sec.get(kind), dict):
                data.setdefault(kind, {}).update(sec[kind])
    steps = max(_int(meta.get("steps")) or 1, 1)
    outputs, stats, flops = data.get("outputs", {}), data.get("stats"), data.get("flops")
    modules: Dict[str, Any] = {}
    for name, mod in session.modules.items():
        shapes = (outputs.get(name) or {}).get("outputs") or {}
        st = None if stats is None else stats.get(name) or {}
        modules[name] = {
            "class": type(mod).__name__,
            "params": sum(p.numel() for p in mod.parameters()),
            "calls": _int((outputs.get(name) or {}).get("calls")),
            "output_shape": next((o["shape"] for o in shapes.values()), None),
            "outputs": shapes,
            "flops": None if flops is None else _per_step(flops.get(name), steps),
            "stats": st,
            "primary": None if st is None else _primary_path(st),
        }
    top = _top_level(list(modules))
    held = {id(p): p.numel() for n in top for p in session.modules[n].parameters()}  # (tied: once)
    totals: Dict[str, Any] = {"modules": len(modules), "params": sum(held.values())}
    if flops is not None:
        whole = _flops_total(sections)
        for k in ("flops", "macs", "backward_flops"):
            totals[k] = (_int(whole.get(k)) // steps if whole is not None
                         else sum(_int((modules[n]["flops"] or {}).get(k)) for n in top))
    if stats is not None:
        sites = [(p, d) for m in modules.values() for p, d in (m["stats"] or {}).items()]
        for k in ("numel", "nan_count", "inf_count", "zero_count"):
            totals[k] = sum(_int(d.get(k)) for p, d in sites if not p.startswith(("grad", "input")))
        for k in ("nan_count", "inf_count"):
            totals["grad_" + k] = sum(_int(d.get(k)) for p, d in sites if p.startswith("grad"))
    hidden = set(hidden)
    extra = {n: {k: v for k, v in s.items() if k not in _KINDS + ("flops_total", "summary")}
             for n, s in sections.items() if n not in hidden}
    for n, plugin in session.plugins.items():  # no section: the plugin's results as they are
        if n not in hidden and n not in sections and hasattr(plugin, "results"):
            try:
                extra[n] = plugin.results()
            except Exception as exc:  # noqa: BLE001 - a report never dies of a plugin
                extra[n] = {"error": f"{type(exc).__name__}: {exc}"}
    doc = {
        "hookplug_version": hookplug.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **meta,
        "plugins_active": [n for n in session.plugins if n not in hidden],
        "kinds": [k for k in _KINDS[1:] if k in data],
        "modules": modules,
        "totals": totals,
        "notes": [str(line) for s in sections.values() for line in s.get("summary") or ()],
        "telemetry": [{k: r.get(k) for k in _RECORD_KEYS} for r in records],
        "disabled": dict(session.disabled),
        "failed_sections": {n: w for n, w in session.section_failures.items() if n not in session.disabled},
        "extra": {n: _jsonable(v) for n, v in extra.items() if v},
    }
    return _clean_floats(doc)


def to_json(doc: Dict[str, Any]) -> str:
    """The document as strict JSON (no NaN/Infinity), indented, lists of numbers on one line."""
    return _dump(_clean_floats(doc), "")


def _dump(obj: Any, indent: str) -> str:
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        inner = indent + "  "
        items = [f"{inner}{json.dumps(str(k))}: {_dump(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in obj):
            return json.dumps(list(obj), allow_nan=False)
        inner = indent + "  "
        return "[\n" + ",\n".join(inner + _dump(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj, allow_nan=False)


# -- formatting ------------------------------------------------------------------------------

def fmt_float(v: Any) -> str:
    f = _num(v)
    if f is None:
        return "-"
    if f == 0:
        return "0"
    a = abs(f)
    text = f"{f:.4g}" if 1e-3 <= a < 1e4 else "e"
    if "e" in text:  # (9999.5 rounds to 1e+04): one scientific form for every large or small value
        text = f"{f:.2e}".replace("e-0", "e-").replace("e+0", "e+")
    return text


def fmt_count(v: Any) -> str:
    return "-" if v is None else f"{_int(v):,}"


def fmt_si(v: Any, unit: str = "") -> str:
    """12_600_000 -> '12.6M'."""
    if v is None:
        return "-"
    x = float(v)
    for prefix in ("", "K", "M", "G", "T", "P", "E"):
        if abs(x) < 999.5:
            if prefix == "":
                return f"{int(round(x))}{unit}"
            return f"{x:.3g}{prefix}{unit}"
        x /= 1000.0
    return f"{float(v):.3g}{unit}"  # past 999.5E: scientific (1.5e+21)


def fmt_shape(shape: Optional[Sequence[int]]) -> str:
    return "-" if shape is None else "x".join(str(s) for s in shape) or "scalar"


def _module_label(name: str, calls: int) -> str:
    label = name if name else "(root)"
    if calls > 1:
        label += f" (x{calls})"
    elif calls == 0:
        label += " (not run)"
    return label


def _grad_path(paths: Dict[str, Any]) -> Optional[str]:
    return "grad" if "grad" in paths else next((p for p in paths if p.startswith("grad")), None)


def has_grads(doc: Dict[str, Any]) -> bool:
    return any(_grad_path(m.get("stats") or {}) for m in doc["modules"].values())


def has_primary(doc: Dict[str, Any]) -> bool:
    """Whether some module has output (or input) statistics for the min..Inf columns."""
    return any(m.get("primary") for m in doc["modules"].values())


_STAT_COLS = (("min", "min", fmt_float), ("max", "max", fmt_float), ("mean", "mean", fmt_float),
              ("std", "std", fmt_float), ("NaN", "nan_count", fmt_count), ("Inf", "inf_count", fmt_count))
_GRAD_COLS = (("grad absmax", "absmax", fmt_float), ("grad std", "std", fmt_float),
              ("grad NaN", "nan_count", fmt_count), ("grad Inf", "inf_count", fmt_count))


def table_values(doc: Dict[str, Any], name: str) -> Dict[str, Any]:
    """``{column title: raw value}`` of one module's row (what the cells show, unformatted)."""
    m = doc["modules"][name]
    st = m.get("stats") or {}
    out = {"FLOPs": (m.get("flops") or {}).get("flops")}
    for cols, path in ((_STAT_COLS, m.get("primary")), (_GRAD_COLS, _grad_path(st))):
        d = st.get(path or "") or {}
        out.update({title: d.get(key) for title, key, _ in cols})
    return out


def profile_table(doc: Dict[str, Any]) -> Tuple[List[Tuple[str, str]], List[List[str]], List[str], List[bool]]:
    """``(columns, rows, total_row, row_is_bad)``: the per-module table as strings, shared by
    the rich and the plain-text renderers. ``columns`` are ``(title, "left"|"right")``."""
    kinds = doc.get("kinds", [])
    numeric = [("FLOPs", "flops", lambda v: fmt_si(v))] if "flops" in kinds else []
    if "stats" in kinds:
        numeric += (list(_STAT_COLS) if has_primary(doc) else []) + (list(_GRAD_COLS) if has_grads(doc) else [])
    cols = [("module", "left"), ("class", "left"), ("output", "left"), ("params", "right")]
    cols += [(title, "right") for title, _, _ in numeric]
    rows, bad = [], []
    for name, m in doc["modules"].items():
        shapes = [o["shape"] for o in m.get("outputs", {}).values()]
        out = fmt_shape(shapes[0]) if shapes else "-"
        if len(shapes) > 1:
            out += f" (+{len(shapes) - 1})"
        values = table_values(doc, name)
        row = [_module_label(name, m.get("calls", 0)), m["class"], out, fmt_count(m["params"])]
        row += [fmt(values[title]) if values[title] is not None else "-" for title, _, fmt in numeric]
        rows.append(row)
        bad.append(any(_int(values[t]) for t in ("NaN", "Inf", "grad NaN", "grad Inf")))
    t = doc["totals"]
    total = [f"total ({t['modules']} module{'s' if t['modules'] != 1 else ''})", "", "", fmt_count(t["params"])]
    sums = {"FLOPs": fmt_si(t.get("flops")), "NaN": fmt_count(t.get("nan_count")),
            "Inf": fmt_count(t.get("inf_count")), "grad NaN": fmt_count(t.get("grad_nan_count")),
            "grad Inf": fmt_count(t.get("grad_inf_count"))}
    total += [sums.get(title, "") for title, _, _ in numeric]
    return cols, rows, total, bad


def _headline(doc: Dict[str, Any]) -> str:
    m = doc["model"]
    label = f"{m['class']} ({m['label']})" if m["label"] != m["class"] else m["class"]
    mode = "forward+backward" if doc.get("backward") else "forward"
    steps = doc.get("steps", 1)
    return (f"hookplug profile: {label} · input {doc['input']['description']} · {doc['device']} · "
            f"{mode} · {steps} step{'s' if steps != 1 else ''}")


def _subline(doc: Dict[str, Any]) -> str:
    n = doc["totals"]["modules"]
    plugins = ", ".join(doc.get("plugins_active") or []) or "none"
    return f"{n} module{'s' if n != 1 else ''} match {doc['selector']!r} · plugins: {plugins}"


def _ms_per_step(doc: Dict[str, Any]) -> Optional[float]:
    """Median step time in ms, leaving out the first step (warm-up); None for a 1-step run."""
    times = [t for t in (doc.get("step_seconds") or [])[1:] if _num(t) is not None]
    if not times:
        return None
    times.sort()
    mid = len(times) // 2
    med = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return med * 1e3


def _summary_lines(doc: Dict[str, Any]) -> List[str]:
    t, m = doc["totals"], doc["model"]
    parts = [f"model: {m['params']:,} parameters"]
    ms = _ms_per_step(doc)
    if ms is not None:
        parts.append(f"{ms:.1f} ms/step (median, hooks attached)")
    lines = [" · ".join(parts)]
    if "flops" in t:
        text = f"selected modules: {fmt_si(t['flops'], ' FLOPs')} forward"
        if doc.get("backward"):
            text += f" + {fmt_si(t.get('backward_flops'), ' FLOPs')} backward"
        lines.append(text + " per step")
    if _int(t.get("grad_nan_count")) or _int(t.get("grad_inf_count")):
        lines.append(f"gradients: {t['grad_nan_count']:,} NaN, {t['grad_inf_count']:,} Inf")
    first = [r for r in doc.get("telemetry") or () if r.get("first_nonfinite")]
    lines += [f"step {r['step']}: first NaN/Inf in {r['module'] or '(root)'} {r['site']} ({r['phase']})"
              for r in first[:3]] + ([f"... and in {len(first) - 3} more steps"] if len(first) > 3 else [])
    lines += doc.get("notes") or []
    if "stats" in doc.get("kinds", []) and doc.get("steps", 1) > 1:
        lines.append(f"statistics over all {doc['steps']} steps"
                     + ("; FLOPs per step" if "flops" in doc.get("kinds", []) else ""))
    for name, why in (doc.get("disabled") or {}).items():
        lines.append(f"plugin {name!r} was disabled during the run: {why}")
    for name, why in (doc.get("failed_sections") or {}).items():
        lines.append(f"plugin {name!r} left out of the report: {why}")
    missing = [p for p in doc.get("plugins", []) if p not in (doc.get("plugins_active") or [])]
    if missing:
        lines.append(f"not loaded: {', '.join(missing)} (see 'hookplug plugins')")
    return lines


# -- terminal output -------------------------------------------------------------------------

def _console(**kwargs):
    """A rich ``Console`` on which a closed pipe (``| head``) raises ``BrokenPipeError``, as
    ``print`` does (rich's own handling exits with status 1, skipping what is left to do)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    return _Console(**kwargs)


def _fit_console(console, renderables: Sequence[Any], whole: Sequence[Any] = ()):
    """When stdout is not a terminal, widen rich's console to the content (no wrapping in
    files and pipes); on a terminal, to the full width of ``whole`` where the terminal is
    narrower (it wraps the lines; rich would cut numbers to "0.…" and drop columns)."""
    from rich.measure import Measurement

    wide = console.options.update(width=4000, max_width=4000)
    if not console.is_terminal:
        widest = max((Measurement.get(console, wide, r).maximum for r in renderables), default=80)
        console.width = max(widest, 80)
    elif whole:
        console.width = max([console.width] + [Measurement.get(console, wide, r).maximum for r in whole])
    return console


def _print_plain_table(cols: Sequence[Tuple[str, str]], rows: Sequence[Sequence[str]],
                       total: Optional[Sequence[str]] = None, file=None) -> None:
    file = file or sys.stdout
    all_rows = [list(r) for r in rows] + ([list(total)] if total else [])
    widths = [max([len(c[0])] + [len(r[i]) for r in all_rows]) for i, c in enumerate(cols)]

    def line(cells):
        out = []
        for (title, align), w, cell in zip(cols, widths, cells):
            out.append(cell.rjust(w) if align == "right" else cell.ljust(w))
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    print(line([c[0] for c in cols]), file=file)
    print(rule, file=file)
    for r in rows:
        print(line(r), file=file)
    if total:
        print(rule, file=file)
        print(line(total), file=file)


def print_profile(doc: Dict[str, Any], use_rich: bool = True, file=None) -> None:
    """The per-module table with its header and totals."""
    cols, rows, total, bad = profile_table(doc)
    if use_rich:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.HORIZONTALS, show_edge=False, pad_edge=False, header_style="bold")
        for title, align in cols:
            table.add_column(title, justify=align, no_wrap=(title != "module"))
        for row, is_bad in zip(rows, bad):
            cells = [Text(c) for c in row]
            cells[0].stylize("cyan")
            for (title, _), c in zip(cols, cells):
                if is_bad and title.endswith(("NaN", "Inf")) and c.plain not in ("0", "-"):
                    c.stylize("bold red")
            table.add_row(*cells)
        table.add_section()
        table.add_row(*[Text(c, style="bold") for c in total])
        head, sub = Text(_headline(doc), style="bold"), Text(_subline(doc), style="dim")
        console = _fit_console(_console(file=file, highlight=False), [table, head, sub], whole=[table])
        console.print(head)
        console.print(sub)
        console.print(table)
        console.print()
        for line in _summary_lines(doc):
            console.print(Text(line))
        return
    out = file or sys.stdout
    print(_headline(doc), file=out)
    print(_subline(doc), file=out)
    print(file=out)
    _print_plain_table(cols, rows, total, file=out)
    print(file=out)
    for line in _summary_lines(doc):
        print(line, file=out)


def _shorten(text: str, n: int) -> str:
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def print_plugins(rows: List[Dict[str, str]], use_rich: bool = True, file=None) -> None:
    cols = [("name", "left"), ("origin", "left"), ("status", "left"), ("entry point", "left"),
            ("description", "left")]
    cells = [[r["name"], r["origin"], "ok" if r["status"] == "ok" else "failed (below)", r["entry_point"],
              _shorten(r["description"], 60)] for r in rows]
    failures = [f"{r['name']} ({r['origin']}, {r['entry_point']}): {r['status']}"
                for r in rows if r["status"] != "ok"]
    if not cells:
        print("no hookplug plugins found (is hookplug installed? 'pip install -e .')", file=file or sys.stdout)
        return
    if use_rich:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for title, _ in cols:
            table.add_column(title, no_wrap=title in ("name", "origin", "entry point"))
        for row in cells:
            status = Text(row[2], style="green" if row[2] == "ok" else "bold red")
            table.add_row(Text(row[0], style="cyan"), Text(row[1]), status, Text(row[3], style="dim"), Text(row[4]))
        console = _fit_console(_console(file=file, highlight=False), [table])
        console.print(table)
        for line in failures:
            console.print(Text(line, style="red"))
        return
    _print_plain_table(cols, cells, file=file)
    for line in failures:
        print(line, file=file or sys.stdout)


def _tree_glyphs(file) -> Tuple[str, str, str, str]:
    enc = getattr(file or sys.stdout, "encoding", None) or "ascii"
    try:
        "├└│─".encode(enc)
        return "├── ", "└── ", "│   ", "    "
    except (UnicodeEncodeError, LookupError):
        return "|-- ", "`-- ", "|   ", "    "


def selection_lines(model, names: Sequence[str], file=None,
                    mods: Optional[Dict[str, Any]] = None) -> List[Tuple[str, str, str, bool]]:
    """``[(tree label, class name, params text, matched), ...]``: the matched modules and
    their ancestors, in model order, drawn as a tree under the root (``mods``: the
    unwrapped model's ``named_modules`` as a dict, where the caller has it already)."""
    chosen = set(names)
    include = {""}
    for n in names:
        parts = n.split(".") if n else []
        for i in range(1, len(parts) + 1):
            include.add(".".join(parts[:i]))
    from hookplug._selectors import named_modules, unwrap_model

    model = unwrap_model(model)
    if mods is None:
        mods = dict(named_modules(model))  # the names select() gives (no wrapper segments)
    children: Dict[str, List[str]] = {}
    for n in mods:
        if n in include and n != "":
            parent = n.rsplit(".", 1)[0] if "." in n else ""
            children.setdefault(parent, []).append(n)
    tee, elbow, pipe, blank = _tree_glyphs(file)

    def params(n):
        return f"{sum(p.numel() for p in mods[n].parameters()):,}"

    root_cls = type(model).__name__
    lines = [("(root)" if "" in chosen else root_cls, root_cls if "" in chosen else "",
              params("") if "" in chosen else "", "" in chosen)]

    def walk(n: str, prefix: str) -> None:
        kids = children.get(n, [])
        for i, k in enumerate(kids):
            last = i == len(kids) - 1
            leaf = k.rsplit(".", 1)[-1]
            lines.append((prefix + (elbow if last else tee) + leaf, type(mods[k]).__name__,
                          params(k) if k in chosen else "", k in chosen))
            walk(k, prefix + (blank if last else pipe))

    walk("", "")
    return lines


def print_selection(model, label: str, selector: str, names: Sequence[str], use_rich: bool = True,
                    file=None) -> None:
    """The tree of matched modules with class names and parameter counts."""
    from hookplug._selectors import named_modules, unwrap_model

    model = unwrap_model(model)
    mods = dict(named_modules(model))  # the names select() gives (no wrapper segments)
    lines = selection_lines(model, names, file, mods)
    total_modules = len(mods)
    top = _top_level(list(names))
    top_params = sum(p.numel() for p in {id(p): p for n in top for p in mods[n].parameters()}.values())  # (tied: once)
    head = f"{type(model).__name__}" + (f" ({label})" if label != type(model).__name__ else "")
    summary = (f"{len(names)} of {total_modules} modules match {selector!r} · "
               f"{top_params:,} of {sum(p.numel() for p in model.parameters()):,} parameters")
    width = max(len(t) for t, *_ in lines) + 2
    cwidth = max(len(c) for _, c, _, _ in lines) + 2
    if use_rich:
        from rich.text import Text

        console = _console(file=file, highlight=False)
        if not console.is_terminal:
            console.width = max(console.width, width + cwidth + 16)
        console.print(Text(head, style="bold"))
        for text, cls, params, matched in lines[1:] if not lines[0][3] else lines:
            t = Text(text.ljust(width), style="cyan" if matched else "dim")
            t.append((cls if matched else f"({cls})").ljust(cwidth), style="" if matched else "dim")
            if params:
                t.append(params.rjust(12))
            console.print(t)
        console.print(Text(summary, style="dim"))
        return
    out = file or sys.stdout
    print(head, file=out)
    for text, cls, params, matched in lines[1:] if not lines[0][3] else lines:
        print((text.ljust(width) + (cls if matched else f"({cls})").ljust(cwidth)
               + (params.rjust(12) if params else "")).rstrip(), file=out)
    print(summary, file=out)


