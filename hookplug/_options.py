"""The one checker of plugin options, driven by the factory's type hints.

``attach(plugins=[("stats", {...})])`` (through ``create_plugin``) and config files (through
``_config``) both call :func:`check_options`. Types are checked here; value ranges that a
hint cannot express stay in the plugin. Supported hints: ``bool``, ``int``, ``float``,
``str``, classes, ``Optional``/``Union``, ``Literal``, ``Sequence[X]``/``List[X]``,
``Tuple[X, ...]``/``Tuple[X, Y]``, ``Dict``; ``Any``, ``Callable`` and unresolvable hints
are not checked. ``bool`` is never an ``int`` or a ``float``. A one-shot iterator (a
generator, ``map``) given for a sequence is materialised once, into the list (or tuple) that
is checked and then handed to the plugin.
"""
from __future__ import annotations

import collections.abc as cabc
import dataclasses
import difflib
import functools
import inspect
import types
import typing
from typing import Any, Callable, Dict, List

from ._manager import PluginError

__all__ = ["OptionError", "check_options", "type_ok", "describe", "materialise"]

_NAMES = {bool: "a boolean", int: "an int", float: "a number", str: "a string",
          dict: "a table", type(None): "None"}
_PLURAL = {bool: "booleans", int: "ints", float: "numbers", str: "strings"}
_SEQS = (list, tuple, cabc.Sequence, cabc.Iterable, cabc.Collection)
_UNIONS = (typing.Union, getattr(types, "UnionType", typing.Union))  # Union[A, B], A | B


class OptionError(PluginError):
    """An unknown, missing or mistyped option: ``plugin``, ``option``, ``problem``."""

    def __init__(self, plugin: str, option: str, problem: str, message: str = ""):
        super().__init__(message or f"plugin {plugin!r} option {option!r}: {problem}")
        self.plugin, self.option, self.problem = plugin, option, problem


def close_matches(word: str, choices: Any, n: int = 1) -> List[str]:
    """The ``choices`` ``word`` may have meant, best first: those equal to it but for case
    (difflib alone misses ``"FLOPS"`` for ``"flops"``), then difflib's close matches."""
    choices = [c for c in choices if isinstance(c, str)]
    if not isinstance(word, str):
        return []
    close = [c for c in choices if c.lower() == word.lower() and c != word]
    close += [c for c in difflib.get_close_matches(word, choices, n=n) if c not in close]
    return close[:n]


def is_int_at_least(value: Any, least: int) -> bool:
    """Whether ``value`` is an int (not a bool) ``>= least``: a count, a step number."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the type hint ``hint``."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        return any(type_ok(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is tuple or origin in _SEQS:
        if isinstance(value, str) and origin is not cabc.Sequence:
            return False
        if isinstance(value, (bytes, dict, cabc.Iterator)) or not isinstance(value, cabc.Iterable):
            return False  # an iterator: checking would consume it (check_options materialises it first)
        if not isinstance(value, (list, tuple, str)):
            value = list(value)  # a set, an array: any finite iterable of the right items
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(type_ok(v, a) for v, a in zip(value, args))
        return not args or all(type_ok(v, args[0]) for v in value)
    if origin in (dict, cabc.Mapping):
        return isinstance(value, dict)
    if origin is not None:
        return not isinstance(origin, type) or isinstance(value, origin)
    if hint is type(None):
        return value is None
    try:
        return not isinstance(hint, type) or isinstance(value, hint)
    except TypeError:  # e.g. a Protocol that is not runtime-checkable: not checked
        return True


def describe(hint: Any, show: Callable[[Any], str] = repr) -> str:
    """``hint`` in words; None is left out (a config file cannot say None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        words = list(dict.fromkeys(describe(a, show) for a in args if a is not type(None)))
        return " or ".join(w for w in words if not any(o.startswith(f"{w} or ") for o in words))
    if origin is typing.Literal:
        return "one of " + ", ".join(show(a) for a in args)
    if origin is tuple or origin in _SEQS:
        fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis
        each = " or ".join(_PLURAL.get(a) or f"{getattr(a, '__name__', a)} objects"
                           for a in dict.fromkeys(args[:1 if not fixed else None]))
        text = f"a sequence of {len(args)} {each}" if fixed else f"a sequence of {each or 'values'}"
        return ("a string or " + text) if origin is cabc.Sequence and str in args else text
    if origin is not None:
        return describe(origin, show)
    name = getattr(hint, "__name__", str(hint))
    return _NAMES.get(hint) or ("an " if name[:1] in "AEIOU" else "a ") + name


def _sequence_type(hint: Any):
    """``list`` or ``tuple`` when ``hint`` (or a member of its union) is a sequence, else None."""
    origin = typing.get_origin(hint)
    if origin in _UNIONS:
        return next((t for t in map(_sequence_type, typing.get_args(hint)) if t is not None), None)
    if origin is tuple:
        return tuple
    return list if origin in _SEQS else None


def materialise(value: Any, hint: Any) -> Any:
    """``value``, or for a one-shot iterator given for a sequence hint the list (or tuple) it
    yields: checked, then handed to the plugin (checking the iterator itself would consume it)."""
    if isinstance(value, cabc.Iterator):
        seq = _sequence_type(hint)
        if seq is not None:
            return seq(value)
    return value


def _hints(factory) -> Dict[str, Any]:
    target = inspect.unwrap(factory.__init__ if isinstance(factory, type) else factory)
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - a hint that cannot be resolved is not checked
        return {}


def check_options(name: str, factory, options: Dict[str, Any],
                  show: Callable[[Any], str] = repr) -> Dict[str, Any]:
    """Check ``options`` against ``factory``'s signature and type hints; raise
    :class:`OptionError` for the first unknown option (with a close match), wrong type or
    missing required option. ``show`` renders the received value. Returns the options to
    pass on: ``options`` itself, or a copy in which one-shot iterators given for sequences
    are the lists (or tuples) that were checked."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return options
    params = {p.name: p for p in sig.parameters.values()
              if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    hints = None
    out = options
    for key, value in options.items():
        param = params.get(key)
        if param is None:
            if open_ended:
                continue
            close = close_matches(key, params)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            accepts = ", ".join(params) or "no options"
            raise OptionError(name, key, f"unknown option{hint}; {name!r} accepts: {accepts}",
                              f"plugin {name!r} got unknown option {key!r}{hint}; it accepts: {accepts}")
        if hints is None:
            hints = _hints(factory)
        hint = hints.get(key, Any)
        if value is None and param.default is None:
            continue
        checked = materialise(value, hint)
        if checked is not value:
            out = dict(out) if out is options else out
            out[key] = value = checked
        if not type_ok(value, hint):
            raise OptionError(name, key, f"expected {describe(hint, show)}, got {show(value)}")
    for key, param in params.items():
        if param.default is param.empty and key not in options:
            if hints is None:
                hints = _hints(factory)
            hint = hints.get(key, Any)
            what = "" if hint is Any else f" ({describe(hint, show)})"
            raise OptionError(name, key, f"required{what}, not given",
                              f"plugin {name!r} is missing its required option {key!r}{what}")
    return out


def check_dataclass_fields(obj) -> None:
    """A dataclass plugin's or sink's field values, checked against the fields' type hints
    as options are (``@dataclass`` makes ``__init__`` after ``__init_subclass__`` could wrap
    it, see :func:`check_constructor`; that ``__init__`` calls ``__post_init__``, which
    ``Plugin`` and ``Sink`` define to call this). Only the values: which arguments the class
    takes is its own ``__init__``'s business (a subclass may have another; InitVars are no
    fields). Values materialised by the check (a generator given for a sequence) are set
    back, also on a frozen dataclass."""
    cls = type(obj)
    if not dataclasses.is_dataclass(cls):
        return
    label = getattr(cls, "name", "") or cls.__name__
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - some class's hint cannot be resolved: the fields' own,
        hints = _hints(cls)  # as the dataclass-made __init__ has them
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if not f.init or hint is None or not hasattr(obj, f.name):
            continue
        value = getattr(obj, f.name)
        if value is None and f.default is None:
            continue
        checked = materialise(value, hint)
        if not type_ok(checked, hint):
            raise OptionError(label, f.name, f"expected {describe(hint)}, got {value!r}")
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def check_constructor(cls) -> None:
    """Make ``cls.__init__`` (when ``cls`` defines one) check its own arguments with
    :func:`check_options`, so a plugin or sink built directly (``StatsPlugin(bins="x")``)
    gets the same errors as one built by ``attach`` or a config file, and the same
    materialised values (a generator given for a sequence reaches ``__init__`` as a list). A
    call the signature refuses raises ``TypeError`` naming the class and the plugin, with
    ``check_options``' words for an unknown (a close match) or missing option."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_hookplug_checked", False):
        return
    sig = inspect.signature(init)
    named = [p.name for p in list(sig.parameters.values())[1:]
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        own = type(self)  # a subclass inheriting this __init__ is named as itself
        label = getattr(own, "name", "") or own.__name__
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError as exc:
            problem = str(exc)
            if not args:  # keywords only: say it as attach() does (an unknown or missing option)
                try:
                    check_options(label, cls, kwargs)
                except OptionError as err:
                    problem = str(err)
            raise TypeError(f"{own.__qualname__}(): {problem}"
                            + ("" if problem.startswith("plugin ") else f" (plugin {label!r})")) from None
        given = {n: bound.arguments[n] for n in named if n in bound.arguments}
        bound.arguments.update(check_options(label, cls, given))
        init(*bound.args, **bound.kwargs)

    __init__._hookplug_checked = True
    cls.__init__ = __init__
