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
  matches none of them warns at attach time.
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
"""

from __future__ import annotations

import fnmatch
import math
import struct
import warnings
from typing import Any, Dict, Literal, Optional, Sequence, Union

import torch

import hookplug
from hookplug import hookimpl
from hookplug._func import is_batched, outside_transforms, unwrapped
from hookplug._plugin import warn_once
from hookplug._selectors import parameter_names

__all__ = ["GradClampPlugin"]



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


class GradClampPlugin(hookplug.Plugin):
    """Clamp / clip / NaN-guard gradients of module outputs and (with ``params=``) of
    parameters. See the module docstring for the options."""

    name = "gradclamp"
    sampled = False  # steering gradients must not stop on the steps `every=N` skips

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
        self._match: Dict[str, bool] = {}
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Zero the changed-element counters."""
        self._changed: Dict[str, torch.Tensor] = {}
        self._dtype_bounds: Dict[torch.dtype, tuple] = {}
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
            return None
        if grad.layout != torch.strided or grad.is_nested:
            warn_once(self._layouts_warned, grad.layout, lambda: (
                f"gradclamp: the gradient of {what()} is a {grad.layout} tensor; only strided "
                "(dense) gradients are steered, this one is left as it is"))
            return None
        amp = self._scale(grad) if self.scaler is not None else None
        if amp is None:
            lo, hi = self._bounds(grad.dtype)
        else:  # unscaled bounds: times the scale, as tensors (torch.clamp rounds them to the dtype)
            lo = None if self.min is None or self.min == -math.inf else amp * self.min
            hi = None if self.max is None or self.max == math.inf else amp * self.max
        g = grad
        if self.nan == "raise":
            if bool(torch.isnan(g).any()):  # the one deliberate sync
                raise FloatingPointError(f"gradclamp: NaN in the gradient of {what()}")
        elif self.nan == "zero":
            g = torch.nan_to_num(g, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        if lo is not None or hi is not None:
            c = torch.clamp(g, min=lo, max=hi)
            g = c if amp is None else torch.where(torch.isinf(g), g, c)  # the scaler's to see
        if self.max_norm is not None:
            low = g.dtype in (torch.float16, torch.bfloat16)
            norm = torch.linalg.vector_norm(g, dtype=torch.float32 if low else None)
            if amp is not None:
                norm = norm / amp.to(norm.dtype)
            scale = self.max_norm / (norm + 1e-6)
            scale = torch.where(
                torch.isfinite(norm) & (norm > self.max_norm), scale, torch.ones_like(scale)
            )
            # a low-precision gradient is scaled in float32: the scale itself, cast to
            # float16, is subnormal for a large norm (max_norm / norm < 6e-5) and lost its
            # precision there (a norm 19% over max_norm, or all zero)
            g = (g.float() * scale).to(g.dtype) if low else g * scale.to(g.dtype)
        if g is grad:
            return None
        if is_batched(grad):  # under vmap: a count would be a BatchedTensor escaping it
            return g
        if self.max_norm is None and self.nan != "zero" and amp is None:
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
        plain = unwrapped(n)
        if plain is not n:  # inside torch.func.grad: n wraps the count; a counter kept as such
            with outside_transforms():  # escaped, and an in-place add to one made outside raised
                self._count(key, plain)
        else:
            self._count(key, n)
        return g

    def _count(self, key: str, n: torch.Tensor) -> None:
        counter = self._changed.get(key)
        if counter is None or counter.device != n.device:
            self._changed[key] = n if counter is None else counter.to(n.device) + n
        else:
            counter.add_(n)

    # -- hooks -----------------------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        if not self.params:
            return
        self._match = {}  # names of another model (a plugin attached again)
        model = session.model
        hits = []
        if model is not None:
            ids = {id(p) for m in session.modules_of(self).values() for p in m.parameters()}
            for pid, names in parameter_names(model).items():
                if pid in ids:  # the hooks name it by its first name; a tied one matches by any
                    hit = self._match[names[0]] = any(self._glob_matches(n) for n in names)
                    hits.append(hit)
        if not any(hits):
            warnings.warn(
                f"hookplug plugin 'gradclamp': params={list(self.params)!r} matches no parameter "
                f"of the {len(session.modules_of(self))} selected module(s); parameter hooks exist "
                "only for parameters of selected modules, so select their owners "
                "(e.g. '*' or 'Linear')",
                RuntimeWarning,
                stacklevel=2,
            )

    @hookimpl
    def hookplug_output_grad(self, ctx, grad, path):
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
        width = max(len(k) for k in res) if res else 4
        lines = [
            f"({opts}{', params=' + repr(list(self.params)) if self.params else ''})",
            f"{'name'.ljust(width)}  changed",
            f"{'-' * width}  -------",
        ]
        lines += [f"{(k or '<root>').ljust(width)}  {v['changed']:>7}" for k, v in res.items()]
        return "\n".join(lines)
