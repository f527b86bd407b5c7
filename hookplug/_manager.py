"""Plugin discovery and construction through the ``hookplug.plugins`` entry-point group.

Entry points are read once, lazily; a plugin's module is imported only when a session asks
for it. First-party plugins (distribution ``hookplug``) register through the same group a
third party uses. ``HOOKPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` limits discovery to them.
"""
from __future__ import annotations

import difflib
import inspect
import os
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Dict, List, Optional

import pluggy

from . import hookspecs

__all__ = ["PluginError", "plugin_names", "plugin_info", "create_plugin", "new_plugin_manager"]

ENTRY_POINT_GROUP = "hookplug.plugins"
FIRST_PARTY_DIST = "hookplug"


class PluginError(ValueError):
    """An unknown plugin name, bad plugin options, or a plugin that breaks the contract."""


@dataclass
class PluginSource:
    """Where a plugin comes from, and what happened when it was loaded."""

    name: str
    distribution: str
    version: str
    entry_point: Any = field(repr=False)
    factory: Any = field(default=None, repr=False)
    error: Optional[str] = None

    @property
    def first_party(self) -> bool:
        return self.distribution == FIRST_PARTY_DIST

    @property
    def origin(self) -> str:
        if self.first_party:
            return "first-party"
        return f"{self.distribution} {self.version}".strip()

    def load(self):
        """Import the factory; on failure warn once, naming the distribution, and return None."""
        if self.factory is None and self.error is None:
            try:
                self.factory = self.entry_point.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin never stops the others
                self.error = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"hookplug plugin {self.name!r} from distribution {self.distribution!r} "
                    f"failed to import ({self.entry_point.value}): {self.error}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return self.factory


_sources: Optional[Dict[str, PluginSource]] = None


def _entry_points():
    eps = metadata.entry_points()
    if hasattr(eps, "select"):
        return list(eps.select(group=ENTRY_POINT_GROUP))
    return list(eps.get(ENTRY_POINT_GROUP, []))  # Python < 3.10


def _discover() -> Dict[str, PluginSource]:
    global _sources
    if _sources is not None:
        return _sources
    autoload = os.environ.get("HOOKPLUG_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
    found: Dict[str, PluginSource] = {}
    for ep in _entry_points():
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
        version = dist.version if dist is not None else ""
        src = PluginSource(ep.name, dist_name, version, ep)
        if not src.first_party and not autoload:
            continue
        prev = found.get(ep.name)
        if prev is not None and prev.distribution != src.distribution:
            keep, drop = (prev, src) if prev.first_party or not src.first_party else (src, prev)
            warnings.warn(
                f"hookplug plugin name {ep.name!r} is provided by both {prev.distribution!r} and "
                f"{src.distribution!r}; using the one from {keep.distribution!r}",
                RuntimeWarning,
                stacklevel=3,
            )
            src = keep
        found[ep.name] = src
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


def _check_options(name: str, factory, options: Dict[str, Any]) -> None:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for opt in options:
        if opt not in accepted:
            close = difflib.get_close_matches(opt, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(
                f"plugin {name!r} got unknown option {opt!r}{hint}; it accepts: "
                f"{', '.join(accepted) or 'no options'}"
            )


def create_plugin(name: str, options: Optional[Dict[str, Any]] = None):
    """Build the plugin registered under ``name`` with ``options``.

    Returns None (after one warning naming the distribution) when the plugin fails to
    import or to construct for a reason other than its options.
    """
    options = dict(options or {})
    if not isinstance(name, str):
        raise PluginError(f"a plugin name must be a str, got {type(name).__name__}")
    sources = _discover()
    src = sources.get(name)
    if src is None:
        close = difflib.get_close_matches(name, list(sources), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PluginError(
            f"unknown hookplug plugin {name!r}.{hint} Available: {', '.join(sources) or 'none'}"
        )
    factory = src.load()
    if factory is None:
        return None
    _check_options(name, factory, options)
    try:
        plugin = factory(**options)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"plugin {name!r} rejected its options {options!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001
        src.error = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"hookplug plugin {name!r} from distribution {src.distribution!r} failed to "
            f"construct: {src.error}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    if getattr(plugin, "name", None) is None:
        try:
            plugin.name = name
        except AttributeError:
            pass
    return plugin


def new_plugin_manager() -> pluggy.PluginManager:
    """A pluggy manager that knows the hookplug specs (one per session)."""
    pm = pluggy.PluginManager("hookplug")
    pm.add_hookspecs(hookspecs)
    return pm
