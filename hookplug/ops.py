"""The fused tensor-statistics op: ``tensor_stats(x) -> TensorStats`` in one pass.

Backends, tried in this order (``backend()`` says which one is in use):

- ``"compiled"``: the prebuilt extension ``hookplug._C`` (``pip install -e .``);
- ``"jit"``: the same sources (``csrc/``) built on first use with
  ``torch.utils.cpp_extension.load`` (ninja) into the torch extensions cache;
- ``"reference"``: :func:`reference_tensor_stats`, pure torch, with one warning.

``HOOKPLUG_REQUIRE_EXT=1`` turns the fallback into an ``ImportError`` that says why the
build failed (CI sets it). The op is ``torch.ops.hookplug.tensor_stats(x, bins, hist_mode,
lo=None, hi=None) -> (counts, moments, hist_counts, hist_edges)``, with a fake kernel so
``torch.compile`` keeps it as one node. See :class:`hookplug.TensorStats` for the fields.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Optional, Sequence, Tuple

import torch

from . import _loader
from ._stats import TensorStats

__all__ = ["tensor_stats", "reference_tensor_stats", "backend", "LOG2_MIN_EXP", "LOG2_MAX_EXP",
           "LOG2_BINS", "log2_edges"]

LOG2_MIN_EXP = -32
LOG2_MAX_EXP = 32
LOG2_BINS = 2 * (LOG2_MAX_EXP - LOG2_MIN_EXP + 1) + 1  # 131
DEFAULT_LINEAR_BINS = 100
_HIST_MODES = {"log2": 0, "linear": 1}
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_lock = threading.RLock()
_backend: Optional[str] = None
_C = None
_has_cuda = False  # the loaded extension has CUDA kernels
_load_error: Optional[str] = None


# -- loading ---------------------------------------------------------------------------------

def _jit_build():
    """Build csrc/ for the running torch with the JIT (see :mod:`hookplug._loader`)."""
    return _loader.jit_build()


def _load(allow_jit: bool = True) -> Optional[str]:
    """Find a backend (once). Returns it, or None when only the JIT build is left to try."""
    global _backend, _C, _has_cuda
    if _backend is not None:
        return _backend
    with _lock:
        if _backend is not None:
            return _backend
        mod, kind = _loader.load(allow_jit, build=lambda: _jit_build())
        if kind is None:
            return None
        if kind != "reference":
            layout = tuple(mod.log2_layout())
            if layout != (LOG2_MIN_EXP, LOG2_MAX_EXP, LOG2_BINS):
                raise ImportError(
                    f"hookplug: the compiled op's log2 layout {layout} does not match hookplug.ops "
                    f"({LOG2_MIN_EXP}, {LOG2_MAX_EXP}, {LOG2_BINS}); rebuild it")
            _C, _has_cuda = mod, bool(mod.has_cuda())
            _register_fake()
        _backend = kind
        return kind


def backend() -> str:
    """``"compiled"``, ``"jit"`` or ``"reference"`` (loads the op if not done yet)."""
    return _load()


def _register_fake() -> None:
    register = getattr(torch.library, "register_fake", None)  # torch >= 2.4
    if register is None:  # pragma: no cover - older torch
        register = getattr(torch.library, "impl_abstract")

    def fake(x, bins, hist_mode, lo=None, hi=None):
        _check_dtype(x, "hookplug::tensor_stats")
        nb = _num_buckets(bins, "log2" if hist_mode == 0 else "linear")
        return (x.new_empty((4,), dtype=torch.int64), x.new_empty((5,), dtype=torch.float64),
                x.new_empty((nb,), dtype=torch.int64),
                x.new_empty((nb + 1 if nb else 0,), dtype=torch.float64))

    try:
        register("hookplug::tensor_stats", fake)
    except RuntimeError as e:  # already registered (module reloaded)
        if "already" not in str(e):
            raise


# -- argument handling -----------------------------------------------------------------------

def _check_dtype(x, who: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{who}: expected a floating tensor (float32, float64, float16, bfloat16), "
                        f"got {x.dtype}")


def _num_buckets(bins: int, hist: str) -> int:
    if bins == 0:
        return 0
    return LOG2_BINS if hist == "log2" else bins


def _parse(x, bins, hist, range) -> Tuple[int, str, Optional[float], Optional[float]]:
    who = "hookplug.ops.tensor_stats"
    _check_dtype(x, who)
    if hist not in _HIST_MODES:
        raise ValueError(f"{who}: expected hist='log2' or 'linear', got {hist!r}")
    if bins is None:
        bins = LOG2_BINS if hist == "log2" else DEFAULT_LINEAR_BINS
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 0:
        raise ValueError(f"{who}: expected bins to be an int >= 0 (0 turns the histogram off), "
                         f"got {bins!r}")
    lo = hi = None
    if range is not None:
        if hist != "linear":
            raise ValueError(f"{who}: range applies to hist='linear' only, got hist={hist!r} "
                             f"with range={range!r}")
        try:
            lo, hi = (float(v) for v in range)
        except (TypeError, ValueError):
            raise ValueError(f"{who}: expected range=(lo, hi) of two numbers, "
                             f"got {range!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"{who}: expected a finite range with lo < hi, got {range!r}")
    return bins, hist, lo, hi


def _kind(nb: int, hist: str, lo, hi):
    if nb == 0:
        return "none"
    if hist == "log2":
        return "log2"
    return ("linear", lo, hi) if lo is not None else "linear"


_warned_devices = set()


def _warn_no_kernel(dev: str) -> None:
    """The extension has no kernel for ``dev`` (e.g. built where torch had no CUDA or
    CUDA_HOME was unset): say so once per device type instead of falling back silently."""
    if dev not in _warned_devices:
        _warned_devices.add(dev)
        warnings.warn(
            f"hookplug: the compiled stats op has no {dev} kernel (hookplug._C was built without "
            f"it; rebuild with CUDA_HOME set where torch has CUDA); {dev} tensors use the "
            "pure-torch reference (slower)", RuntimeWarning, stacklevel=3)


# -- public API ------------------------------------------------------------------------------

def tensor_stats(x: torch.Tensor, *, bins: Optional[int] = None, hist: str = "log2",
                 range: Optional[Sequence[float]] = None) -> TensorStats:
    """Statistics of ``x`` in one pass, as a :class:`TensorStats` of device tensors.

    ``hist="log2"`` (default): the fixed 131-bucket sign/exponent histogram (any ``bins > 0``
    turns it on, ``bins=0`` off). ``hist="linear"``: ``bins`` (default 100) equal buckets
    over ``range=(lo, hi)``, or over the finite min/max found on the device (a second pass,
    never a host copy). No host synchronization; ``x`` is read in its own dtype and layout.
    """
    bins, hist, lo, hi = _parse(x, bins, hist, range)
    be = _backend if _backend is not None else _load()
    dev = x.device.type
    if be == "reference" or not (dev in ("cpu", "meta") or (dev == "cuda" and _has_cuda)):
        if be != "reference":
            _warn_no_kernel(dev)
        return reference_tensor_stats(x, bins=bins, hist=hist, range=range)
    out = torch.ops.hookplug.tensor_stats(x, bins, _HIST_MODES[hist], lo, hi)  # no autograd (C++)
    return TensorStats._from_outputs(*out, hist_kind=_kind(_num_buckets(bins, hist), hist, lo, hi))


_LOG2_EDGES = {}  # device -> edges, built once per device (a fresh copy is returned)


def log2_edges(device=None) -> torch.Tensor:
    """The 132 edges of the log2 histogram (float64): -2**33 .. -2**-32, 2**-32 .. 2**33."""
    device = torch.device(device if device is not None else "cpu")
    edges = _LOG2_EDGES.get(device)
    if edges is None:
        neg = [-math.ldexp(1.0, e) for e in range(LOG2_MAX_EXP + 1, LOG2_MIN_EXP - 1, -1)]
        pos = [math.ldexp(1.0, e) for e in range(LOG2_MIN_EXP, LOG2_MAX_EXP + 2)]
        edges = torch.tensor(neg + pos, dtype=torch.float64).to(device, non_blocking=True)
        _LOG2_EDGES[device] = edges
    return edges.clone()


def reference_tensor_stats(x: torch.Tensor, *, bins: Optional[int] = None, hist: str = "log2",
                           range: Optional[Sequence[float]] = None) -> TensorStats:
    """Pure-torch :func:`tensor_stats` (same signature and semantics, float64 math on an
    upcast copy, no host sync; slow). The tests' reference and the fallback backend."""
    bins, hist, lo, hi = _parse(x, bins, hist, range)
    f64, i64 = torch.float64, torch.int64
    v = x.detach().reshape(-1).to(f64)
    dev = v.device
    nan_m, inf_m = torch.isnan(v), torch.isinf(v)
    fin = ~(nan_m | inf_m)
    counts = torch.stack([torch.full((), v.numel(), dtype=i64, device=dev), nan_m.sum(),
                          inf_m.sum(), (v == 0).sum()])
    nf = fin.sum().to(f64)
    has = nf > 0
    if v.numel():
        mn = torch.where(fin, v, math.inf).amin()
        mx = torch.where(fin, v, -math.inf).amax()
    else:
        mn = torch.full((), math.inf, dtype=f64, device=dev)
        mx = torch.full((), -math.inf, dtype=f64, device=dev)
    safe_n = torch.where(has, nf, 1.0)
    mean = torch.where(fin, v, 0.0).sum() / safe_n
    dev_ = torch.where(fin, v - mean, 0.0)
    std = torch.sqrt((dev_ * dev_).sum() / safe_n)
    nan = torch.full((), math.nan, dtype=f64, device=dev)
    mn, mx = torch.where(has, mn, nan), torch.where(has, mx, nan)
    moments = torch.stack([mn, mx, torch.where(has, mean, nan), torch.where(has, std, nan),
                           torch.where(has, torch.maximum(mn.abs(), mx.abs()), nan)])
    nb = _num_buckets(bins, hist)
    hc = torch.zeros(nb, dtype=i64, device=dev)
    if nb == 0:
        he = torch.zeros(0, dtype=f64, device=dev)
    elif hist == "log2":
        _, e = torch.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1: binary exponent e - 1
        e = (e.to(i64) - 1).clamp(LOG2_MIN_EXP, LOG2_MAX_EXP)
        zero_bin = LOG2_MAX_EXP - LOG2_MIN_EXP + 1
        idx = torch.where(v < 0, LOG2_MAX_EXP - e, zero_bin + 1 + (e - LOG2_MIN_EXP))
        idx = torch.where(v == 0, zero_bin, idx)
        idx = torch.where(inf_m, torch.where(v > 0, LOG2_BINS - 1, 0), idx)
        hc.scatter_add_(0, torch.where(nan_m, 0, idx), (~nan_m).to(i64))
        he = log2_edges(dev)
    else:
        if lo is not None:
            lo_t = torch.full((), lo, dtype=f64, device=dev)
            hi_t = torch.full((), hi, dtype=f64, device=dev)
        else:  # the finite min/max, widened like torch.histc
            lo_t, hi_t = torch.where(has, mn, 0.0), torch.where(has, mx, 0.0)
            eq = lo_t == hi_t
            lo_t, hi_t = torch.where(eq, lo_t - 1, lo_t), torch.where(eq, hi_t + 1, hi_t)
        width = hi_t - lo_t
        scale = torch.full_like(width, float(nb)) / width  # a true division, as in C++
        inside = (v >= lo_t) & (v <= hi_t)
        b = ((torch.where(inside, v, lo_t) - lo_t) * scale).to(i64).clamp(0, nb - 1)
        hc.scatter_add_(0, b, inside.to(i64))
        i = torch.arange(nb + 1, dtype=f64, device=dev)
        he = lo_t + (width * i) / nb
        he[nb] = hi_t
    return TensorStats._from_outputs(counts, moments, hc, he, hist_kind=_kind(nb, hist, lo, hi))


# Import the prebuilt extension now (cheap); a JIT build waits for the first use.
try:
    _load(allow_jit=False)
except ImportError:
    if os.environ.get("HOOKPLUG_REQUIRE_EXT", "0") == "1":
        raise
