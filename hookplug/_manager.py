"""Plugin discovery and construction through the ``hookplug.plugins`` entry-point group.

Entry points are read once, lazily; a plugin's module is imported only when a session asks
for it. First-party plugins (distribution ``hookplug``) register through the same group a
third party uses; they are taken from the distribution this hookplug was installed from,
and another distribution named ``hookplug`` (earlier on ``sys.path``) is reported and
ignored. ``HOOKPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` limits discovery to them.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any, Dict, Iterator, List, Optional
from urllib.parse import unquote, urlparse

import pluggy

from . import hookspecs
from ._plugin import user_stacklevel

__all__ = ["PluginError", "PluginLoadError", "plugin_names", "plugin_info", "create_plugin",
           "new_plugin_manager"]

ENTRY_POINT_GROUP = "hookplug.plugins"
FIRST_PARTY_DIST = "hookplug"


class PluginError(ValueError):
    """An unknown plugin name, bad plugin options, or a plugin that breaks the contract."""


class PluginLoadError(PluginError):
    """A requested plugin that cannot be had: its import, or its factory, failed.

    ``attach(on_error="raise")`` raises it; ``on_error="warn"`` warns and goes on without."""


@dataclass
class PluginSource:
    """Where a plugin comes from, and what happened when it was loaded."""

    name: str
    distribution: str
    version: str
    entry_point: Any = field(repr=False)
    factory: Any = field(default=None, repr=False)
    error: Optional[str] = None
    #: from the distribution this hookplug was installed from (None: judged by name)
    own: Optional[bool] = field(default=None, repr=False)

    @property
    def first_party(self) -> bool:
        if self.own is not None:
            return self.own
        return self.distribution == FIRST_PARTY_DIST

    @property
    def origin(self) -> str:
        if self.first_party:
            return "first-party"
        return f"{self.distribution} {self.version}".strip()

    def load(self):
        """Import the factory once; return None when that failed (``error`` says why).

        ``SystemExit`` at import is a failure like any other: it never escapes."""
        if self.factory is None and self.error is None:
            pattern, value = getattr(self.entry_point, "pattern", None), getattr(self.entry_point, "value", None)
            if pattern is not None and isinstance(value, str) and not pattern.match(value):
                self.error = (f"the entry point's value {value!r} is malformed; write it as "
                              "'package.module:PluginClass'")  # (importlib: 'NoneType' ... 'group')
                return None
            try:
                factory = self.entry_point.load()
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - never stops the others
                self.error = f"{type(exc).__name__}: {exc}"
            else:
                if callable(factory):
                    self.factory = factory
                else:  # 'pkg.mod' with no ':attr' loads the module itself
                    what = "a module" if isinstance(factory, ModuleType) else f"a {type(factory).__name__}"
                    self.error = (f"it names {what}, not a plugin class or factory; write the entry "
                                  "point as 'package.module:PluginClass'")
        return self.factory

    def load_error(self) -> "PluginLoadError":
        return PluginLoadError(
            f"hookplug plugin {self.name!r} from distribution {self.distribution!r} failed to "
            f"import ({getattr(self.entry_point, 'value', '?')}): {self.error}"
        )


_sources: Optional[Dict[str, PluginSource]] = None


def _entry_points():
    """Every entry point of the group, each with its ``.dist``.

    As ``metadata.entry_points()``, a distribution found again later on ``sys.path`` (a stale
    copy: ``pip install --user`` beside a system one, an old site-packages copy beside an
    editable checkout) is left out: the copy Python imports is the first. Except ``hookplug``
    itself: every copy is kept, for :func:`_discover` to find the one being run (a stray
    ``hookplug`` earlier on the path would shadow it)."""
    if sys.version_info < (3, 10):  # no EntryPoint.dist: by name only
        return list(metadata.entry_points().get(ENTRY_POINT_GROUP, []))
    found, seen = [], set()
    for dist in metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        # (hookplug itself, or metadata without a name: told apart by location)
        key = (name, _location(dist)) if name in (FIRST_PARTY_DIST, "") else name
        if key in seen:  # the same directory twice on sys.path, or a shadowed copy
            continue
        seen.add(key)
        found.extend(ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
    return found


def _location(dist) -> str:
    try:
        return str(Path(dist.locate_file("")).resolve())
    except Exception:  # noqa: BLE001
        return "<unknown>"


def _is_own(dist) -> Optional[bool]:
    """Whether ``dist`` is the distribution this hookplug package was installed from: its
    files, or for an editable install its source tree, hold this very package. None when
    ``dist`` cannot say (no files to look at)."""
    if not hasattr(dist, "locate_file"):
        return None
    here = Path(__file__).resolve().parent
    try:
        if Path(dist.locate_file("hookplug/__init__.py")).resolve() == here / "__init__.py":
            return True
    except Exception:  # noqa: BLE001
        pass
    try:
        info = json.loads(dist.read_text("direct_url.json") or "null") or {}
        url = urlparse(info.get("url", ""))
        if url.scheme == "file" and (Path(unquote(url.path)) / "hookplug").resolve() == here:
            return True
    except Exception:  # noqa: BLE001
        pass
    return False


def _discover() -> Dict[str, PluginSource]:
    global _sources
    if _sources is not None:
        return _sources
    autoload = os.environ.get("HOOKPLUG_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
    eps = _entry_points()
    own: Dict[int, Optional[bool]] = {}
    for ep in eps:
        dist = getattr(ep, "dist", None)
        if dist is not None and dist.metadata["Name"] == FIRST_PARTY_DIST and id(dist) not in own:
            own[id(dist)] = _is_own(dist)
    have_own = any(v is not False for v in own.values())
    shadows: Dict[str, List[str]] = {}
    found: Dict[str, PluginSource] = {}
    for ep in eps:
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
        version = dist.version if dist is not None else ""
        src = PluginSource(ep.name, dist_name, version, ep, own=own.get(id(dist)))
        if src.own is False:
            # a distribution named hookplug that is not this hookplug
            src.distribution = f"{dist_name} at {_location(dist)}"
            if have_own:
                shadows.setdefault(src.distribution, []).append(ep.name)
                continue
        if not src.first_party and not autoload:
            continue
        prev = found.get(ep.name)
        if prev is not None and prev.distribution != src.distribution:
            keep, drop = (prev, src) if prev.first_party or not src.first_party else (src, prev)
            warnings.warn(
                f"hookplug plugin name {ep.name!r} is provided by both {prev.distribution!r} and "
                f"{src.distribution!r}; using the one from {keep.distribution!r}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
            src = keep
        found[ep.name] = src
    for where, names in shadows.items():
        warnings.warn(
            f"a distribution {where} is not the hookplug being run ({Path(__file__).resolve().parent}); "
            f"its plugin entry points ({', '.join(names)}) are ignored and the first-party plugins "
            "come from this hookplug's own distribution",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    _sources = dict(sorted(found.items()))
    return _sources


def _reset_discovery() -> None:
    """Forget what was discovered (tests monkeypatch entry points, then call this)."""
    global _sources
    _sources = None


def plugin_names() -> Dict[str, str]:
    """``{name: origin}`` of every available plugin; origin is ``"first-party"`` or the
    distribution and version that provides it."""
    return {name: src.origin for name, src in _discover().items()}


def plugin_info() -> List[PluginSource]:
    """Every discovered plugin with its distribution and, once loaded, its load error."""
    return list(_discover().values())


def check_plugin(name: str, options: Optional[Dict[str, Any]] = None) -> None:
    """Raise what :func:`create_plugin` would for an unknown name, a plugin that fails to
    import, or options its signature rejects, without building it (a trainer callback
    checks at its construction what it attaches later). Options holding a one-shot
    iterator are left to ``create_plugin`` (a check would consume it)."""
    options = dict(options or {})
    _factory(name, None if any(isinstance(v, Iterator) for v in options.values()) else options)


def _factory(name: str, options: Optional[Dict[str, Any]]):
    """``(source, factory, options checked against the factory's signature)`` (None: not
    checked)."""
    if not isinstance(name, str):
        raise PluginError(f"a plugin name must be a str, got {type(name).__name__}")
    sources = _discover()
    src = sources.get(name)
    if src is None:
        from ._options import close_matches

        bare, paren, rest = name.partition("(")
        if paren and rest.endswith(")") and bare.strip() in sources:
            raise PluginError(
                f"unknown hookplug plugin {name!r}: the 'name(option=value)' form is the "
                f"command line's (--plugins); in Python give "
                f"({bare.strip()!r}, {{'option': value}}) or {{{bare.strip()!r}: {{...}}}}")
        close = close_matches(name, sources)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PluginError(
            f"unknown hookplug plugin {name!r}.{hint} Available: {', '.join(sources) or 'none'}"
        )
    factory = src.load()
    if factory is None:
        raise src.load_error()
    from ._options import check_options

    return src, factory, options if options is None else check_options(name, factory, options)


def create_plugin(name: str, options: Optional[Dict[str, Any]] = None):
    """Build the plugin registered under ``name`` with ``options``.

    Raises :class:`PluginError` for an unknown name or options the plugin rejects (unknown,
    missing or mistyped ones; a TypeError/ValueError from the factory when options were
    given), and :class:`PluginLoadError` (naming the distribution) when the plugin fails to
    import or to construct (any other error, or any error with no options given), or its
    factory returns no plugin object (None, a class, an object with no hooks).
    """
    src, factory, options = _factory(name, dict(options or {}))
    try:
        plugin = factory(**options)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        if options and isinstance(exc, (TypeError, ValueError)):  # its own checks of their values
            raise PluginError(f"plugin {name!r} rejected its options {options!r}: {exc}") from exc
        # with no options given nothing can be wrong with them: a bug (or a missing resource)
        src.error = f"{type(exc).__name__}: {exc}"
        raise PluginLoadError(
            f"hookplug plugin {name!r} from distribution {src.distribution!r} failed to "
            f"construct: {src.error}"
        ) from exc
    got = _not_a_plugin(plugin)
    if got:
        src.error = f"its factory {getattr(src.entry_point, 'value', factory)!r} returned {got}"
        raise PluginLoadError(
            f"hookplug plugin {name!r} from distribution {src.distribution!r}: {src.error}; "
            "expected a plugin object (a hookplug.Plugin or hookplug.Sink instance, or any "
            "object with @hookplug.hookimpl methods)"
        )
    if getattr(plugin, "name", None) is None:
        try:
            plugin.name = name
        except AttributeError:
            pass
    return plugin


def _not_a_plugin(obj) -> str:
    """What ``obj`` is in words when a factory returned it but it is no plugin object (None, a
    class, an object with no hooks), else ''."""
    if obj is None:
        return "None"
    if isinstance(obj, type):
        return f"the class {obj.__name__}, not an instance of it"
    if is_plugin_object(obj):
        return ""
    return f"a {type(obj).__name__} with no @hookplug.hookimpl method"


def is_plugin_object(obj) -> bool:
    """Whether ``obj`` can be attached as a plugin: a ``Plugin`` or ``Sink``, or any object
    with a method marked ``@hookplug.hookimpl``."""
    from ._plugin import Plugin
    from ._sink import Sink

    return isinstance(obj, (Plugin, Sink)) or any(is_hookimpl(obj, attr) for attr in dir(obj))


def is_plugin_class(cls: type) -> bool:
    """Whether instances of ``cls`` would be plugin objects (see :func:`is_plugin_object`),
    judged without building one."""
    from ._plugin import Plugin
    from ._sink import Sink

    return issubclass(cls, (Plugin, Sink)) or any(is_hookimpl(cls, attr) for attr in dir(cls))


_MARKS = pluggy.PluginManager(hookspecs.hookimpl.project_name)  # no specs: reads @hookimpl marks only


def is_hookimpl(obj, attr: str) -> bool:
    """Whether ``obj``'s attribute ``attr`` is marked ``@hookplug.hookimpl``, read as pluggy
    reads it when registering ``obj`` (descriptors are not run)."""
    return _MARKS.parse_hookimpl_opts(obj, attr) is not None


def implements_hook(obj, hook: str) -> bool:
    """Whether ``obj`` has a ``@hookplug.hookimpl`` for ``hook``: a method of that name, or any
    method marked ``@hookimpl(specname=hook)``."""
    for attr in dir(obj):
        opts = _MARKS.parse_hookimpl_opts(obj, attr)
        if opts is not None and (opts.get("specname") or attr) == hook:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _hook_arguments() -> frozenset:
    """Every argument name of the hook specs (``ctx``, ``session``, ``output``, ...)."""
    return frozenset(p for name, f in vars(hookspecs).items() if name.startswith("hookplug_")
                     and callable(f) for p in inspect.signature(f).parameters)


def check_hook_methods(cls, inherited: bool = False) -> None:
    """Check the methods ``cls`` defines (and, with ``inherited``, those of its bases) with a
    hook's ``hookplug_`` prefix: one without ``@hookplug.hookimpl`` is never called (for a
    base's marked hook, the override switches it off), a warning naming it; a marked one
    written without ``self`` (``def hookplug_step(session, step)``) would get the plugin as
    its first argument, a TypeError. Called at class creation by ``Plugin`` and ``Sink``, at
    attach for other plugin objects."""
    for owner in (cls.__mro__[:-1] if inherited else (cls,)):
        for attr, value in vars(owner).items():
            if not (attr.startswith("hookplug_") and isinstance(value, (FunctionType, staticmethod, classmethod))):
                continue
            if value is not inspect.getattr_static(cls, attr, None):
                continue  # overridden below: the definition used is the one judged
            if not is_hookimpl(cls, attr):
                warnings.warn(
                    f"{owner.__module__}.{owner.__qualname__}.{attr} is named like a hookplug hook but is not "
                    "marked @hookplug.hookimpl, so hookplug never calls it: add @hookplug.hookimpl above it",
                    RuntimeWarning, stacklevel=user_stacklevel())
            elif isinstance(value, FunctionType):
                params = list(inspect.signature(value).parameters.values())
                first = params[0].name if params and params[0].kind in (
                    inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) else None
                if first in _hook_arguments():
                    raise TypeError(
                        f"{owner.__qualname__}.{attr}({', '.join(inspect.signature(value).parameters)}) "
                        f"has no self: as a method it would get the plugin as {first!r}; write "
                        f"def {attr}(self, {first}, ...) (or make it a @staticmethod)")


def new_plugin_manager() -> pluggy.PluginManager:
    """A pluggy manager that knows the hookplug specs (one per session)."""
    pm = pluggy.PluginManager("hookplug")
    pm.add_hookspecs(hookspecs)
    return pm
