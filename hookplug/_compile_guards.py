"""torch.compile and hooks: dynamo's module-hook guards switched on, and its recompile limit
raised, for every session (see :func:`_guard_module_hooks`), at once where dynamo is imported
and through a one-shot import hook where it is not yet (importing it costs seconds)."""
from __future__ import annotations

import importlib.abc
import logging
import sys

from ._bank import ON_COMPILE_START, hook_compile_start

_RECOMPILE_LIMIT = 8  # dynamo's default recompile_limit
_log = logging.getLogger("hookplug")
# the recompile limit sessions attached before torch._dynamo.config was imported asked for
_PENDING_RECOMPILE_LIMIT = [0]


def _guard_module_hooks(recompile_limit: int = 0) -> None:
    """torch.compile does not guard on module hooks by default (``skip_nnmodule_hook_guards``):
    code compiled before hooks were added or removed would keep running without (or with)
    them, and an instance of a class compiled without hooks (an EMA copy, a teacher) would
    share its graph with a hooked one. Switch the guards on: on this thread now, and on any
    thread as it starts compiling (dynamo's config is per thread; see ``ON_COMPILE_START``). The first switch
    drops all compiled code (it has no hook guards, wherever it lives: the model's forward, a
    compiled parent, code after a graph break); later attaches and removes are then caught
    by the guards. Also raise dynamo's recompile limit to ``recompile_limit``
    (:func:`_raise_recompile_limit`). Where dynamo is not imported yet (importing it costs
    seconds), both are made when its config module is first imported."""
    _WANTED_LIMIT[0] = max(_WANTED_LIMIT[0], recompile_limit)
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:
        if getattr(config, "skip_nnmodule_hook_guards", False):
            config.skip_nnmodule_hook_guards = False
            # code compiled before has no hook guards, wherever it is (a compiled parent of
            # the model, a helper method with a graph break): compile it again, once
            reset = getattr(sys.modules.get("torch._dynamo"), "reset_code_caches", None)
            if reset is not None:
                reset()
        _raise_recompile_limit(config, recompile_limit)
        hook_compile_start()  # (again after a torch._dynamo.reset(), which drops it)
        return
    _PENDING_RECOMPILE_LIMIT[0] = max(_PENDING_RECOMPILE_LIMIT[0], recompile_limit)
    if not any(isinstance(f, _HookGuardsOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _HookGuardsOnImport())


# the highest recompile limit any session asked for; > -1 once one attached (guards wanted)
_WANTED_LIMIT = [-1]


def _guards_on_this_thread() -> None:
    """At each compile start (``hookplug._bank.ON_COMPILE_START``): dynamo's config settings
    are per thread (torch 2.13), so a thread other than the one that attached (or dynamo
    first imported on another thread) gets the module-hook guards and the recompile limit
    the sessions asked for when it compiles. No code-cache reset here: inside a compile."""
    if _WANTED_LIMIT[0] < 0:
        return
    config = sys.modules.get("torch._dynamo.config")
    if config is None:
        return
    if getattr(config, "skip_nnmodule_hook_guards", False):  # a thread not set up yet
        config.skip_nnmodule_hook_guards = False
        _raise_recompile_limit(config, _WANTED_LIMIT[0])


ON_COMPILE_START.append(_guards_on_this_thread)


def _raise_recompile_limit(config, wanted: int) -> None:
    """Dynamo's recompile limits (per code object, and its accumulated cap) at least
    ``wanted``, never lowered, with one INFO line. The hooked instances of a repeated block
    (regional compilation, or a block's code after a graph break) share one graph, but a
    traced hook that reads something of its module (a plugin reading ``ctx.name``; ``stats``
    meeting a key in a trace before its row tensor exists, for one step) makes that
    module's graph its own; past the limit the rest would run eagerly (or fail under
    fullgraph=True)."""
    raised = []
    for name, old_name in (("recompile_limit", "cache_size_limit"),
                           ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = name if hasattr(config, name) else old_name
        current = getattr(config, name, None)
        if isinstance(current, int) and current < wanted:
            setattr(config, name, wanted)
            raised.append(f"{name} {current} -> {wanted}")
    if raised:
        _log.info("hookplug: torch._dynamo.config %s: a hooked instance of a repeated module "
                  "may compile a graph of its own", ", ".join(raised))


class _HookGuardsOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch._dynamo.config`` with the other finders, executes it, then switches its
    module-hook guards on and raises its recompile limit as far as the sessions attached
    so far asked (see :func:`_guard_module_hooks`); removes itself on first use."""

    _NAME = "torch._dynamo.config"

    def find_spec(self, fullname, path, target=None):
        if fullname != self._NAME:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", None) and finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self._inner = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def __getattr__(self, name):  # get_source, get_code, ...: the real loader's
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def exec_module(self, module):
        self._inner.exec_module(module)
        config = sys.modules.get(self._NAME, module)
        if getattr(config, "skip_nnmodule_hook_guards", False):
            config.skip_nnmodule_hook_guards = False
        _raise_recompile_limit(config, _PENDING_RECOMPILE_LIMIT[0])
        hook_compile_start()
