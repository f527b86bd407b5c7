"""``Plugin``: an optional base class for hookplug plugins.

A plugin is any object with a ``name`` and methods marked ``@hookplug.hookimpl``; this base
only supplies the conventions a session relies on (``results``, ``reset``, ``report``).
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

__all__ = ["Plugin"]


def warn_once(seen: set, key: Hashable, message: Callable[[], str]) -> None:
    """A ``RuntimeWarning`` at the user's line (``user_stacklevel``) the first time ``key``
    is met (``seen`` keeps the keys met); ``message()`` is built only then."""
    if key not in seen:
        seen.add(key)
        warnings.warn(message(), RuntimeWarning, stacklevel=user_stacklevel())


_OWN_PACKAGES = ("hookplug", "hookplug_plugins", "torch")


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning our caller gives that names the user's line: the
    first frame outside hookplug, its first-party plugins and torch (dynamo's ``disable``
    wrappers the session methods run through, ``Module.__call__`` and ``backward()`` around
    a hook), where a fixed count named hookplug's or torch's own code. Inside code dynamo
    traces: 2 (it cannot trace the frame walk, and says so in a warning of its own)."""
    if _tracing():
        return 2
    return _user_frame(sys._getframe(1))[0]


def _tracing() -> bool:
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _user_frame(frame, unless: Tuple[str, ...] = ()):
    """``(stacklevel, frame)`` of the first frame from ``frame`` outside hookplug, its
    plugins and torch (see :func:`user_stacklevel`); None where a frame on the way is in a
    module under one of ``unless``. Not inside code dynamo traces (it cannot trace the walk)."""
    level = 1
    while frame.f_back is not None:
        module = frame.f_globals.get("__name__", "")
        if unless and module.startswith(unless):
            return None
        if not any(module == p or module.startswith(p + ".") for p in _OWN_PACKAGES):
            break
        frame, level = frame.f_back, level + 1
    return level, frame


def user_site(unless: Tuple[str, ...] = ()) -> Optional[Tuple[str, int]]:
    """``(file, line)`` of the frame :func:`user_stacklevel` names; None inside traced code,
    or where a caller on the way is in a module under one of ``unless``."""
    found = None if _tracing() else _user_frame(sys._getframe(1), unless)
    return None if found is None else (found[1].f_code.co_filename, found[1].f_lineno)


def plugin_off(plugin, session) -> bool:
    """Whether ``session`` (None: gone) no longer runs ``plugin``: removed, or the plugin
    disabled by an error under ``on_error="warn"``. For a plugin's code that torch calls
    directly (optimizer step hooks, a dispatch mode, ops run by compiled code)."""
    if session is None or session.removed:
        return True
    entry = session._entry_of.get(id(plugin))
    return entry is not None and entry.disabled is not None


def plugin_failed(plugin, session, where: str, exc: Exception) -> None:
    """An error of ``plugin`` in code torch calls directly, through ``session``'s
    ``on_error``: raised with a note under "raise", else one warning and the plugin off
    from then on; raised as it is without a live session."""
    if session is None or session.removed:
        raise exc
    session._plugin_failed(plugin, where, exc)


class Plugin:
    """Base class: subclasses set ``name`` and implement hooks from ``hookplug.hookspecs``."""

    name: str = ""
    #: ``attach(..., every=N)`` calls the plugin on sampled steps only; a plugin that must
    #: act on every step (gradient steering) sets this to False.
    sampled: bool = True
    #: Inside ``torch.compile``d code the session's hooks are traced by dynamo, and contexts
    #: carry no per-call Python state (``call_index`` -1). A plugin that keeps Python state
    #: per call (capture) sets this to False: where it is attached, the hooks run outside
    #: the graph (a graph break per hooked call) exactly as in eager code.
    traceable: bool = True
    #: The plugin works on the parameters of its modules (as ``params`` does; a plugin with
    #: ``hookplug_param_grad`` does in any case): a module with parameters put under one of
    #: them after attach, which it does not cover, is warned about at the first step.
    watches_parameters: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        from ._manager import check_hook_methods
        from ._options import check_constructor

        check_constructor(cls)  # options of an instance built directly are checked too
        check_hook_methods(cls)  # unmarked hooks (never called), hooks without self

    def __post_init__(self, *init_vars) -> None:
        """A ``@dataclass`` plugin's fields are checked as options are (a dataclass that
        defines its own ``__post_init__`` calls ``super().__post_init__()`` for that)."""
        from ._options import check_dataclass_fields

        check_dataclass_fields(self)
        after = getattr(super(), "__post_init__", None)  # (a dataclass mixin after this base)
        if after is not None:
            after(*init_vars)

    def results(self) -> Dict[str, Any]:
        """Results keyed by qualified module name."""
        return {}

    def reset(self) -> None:
        """Forget what was gathered so far."""

    def report(self) -> str:
        """A plain-text section for ``session.report()`` (empty: no section)."""
        return ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
