"""The torch hooks of a session: a call's :class:`HookContext`, the checks on what plugins
return, and the bindings that run the plugins' per-call hooks, one per hooked module
(:class:`_ModuleBinding`: forward pre/post hooks and the output-gradient sites; the hot path)
and one per hooked parameter (:class:`_ParamBinding`: the gradient's tensor hook).

A binding holds tuples of ``(plugin, bound method)`` that ``Session`` resolves once through
pluggy; the torch hooks loop over those plain tuples (see docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from . import _bank
from ._bank import _is_compiling, is_dtensor, is_lazy, unmaterialized
# != -1 in eager code: a forward running inside backward, i.e. activation checkpointing
# recomputing it (compiled code cannot ask at trace time: the stats op's kernel asks when
# it runs, see skip_recompute in hookplug.ops)
from ._checkpoint import _graph_task_id
from ._manager import PluginError
from ._plugin import user_stacklevel
from .structures import children, iter_tensors, map_tensors, rebuild

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["HookContext"]


# torch.export (also compiling): hooks run no plugin, so the exported program holds no
# hookplug op and no bank of the session (it would need hookplug to load, and keep
# accumulating into the session after remove())
def _is_exporting() -> bool:
    """torch.export is running (not merely torch.compile): its flag, read as an attribute.
    dynamo in torch 2.11 folds a call of ``torch.compiler.is_exporting()`` to True under any
    torch.compile (2.13 reads the flag), which made every compiled hook a no-op there."""
    return getattr(torch.compiler, "_is_exporting_flag", False)
# torch.jit.trace (and the TorchScript ONNX exporter): likewise, or the traced graph would
# call the session's ops on its bank (still accumulating after remove(), needing hookplug
# wherever it runs); capture's per-call state made trace's check fail
_is_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)
# torch.fx tracing (``symbolic_trace``, torchvision's ``create_feature_extractor`` and
# ``get_graph_node_names``, ``make_fx``): likewise. symbolic_trace ran the hooks of the
# modules it traces through on Proxies (capture kept them), make_fx traced stats' op into its
# graph. Its flag, read inline as ``_FX_FLAG_IN.__dict__.get(_FX_FLAG)`` (a helper call on the
# hot path costs 0.1 us; a missing attribute of a ``threading.local`` 0.3 us): per thread
# from torch 2.14 on, a module global before
_fx = torch.fx._symbolic_trace
_FX_FLAG_IN, _FX_FLAG = ((_fx._is_fx_tracing_tls, "flag") if hasattr(_fx, "_is_fx_tracing_tls")
                         else (_fx, "_is_fx_tracing_flag"))
del _fx
_get_ident = threading.get_ident
# a binding's impls where it runs nothing: (fwd_in, fwd_out, out_grad, sampling key)
_NO_IMPLS: Tuple = ((), (), (), None)
_CALL_IMPL = nn.Module._call_impl.__code__  # the frame torch runs a module's hooks and forward in


# the hook name a failure of forward_output given no output is reported under
_GIVEN_NONE = "hookplug_forward_output (given output=None: the forward raised, or returned None)"

def interrupted_calls(open_calls: list, module) -> list:
    """The oldest of ``open_calls`` (this thread's calls of ``module`` that began and did not
    end, oldest first, the call now starting not among them) that no longer run: a
    ``BaseException`` (Ctrl-C) in ``forward`` runs no post hook. The calls still running are
    the ``Module._call_impl`` frames of ``module`` on the stack, less the one starting; none
    is dropped where no such frame is found (a module called some other way)."""
    running = 0
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _CALL_IMPL and f.f_locals.get("self") is module:
            running += 1
        f = f.f_back
    if not running:
        return []
    return open_calls[:max(0, len(open_calls) - (running - 1))]


# a hook's argument torch leaves out where it calls a copy of it registered without
# with_kwargs (see _ModuleBinding.foreign)
_FOREIGN = object()


class _RecomputeMark:
    """What a recompute's pre hook leaves in a binding's ``_pending`` (it has no context of
    its own), tagged with its thread like a context: each thread takes only its own entries,
    so a forward on one thread cannot take another thread's recompute mark, nor the reverse."""

    __slots__ = ("_thread",)

    def __init__(self, thread: int):
        self._thread = thread


def _NO_SESSION() -> None:
    """A context's session reference when it has none (benchmarks, tests)."""
    return None


_inference_mode = torch.is_inference_mode_enabled


def _has_container_arg(args, kwargs) -> bool:
    """Whether an argument is a list or dict (one the call may append its outputs to)."""
    for a in args:
        if isinstance(a, (list, dict)):
            return True
    for a in kwargs.values():
        if isinstance(a, (list, dict)):
            return True
    return False


def _inputs_at_call(args, kwargs) -> Optional[set]:
    """The ``id`` of every input tensor as a call begins, where an argument is a list or
    dict (a feature list torchvision's FPN blocks append their new outputs to: read after
    ``forward``, those outputs were taken for inputs passed through); None otherwise (the
    arguments as they are after ``forward`` say the same)."""
    return _input_ids(args, kwargs) if _has_container_arg(args, kwargs) else None


def _own_outputs(output, args, kwargs, inputs: Optional[set] = None):
    """``(output to use or None, ids)``: each output tensor that needs a gradient and is one
    of the call's inputs (``nn.Identity``, an empty ``nn.Sequential`` shortcut, Dropout in
    eval) replaced by ``t.view_as(t)``: same values and memory, its own autograd node, so a
    gradient hook on it sees the gradient through this module only (as
    ``register_full_backward_hook``'s ``grad_output``), not every use of the shared tensor.
    ``ids``: the ``id`` of every such input; one left in place gets no gradient hook. It is
    left where replacing it could change what the model computes or returns: a layout
    without views (sparse, mkldnn, strided nested tensors), or inside a container other
    than a tuple, namedtuple (or a subclass adding no attributes, PackedSequence) or HF
    ModelOutput (a list or dict may be the module's own state, a dataclass or subclass may
    hold what a rebuild drops); the session warns once per module. ``(x, x)`` gets one view
    at both places. A leaf that is not an input (a Parameter returned as is) stays itself
    and gets no hook (it would keep it for good). ``inputs``: the input ids as the call
    began (:func:`_inputs_at_call`), else read from the arguments now."""
    if inputs is None and _is_compiling():
        return _own_outputs_traced(output, args, kwargs)
    if isinstance(output, torch.Tensor):  # the common case, without walking anything
        if not output.requires_grad or id(output) not in (_input_ids(args, kwargs) if inputs is None else inputs):
            return None, ()
        return (output.view_as(output) if _has_views(output) else None), (id(output),)
    shared = set()
    for _, t in iter_tensors(output):
        if t.requires_grad:
            if inputs is None:
                inputs = _input_ids(args, kwargs)
            if id(t) in inputs:
                shared.add(id(t))
    if not shared:
        return None, ()
    new = _with_views(output, shared, {})
    return (None if new is output else new), shared


def _own_outputs_traced(output, args, kwargs):
    """:func:`_own_outputs` in code dynamo traces: an output is found among the inputs by
    identity (``is``), not by ``id()``, which torch 2.11's dynamo does not trace for a tensor
    made inside the graph (``call_id() without source``: a graph break at every grad site
    taking tensor hooks, e.g. under compiled autograd). The rare output that is an input
    takes the ``id()`` path (it may break the graph there)."""
    ins = [x for _, x in iter_tensors((args, kwargs))]
    if isinstance(output, torch.Tensor):
        if not output.requires_grad or not any(output is x for x in ins):
            return None, ()
    elif not any(t.requires_grad and any(t is x for x in ins) for _, t in iter_tensors(output)):
        return None, ()
    return _own_outputs(output, args, kwargs, {id(x) for x in ins})


def _is_model_output(obj) -> bool:
    """An HF ``ModelOutput`` (an OrderedDict subclass and a dataclass), or another such."""
    return isinstance(obj, dict) and dataclasses.is_dataclass(obj)


def _has_views(t: torch.Tensor) -> bool:
    """Whether ``t.view_as(t)`` works: strided and jagged layouts (not sparse, mkldnn or a
    strided nested tensor)."""
    layout = t.layout
    return (layout is torch.strided and not t.is_nested) or layout is torch.jagged


def _with_views(obj, shared: set, views: dict):
    """``obj`` with the tensors whose ``id`` is in ``shared`` replaced by views (one per
    tensor, in ``views``), rebuilt only where it changed and rebuilds as it was."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in shared or not _has_views(obj):
            return obj
        view = views.get(id(obj))
        if view is None:
            view = views[id(obj)] = obj.view_as(obj)
        return view
    kids = children(obj, init_only=True)
    if kids is None:
        return obj
    items = [(key, _with_views(value, shared, views)) for key, _, value in kids]
    if all(new is value for (_, new), (_, _, value) in zip(items, kids)):
        return obj
    if not (type(obj) is tuple or _is_model_output(obj)
            # a namedtuple, or a subclass of one with no attributes of its own (PackedSequence)
            or (isinstance(obj, tuple) and hasattr(obj, "_fields") and not getattr(obj, "__dict__", None))):
        return obj
    return rebuild(obj, items)


_SCALARS = (int, float, bool, str, type(None))


def _input_ids(args, kwargs) -> set:
    """``id`` of every tensor among a call's arguments (walked into containers only when
    an argument is one)."""
    ids = set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            ids.add(id(a))
        elif not isinstance(a, _SCALARS):
            return {id(x) for _, x in iter_tensors((args, kwargs))}
    return ids


def _phase_of(module: nn.Module) -> str:
    """``"eval"`` for a model (the session's root module: a frozen submodule kept in eval
    mode inside a training model, a distillation teacher, runs in the training step) in
    eval mode or under inference_mode, else ``"train"`` (inside compiled code: inference
    mode where dynamo started compiling the frame, see
    ``hookplug._bank.trace_inference_mode``)."""
    if not module.training:
        return "eval"
    inference = _bank.trace_inference_mode() if _is_compiling() else torch.is_inference_mode_enabled()
    return "eval" if inference else "train"


class HookContext:
    """What a per-call hook knows about the call: module ``name``, ``phase`` (``"train"``,
    or ``"eval"`` when the model is in eval mode or under ``torch.inference_mode``),
    ``call_index`` (how many times this module ran before in this session; -1 inside
    torch.compile'd code, where Python counters would make dynamo recompile), the session's
    ``step`` and ``session``. Inside compiled code ``step`` is a Python int read at trace
    time: a traceable plugin that reads it specialises the graph on it, so dynamo recompiles
    every step (see ``hookplug.hookspecs``)."""

    # _impls: the binding's (fwd_in, fwd_out, out_grad, sampling key) at the call's pre hook:
    # its post hook runs the same step's plugins (set only on contexts left in _pending)
    # _inputs: the ids of the call's input tensors as it began, where an argument is a list or
    # dict the call may append its own outputs to (see _inputs_at_call; contexts in _pending)
    __slots__ = ("name", "call_index", "_step", "_session_ref", "phase", "_thread", "_impls", "_inputs")

    def __init__(self, name: str, call_index: int, step: Optional[int], session: Optional["Session"],
                 phase: str = "train", thread: Optional[int] = None):
        self.name = name
        self.call_index = call_index
        self._step = step
        # held weakly: a context lives on in the tensor hooks of the outputs a user keeps,
        # and those must not keep a removed session (its plugins, their data) alive
        self._session_ref = _NO_SESSION if session is None else session._self_ref
        self.phase = phase
        self._thread = thread  # the calling thread, for contexts the pre hook leaves in _pending (else None)
        self._inputs: Optional[set] = None

    @property
    def session(self) -> Optional["Session"]:
        """The session (None once it is gone)."""
        return self._session_ref()

    @property
    def step(self) -> int:
        """The session's step when the call happened (read lazily inside compiled code)."""
        if self._step is not None:
            return self._step
        s = self.session
        return -1 if s is None else s._step

    # compiled code's per-module tensors (see _TracedContext); None in eager code
    _module_tensors: Optional[Dict[Any, torch.Tensor]] = None

    def __repr__(self) -> str:
        return (f"HookContext(name={self.name!r}, phase={self.phase!r}, "
                f"call_index={self.call_index}, step={self.step})")


class _TracedContext(HookContext):
    """A call's context inside compiled code. Nothing per module is read unless a plugin
    asks: ``name`` comes from the module's binding when read (a traced read makes the graph
    that module's own), and ``_module_tensors`` is the binding's dict of per-module tensors
    of the call's phase (e.g. ``stats``' row index): dynamo passes those as graph inputs
    guarded by shape and dtype only, so identical hooked blocks share one graph
    (``block.compile()``)."""

    __slots__ = ("binding", "tensors")

    def __init__(self, binding: "_ModuleBinding", phase: str,
                 tensors: Optional[Dict[Any, torch.Tensor]] = None):
        self.binding = binding
        self.tensors = tensors  # a backward's: the ones its _GradSite saved
        self.call_index = -1
        self._step = None
        self.phase = phase
        self._thread = None

    @property
    def name(self) -> str:
        return self.binding.name

    @property
    def session(self) -> "Session":  # no weak reference to call in a traced graph
        return self.binding.session

    @property
    def _module_tensors(self) -> Dict[Any, torch.Tensor]:
        return self.binding.module_tensors[self.phase] if self.tensors is None else self.tensors


# -- what plugins return ----------------------------------------------------------------------

def _kind(value) -> Optional[str]:
    """The structure a forward output has, as far as a returned replacement must keep it."""
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, dict):  # also HF ModelOutput
        return "a dict"
    if isinstance(value, (list, tuple)):
        return "a list or tuple"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "a dataclass"
    return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    return type(value).__name__


def _fold(session: "Session", impls, hook_name: str, value, before: tuple, after: tuple, where: str):
    """pluggy's call loop for the per-call hooks that may replace a value: each ``(plugin,
    fn)`` in order is called with ``(*before, value, *after)``; a non-None result that
    passes :func:`_returned_ok` replaces ``value`` for the next plugin (failures go through
    ``on_error``). Returns the final value, or None when no plugin changed it. Errors name
    the call site as ``where`` followed by ``after`` (a gradient's path)."""
    changed = False
    for plugin, fn in impls:
        try:
            res = fn(*before, value, *after)
        except Exception as exc:  # noqa: BLE001 - on_error decides
            session._plugin_failed(plugin, hook_name, exc)
            continue
        if res is not None and _returned_ok(session, plugin, hook_name, where, value, res, after):
            value = res
            changed = True
    return value if changed else None


def _returned_ok(session: "Session", plugin, hook_name: str, where: str, before, result,
                 after: tuple = ()) -> bool:
    """Check a non-None value a plugin returned from ``hook_name``; report a bad one through
    ``session._plugin_failed`` (raise, or warn and disable) and return False. ``where``
    followed by ``after`` names the call site, joined only for the error: compiled code
    that read the module's ``where`` on success would be that module's own graph.

    A forward output keeps its kind (a tensor stays a tensor; values and shapes may change);
    a gradient keeps the incoming gradient's shape, dtype and device."""
    if hook_name == "hookplug_forward_output":
        kind = _kind(before)
        if kind is None or _kind(result) == kind:
            return True
        expected = f"None or {kind} like the module's output ({_describe(before)})"
    else:
        if (isinstance(result, torch.Tensor) and result.shape == before.shape
                and result.dtype == before.dtype and result.device == before.device):
            return True
        expected = f"None or a tensor like the incoming grad ({_describe(before)})"
    entry = session._entry_of.get(id(plugin))
    name = entry.name if entry is not None else type(plugin).__name__
    where = " ".join((where, *after))
    session._plugin_failed(plugin, hook_name, PluginError(
        f"plugin {name!r}: {hook_name} for {where} must return {expected}, got {_describe(result)}"))
    return False


def _base_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``t`` views (``_base``, which dynamo traces), else ``t``: two
    tensors share memory when they are one, one views the other, or both view one base."""
    return t if t._base is None else t._base


def _aliases_input(t: torch.Tensor, args, kwargs) -> bool:
    """Whether ``t`` shares memory with one of the module's input tensors (keyword ones too)."""
    base = _base_of(t)
    for _, a in iter_tensors((args, kwargs), "input"):
        if base is _base_of(a):
            return True
    return False


def _plain_container(obj) -> bool:
    """Whether ``obj`` is a tensor, or nested tuples, lists, dicts, namedtuples and HF
    ModelOutputs (whatever else), which :func:`map_tensors` rebuilds as they were."""
    kids = children(obj)
    if kids is None:
        return True
    t = type(obj)
    plain = (t in (tuple, list, dict) or (t.__bases__ == (tuple,) and hasattr(obj, "_fields"))
             or _is_model_output(obj))
    return plain and all(_plain_container(v) for _, _, v in kids)


def _compiled_autograd_may_run() -> bool:
    """Whether compiled autograd is on, or will be for a backward dynamo traces now (its
    config flag, or ``compiled_autograd._enable``), read at trace time (dynamo guards on
    it). Not while compiled autograd runs a backward (``in_compiled_autograd_region``): a
    forward traced there is a checkpoint's recompute, which must take the path its forward
    took (``_enable`` around ``backward()`` only: the grad-site op), else it saves other
    tensors and torch's checkpoint check fails. Compiled autograd copies the AOT backward graph into its own, and the effect token
    of :class:`_GradSite`'s op fails there under inductor (dynamo cannot trace it), while it
    traces tensor hooks as eager code does: grad sites take those then."""
    config = sys.modules.get("torch._dynamo.config")
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(config, "compiled_autograd", False)
                or getattr(ca, "compiled_autograd_enabled", False))


class _GradSite(torch.autograd.Function):
    """A module output's grad site in compiled code: ``hook(grad)`` in backward, identity
    otherwise. dynamo traces it, backward included, with no graph break (it breaks on
    ``grad_fn``, and on ``register_hook`` of an intermediate where torch does not trace
    those; in 2.13, which does, the traced hook makes transformers' DynamicCache frames
    fall back to eager).
    Forward clones: a view returned by a Function refuses later in-place ops
    (``ReLU(inplace=True)``); inductor fuses the clone away. ``tensors`` (the module's
    per-module tensors, see ``_TracedContext``) are saved for backward and handed to the
    hook: a tensor the backward only closed over would be a free variable of the compiled
    backward, which compiled autograd switched on around ``backward()`` fails on."""

    @staticmethod
    def forward(ctx, t, hook, *tensors):
        ctx.hook = hook
        ctx.save_for_backward(*tensors)
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        res = ctx.hook(grad, saved)
        return (grad if res is None else res, None, *(None for _ in saved))


def _call(hook, *args):
    return hook(*args)


# {reason: torch.compiler.disable(_call, reason=reason)}, made once dynamo is imported
_EAGER_RUNNERS: Dict[str, Callable] = {}


def _eager_reason(plugins: List[str]) -> str:
    """What dynamo says when it refuses the graph break of an eager runner (fullgraph=True)."""
    names = ", ".join(repr(n) for n in plugins)
    who = f"plugins {names} set" if len(plugins) > 1 else f"plugin {names} sets"
    return (f"hookplug {who} traceable = False: hooks run outside the graph, a graph break per "
            "hooked module call, which torch.compile(fullgraph=True) forbids; compile without "
            "fullgraph=True, or attach such plugins to modules outside the fullgraph region")


def _make_eager_runner(reason: str) -> Callable:
    runner = _EAGER_RUNNERS.get(reason)
    if runner is None:
        try:
            runner = torch.compiler.disable(_call, reason=reason)
        except TypeError:  # a torch whose disable() takes no reason
            runner = torch.compiler.disable(_call)
        _EAGER_RUNNERS[reason] = runner
    return runner


def _outside_graph(reason: str, hook, *args):
    """Run a hook from compiled code as eager code: dynamo does not trace it (a graph break,
    named by ``reason`` where fullgraph=True refuses it), so ``is_compiling()`` is False
    inside and the eager path runs. The runner is made at attach where dynamo is imported
    already (importing it for a session that may never compile would cost seconds), else by
    the first compiled call, outside the graph."""
    return _make_eager_runner(reason)(hook, *args)


class _ModuleBinding:
    """The torch hooks of one module: tuples of ``(plugin, fn)`` per hook kind.

    ``variants[sampling]`` holds the tuples for sampled and unsampled steps (plugins with
    ``sampled = False`` run on both); ``Session._apply_sampling`` swaps them in for eager
    code (``impls``: the three together; a call's pre hook reads it once and its post hook
    runs the same, so a ``step()`` on another thread during the call cannot split it).
    Compiled code always uses the sampled tuples (``all_*``: swapping would make dynamo
    recompile); plugins that sample there gate themselves on the device (stats).
    """

    __slots__ = ("name", "where", "session", "fwd_in", "fwd_out", "out_grad", "all_in", "all_out",
                 "all_grad", "grad_in_graph", "eager_only", "eager_reason", "calls", "has_pre",
                 "has_post", "variants", "impls", "recompute", "_pending", "module_tensors", "_ref",
                 "__weakref__")

    def __init__(self, name: str, session: "Session"):
        self.name = name
        self.where = f"module {name!r}"  # the call site, in plugin errors
        self.session = session
        self.fwd_in: Tuple = ()
        self.fwd_out: Tuple = ()
        self.out_grad: Tuple = ()
        self.all_in: Tuple = ()
        self.all_out: Tuple = ()
        self.all_grad: Tuple = ()
        self.impls: Tuple = _NO_IMPLS  # (fwd_in, fwd_out, out_grad, sampling key)
        self.grad_in_graph = False  # every all_grad plugin can be traced into a compiled backward
        self.eager_only = False  # a plugin here is not traceable: compiled code runs the eager path
        self.eager_reason = ""  # why, naming those plugins (dynamo's fullgraph=True error)
        self.calls = 0  # every call, sampled or not
        self.has_pre = False
        self.has_post = False
        self.variants: Dict[bool, Tuple[Tuple, Tuple, Tuple]] = {}
        # plugins told of a forward re-run inside backward (see Plugin._recompute_started)
        self.recompute: Tuple = ()
        # pushed by pre_hook, taken by post_hook: every thread appends and takes only its
        # own entries (by identity, one step under the GIL), never by position
        self._pending: List[Any] = []  # HookContext, or _RecomputeMark
        # per phase (see _TracedContext): a graph guards on the table it reads, so the eval
        # rows made after the first eval pass must not change the training graph's table
        self.module_tensors: Dict[str, Dict[Any, torch.Tensor]] = {"train": {}, "eval": {}}
        self._ref = weakref.ref(self)  # what an output's tensor hook holds (see _output_grad_hook)

    def _new_ctx(self, module, compiling: bool) -> HookContext:
        """A call's context. Inside compiled code nothing Python-side that changes per call
        or per step is read (no recompiles): call_index is -1, step is read lazily."""
        root = self.session._model_ref()  # the phase is the model's (see _phase_of)
        if root is None:
            root = module
        if compiling:
            return _TracedContext(self, _phase_of(root))
        index = self.calls
        self.calls = index + 1
        phase = "train" if root.training and not _inference_mode() else "eval"
        return HookContext(self.name, index, self.session._step, self.session, phase, _get_ident())

    def foreign(self, module, post: bool) -> None:
        """A hook of ours that torch registered again on another module, without
        ``with_kwargs``: torch.ao.quantization's in-place swaps (``fuse_modules``,
        ``prepare``/``convert``, ``prepare_qat``, ``quantize_dynamic`` with ``inplace=True``)
        copy the swapped module's forward hooks onto the new one. It does nothing there (the
        new module computes something else than the one selected); ``remove()`` takes it off.
        Inside compiled code it does not warn either: dynamo cannot trace ``warnings.warn``
        (a graph break, an error under ``fullgraph=True``). The post hook's copy takes this
        thread's pending call of the module off (``fuse_modules`` keeps the selected ReLU,
        pre hook and all, inside the fused module that runs the copy of its post hook)."""
        compiling = _is_compiling()
        if post and self._pending and not compiling:
            self._own_pending()  # as post_hook takes it
        s = self.session
        if s is not None and not s._foreign_warned and not s._removed and not compiling:
            s._foreign_warned = True  # once a session: it names the first one
            warnings.warn(
                f"hookplug: the hooks of module {self.name!r} were copied by torch onto another "
                f"module, {type(module).__name__} (torch.ao.quantization's fuse_modules, prepare, "
                "convert, quantize_dynamic with inplace=True copy a swapped module's forward "
                "hooks): they do nothing there, and those modules are not observed; attach after "
                "the transformation", RuntimeWarning, stacklevel=user_stacklevel())

    def retire(self) -> None:
        """At ``remove()``: no plugin, no session. A call torch still makes (a hook list it
        took before ``remove()``, on another thread; a copy torch made where ``remove()``
        cannot reach) does nothing, and the binding keeps neither the plugins nor the
        session alive."""
        self.fwd_in = self.fwd_out = self.out_grad = ()
        self.all_in = self.all_out = self.all_grad = ()
        self.impls = _NO_IMPLS
        self.variants, self.recompute = {}, ()
        self.has_pre = self.has_post = False
        self.session = None

    def __reduce__(self):
        """A copy or pickle of a model holding such a copy (copies of the model leave the
        hooks of its selected modules out, see ``_HookFreeState``) gets an inert binding,
        not the session."""
        return _inert_binding, (self.name,)

    def pre_hook(self, module, args, kwargs=_FOREIGN):
        if kwargs is _FOREIGN:
            return self.foreign(module, False)
        compiling = _is_compiling()
        if compiling and _is_exporting():
            return None
        if compiling and self.eager_only:
            return _outside_graph(self.eager_reason, self.pre_hook, module, args, kwargs)
        if not compiling and _graph_task_id() != -1:  # a recompute (activation checkpointing)
            if self.has_post:
                self._pending.append(_RecomputeMark(_get_ident()))
            for plugin in self.recompute:
                plugin._recompute_started(self.name)
            return None
        if compiling:
            impls = self.all_in
        else:  # read once: this call's post hook runs the same step's tuples (see _impls)
            step_impls = self.impls
            impls = step_impls[0]
        if not impls and not self.has_post:
            if not compiling:
                self.calls += 1
            return None
        if not compiling and (_is_tracing() or _FX_FLAG_IN.__dict__.get(_FX_FLAG)):
            return None  # (checked where there is work: an unsampled call does not pay it)
        s = self.session
        if s is None:  # retired while this call was on its way (see retire)
            return None
        ctx = self._new_ctx(module, compiling)
        if self.has_post and not compiling:  # the same ctx reaches forward_output for this call
            # (compiled code makes an equal one there: a traced list mutation graph-breaks
            # inside a checkpoint's region and is lost when its early stop raises)
            ctx._impls = step_impls
            if step_impls[2]:  # its grad sites: what was an input before forward appended to it
                ctx._inputs = _inputs_at_call(args, kwargs)
            if self._pending:  # (rare: nested or overlapping calls, or ones Ctrl-C left)
                self._drop_interrupted(module)
            self._pending.append(ctx)
        if not impls:
            return None
        changed = False
        for plugin, fn in impls:
            try:
                res = fn(ctx, module, args, kwargs)
            except Exception as exc:  # noqa: BLE001
                s._plugin_failed(plugin, "hookplug_forward_input", exc)
                continue
            if res is not None:
                if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], (tuple, list))
                        and isinstance(res[1], dict)):
                    got = (f"({', '.join(type(r).__name__ for r in res)})"
                           if isinstance(res, tuple) else type(res).__name__)
                    s._plugin_failed(plugin, "hookplug_forward_input", PluginError(
                        f"plugin {s._entry_of[id(plugin)].name!r}: hookplug_forward_input must return None or "
                        f"(args: tuple, kwargs: dict), got {got}"))
                    continue
                args, kwargs = res
                args = tuple(args)
                changed = True
        return (args, kwargs) if changed else None

    def note_inputs(self, module, args, kwargs=_FOREIGN):
        """The pre hook of a module with grad sites and no forward-input plugin: a call with a
        list or dict argument takes :meth:`pre_hook`'s path (a context in ``_pending``, which
        keeps the inputs as the call began, see :func:`_inputs_at_call`); any other costs a
        look at its arguments' types."""
        if kwargs is _FOREIGN:
            return self.foreign(module, False)
        if not _has_container_arg(args, kwargs) or _is_compiling():  # (compiled grad sites
            return None                                               # read the arguments as traced)
        return self.pre_hook(module, args, kwargs)

    def post_hook(self, module, args, kwargs, output=_FOREIGN):
        """Also runs (``always_call``) when ``forward`` raised; ``output`` is None then.
        Eager code runs inline (the hot path): one plugin and no pre hook or gradient
        plugin cost a context and one call."""
        if output is _FOREIGN:
            return self.foreign(module, True)
        if _is_compiling():
            if _is_exporting():
                return None
            if self.eager_only:
                return _outside_graph(self.eager_reason, self.post_hook, module, args, kwargs,
                                      output)
            return self._post_hook_compiled(module, args, kwargs, output)
        # this thread's own pending call (other threads append and take theirs meanwhile);
        # None where it has none (a call whose pre hook left no context)
        ctx = self._own_pending() if self._pending else None
        if ctx is not None:
            if ctx.__class__ is _RecomputeMark:  # a recompute's mark
                for plugin in self.recompute:
                    plugin._recompute_ended(self.name, output)
                if not self.fwd_out and not self.out_grad:
                    return None
                return self._post_hook_recompute(module, args, kwargs, output)
            # the tuples of the step the call began in: a step() on another thread since
            # (every=N) must not run the output half of a call whose input half did not
            # run, or skip the output half of one whose input half did
            inputs, ctx._inputs = ctx._inputs, None  # (as the call began: see _inputs_at_call)
            step_impls, ctx._impls = ctx._impls, None  # (the context lives on in the output's
            # grad hook, which must not hold the plugins' bound methods: see _session_ref)
            if step_impls is not self.impls:  # a step() or a plugin disabled since: the
                # plugins of the call's step that are still enabled
                step_impls = self.variants.get(step_impls[3], _NO_IMPLS)
            fwd_out, out_grad = step_impls[1], step_impls[2]
            if not fwd_out and not out_grad:
                return None
        else:
            inputs = None
            fwd_out, out_grad = self.fwd_out, self.out_grad
            if not fwd_out and not out_grad:  # e.g. an unsampled step: count the call, no more
                self.calls += 1
                return None
            if _is_tracing() or _FX_FLAG_IN.__dict__.get(_FX_FLAG):  # (pre_hook left no ctx)
                return None
            if _graph_task_id() != -1:
                return self._post_hook_recompute(module, args, kwargs, output)
            # no thread: only pre_hook's contexts wait in _pending
            index = self.calls
            self.calls = index + 1
            s = self.session
            if s is None:  # retired while this call was on its way (see retire)
                return None
            root = s._model_ref()  # the phase is the model's (see _phase_of)
            ctx = HookContext(self.name, index, s._step, s,
                              "train" if (module if root is None else root).training and not _inference_mode()
                              else "eval")
        new = None
        for plugin, fn in fwd_out:  # _fold's loop, inlined: the call costs as much as the rest
            try:
                res = fn(ctx, module, args, kwargs, output if new is None else new)
            except Exception as exc:  # noqa: BLE001 - on_error decides
                given = output if new is None else new
                self.session._plugin_failed(plugin, "hookplug_forward_output" if given is not None
                                            else _GIVEN_NONE, exc)
                continue
            if res is not None and _returned_ok(self.session, plugin, "hookplug_forward_output", self.where,
                                                output if new is None else new, res):
                new = res
        if not out_grad:
            return new
        return self._watch_grads(ctx, module, args, kwargs, output if new is None else new, new, inputs)

    def _post_hook_compiled(self, module, args, kwargs, output):
        """``post_hook`` inside compiled code: the sampled tuples always, nothing Python-side
        that changes per call (no recompiles), gradient sites traced into the graph."""
        fwd_out, out_grad = self.all_out, self.all_grad
        if not fwd_out and not out_grad:
            return None
        ctx = self._new_ctx(module, True)  # equal to pre_hook's (see there)
        new = _fold(self.session, fwd_out, "hookplug_forward_output", output, (ctx, module, args, kwargs), (),
                    self.where) if fwd_out else None
        if new is not None:
            output = new
        if out_grad and torch.is_grad_enabled():
            # no tensor hook: traced into the backward graph (not compiled autograd's)
            if self.grad_in_graph and not _compiled_autograd_may_run():
                wrapped = self._grad_sites(ctx, module, args, kwargs, output)
                if wrapped is not None:
                    return wrapped
            return self._hook_grads(ctx, module, args, kwargs, output, new)
        return new

    def _post_hook_recompute(self, module, args, kwargs, output):
        """A recompute (activation checkpointing): forward is not observed again, grads
        still are, with the context of the call it repeats."""
        if not self.out_grad:
            return None
        ctx = self.session._recompute.recompute_ctx(self)
        if ctx is None:
            ctx = HookContext(self.name, -1, None, self.session, _phase_of(self.session._phase_module(module)))
        return self._watch_grads(ctx, module, args, kwargs, output, None)

    def _watch_grads(self, ctx, module, args, kwargs, output, new, inputs: Optional[set] = None):
        """Eager code: :meth:`_hook_grads` with autograd on; with it off, remember a call
        that may be a reentrant checkpoint's first forward and return ``new``."""
        if not torch.is_grad_enabled():
            if self.session._training():
                self.session._recompute.forward_call(self, ctx)
            return new
        return self._hook_grads(ctx, module, args, kwargs, output, new, inputs)

    def _hook_grads(self, ctx, module, args, kwargs, output, new, inputs: Optional[set] = None):
        """A tensor hook on each output tensor that needs a gradient (a module's own view of
        one it shares, see :func:`_own_outputs`); returns the output to use, or ``new``."""
        own, shared = _own_outputs(output, args, kwargs, inputs)
        if own is not None:
            output = new = own
        found: List[Tuple[torch.Tensor, List[str]]] = []
        for path, t in iter_tensors(output):
            if shared and id(t) in shared:  # an input left in place: no grad site
                self._warn_no_site(path, output)
                continue
            # a leaf (a Parameter returned as is) would keep a tensor hook for good
            if t.requires_grad and t.grad_fn is not None:
                for u, paths in found:
                    if u is t:  # one tensor at two paths, (y, y): one hook, or a plugin
                        paths.append(path)  # steering its gradient would do so twice
                        break
                else:
                    found.append((t, [path]))
        for t, paths in found:
            # every path's hooks with the whole gradient where the tensor has several, as
            # compiled code runs them
            t.register_hook(functools.partial(_output_grad_hook, self._ref, ctx, weakref.ref(module),
                                              paths[0] if len(paths) == 1 else paths))
        return new

    def _warn_no_site(self, path: str, output) -> None:
        """Once a session per module: a grad site left out (see :func:`_own_outputs`)."""
        s = self.session
        if s is None or self.name in s._no_site_warned:
            return
        s._no_site_warned.add(self.name)
        warnings.warn(
            f"hookplug: module {self.name or '<root>'!r} returns its input at {path} (in a "
            f"{type(output).__name__}, or a tensor without views); it has no gradient site there: "
            "a view of its own would change what the model returns (see hookplug_output_grad "
            "in the README)", RuntimeWarning, stacklevel=user_stacklevel())

    def _drop_interrupted(self, module) -> None:
        """Drop this thread's pending contexts of calls that are no longer running: a
        ``BaseException`` (Ctrl-C) in ``forward`` runs no post hook, and a session that never
        steps (serving, forward-only) would keep one context per such call for good."""
        me, pending = _get_ident(), self._pending
        # a snapshot (one step), and removal by identity: other threads' entries come and go
        # meanwhile, so a position read here may hold another thread's call by the time it is used
        mine = [c for c in pending[:] if c._thread == me]
        for c in mine:
            if c.__class__ is _RecomputeMark:  # a recompute's that never ended: a forward on
                pending.remove(c)  # this thread runs outside backward, so none is running
        mine = [c for c in mine if c.__class__ is not _RecomputeMark]
        if mine:
            for c in interrupted_calls(mine, module):
                pending.remove(c)

    def _own_pending(self) -> Any:
        """Take this thread's latest pending entry (a ``_RecomputeMark``: a recompute's), or
        None where it has none. Only this thread removes its entries, so the one found is
        still there for ``remove`` (by identity: neither class defines ``__eq__``)."""
        me, pending = _get_ident(), self._pending
        try:
            c = pending[-1]
        except IndexError:  # (emptied by other threads since the caller looked: none is ours)
            return None
        if c._thread == me:  # the usual case: this thread's latest entry is the last one
            pending.remove(c)
            return c
        # a snapshot (one step): a list iterator stops early where other threads' removals
        # shrink the list under it; this thread's entries in it are still in the list
        for c in reversed(pending[:]):
            if c._thread == me:
                pending.remove(c)
                return c
        return None

    def _grad_sites(self, ctx, module, args, kwargs, output):
        """Compiled code: ``output`` with each tensor that needs a grad site passed through
        :class:`_GradSite` once (a tensor at several paths runs every path's hooks with the
        whole gradient, as tensor hooks do); ``output`` itself when none needs one. None
        where the clone could change what the model computes or returns: a view or an
        input returned as output, or two outputs that share memory (``h, h[:, 0]``; the
        clones would not alias it, or each other) or a container other than a tuple, list,
        dict, namedtuple or HF ModelOutput; those take the tensor hooks."""
        found: List[Tuple[torch.Tensor, List[str]]] = []
        for path, t in iter_tensors(output):
            if not t.requires_grad:
                continue
            # (before the leaf test: dynamo traces a graph input, an activation under
            # regional compilation, as a leaf)
            if _aliases_input(t, args, kwargs):
                return None
            if t.is_leaf:  # a leaf would keep a tensor hook for good
                continue
            for u, paths in found:
                if u is t:
                    paths.append(path)
                    break
                if _base_of(u) is _base_of(t):
                    return None
            else:
                found.append((t, [path]))
        if not found:
            return output
        if not _plain_container(output):
            return None
        table = self.module_tensors[ctx.phase]
        keys, tensors = tuple(table), tuple(table.values())
        wrapped = [(t, _GradSite.apply(t, functools.partial(self._grad_hooks, ctx, module, paths, keys),
                                       *tensors))
                   for t, paths in found]

        def swap(path, t):
            for u, w in wrapped:
                if u is t:
                    return w
            return t

        return map_tensors(swap, output)

    def _grad_hooks(self, ctx, module, paths, keys, grad, saved=()):
        """The grad hooks of every path of one tensor: the first replacement is the
        gradient, and the paths after it see it (they steer nothing more), with a context
        whose per-module tensors are those ``_GradSite`` saved (under ``keys``; none in
        eager code)."""
        if keys:
            ctx = _TracedContext(self, ctx.phase, dict(zip(keys, saved)))
        out = None
        for path in paths:  # a later path sees the gradient as steered (a clamp counts once)
            res = self.grad_hook(ctx, module, path, grad if out is None else out)
            if res is not None and out is None:
                out = res
        return out

    def grad_hook(self, ctx, module, path, grad):
        s = self.session
        if s is None or s._removed or grad is None:  # None: removed (see Session._remove)
            # None: no gradient reached this output (an unused output of a node with
            # several, e.g. one chunk of ``x.chunk(2)``, or an autograd.Function's):
            # torch calls tensor hooks with None there; nothing to measure or steer
            return None
        return _fold(s, self.all_grad if _is_compiling() else self.out_grad, "hookplug_output_grad",
                     grad, (ctx, module), (path,), self.where)


def _inert_binding(name: str) -> _ModuleBinding:
    """What a copy of a :class:`_ModuleBinding` is: no session, no plugin."""
    return _ModuleBinding(name, None)


def _output_grad_hook(binding_ref, ctx, module_ref, paths, grad):
    """The tensor hook on a module's output: it reaches the binding and the module weakly,
    so an output a user keeps after ``remove()`` keeps neither the binding, its session nor
    the module alive."""
    binding, module = binding_ref(), module_ref()
    if binding is None or module is None:
        return None
    if isinstance(paths, str):
        return binding.grad_hook(ctx, module, paths, grad)
    return binding._grad_hooks(ctx, module, paths, (), grad)


class _ParamBinding:
    """The tensor hook on one parameter's gradient. The parameter is reached through its
    module (held weakly) and attribute name: a weak reference to the tensor itself would
    stop ``torch.utils.swap_tensors`` (``module.double()`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``)."""

    __slots__ = ("name", "key", "owner_ids", "owner_ref", "attr", "session", "impls", "calls",
                 "variants", "handle", "seen")

    def __init__(self, name: str, owner: nn.Module, attr: str, session: "Session"):
        self.name = self.key = name  # key: in session._param_bindings
        # the modules holding the Parameter once it was replaced (None: the one at attach,
        # whose plugins are those covering its name): the plugins covering them steer it
        self.owner_ids: Optional[frozenset] = None
        # id of the Parameter it last found (no weak reference: see the class docstring; an
        # id reused by a replacement made after the old one was freed goes unnoticed)
        self.seen: Optional[int] = None
        self.owner_ref = weakref.ref(owner)
        self.attr = attr
        self.session = session
        self.handle = None  # of the tensor hook
        self.impls: Tuple = ()
        self.variants: Dict[bool, Tuple] = {}
        self.calls = 0

    def param(self) -> Optional[torch.Tensor]:
        owner = self.owner_ref()
        return None if owner is None else owner._parameters.get(self.attr)

    def hook(self) -> None:
        """Put the tensor hook on the parameter (the session keeps the handle), and on
        every later call install its hook dict again: ``swap_tensors`` (``module.double()``
        under ``swap_module_params_on_conversion``) gives the parameter a new at::Tensor,
        and the dict moves with the Python object but the autograd hook that runs it does
        not. Assigning the dict back installs it on the current one (0.2 us; every hook in
        it runs again, not only ours; an address check would miss a reused address). A
        frozen parameter gets its hook too (``requires_grad`` is on for the registration
        only; torch keeps a leaf's hooks through freezing): it runs once the parameter is
        unfrozen, also in the backward right after ``requires_grad_(True)``."""
        param = self.param()
        if param is None or is_lazy(param):
            return  # (a lazy module's: hooked once its forward materialized it, see _Materialize)
        if not is_dtensor(param) and (id(self.owner_ref()), self.attr) in self.session._fsdp2_owners():
            # FSDP2's unsharded copy between a forward and the reshard (the root group's
            # after a no_grad forward): its hook would steer one backward, then FSDP2 puts the
            # sharded DTensor back, whose hook never runs; hooked never, as the DTensor
            self._warn_fsdp2()
            return
        if self.seen != id(param):
            if self.seen is not None:  # replaced (also while tied to another binding's): the
                self.session._param_replaced(self)  # plugins of its owners now
            self.seen = id(param)
        hooks = param._backward_hooks
        if self.handle is None or hooks is None or self.handle.id not in hooks:
            # first time, or a new Parameter object
            if self.handle is not None:  # the Parameter it was on was replaced
                self._retire_handle()
            if hooks and self._hooked_by_another(param, hooks):
                return  # tied to another name's binding, which hooks it: steered once
            if param.requires_grad:
                self.handle = param.register_hook(self)
            elif (param.is_leaf and (param.is_floating_point() or param.is_complex())
                  and not param.is_inference()):  # (an inference tensor cannot require grad)
                param.requires_grad_(True)
                try:
                    self.handle = param.register_hook(self)
                finally:
                    param.requires_grad_(False)
            else:
                return
            self.session._handles[id(self.handle)] = self.handle
            if _sharded_by_fsdp2(param, self.session.model):
                self._warn_fsdp2()
        else:
            param._backward_hooks = hooks
        if getattr(param, "_fsdp_flattened", False):  # FSDP1's views of its flat parameter,
            self._warn_fsdp2(wrapper="FSDP1's FullyShardedDataParallel")  # wrapped before or after

    def _warn_fsdp2(self, wrapper: str = "FSDP2's fully_shard") -> None:
        if not self.session._fsdp2_warned:
            self.session._fsdp2_warned = True  # once a session: it names the first one
            _warn_fsdp2_param(self.name, wrapper)

    def _hooked_by_another(self, param: torch.Tensor, hooks: dict) -> bool:
        """Another binding of the session hooks ``param`` (tied to it). A hook left by a
        binding whose own Parameter was replaced since (see :meth:`_retire_handle`) comes
        off: this binding takes the Parameter over."""
        for key, h in list(hooks.items()):
            if type(h) is not _ParamBinding or h.session is not self.session:
                continue
            if h.param() is param:
                return True
            handles = self.session._handles
            for hid, handle in list(handles.items()):
                if getattr(handle, "id", None) == key and handle.hooks_dict_ref() is hooks:
                    handle.remove()
                    del handles[hid]
            hooks.pop(key, None)
        return False

    def _retire_handle(self) -> None:
        """Take the hook off the Parameter this binding's is no longer on, and its handle out
        of the session's (one per replacement otherwise), unless another owner of the
        session still has that Parameter (untied by replacing the first owner's): there it
        keeps steering until the next step() hands it to that owner's binding."""
        old, handle = self.handle.hooks_dict_ref(), self.handle
        self.handle = None
        if old is not None:
            for pb in self.session._param_bindings.values():
                p = pb.param() if pb is not self else None
                if p is not None and p._backward_hooks is old:
                    return
        handle.remove()
        self.session._handles.pop(id(handle), None)

    def __call__(self, grad):
        s = self.session
        if s._removed or not self.impls:
            return None
        if _is_compiling():
            ctx = HookContext(self.name, -1, None, s)
        else:
            ctx = HookContext(self.name, self.calls, s._step, s)
            self.calls += 1
        return _fold(s, self.impls, "hookplug_param_grad", grad, (ctx, self.name, self.param()), (),
                     f"parameter {self.name!r}")


def _run_eagerly(*fns) -> None:
    """Have dynamo run ``fns`` (the hooks torch calls) and all they call as they are where
    they are called as frames of their own, from code dynamo does not trace while its frame
    hook is on: it compiled them into graphs of their own, one per module or parameter,
    recompiled up to the recompile limit. The tensor hooks in the backward a compiled
    training step runs after its ``loss.backward()`` graph break (a 12-Linear MLP with
    gradclamp ``params=``: 10 graphs for 2 and the step twice as slow); the module hooks
    around a module called from a frame dynamo gave up on (a ``torch.compiler.disable``d
    forward in an ``nn.Sequential``: 5 graphs for 2, the step 1.8 ms for 0.8). Where
    dynamo traces the module call (or compiled autograd the backward) it inlines them, which
    this does not change. Nothing where this torch has no such setting (private API)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
        from torch._C._dynamo.eval_frame import set_code_exec_strategy

        skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
        for fn in fns:
            set_code_exec_strategy(fn.__code__, skip)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pass


_run_eagerly(_ModuleBinding.pre_hook, _ModuleBinding.post_hook, _output_grad_hook,
             _ParamBinding.__call__)


def _no_hook(*args, **kwargs) -> None:
    """A copied model's stand-in for a hook object of the session's that a copy still
    reaches (through a handle kept on another module: see ``_HookFreeState``)."""


def _inert_hook():
    return _no_hook


class _Rehook:
    """A module's ``load_state_dict`` post-hook: its parameters (new objects under
    ``assign=True``) get their gradient hooks before the next backward."""

    __slots__ = ("bindings",)

    def __init__(self, bindings: List[_ParamBinding]):
        self.bindings = bindings

    def __reduce__(self):  # (copies and pickles get no session)
        return _inert_hook, ()

    def __call__(self, module, incompatible_keys) -> None:
        for pb in self.bindings:
            if not pb.session._removed:
                pb.hook()


class _Materialize:
    """A forward pre-hook while some hooked parameter holds no values (``unmaterialized``),
    so that it gets its gradient hook before the first backward that reaches it, instead of
    at the next ``session.step()``. On the attached model for parameters on ``meta``
    (attached before deferred init: ``to_empty()``, accelerate's
    ``load_checkpoint_and_dispatch`` make new Parameter objects without
    ``load_state_dict``); on the owning module for a lazy module's parameters
    (``nn.LazyLinear``: its own pre-hook, registered before ours, materializes them in place
    at its first forward). It takes itself off once all of its parameters hold values."""

    __slots__ = ("bindings", "handle")

    def __init__(self, bindings: List[_ParamBinding]):
        self.bindings = bindings
        self.handle = None

    def __reduce__(self):  # (copies and pickles get no session)
        return _inert_hook, ()

    def __call__(self, module, args) -> None:
        if _is_compiling():  # (no hook is registered in a trace: session.step() does it)
            return
        pending = False
        for pb in self.bindings:
            if pb.session._removed:
                return
            param = pb.param()
            if param is not None and (unmaterialized(param) or _substituted(param)):
                pending = True  # (the module's own Parameter is still to come)
            elif param is not None:
                pb.hook()
        if not pending:
            self.handle.remove()


def _substituted(param: torch.Tensor) -> bool:
    """``param`` is a tensor ``torch.func.functional_call`` put in a Parameter's place (a
    plain tensor, or one wrapped by ``vmap``/``grad``): not the model's, never hooked."""
    return not isinstance(param, nn.Parameter) or torch._C._functorch.is_functorch_wrapped_tensor(param)


def _sharded_by_fsdp2(param: torch.Tensor, model: Optional[nn.Module]) -> bool:
    """``param`` is a DTensor of a model that ``fully_shard`` (FSDP2) manages."""
    if model is None or not is_dtensor(param):
        return False
    cls = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def fsdp2_owners(model: Optional[nn.Module]) -> frozenset:
    """``(id(module), name)`` of the parameters of ``model`` that ``fully_shard`` (FSDP2)
    manages (its param groups' ``FSDPParam``s; ``ignored_params`` are not among them). Where
    torch's private layout differs: every parameter of a module under an ``FSDPModule``."""
    cls = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if cls is None or model is None:
        return frozenset()
    out = set()
    for top in model.modules():
        if not isinstance(top, cls):
            continue
        try:
            state = top._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # (torch < 2.12: one group or None)
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fp in group.fsdp_params:
                    info = fp._module_info
                    out.add((id(info.module), info.param_name))
                    out.update((id(m), n) for m, n in zip(info.shared_modules, info.shared_param_names))
        except AttributeError:
            out.update((id(m), n) for m in top.modules() for n, _ in m.named_parameters(recurse=False))
    return frozenset(out)


def _warn_fsdp2_param(name: str, wrapper: str = "FSDP2's fully_shard") -> None:
    warnings.warn(
        f"hookplug: parameter {name!r} (and every other one sharded by {wrapper}) "
        "gets no gradient hook: FSDP computes its gradient "
        "on an unsharded copy and reduce-scatters it into .grad directly, so a "
        "parameter-gradient hook (hookplug_param_grad: gradclamp params=, ...) never runs for "
        "it. Steer module-output gradients instead, or clip after backward (the params "
        "plugin measures FSDP gradients from .grad)", RuntimeWarning, stacklevel=user_stacklevel())
