"""``attach`` and ``Session``: plugins bound to the modules a selector picks.

pluggy is consulted once, at attach time: for every selected module and every per-call hook
spec we keep a tuple of ``(plugin, bound method)`` in plugin order, and register a torch
hook only where that tuple is non-empty. The torch hooks (``hookplug._binding``) then loop
over plain tuples.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import copyreg
import difflib
import functools
import inspect
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

import pluggy
import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from . import hookspecs
from ._bank import ON_COMPILE_START, _is_compiling, dynamo_disable, unmaterialized
from ._binding import (_EAGER_RUNNERS, HookContext, _Materialize, _ModuleBinding, _ParamBinding, _Rehook, _eager_reason,
                       _get_ident, _make_eager_runner, fsdp2_owners)
from ._checkpoint import RecomputeMatcher
from ._compile_guards import _RECOMPILE_LIMIT, _guard_module_hooks
from ._config import _records_given, attach_options
from ._manager import (PluginError, PluginLoadError, check_plugin, create_plugin, implements_hook, is_plugin_object,
                       new_plugin_manager, check_hook_methods)
from ._options import is_int_at_least
from ._pipelining import patch_pipelining
from ._plugin import Plugin, user_site, user_stacklevel
from .structures import iter_tensors
from ._sink import Sink
from ._selectors import (check_strict, named_modules, parse_selector, named_parameters, parameter_owners, qualified, ddp_wrapper,
                         select_terms, unwrap_model, warn_never_called)

__all__ = ["attach", "Session", "HookContext"]

_PER_CALL_HOOKS = (
    "hookplug_forward_input",
    "hookplug_forward_output",
    "hookplug_output_grad",
    "hookplug_param_grad",
)
_HOOK_NAMES = tuple(n for n in vars(hookspecs) if n.startswith("hookplug_"))
_SPEC_ARGS = {
    name: tuple(getattr(hookspecs, name).__code__.co_varnames[: getattr(hookspecs, name).__code__.co_argcount])
    for name in _HOOK_NAMES
}
_ON_ERROR = ("raise", "warn")
_NONFINITE_KEPT = 10_000  # session.nonfinite keeps the latest entries
# always_call (torch >= 2.1): the post hook also runs when forward raises, so per-call
# state (ours and the plugins') unwinds.
_POST_HOOK_KWARGS = {"with_kwargs": True}
if "always_call" in inspect.signature(nn.Module.register_forward_hook).parameters:
    _POST_HOOK_KWARGS["always_call"] = True


def _raise_noted(exc: BaseException, plugin_name: str, where: str):
    """Raise ``exc`` (a plugin's error under ``on_error="raise"``) with a note naming the
    plugin and the hook or method it came from."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised by hookplug plugin {plugin_name!r} in {where})")
    raise exc


# -- plugin specs --------------------------------------------------------------------------

PluginSpec = Union[str, Any, Tuple[str, Dict[str, Any]], List[Any], Dict[str, Dict[str, Any]]]


def _normalize_specs(spec: PluginSpec, what: str = "plugins") -> List[Tuple[str, Dict[str, Any], Any]]:
    """Every accepted form as ``[(name, options, instance_or_None), ...]``."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return [(spec, {}, None)]
    if isinstance(spec, dict):
        out = []
        for name, opts in spec.items():
            if opts is not None and not isinstance(opts, dict):
                raise PluginError(
                    f"{what}={{...}}: options of {name!r} must be a dict or None, got {type(opts).__name__}"
                )
            out.append((name, dict(opts or {}), None))
        return out
    if (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], dict) and spec[1]
            and not all(v is None or isinstance(v, dict) for v in spec[1].values())
            and not isinstance(spec[0], (str, type)) and is_plugin_object(spec[0])):
        raise PluginError(
            f"{what}=: {_short(spec[0])} is an instance, built with its options already: give "
            f"them to its constructor ({type(spec[0]).__name__}(...)); (name, {{options}}) pairs "
            "are for registered names")
    if isinstance(spec, tuple) and len(spec) >= 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
        if len(spec) != 2:
            raise PluginError(f"{what}: a spec tuple is (name, options), got a tuple of {len(spec)} "
                              f"items: {_short(spec)}")
        return [(spec[0], dict(spec[1]), None)]
    if isinstance(spec, (list, tuple)):
        for prev, sub in zip(spec, spec[1:]):
            if (isinstance(prev, str) and isinstance(sub, dict) and sub
                    and not all(v is None or isinstance(v, dict) for v in sub.values())):
                # [name, {options}]: a pair JSON or YAML gives as a list, not {name: options}
                raise PluginError(
                    f"{what}=[...]: {_short(sub)} after {prev!r} holds options, not plugins; write "
                    f"the pair as a tuple ({prev!r}, {{...}}) or a dict {{{prev!r}: {{...}}}}")
        return [item for sub in spec for item in _normalize_specs(sub, what)]
    if isinstance(spec, type):
        raise PluginError(f"{what}= got the class {spec.__name__}; pass an instance or a registered name")
    if not is_plugin_object(spec):
        hint = (f"; pass a list ({'sinks' if what == 'sink' else 'plugins'} run in list order)"
                if isinstance(spec, (set, frozenset)) else "")
        unmarked = [a for a in dir(type(spec)) if a.startswith("hookplug_") and callable(getattr(spec, a, None))]
        if unmarked:
            hint += (f"; it has {', '.join(unmarked)} but no method marked @hookplug.hookimpl: "
                     "add @hookplug.hookimpl above each hook")
        raise PluginError(
            f"{what}= takes a plugin name, (name, {{options}}), a list of these, a dict {{name: options}} "
            "or a plugin instance (a hookplug.Plugin or hookplug.Sink, or any object with "
            f"@hookplug.hookimpl methods); got {type(spec).__name__} {_short(spec)}{hint}")
    if not isinstance(spec, (Plugin, Sink)):  # (their classes were checked when defined)
        check_hook_methods(type(spec), inherited=True)
    name = getattr(spec, "name", None) or type(spec).__name__
    return [(name, {}, spec)]


def _same_form(value):
    """``value`` with its lists as tuples, to compare options given once as a list and once
    as a tuple (equal options)."""
    if isinstance(value, dict):
        return {k: _same_form(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_same_form(v) for v in value)
    return value


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- plugin hooks as the bindings call them ---------------------------------------------------

def _check_parameters(plugin_name: str, hook_name: str, fn) -> None:
    """A hook's function is given the spec's arguments it names as plain parameters (pluggy
    leaves the others out of its argument names): a keyword-only one without a default
    would fail at the first call (refused); ``*args``/``**kwargs`` get nothing (a warning)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin: pluggy read what it could
        return
    spec = ", ".join(_SPEC_ARGS[hook_name])
    defaulted = [p.name for p in params if p.name in _SPEC_ARGS[hook_name]
                 and p.default is not p.empty]
    if defaulted:  # pluggy passes only parameters without a default: it would get the default
        raise PluginError(
            f"hookplug plugin {plugin_name!r}: {hook_name} gives the spec argument(s) "
            f"{', '.join(defaulted)} a default, so they would never be passed (pluggy passes "
            f"only parameters without one); drop the default, from ({spec})")
    required = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if required:
        raise PluginError(
            f"hookplug plugin {plugin_name!r}: {hook_name} takes the keyword-only argument(s) "
            f"{', '.join(required)}, which hooks are never given; name the spec's arguments it "
            f"uses as plain parameters, from ({spec})")
    star = [("*" if p.kind is p.VAR_POSITIONAL else "**") + p.name for p in params
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if star:
        warnings.warn(
            f"hookplug plugin {plugin_name!r}: {hook_name}'s {', '.join(star)} receive nothing: a "
            f"hook is given the spec's arguments it names as plain parameters, from ({spec})",
            RuntimeWarning, stacklevel=user_stacklevel())


def _adapt(impl, hook_name: str) -> Callable:
    """The plugin's bound method, called positionally with the spec's arguments."""
    if impl.hookwrapper or getattr(impl, "wrapper", False):
        raise PluginError(
            f"plugin {impl.plugin_name!r}: {hook_name} is called on the hot path and cannot be "
            "a hookwrapper/wrapper; implement it as a plain hook"
        )
    spec_args = _SPEC_ARGS[hook_name]
    wanted = tuple(impl.argnames)
    fn = impl.function
    if wanted == spec_args:
        return fn
    unknown = [a for a in wanted if a not in spec_args]
    if unknown:
        raise PluginError(
            f"plugin {impl.plugin_name!r}: {hook_name} takes unknown argument(s) {unknown}; "
            f"the spec offers {list(spec_args)}"
        )
    idx = [spec_args.index(a) for a in wanted]
    # one lambda frame, no list (0.11 us a call against 0.42 us); dynamo traces it, not itemgetter
    if len(idx) == 1:
        i0, = idx
        return lambda *a: fn(a[i0])
    if len(idx) == 2:
        i0, i1 = idx
        return lambda *a: fn(a[i0], a[i1])
    if len(idx) == 3:
        i0, i1, i2 = idx
        return lambda *a: fn(a[i0], a[i1], a[i2])
    return lambda *a: fn(*[a[i] for i in idx])


# exceptions that end an iteration, not a run: remove() in their handler is a normal end
_NOT_FAILURES = (StopIteration, StopAsyncIteration, GeneratorExit)


class _teardown_behind:
    """Cleanup run while ``primary`` propagates (a ``with`` block that raised, a failed
    attach): an error of the cleanup (a sink's last write, a plugin's ``session_end``) is
    a warning and a note on ``primary``, which goes on: it would replace it otherwise, and
    the caller's ``except`` for it would miss it."""

    def __init__(self, primary: BaseException):
        self.primary = primary

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, err, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        text = f"hookplug: removing the session failed as well: {exc_type.__name__}: {err}"
        if hasattr(self.primary, "add_note"):
            self.primary.add_note(f"({text})")
        try:
            warnings.warn(text, RuntimeWarning, stacklevel=user_stacklevel())
        except Warning:  # warnings turned into errors: primary still goes on, noted
            pass
        return True  # primary is the error to raise


def _failing(exc_type) -> bool:
    """``remove()`` with ``exc_type`` propagating or being handled ends a failing run."""
    return exc_type is not None and not issubclass(exc_type, _NOT_FAILURES)


_SESSION_CALL = ("a hookplug Session method (step, flush, remove) called from compiled code runs as "
                 "eager code, outside the graph: a graph break, which torch.compile(fullgraph=True) "
                 "forbids; call it outside the compiled function")


def _eager(method):
    """A session method called from code dynamo traces (a whole training step compiled,
    ``session.step()`` in it) runs as eager code, outside the graph (one graph break):
    dynamo traced the session's Python (its lock, the snapshot, the flush), ten graph
    breaks and recompiles of hookplug's own functions. Once dynamo is imported, every call
    goes through the ``torch.compiler.disable``'d runner (made outside the trace: at the
    first eager call, at attach or at a compile start): a check of ``is_compiling()`` is
    not enough, dynamo runs a frame whose graph break comes first as plain code, with its
    frame hook still on for the calls."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        runner = _EAGER_RUNNERS.get(_SESSION_CALL)
        if runner is None:
            if _is_compiling() or dynamo_disable() is None:
                return method(self, *args, **kwargs)
            runner = _make_eager_runner(_SESSION_CALL)
        return runner(functools.partial(method, self, *args, **kwargs))

    return run


ON_COMPILE_START.append(functools.partial(_make_eager_runner, _SESSION_CALL))


# -- copies of the model ------------------------------------------------------------------------

class _HookFreeState:
    """Set as ``module.__getstate__`` (an instance attribute) while hookplug hooks are on
    ``module``: ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` all take a
    module's state from it, so a copy carries no hookplug hook (and no session with it).

    ``hook_ids`` are the ids of the hookplug handles on the module (every session's); the
    entries under those ids are left out of every hook dict of the copied state."""

    __slots__ = ("module_ref", "hook_ids", "__weakref__")

    def __init__(self, module: nn.Module):
        self.module_ref = weakref.ref(module)
        self.hook_ids: set = set()

    def __call__(self):
        module = self.module_ref()
        state = type(module).__getstate__(module)
        if state is module.__dict__:
            state = dict(state)
        elif not isinstance(state, dict):
            # a class's own state (quantized convs' tuple of fields): no hook dict in it
            return state
        return self.without_hooks(state)

    def without_hooks(self, state: dict) -> dict:
        """``state`` (a module's ``__dict__`` or a copy, changed in place) without the guards
        and the entries under ``hook_ids``. A handle kept in the state (a lazy module's
        ``_initialize_hook``, a user's ``self.h = self.register_forward_hook(...)``) on a
        hook dict left this way points at the copy's dict: copied as it was, its state is
        the module's dict with hookplug's hooks, copied again beside the filtered one."""
        for name in _GUARDS:
            state.pop(name, None)
        ids = self.hook_ids
        filtered: Dict[int, dict] = {}  # id of a hook dict of the module -> the copy's
        for key, value in list(state.items()):
            if isinstance(value, dict) and "hook" in key and not ids.isdisjoint(value):
                state[key] = filtered[id(value)] = type(value)(
                    (k, v) for k, v in value.items() if k not in ids)
        if filtered:
            for key, value in list(state.items()):
                if isinstance(value, RemovableHandle):
                    state[key] = _on_filtered(value, filtered)
                elif type(value) in (list, tuple) and any(isinstance(v, RemovableHandle) for v in value):
                    # (exactly: a namedtuple or a list subclass is built otherwise; left as it is)
                    state[key] = type(value)(_on_filtered(v, filtered) if isinstance(v, RemovableHandle)
                                             else v for v in value)
        return state


def _on_filtered(handle: RemovableHandle, filtered: Dict[int, dict]) -> RemovableHandle:
    """``handle``, or a handle of the same id on the filtered copies of its hook dicts."""
    hooks = handle.hooks_dict_ref()
    extras = [ref() for ref in handle.extra_dict_ref]
    if id(hooks) not in filtered and not any(id(d) in filtered for d in extras):
        return handle
    copy_ = RemovableHandle.__new__(RemovableHandle)
    copy_.id = handle.id
    copy_.hooks_dict_ref = weakref.ref(filtered.get(id(hooks), hooks)) if hooks is not None else handle.hooks_dict_ref
    copy_.extra_dict_ref = tuple(weakref.ref(filtered.get(id(d), d)) for d in extras if d is not None)
    return copy_


class _HookFreeCall:
    """Set as ``module.__deepcopy__`` and ``module.__reduce_ex__`` (instance attributes, which
    ``copy`` and ``pickle`` look up first) beside :class:`_HookFreeState`. Where the module's
    class has no such method the default protocol runs (it reads ``__getstate__``); where it
    has one of its own, one that copies ``__dict__`` whole and never reads ``__getstate__``
    (also a class swapped in after attach): ``torch.nn.utils.parametrize``'s ``__deepcopy__`` (``weight_norm``,
    ``spectral_norm``, ``orthogonal``), ``torch.fx.GraphModule``'s ``__deepcopy__`` and
    ``__reduce__``. The class's method runs with the module's ``__dict__`` swapped, for the
    call, for one without hookplug's hooks and guards (a forward on another thread during
    that call runs unobserved). ``__deepcopy__``, where the class has none, takes the route
    ``copy.deepcopy`` would take after it: a ``copyreg`` reducer, the class's
    ``__reduce_ex__``/``__reduce__``, else the default reading ``__getstate__``. A class's
    ``__getstate__`` returning something other than a dict (quantized convs' tuple) holds no
    hook dict and is left as it is."""

    __slots__ = ("guard", "method")

    def __init__(self, guard: _HookFreeState, method: str):
        self.guard = guard
        self.method = method

    def __call__(self, *args):
        module = self.guard.module_ref()
        cls = type(module)
        own = _own_copy_methods(cls)
        if self.method in own:
            return self._hook_free(module, getattr(cls, self.method), *args)
        if self.method == "__reduce_ex__":
            # the class has none (now; parametrize swaps the class after attach): the
            # default protocol, which reads the hook-free __getstate__ (the module left
            # untouched: another thread may copy or remove() it meanwhile)
            return object.__reduce_ex__(module, *args)
        # __deepcopy__ where the class has none: what copy.deepcopy does after it (this
        # guard is found before them): a copyreg reducer, the class's __reduce_ex__, else
        # the default one reading the hook-free __getstate__
        memo = args[0] if args else {}
        reductor = copyreg.dispatch_table.get(cls)
        if reductor is not None:
            rv = self._hook_free(module, reductor)
        elif "__reduce_ex__" in own:
            rv = self._hook_free(module, cls.__reduce_ex__, 4)
        else:
            rv = object.__reduce_ex__(module, 4)
        if isinstance(rv, str):  # (a global: copied as itself, as copy.deepcopy does)
            return module
        if len(rv) > 2 and isinstance(rv[2], dict):
            rv = (*rv[:2], _SeedingState(module, rv[2]), *rv[3:])
        return copy._reconstruct(module, memo, *rv)

    def _hook_free(self, module, method, *args):
        """``method(module, *args)`` with the module's ``__dict__`` swapped, for the call,
        for one without hookplug's hooks and guards."""
        saved = module.__dict__
        object.__setattr__(module, "__dict__", self.guard.without_hooks(dict(saved)))
        try:
            return method(module, *args)
        finally:
            object.__setattr__(module, "__dict__", saved)


class _SeedingState(dict):
    """A module's hook-free state (see ``_HookFreeState``) as ``copy._reconstruct`` deep-copies
    it, after it put the module's copy in ``memo``: first each filtered hook dict is copied
    and that copy stands in ``memo`` for the module's own dict too, so a handle on the
    module's dict kept anywhere in the model (a parent's ``self.h =
    self.fc.register_forward_hook(...)``, a child's, one in a dict attribute), copied before
    or after, removes the hook from the copy's dict, as without a session."""

    def __init__(self, module: nn.Module, state: dict):
        super().__init__(state)
        own = module.__dict__
        self.pairs = [(own[k], v) for k, v in state.items()
                      if isinstance(v, dict) and isinstance(own.get(k), dict) and own[k] is not v]

    def __deepcopy__(self, memo):
        for own, value in self.pairs:
            copied = memo.get(id(own))
            if isinstance(copied, dict):  # copied already, through such a handle: filtered
                for k in [k for k in copied if k not in value]:
                    del copied[k]
            else:
                copied = memo[id(own)] = type(value)()
                copy._keep_alive(own, memo)
            memo[id(value)] = copied
            copy._keep_alive(value, memo)
            for k, v in value.items():
                if k not in copied:
                    copied[k] = copy.deepcopy(v, memo)
        return {copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()}


# the instance attributes that keep hookplug's hooks out of copies and pickles of a module
_GUARDS = ("__getstate__", "__deepcopy__", "__reduce_ex__")


def _own_copy_methods(cls) -> List[str]:
    """The methods of ``cls`` through which ``copy``/``pickle`` would bypass
    ``__getstate__`` (see :class:`_HookFreeCall`)."""
    out = []
    if getattr(cls, "__deepcopy__", None) is not None:
        out.append("__deepcopy__")
    if cls.__reduce__ is not object.__reduce__ or cls.__reduce_ex__ is not object.__reduce_ex__:
        out.append("__reduce_ex__")
    return out


# The (pre, post) hook ids of a model's sessions, in attach order, each True while free (its
# session removed): a module compiled with a session's hooks guards on their ids, so a
# session attached again must get the same ids to run the graphs compiled for the last one
# (no recompile per attach). A model's session takes the first free pair of that model (two
# sessions alive together keep theirs whatever order they are removed in), else fresh ids:
# never another model's (that model's next session would find them taken).
_HOOK_IDS_OF: "weakref.WeakKeyDictionary[nn.Module, Dict[Tuple[int, int], bool]]" = weakref.WeakKeyDictionary()


# Each live session of a model, with where (file, line) and with what (selector, plugins,
# sink) it was attached: the same attach again from the same place while that session is not
# removed is a re-run notebook cell or a loop reassigning ``s = attach(...)``, and the old
# session, unreachable, would run for good. (Sessions attached from one place with other
# selectors or plugins, e.g. two trainer callbacks, are meant to run together.)
_ATTACHED_AT: "weakref.WeakKeyDictionary[nn.Module, List[Tuple[weakref.ref, Any]]]" = weakref.WeakKeyDictionary()


def _spec_key(value: Any, depth: int = 0) -> Any:
    """A comparable stand-in for an attach argument: plain values as they are, containers
    item by item, any other object (a plugin instance: a new one each re-run) by its type
    and its public attributes (its options, mostly), down to a few levels."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if depth > 3:
        return ("deep", type(value).__qualname__)
    if isinstance(value, dict):
        return ("dict", tuple((_spec_key(k, depth + 1), _spec_key(v, depth + 1)) for k, v in list(value.items())[:64]))
    if isinstance(value, (list, tuple, set, frozenset)):
        return ("seq", tuple(_spec_key(v, depth + 1) for v in list(value)[:64]))
    attrs = getattr(value, "__dict__", None) or {}
    return ("object", type(value).__qualname__,
            tuple((k, _spec_key(v, depth + 1)) for k, v in sorted(attrs.items()) if not k.startswith("_")))


def _attached_again(model: nn.Module, what: Any) -> Any:
    """Warn where ``model`` has a live session attached from the caller's place with the same
    ``what``; returns the key to note once this one is attached."""
    # (a trainer callback or the CLI: each manages its own sessions)
    site = user_site(unless=("hookplug.integrations", "hookplug.cli"))
    if site is None:
        return None
    key = (site, _spec_key(what))
    if any(at == key and ref() is not None and not ref()._removed
           for ref, at in _ATTACHED_AT.get(model, ())):
        warnings.warn(
            f"hookplug: attach() again at {os.path.basename(site[0])}:{site[1]} on this "
            f"{type(model).__name__}, whose session attached there with the same selector and "
            "plugins is not removed (a re-run notebook cell, a loop reassigning the session?): "
            "both sessions run (the old one's hooks stay, still recording and steering). Call "
            "remove() on the old session, or use `with hookplug.attach(...) as s:`",
            RuntimeWarning, stacklevel=user_stacklevel())
    return key


def _note_attached_at(model: nn.Module, session: "Session", key: Any) -> None:
    live = [(ref, at) for ref, at in _ATTACHED_AT.get(model, ())
            if ref() is not None and not ref()._removed]
    if key is not None:
        live.append((weakref.ref(session), key))
    _ATTACHED_AT[model] = live


def _new_hook_ids(model: nn.Module) -> Tuple[Tuple[int, int], Dict[Tuple[int, int], bool]]:
    """Two ids from torch's hook-handle counter that no live handle has, and the table of
    ``model``'s pairs to give them back to (see _HOOK_IDS_OF)."""
    pairs = _HOOK_IDS_OF.setdefault(model, {})
    ids = next((pair for pair, free in pairs.items() if free), None)
    if ids is None:
        first = RemovableHandle.next_id
        RemovableHandle.next_id = first + 2
        ids = (first, first + 1)
    pairs[ids] = False
    return ids, pairs


def _shared_id(handle, hook_id: int):
    """``handle``'s hook moved to ``hook_id``, the id a session gives all its modules' hooks
    of one kind. Traced module calls guard on the ids of their hooks (dynamo checks
    ``hook_id in module._forward_hooks_always_called``): with an id per module, identical
    hooked blocks could never share a graph (``block.compile()``, regional compilation)."""
    old = handle.id
    for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
        d = ref()
        if d is not None and old in d:
            d[hook_id] = d.pop(old)  # the hook was the last one in: it stays last
    handle.id = hook_id
    return handle


def _guard_copies(module: nn.Module, handle) -> None:
    """Leave the hook behind ``handle`` out of copies and pickles of ``module``."""
    guard = module.__dict__.get("__getstate__")
    if guard is None:
        guard = module.__dict__["__getstate__"] = _HookFreeState(module)
        # both, whatever the class has now: a parametrization registered after attach gives
        # the module a class with a __deepcopy__ of its own (see _HookFreeCall)
        for method in ("__deepcopy__", "__reduce_ex__"):
            if method not in module.__dict__:  # (a user's own is left alone)
                module.__dict__[method] = _HookFreeCall(guard, method)
    if isinstance(guard, _HookFreeState):  # a user's own instance __getstate__ is left alone
        guard.hook_ids.add(handle.id)


def _unguard_copies(module: nn.Module, hook_id: int) -> None:
    guard = module.__dict__.get("__getstate__")
    if isinstance(guard, _HookFreeState):
        guard.hook_ids.discard(hook_id)
        if not guard.hook_ids:
            del module.__dict__["__getstate__"]
            for method in _GUARDS[1:]:
                call = module.__dict__.get(method)
                if isinstance(call, _HookFreeCall) and call.guard is guard:
                    del module.__dict__[method]


# -- interpreter exit ----------------------------------------------------------------------------

# attached sessions with a sink, not removed yet: removed at interpreter exit
_UNREMOVED: "weakref.WeakSet[Session]" = weakref.WeakSet()
_AT_EXIT: List[Callable] = []  # the atexit handler, once registered


def _flush_at_exit(session: "Session") -> None:
    """Have ``session`` removed at interpreter exit if it is still attached then."""
    _UNREMOVED.add(session)
    if not _AT_EXIT:
        _AT_EXIT.append(_remove_at_exit)
        atexit.register(_remove_at_exit)


def exit_flush_first() -> None:
    """Have the exit flush run before the atexit handlers registered so far (atexit runs the
    last registered first): a sink calls it once it uses a service that tears itself down
    at exit (a ``wandb`` run started after ``attach``), so its last steps still reach it."""
    if _AT_EXIT:
        atexit.unregister(_remove_at_exit)
        atexit.register(_remove_at_exit)


def _remove_at_exit() -> None:
    """At interpreter exit, every session of this process that has a sink and was never
    removed is removed as a failing rank's is (a local flush, no collective: the other
    ranks may be gone), with a warning, so its last steps reach its sinks."""
    for session in list(_UNREMOVED):
        if session._removed or session._pid != os.getpid():  # a forked child's copy: not its own
            continue
        warnings.warn(f"hookplug: session {session.run_id} was never removed; flushing its "
                      "telemetry at exit", RuntimeWarning, stacklevel=1)
        try:
            session._remove(failed=True)
        except Exception as exc:  # noqa: BLE001 - the other sessions still get theirs
            warnings.warn(f"hookplug: the exit flush of session {session.run_id} failed: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)


# -- the session ---------------------------------------------------------------------------------

class _Entry:
    """One plugin or sink of a session: its name, the object, the modules it is attached to,
    whether it was disabled (and why), and its pluggy hook implementations."""

    __slots__ = ("name", "plugin", "modules", "is_sink", "disabled", "impls", "adapted", "params",
                 "module_ids")

    def __init__(self, name: str, plugin, modules: List[str], is_sink: bool):
        self.name = name
        self.plugin = plugin
        self.modules = modules
        self.is_sink = is_sink
        self.disabled: Optional[str] = None  # the error that switched it off (on_error="warn")
        self.impls: Dict[str, Any] = {}  # hook name -> pluggy HookImpl
        self.adapted: Dict[str, Callable] = {}  # per-call hook name -> the callable the core calls
        self.params: Optional[set] = None  # parameter names under its modules (computed once)
        self.module_ids: Optional[set] = None  # ids of the modules under them (computed once)


# plugin instances (not sinks) in a session not removed yet: id -> that session, weakly (the
# entry of a session dropped without remove() leaves with it)
_IN_USE: "weakref.WeakValueDictionary[int, Session]" = weakref.WeakValueDictionary()
_IN_USE_LOCK = threading.Lock()


def _check_session_options(every, on_error, flush_every, start_step, distributed) -> None:
    if on_error not in _ON_ERROR:
        raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
    if not is_int_at_least(every, 1):
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    if flush_every is not None and not is_int_at_least(flush_every, 1):
        raise ValueError(f"flush_every must be None or an int >= 1, got {flush_every!r}")
    if not is_int_at_least(start_step, 0):
        raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}")


class Session:
    """Plugins attached to a model. A context manager; ``remove()`` takes every hook off.

    ``session[name]`` is a plugin; ``session.modules`` the selected ``{name: module}``;
    ``results()``, ``report()``, ``step()`` and ``flush()`` act on every plugin.
    """

    def __init__(self, model: nn.Module, *, every: int = 1, on_error: str = "raise",
                 flush_every: Optional[int] = None, start_step: int = 0,
                 distributed: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach() expects a torch.nn.Module, got {type(model).__name__}")
        _check_session_options(every, on_error, flush_every, start_step, distributed)
        # False: this session never communicates (attached on some ranks only); its
        # records hold this rank's statistics, and every sink it has gets them
        self.distributed = distributed
        self._model_ref = weakref.ref(model)
        self._self_ref = weakref.ref(self)  # what hook contexts hold (see HookContext)
        # the process group of a DistributedDataParallel the model was attached through: the
        # ranks holding replicas of its plain parameters (None: the world)
        self._replica_group = None
        self._ddp_ref = None  # that DistributedDataParallel (its Join blocks: see _join_block)
        self.every = every
        self.on_error = on_error
        self.flush_every = flush_every
        # the number of the step in progress; sampling (every=N) follows it from the first
        # step on: the same rule on every rank, no communication
        self._step = start_step
        self._steps_done = 0  # step() calls (flush_every counts these)
        # the step in progress runs an evaluation only (a trainer's evaluation before training,
        # HF eval_on_start): plugins measuring the training step record nothing for it
        self._evaluation_only = False
        self._last_ended: Optional[int] = None  # the number of the step that ended last
        self._backwards_warned = False
        self._replaced_warned: set = set()  # selected modules warned of as gone from the model
        self._sampling = start_step % every == 0
        self._nonfinite: Deque[dict] = collections.deque(maxlen=_NONFINITE_KEPT)
        self._removed = False
        self._not_started: set = set()  # plugins whose session_start a failed attach never ran
        self._no_site_warned: set = set()  # modules told their returned input has no grad site
        # step(), flush() and remove() take turns: a server's timer thread ending steps while
        # another thread flushes or removes the session would otherwise end one bank step
        # twice at once, or hand a flush another thread is delivering to a sink again.
        # Reentrant: a signal handler's remove() inside a flush on the same thread goes on
        self._boundary = threading.RLock()
        self._boundary_pid = os.getpid()  # a forked child makes its own (see _turns)
        self._fsdp2_warned = False
        self._fsdp2_owner_ids: Optional[frozenset] = None
        self._foreign_warned = False  # a hook copied onto another module ran (_ModuleBinding.foreign)
        self._attached = False  # attach() finished (a failed attach has no final flush to share)
        self._entries: Dict[str, _Entry] = {}  # plugins, then sinks, in attach order
        self._entry_of: Dict[int, _Entry] = {}  # id(plugin) -> its entry
        self._module_refs: Dict[str, weakref.ref] = {}
        self._bindings: Dict[str, _ModuleBinding] = {}
        self._param_bindings: Dict[str, _ParamBinding] = {}
        self._replaced: Dict[int, _ParamBinding] = {}  # whose Parameter was replaced (see _settle_replaced)
        self.params_settled = 0  # how many times _settle_replaced renamed and rebound parameters
        # plugin name -> why its last report section failed (on_error="warn"; see report_sections)
        self.section_failures: Dict[str, str] = {}
        self._param_roots: List[str] = []  # see _bind
        self._param_modules: "weakref.WeakKeyDictionary[nn.Module, frozenset]" = weakref.WeakKeyDictionary()
        self._param_aliases: Dict[str, weakref.ref] = {}  # a tied parameter's other names: their owners
        self._handles: Dict[int, Any] = {}  # id -> hook handle, taken off at remove()
        self._guarded: List[Tuple[weakref.ref, int]] = []  # (module, hook id) left out of copies
        self._hook_ids: Optional[Tuple[int, int]] = None  # (pre, post): one id for every module
        # (see _shared_id), taken by _bind from its model's pairs, given back at remove()
        self._hook_ids_of_model: Dict[Tuple[int, int], bool] = {}
        self._call_order: Dict[str, List[_Entry]] = {}  # hook name -> entries, in call order
        self._recompute = RecomputeMatcher()  # reentrant checkpoints' recomputes -> their calls
        from ._telemetry import Telemetry, new_run_id

        self._telemetry = Telemetry()
        self.run_id = new_run_id()  # names runs/<run-id>/ for sinks given no path
        self._pid = os.getpid()  # the process it belongs to (a forked child emits nothing)
        self._fork_warned = False

    # -- public API ------------------------------------------------------------------------

    @property
    def model(self) -> Optional[nn.Module]:
        return self._model_ref()

    @property
    def modules(self) -> Dict[str, nn.Module]:
        """The selected modules, ``{qualified name: module}``, in model order."""
        out = {}
        for name, ref in self._module_refs.items():
            mod = ref()
            if mod is not None:
                out[name] = mod
        return out

    def modules_of(self, plugin: Union[str, Any]) -> Dict[str, nn.Module]:
        """The modules one plugin is attached to (with ``{selector: plugins}`` they differ)."""
        entry = self._entries.get(plugin) if isinstance(plugin, str) else self._entry_of.get(id(plugin))
        mods = self.modules
        return {n: mods[n] for n in (entry.modules if entry else []) if n in mods}

    @property
    def plugins(self) -> Dict[str, Any]:
        return {n: e.plugin for n, e in self._entries.items() if not e.is_sink}

    @property
    def sinks(self) -> Dict[str, Any]:
        return {n: e.plugin for n, e in self._entries.items() if e.is_sink}

    @property
    def step_index(self) -> int:
        """The number of the step in progress (``start_step``, 0 by default, before the
        first ``step()``)."""
        return self._step

    @property
    def sampled(self) -> bool:
        """Whether the current step is sampled (``every=N``)."""
        return self._sampling

    @property
    def run_dir(self) -> str:
        """``runs/<run-id>``: where sinks given no ``path`` write."""
        return os.path.join("runs", self.run_id)

    @property
    def has_sinks(self) -> bool:
        """Whether telemetry has a consumer: a plugin implementing ``hookplug_flush`` that
        does not only add fields to records (``decorates_records = True``)."""
        return any(not getattr(e.plugin, "decorates_records", False)
                   for e in self._call_order.get("hookplug_flush", ()))

    @property
    def nonfinite(self) -> List[dict]:
        """Per step (and rank), the first selected module whose output or gradient held a
        NaN/Inf, in execution order: ``{step, module, site, phase, rank}``, known once the
        step's telemetry was flushed. A new list of the latest 10,000 entries (older ones
        are dropped: a model with an Inf in some output every step, e.g. masked logits,
        would otherwise grow it without bound; the records keep ``first_nonfinite``)."""
        return list(self._nonfinite)

    def _phase_module(self, module: nn.Module) -> nn.Module:
        """The module whose mode is a call's phase: the model (see ``_phase_of``)."""
        root = self._model_ref()
        return module if root is None else root

    def _training(self) -> bool:
        """Whether the model is in training mode (its root: a frozen submodule in eval mode
        inside a training model still counts as training)."""
        model = self._model_ref()
        return model is not None and model.training

    def _join_block(self):
        """The ``Join`` block (uneven inputs) the DistributedDataParallel attached through
        runs in now: a token new at each entry (None: none; see ``_telemetry.watch_join``)."""
        ddp = self._ddp_ref() if self._ddp_ref is not None else None
        return getattr(ddp, "_hookplug_join_block", None)

    def _in_child(self) -> bool:
        """Whether this is a process forked from the one that attached the session (a
        DataLoader worker, an async checkpoint writer): the telemetry and sinks belong to
        that process, so nothing is collected or emitted here (one warning the first time)."""
        if os.getpid() == self._pid:
            return False
        if not self._fork_warned:
            self._fork_warned = True
            warnings.warn(
                f"hookplug: session {self.run_id} belongs to process {self._pid}, which attached "
                f"it; in this forked process ({os.getpid()}) it emits no telemetry (the steps and "
                "sinks are the parent's). Attach a session in the child to record there",
                RuntimeWarning, stacklevel=user_stacklevel())
        return True

    def _note_nonfinite(self, info: dict) -> None:
        self._nonfinite.append(info)

    @property
    def disabled(self) -> Dict[str, str]:
        """Plugins switched off under ``on_error="warn"``, with the error that did it."""
        return {n: e.disabled for n, e in self._entries.items() if e.disabled is not None}

    @property
    def removed(self) -> bool:
        return self._removed

    def __getitem__(self, name: str):
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"no plugin {name!r} in this session; it has: {', '.join(self._entries) or 'none'}")
        return entry.plugin

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def results(self) -> Dict[str, Any]:
        """``{plugin name: plugin.results()}``. A plugin whose ``results()`` raises is left
        out with a warning under ``on_error="warn"``; under ``"raise"`` its error is raised,
        with a note naming it."""
        out, failed = self._ask_plugins("results")
        for name, exc in failed.items():
            warnings.warn(f"hookplug plugin {name!r}: results() failed ({type(exc).__name__}: {exc}); "
                          "left out of session.results() (on_error='warn')", RuntimeWarning, stacklevel=2)
        return out

    def _ask_plugins(self, method: str) -> Tuple[Dict[str, Any], Dict[str, Exception]]:
        """``plugin.<method>()`` of every plugin that has it: ``({name: result}, {name:
        error})``; an error is raised instead under ``on_error="raise"`` (noted as a hook's)."""
        out: Dict[str, Any] = {}
        failed: Dict[str, Exception] = {}
        for name, p in self.plugins.items():
            fn = getattr(p, method, None)
            if fn is None:
                continue
            try:
                out[name] = fn()
            except Exception as exc:  # noqa: BLE001 - on_error decides
                if self.on_error == "raise":
                    _raise_noted(exc, name, f"{method}()")
                failed[name] = exc
        return out, failed

    def reset(self) -> None:
        for p in self.plugins.values():
            if hasattr(p, "reset"):
                p.reset()

    def report(self) -> str:
        """A plain-text report: one section per plugin that has something to say (under
        ``on_error="warn"``, a line saying so for one whose ``report()`` raised)."""
        lines = [f"hookplug session: {len(self._module_refs)} module(s), step {self._step}, "
                 f"plugins: {', '.join(self.plugins) or 'none'}"]
        texts, failed = self._ask_plugins("report")
        for name in self.plugins:
            if name in failed:
                exc = failed[name]
                lines += ["", f"!! {name}: report failed: {type(exc).__name__}: {exc}"]
            elif texts.get(name):
                lines += ["", f"== {name} ==", texts[name].rstrip()]
        for name, why in self.disabled.items():
            lines += ["", f"!! {name} was disabled: {why}"]
        return "\n".join(lines)

    def report_sections(self) -> Dict[str, Any]:
        """``{plugin name: section}`` from every plugin implementing
        ``hookplug_report_section`` (plain data; see ``hookplug.hookspecs``), in plugin order.
        A section that fails is left out with a warning under ``on_error="warn"`` (its plugin
        goes on collecting, as after a failed ``report()``); under ``"raise"`` its error is
        raised, with a note naming it."""
        out: Dict[str, Any] = {}
        for entry in self._call_order.get("hookplug_report_section", []):
            if entry.disabled is not None:
                continue
            impl = entry.impls["hookplug_report_section"]
            try:
                res = impl.function(**{a: self for a in impl.argnames if a == "session"})
                if res is not None and not isinstance(res, dict):  # a report would drop it silently
                    raise TypeError(f"hookplug plugin {entry.name!r}: hookplug_report_section must "
                                    f"return a dict or None, got {type(res).__name__}")
                tensor = next(iter_tensors(res, "section"), None) if res else None
                if tensor is not None:  # (a device tensor: a sync per report, JSON as a list)
                    raise TypeError(f"hookplug plugin {entry.name!r}: hookplug_report_section must "
                                    f"return plain data (host numbers), got a tensor at {tensor[0]}")
            except Exception as exc:  # noqa: BLE001 - on_error decides
                if self.on_error == "raise":
                    _raise_noted(exc, entry.name, "hookplug_report_section")
                self.section_failures[entry.name] = f"{type(exc).__name__} in hookplug_report_section: {exc}"
                warnings.warn(f"hookplug plugin {entry.name!r}: hookplug_report_section failed "
                              f"({type(exc).__name__}: {exc}); left out of the report "
                              "(on_error='warn')", RuntimeWarning, stacklevel=2)
                continue
            self.section_failures.pop(entry.name, None)
            if res is not None:
                out[entry.name] = res
        return out

    @_eager
    def step(self, step: Optional[int] = None, *, next_step: Optional[int] = None) -> "_StepScope":
        """Mark a training-step boundary: the step that ran so far ends (numbered ``step``
        when given, e.g. a trainer's global step, else the session's counter) and the next
        one is numbered one more (``next_step``: another number, larger, where a trainer's
        steps are not consecutive); plugins see ``hookplug_step``, sampling (``every=N``, on
        step numbers) and ``flush_every`` take effect. A resumed run passes its global step
        and continues from it (``attach(start_step=...)`` numbers its first step before it
        runs, for sampling). Call it after the step's work: ``with session.step():`` is
        refused (the call ends the step before the body runs, which would belong to the
        next). After ``remove()`` it does nothing (its plugins have ended)."""
        with self._turns():  # another thread's step(), flush() or remove() waits (see __init__)
            return self._end_step(step, next_step)

    def _end_step(self, step: Optional[int], next_step: Optional[int]) -> "_StepScope":
        for what, value in (("step", step), ("next_step", next_step)):
            if value is not None and not is_int_at_least(value, 0):
                raise ValueError(f"session.step({what}=...) expects an int >= 0, got {value!r}")
        ended = self._step if step is None else step
        if next_step is not None and next_step <= ended:
            raise ValueError(f"session.step(next_step=...) expects a number after the step ending "
                             f"({ended}), got {next_step}")
        if self._removed:  # its plugins ended (files closed, hooks off): nothing to step
            return _StepScope(self)
        if self._last_ended is not None and ended <= self._last_ended:
            self._warn_backwards(ended)
        self._last_ended = ended
        self._step = ended + 1 if next_step is None else next_step
        self._steps_done += 1
        if self._steps_done == 1 and not self._removed:
            self._warn_replaced()
        sampling = (self._step % self.every) == 0 and not self._removed
        if not self._removed:
            for pb in self._param_bindings.values():
                if pb.variants.get(True):  # a parameter unfrozen or replaced (module.to()/.double()
                    pb.hook()              # under swap_module_params_on_conversion) since attach
            self._settle_replaced()
            me = _get_ident()
            for binding in self._bindings.values():
                if binding._pending:  # this thread's calls left by a BaseException (Ctrl-C:
                    # torch runs no post hook then), and recomputes' marks: no call of this
                    # thread is in progress between steps
                    # (removed one by one: other threads append and take theirs meanwhile)
                    for c in [c for c in binding._pending[:] if c._thread == me]:
                        binding._pending.remove(c)
        if sampling != self._sampling:
            self._sampling = sampling
            self._apply_sampling()
        try:
            # every plugin ends its step, also after one raised (under on_error="raise" the
            # first error is raised once all have run): a caller that catches it and goes on
            # (nonfinite="raise" to skip a bad batch) would get the others' step merged into
            # the next one
            self._dispatch("hookplug_step", step=ended, run_all=True)
        except Exception as exc:
            self._evaluation_only = False
            # the step ended all the same (the other ranks flush now; a caller that goes on
            # would get this step's records only at the next flush, a step late)
            try:
                self._telemetry.on_step(self, ended)
            except Exception as other:  # noqa: BLE001 - the plugin's error is the one raised
                if hasattr(exc, "add_note"):
                    exc.add_note(f"(the telemetry flush of this step also failed: "
                                 f"{type(other).__name__}: {other})")
            raise
        self._evaluation_only = False
        self._telemetry.on_step(self, ended)  # polls flushes in flight; never waits
        return _StepScope(self)

    @_eager
    def flush(self, *, wait: bool = True) -> List[dict]:
        """Collect telemetry from the producers and hand the records to every sink (see
        ``hookplug._telemetry``). ``wait=True`` finishes every flush in flight (a device sync);
        ``wait=False`` starts one and emits only what is already done. Returns the records
        emitted by this call. Under torch.distributed a session with a telemetry producer
        flushes collectively: call it on every rank."""
        with self._turns():
            return self._telemetry.flush(self, wait=wait)

    @_eager
    def remove(self) -> None:
        """Take every hook off (idempotent) and end the session for its plugins, after a
        final telemetry flush: when a sink is given, and under torch.distributed (world
        size > 1) on every rank when a plugin produces telemetry (the flush is collective,
        so it cannot depend on which ranks have a sink). Called while an exception
        propagates (a ``with`` block or ``finally`` that a raise left, a trainer's failure
        path), the final flush is this rank's own, with no collective: the other ranks are
        not there to join it. In a process forked from the one that attached the session
        the hooks come off, with no flush and no sink touched (one warning). A session with
        a sink that is never removed is removed at interpreter exit, as a failing rank's."""
        self._remove(failed=_failing(sys.exc_info()[0]))

    def _remove(self, failed: bool) -> None:
        """``remove()``; ``failed``: this rank is leaving with an exception."""
        with self._turns():
            self._remove_locked(failed)

    def _turns(self) -> "threading.RLock":
        """The lock ``step()``, ``flush()`` and ``remove()`` take turns on. A process forked
        while another thread held it (a timer thread's ``step()``) gets a new one: the copy
        it inherits stays held by a thread it does not have, and its ``remove()`` would hang."""
        pid = os.getpid()
        if self._boundary_pid != pid:
            self._boundary, self._boundary_pid = threading.RLock(), pid
        return self._boundary

    def _remove_locked(self, failed: bool) -> None:
        if self._removed:
            return
        if self._attached and not failed and os.getpid() == self._pid:
            self._warn_replaced()
        self._removed = True
        _UNREMOVED.discard(self)
        self._release_plugins()
        self._sampling = False
        self._recompute.clear()
        for h in self._handles.values():
            h.remove()
        self._handles.clear()
        self._remove_foreign_copies()
        if self._hook_ids is not None:  # no module holds a hook under them now
            self._hook_ids_of_model[self._hook_ids] = True
            self._hook_ids = None
        for module_ref, hook_id in self._guarded:
            module = module_ref()
            if module is not None:
                _unguard_copies(module, hook_id)
        self._guarded.clear()
        # the bindings point back at the session: drop them so `del session` frees plugins'
        # data without waiting for the cycle collector, and retire them, so a binding
        # something else still holds (a hook copy torch made where remove() cannot reach it,
        # a compiled backward in flight, a hook list another thread took) does nothing and
        # keeps no plugin or session alive
        for binding in self._bindings.values():
            binding.retire()
        self._bindings.clear()
        self._param_bindings.clear()
        self._param_aliases.clear()
        _guard_module_hooks()  # compiled code that ran with the hooks recompiles without
        child = os.getpid() != self._pid
        flush_error: Optional[BaseException] = None
        try:
            # under torch.distributed the final flush is collective: every rank runs it when
            # the session has a telemetry producer, whether or not a sink is given here; a
            # failed attach has nothing to flush, a failing rank flushes alone (a forked
            # child: nothing, see _in_child)
            if self._attached and failed and self.has_sinks:
                self._telemetry.flush(self, wait=True, local=True)
            elif self._attached and not failed and (
                    self.has_sinks or (not child and self._telemetry.collective(self))):
                try:
                    self.flush(wait=True)
                except Exception as exc:
                    # the final collective flush failed under on_error="raise" (a rank gone):
                    # this rank's rows go out alone first, then the error
                    with _teardown_behind(exc):
                        self._flush_unsent()
                    raise
                # ... or under on_error="warn"
                self._flush_unsent()
        except BaseException as exc:
            flush_error = exc
            raise
        finally:
            # disabled plugins get their cleanup call too; one failing never skips the others.
            # A forked child leaves the sinks alone: their files, writers and servers are
            # the parent's. After a failed final flush, an error here is noted on it (it
            # would replace it: the first failure, a sink's last write, would go unreported)
            not_started = self._not_started
            with (_teardown_behind(flush_error) if flush_error is not None else contextlib.nullcontext()):
                self._dispatch("hookplug_session_end", include_disabled=True, run_all=True,
                               skip=lambda p: (self._entry_of[id(p)].is_sink and child
                                               or self._entry_of[id(p)].name in not_started))

    def _flush_unsent(self) -> None:
        """Rows the final collective flush could not send (no later flush can): this rank's
        go out alone."""
        if self._telemetry.has_unsent() and self.has_sinks:
            self._telemetry.flush(self, wait=True, local=True)

    def _warn_backwards(self, ended: int) -> None:
        """Once: a step numbered at or before one that already ended (a per-epoch batch
        index passed as ``step=``): records of different steps share numbers, and sampling
        repeats. A resumed run restarting below its last step is the one known reason."""
        if self._backwards_warned:
            return
        self._backwards_warned = True
        warnings.warn(
            f"hookplug: session.step(step={ended}) ends a step numbered at or before one that "
            f"already ended ({self._last_ended}); records of different steps now share numbers "
            "(pass a number that grows every step, e.g. a trainer's global step)",
            RuntimeWarning, stacklevel=user_stacklevel())

    def _warn_replaced(self) -> None:
        """Warn (once per name) about selected modules the model no longer holds: replaced
        after attach (``resize_token_embeddings``' new ``lm_head``, timm's
        ``reset_classifier``), their hooks stay on modules the model does not call, so
        nothing would be recorded for them, silently. Checked at the first ``step()`` and at
        ``remove()`` (one walk of the model's modules each)."""
        model = self._model_ref()
        if model is None or not self._module_refs:
            return
        present = {id(m) for m in model.modules()}
        if self._param_roots:
            self._warn_new_parameters(model, present)
        gone = [name for name, ref in self._module_refs.items()
                if name not in self._replaced_warned and id(ref()) not in present]
        self._warn_modules(gone, "selected module(s) are no longer in the model (replaced after "
                           "attach?): {}; their hooks stay on the old module objects, which the "
                           "model does not call, so nothing is recorded for them. Attach after "
                           "replacing modules, or remove() and attach again.")

    def _warn_modules(self, names: List[str], text: str) -> None:
        """One warning naming ``names`` (the first five) in ``text``, each named once a session."""
        if not names:
            return
        self._replaced_warned.update(names)
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(f"hookplug: {len(names)} {text.format(shown)}", RuntimeWarning,
                      stacklevel=user_stacklevel())

    def _warn_new_parameters(self, model: nn.Module, present: set) -> None:
        """Warn (once per name) about modules holding parameters put after attach under a
        selected module of a plugin working on parameters (``params``, ``gradclamp``
        ``params=``): a child replaced, an adapter wrapped around one. Parameters are listed
        at attach: theirs are neither measured nor steered, silently."""
        roots = {mn for mn in self._param_roots if id(self._module_refs[mn]()) in present}
        if not roots:
            return
        new = []
        for prefix, mod in named_modules(model):
            names = frozenset(k for k, p in mod._parameters.items() if p is not None)
            known = self._param_modules.get(mod)
            if not names or (known is not None and names <= known) or prefix in self._replaced_warned:
                continue  # (what attach listed, or a parameter added to it: pruning's weight_orig)
            if "" in roots or any(".".join(prefix.split(".")[:i]) in roots
                                  for i in range(1, prefix.count(".") + 2)):
                new.append(prefix)
        self._warn_modules(new, "module(s) under selected modules got parameters after attach (a "
                           "child replaced, an adapter added, pruning?): {}; their parameters are "
                           "not covered (params and gradclamp params= list parameters at attach). "
                           "Attach after changing the model, or remove() and attach again.")

    def _remove_foreign_copies(self) -> None:
        """Take off the model's modules the copies of this session's hooks that torch
        registered on modules it swapped in (see ``_ModuleBinding.foreign``): no handle of
        ours has them, and they would keep the session alive."""
        model = self._model_ref()
        ours = {id(b) for b in self._bindings.values()}
        if model is None or not ours:
            return
        for mod in model.modules():
            for hooks in (mod._forward_pre_hooks, mod._forward_hooks):
                for hook_id in [k for k, fn in hooks.items() if id(getattr(fn, "__self__", None)) in ours]:
                    del hooks[hook_id]
                    mod._forward_pre_hooks_with_kwargs.pop(hook_id, None)
                    mod._forward_hooks_with_kwargs.pop(hook_id, None)
                    mod._forward_hooks_always_called.pop(hook_id, None)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc_value, tb) -> None:
        if exc_type is None:
            self._remove(failed=False)
            return
        with _teardown_behind(exc_value):  # the block's own exception goes on
            self._remove(failed=_failing(exc_type))

    def __repr__(self) -> str:
        state = "removed" if self._removed else "attached"
        return f"<hookplug.Session {state}: {len(self._module_refs)} modules, plugins={list(self.plugins)}>"

    # -- errors ----------------------------------------------------------------------------

    def _plugin_failed(self, plugin, hook_name: str, exc: BaseException) -> None:
        entry = self._entry_of.get(id(plugin))
        name = entry.name if entry is not None else type(plugin).__name__
        if self.on_error == "raise":
            _raise_noted(exc, name, hook_name)
        if entry is None or entry.disabled is not None:
            return
        why = f"{type(exc).__name__} in {hook_name}: {exc}"
        entry.disabled = why
        warnings.warn(f"hookplug plugin {name!r} failed and is disabled for this session: {why}",
                      RuntimeWarning, stacklevel=user_stacklevel())
        if not self._removed:  # a removed session has no bindings left to rebuild
            self._rebind()
        stop = getattr(plugin, "_hookplug_disabled", None)
        if callable(stop):  # a first-party plugin with hooks of its own outside the session's
            try:  # (a dispatch mode, node hooks): they stop now, not at remove()
                stop()
            except Exception as other:  # noqa: BLE001 - the plugin is off already
                warnings.warn(f"hookplug plugin {name!r}: stopping it after its error failed too: "
                              f"{type(other).__name__}: {other}", RuntimeWarning, stacklevel=user_stacklevel())

    def _telemetry_failed(self, exc: BaseException) -> None:
        """A telemetry flush failed outside any plugin hook (a collective, a producer's
        malformed rows): raised under ``on_error="raise"``, else a warning."""
        if self.on_error == "raise":
            raise exc
        warnings.warn(f"hookplug telemetry: a flush failed (on_error='warn'): {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=user_stacklevel())

    def _dispatch(self, hook_name: str, *, on_result=None, skip=None, include_disabled: bool = False,
                  run_all: bool = False, returned=None, **kwargs) -> None:
        """Call a session-level hook on every plugin that implements it, in plugin order,
        each given the arguments it asks for (``session`` always offered);
        ``on_result(plugin_name, result)`` sees each result; failures go through
        ``on_error``. ``run_all``: under ``on_error="raise"`` a failing plugin does not stop
        the others; the first error is raised once all have run (later ones in its notes).
        ``returned(plugin_name)``: told of each hook that ran to its end, also when a
        ``BaseException`` (Ctrl-C) is raised as it returns."""
        kwargs.setdefault("session", self)
        failed: List[Tuple[Any, BaseException]] = []
        for entry in self._call_order.get(hook_name, []):
            plugin = entry.plugin
            if (entry.disabled is not None and not include_disabled) or (skip is not None and skip(plugin)):
                continue
            impl = entry.impls[hook_name]
            try:
                res = impl.function(**{a: kwargs[a] for a in impl.argnames if a in kwargs})
                if on_result is not None:
                    on_result(entry.name, res)
                if returned is not None:
                    returned(entry.name)
            except Exception as exc:  # noqa: BLE001 - on_error decides
                if run_all and self.on_error == "raise":
                    failed.append((plugin, exc))
                else:
                    self._plugin_failed(plugin, hook_name, exc)
            except BaseException as exc:
                # raised in this frame, not inside the hook: a signal handler runs at the first
                # check after a call, so a Ctrl-C that came while the hook ran its last
                # (C) code lands here once it has returned
                if returned is not None and exc.__traceback__.tb_next is None:
                    returned(entry.name)
                raise
        if failed:
            plugin, exc = failed[0]
            try:
                self._plugin_failed(plugin, hook_name, exc)
            finally:
                for other, other_exc in failed[1:]:
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"(hookplug plugin {self._entry_of[id(other)].name!r} also raised in "
                                     f"{hook_name}: {type(other_exc).__name__}: {other_exc})")

    # -- binding -----------------------------------------------------------------------------

    def _add_plugin(self, name: str, plugin, module_names: List[str], sink: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"a plugin's name must be a non-empty str (its key in session.plugins, "
                              f"results and reports); {type(plugin).__name__} has name {name!r}")
        if name in self._entries:
            raise PluginError(f"plugin name {name!r} is used twice in one session")
        if not sink and not implements_hook(plugin, "hookplug_flush"):  # (a sink may serve
            with _IN_USE_LOCK:                                       # several: it only receives)
                other = _IN_USE.get(id(plugin))
                if other is not None and other is not self and not other._removed and getattr(
                        other._entry_of.get(id(plugin)), "plugin", None) is plugin:
                    raise PluginError(
                        f"plugin {name!r} ({type(plugin).__name__} instance) is attached to another "
                        "session that is not removed; an instance serves one session at a time "
                        "(remove() that one first, or give this session an instance of its own)")
                _IN_USE[id(plugin)] = self
        entry = self._entries[name] = _Entry(name, plugin, list(module_names), sink)
        self._entry_of[id(plugin)] = entry

    def _bind(self, model: nn.Module) -> int:
        """Resolve the plugins' hooks and put the torch hooks on the modules; returns the
        most hooked modules that share one forward code (a repeated block's layers)."""
        self._resolve_hooks()
        self._hook_ids, self._hook_ids_of_model = _new_hook_ids(model)
        mods = dict(named_modules(model))
        for name in self._module_refs:
            self._bindings[name] = _ModuleBinding(name, self)
        params_by_id: Dict[int, str] = {}
        for pname, p in named_parameters(model):
            params_by_id.setdefault(id(p), pname)
        wanted_params: Dict[str, torch.Tensor] = {}
        for entry in self._call_order["hookplug_param_grad"]:
            if entry.is_sink:
                continue
            for mn in entry.modules:
                for p in mods[mn].parameters():  # frozen ones too: hooked once they need a gradient
                    if id(p) in params_by_id:
                        wanted_params[params_by_id[id(p)]] = p
        owners = parameter_owners(model)
        # the owners a parameter hook may follow: the selected modules and what they hold
        under = {id(m) for entry in self._call_order["hookplug_param_grad"] if not entry.is_sink
                 for mn in entry.modules for m in mods[mn].modules()}
        # the modules under those of plugins working on parameters, for _warn_replaced
        watching = {mn for e in self._entries.values() if not e.is_sink and (
            "hookplug_param_grad" in e.impls or getattr(e.plugin, "watches_parameters", False))
            for mn in e.modules}
        # (held weakly, not by id: a module replaced and freed leaves its id to the next),
        # with the names of the parameters each held
        self._param_roots = list(watching)
        self._param_modules = weakref.WeakKeyDictionary(
            (m, frozenset(k for k, p in m._parameters.items() if p is not None))
            for mn in watching for m in mods[mn].modules())
        for pname, p in wanted_params.items():
            # keyed by its first name; held through its first selected owner, whose attribute
            # it follows when replaced (``lm_head.weight`` tied to an unselected ``wte``)
            mine = [o for o in owners[id(p)] if id(o[1]) in under] or owners[id(p)]
            prefix, mod, attr = mine[0]
            self._param_bindings[pname] = _ParamBinding(pname, mod, attr, self)
            # a tied parameter's other selected owners get bindings of their own, inert while
            # tied (the first one hooks the tensor, see _ParamBinding.hook) and where no
            # plugin covers them (see _params_of): once untied after attach
            # (``b.weight = nn.Parameter(...)``), the next step() hooks it
            for prefix, mod, attr in mine[1:]:
                alias = qualified(prefix, attr)
                if alias not in self._param_bindings:
                    self._param_bindings[alias] = _ParamBinding(alias, mod, attr, self)
                    self._param_aliases[alias] = weakref.ref(mod)
        self._rebind()
        forwards: Dict[Any, int] = {}  # forward code -> hooked modules running it
        for name, binding in self._bindings.items():
            mod = mods[name]
            fwd_in, fwd_out, out_grad = binding.variants[True]
            binding.has_pre, binding.has_post = bool(fwd_in), bool(fwd_out or out_grad)
            if binding.has_pre:
                self._keep_handle(mod, _shared_id(mod.register_forward_pre_hook(
                    binding.pre_hook, with_kwargs=True), self._hook_ids[0]))
            elif out_grad:  # a grad site reads the call's inputs as it begins (see _inputs_at_call)
                self._keep_handle(mod, _shared_id(mod.register_forward_pre_hook(
                    binding.note_inputs, with_kwargs=True), self._hook_ids[0]))
            if binding.has_post:
                self._keep_handle(mod, _shared_id(mod.register_forward_hook(
                    binding.post_hook, **_POST_HOOK_KWARGS), self._hook_ids[1]))
            if binding.has_pre or binding.has_post:
                code = getattr(type(mod).forward, "__code__", type(mod))
                forwards[code] = forwards.get(code, 0) + 1
        replaced_in: Dict[int, Tuple[nn.Module, List[_ParamBinding]]] = {}
        for pb in self._param_bindings.values():
            if pb.variants[True]:
                pb.hook()
                owner = pb.owner_ref()
                replaced_in.setdefault(id(owner), (owner, []))[1].append(pb)
        for owner, pbs in replaced_in.values():  # load_state_dict(assign=True) makes new Parameters
            self._keep_handle(owner, owner.register_load_state_dict_post_hook(_Rehook(pbs)))
        pending: Dict[int, Tuple[nn.Module, List[_ParamBinding]]] = {}
        for owner, pbs in replaced_in.values():  # materialized later: hooked at a forward
            for pb in pbs:
                param = pb.param()
                if unmaterialized(param):  # meta: at the model's; lazy: at its owner's, after its init
                    where = owner if not param.is_meta else model
                    pending.setdefault(id(where), (where, []))[1].append(pb)
        for where, pbs in pending.values():
            materialize = _Materialize(pbs)
            materialize.handle = where.register_forward_pre_hook(materialize)
            self._keep_handle(where, materialize.handle)
        return max(forwards.values(), default=0)

    def _module_tensors_of(self, name: str, phase: str) -> Optional[Dict[Any, torch.Tensor]]:
        """The per-module tensor table of hooked module ``name`` in ``phase`` (see
        ``_TracedContext``)."""
        binding = self._bindings.get(name)
        return None if binding is None else binding.module_tensors.get(phase)

    def _release_plugins(self) -> None:
        """This session's plugin instances may serve another session (see ``_IN_USE``)."""
        with _IN_USE_LOCK:
            for entry in self._entries.values():
                if _IN_USE.get(id(entry.plugin)) is self:
                    _IN_USE.pop(id(entry.plugin), None)

    def _fsdp2_owners(self) -> frozenset:
        """Modules whose parameters FSDP2 managed when first asked (at attach; a model
        sharded after attach has DTensor parameters, see ``_ParamBinding.hook``)."""
        if self._fsdp2_owner_ids is None:
            self._fsdp2_owner_ids = fsdp2_owners(self.model)
        return self._fsdp2_owner_ids

    def _keep_handle(self, module: nn.Module, handle) -> None:
        """Keep ``handle`` for ``remove()``; copies and pickles of ``module`` leave its hook out."""
        self._handles[id(handle)] = handle
        _guard_copies(module, handle)
        self._guarded.append((weakref.ref(module), handle.id))

    def _resolve_hooks(self) -> None:
        """Ask pluggy, once, which plugin implements which hook and in what order; keep the
        answer and let the manager go (it is a reference cycle that would hold every plugin
        until the cycle collector runs)."""
        pm = new_plugin_manager()
        order = [e.plugin for e in self._entries.values() if not e.is_sink] + \
                [e.plugin for e in self._entries.values() if e.is_sink]
        try:
            for plugin in reversed(order):  # pluggy calls the last registered first
                self._register(pm, self._entry_of[id(plugin)])
            for hook_name in _HOOK_NAMES:
                impls = list(reversed(getattr(pm.hook, hook_name).get_hookimpls()))
                entries = self._call_order[hook_name] = [self._entry_of[id(i.plugin)] for i in impls]
                for entry, impl in zip(entries, impls):
                    entry.impls[hook_name] = impl
        finally:
            for plugin in order:
                if pm.is_registered(plugin):
                    pm.unregister(plugin)

    def _register(self, pm: pluggy.PluginManager, entry: _Entry) -> None:
        """Register ``entry``'s plugin with ``pm`` under its session name and check it against
        the specs (an unknown hook name, an argument a spec lacks, a wrapper on a per-call
        hook); keep the callables its per-call hooks are called through. A plugin that does
        not fit raises :class:`PluginError` naming it and the hook, or under
        ``on_error="warn"`` is left out of the session with a warning, as a plugin that
        fails to load is."""
        plugin = entry.plugin
        try:
            try:
                pm.register(plugin, name=entry.name)
            except pluggy.PluginValidationError as exc:
                text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
                specs = [f"{h}({', '.join(_SPEC_ARGS[h])})" for h in _HOOK_NAMES if f"'{h}'" in text]
                raise PluginError(f"hookplug plugin {entry.name!r} does not fit hookplug's hook specs: "
                                  f"{text}" + "".join(f"; the spec is {spec}" for spec in specs)) from None
            for caller in pm.get_hookcallers(plugin) or ():
                impl = next(i for i in caller.get_hookimpls() if i.plugin is plugin)
                if not caller.has_spec():
                    if impl.optionalhook:
                        continue
                    close = difflib.get_close_matches(caller.name, _HOOK_NAMES, n=1)
                    raise PluginError(
                        f"hookplug plugin {entry.name!r}: unknown hook {caller.name!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else "")
                        + "; the hooks are the specs in hookplug.hookspecs")
                _check_parameters(entry.name, caller.name, impl.function)
                if caller.name in _PER_CALL_HOOKS:
                    entry.adapted[caller.name] = _adapt(impl, caller.name)
                elif impl.hookwrapper or getattr(impl, "wrapper", False):
                    # _dispatch calls it as a plain hook: it would only make a generator
                    raise PluginError(
                        f"plugin {entry.name!r}: {caller.name} cannot be a hookwrapper/wrapper "
                        "(hookplug calls each plugin's hook itself, so its body would never run); "
                        "implement it as a plain hook")
                fn = impl.function
                if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) \
                        or inspect.isasyncgenfunction(fn):
                    raise PluginError(
                        f"hookplug plugin {entry.name!r}: {caller.name} is a generator or async "
                        "function, whose body a call never runs; make it a plain function")
        except PluginError as exc:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            if self.on_error == "raise":
                raise
            _skip_plugin(exc)
            del self._entries[entry.name], self._entry_of[id(plugin)]

    def _rebind(self) -> None:
        """(Re)build the per-module tuples, leaving out disabled plugins; one set for
        sampled steps and one (plugins with ``sampled = False`` only) for the others."""
        live = [e for e in self._entries.values() if e.disabled is None and not e.is_sink]
        by_module: Dict[str, List[_Entry]] = {n: [] for n in self._bindings}
        for entry in live:
            for mn in entry.modules:
                by_module[mn].append(entry)

        def impls_for(hook_name: str, allowed: List[_Entry], sampling: bool) -> Tuple:
            ok = {id(e) for e in allowed if sampling or not getattr(e.plugin, "sampled", True)}
            return tuple((e.plugin, e.adapted[hook_name]) for e in self._call_order[hook_name] if id(e) in ok)

        for name, binding in self._bindings.items():
            allowed = by_module[name]
            binding.variants = {
                sampling: tuple(impls_for(h, allowed, sampling) for h in _PER_CALL_HOOKS[:3])
                for sampling in (True, False)
            }
            binding.all_in, binding.all_out, binding.all_grad = binding.variants[True]
            binding.grad_in_graph = all(getattr(p, "grad_in_graph", False) for p, _ in binding.all_grad)
            untraceable = list(dict.fromkeys(
                self._entry_of[id(p)].name for impls in binding.variants[True] for p, _ in impls
                if not getattr(p, "traceable", True)))
            binding.recompute = tuple(e.plugin for e in allowed
                                      if callable(getattr(e.plugin, "_recompute_started", None)))
            binding.eager_only = bool(untraceable)
            binding.eager_reason = _eager_reason(untraceable) if untraceable else ""
            if binding.eager_only and dynamo_disable() is not None:
                _make_eager_runner(binding.eager_reason)
        if dynamo_disable() is not None:
            _make_eager_runner(_SESSION_CALL)  # (see _eager)
        for pb in self._param_bindings.values():
            if pb.owner_ids is None:
                covering = [e for e in live if pb.key in self._params_of(e)]
            else:  # (a Parameter replaced after attach, see _param_replaced)
                covering = [e for e in live if self._module_ids_of(e) & pb.owner_ids]
            pb.variants = {sampling: impls_for("hookplug_param_grad", covering, sampling)
                           for sampling in (True, False)}
        self._apply_sampling()

    def _sample_until_step(self) -> None:
        """Sample what runs until the next ``step()`` (an evaluation a trainer integration
        runs after a step ``every=N`` did not sample): the sampled hooks swapped in, plugins
        told (``hookplug_sampling``). The next ``step()`` samples by the rule again."""
        with self._turns():  # (as step() changes sampling: another thread's step() waits)
            if self._sampling or self._removed:
                return
            self._sampling = True
            self._apply_sampling()
            self._dispatch("hookplug_sampling")

    def _apply_sampling(self) -> None:
        """Swap in the tuples for this step: unsampled steps run only unsampled plugins."""
        sampling = self._sampling
        for binding in self._bindings.values():
            impls = binding.variants[sampling]
            binding.fwd_in, binding.fwd_out, binding.out_grad = impls
            binding.impls = (*impls, sampling)  # (the key: see _ModuleBinding.post_hook)
        for pb in self._param_bindings.values():
            pb.impls = pb.variants[sampling]

    def _param_replaced(self, pb: _ParamBinding) -> None:
        """``pb``'s Parameter was replaced (untied, reloaded with ``assign=True``, made by
        ``to_empty()``): noted; the next ``step()`` renames and rebinds (once for all, see
        :meth:`_settle_replaced`); until then the new one is steered as the old one was."""
        self._replaced[id(pb)] = pb

    def _settle_replaced(self) -> None:
        """Each replaced Parameter noted since the last call is named by its first name and
        steered by the plugins covering a module that holds it now, no longer by those of
        the Parameter it replaced: one walk of the model and one rebind for all of them."""
        if not self._replaced:
            return
        todo, self._replaced = list(self._replaced.values()), {}
        model = self._model_ref()
        if model is None or self._removed:
            return
        owners = parameter_owners(model)
        for pb in todo:
            param = pb.param()
            got = owners.get(id(param)) if param is not None else None
            if got:
                pb.name = qualified(got[0][0], got[0][2])
                pb.owner_ids = frozenset(id(m) for _, m, _ in got)
        self.params_settled += 1  # (plugins matching parameters by name look again: untied, tied)
        self._rebind()

    def _module_ids_of(self, entry: _Entry) -> set:
        """The ids of the modules under ``entry``'s selected modules (computed once)."""
        if entry.module_ids is None:
            model = self.model
            mods = dict(named_modules(model)) if model is not None else {}
            entry.module_ids = {id(m) for mn in entry.modules if mn in mods for m in mods[mn].modules()}
        return entry.module_ids

    def _params_of(self, entry: _Entry) -> set:
        """The names of the parameters under ``entry``'s modules (computed once)."""
        if entry.params is None:
            model = self.model
            names = set()
            if model is not None:
                mods = dict(named_modules(model))
                ids = {id(p) for mn in entry.modules for p in mods[mn].parameters()}
                names = {n for n, p in named_parameters(model) if id(p) in ids}
                under = {id(m) for mn in entry.modules for m in mods[mn].modules()}
                names.update(alias for alias, owner in self._param_aliases.items() if id(owner()) in under)
            entry.params = names
        return entry.params


class _StepScope:
    """Returned by ``Session.step()``: refuses ``with session.step():``, whose body would run
    in the step after the one the call ended (the boundary is the call, not the exit)."""

    __slots__ = ("session",)

    def __init__(self, session: Session):
        self.session = session

    def __enter__(self) -> Session:
        raise TypeError(
            "with session.step(): the call ends the step at once, so the body would count "
            "in the next step; call session.step() after each step's work instead")

    def __exit__(self, *exc) -> None:
        return None


def _needs_calls(plugin) -> bool:
    """Whether ``plugin`` works only through module calls: it implements a forward or
    output-gradient hook and no parameter-gradient hook (``params`` implements none: it reads
    the parameters of the selected modules, children's included)."""
    def has(name):
        return getattr(getattr(plugin, name, None), "hookplug_impl", None) is not None
    return (any(has(n) for n in ("hookplug_forward_input", "hookplug_forward_output", "hookplug_output_grad"))
            and not has("hookplug_param_grad"))


def _skip_plugin(exc: PluginError) -> None:
    """Under ``on_error="warn"``: the one warning for a plugin left out of the session."""
    warnings.warn(f"{exc}; attached without it (on_error='warn')", RuntimeWarning, stacklevel=user_stacklevel())


def _build_plugins(specs, on_error: str, origins: Dict[str, str]) -> List[Tuple[str, Any]]:
    """Instances for ``[(name, options, instance_or_None)]``. A plugin that fails to load
    raises under ``on_error="raise"``; under ``"warn"`` it is named in a warning and left out.
    The error of a plugin from a config file starts with its file and table (``origins``)."""
    built = []
    for name, options, instance in specs:
        if instance is None:
            try:
                instance = create_plugin(name, options)
            except PluginError as exc:
                if name in origins and exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"{origins[name]}: {exc.args[0]}",) + exc.args[1:]
                if on_error == "raise" or not isinstance(exc, PluginLoadError):
                    raise
                _skip_plugin(exc)
                continue
        built.append((name, instance))
    return built


def _plugin_groups(who: str, selector: Any, plugins: Any, where: str = "") -> List[Tuple[Any, Any]]:
    """``[(selector, plugins)]`` of an ``attach()`` call: a ``{selector: plugins}`` dict's
    items (not empty, and no ``plugins=`` beside it), else the one pair."""
    if isinstance(selector, dict):
        if plugins is not None:
            raise PluginError(f"{who}with a {{selector: plugins}} dict, leave plugins= unset")
        if not selector:
            raise PluginError(f"{who}the {{selector: plugins}} dict is empty: no module would be hooked")
        return list(selector.items())
    if plugins is None:
        raise PluginError(f"{who}plugins= is required (a name, a list, or instances){where}")
    return [(selector, plugins)]


def check_attach_arguments(who: str, selector: Any, plugins: Any, kwargs: Dict[str, Any]) -> None:
    """Raise now what ``attach(model, selector, plugins, **kwargs)`` would refuse before it
    looks at a model: an unknown keyword, a ``config=`` that cannot be read, no plugins,
    option values out of range, unknown plugin names and options a plugin's signature
    rejects (checked, not built). For trainer callbacks, which attach at the first batch;
    errors start with ``who``."""
    sig = inspect.signature(attach)
    try:
        bound = sig.bind(None, selector, plugins, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{who}: {exc}") from None
    for name, value in list(bound.arguments.items()):  # None: not set, as attach() takes it
        default = sig.parameters[name].default
        if value is None and default is not None and default is not sig.empty:
            del bound.arguments[name]
    given = frozenset(bound.arguments)
    bound.apply_defaults()
    a = bound.arguments
    try:
        check_strict("attach()", a["strict"])
        selector, plugins, every, sink, on_error, _, flush_every, _ = attach_options(
            a["config"], given, a["selector"], a["plugins"], every=a["every"], sink=a["sink"],
            on_error=a["on_error"], strict=a["strict"], flush_every=a["flush_every"])
        groups = _plugin_groups("", selector, plugins, " (or a config= file that names them)")
        _check_session_options(every, on_error, flush_every, a["start_step"], a["distributed"])
        for sel, spec in groups + [(None, sink)]:
            specs = _normalize_specs(spec, "plugins" if sel is not None else "sink")
            if sel is not None and not specs:
                raise PluginError(f"no plugins given for selector {sel!r}")
            if isinstance(sel, str):  # its syntax (classes are resolved against the model)
                parse_selector(sel)
            for name, options, instance in specs:
                if instance is None:
                    try:
                        check_plugin(name, options)
                    except PluginLoadError:
                        if on_error == "raise":  # (under "warn" attach() leaves it out)
                            raise
    except (ValueError, TypeError) as exc:  # (PluginError and ConfigError are ValueErrors)
        if exc.args and isinstance(exc.args[0], str):  # (the same error, its fields kept)
            exc.args = (f"{who}: {exc.args[0]}",) + exc.args[1:]
        raise


@_records_given
def attach(
    model: nn.Module,
    selector: Union[str, Dict[str, PluginSpec]] = "*",
    plugins: PluginSpec = None,
    *,
    every: int = 1,
    sink: PluginSpec = None,
    on_error: str = "raise",
    strict: bool = False,
    flush_every: Optional[int] = None,
    config: Union[str, "os.PathLike[str]", Dict[str, Any], None] = None,
    start_step: int = 0,
    distributed: bool = True,
    _given: frozenset = frozenset(),
) -> Session:
    """Attach ``plugins`` to the modules of ``model`` that ``selector`` picks.

    ``selector`` may be a dict ``{selector: plugins}`` to give each plugin its own modules.
    ``plugins`` and ``sink`` take a name, ``(name, {options})``, a list, a dict
    ``{name: options}`` or plugin instances. Returns a :class:`Session`.

    Telemetry: ``every=N`` samples one step in N (default 1); ``flush_every=K`` flushes
    the producers' stats to the sinks every K steps without waiting for the device; with
    ``flush_every`` set and no sink (in ``sink=`` or ``plugins=``), records go to
    ``runs/<run-id>/telemetry.jsonl``.
    ``config=`` a TOML file (see ``hookplug.load_config``) supplies what is not passed here.
    ``distributed=False`` keeps the session off torch.distributed (no collective flush,
    records of this rank only): for a session attached on some ranks only, e.g. to debug
    one. ``start_step=S`` numbers the first step ``S`` (a resumed run's global step), so that
    ``every=N`` samples it only when ``S % N == 0``, like every later step; by default the
    first step is 0, always sampled.
    """
    check_strict("attach()", strict)
    selector, plugins, every, sink, on_error, strict, flush_every, origins = attach_options(
        config, _given, selector, plugins, every=every, sink=sink, on_error=on_error,
        strict=strict, flush_every=flush_every)
    patch_pipelining()  # a PipelineStage's metadata inference runs no hook (see _pipelining)
    ddp = None
    if isinstance(model, nn.Module):
        ddp = ddp_wrapper(model)
        model = unwrap_model(model)  # hooks on the wrapped modules serve the wrapper too
    again = (_attached_again(model, (selector, plugins, sink, every, flush_every, on_error, start_step,
                                     distributed))
             if isinstance(model, nn.Module) else None)
    session = Session(model, every=every, on_error=on_error, flush_every=flush_every,
                      start_step=start_step, distributed=distributed)
    if ddp is not None:
        session._replica_group = getattr(ddp, "process_group", None)
        session._ddp_ref = weakref.ref(ddp)
        if flush_every:
            from ._telemetry import watch_join

            watch_join(ddp)
    groups = _plugin_groups("attach(): ", selector, plugins,
                            "" if config is None else f"; config={config!r} names none ([plugins.NAME] tables)")

    chosen: Dict[str, nn.Module] = {}
    plan: Dict[str, Tuple[Any, List[str], Dict[str, Any]]] = {}
    never_called = []
    for sel, spec in groups:
        matched, containers = select_terms(model, sel, strict=strict, stacklevel=4)
        for n, m in matched:
            if isinstance(m, torch.jit.ScriptModule):
                raise TypeError(
                    f"attach(): module {n or '<root>'!r} is a TorchScript module "
                    f"({type(m).__name__}), which takes no Python hooks; attach to the eager "
                    "model before torch.jit.script/trace"
                    + (f", or leave it out: '..., -*:{n}, -*:{n}.*'" if n else ""))
        if containers:
            never_called.append((sel, containers, spec))
        specs = _normalize_specs(spec)
        if not specs:
            raise PluginError(f"attach(): no plugins given for selector {sel!r}")
        group_keys = set()
        for name, options, instance in specs:
            key = getattr(instance, "name", None) or name
            if key in group_keys:
                raise PluginError(f"plugin name {key!r} is used twice for selector {sel!r}")
            group_keys.add(key)
            if key in plan:
                prev_instance, mods, prev_opts = plan[key]
                if instance is not prev_instance or _same_form(options) != _same_form(prev_opts):
                    raise PluginError(
                        f"plugin {key!r} appears under two selectors with different options or "
                        "instances; give the second one its own instance with another name"
                    )
                mods.extend(n for n, _ in matched if n not in mods)
            else:
                plan[key] = (instance, [n for n, _ in matched], options)
        for n, m in matched:
            chosen.setdefault(n, m)
    order = {n: i for i, (n, _) in enumerate(named_modules(model))}
    for n in sorted(chosen, key=order.__getitem__):
        session._module_refs[n] = weakref.ref(chosen[n])

    try:  # (a failure here leaves no plugin claimed by a session that never attached)
        built = _build_plugins([(k, opts, inst) for k, (inst, _, opts) in plan.items()], on_error,
                               origins["plugins"])
        for key, instance in built:
            session._add_plugin(key, instance, sorted(plan[key][1], key=order.__getitem__))
        by_key = dict(built)
        for sel, containers, spec in never_called:  # where a plugin works through module calls
            group = [by_key.get(getattr(inst, "name", None) or name) for name, _, inst in _normalize_specs(spec)]
            if any(p is not None and _needs_calls(p) for p in group):
                warn_never_called(sel, containers, stacklevel=3)
        if sink is None and flush_every is not None and not any(implements_hook(p, "hookplug_flush") for _, p in built):
            sink = "jsonl"  # (a sink named in plugins= serves as the sink)
        sink_specs = [(getattr(inst, "name", None) or n, o, inst) for n, o, inst in _normalize_specs(sink, "sink")]
        for key, instance in _build_plugins(sink_specs, on_error, origins["sink"]):
            if not implements_hook(instance, "hookplug_flush"):  # its records would go nowhere, silently
                exc = PluginError(f"sink= got {key!r}, which is not a sink: it implements no "
                                  "@hookplug.hookimpl hookplug_flush (a plugin goes in plugins=)")
                if on_error == "raise":
                    raise exc
                _skip_plugin(exc)
                continue
            session._add_plugin(key, instance, [], sink=True)
    except BaseException:
        session._release_plugins()
        raise
    started: set = set()  # (set before the try: a failed _bind reads it too)
    try:
        repeats = session._bind(model)
        _guard_module_hooks(repeats + _RECOMPILE_LIMIT if repeats > 1 else 0)
        session._dispatch("hookplug_session_start", returned=started.add)
        session._attached = True
        if session.has_sinks:
            _flush_at_exit(session)
        _note_attached_at(model, session, again)
    except BaseException as exc:
        # only plugins whose session_start ran (or that have none) are ended
        session._not_started = {n for n, e in session._entries.items()
                                if "hookplug_session_start" in e.impls and n not in started}
        with _teardown_behind(exc):
            session._remove(failed=True)
        raise
    return session
