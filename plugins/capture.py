"""``capture``: keep module activations (and optionally inputs and output gradients).

    with hookplug.attach(model, "Conv2d", plugins="capture") as s:
        model(x)
    fmap = s["capture"].features["layer1.0.conv1"]      # detached, same structure as the output
    s["capture"].save("features.safetensors")           # hookplug.load_capture(path) reads it back

Options (keyword-only):

- ``keep="last"|"all"|N``: the last call of each module (the value itself), every call
  (a list, oldest first), or the last ``N`` calls (a list of at most ``N``).
- ``to=None|"cpu"``: keep on the tensor's device, or copy to the host; from CUDA the copy is
  non-blocking into pinned memory (``features`` waits for it when read).
- ``clone=True``: copy what is captured, so a later in-place op (``ReLU(inplace=True)``,
  ``x += ...``) cannot change it. ``clone=False`` keeps detached views (no copy, but a
  later in-place op shows through, and a view keeps its base's whole storage alive, which
  ``nbytes``/``max_bytes`` do not count: they count the view's elements). With ``to="cpu"``
  there is always a copy.
- ``max_bytes=None``: a bound on the bytes held. A call whose tensors would go over it, once
  what it replaces is freed (``keep="last"``/``N``: the oldest call kept), is not captured
  and is counted once in ``skipped``; later calls that fit are captured. A gradient that does
  not fit is not kept (``None``; its call is not counted). The first time, the plugin warns.
  ``nbytes`` never goes past the bound (while a call runs, the inputs of the call it replaces
  are held too, put back if it is not captured).
- ``grads=False``: also keep the gradient of each output in ``grads[name]``, in the output's
  structure (``None`` where no gradient arrived); with ``keep="last"`` that of the last call.
- ``inputs=False``: also keep the arguments, read before ``forward`` runs (as torch's
  forward pre-hooks get them): the positional ones in ``inputs[name]`` (a tuple), the
  keyword ones in ``input_kwargs[name]`` (a dict, ``{}`` for a call given none: an HF
  attention's ``hidden_states=``, ``attention_mask=``, ...), call by call alike. A keyword
  argument holding tensors that is no container (an HF cache, handed to every attention
  call: a copy per call would hold every layer's keys and values each time) is kept as
  ``"<ClassName: not kept>"``; a cache passed positionally, or returned, is copied.

``results()`` is ``features``. ``save(path)`` writes a safetensors file (never pickle): keys
``"<module>/output"``, ``"<module>/output[1]"``, ``"<module>/3/output"`` (call 3 of a list),
``"<module>/grad"``, ``"<module>/input[0]"``, ``"<module>/kwargs.attention_mask"``, plus JSON metadata from which
``hookplug.load_capture(path)`` rebuilds the same dicts (dataclasses come back as dicts).
safetensors holds dense strided tensors only: nested tensors (``torch.nested``, e.g. inside
``nn.TransformerEncoder``'s fast path) and sparse ones are captured like any other, but
``save`` leaves them out with one warning naming them (they load back as ``None``), as it
does tensors on the meta device and quantized ones. complex32/complex128 tensors (dtypes
safetensors lacks) are written as their ``view_as_real`` and load back complex.

Under ``torch.compile`` the capture hooks run outside the graph, as in eager code (the
plugin sets ``traceable = False``: a graph break per hooked call, call indices counted).

Objects that are not tensors, containers or dataclasses but hold tensors (HF caches such
as ``past_key_values``: a ``DynamicCache`` with lists of key/value tensors) are not kept
live: their tensors are captured (detached, cloned) in a dict of the object's attributes
(``__dict__`` and ``__slots__``: ``{"layers": [...], ...}``), with one warning per plugin
naming the class; the dict saves and loads like any other structure. An object holding no
tensor when captured (an empty cache the forward fills) is kept as a ``copy.deepcopy``
where it reaches only plain values, containers, classes, functions and instances of
pure-Python classes made of them; else (it reaches a module, a bound method, a file, a
C type such as ``functools.partial``) it is kept as it is, live.

A call whose ``forward`` raised captures nothing: its output is not captured and its
inputs (read before ``forward``) are dropped again, so ``inputs`` and ``features`` stay call
by call alike; with ``keep="last"`` the last call captured stays, its inputs too. A module
that returns None is captured as None (also when
called while an exception is being handled). ``grads`` and ``inputs`` go call by call
with ``features``: with a list, entry ``i`` of each is of the call of ``features[m][i]``
(``None`` for a call that got no gradient: evaluation between training steps, a frozen
teacher), and ``save`` writes them under the same index; with ``keep="last"`` they are of
the call ``features`` holds (no entry where it has none). The gradients of a call the kept
calls have moved past (``keep="last"``/``N``) are dropped; every gradient held is counted
in ``nbytes`` and bounded by ``max_bytes``.
"""

from __future__ import annotations

import bisect
import copy
import sys
import threading
import types
import warnings
from typing import Any, Dict, List, Literal, Optional, Union

import torch

import hookplug
from hookplug import hookimpl
from hookplug._bank import is_dtensor
from hookplug._binding import interrupted_calls
from hookplug._plugin import user_stacklevel
from hookplug._func import is_batched as _is_batched
from hookplug._func import outside_transforms as _outside_transforms
from hookplug._func import unwrapped as _unwrapped
from hookplug.structures import _rebuild_fields, children, iter_tensors, map_tensors

__all__ = ["CapturePlugin"]

_KINDS = ("features", "grads", "inputs")
_PREFIX = {"features": "output", "grads": "grad", "inputs": "input", "input_kwargs": "kwargs"}


def _part(calls: Dict[str, Any], i: int, per_call: bool) -> Dict[str, Any]:
    """Part ``i`` (0: args, 1: kwargs) of the ``(args, kwargs)`` the inputs store holds per
    call (a list of them, None where a call has none, with ``per_call``)."""
    if per_call:
        return {n: [None if v is None else v[i] for v in values] for n, values in calls.items()}
    return {n: v[i] for n, v in calls.items()}


class _Slot:
    """A placeholder for one tensor of an output structure, named by its path."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __repr__(self) -> str:
        return f"_Slot({self.path!r})"


_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
_OPAQUE = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType)
_MAX_OBJECT_DEPTH = 8


def _keyword_value(value: Any) -> Any:
    """What ``input_kwargs`` keeps of one keyword argument: as ``inputs`` does, except an
    object holding tensors that is no container, kept by its class name only. An HF cache
    (``cache=``, ``past_key_values=``) is handed to every attention call: copied per call it
    held every layer's keys and values once per call (hundreds of MB over a short
    ``generate()``); a 🤗 ``Cache`` also while still empty. Small objects holding no tensor
    (an enum, a slice, a memory format) are kept as ``inputs`` keeps them; a large one is not
    walked or copied per call."""
    if isinstance(value, (torch.Tensor, *_PLAIN)) or children(value) is not None:
        return value
    cache = getattr(sys.modules.get("transformers"), "Cache", None)  # (empty at first: still a cache)
    if (cache is None or not isinstance(value, cache)) and _small_and_tensor_free(value):
        return value
    return f"<{type(value).__name__}: not kept>"


def _small_and_tensor_free(obj: Any, budget: int = 256) -> bool:
    """Whether ``obj`` reaches no tensor and holds at most ``budget`` values (each object
    walked once): a per-call check, so a large object is not walked whole (nor copied)."""
    seen, todo, visits = set(), [obj], 0
    while todo:
        o = todo.pop()
        visits += 1
        if isinstance(o, torch.Tensor) or visits > budget:
            return False
        if isinstance(o, (*_PLAIN, *_OPAQUE)) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (dict, list, tuple)):
            if len(o) > budget:  # (not walked item by item: a vocabulary)
                return False
            todo.extend(o.values() if isinstance(o, dict) else o)
            continue
        kids = children(o)
        todo.extend(v for _, _, v in kids) if kids is not None else todo.extend((_attributes(o) or {}).values())
    return True


def _objects_as_dicts(obj: Any, found: List[str], depth: int = 0) -> Any:
    """``obj`` with every object that holds tensors but is no container (an HF cache) replaced
    by a dict of its tensor-holding (and plain) attributes; ``obj`` itself when nothing
    changes. The class names replaced are appended to ``found``."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return obj
    kids = children(obj)
    if kids is not None:
        new = [(k, _objects_as_dicts(v, found, depth + 1)) for k, _, v in kids]
        if all(n is v for (_, n), (_, _, v) in zip(new, kids)):
            return obj
        return _rebuild_fields(obj, new)  # (a dataclass: no __init__/__post_init__ again)
    if isinstance(obj, _OPAQUE):
        return obj
    if depth > _MAX_OBJECT_DEPTH:  # (or a cycle)
        if not _reaches_tensor(obj, set()):
            return obj
        found.append(type(obj).__name__)
        return None  # not the live object, with its tensors' graph
    attrs = _attributes(obj)
    if attrs is None:
        return obj
    out: Dict[str, Any] = {}
    holds_tensors = False
    for key, attr in attrs.items():
        replaced = len(found)
        value = _objects_as_dicts(attr, found, depth + 1)
        if len(found) > replaced or next(iter_tensors(value), None) is not None:
            out[key] = value  # (or an object in it replaced: one too deep is None)
            holds_tensors = True
        elif isinstance(value, (str, int, float, bool)) or value is None:
            out[key] = value
    if not holds_tensors:  # (yet: an empty HF cache fills after the call) a copy, when cheap
        if _copies_cheaply(obj):
            try:
                return copy.deepcopy(obj)
            except Exception:  # noqa: BLE001 - a __deepcopy__ of its own refusing: kept live
                return obj
        return obj
    found.append(type(obj).__name__)
    return out


def _reaches_tensor(obj: Any, seen: set) -> bool:
    """Whether a tensor is reachable from ``obj`` through containers and attributes (each
    object visited once: cycles end)."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (*_PLAIN, *_OPAQUE)) or id(obj) in seen:
        return False
    seen.add(id(obj))
    kids = children(obj)
    values = [v for _, _, v in kids] if kids is not None else list((_attributes(obj) or {}).values())
    return any(_reaches_tensor(v, seen) for v in values)


def _attributes(obj: Any) -> Optional[Dict[str, Any]]:
    """The attributes of an object, from its ``__dict__`` and ``__slots__`` (dunder names
    left out); None for one with neither."""
    attrs = getattr(obj, "__dict__", None)
    out = dict(attrs) if isinstance(attrs, dict) else None
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            if slot.startswith("__") and not slot.endswith("__"):  # private: name-mangled
                slot = f"_{cls.__name__.lstrip('_')}{slot}"
            if hasattr(obj, slot):
                out = {} if out is None else out
                out.setdefault(slot, getattr(obj, slot))
    if out is None:
        return None
    return {k: v for k, v in out.items() if isinstance(k, str) and not k.startswith("__")}


def _copies_cheaply(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` reaches only plain values, containers, classes, functions and
    instances of pure-Python classes made of them (no tensor, no module, no bound method,
    no object of a C type keeping state ``__dict__`` does not show, such as a
    ``functools.partial`` or a file), so a ``deepcopy`` is small and safe."""
    if isinstance(obj, _PLAIN) or isinstance(obj, (type, types.FunctionType)):
        return True
    if depth > _MAX_OBJECT_DEPTH or isinstance(obj, (torch.Tensor, *_OPAQUE)):
        return False
    kids = children(obj, init_only=True)
    if kids is not None:
        return all(_copies_cheaply(v, depth + 1) for _, _, v in kids)
    if not all(cls.__flags__ & _HEAPTYPE and not _COPY_PROTOCOL.intersection(cls.__dict__)
               for cls in type(obj).__mro__ if cls is not object):
        return False  # a C type, or one copying itself its own way: state beyond attributes
    attrs = _attributes(obj)
    return attrs is not None and all(_copies_cheaply(v, depth + 1) for v in attrs.values())


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement
# (functools.partial is a heap type on Python 3.11 whose state lives in C, told by __reduce__)
_COPY_PROTOCOL = frozenset(("__reduce__", "__reduce_ex__", "__getstate__", "__deepcopy__",
                            "__copy__", "__getnewargs__", "__getnewargs_ex__"))


def _shape_text(t: torch.Tensor) -> str:
    """``(2, 3)``; a nested tensor has no single shape: ``nested(3 tensors)``."""
    if t.is_nested:
        return f"nested({t.size(0)} tensors)"
    return f"{tuple(t.shape)}"


def _forward_raised(module: torch.nn.Module) -> bool:
    """In a forward hook given ``output=None``: whether ``module``'s forward raised (torch
    runs ``always_call`` hooks from the handler in ``Module._call_impl``, the frame that
    catches the exception being handled) rather than returned None (maybe while the caller
    handles an exception of its own)."""
    tb = sys.exc_info()[2]
    if tb is None:
        return False
    frame = tb.tb_frame
    return frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _tensor_bytes(t: torch.Tensor) -> int:
    """The bytes ``t`` holds: a sparse tensor its indices and values (not its dense size), a
    meta tensor none, a DTensor its local shard (a view its own elements: not the base it
    keeps alive)."""
    if is_dtensor(t):
        t = t.to_local()
    if t.is_meta:
        return 0
    layout = t.layout
    if layout is torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        return t.numel() * t.element_size()
    return sum(u.numel() * u.element_size() for u in parts)


def _nbytes(obj: Any) -> int:
    return sum(_tensor_bytes(t) for _, t in iter_tensors(obj))


def _unsavable(t: torch.Tensor) -> Optional[str]:
    """Why safetensors cannot store ``t`` (None if it can)."""
    if is_dtensor(t):  # (its shards are the ranks': no file of one rank holds the tensor)
        return "DTensor: save t.to_local() or t.full_tensor() yourself"
    if t.is_nested:
        return "nested"
    if t.layout is not torch.strided:
        return str(t.layout).replace("torch.", "")
    if t.is_meta:  # no data to write
        return "meta"
    if t.is_quantized:
        return "quantized"
    return None


class CapturePlugin(hookplug.Plugin):
    """Detached copies of module outputs (and optionally inputs and output gradients).
    See the module docstring for the options."""

    name = "capture"
    traceable = False  # per-call Python state: under torch.compile its hooks run as in eager code

    def __init__(
        self,
        *,
        keep: Union[Literal["last", "all"], int] = "last",
        to: Optional[Literal["cpu"]] = None,
        clone: bool = True,
        max_bytes: Optional[int] = None,
        grads: bool = False,
        inputs: bool = False,
    ):
        if isinstance(keep, int) and keep < 1:
            raise ValueError(f"capture: keep must be 'last', 'all' or an int >= 1, got {keep!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"capture: max_bytes must be None or an int >= 0, got {max_bytes!r}")
        self.keep = keep
        self.to = to
        self.clone = clone
        self.max_bytes = max_bytes
        self.keep_grads = grads
        self.keep_inputs = inputs
        if not grads:
            self.hookplug_output_grad = None
        if not inputs:
            self.hookplug_forward_input = None
        # forwards on several threads (a server's request threads), gradients on autograd's
        # and readers (report() on a monitoring thread): each hook's room check, copy and
        # bookkeeping (nbytes, the kept lists) is one step, as is each read of the store
        self._lock = threading.RLock()
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop everything captured."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._store: Dict[str, Dict[str, Any]] = {k: {} for k in _KINDS}
        self._calls: Dict[str, Dict[str, Any]] = {
            k: {} for k in _KINDS
        }  # call index(es) per module
        self._skeletons: Dict[
            tuple, Any
        ] = {}  # (module, call) -> output structure of _Slots (grads)
        self._grad_parts: Dict[tuple, Dict[str, torch.Tensor]] = {}
        # module -> {call: None}, the calls with a skeleton, oldest first (an ordered set)
        self._skel_calls: Dict[str, Dict[int, None]] = {}
        self._events: List[Any] = []
        self.nbytes = 0  # bytes held (what max_bytes bounds)
        self.skipped = 0
        # (module, call) -> thread: calls whose inputs did not fit / are kept, until their output
        self._refused: Dict[tuple, int] = {}
        self._open: Dict[tuple, int] = {}
        # (module, call) -> [(call, inputs)] set aside by that call's inputs, until its output
        self._set_aside: Dict[tuple, List[tuple]] = {}
        self._warned = False
        self._warned_objects = False
        self._warned_batched = False

    def _wait(self) -> None:
        with self._lock:  # (a reader on another thread waits for these too, not past them)
            events, self._events = self._events, []
            for ev in events:
                ev.synchronize()

    @property
    def features(self) -> Dict[str, Any]:
        """``{module: output}`` (``keep="last"``) or ``{module: [output, ...]}``, detached."""
        if self._events:
            self._wait()
        return self._store["features"]

    @property
    def grads(self) -> Dict[str, Any]:
        """``{module: gradient of the output}`` in the output's structure (``grads=True``), of
        the calls ``features`` holds: with a list, ``grads[m][i]`` is the gradient of the call
        of ``features[m][i]`` (None: no gradient reached it, e.g. an evaluation call); a module
        none of whose kept calls got one (inference only: ``generate`` under ``no_grad``; a
        no-grad output such as a rotary embedding's) has no entry, also with
        ``keep="last"`` where its last call got none: read ``grads.get(m)``."""
        if self._events:
            self._wait()
        return self._aligned("grads")

    @property
    def inputs(self) -> Dict[str, Any]:
        """``{module: args tuple}`` read before ``forward`` (``inputs=True``), of the calls
        ``features`` holds (aligned as ``grads`` are)."""
        if self._events:
            self._wait()
        return _part(self._aligned("inputs"), 0, self.keep != "last")

    @property
    def input_kwargs(self) -> Dict[str, Any]:
        """``{module: keyword arguments dict}`` read before ``forward`` (``inputs=True``;
        ``{}`` for a call given none), of the calls ``inputs`` holds, aligned as it is."""
        if self._events:
            self._wait()
        return _part(self._aligned("inputs"), 1, self.keep != "last")

    def _aligned(self, kind: str) -> Dict[str, Any]:
        """What ``kind`` holds, call by call with ``features``: a list entry per kept call
        (None where ``kind`` has none), or, with ``keep="last"``, the value of the call
        ``features`` holds."""
        with self._lock:
            store, calls = self._store[kind], self._calls[kind]
            fcalls = self._calls["features"]
            if self.keep == "last":
                return {n: v for n, v in store.items() if calls.get(n) == fcalls.get(n)}
            out = {}
            for name, values in store.items():
                by_call = dict(zip(calls[name], values))
                aligned = [by_call.get(c) for c in fcalls.get(name, ())]
                if any(v is not None for v in aligned):  # (none of its kept calls: no entry)
                    out[name] = aligned
            return out

    # -- copying ---------------------------------------------------------------------------------

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        plain = _unwrapped(t)
        if plain is not t:  # a torch.func.grad wrapper: a copy of the plain tensor it holds, made
            with _outside_transforms():  # outside the transform (else a wrapper again)
                return self._copy(plain)
        if torch.is_inference_mode_enabled() and (self.clone or self.to == "cpu"):
            with torch.inference_mode(False):  # a copy made in there would be an inference
                return self._copy(t)  # tensor, which autograd and in-place ops refuse later
        t = t.detach()
        if self.to == "cpu" and t.device.type != "cpu" and not t.is_meta:  # meta: no data to copy
            if t.is_nested or t.layout is not torch.strided:
                return t.to("cpu")
            pin = t.device.type == "cuda"
            try:
                dst = torch.empty_like(t, device="cpu", pin_memory=pin)
            except RuntimeError:  # layouts empty_like cannot pin (sparse, ...)
                return t.to("cpu")
            dst.copy_(t, non_blocking=pin)
            return dst
        return t.clone() if self.clone or self.to == "cpu" else t

    def _after_copy(self, src_device: torch.device) -> None:
        """With ``to="cpu"`` from CUDA: an event behind the non-blocking copies, waited for
        when ``features``/``grads``/``inputs`` are read."""
        if self.to == "cpu" and src_device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(src_device))
            self._events.append(ev)
            if len(self._events) > 256:  # nobody reads: forget the copies already done
                self._events = [e for e in self._events if not e.query()]

    # -- keeping -----------------------------------------------------------------------------------

    def _room(self, kind: str, name: str, call: int, new_bytes: int) -> bool:
        """Whether ``new_bytes`` fit under ``max_bytes`` once what this call replaces is freed."""
        if self.max_bytes is None:
            return True
        if self.nbytes - self._freed(kind, name, call) + new_bytes <= self.max_bytes:
            return True
        if kind == "inputs":  # its output is not captured either: counted once, there or here
            self._refused[(name, call)] = threading.get_ident()
            self.skipped += 1
        elif kind == "features":
            self.skipped += 1
        if not self._warned:
            self._warned = True
            what = ("gradients that do not fit are not kept" if kind == "grads"
                    else "calls that do not fit are not captured (see .skipped)")
            warnings.warn(
                f"hookplug plugin 'capture': max_bytes={self.max_bytes} reached at {kind} of "
                f"{name!r} (call {call}, {new_bytes} bytes more, {self.nbytes} held); {what}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return False

    def _freed(self, kind: str, name: str, call: int) -> int:
        """The bytes held that keeping ``kind`` of this call frees: the value it replaces (a
        gradient with one part more, the older call's with keep="last"); for the inputs of a
        call that moves past a kept call (keep="last"/N), that call's inputs (set aside by
        ``_put``); for its output, that call's output, inputs and gradients (``_trim``)."""
        store, calls = self._store[kind], self._calls[kind]
        if self.keep == "last":
            prev = calls.get(name)
            freed = _nbytes(store[name]) if prev is not None and prev <= call else 0
            if kind != "features" or prev == call:
                return freed
            others: tuple = ("inputs", "grads")
        else:
            cl = calls.get(name, ())
            i = bisect.bisect_left(cl, call)
            if i < len(cl) and cl[i] == call:
                return _nbytes(store[name][i])
            if kind == "grads":
                return 0
            freed, others = 0, (_KINDS if kind == "features" else ("inputs",))
        floor = self._floor_after(name, call)
        if floor is not None:
            freed += sum(self._older_bytes(k, name, floor) for k in others)
        return freed

    def _floor_after(self, name: str, call: int) -> Optional[int]:
        """The oldest call ``features`` keeps once the output of this new call is kept, where
        that moves past a kept call (keep="last", or N calls kept); None where it does not."""
        fc = self._calls["features"].get(name)
        if fc is None:
            return None
        if self.keep == "last":
            return call if fc < call else None
        if not isinstance(self.keep, int) or len(fc) < self.keep or call <= fc[0]:
            return None
        i = bisect.bisect_left(fc, call)
        if i < len(fc) and fc[i] == call:
            return None
        return min(fc[1], call) if len(fc) > 1 else call

    def _older_bytes(self, kind: str, name: str, floor: int) -> int:
        """The bytes ``kind`` holds for calls of ``name`` before ``floor``."""
        calls = self._calls[kind].get(name)
        if calls is None:
            return 0
        if self.keep == "last":
            return _nbytes(self._store[kind][name]) if calls < floor else 0
        return sum(_nbytes(v) for c, v in zip(calls, self._store[kind][name]) if c < floor)

    def _floor(self, kind: str, name: str) -> Optional[int]:
        """The oldest call of ``name`` that ``_put`` still accepts for ``kind`` (None: any)."""
        calls = self._calls[kind].get(name)
        if calls is None:
            return None
        if self.keep == "last":
            return calls
        if isinstance(self.keep, int) and calls and len(calls) >= self.keep:
            return calls[0]
        return None

    def _drop_grad_calls(self, name: str, floor: Optional[int]) -> None:
        """Forget the skeletons and gradient parts of the calls of ``name`` before ``floor``:
        their gradients can no longer be kept."""
        if floor is None:
            return
        calls = self._skel_calls.get(name)
        if not calls:
            return
        # every one, not a leading run: a module nested in itself ends its inner call first
        for c in [c for c in calls if c < floor]:
            del calls[c]
            self._skeletons.pop((name, c), None)
            self._grad_parts.pop((name, c), None)

    def _put(self, kind: str, name: str, call: int, value: Any) -> None:
        store, calls = self._store[kind], self._calls[kind]
        if self.keep == "last":
            prev = calls.get(name)
            if prev is not None and call < prev:  # an older call's late gradient
                return
            if name in store:
                self.nbytes -= _nbytes(store[name])
                if kind == "inputs" and prev != call:  # back if this call is not captured
                    self._set_aside[(name, call)] = [(prev, store[name])]
            store[name] = value
            calls[name] = call
        else:
            lst = store.setdefault(name, [])
            cl = calls.setdefault(name, [])
            if kind == "inputs" and isinstance(self.keep, int):
                # the inputs of the kept call this one moves past: set aside (out of nbytes, so
                # a budget of N calls takes the next one), back if this call is not captured
                floor = self._floor_after(name, call)
                n = 0 if floor is None else bisect.bisect_left(cl, floor)
                if n:
                    self._set_aside[(name, call)] = list(zip(cl[:n], lst[:n]))
                    self.nbytes -= sum(_nbytes(v) for v in lst[:n])
                    del cl[:n], lst[:n]
            i = bisect.bisect_left(cl, call)
            if i < len(cl) and cl[i] == call:
                self.nbytes -= _nbytes(lst[i])
                lst[i] = value
            else:
                # inputs come before their call's output: the oldest go once that output is
                # kept (_trim), so a call not captured (max_bytes) drops no kept call's inputs
                evict = isinstance(self.keep, int) and kind != "inputs"
                if evict and len(cl) >= self.keep and i == 0:
                    return  # older than every kept call
                lst.insert(i, value)
                cl.insert(i, call)
                if evict and len(cl) > self.keep:
                    self.nbytes -= _nbytes(lst.pop(0))
                    cl.pop(0)
        self.nbytes += _nbytes(value)

    def _warn_batched(self, what: str, name: str) -> None:
        if not self._warned_batched:
            self._warned_batched = True
            warnings.warn(f"hookplug plugin 'capture': the {what} of {name or '<root>'!r} is batched "
                          "by torch.func.vmap and is not kept (a tensor from inside vmap cannot be "
                          "used after it); calls under vmap are not captured", RuntimeWarning,
                          stacklevel=user_stacklevel())

    def _capture(self, kind: str, name: str, call: int, obj: Any, prefix: str) -> bool:
        if not isinstance(obj, torch.Tensor):
            found: List[str] = []
            obj = _objects_as_dicts(obj, found)
            if found and not self._warned_objects:
                self._warned_objects = True
                warnings.warn(
                    f"hookplug plugin 'capture': the {prefix} of {name or '<root>'!r} holds "
                    f"{', '.join(sorted(set(found)))} object(s) (not containers: an HF cache, a "
                    "torchvision ImageList); their tensors are captured as a dict of the object's attributes, not the live object (one "
                    f"nested more than {_MAX_OBJECT_DEPTH} objects deep as None)",
                    RuntimeWarning, stacklevel=user_stacklevel(),
                )
        tensors = list(iter_tensors(obj, prefix))
        if any(_is_batched(t) for _, t in tensors):
            self._warn_batched(prefix, name)
            return False
        if not self._room(kind, name, call, sum(_tensor_bytes(t) for _, t in tensors)):
            return False
        value = map_tensors(lambda _p, t: self._copy(t), obj, prefix, fields=True)
        if tensors:
            for dev in {t.device for _, t in tensors if t.device.type == "cuda"}:
                self._after_copy(dev)
        self._put(kind, name, call, value)
        return True

    def _trim(self, kind: str, name: str) -> None:
        """Forget what ``kind`` holds for calls of ``name`` older than every call ``features``
        keeps (``keep="last"``/``N``)."""
        floor = self._floor("features", name)
        if floor is None:
            return
        store, calls = self._store[kind], self._calls[kind]
        if self.keep == "last":
            if name in store and calls[name] < floor:
                self.nbytes -= _nbytes(store.pop(name))
                del calls[name]
            return
        cl = calls.get(name)
        while cl and cl[0] < floor:
            self.nbytes -= _nbytes(store[name].pop(0))
            cl.pop(0)

    def _discard(self, kind: str, name: str, call: int) -> None:
        """Forget what ``kind`` holds for that call of ``name`` (nothing if it holds none), and
        put back the inputs it set aside (a call is captured whole or not at all)."""
        store, calls = self._store[kind], self._calls[kind]
        back = self._set_aside.pop((name, call), ()) if kind == "inputs" else ()
        if self.keep == "last":
            if name in store and calls.get(name) == call:
                self.nbytes -= _nbytes(store.pop(name))
                del calls[name]
            for c, v in back:
                if name not in store:  # (not where a newer call's inputs came since)
                    store[name], calls[name] = v, c
                    self.nbytes += _nbytes(v)
            return
        cl = calls.get(name, [])
        i = bisect.bisect_left(cl, call)
        if i < len(cl) and cl[i] == call:
            self.nbytes -= _nbytes(store[name].pop(i))
            cl.pop(i)
        floor = self._floor("features", name)
        for c, v in back:
            i = bisect.bisect_left(cl, c)
            if (floor is None or c >= floor) and not (i < len(cl) and cl[i] == c):
                cl.insert(i, c)
                store[name].insert(i, v)
                self.nbytes += _nbytes(v)

    # -- hooks (hot path) ------------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        # an instance attached again starts afresh, as a new one would (call indices start
        # again: kept calls of the last session would mix with this one's by index)
        with self._lock:
            self._reset()

    @hookimpl
    def hookplug_step(self):
        """Calls whose output never came (a ``KeyboardInterrupt`` in ``forward``: torch runs
        no post hook then) are not captured: their inputs go, those they set aside go back."""
        with self._lock:
            self._step_ended()

    def _step_ended(self) -> None:
        if self._open or self._refused:  # this thread's calls only: another's may be running
            me = threading.get_ident()
            for key in [k for k, thread in self._open.items() if thread == me]:
                del self._open[key]
                self._discard("inputs", *key)
            for key in [k for k, thread in self._refused.items() if thread == me]:
                del self._refused[key]
                self.skipped -= 1  # (a call Ctrl-C stopped is no call skipped, as a raised one)

    @hookimpl
    def hookplug_forward_input(self, ctx, module, args, kwargs):
        with self._lock:
            if self._open or self._refused:  # (rare: nested or overlapping calls, or ones Ctrl-C left)
                self._drop_interrupted(ctx.name, module)
            self._forward_input(ctx, args, kwargs)

    def _drop_interrupted(self, name: str, module) -> None:
        """Drop this thread's open calls of ``name`` that are no longer running (their
        inputs, and put back what they set aside), as at a step: without steps (serving,
        forward-only) each call Ctrl-C stopped kept its inputs for good."""
        me = threading.get_ident()
        mine = sorted({k for calls in (self._open, self._refused) for k, thread in calls.items()
                       if thread == me and k[0] == name})
        for key in interrupted_calls(mine, module) if mine else ():
            if self._open.pop(key, None) is not None:
                self._discard("inputs", *key)
            if self._refused.pop(key, None) is not None:
                self.skipped -= 1  # (a call Ctrl-C stopped is no call skipped, as a raised one)

    def _forward_input(self, ctx, args, kwargs=None) -> None:
        # one value per call, (args, kwargs): kept, bounded and dropped together
        kept = {k: _keyword_value(v) for k, v in kwargs.items()} if kwargs else {}
        if self._capture("inputs", ctx.name, ctx.call_index, (tuple(args), kept), "input"):
            self._open[(ctx.name, ctx.call_index)] = threading.get_ident()  # until its output

    @hookimpl
    def hookplug_forward_output(self, ctx, module, output):
        with self._lock:
            self._forward_output(ctx, module, output)

    def _forward_output(self, ctx, module, output) -> None:
        if self._open:
            self._open.pop((ctx.name, ctx.call_index), None)
        if output is None and _forward_raised(module):  # nothing to capture, the last capture stays
            if self.keep_inputs:
                if self._refused.pop((ctx.name, ctx.call_index), None) is not None:
                    self.skipped -= 1  # (no call to skip: counted when its inputs did not fit)
                self._discard("inputs", ctx.name, ctx.call_index)
            return
        # a call is captured whole or not at all: not its output when its inputs did not fit
        if self.keep_inputs and self._refused:
            ok = (ctx.name, ctx.call_index) not in self._refused
            self._refused.pop((ctx.name, ctx.call_index), None)
        else:
            ok = True
        if not (ok and self._capture("features", ctx.name, ctx.call_index, output, "output")):
            if self.keep_inputs:  # a call is captured whole or not at all
                self._discard("inputs", ctx.name, ctx.call_index)
            return
        if self.keep_inputs:
            if self._set_aside:  # the inputs of the call it moved past are no longer held
                self._set_aside.pop((ctx.name, ctx.call_index), None)
            if isinstance(self.keep, int):  # inputs of calls no longer kept go
                self._trim("inputs", ctx.name)
        if self.keep_grads and self.keep != "all":  # gradients of calls no longer kept go
            self._trim("grads", ctx.name)
            self._drop_grad_calls(ctx.name, self._floor("features", ctx.name))
        if (
            self.keep_grads
            and not isinstance(output, torch.Tensor)
            and any(t.requires_grad for _, t in iter_tensors(output))
        ):
            # the structure of what features holds, not of the output: an object holding
            # tensors (an HF cache) is a dict there, not the live object with its graph
            feature = self._captured("features", ctx.name, ctx.call_index)
            if feature is not None:
                self._add_skeleton(ctx.name, ctx.call_index, feature)

    def _add_skeleton(self, name: str, call: int, output: Any) -> Any:
        """Remember the structure of a call's captured output, for its gradients (one per
        tensor)."""
        skel = map_tensors(lambda p, _t: _Slot(p), output, "output", fields=True)
        self._skeletons[(name, call)] = skel
        self._skel_calls.setdefault(name, {})[call] = None
        if len(self._skeletons) > 4096:  # gradients that never came: forget the oldest
            for k in list(self._skeletons)[:1024]:
                self._skeletons.pop(k, None)
                self._grad_parts.pop(k, None)
                self._skel_calls.get(k[0], {}).pop(k[1], None)
        return skel

    def _captured(self, kind: str, name: str, call: int) -> Any:
        """What ``kind`` holds for that call of ``name``, or None."""
        store, calls = self._store[kind], self._calls[kind]
        if self.keep == "last":
            return store.get(name) if calls.get(name) == call else None
        cl = calls.get(name, [])
        i = bisect.bisect_left(cl, call)
        return store[name][i] if i < len(cl) and cl[i] == call else None

    @hookimpl
    def hookplug_output_grad(self, ctx, grad, path):
        with self._lock:
            self._output_grad(ctx, grad, path)

    def _output_grad(self, ctx, grad, path) -> None:
        name, call = ctx.name, ctx.call_index
        if _is_batched(grad):
            self._warn_batched("gradient", name)
            return
        feature = self._captured("features", name, call)
        if feature is None:  # a call features does not hold (moved past, or not captured)
            self._drop_grad_calls(name, self._floor("features", name))
            return
        key = (name, call)
        skel = self._skeletons.get(key)
        if skel is None and path != "output":
            # a call that ran without autograd (a reentrant checkpoint's first forward; its
            # recompute's grads come with its ctx): the structure is the captured output's
            if isinstance(feature, torch.Tensor):
                return
            skel = self._add_skeleton(name, call, feature)
        if skel is None:
            if not self._room("grads", name, call, _tensor_bytes(grad)):
                return
            value = self._copy(grad)
            self._after_copy(grad.device)
            self._put("grads", name, call, value)
            return
        g = _tensor_bytes(grad)
        # the structure so far (earlier parts) is freed by _put and counted again, so only g is new
        if not self._room("grads", name, call, g + self._parts_bytes(key)):
            return
        parts = self._grad_parts.setdefault(key, {})
        parts[path] = self._copy(grad)
        self._after_copy(grad.device)
        value = map_tensors(lambda _p, s: parts.get(s.path), skel, "output", leaf=_Slot, fields=True)
        self._put("grads", name, call, value)
        # the parts of calls features moved past (keep="last"/N) are no longer held by the
        # store: drop them, so every part held is one counted in nbytes
        self._drop_grad_calls(name, self._floor("features", name))

    def _parts_bytes(self, key) -> int:
        parts = self._grad_parts.get(key)
        return sum(_tensor_bytes(t) for t in parts.values()) if parts else 0

    # -- results ---------------------------------------------------------------------------------

    def results(self) -> Dict[str, Any]:
        """``features``."""
        return self.features

    def save(self, path) -> None:
        """Write what was captured to a safetensors file (no pickle); read it back with
        ``hookplug.load_capture``."""
        from hookplug._capture_io import save_capture

        if self._events:
            self._wait()
        with self._lock:  # what is held now: forwards on other threads may go on meanwhile
            per_call = self.keep != "last"  # (else a list is one call's list output)
            stores = {k: ({n: (list(x) if per_call else x) for n, x in v.items()}
                          if k == "features" else self._aligned(k))
                      for k, v in self._store.items() if v}
        if "inputs" in stores:  # (args, kwargs) per call: two kinds in the file
            calls = stores.pop("inputs")
            stores["inputs"] = _part(calls, 0, per_call)
            stores["input_kwargs"] = _part(calls, 1, per_call)
        left_out: List[str] = []
        for kind, store in stores.items():
            prefix = _PREFIX[kind]
            if not any(
                _unsavable(t)
                for value in store.values()
                for entry in (value if per_call else [value])
                for _, t in iter_tensors(entry)
            ):
                continue

            def keep_or_none(p, t, name):
                why = _unsavable(t)
                if why is None:
                    return t
                left_out.append(f"{name or '<root>'}/{p} ({why})")
                return None

            out = {}
            for name, value in store.items():

                def fn(p, t, name=name):
                    return keep_or_none(p, t, name)

                if per_call:
                    out[name] = [map_tensors(fn, v, prefix, fields=True) for v in value]
                else:
                    out[name] = map_tensors(fn, value, prefix, fields=True)
            stores[kind] = out
        if left_out:
            shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
            warnings.warn(
                f"hookplug plugin 'capture': save({str(path)!r}) left out {len(left_out)} tensor(s) "
                f"that safetensors cannot store (dense strided tensors only): {shown}; they load "
                "back as None",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        save_capture(path, stores, keep=self.keep)

    def report(self) -> str:
        with self._lock:  # (forwards on other threads add modules meanwhile)
            return self._report()

    def _report(self) -> str:
        rows = []
        per_call = self.keep != "last"  # (else a list is one call's list output)
        for kind in _KINDS:
            for name, value in self._store[kind].items():
                entries = value if per_call else [value]
                last = entries[-1] if entries else None
                tensors = [t for _, t in iter_tensors(last)]
                shapes = ", ".join(_shape_text(t) for t in tensors) or "-"
                kinds = [str(t.dtype).replace("torch.", "") for t in tensors]
                # one per shape, in the same order; one name where every tensor has it
                dtypes = ", ".join(kinds if len(set(kinds)) > 1 else kinds[:1]) or "-"
                label = name or "<root>"
                if kind != "features":
                    label += f" [{kind[:-1]}]"
                if per_call:
                    label += f" x{len(entries)}"
                rows.append((label, shapes, dtypes, str(sum(_nbytes(e) for e in entries))))
        if not rows:
            return ""
        header = ("module", "shape", "dtype", "bytes")
        table = [header, *rows]
        widths = [max(len(r[i]) for r in table) for i in range(4)]
        lines = []
        for j, r in enumerate(table):
            lines.append(
                "  ".join(
                    c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
                ).rstrip()
            )
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(
            f"total {self.nbytes} bytes"
            + (f", {self.skipped} call(s) skipped (max_bytes)" if self.skipped else "")
        )
        return "\n".join(lines)
