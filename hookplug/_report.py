"""Reports of a profiling run: terminal table (rich or plain text), JSON, self-contained
HTML with inline SVG, and TensorBoard events.

Everything here works from host numbers: :class:`Collector` copies the plugins' results
after each step (``TensorStats.to_dict()``), and :func:`build_document` turns a run into one
JSON-able dict that every renderer reads. Plugins that were not selected leave their
columns out; nothing here imports a plugin by name.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import html
import json
import math
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ._optional import optional_import
from ._tb import hist_tag, scalar_tag

__all__ = [
    "Collector",
    "build_document",
    "stats_to_dict",
    "merge_stats",
    "print_profile",
    "print_plugins",
    "print_selection",
    "profile_table",
    "to_json",
    "render_html",
    "TensorBoardWriter",
]

STATS_FIELDS = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "mean", "std", "absmax",
                "hist_counts", "hist_edges")

# -- host numbers ----------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Tensors, numpy values and containers as plain Python numbers and lists."""
    if hasattr(value, "tolist") and callable(value.tolist):  # torch.Tensor, numpy
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def stats_to_dict(ts: Any) -> Optional[Dict[str, Any]]:
    """A ``TensorStats`` (or a dict of its fields) as a dict of host numbers and lists."""
    if ts is None:
        return None
    if hasattr(ts, "to_dict"):
        d = ts.to_dict()
    elif isinstance(ts, dict):
        d = dict(ts)
    elif dataclasses.is_dataclass(ts):
        d = {f.name: getattr(ts, f.name) for f in dataclasses.fields(ts)}
    else:
        d = {k: getattr(ts, k) for k in STATS_FIELDS if hasattr(ts, k)}
    return {k: _plain(v) for k, v in d.items()}


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


def _finite_count(d: Dict[str, Any]) -> int:
    return _int(d.get("numel")) - _int(d.get("nan_count")) - _int(d.get("inf_count"))


def merge_stats(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Merge two stats dicts exactly: counts add, extremes combine, mean and (population) std
    by the parallel formula, histograms add when their edges agree (else the newer one)."""
    if not a:
        return dict(b) if b else a
    if not b:
        return dict(a)
    out = dict(b)
    for k in ("numel", "nan_count", "inf_count", "zero_count"):
        if k in a or k in b:
            out[k] = _int(a.get(k)) + _int(b.get(k))
    na, nb = max(_finite_count(a), 0), max(_finite_count(b), 0)
    n = na + nb

    def pick(key, fn):
        vals = [v for v, cnt in ((_num(a.get(key)), na), (_num(b.get(key)), nb)) if v is not None and cnt > 0]
        return fn(vals) if vals else (a.get(key) if nb == 0 else b.get(key))

    out["min"] = pick("min", min)
    out["max"] = pick("max", max)
    out["absmax"] = pick("absmax", max)
    ma, mb = _num(a.get("mean")), _num(b.get("mean"))
    sa, sb = _num(a.get("std")), _num(b.get("std"))
    if n > 0 and None not in (ma, mb, sa, sb):
        delta = mb - ma
        mean = ma + delta * nb / n
        m2 = sa * sa * na + sb * sb * nb + delta * delta * na * nb / n
        out["mean"], out["std"] = mean, math.sqrt(max(m2, 0.0) / n)
    elif nb == 0:
        out["mean"], out["std"] = a.get("mean"), a.get("std")
    ca, cb = a.get("hist_counts") or [], b.get("hist_counts") or []
    if ca and cb and len(ca) == len(cb) and a.get("hist_edges") == b.get("hist_edges"):
        out["hist_counts"] = [x + y for x, y in zip(ca, cb)]
    return out


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


# -- collecting a run ------------------------------------------------------------------------

def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=3)


class Collector:
    """Copies the ``stats`` and ``flops`` results to the host after each step.

    When a plugin's ``reset()`` empties its results, each snapshot is one step: stats are
    merged across steps here and FLOPs are those of the last step. Otherwise the plugin's
    own (cumulative) results are used as they are.
    """

    def __init__(self, session, skip: Iterable[str] = ()):
        self.session = session
        self.skip = set(skip)
        self.stats: Dict[str, Dict[str, Dict[str, Any]]] = {}
        self.flops: Dict[str, Dict[str, int]] = {}
        self.flops_total: Optional[Dict[str, int]] = None
        self.steps = 0
        self._resettable: Dict[str, bool] = {}

    def _plugin(self, name: str):
        return self.session.plugins.get(name)

    def _results(self, name: str) -> Optional[Dict[str, Any]]:
        plugin = self._plugin(name)
        if plugin is None or not hasattr(plugin, "results"):
            return None
        try:
            return plugin.results()
        except Exception as exc:  # noqa: BLE001 - a report never dies of a plugin
            _warn(f"plugin {name!r}: results() failed: {type(exc).__name__}: {exc}")
            return None

    def _reset(self, name: str) -> None:
        from ._plugin import Plugin

        plugin = self._plugin(name)
        reset = getattr(type(plugin), "reset", None)
        if plugin is None or self._resettable.get(name) is False or reset is None or reset is Plugin.reset:
            self._resettable[name] = False  # no reset of its own: its results are cumulative
            return
        try:
            plugin.reset()
            self._resettable[name] = True
        except Exception:  # noqa: BLE001
            self._resettable[name] = False

    def after_step(self, step: int) -> Dict[str, Any]:
        """Snapshot this step's results (host numbers) and fold them into the run's."""
        snap: Dict[str, Any] = {"step": step, "stats": {}, "flops": {}, "flops_total": None}
        res = self._results("stats")
        if res is not None:
            snap["stats"] = {
                str(mod): {str(path): stats_to_dict(ts) for path, ts in (paths or {}).items()}
                for mod, paths in res.items()
            }
        res = self._results("flops")
        if res is not None:
            snap["flops"] = {
                str(mod): {k: _int(v) for k, v in _plain(dict(vals)).items() if not isinstance(v, str)}
                for mod, vals in res.items()
            }
            total = None
            plugin = self._plugin("flops")
            if hasattr(plugin, "total"):
                try:
                    total = plugin.total()
                except Exception:  # noqa: BLE001
                    total = None
            if isinstance(total, dict):
                snap["flops_total"] = {k: _int(v) for k, v in _plain(total).items()}
            elif total is not None:
                snap["flops_total"] = {"flops": _int(_plain(total))}
        # fold in
        cumulative = self._resettable.get("stats") is False
        for mod, paths in snap["stats"].items():
            into = self.stats.setdefault(mod, {})
            for path, d in paths.items():
                into[path] = d if cumulative else merge_stats(into.get(path), d)
        if snap["flops"] or "flops" in self.session.plugins:
            self.flops = snap["flops"]
            self.flops_total = snap["flops_total"]
        self.steps += 1
        for name in ("stats", "flops"):
            if name in self.session.plugins:
                self._reset(name)
        return snap


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
    if not paths:
        return None
    if "output" in paths:
        return "output"
    for p in paths:
        if p.startswith("output"):
            return p
    for p in paths:
        if not p.startswith(("input", "grad")):
            return p
    return next(iter(paths))


def build_document(*, session, collector: Collector, recorder, meta: Dict[str, Any],
                   param_count: Callable[[Any], int]) -> Dict[str, Any]:
    """The whole run as one JSON-able dict: what every report is drawn from."""
    from . import __version__

    active = [n for n in session.plugins if n != getattr(recorder, "name", None)]
    has_stats, has_flops = "stats" in active, "flops" in active
    modules: Dict[str, Any] = {}
    rec = recorder.results() if recorder is not None else {"shapes": {}, "dtypes": {}, "calls": {}}
    for name, mod in session.modules.items():
        shapes = rec["shapes"].get(name, {})
        dtypes = rec["dtypes"].get(name, {})
        first = next(iter(shapes.values()), None)
        stats = collector.stats.get(name) if has_stats else None
        entry = {
            "class": type(mod).__name__,
            "params": param_count(mod),
            "calls": rec["calls"].get(name, 0),
            "output_shape": first,
            "outputs": {p: {"shape": s, "dtype": dtypes.get(p)} for p, s in shapes.items()},
            "flops": collector.flops.get(name) if has_flops else None,
            "stats": stats if has_stats else None,
            "primary": _primary_path(stats or {}) if has_stats else None,
        }
        modules[name] = entry
    top = _top_level(list(modules))
    totals: Dict[str, Any] = {"modules": len(modules), "params": sum(modules[n]["params"] for n in top)}
    if has_flops:
        for k in ("flops", "macs", "backward_flops"):
            totals[k] = sum(_int((modules[n]["flops"] or {}).get(k)) for n in top)
        totals["model_flops"] = collector.flops_total
    if has_stats:
        for k in ("numel", "nan_count", "inf_count", "zero_count"):
            totals[k] = sum(_int(d.get(k)) for m in modules.values() for p, d in (m["stats"] or {}).items()
                            if not p.startswith(("grad", "input")))
        totals["grad_nan_count"] = sum(_int(d.get("nan_count")) for m in modules.values()
                                       for p, d in (m["stats"] or {}).items() if p.startswith("grad"))
        totals["grad_inf_count"] = sum(_int(d.get("inf_count")) for m in modules.values()
                                       for p, d in (m["stats"] or {}).items() if p.startswith("grad"))
    extra = {}
    for name in active:
        if name in ("stats", "flops"):
            continue
        plugin = session.plugins[name]
        if hasattr(plugin, "results"):
            try:
                extra[name] = _jsonable(plugin.results())
            except Exception as exc:  # noqa: BLE001
                extra[name] = {"error": f"{type(exc).__name__}: {exc}"}
    doc = {
        "hookplug_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **meta,
        "plugins_active": active,
        "modules": modules,
        "totals": totals,
        "disabled": dict(session.disabled),
        "extra": extra,
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
    if 1e-3 <= a < 1e5:
        text = f"{f:.4g}"
    else:
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
        if abs(x) < 999.5 or prefix == "E":
            if prefix == "":
                return f"{int(round(x))}{unit}"
            return f"{x:.3g}{prefix}{unit}"
        x /= 1000.0
    return str(v)  # pragma: no cover


def fmt_shape(shape: Optional[Sequence[int]]) -> str:
    return "-" if shape is None else "x".join(str(s) for s in shape) or "scalar"


def _module_label(name: str, calls: int) -> str:
    label = name if name else "(root)"
    if calls > 1:
        label += f" (x{calls})"
    elif calls == 0:
        label += " (not run)"
    return label


def profile_table(doc: Dict[str, Any]) -> Tuple[List[Tuple[str, str]], List[List[str]], List[str], List[bool]]:
    """``(columns, rows, total_row, row_is_bad)``: the per-module table as strings, shared by
    the rich and the plain-text renderers. ``columns`` are ``(title, "left"|"right")``."""
    active = doc.get("plugins_active", [])
    has_stats, has_flops = "stats" in active, "flops" in active
    cols = [("module", "left"), ("class", "left"), ("output", "left"), ("params", "right")]
    if has_flops:
        cols.append(("FLOPs", "right"))
    if has_stats:
        cols += [("min", "right"), ("max", "right"), ("mean", "right"), ("std", "right"),
                 ("NaN", "right"), ("Inf", "right")]
    rows, bad = [], []
    for name, m in doc["modules"].items():
        shapes = [o["shape"] for o in m.get("outputs", {}).values()]
        out = fmt_shape(shapes[0]) if shapes else "-"
        if len(shapes) > 1:
            out += f" (+{len(shapes) - 1})"
        row = [_module_label(name, m.get("calls", 0)), m["class"], out, fmt_count(m["params"])]
        if has_flops:
            row.append(fmt_si((m.get("flops") or {}).get("flops")) if m.get("flops") is not None else "-")
        is_bad = False
        if has_stats:
            s = (m.get("stats") or {}).get(m.get("primary") or "", None) or {}
            row += [fmt_float(s.get("min")), fmt_float(s.get("max")), fmt_float(s.get("mean")),
                    fmt_float(s.get("std")), fmt_count(s.get("nan_count")) if s else "-",
                    fmt_count(s.get("inf_count")) if s else "-"]
            is_bad = bool(_int(s.get("nan_count")) or _int(s.get("inf_count")))
        rows.append(row)
        bad.append(is_bad)
    t = doc["totals"]
    total = [f"total ({t['modules']} module{'s' if t['modules'] != 1 else ''})", "", "", fmt_count(t["params"])]
    if has_flops:
        total.append(fmt_si(t.get("flops")))
    if has_stats:
        total += ["", "", "", "", fmt_count(t.get("nan_count")), fmt_count(t.get("inf_count"))]
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
    mf = t.get("model_flops")
    if mf and mf.get("flops") is not None:
        text = f"{fmt_si(mf['flops'], ' FLOPs')} forward"
        if _int(mf.get("backward_flops")):
            text += f" + {fmt_si(mf['backward_flops'], ' FLOPs')} backward"
        parts.append(text + " per step")
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
    if "stats" in (doc.get("plugins_active") or []) and doc.get("steps", 1) > 1:
        lines.append(f"statistics over all {doc['steps']} steps; FLOPs per step")
    for name, why in (doc.get("disabled") or {}).items():
        lines.append(f"plugin {name!r} was disabled during the run: {why}")
    missing = [p for p in doc.get("plugins", []) if p not in (doc.get("plugins_active") or [])]
    if missing:
        lines.append(f"not loaded: {', '.join(missing)} (see 'hookplug plugins')")
    return lines


# -- terminal output -------------------------------------------------------------------------

def _fit_console(console, renderables: Sequence[Any]):
    """When stdout is not a terminal, widen rich's console to the content (no wrapping in
    files and pipes)."""
    if not console.is_terminal:
        from rich.measure import Measurement

        wide = console.options.update(width=4000, max_width=4000)
        widest = max((Measurement.get(console, wide, r).maximum for r in renderables), default=80)
        console.width = max(widest, 80)
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
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.HORIZONTALS, show_edge=False, pad_edge=False, header_style="bold")
        for title, align in cols:
            table.add_column(title, justify=align, no_wrap=(title != "module"))
        for row, is_bad in zip(rows, bad):
            cells = [Text(c) for c in row]
            cells[0].stylize("cyan")
            if is_bad:
                for c in cells[-2:]:
                    if c.plain not in ("0", "-"):
                        c.stylize("bold red")
            table.add_row(*cells)
        table.add_section()
        table.add_row(*[Text(c, style="bold") for c in total])
        head, sub = Text(_headline(doc), style="bold"), Text(_subline(doc), style="dim")
        console = _fit_console(Console(file=file, highlight=False), [table, head, sub])
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
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for title, _ in cols:
            table.add_column(title, no_wrap=title in ("name", "origin", "entry point"))
        for row in cells:
            status = Text(row[2], style="green" if row[2] == "ok" else "bold red")
            table.add_row(Text(row[0], style="cyan"), row[1], status, Text(row[3], style="dim"), row[4])
        console = _fit_console(Console(file=file, highlight=False), [table])
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


def selection_lines(model, names: Sequence[str], file=None) -> List[Tuple[str, str, str, bool]]:
    """``[(tree label, class name, params text, matched), ...]``: the matched modules and
    their ancestors, in model order, drawn as a tree under the root."""
    chosen = set(names)
    include = {""}
    for n in names:
        parts = n.split(".") if n else []
        for i in range(1, len(parts) + 1):
            include.add(".".join(parts[:i]))
    mods = dict(model.named_modules())
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
    lines = selection_lines(model, names, file)
    total_modules = sum(1 for _ in model.modules())
    top = _top_level(list(names))
    mods = dict(model.named_modules())
    top_params = sum(p.numel() for n in top for p in mods[n].parameters())
    head = f"{type(model).__name__}" + (f" ({label})" if label != type(model).__name__ else "")
    summary = (f"{len(names)} of {total_modules} modules match {selector!r} · "
               f"{top_params:,} of {sum(p.numel() for p in model.parameters()):,} parameters")
    width = max(len(t) for t, *_ in lines) + 2
    cwidth = max(len(c) for _, c, _, _ in lines) + 2
    if use_rich:
        from rich.console import Console
        from rich.text import Text

        console = Console(file=file, highlight=False)
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


# -- HTML ----------------------------------------------------------------------------------

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


def _hist_svg(name: str, stats: Optional[Dict[str, Any]], width: int = 300, height: int = 120) -> str:
    """One module's histogram as inline SVG: one bar per bucket in order (for log2 buckets:
    sign and binary exponent, long empty runs drawn as a break in the axis), bar heights on a
    log scale, the exact count of each bucket in its tooltip."""
    esc = html.escape
    pad_l, pad_r, pad_t, pad_b = 8, 8, 6, 20
    pw, ph = width - pad_l - pad_r, height - pad_t - pad_b
    base = pad_t + ph
    qname = esc(name, quote=True)
    parts = [f'<svg class="hist" data-module="{qname}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="histogram of {qname}">']
    edges = (stats or {}).get("hist_edges") or []
    bars = _hist_bars((stats or {}).get("hist_counts") or [], edges)
    parts.append(f'<line x1="{pad_l}" y1="{base}" x2="{pad_l + pw}" y2="{base}" class="axis"/>')
    if not bars:
        why = "no histogram (bins=0)" if stats and not (stats.get("hist_counts") or []) else "no finite values"
        if not stats:
            why = "no values recorded"
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">{why}</text></svg>')
        return "".join(parts)
    log2 = bool(edges) and all(_num(e) == 0 or _is_pow2(e) for e in edges)
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
                         f"<title>{esc(f'no values from {_fmt_edge(lo)} to {_fmt_edge(hi)}')}</title></rect>")
            if spans_zero:
                ticks.append((1, mid, "0"))
            else:
                ticks.append((2, x, _fmt_edge(lo)))
                ticks.append((2, x + bw, _fmt_edge(hi)))
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
                tip = f"{_fmt_edge(lo)} to {_fmt_edge(hi)}: {c:,}"
            parts.append(f'<rect class="{cls}" x="{x:.2f}" y="{base - h:.2f}" width="{max(bw - 0.6, 0.6):.2f}" '
                         f'height="{h:.2f}"><title>{esc(tip)}</title></rect>')
            if spans_zero:
                ticks.append((1, x + bw / 2, "0"))
        if k == 0 and lo is not None and not (kind == "gap" and spans_zero):
            ticks.append((0, x, _fmt_edge(lo)))
        if k == len(items) - 1 and hi is not None and not (kind == "gap" and spans_zero):
            ticks.append((0, x + bw, _fmt_edge(hi)))
        if kind == "bar" and k > 0 and lo is not None:
            e = _log2_exp(lo) if log2 else None
            if (log2 and e is not None and e % 4 == 0) or (not log2 and k % max(1, len(items) // 4) == 0):
                ticks.append((3, x, _fmt_edge(lo)))
        x += bw
    placed: List[Tuple[float, str]] = []
    for _, tx, label in sorted(ticks, key=lambda t: t[0]):
        if all(abs(tx - px) >= 34 for px, _ in placed):
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
    has_stats, has_flops = "stats" in active, "flops" in active
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
        mf = t.get("model_flops") or {}
        cards.append(("FLOPs / step", fmt_si(t.get("flops")),
                      "selected modules" + (f" · model {fmt_si(mf.get('flops'))}" if mf.get("flops") else ""),
                      False))
        if doc.get("backward"):
            cards.append(("backward FLOPs", fmt_si(t.get("backward_flops")), "selected modules", False))
    if has_stats:
        cards.append(("NaN values", f"{_int(t.get('nan_count')):,}", "in selected outputs",
                      bool(_int(t.get("nan_count")))))
        cards.append(("Inf values", f"{_int(t.get('inf_count')):,}", "in selected outputs",
                      bool(_int(t.get("inf_count")))))
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

    if has_stats:
        out.append('<h2>Output distributions<small>log2 histogram: one bucket per sign and binary exponent; '
                   'bar height on a log scale; hover a bar for its count</small></h2>')
        out.append('<p class="legend"><i style="background:var(--neg)"></i>negative'
                   '<i style="background:var(--zero)"></i>zero<i style="background:var(--pos)"></i>positive</p>')
        out.append('<div class="hists">')
        for name, mod in doc["modules"].items():
            stats = (mod.get("stats") or {}).get(mod.get("primary") or "")
            info = ""
            if stats:
                info = (f"numel {_int(stats.get('numel')):,} · zeros {_int(stats.get('zero_count')):,} · "
                        f"absmax {fmt_float(stats.get('absmax'))}")
                if _int(stats.get("nan_count")) or _int(stats.get("inf_count")):
                    info += (f' · <span class="warn">NaN {_int(stats.get("nan_count")):,} · '
                             f'Inf {_int(stats.get("inf_count")):,}</span>')
                else:
                    info = esc(info)
            path = mod.get("primary")
            path_txt = f" {path}" if path and path != "output" else ""
            out.append(f'<div class="hist-card"><h3 title="{esc(name or "(root)", quote=True)}">'
                       f'{esc(name or "(root)")}{esc(path_txt)} <span>{esc(mod["class"])}</span></h3>'
                       f"<p>{info or '&nbsp;'}</p>{_hist_svg(name, stats)}</div>")
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
        s = (m.get("stats") or {}).get(m.get("primary") or "") or {}
        shape = m.get("output_shape")
        numel = math.prod(shape) if shape else None
        vals = {"module": None, "class": None, "output": numel, "params": m["params"],
                "FLOPs": (m.get("flops") or {}).get("flops"),
                "min": s.get("min"), "max": s.get("max"), "mean": s.get("mean"), "std": s.get("std"),
                "NaN": s.get("nan_count"), "Inf": s.get("inf_count")}
        row = []
        for title, _ in cols:
            v = vals.get(title)
            row.append(None if v is None else repr(float(v)) if _num(v) is not None else None)
        out.append(row)
    return out


# -- TensorBoard ---------------------------------------------------------------------------

class TensorBoardWriter:
    """Scalars (min/max/mean/std/absmax, NaN/Inf counts, FLOPs) and raw histograms per step,
    written with ``torch.utils.tensorboard.SummaryWriter`` in the layout of the
    ``tensorboard`` sink (:mod:`hookplug._tb`: ``hookplug/<stat>/<module>/<site>``)."""

    def __init__(self, logdir: str):
        _, tb = optional_import("tensorboard", "torch.utils.tensorboard",
                                feature="hookplug profile --tensorboard", extra="tensorboard",
                                package="tensorboard")
        SummaryWriter = tb.SummaryWriter
        self.logdir = logdir
        self.writer = SummaryWriter(log_dir=logdir)

    def write_step(self, step: int, snap: Dict[str, Any]) -> None:
        w = self.writer
        for mod, paths in (snap.get("stats") or {}).items():
            for path, d in (paths or {}).items():
                if not d:
                    continue
                for k in ("min", "max", "mean", "std", "absmax"):
                    v = _num(d.get(k))
                    if v is not None:
                        w.add_scalar(scalar_tag(k, mod, path), v, step)
                for k in ("nan_count", "inf_count"):
                    if k in d:
                        w.add_scalar(scalar_tag(k, mod, path), _int(d.get(k)), step)
                self._histogram(hist_tag(mod, path), d, step)
        for mod, f in (snap.get("flops") or {}).items():
            if "flops" in f:
                w.add_scalar(scalar_tag("flops", mod), _int(f["flops"]), step)
        if snap.get("flops_total") and "flops" in snap["flops_total"]:
            w.add_scalar("hookplug/flops_total", _int(snap["flops_total"]["flops"]), step)
        w.flush()

    def _histogram(self, tag: str, d: Dict[str, Any], step: int) -> None:
        bars = _hist_bars(d.get("hist_counts") or [], d.get("hist_edges") or [])
        n = _finite_count(d)
        mn, mx, mean, std = (_num(d.get(k)) for k in ("min", "max", "mean", "std"))
        if not bars or n <= 0 or None in (mn, mx, mean, std):
            return
        limits = []
        for lo, hi, _ in bars:
            v = _num(hi)
            if v is None:
                v = mx if hi is None or float(hi) > 0 else mn
            limits.append(v)
        for i in range(1, len(limits)):  # strictly increasing, as TensorBoard expects
            if limits[i] <= limits[i - 1]:
                limits[i] = math.nextafter(limits[i - 1], math.inf)
        self.writer.add_histogram_raw(
            tag, min=mn, max=mx, num=n, sum=mean * n, sum_squares=(std * std + mean * mean) * n,
            bucket_limits=limits, bucket_counts=[c for _, _, c in bars], global_step=step)

    def close(self) -> None:
        self.writer.close()
