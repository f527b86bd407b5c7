"""Telemetry config files: ``hookplug.attach(model, config="telemetry.toml")``.

``load_config(path)`` reads a TOML file and returns the keyword arguments of
:func:`hookplug.attach` it describes, so ``attach(model, **load_config(path))`` and
``attach(model, config=path)`` do the same thing. Every key is optional::

    select = "Conv2d|Linear"      # default selector of the [plugins.*] tables ("*" if unset)
    every = 1                     # sample one step in N (session level)
    flush_every = 10              # flush telemetry every K steps
    on_error = "raise"            # or "warn"
    strict = false                # a selector that matches nothing raises

    [plugins.stats]               # one table per plugin; its keys are the plugin's options
    select = "Linear:*"           # reserved key: this plugin's own selector (optional)
    bins = 32
    sites = ["output", "grad"]    # TOML arrays reach the plugin as lists

    [plugins.capture]             # a plugin without options: an empty table

    [sinks.jsonl]                 # one table per sink; its keys are the sink's options
    path = "runs/exp1"            # relative to this file's folder (see below)
    [sinks.prometheus]
    port = 9100

``plugins = ["stats", "capture"]`` (names without options) may replace the ``[plugins.*]``
tables. The result maps onto ``attach``: ``selector`` is ``{selector: {plugin: options}}``
(plugins that share a selector share an entry), ``sink`` is ``{sink: options}``.

Precedence (``attach(model, config=..., **arguments)``): an argument given to ``attach``
wins over the file, key by key (``every``, ``flush_every``, ``sink``, ``on_error``,
``strict``); what neither gives takes attach's default (``every=1``, ``on_error="raise"``,
``strict=False``). Plugins come from the file or from ``plugins=``, not both (a
:class:`ConfigError` says so). A file without plugins but with a top-level ``select``
supplies the selector for the ``plugins=`` given to ``attach``, unless ``attach`` is given
a selector of its own (passed explicitly, even ``"*"``), which wins; ``load_config`` then
returns that ``select`` as the string ``selector``.

A sink's ``path`` read from a file is relative to the file's folder, not to the working
directory (as ruff and pytest read paths in their config files): ``load_config`` returns it
as an absolute path, fixed when the file is read. A sink given no ``path`` writes under
``runs/<run-id>`` in the working directory as always, and a dict config
(``attach(config={...})``, :func:`parse_config`) or ``sink=`` keeps its paths as given,
relative to the working directory as Python code's paths are.

Checks happen here, before anything is attached: unknown top-level keys, wrong types,
unknown plugin or sink names, an empty sink ``path``, and plugin options (``hookplug._options``: unknown names,
types against the factory's type hints). Every
error is a :class:`ConfigError` (a ``ValueError``) that names the file, the key and what
was expected, e.g. ``telemetry.toml: [plugins.stats] bins: expected an int, got "x"``.
Values only the plugin checks (a range, a path's placeholders) are refused when ``attach``
builds it: a :class:`~hookplug.PluginError` starting with the file and table
(``telemetry.toml: [plugins.stats]: plugin 'stats' rejected its options ...``).

Nesting is bounded: tables and arrays nested more than ``MAX_DEPTH`` deep are refused with a
:class:`ConfigError` before the TOML parser (which recurses) sees them.

TOML is read with ``tomllib`` (Python 3.11+) or, on 3.9/3.10, the ``tomli`` package.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Dict

from ._options import close_matches

__all__ = ["load_config", "ConfigError"]

MAX_DEPTH = 32  # tables/arrays nested deeper are refused
_TOP_KEYS = ("select", "every", "flush_every", "on_error", "strict", "plugins", "sinks")


class ConfigError(ValueError):
    """A telemetry config file that cannot be read or does not match the schema."""


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError:  # pragma: no cover - depends on the interpreter
        raise ConfigError(
            "reading a hookplug config file needs Python 3.11+ (tomllib) or the tomli package: "
            "pip install tomli"
        ) from None
    return tomli


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):  # its items, so a wrong one is seen (TOML's syntax; the first 6)
        items = [_show(v) for v in value[:6]] + (["..."] if len(value) > 6 else [])
        return f"an array [{', '.join(items)}]"
    return repr(value)


def _check_selector(ctx: "_Ctx", where: str, selector: str) -> None:
    """The selector's syntax, checked when the file is read (its classes are resolved at
    ``attach``, against the model)."""
    from ._selectors import SelectorError, parse_selector

    try:
        parse_selector(selector)
    except SelectorError as exc:
        raise ctx.error(where, str(exc)) from None


class _Ctx:
    def __init__(self, path: str):
        self.name = os.path.basename(path) or path

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.name}: {where}{': ' if where else ''}{message}")

    def expect(self, where: str, value: Any, hint: Any) -> None:
        from ._options import describe, type_ok

        if not type_ok(value, hint):
            raise self.error(where, f"expected {describe(hint)}, got {_show(value)}")


# -- plugin options: hookplug._options checks them -------------------------------------------

def _check_options(ctx: _Ctx, table: str, name: str, options: Dict[str, Any]) -> Any:
    """Refuse an unknown plugin name or options its factory rejects; the factory (None: it
    failed to load, which attach() reports)."""
    from ._manager import _discover
    from ._options import OptionError, check_options

    sources = _discover()
    src = sources.get(name)
    if src is None:
        close = close_matches(name, sources)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ctx.error(f"[{table}.{name}]", f"unknown plugin {name!r}.{hint} Available: "
                        f"{', '.join(sources) or 'none'}")
    factory = src.load()  # a broken plugin has warned already; attach() will skip it
    if factory is None:
        return None
    try:
        check_options(name, factory, options, show=_show)
    except OptionError as exc:
        raise ctx.error(f"[{table}.{name}] {exc.option}", exc.problem) from None
    return factory


# -- the schema ---------------------------------------------------------------------------------

def _plugin_tables(ctx: _Ctx, table: str, raw: Any) -> Dict[str, Dict[str, Any]]:
    if isinstance(raw, list) and table == "plugins":
        out = {}
        for i, item in enumerate(raw):
            ctx.expect(f"plugins[{i}]", item, str)
            if item in out:  # (as attach(plugins=[...]) refuses it)
                raise ctx.error(f"plugins[{i}]", f"{item!r} is listed twice (a plugin name is used once "
                                "in a session)")
            out[item] = {}
        return out
    if not isinstance(raw, dict):
        want = "a table [plugins.NAME] or an array of names" if table == "plugins" else "a table [sinks.NAME]"
        raise ctx.error(table, f"expected {want}, got {_show(raw)}")
    out = {}
    for name, opts in raw.items():
        if not isinstance(opts, dict):
            raise ctx.error(f"[{table}.{name}]", f"expected a table of options, got {_show(opts)}")
        out[name] = dict(opts)
    return out


def _text_depth(text: str) -> int:
    """How deep ``[``/``{`` nest in TOML text, outside strings and comments (an upper bound
    on the parsed nesting; table headers count one)."""
    depth = deepest = 0
    quote = ""
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 2
                continue
            if ch == quote or ch == "\n":
                quote = ""
        elif text.startswith(('"""', "'''"), i):  # a multi-line string: skip to its end
            end = text.find(text[i:i + 3], i + 3)
            i = n if end < 0 else end + 3
            continue
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def _check_depth(ctx: "_Ctx", data: Any) -> None:
    """Refuse values nested more than ``MAX_DEPTH`` deep (iteratively: no recursion)."""
    stack = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ctx.error(where.lstrip("."), f"nested more than {MAX_DEPTH} tables/arrays deep")
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}", depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


def parse_config(data: Dict[str, Any], path: str = "<config>") -> Dict[str, Any]:
    """Validate an already parsed config mapping; see :func:`load_config`."""
    ctx = _Ctx(path)
    if not isinstance(data, dict):
        raise ctx.error("", f"expected a table of settings, got {type(data).__name__}")
    _check_depth(ctx, data)
    for key in data:
        if key not in _TOP_KEYS:
            close = close_matches(key, _TOP_KEYS)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ctx.error(key, f"unknown key{hint}; expected one of {', '.join(_TOP_KEYS)}")
    out: Dict[str, Any] = {}
    default_sel = data.get("select", "*")
    ctx.expect("select", default_sel, str)
    _check_selector(ctx, "select", default_sel)
    for key in ("every", "flush_every"):
        if key in data:
            ctx.expect(key, data[key], int)
            if data[key] < 1:
                raise ctx.error(key, f"expected an int >= 1, got {data[key]}")
            out[key] = data[key]
    if "on_error" in data:
        if data["on_error"] not in ("raise", "warn"):
            raise ctx.error("on_error", f'expected "raise" or "warn", got {_show(data["on_error"])}')
        out["on_error"] = data["on_error"]
    if "strict" in data:
        ctx.expect("strict", data["strict"], bool)
        out["strict"] = data["strict"]

    groups: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for name, opts in _plugin_tables(ctx, "plugins", data.get("plugins", {})).items():
        sel = opts.pop("select", default_sel)
        ctx.expect(f"[plugins.{name}] select", sel, str)
        _check_selector(ctx, f"[plugins.{name}] select", sel)
        _check_options(ctx, "plugins", name, opts)
        groups.setdefault(sel, {})[name] = opts
    if groups:
        out["selector"] = groups
    elif "select" in data:  # no plugins here: the selector for attach's own plugins=
        out["selector"] = default_sel
    sinks = _plugin_tables(ctx, "sinks", data.get("sinks", {}))
    for name, opts in sinks.items():
        factory = _check_options(ctx, "sinks", name, opts)
        if isinstance(factory, type) and not _is_sink_class(factory):  # (a factory function: attach checks)
            raise ctx.error(f"[sinks.{name}]", f"expected a sink (a plugin that writes telemetry); {name!r} "
                            f"is a plugin: put it under [plugins.{name}]")
        path_value = opts.get("path")
        # refused here as the sink refuses it: a file's "" would be joined to its folder (taken
        # silently as that folder) before the sink could see it
        if isinstance(path_value, str) and not path_value.strip():
            raise ctx.error(f"[sinks.{name}] path", f"expected a file or folder name, got {_show(path_value)}")
    if sinks:
        out["sink"] = sinks
    return out


def load_config(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """Read a telemetry TOML file (schema in this module's docstring) and return the
    ``hookplug.attach`` keyword arguments it describes: some of ``selector`` (a
    ``{selector: {plugin: options}}`` dict, or the top-level ``select`` string when the file
    names no plugins), ``sink`` (``{sink: options}``), ``every``, ``flush_every``,
    ``on_error``, ``strict``; a sink's relative ``path`` made absolute against the file's
    folder. Raises :class:`ConfigError`."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    toml = _toml()
    name = os.path.basename(path) or path
    try:
        text = raw.decode("utf-8-sig")  # (a byte-order mark, as some Windows editors write)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name}: not UTF-8 text: {exc}") from None
    depth = _text_depth(text)
    if depth > MAX_DEPTH:
        raise ConfigError(f"{name}: tables/arrays nested {depth} deep; at most {MAX_DEPTH} are allowed")
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{name}: tables/arrays nested too deep") from None
    out = parse_config(data, path)
    folder = os.path.dirname(os.path.abspath(path))
    _paths_relative_to(folder, out.get("sink", {}))
    if isinstance(out.get("selector"), dict):  # a sink in [plugins.NAME] serves as a sink too
        for plugins in out["selector"].values():
            _paths_relative_to(folder, {n: o for n, o in plugins.items() if _is_sink(n)})
    return out


def _is_sink(name: str) -> bool:
    """Whether the plugin registered as ``name`` is a sink (its factory has ``hookplug_flush``)."""
    from ._manager import PluginError, _factory

    try:
        factory = _factory(name, None)[1]
    except PluginError:
        return False  # (attach() says what is wrong with it)
    return _is_sink_class(factory)


def _is_sink_class(factory: Any) -> bool:
    """Whether a plugin class implements ``hookplug_flush`` (under that name or a
    ``specname=``)."""
    from ._manager import implements_hook

    return implements_hook(factory, "hookplug_flush")


def _paths_relative_to(folder: str, sinks: Dict[str, Dict[str, Any]]) -> None:
    """Make each sink's relative ``path`` (read from a file: the tables are this module's
    own) relative to ``folder``, the file's, as an absolute path; the folder's braces are
    doubled so they are not taken for the path's ``{rank}``/``{run_id}`` placeholders. A
    leading ``~`` is the home folder; a URL (``s3://bucket/x``, a third-party sink's) is
    left as it is."""
    template = folder.replace("{", "{{").replace("}", "}}")
    for opts in sinks.values():
        value = opts.get("path")
        if isinstance(value, str) and value.startswith("~"):  # the home folder, as a shell
            value = opts["path"] = os.path.expanduser(value)  # reads it (not a folder "~")
        if isinstance(value, str) and not os.path.isabs(value) and "://" not in value:
            opts["path"] = os.path.join(template, value)


def _records_given(fn):
    """Call ``fn`` with ``_given``: the names of the arguments its caller passed (found with
    ``inspect.signature(fn).bind``); the signature shown drops ``_given``. An argument passed
    as None whose default is not None counts as not passed (its default, or the config
    file, applies), so wrappers may forward None for "not set"."""
    sig = inspect.signature(fn)
    public = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "_given"])
    has_default = {n for n, p in public.parameters.items()
                   if p.default is not p.empty and p.default is not None}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = public.bind(*args, **kwargs)
        for name in [n for n, v in bound.arguments.items() if v is None and n in has_default]:
            del bound.arguments[name]
        return fn(*bound.args, _given=frozenset(bound.arguments), **bound.kwargs)

    wrapper.__signature__ = public
    return wrapper


def attach_options(config, given, selector, plugins, *, every, sink, on_error, strict, flush_every):
    """How ``attach()`` combines ``config=`` (a path or an already loaded dict) with its own
    arguments (the precedence rule of this module's docstring): an argument whose name is in
    ``given`` (passed by the caller) wins over the file; plugins come from one or the other,
    not both (``attach`` adds the ``jsonl`` sink where ``flush_every`` is set and neither
    ``sink`` nor ``plugins`` names one).
    Returns ``(selector, plugins, every, sink, on_error, strict, flush_every, origins)``:
    ``origins`` names the file and table of each plugin and sink taken from the file,
    ``{"plugins": {"stats": "run.toml: [plugins.stats]"}, "sink": {...}}``, for errors
    their options raise at attach."""
    origins: Dict[str, Dict[str, str]] = {"plugins": {}, "sink": {}}
    if config is not None:
        if not isinstance(config, (str, os.PathLike, dict)):
            raise TypeError(f"attach(): config= expects a path to a TOML file (str or os.PathLike) or a "
                            f"dict, got {type(config).__name__}")
        cfg = parse_config(config) if isinstance(config, dict) else load_config(config)
        cfg_selector = cfg.get("selector")
        if isinstance(cfg_selector, dict) and (plugins is not None or "selector" in given):
            raise ConfigError(
                f"attach(): plugins come from config={config!r}; leave selector= and plugins= "
                "unset, or remove the plugins from the file")
        if cfg_selector is not None and "selector" not in given:
            selector = cfg_selector
        every = every if "every" in given else cfg.get("every", every)
        flush_every = flush_every if "flush_every" in given else cfg.get("flush_every", flush_every)
        sink = sink if "sink" in given else cfg.get("sink", sink)
        on_error = on_error if "on_error" in given else cfg.get("on_error", on_error)
        strict = strict if "strict" in given else cfg.get("strict", strict)
        file = "config=" if isinstance(config, dict) else (os.path.basename(os.fspath(config)) or os.fspath(config))
        if isinstance(cfg_selector, dict):
            origins["plugins"] = {n: f"{file}: [plugins.{n}]" for group in cfg_selector.values() for n in group}
        if "sink" not in given:
            origins["sink"] = {n: f"{file}: [sinks.{n}]" for n in cfg.get("sink", {})}
    return selector, plugins, every, sink, on_error, strict, flush_every, origins
