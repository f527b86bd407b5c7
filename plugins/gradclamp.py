"""``gradclamp``: steer the gradients flowing back through modules and into parameters.

    # clamp the gradient of every conv output to >= 0
    hookplug.attach(model, "Conv2d", plugins=("gradclamp", {"min": 0}))
    # zero every fc bias gradient (the params' owners must be selected: "*" selects all)
    hookplug.attach(model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "fc*.bias"}))

Options (keyword-only):

- ``min``, ``max``: clamp every element of the gradient to ``[min, max]``. A bound past the
  largest finite value of the gradient's dtype is what that dtype rounds it to: on a
  float16 gradient ``max=65510`` clamps to 65504 (an inf gradient becomes 65504), while
  ``max=65520`` or more is +inf, no bound (as ``torch.clamp`` in float64 then cast gives).
- ``max_norm``: scale each gradient tensor down so its L2 norm is at most ``max_norm``
  (per tensor, like ``clip_grad_norm_`` on that tensor alone; a tensor whose norm is not
  finite is left as it is).
- ``nan="keep"|"zero"|"raise"``: what to do with NaN elements, before clamping. ``"raise"``
  raises a ``FloatingPointError`` naming the module (or parameter); it is the only option
  that synchronizes with the device (once per gradient, to know whether to raise).
- ``params=None|"glob"|["glob", ...]``: also transform the gradients of the parameters whose
  qualified name (``"layer1.0.conv1.weight"``) matches an ``fnmatch`` glob. Only parameters
  of the *selected* modules get a hook, so select their owners (or ``"*"``); a glob that
  matches none of them warns at attach time. The hook steers each backward's gradient
  before it is added into ``.grad``: each micro-batch's under gradient accumulation, this
  rank's before DDP's all-reduce, not the accumulated gradient the optimizer gets.
- ``outputs=None|True|False``: transform the gradients of the selected modules' outputs.
  ``None`` (default) means yes unless ``params`` is given, so
  ``{"min": 0, "max": 0, "params": "fc*.bias"}`` touches only those parameters (the seeds'
  "zero every fc bias gradient"); pass ``outputs=True`` to do both.

- ``scaler=None|GradScaler``: the ``torch.amp.GradScaler`` of the training loop. The hooks
  run inside backward, where its gradients are *scaled* (times its current scale), before
  its ``unscale_``/``step`` look for inf/NaN. Without ``scaler`` the bounds apply to those
  scaled values, and a bound clamps an overflowed (inf) gradient to a finite value, which
  hides the overflow from the scaler: it steps and keeps its scale. With ``scaler``,
  ``min``/``max``/``max_norm`` are in the unscaled units the optimizer sees (the bounds
  times the scale, read on the device: no sync), and inf elements are left as they are so
  the scaler still skips that step and lowers its scale (torch's own clipping comes after
  ``unscale_`` for that reason). ``nan="zero"`` is refused with it (it would hide them too).

Order: NaN handling, then ``min``/``max``, then ``max_norm``. The plugin counts how many
elements it changed in an int64 device counter per module output (keyed by module name)
and per parameter (keyed by parameter name), without a host sync; ``results()`` reads them:
``{name: {"changed": int}}``.

**Under torch.compile** output gradients are steered inside the compiled backward
(``grad_in_graph``: the core passes each hooked output through ``hookplug._binding._GradSite``,
whose backward dynamo traces), with no graph break: a model compiles the graphs it compiles
without hooks, and identical blocks share theirs. The steering is the eager code, traced
(bitwise the same under ``aot_eager``; inductor fuses it). The count goes to
``hookplug::gradclamp_count(n, token)``, an op registered as an ordered effect that adds it
to the module's counter when it runs: the token is a per-module CPU tensor in the module's
table (a graph input saved for backward, so the graph is the same for every module); the
counter itself is no graph input (saved for backward, the in-place add of one module's
backward would fail autograd's version check in another's). With ``scaler=`` the traced
backward reads the scaler's scale tensor from the module tables; a scaler that has none
yet gets it when dynamo starts compiling (what its first ``scale()`` makes, on the model's
device), since the first forward is traced before the first ``scaler.scale(loss)``.
``nan="raise"`` is not traced (deciding to raise reads the device, a sync): its modules
keep the tensor hooks and their graph break per module call, as does every module under
compiled autograd (it traces those hooks; with ``compiled_autograd._enable`` around
``backward()`` alone a forward compiled with inductor fails, as for stats' grad site, see
the README). Compiled autograd traces the counting too: the counters of the steered modules
(those with parameters) and parameters are made, zero, when dynamo starts compiling (a
trace making one guarded on it, and the whole backward compiled again at the next step).
A compiled backward that runs after ``remove()`` (of a forward before it) still steers,
counting nothing; eager hooks do nothing then.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import struct
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, Literal, Optional, Sequence, Tuple, Union

import torch

import hookplug
from hookplug import hookimpl
from hookplug._bank import ON_COMPILE_START, _is_compiling, bank_effect_op, is_dtensor, param_device, unmaterialized
from hookplug._binding import _compiled_autograd_may_run
from hookplug._func import is_batched, outside_transforms, unwrapped
from hookplug._plugin import plugin_failed, plugin_off, user_stacklevel, warn_once
from hookplug._selectors import clean_name, parameter_names

__all__ = ["GradClampPlugin"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A counter's token (a one-element CPU int64 tensor in its module's per-module table) ->
# (the plugin, weakly, and the counter's key); the count op finds the counter through it
# when it runs. Entries go at session end: a compiled backward left from a removed session's
# forward counts nothing.
_COUNTERS: Dict[int, Tuple["weakref.ref[GradClampPlugin]", str]] = {}
_token_ids = itertools.count(1)
_count_op_: Any = None  # the op, or False where this torch cannot keep it in a graph
# the live gradclamp plugins with a scaler= (their scale tensor is made at compile start)
_SCALED: "weakref.WeakSet[GradClampPlugin]" = weakref.WeakSet()
# the live gradclamp plugins (their counters are made at compile start under compiled autograd)
_LIVE: "weakref.WeakSet[GradClampPlugin]" = weakref.WeakSet()


def _count_op():
    """``hookplug::gradclamp_count(n, token) -> ()``: add ``n`` (a 0-d int64 count, on the
    gradient's device) to the counter ``token`` names, when it runs. What a compiled backward
    calls: the counter, a plugin-held tensor mutated in place, is no graph input (AOT
    autograd would save it for backward, and an update between a forward and its backward,
    e.g. another module's backward first, would fail autograd's version check), and the op
    is an ordered effect (see ``hookplug._bank.bank_effect_op``), so the graph keeps it and
    runs it in order. None where this torch cannot keep such an op in a graph."""
    global _count_op_
    if _count_op_ is None:
        def gradclamp_count(n: torch.Tensor, token: torch.Tensor) -> None:
            entry = _COUNTERS.get(int(token))
            plugin = entry[0]() if entry is not None else None
            if plugin is not None and not plugin._off():
                try:  # a copy: n is the compiled graph's buffer (inductor reuses its memory)
                    plugin._count(entry[1], n, copy=True)
                except Exception as exc:  # noqa: BLE001 - the plugin's, not the backward's
                    plugin._failed("its count in a compiled backward", exc)

        try:
            _count_op_ = bank_effect_op(gradclamp_count)
        except (AttributeError, ImportError, TypeError, RuntimeError, AssertionError):
            _count_op_ = False  # a torch without these (private) APIs
    return _count_op_ or None


def _make_scales() -> None:
    """At each compile start (outside the trace): the ``GradScaler`` of each live plugin
    gets its scale tensor if it has none yet, and it goes in the plugin's module tables
    (see ``GradClampPlugin._put_scale``)."""
    for plugin in list(_SCALED):
        if not plugin._off():
            try:
                plugin._put_scale(init=True)
            except Exception as exc:  # noqa: BLE001 - the plugin's, never the compile's
                plugin._failed("its scale at a compile start", exc)


ON_COMPILE_START.append(_make_scales)


def _make_counters() -> None:
    """At each compile start under compiled autograd (outside the trace; its own backward's
    compile starts inside its region, where ``compiled_autograd._enable`` around
    ``backward()`` alone is all there is): every live plugin's counters exist (see
    ``GradClampPlugin._put_counters``)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    in_region = getattr(ca, "in_compiled_autograd_region", False)
    if _LIVE and (_compiled_autograd_may_run() or in_region):
        for plugin in list(_LIVE):
            if not plugin._off():
                try:
                    plugin._put_counters()
                except Exception as exc:  # noqa: BLE001 - the plugin's, never the compile's
                    plugin._failed("its counters at a compile start", exc)


ON_COMPILE_START.append(_make_counters)


def _saturate(v: Optional[float], dtype: torch.dtype) -> Optional[float]:
    """A bound ``v`` on a ``dtype`` gradient as that dtype rounds it. Inside its range torch
    rounds the number itself; past its largest finite value ``v`` is that value while it
    rounds to it (float16: 65504 < |v| < 65520), else +-inf, as ``torch.clamp`` with a
    tensor bound, in float64 then cast, or compiled gives (eager ``torch.clamp`` with such a
    Python number raises). A number reaches a tensor of any dtype through float32, so it is
    rounded to float32 first, as torch does (65519.999999 is 65520.0 there: inf in float16)."""
    fi = torch.finfo(dtype)
    if v is None or abs(v) <= fi.max:
        return v
    try:
        w = struct.unpack("f", struct.pack("f", abs(v)))[0]
    except OverflowError:  # past float32's range once rounded
        w = math.inf
    half_ulp = fi.max * fi.eps / (2 - fi.eps) / 2  # the tie rounds to inf (max's mantissa is odd)
    return math.copysign(fi.max if w < fi.max + half_ulp else math.inf, v)


def _number(name: str, v):
    if v is not None and math.isnan(v):
        raise ValueError(f"gradclamp: {name} must not be NaN")
    return v


def _text(x: Optional[float]) -> str:
    return "" if x is None else repr(float(x))


def _option(name: str):
    """A float option kept as its exact ``repr`` (``""``: None) and read back with
    ``float``: traced code reads a string attribute as a constant, guarded by its value (a
    session attached again with other options recompiles), where a float attribute is a
    symbolic graph input under ``torch.compile(dynamic=True)``, which the traced backward
    of a grad site cannot take ("lift_tracked_freevar_to_input should not be called on
    root SubgraphTracer")."""
    attr = f"_{name}_text"

    def get(self) -> Optional[float]:
        text = getattr(self, attr)
        return float(text) if text else None

    def set_(self, value: Optional[float]) -> None:
        setattr(self, attr, _text(value))
        bounds = self.__dict__.get("_dtype_bounds")
        if bounds is not None and name != "max_norm":  # min/max as each dtype holds them, again
            bounds.clear()
            for dtype in _FLOATS:
                self._bounds(dtype)

    return property(get, set_)


class GradClampPlugin(hookplug.Plugin):
    """Clamp / clip / NaN-guard gradients of module outputs and (with ``params=``) of
    parameters. See the module docstring for the options."""

    name = "gradclamp"
    sampled = False  # steering gradients must not stop on the steps `every=N` skips
    min = _option("min")  # (floats kept as text: see _option)
    max = _option("max")
    max_norm = _option("max_norm")

    def __init__(
        self,
        *,
        min: Optional[float] = None,  # noqa: A002 - torch.clamp's names
        max: Optional[float] = None,  # noqa: A002
        max_norm: Optional[float] = None,
        nan: Literal["keep", "zero", "raise"] = "keep",
        params: Union[None, str, Sequence[str]] = None,
        outputs: Optional[bool] = None,
        scaler: Optional[torch.amp.GradScaler] = None,
    ):
        self.min = _number("min", min)
        self.max = _number("max", max)
        self.max_norm = _number("max_norm", max_norm)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"gradclamp: min must be <= max, got min={min!r}, max={max!r}")
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ValueError(f"gradclamp: max_norm must be a finite number > 0, got {max_norm!r}")
        self.nan = nan
        if scaler is not None and nan == "zero":
            raise ValueError(
                "gradclamp: nan='zero' with scaler= would hide an overflow from the GradScaler "
                "(it skips the steps whose gradients have inf/NaN and lowers its scale); "
                "use nan='keep' or 'raise'")
        self.scaler = scaler
        globs = () if params is None else (params,) if isinstance(params, str) else tuple(params)
        if params is not None and not globs:
            raise ValueError("gradclamp: params must be None, a glob string or a non-empty list")
        self.params = globs
        self.outputs = (not globs) if outputs is None else outputs
        if self.min is None and self.max is None and self.max_norm is None and nan == "keep":
            raise ValueError(
                "gradclamp: nothing to do; give min, max, max_norm or nan='zero'|'raise'"
            )
        if not self.outputs and not globs:
            raise ValueError("gradclamp: outputs=False and no params glob: nothing to transform")
        # Hooks not needed are switched off so the core registers no torch hook for them.
        if not self.outputs:
            self.hookplug_output_grad = None
        if not globs:
            self.hookplug_param_grad = None
        # Output gradients are steered inside a compiled backward (no graph break per module
        # call, see hookplug._binding._GradSite), all but nan="raise": it must read the device
        # to decide whether to raise, a sync a graph cannot hold (its tensor hooks remain).
        self.grad_in_graph = self.outputs and nan != "raise" and _count_op() is not None
        self._match: Dict[str, bool] = {}
        self._settled_seen = 0  # session.params_settled when _match was built
        self._tag = self.name  # the plugin's name in its session (keys of the module tables)
        self._model_ref = lambda: None  # the session's model (weakly)
        self._session_ref: Callable[[], Any] = lambda: None
        self._steered: Any = weakref.WeakValueDictionary()  # module name -> steered module
        self._tokens: Dict[str, torch.Tensor] = {}  # module name -> its counter's token
        self._tables: list = []  # the module tables the tokens (and scale) are in
        # min/max as each floating dtype holds them, made here: compiled code reads the
        # dict and must find it unchanged (a traced insert would recompile the next call)
        self._dtype_bounds: Dict[torch.dtype, tuple] = {}
        for dtype in _FLOATS:
            self._bounds(dtype)
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Zero the changed-element counters."""
        self._changed: Dict[str, torch.Tensor] = {}
        self._layouts_warned: set = set()

    def _glob_matches(self, pname: str) -> bool:
        return any(fnmatch.fnmatchcase(pname, g) for g in self.params)

    def _matches(self, pname: str) -> bool:
        hit = self._match.get(pname)
        if hit is None:
            hit = self._match[pname] = self._glob_matches(pname)
        return hit

    # -- the transform ---------------------------------------------------------------------------

    def _bounds(self, dtype: torch.dtype):
        """``min``/``max`` as ``dtype`` holds them (see `_saturate`), None where unset or
        without effect (no tensor is made: this runs inside backward)."""
        got = self._dtype_bounds.get(dtype)
        if got is None:
            lo, hi = _saturate(self.min, dtype), _saturate(self.max, dtype)
            got = self._dtype_bounds[dtype] = (None if lo == -math.inf else lo,
                                               None if hi == math.inf else hi)
        return got

    def _scale(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """The scaler's current scale (0-d float32 on ``grad``'s device), None where the
        gradients are not scaled (no scaler, one switched off, or before its first ``scale``)."""
        s = self.scaler
        if s is None or not s.is_enabled() or s._scale is None:
            return None
        return s._scale.reshape(()).to(grad.device)

    def _apply(self, key: str, what, grad: torch.Tensor) -> torch.Tensor:
        """Steer ``grad``; ``what()`` names it in an error (built only then: reading
        ctx.step per call would make compiled code recompile every step)."""
        if not grad.is_floating_point():
            if grad.is_complex():  # (min/max have no meaning there; not steered, said once)
                warn_once(self._layouts_warned, grad.dtype, lambda: (
                    f"gradclamp: the gradient of {what()} is {grad.dtype}; only real floating "
                    "gradients are steered, this one is left as it is"))
            return None
        if grad.layout != torch.strided or grad.is_nested:
            warn_once(self._layouts_warned, grad.layout, lambda: (
                f"gradclamp: the gradient of {what()} is a {grad.layout} tensor; only strided "
                "(dense) gradients are steered, this one is left as it is"))
            return None
        if self.nan == "raise":
            # (a DTensor's shard of this rank: no collective, which torch 2.14 ran for .any())
            local = grad.to_local() if is_dtensor(grad) else grad
            if bool(torch.isnan(local).any()):  # the one deliberate sync
                raise FloatingPointError(f"gradclamp: NaN in the gradient of {what()}")
        amp = self._scale(grad) if self.scaler is not None else None
        batched = is_batched(grad)  # under vmap: a count would be a BatchedTensor escaping it
        g, n = self._steer(grad, amp, count=not batched)
        if g is None or batched:
            return g
        if is_dtensor(n):  # a sharded gradient's: this rank's shard's count (a Partial sum,
            n = n.to_local()  # which int() read as this rank's part for Shard, whole for Replicate)
        plain = unwrapped(n)
        if plain is not n:  # inside torch.func.grad: n wraps the count; a counter kept as such
            with outside_transforms():  # escaped, and an in-place add to one made outside raised
                self._count(key, plain)
        else:
            self._count(key, n)
        return g

    def _steer(self, grad: torch.Tensor, amp: Optional[torch.Tensor], count: bool = True):
        """``(steered gradient, elements changed)`` of a floating strided ``grad`` (``amp``:
        the scaler's scale, see :meth:`_scale`); ``(None, None)`` where nothing was done, the
        count None where not ``count``. Plain tensor code, run as it is in eager code and
        traced into a compiled backward (:meth:`_apply_traced`)."""
        if amp is None:
            lo, hi = self._bounds(grad.dtype)
        else:  # unscaled bounds: times the scale, as tensors in the gradient's dtype (a float32
            # bound would promote a 0-d float16 gradient to float32)
            lo = None if self.min is None or self.min == -math.inf else amp * self.min
            hi = None if self.max is None or self.max == math.inf else amp * self.max
            lo, hi = (None if b is None else b.to(grad.dtype) for b in (lo, hi))
        g = grad
        if self.nan == "zero":
            g = torch.nan_to_num(g, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        if lo is not None or hi is not None:
            c = torch.clamp(g, min=lo, max=hi)
            g = c if amp is None else torch.where(torch.isinf(g), g, c)  # the scaler's to see
        max_norm = self.max_norm
        if max_norm is not None:
            low = g.dtype in (torch.float16, torch.bfloat16)
            norm = torch.linalg.vector_norm(g, dtype=torch.float32 if low else None)
            if amp is not None:
                norm = norm / amp.to(norm.dtype)
            scale = max_norm / (norm + 1e-6)
            scale = torch.where(
                torch.isfinite(norm) & (norm > max_norm), scale, torch.ones_like(scale)
            )
            # a low-precision gradient is scaled in float32: the scale itself, cast to
            # float16, is subnormal for a large norm (max_norm / norm < 6e-5) and lost its
            # precision there (a norm 19% over max_norm, or all zero)
            g = (g.float() * scale).to(g.dtype) if low else g * scale.to(g.dtype)
        if g is grad:
            return None, None
        if not count:
            return g, None
        if max_norm is None and self.nan != "zero" and amp is None:
            # only the clamp changed anything: count what it moved (NaN compares false, stays NaN)
            if lo is not None and hi is not None:
                n = torch.logical_or(grad < lo, grad > hi).sum()
            else:
                n = (grad < lo if lo is not None else grad > hi).sum()
        else:
            diff = g != grad
            if self.nan == "keep":  # NaN stays NaN: not a change
                diff &= g == g  # noqa: PLR0124 - False exactly at NaN
            n = diff.sum()
        return g, n

    def _apply_traced(self, ctx, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """:meth:`_apply` traced into a compiled backward (``grad_in_graph``): the same
        steering, the count handed to the count op with the module's token (a per-module
        tensor, so identical blocks share one graph; see :func:`_count_op`), the scaler's
        scale read from the module's table too (saved for backward, not closed over)."""
        if not grad.is_floating_point():  # (a traced backward cannot read .layout: strict mode)
            return None
        tensors = ctx._module_tensors
        amp = None
        s = self.scaler
        if s is not None and s._enabled:  # (attributes: dynamo skips GradScaler's methods)
            amp = tensors.get((self._tag, "scale")) if tensors is not None else None
            if amp is None:  # none made at compile start (another compile was in flight)
                amp = s._scale
            if amp is not None:
                amp = amp.reshape(()).to(grad.device)
        token = tensors.get((self._tag, "changed")) if tensors is not None else None
        g, n = self._steer(grad, amp)
        if n is not None:
            if token is not None:
                _count_op()(n, token)
            else:  # eager code's context (its forward ran eagerly) under compiled autograd:
                self._count(ctx.name, n)  # the counter's update traced, as before
        return g

    def _off(self) -> bool:
        """Removed or disabled: what torch runs directly (compile starts, the count op in a
        compiled backward) does nothing more."""
        return plugin_off(self, self._session_ref())

    def _failed(self, where: str, exc: Exception) -> None:
        plugin_failed(self, self._session_ref(), where, exc)

    def _count(self, key: str, n: torch.Tensor, copy: bool = False) -> None:
        counter = self._changed.get(key)
        if counter is None or counter.device != n.device:
            if counter is None:
                self._changed[key] = n.clone() if copy else n
            else:
                self._changed[key] = counter.to(n.device) + n
        else:
            counter.add_(n)

    def _put_counters(self) -> None:
        """A zero counter for each steered module (on its parameters' device) and parameter
        (on its own) that has none yet. Compiled autograd traces the eager hooks' count
        (:meth:`_count`), and a trace that added a counter to ``_changed`` guarded on it: the
        whole backward compiled again at the next step. Not for DTensors, modules without
        parameters, nor parameters that need no gradient (eager code makes none for them)."""
        zero = lambda device: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        with torch.inference_mode(False):  # (a compile started under it: counted in backward)
            for name, module in list(self._steered.items()):
                device = param_device(module)
                if (name not in self._changed and device is not None and device.type != "meta"
                        and not any(is_dtensor(p) for p in module.parameters())):
                    self._changed.setdefault(name, zero(device))  # (a backward may count first)
            model = self._model_ref()
            if not self.params or model is None:
                return
            for n, p in model.named_parameters():
                name = clean_name(n)
                if (self._match.get(name) and name not in self._changed and p.requires_grad
                        and not unmaterialized(p) and not is_dtensor(p)):
                    self._changed.setdefault(name, zero(p.device))

    # -- compiled code's per-module tensors --------------------------------------------------------

    def _put_tokens(self, session) -> None:
        """Each selected module's counter token, in the module's tables (both phases) under
        ``(tag, "changed")``, and the scaler's scale where it exists (see :meth:`_put_scale`)."""
        self._tag = next(n for n, p in session.plugins.items() if p is self)
        self._tables = []
        with torch.inference_mode(False):  # saved for backward: never an inference tensor
            for name in session.modules_of(self):
                token = self._tokens.get(name)
                if token is None or int(token) not in _COUNTERS:
                    tid = next(_token_ids)
                    # (the entry goes with the plugin too: a session never removed never ends)
                    gone = lambda _, t=tid: _COUNTERS.pop(t, None)  # noqa: E731
                    _COUNTERS[tid] = (weakref.ref(self, gone), name)
                    token = self._tokens[name] = torch.tensor([tid], dtype=torch.int64)
                for phase in ("train", "eval"):
                    table = session._module_tensors_of(name, phase)
                    if table is not None:
                        table[(self._tag, "changed")] = token
                        self._tables.append(table)
        if self.scaler is not None:
            _SCALED.add(self)
            self._put_scale(init=False)

    def _put_scale(self, init: bool) -> None:
        """The scaler's scale tensor in the module tables under ``(tag, "scale")``, what the
        compiled backward reads (read at trace time, a scaler with no scale yet would be
        traced as unscaled: the first forward runs before the first ``scaler.scale(loss)``).
        ``init`` (at compile start): a scaler with no scale yet gets it as its first
        ``scale()`` makes it (``init_scale``, on the model's device; ``scale()`` then uses
        it)."""
        s = self.scaler
        if s is None or not s.is_enabled():
            return
        if s._scale is None:
            device = param_device(self._model_ref()) if init else None
            if device is None or device.type == "meta":  # (materialized later: at a later compile start)
                return
            with torch.inference_mode(False):
                s._lazy_init_scale_growth_tracker(device)
        for table in self._tables:
            if table.get((self._tag, "scale")) is not s._scale:
                table[(self._tag, "scale")] = s._scale

    def _drop_tokens(self) -> None:
        for token in self._tokens.values():
            _COUNTERS.pop(int(token), None)
        self._tokens = {}
        self._tables = []
        _SCALED.discard(self)

    # -- hooks -----------------------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        self.reset()  # an instance attached again starts afresh, as a new one would
        self._session_ref = weakref.ref(session)
        model = session.model
        self._model_ref = (lambda: None) if model is None else weakref.ref(model)
        self._steered = weakref.WeakValueDictionary(session.modules_of(self) if self.outputs
                                                    else {})
        _LIVE.add(self)
        if self.grad_in_graph:
            self._put_tokens(session)
        if not self.params:
            return
        if not any(self._match_params(session).values()):
            warnings.warn(
                f"hookplug plugin 'gradclamp': params={list(self.params)!r} matches no parameter "
                f"of the {len(session.modules_of(self))} selected module(s); parameter hooks exist "
                "only for parameters of selected modules, so select their owners "
                "(e.g. '*' or 'Linear')",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def _match_params(self, session) -> Dict[str, bool]:
        """Whether ``params=`` steers each parameter of the selected modules, by the name its
        gradient hook gives (the first; a tied one matches by any of its names). Built at
        attach, and again once the session renamed parameters (untied, tied after attach:
        the tensor a hook's name reaches has other names now)."""
        self._settled_seen = session.params_settled
        model = session.model
        match: Dict[str, bool] = {}
        if model is not None:
            ids = {id(p) for m in session.modules_of(self).values() for p in m.parameters()}
            for pid, names in parameter_names(model).items():
                if pid in ids:
                    hit = any(self._glob_matches(n) for n in names)
                    for n in names:  # (a hook named by a name that is no longer the first)
                        match.setdefault(n, hit)
                    match[names[0]] = hit
        if match != self._match:  # (the same dict otherwise: compiled code guards on it)
            self._match = match
        return match

    @hookimpl
    def hookplug_step(self, session):
        if self.params and session.params_settled != self._settled_seen:
            self._match_params(session)

    @hookimpl
    def hookplug_session_end(self, session):
        self._drop_tokens()
        _LIVE.discard(self)

    @hookimpl
    def hookplug_output_grad(self, ctx, grad, path):
        if self.grad_in_graph and _is_compiling():  # traced into a compiled backward
            return self._apply_traced(ctx, grad)
        return self._apply(
            ctx.name,
            lambda: f"module {ctx.name!r} ({path}, call {ctx.call_index}, step {ctx.step})",
            grad,
        )

    @hookimpl
    def hookplug_param_grad(self, name, grad):
        if not self._matches(name):
            return None
        return self._apply(name, lambda: f"parameter {name!r}", grad)

    # -- results ---------------------------------------------------------------------------------

    def results(self) -> Dict[str, Dict[str, Any]]:
        """``{module or parameter name: {"changed": int}}`` (reads the device counters)."""
        if not self._changed:
            return {}
        keys = list(self._changed)
        vals = [c.to("cpu") for c in self._changed.values()]
        return {k: {"changed": int(v)} for k, v in zip(keys, vals)}

    def report(self) -> str:
        res = self.results()
        if not res:
            return ""
        opts = ", ".join(
            f"{k}={v!r}"
            for k, v in (
                ("min", self.min),
                ("max", self.max),
                ("max_norm", self.max_norm),
                ("nan", self.nan),
            )
            if v is not None and not (k == "nan" and v == "keep")
        )
        names = {k: k or "<root>" for k in res}
        width = max(len("name"), *map(len, names.values()))
        lines = [
            f"({opts}{', params=' + repr(list(self.params)) if self.params else ''})",
            f"{'name'.ljust(width)}  changed",
            f"{'-' * width}  -------",
        ]
        lines += [f"{names[k].ljust(width)}  {v['changed']:>7}" for k, v in res.items()]
        return "\n".join(lines)
