"""``StatsBank``: device-resident stats rows for a set of keys, the engine of every plugin
that measures tensors (``stats`` for activations and gradients, ``params`` for weights).

Each key (a tuple, e.g. ``(module, path, phase)``) owns a row, assigned the first time it
is seen; every device a key's tensors live on has a ``[capacity, HEAD + B]`` float64 bank
(row 0: the meta row with the call clock). ``accumulate`` is one
``hookplug::stats_accumulate_`` call on preallocated memory; ``end_step`` copies the rows
in use into a snapshot slot (preallocated for 16 steps at a time) and resets them in place
(same memory: compiled code and CUDA graphs stay valid); snapshots are folded into the
totals in batches, one ``merge_rows`` every 16 steps or when the totals are read;
``collect`` hands the snapshots to telemetry as ``StatsBlock``s. Sampling is ``live``: a
Python check in eager code and a one-element device flag the op reads inside compiled code
(no recompiles).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.nn.parameter import is_lazy

from ._plugin import user_stacklevel
from ._stats import (CLOCK, HEAD, MAX_BINS, StatsBlock, TensorStats, empty_rows, linear_range_ok, merge_rows,
                     touched)

__all__ = ["StatsBank", "MEASURED_AS", "as_measured", "is_dtensor", "dtensor_local"]

_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# What the plugins measure, by dtype: the op's own dtypes as they are (None); the other
# floating dtypes that convert exactly to float32 (the float8 formats) through a float32
# copy. Not listed (integers, bool, complex, packed float4): not measured.
MEASURED_AS: Dict[torch.dtype, Optional[torch.dtype]] = dict.fromkeys(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16))
MEASURED_AS.update((getattr(torch, name), torch.float32) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))
# The clock a bank's steps start from where it measures after the step's forward and backward
# (params, at the optimizer step): telemetry marks a step's first NaN/Inf by the smallest
# clock over the banks, so their values must order after any activation's of the same step.
LATE_CLOCK = 2.0 ** 40
_FOLD_EVERY = 16  # ended steps merged into the totals in one batch
_BANKS: "weakref.WeakValueDictionary[int, StatsBank]" = weakref.WeakValueDictionary()
_bank_ids = itertools.count(1)
_by_key_op: Any = None  # the op, or False where this torch cannot keep it in a graph
_by_row_op: Any = None  # likewise
# banks whose device is not known yet (a model on the meta device): made when dynamo starts
# compiling, so that compiled code never makes a bank while it traces
_DEFERRED: "weakref.WeakSet[StatsBank]" = weakref.WeakSet()

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - older torch / no distributed
    try:
        from torch.distributed._tensor import DTensor as _DTensor
    except Exception:
        _DTensor = None


def as_measured(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` as the plugins measure it (see ``MEASURED_AS``), or None: not measured.
    (``stats``' eager hook inlines this: it is the hot path.)"""
    upcast = MEASURED_AS.get(t.dtype, False)
    if upcast is None:
        return t
    return None if upcast is False else t.to(upcast)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    return _DTensor is not None and isinstance(t, _DTensor)


def unmaterialized(t) -> bool:
    """Whether parameter ``t`` holds no values yet: on ``meta`` (deferred init, new Parameter
    objects come with ``to_empty()``) or a lazy module's ``UninitializedParameter``
    (``nn.LazyLinear``: materialized in place by the module's first forward)."""
    return is_lazy(t) or t.is_meta


def param_device(model) -> Optional[torch.device]:
    """The device of the model's first parameter (a DTensor's local one; ``meta`` before
    materialization), or None."""
    param = next(iter(model.parameters()), None) if model is not None else None
    if param is None:
        return None
    return param.to_local().device if is_dtensor(param) else param.device


def dtensor_local(t, owner: int) -> Tuple[Optional[torch.Tensor], bool]:
    """The part of the DTensor ``t`` this rank counts, such that merging every rank's rows
    (telemetry's cross-rank merge) gives the statistics of the whole logical tensor, each
    element counted once: ``(local tensor or None, partial)``.

    - ``Shard`` mesh dimensions: the local shard (``to_local()``; it may be empty).
    - ``Replicate`` mesh dimensions: every rank along the dimension holds the same data, so
      only the rank whose coordinate there is ``owner % size`` counts it (callers spread
      ``owner``, e.g. a row or parameter index, so the work is spread over the replicas).
    - ``Partial`` placements: partial sums have no mergeable statistics: ``(None, True)``
      (the caller warns).
    - a rank outside the DTensor's mesh: ``(None, False)``.

    Replication *outside* the mesh (a DTensor on a sub-mesh of the world) is not visible
    here: every replica of that sub-mesh counts its part, as data-parallel copies of a plain
    tensor are."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None, False
    for dim, pl in enumerate(t.placements):
        if pl.is_partial():
            return None, True
        if pl.is_replicate() and coord[dim] != owner % mesh.size(dim):
            return None, False
    return t.to_local(), False


def bank_effect_op(fn):
    """``fn`` (annotated, returning None) as the op ``hookplug::<its name>``: a fake kernel
    that returns nothing and an ordered effect, so compiled graphs keep it."""
    torch.library.custom_op(f"hookplug::{fn.__name__}", mutates_args=())(fn).register_fake(
        lambda *args: None)
    op = getattr(torch.ops.hookplug, fn.__name__).default
    _register_ordered_effect(op)
    return op


def _owned(bank: "StatsBank", where: str, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)`` where torch calls the bank directly (an op compiled code runs,
    a compile start): an error is the owning plugin's (``bank.on_error``, which raises under
    ``on_error="raise"``); under "warn" the bank's ops do nothing from then on."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the plugin's, not the model's or the compile's
        if bank.on_error is None:
            raise
        bank.on_error(where, exc)
        bank.broken = True


def accumulate_by_key_op():
    """``hookplug::stats_accumulate_by_key(x, bank, module, site, phase) -> ()``, or None
    where torch offers no way to keep it in a compiled graph (grad sites then graph-break
    as before). The bank (by id) and row (by key) are looked up when it runs, so a compiled
    backward holds no bank tensor (AOT autograd would save it for backward, and the
    forward's in-place updates of it would then fail autograd's version check), and rows
    are assigned at run time. It returns nothing: registered as an ordered effect so
    compiled graphs keep it."""
    global _by_key_op
    if _by_key_op is None:
        def stats_accumulate_by_key(x: torch.Tensor, bank: int, module: str, site: str, phase: str) -> None:
            owner = _BANKS.get(bank)
            if owner is not None and not owner.broken:
                _owned(owner, "its op in a compiled backward", owner.accumulate, x, (module, site, phase),
                       gated=True)

        try:
            _by_key_op = bank_effect_op(stats_accumulate_by_key)
        except (AttributeError, ImportError, TypeError, RuntimeError, AssertionError):
            _by_key_op = False  # a torch without these (private) APIs
    return _by_key_op or None


def accumulate_by_row_op():
    """``hookplug::stats_accumulate_by_row(x, bank, row) -> ()``: ``accumulate_by_key`` with
    the row index as a tensor (a module's, see ``StatsBank.make_row_tensors``) instead of
    names, so a compiled backward shared by identical blocks measures each block into its
    own row. ``bank`` is the bank's ``token``, a CPU tensor holding its id, kept in the
    module's table beside the row: a graph input, not a constant, so a graph traced for one
    session's bank serves the next session's (attached again) with no recompile, and a
    backward left from a removed session's forward finds no bank. None where
    :func:`accumulate_by_key_op` is."""
    global _by_row_op
    if _by_row_op is None:
        def stats_accumulate_by_row(x: torch.Tensor, bank: torch.Tensor, row: torch.Tensor) -> None:
            owner = _BANKS.get(int(bank))
            if owner is not None and not owner.broken:
                _owned(owner, "its op in a compiled backward", owner.accumulate_at, x, row)

        _by_row_op = (accumulate_by_key_op() is not None) and bank_effect_op(stats_accumulate_by_row)
    return _by_row_op or None


def _row_for_trace(bank_id: int, module: str, path: str, phase: str) -> int:
    """The row of a key for traced code, run as it is while dynamo traces (marked a constant
    result: the graph holds the row; dynamo neither traces the assignment nor guards on the
    bank's tables, and a trace inside an activation checkpoint, where dynamo refuses such
    side effects, assigns it too. Rows never change once assigned and bank ids are never
    reused; the graph guards on the bank's id). Traced with autograd on, the module's new
    row tensors are held back until the step ends (see :func:`_hold_for_trace`)."""
    bank = _BANKS[bank_id]
    if torch.is_grad_enabled():  # (as the traced code runs: no backward, no recompute, else)
        bank.held_modules.add(module)
    key = (module, path, phase)
    if (key not in bank.rows and len(bank.keys) + 1 >= bank._capacity
            and torch._guards.TracingContext.try_get() is not None):
        # the bank must grow, and this trace (on this thread: is_compiling() is true for the
        # whole process during a compile, also in another thread's eager hooks) holds its rows
        # tensor as a graph input already: grow now, with room to spare, and trace again
        bank.reserve(2 * (len(bank.keys) + 1) + 64)
        from torch._dynamo.exc import RestartAnalysis

        raise RestartAnalysis(restart_reason="hookplug: the stats bank grew while tracing")
    return bank.row_of(key)


def _hold_for_trace(bank_id: int, module: str) -> int:
    """Called while dynamo traces a module's hook that found no row tensor in its table: no
    new row tensor goes into that table until the step ends (``make_row_tensors``), so a
    recompute of the graph in the step's backward (an activation checkpoint around a
    compiled block) finds the table as the trace did, and runs the same graph (another
    graph, with other saved tensors, failed the checkpoint's check). (A constant result,
    as :func:`_row_for_trace`.)"""
    _BANKS[bank_id].held_modules.add(module)
    return 0


def _device_rows_for_trace(bank_id: int, device: torch.device) -> int:
    """Make the bank's rows on ``device`` while dynamo traces (a model with no parameters
    compiled before any eager call: its device was not known at attach). Run as it is
    (a constant result, as :func:`_row_for_trace`): the lock that guards the making is no
    graph break. Traced code taking a constant row (:meth:`StatsBank.accumulate`, which
    guards on the bank's id already) calls it before every read of the bank's device
    table, so the trace, started again after new rows (the table may have been read
    already), takes the same path."""
    bank = _BANKS[bank_id]
    if device in bank._devices:
        return 0
    if bank.device_rows(device) is not None and torch._guards.TracingContext.try_get() is not None:
        from torch._dynamo.exc import RestartAnalysis

        raise RestartAnalysis(restart_reason="hookplug: a stats bank for a new device while tracing")
    return 0


_row_for_trace._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, no import
_hold_for_trace._dynamo_marked_constant = True
_device_rows_for_trace._dynamo_marked_constant = True


def _register_ordered_effect(op) -> None:
    """Mark ``op`` an ordered side effect (private torch APIs: there is no public one).
    Also mark torch's ``with_effects`` (the node such an op becomes in a graph) a side
    effect for FX's dead-code elimination: compiled autograd copies an AOT backward into
    its own graph without the effect tokens and then eliminates dead code, and FX judges
    ``with_effects`` pure, so the grad site's op was dropped (no gradient record) when
    compiled autograd was enabled around ``backward()`` only."""
    from torch._higher_order_ops import effects

    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None:  # newer torch: by name (2.13 refuses a CustomOpDef here)
        register(op._name, effects._EffectType.ORDERED)
    else:  # older torch: the op overload
        effects._register_effectful_op(op, effects._EffectType.ORDERED)
    try:
        from torch.fx.node import has_side_effect

        has_side_effect(torch.ops.higher_order.with_effects)
    except (ImportError, AttributeError):  # a torch without either: as before
        pass


_START: Optional[Callable] = None  # _on_compile_start / _on_compile_end as registered (see below)
_END: Optional[Callable] = None


def hook_compile_start() -> None:
    """Have dynamo call ``_on_compile_start`` when it starts compiling a frame (torch's
    compile-start callbacks; imports dynamo; registered again after a
    ``torch._dynamo.reset()``, which clears them). Where this torch has none, a deferred
    bank is made by its first call, as any bank (traced: graph breaks at warm-up), and row
    tensors are made at steps only."""
    try:
        from torch._dynamo.callback import callback_handler

        _install_callbacks(callback_handler)
        _mark_trace_constants()
    except Exception:  # noqa: BLE001 - a torch without them (private API)
        pass
    _keep_effects_in_compiled_autograd()


def _keep_effects_in_compiled_autograd() -> None:
    """Compiled autograd's dead-code elimination keeps the nodes in its ``_impure_targets``
    and those ``Node.is_impure()`` calls impure. torch 2.11's ``is_impure`` does not look a
    higher-order op up in ``_side_effectful_functions`` (2.13 does), so ``has_side_effect``
    (see :func:`_register_ordered_effect`) does not keep ``with_effects`` there: the grad
    site's and gradclamp's count ops were dropped from a backward run under compiled
    autograd. Name it among compiled autograd's impure targets (private API; once dynamo
    and its compiled_autograd module are imported: also at each compile start)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    targets = getattr(ca, "_impure_targets", None)
    if targets is None:
        return
    try:
        op = torch.ops.higher_order.with_effects
        if op not in targets:
            targets.add(op)
    except Exception:  # noqa: BLE001 - private API
        pass


def dynamo_disable() -> Optional[Callable]:
    """``torch._dynamo.disable`` once dynamo is imported (its import done), else None: a
    session never imports dynamo itself (seconds, for code that may never compile)."""
    return getattr(sys.modules.get("torch._dynamo"), "disable", None)


def _install_callbacks(handler) -> None:
    """Register the compile start/end callbacks, wrapped in ``torch._dynamo.disable`` so they
    run outside dynamo: a compile that starts inside code dynamo runs (the lazy backward
    compile of a compiled step calling ``backward()`` after a graph break, under compiled
    autograd) calls them with dynamo's frame hook on, and dynamo converting a callback's
    frame takes the callbacks' lock it holds there (a deadlock). Called while dynamo is still
    importing (its config's import hook), they are registered bare and wrapped in place at
    the first compile start, which is never such a nested one."""
    global _START, _END
    if _START is None:
        disable = dynamo_disable()
        if disable is not None:
            _START, _END = disable(_on_compile_start), disable(_on_compile_end)
    for callbacks, register, bare, wrapped in (
            (handler.start_callbacks, handler.register_start_callback, _on_compile_start, _START),
            (handler.end_callbacks, handler.register_end_callback, _on_compile_end, _END)):
        if wrapped is not None and bare in callbacks:
            callbacks[callbacks.index(bare)] = wrapped  # in place: dynamo may be iterating
        if (wrapped or bare) not in callbacks:
            register(wrapped or bare)
    if not getattr(handler, "_hookplug_keeps_callbacks", False):
        _keep_callbacks_through_clear(handler)


def _keep_callbacks_through_clear(handler) -> None:
    """``torch._dynamo.reset()`` / ``torch.compiler.reset()`` clear every compile callback:
    a session attached before (a notebook cell, a test fixture) would then trace without
    its compile-start work (gradclamp's loss-scale tensors: a first backward clamped in
    scaled units, silently). Register ours again after each clear."""
    clear = handler.clear

    def clear_and_keep_hookplugs() -> None:
        try:
            clear()  # (raises when callbacks are pending: after emptying the lists)
        finally:
            _install_callbacks(handler)

    try:
        handler.clear = clear_and_keep_hookplugs
        handler._hookplug_keeps_callbacks = True
    except (AttributeError, TypeError):  # (a handler without an instance dict: as before)
        pass


# Whether inference mode was on where dynamo started compiling a frame, and that compile's
# id, per thread: dynamo traces with it off, and cannot read it in traced code.
_TRACE_STATE = threading.local()


def _read_trace_inference_mode() -> bool:
    """The inference mode noted at the start of the compile being traced; False where none
    was noted for it (callbacks dropped by ``torch._dynamo.reset()``, or skipped: dynamo
    runs them only when no other compile is in flight, on any thread)."""
    noted = getattr(_TRACE_STATE, "inference_mode", None)
    if not noted:
        return False
    if noted[1] is None:  # a torch whose callbacks name no compile: the note (cleared at the end)
        return True
    try:
        from torch._guards import CompileContext

        return str(CompileContext.current_compile_id()) == noted[1]
    except Exception:  # noqa: BLE001 - private API
        return False


def _not_known() -> bool:
    return False


# What traced code calls (``trace_inference_mode()``, read through this module): the reader
# once hook_compile_start has marked it a constant of the trace (no guard of its own: a
# graph traced under inference mode runs only there anyway, dynamo's tensor guards check
# the dispatch keys, which inference mode changes). Marking imports dynamo, so it waits
# until dynamo is imported; False where this torch cannot mark it.
trace_inference_mode: Callable[[], bool] = _not_known


def _mark_trace_constants() -> None:
    global trace_inference_mode
    mark = getattr(torch.compiler, "assume_constant_result", None)
    if mark is not None and trace_inference_mode is _not_known:
        trace_inference_mode = mark(_read_trace_inference_mode)


# more to run at each compile start (the session's: dynamo's per-thread config settings on
# the compiling thread)
ON_COMPILE_START: List[Callable[[], None]] = [_keep_effects_in_compiled_autograd]


def _on_compile_start(args=None) -> None:
    """Before dynamo traces a frame (outside the trace): the caller's inference mode is noted
    (see ``trace_inference_mode``), deferred banks are made, and each bank's
    ``before_trace`` runs (``stats``: rows and row tensors for keys an earlier trace met, so
    the next identical block's trace finds them and shares its graph)."""
    if _START is None:  # registered bare while dynamo was importing: wrap them now
        try:
            from torch._dynamo.callback import callback_handler

            _install_callbacks(callback_handler)
        except Exception:  # noqa: BLE001 - private API
            pass
    for settle in ON_COMPILE_START:
        settle()
    inference = torch.is_inference_mode_enabled()
    _TRACE_STATE.inference_mode = (True, getattr(args, "compile_id", None)) if inference else None
    if trace_inference_mode is _not_known:  # (dynamo was still importing at hook_compile_start)
        _mark_trace_constants()
    # bank memory and row tensors made here are never inference tensors (a compile started
    # under inference_mode, e.g. a validation pass before training: a training graph saves
    # row tensors for backward)
    with torch.inference_mode(False) if inference else contextlib.nullcontext():
        for bank in list(_DEFERRED):
            bank.prepare_deferred()
        for bank in list(_BANKS.values()):
            if bank.before_trace is not None and not bank.broken:
                _owned(bank, "its compile-start hook", bank.before_trace)


def _on_compile_end(_args=None) -> None:
    """The compiles in flight ended: what ``_on_compile_start`` noted is no longer theirs
    (compile ids start over after ``torch._dynamo.reset()``, which also drops these
    callbacks: a stale note could match a later compile's id)."""
    _TRACE_STATE.inference_mode = None


def check_sites(who: str, sites, allowed) -> tuple:
    """``sites`` (a name or a sequence of names) as a non-empty tuple drawn from ``allowed``."""
    sites = (sites,) if isinstance(sites, str) else tuple(sites)
    if not sites or any(s not in allowed for s in sites):
        raise ValueError(f"{who}: sites must be a non-empty subset of {allowed}, got {sites!r}")
    return sites


def check_hist_options(who: str, bins, hist, range):  # noqa: A002 - the op's own name
    """The histogram options of a measuring plugin (types checked by ``hookplug._options``),
    range-checked: ``(bins, hist, range)`` with ``range`` as floats, or a ValueError naming
    the plugin, the option and the value."""
    if bins is not None and not 0 <= bins <= MAX_BINS:
        raise ValueError(f"{who}: bins must be None or an int in [0, {MAX_BINS}], got {bins!r}")
    if range is not None:
        lo, hi = (float(v) for v in range)
        if not linear_range_ok(lo, hi, MAX_BINS):  # (bins not known yet: the most)
            raise ValueError(f"{who}: range must be finite with lo < hi (hi - lo finite, and "
                             f"{MAX_BINS} / (hi - lo) finite), got {range!r}")
        range = (lo, hi)
    if hist == "linear" and range is None and bins != 0:
        raise ValueError(
            f"{who}: hist='linear' needs range=(lo, hi): rows are merged over calls, steps and "
            "ranks, which needs the same bucket edges every time (or use hist='log2', which "
            "needs no range)")
    return bins, hist, range


#: The default bound on the memory (the device's, where the rows live) of the ended steps a
#: bank keeps for telemetry: with no sink and no flush a 16,000-row bank kept 1024 steps, 19 GB
MAX_PENDING_BYTES = 256 * 2**20


def check_max_pending(who: str, max_pending_steps: int, max_pending_bytes: Optional[int] = None) -> None:
    """``max_pending_steps`` (ended steps kept for telemetry) must be >= 1, and
    ``max_pending_bytes`` None or >= 1."""
    if max_pending_steps < 1:
        raise ValueError(f"{who}: max_pending_steps must be >= 1, got {max_pending_steps!r}")
    if max_pending_bytes is not None and max_pending_bytes < 1:
        raise ValueError(f"{who}: max_pending_bytes must be None or >= 1, got {max_pending_bytes!r}")


def host_copy(t: torch.Tensor):
    """``t`` on the host without blocking: ``(host tensor, CUDA event or None)``; the copy
    has landed once the event is done (CPU tensors: at once)."""
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(t.device):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return host, event
    return (t if t.device.type == "cpu" else t.to("cpu")), None


def _outside_inference_mode(fn):
    """Bank memory is created and replaced outside inference mode (a read of results() or
    an eval forward under ``torch.inference_mode`` must not leave inference tensors that
    later in-place resets would refuse); the context is entered only when it is on."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _is_compiling() and torch.is_inference_mode_enabled():  # (dynamo cannot read it)
            with torch.inference_mode(False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


class _DeviceRows:
    """One device's rows: ``acc`` (the step being filled), ``gate`` (the sampling flag the
    op reads), ``empty`` (what a reset copies in), ``totals`` (ended steps, merged) and
    ``unfolded`` (snapshots of ended steps not merged into ``totals`` yet: they are merged
    in one batch, at most every ``_FOLD_EVERY`` steps or when read). A snapshot holds the
    rows in use when it was taken (the meta row and one per key), not the whole capacity."""

    __slots__ = ("acc", "gate", "empty", "totals", "unfolded", "lock", "_block", "_next", "_views",
                 "_snapshot", "retired", "graph_kept", "kernel")

    @_outside_inference_mode
    def __init__(self, device, capacity: int, width: int, lo: float, hi: float, live: bool,
                 clock_base: float = 0.0):
        self.empty = empty_rows(capacity, width - HEAD, lo, hi, device=device)
        self.empty[0, CLOCK].fill_(clock_base)  # where each step's clock starts (see LATE_CLOCK)
        self.acc = self.empty.clone()
        self.totals = self.empty.clone()
        self.unfolded: List[torch.Tensor] = []
        # the step's rows before the bank last grew (see grow): merged into acc at end_step
        self.retired: List[torch.Tensor] = []
        # retired CUDA rows, never freed while the bank lives: a CUDA graph recorded before
        # the bank grew (an eager capture, inductor's reduce-overhead backward) still writes
        # there, and freed memory would be another tensor's
        self.graph_kept: List[torch.Tensor] = []
        self.gate = torch.full((1,), live, dtype=torch.bool, device=device)  # (no host copy)
        # end_step's append and fold: readers may be other threads. Reentrant: a signal handler
        # that removes the session (SIGTERM: flush and exit) can run inside a fold and end a
        # step there (the final flush); the step that was folding is in StatsBank.pending by
        # then (end_step notes a step before it folds), so telemetry loses no step. The totals
        # may then miss the nested step (the outer fold writes its merge over the nested one's).
        self.lock = threading.RLock()
        self._block: Optional[Tuple[torch.Tensor, ...]] = None  # snapshot slots up to the next fold
        self._next = 0  # the next free slot
        self._views: Tuple = (0, None, None)  # (used, acc[:used], empty[:used])
        self._snapshot = None  # CPU: the compiled snap <- acc, acc <- empty (one call, no dispatcher)
        from . import ops

        # whether the compiled op has a kernel here (not for CUDA where _C was built without
        # its CUDA kernels, nor MPS/XPU: the pure-torch reference then, with a warning once)
        self.kernel = ops.has_kernel(self.acc.device)
        if self.acc.device.type == "cpu":
            self._snapshot = ops.snapshot_rows()

    @_outside_inference_mode
    def end_step(self, used: int, fold_every: int = _FOLD_EVERY) -> torch.Tensor:
        """Snapshot and reset the first ``used`` rows of ``acc`` in place (no other row was
        written); the snapshot waits in ``unfolded`` (see :meth:`fold_due`). While the set
        of rows stays the same,
        snapshots are slots (views made with the block) of a block allocated once per fold
        batch (a block is never reused: its slots live as long as anyone holds them), so a
        step costs two copies, no allocation and, on the CPU, one call into the extension
        and no torch op; the step after rows were added gets a copy of its own."""
        if self.retired:
            self._absorb_retired()
        n, acc, empty = self._views
        if n != used:  # rows were added (or the bank grew): keys may keep arriving
            acc, empty = self.acc[:used], self.empty[:used]
            self._views = (used, acc, empty)
            self._block = None
            if self._snapshot is not None:  # one call: no other thread's merge between the copies
                snap = acc.new_empty(acc.shape)
                self._snapshot(acc, empty, snap)
            else:
                snap = acc.clone()
                acc.copy_(empty)
        else:
            slots, i = self._block, self._next
            if slots is None or i == len(slots):  # slots up to the next fold
                count = max(1, fold_every - len(self.unfolded))
                slots = self._block = acc.new_empty((count, *acc.shape)).unbind(0)
                i = 0
            self._next = i + 1
            snap = slots[i]
            if self._snapshot is not None:
                self._snapshot(acc, empty, snap)
            else:
                snap.copy_(acc)
                acc.copy_(empty)
        with self.lock:
            self.unfolded.append(snap)
        return snap

    def fold_due(self, fold_every: int = _FOLD_EVERY) -> None:
        """Fold once ``fold_every`` snapshots wait (``StatsBank.end_step`` calls it after
        noting the ended step in ``pending``)."""
        if len(self.unfolded) >= fold_every:
            self.fold()

    @_outside_inference_mode
    def fold(self) -> torch.Tensor:
        """``totals`` with every unfolded snapshot merged in (one ``merge_rows``)."""
        with self.lock:
            return self._fold_locked()

    def _fold_locked(self) -> torch.Tensor:
        if self.unfolded:
            used = max(s.shape[0] for s in self.unfolded)
            snaps = [pad_rows(s, self.empty[:used]) for s in self.unfolded]
            merged = merge_rows(torch.stack([self.totals[:used], *snaps]))
            # a new tensor: what fold() returned before never changes under its reader
            self.totals = torch.cat([merged, self.totals[used:]])
            self.unfolded = []
        return self.totals

    @_outside_inference_mode
    def reset(self) -> None:
        with self.lock:
            self.acc.copy_(self.empty)
            self.totals.copy_(self.empty)
            self.unfolded = []
            self.graph_kept.extend(r for r in self.retired if r.is_cuda)
            self.retired = []

    def current(self) -> torch.Tensor:
        """The step being filled (``acc``, with the rows it had before the bank grew merged
        in): what readers of the running step use."""
        if not self.retired:
            return self.acc
        with self.lock:  # (not while grow swaps them)
            return _merge_retired(self.acc, self.retired, self.empty)

    @_outside_inference_mode
    def grow(self, capacity: int) -> None:
        """More rows. The step's rows so far stay where they are (``retired``) and ``acc``
        starts empty (its clock carried on): another thread's op that read ``acc`` before
        the swap and merges after it (CPU kernels run without the GIL) still lands in the
        retired rows, which ``end_step`` merges in; copying them over would lose it."""
        with self.lock:  # against end_step's _absorb_retired (another thread's step())
            self._fold_locked()
            fresh = self.empty[-1:].expand(capacity - self.acc.shape[0], -1)  # not the meta row
            empty = torch.cat([self.empty, fresh])
            old = self.acc
            acc = empty.clone()
            acc[0] = old[0]  # the meta row: the clock goes on
            self.empty, self.acc = empty, acc
            self.retired.append(old)
            self.totals = torch.cat([self.totals, fresh])
            self._views = (0, None, None)

    def _absorb_retired(self) -> None:
        with self.lock:
            retired, self.retired = self.retired, []
            self.acc.copy_(_merge_retired(self.acc, retired, self.empty))
            self.graph_kept.extend(r for r in retired if r.is_cuda)


def _merge_retired(acc: torch.Tensor, retired: List[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """``acc`` with the (fewer) rows of each retired bank merged in (``empty``: acc's empty
    rows); the clock is the latest of theirs (each counted on from the same value)."""
    stacked = torch.stack([acc] + [pad_rows(r, empty) for r in retired])
    out = merge_rows(stacked)
    out[0, CLOCK] = stacked[:, 0, CLOCK].amax()
    return out


def merge_devices(per_device: List[torch.Tensor]) -> torch.Tensor:
    """Rows of the same keys taken on several devices, merged on the first one's device (a
    key measured on one device only keeps its rows: the others' are empty)."""
    if len(per_device) == 1:
        return per_device[0]
    return merge_rows(torch.stack([r.to(per_device[0].device) for r in per_device]))


def pad_rows(snap: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """``snap`` (a snapshot taken when fewer rows were in use) with the rows of ``empty``
    after its own: as many rows as ``empty``."""
    n = snap.shape[0]
    return snap if n >= empty.shape[0] else torch.cat([snap, empty[n:]])


class StatsBank:
    """Rows of statistics on the device, one per key (see the module docstring)."""

    def __init__(self, *, bins: Optional[int] = None, hist: str = "log2",
                 range: Optional[Sequence[float]] = None,  # noqa: A002 - the op's own name
                 max_pending_steps: int = 1024, max_pending_bytes: Optional[int] = MAX_PENDING_BYTES,
                 who: str = "stats", clock_base: float = 0.0):
        from . import ops

        self.who = who
        self.max_pending_steps = max_pending_steps
        self.max_pending_bytes = max_pending_bytes
        self.clock_base = clock_base
        self.op_args = ops.hist_args(bins, hist, range)  # (bins, hist_mode, lo, hi)
        self._reference = ops.reference_accumulate_  # (a device without a compiled kernel)
        nb = ops.buckets(self.op_args[0], hist)
        self.width = HEAD + nb
        if nb == 0:
            self.kind, self._range_cols = "none", (0.0, 0.0)
        elif hist == "log2":
            edge = math.ldexp(1.0, ops.LOG2_MAX_EXP + 1)
            self.kind, self._range_cols = "log2", (-edge, edge)
        else:
            self.kind, self._range_cols = ("linear", *range), tuple(range)
        self._capacity = 64
        self._devices: Dict[torch.device, _DeviceRows] = {}
        self._assigning = threading.RLock()  # new keys and devices (not the hot path)
        self._later: Optional[Callable[[], Any]] = None  # where the device will be (prepare)
        self._accumulate: Optional[Callable] = None
        self._eager: Optional[Callable] = None
        self._by_key: Optional[Callable] = None
        self._by_row: Optional[Callable] = None
        self._accumulate_at: Optional[Callable] = None
        # the per-module tensor table of a key (compiled code's row indices, see
        # make_row_tensors), set by the plugin; and the (keys, devices) made so far
        self.table_of: Optional[Callable[[Tuple], Optional[Dict]]] = None
        self._tables_made = (0, 0)
        self.before_trace: Optional[Callable[[], None]] = None  # see _on_compile_start
        # set by the owning plugin: an error in the ops compiled code runs (which the session
        # does not call) goes through its on_error; under "warn" the ops then do nothing
        self.on_error: Optional[Callable[[str, Exception], None]] = None
        self.broken = False
        self.live = True
        self._warned = False
        self._collected = False
        self.rows: Dict[Tuple, int] = {}
        self.keys: List[Tuple] = []  # row r holds keys[r - 1]
        self.held_modules: set = set()  # traced without a row tensor in this step
        self.pending: List[Tuple[int, Dict[torch.device, torch.Tensor]]] = []
        self.dropped_through: Optional[int] = None  # the last step dropped since collect()
        self.id = next(_bank_ids)  # what stats_accumulate_by_key finds it by (see prepare)
        # the id as the by-row op takes it (a graph input: see accumulate_by_row_op)
        with torch.inference_mode(False):  # saved for backward: never an inference tensor
            self.token = torch.tensor([self.id], dtype=torch.int64)
        self.tag = who  # a key's row tensor is kept under it (see _table_entry)

    # -- rows --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every value (pending telemetry included), in place: rows keep their keys
        and memory, so compiled code and captured CUDA graphs stay valid."""
        for dev in self._devices.values():
            dev.reset()
        self.pending = []
        self.dropped_through = None
        self._warned = self._collected = False

    def row_of(self, key: Tuple) -> int:
        row = self.rows.get(key)
        if row is not None:
            return row
        if _is_compiling():  # dynamo traces no lock (and one frame at a time)
            return self._assign(key)
        with self._assigning:  # threads sharing a model may meet a new key together
            return self._assign(key)

    def _assign(self, key: Tuple) -> int:
        row = self.rows.get(key)
        if row is None:
            row = len(self.keys) + 1
            if row >= self._capacity:
                self.reserve(2 * self._capacity)
            self.keys.append(key)
            self.rows[key] = row
        return row

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` keys (a power of two). Done at session start for twice the keys
        assigned then and 64 more (their eval-phase twins, extra output paths), so that
        compiled code does not grow the bank while tracing."""
        capacity = self._capacity
        while capacity <= rows:
            capacity *= 2
        if capacity != self._capacity:
            self._capacity = capacity
            for dev in self._devices.values():
                dev.grow(capacity)

    def device_rows(self, device) -> Optional[_DeviceRows]:
        """The rows of ``device``, made the first time; None for the meta device: a meta
        tensor has no values (a model built on ``meta`` and materialized later with
        ``to_empty``), and a bank there could never be read."""
        dev = self._devices.get(device)
        if dev is None:
            if torch.device(device).type == "meta":
                return None
            with self._assigning:  # one _DeviceRows per device, whichever thread comes first
                dev = self._devices.get(device)
                if dev is None:
                    dev = self._devices[device] = _DeviceRows(device, self._capacity, self.width,
                                                              *self._range_cols, self.live,
                                                              self.clock_base)
        return dev

    def prepare(self, device=None, *, later: Optional[Callable[[], Any]] = None) -> None:
        """Before the first call (e.g. at session start): the op and the likely device's
        bank, so compiled code never creates them while tracing. None for the meta device;
        ``later()`` then says where the tensors are once known (e.g. the device of the
        model's parameters after ``to_empty``, None while still meta): its bank is made
        when dynamo starts compiling (eager code makes it at its first call anyway)."""
        from . import ops

        if ops.backend() != "reference":
            self._accumulate = torch.ops.hookplug.stats_accumulate_.default
            self._accumulate_at = torch.ops.hookplug.stats_accumulate_at_.default
            self._eager = ops.eager_accumulate()
        else:
            self._accumulate = ops.reference_accumulate_
            self._accumulate_at = ops.reference_accumulate_
        self._by_key = accumulate_by_key_op()
        self._by_row = accumulate_by_row_op()
        _BANKS[self.id] = self  # found by id from now on (again after a close(): attached once more)
        if device is not None:
            self.device_rows(device)
        if later is not None:
            self._later = later
            _DEFERRED.add(self)
            hook_compile_start()

    def prepare_deferred(self) -> None:
        """Make the bank of the device ``prepare(later=...)`` names, once it is known."""
        later = self._later
        if later is None:
            _DEFERRED.discard(self)
            return
        device = later()
        if device is None or torch.device(device).type == "meta":
            return
        self._later = None
        _DEFERRED.discard(self)
        self.device_rows(device)
        self.make_row_tensors()

    # -- the hot path ------------------------------------------------------------------------
    def accumulate(self, t: torch.Tensor, key: Tuple, gated: bool = False,
                   skip_recompute: bool = False, gate: Optional[torch.Tensor] = None) -> None:
        """Merge the statistics of ``t`` (strided, floating) into ``key``'s row (``gated``:
        sampling left to the device gate alone, as in compiled code). A meta tensor has no
        values: its key gets a row, nothing is measured. ``skip_recompute``: a forward
        hook's call in compiled code (see ``hookplug.ops``: the op does nothing when it
        runs as an activation-checkpoint recompute). ``gate``: a one-element bool tensor on
        ``t``'s device in place of the sampling gate (the caller and's them)."""
        compiling = _is_compiling()
        if not compiling and not self.live and not gated:
            return  # an unsampled step (eager); traced code reads the device gate instead
        if compiling:  # (the device first: a restart for it comes before the key is held)
            _device_rows_for_trace(self.id, t.device)
            row = _row_for_trace(self.id, *key)
        else:
            row = self.rows.get(key) or self.row_of(key)
        dev = self._devices.get(t.device) or self.device_rows(t.device)
        if dev is None:  # the meta device
            return
        # The gate is passed in eager code too: a CUDA graph captured there replays the op,
        # and the device flag is what keeps sampling working on replay.
        gate = dev.gate if gate is None else gate
        if not dev.kernel:
            return self._reference(t.detach(), dev.acc, row, gate, *self.op_args, skip_recompute)
        if not compiling and self._eager is not None and type(t) in _PLAIN_TENSORS:
            self._eager(t, dev.acc, row, gate, *self.op_args)  # below autograd: no detach
            return
        if self._accumulate is None:  # subclasses, traced code and the reference op: torch.ops
            self.prepare()
        self._accumulate(t.detach(), dev.acc, row, gate, *self.op_args, skip_recompute)

    def close(self) -> None:
        """The session ended: a compiled backward that still runs finds no bank by id
        (records nothing, as removed tensor hooks do)."""
        _BANKS.pop(self.id, None)
        _DEFERRED.discard(self)
        self._later = None

    def accumulate_traced(self, t: torch.Tensor, ctx, path: str, forward: bool) -> None:
        """``accumulate(t, (ctx.name, path, ctx.phase))`` inside compiled code (``forward``:
        from a forward hook, not counted again when an activation-checkpoint recompute
        re-runs the compiled code), the row index
        passed as the module's tensor (``ctx._module_tensors``, see :meth:`make_row_tensors`)
        instead of a constant: the graph is the same for every module, so identical hooked
        blocks share it. A key with no tensor yet (first seen while tracing, or a device
        new to the bank) takes the constant row: that module's graph is its own (the
        tensors are made at the next compile start or step, see ``_on_compile_start``)."""
        row = ctx._module_tensors.get(self._table_entry(path, ctx.phase, t.device))
        if row is None:
            return self.accumulate(t, (ctx.name, path, ctx.phase), skip_recompute=forward)
        self.accumulate_at(t, row, skip_recompute=forward)

    def accumulate_at(self, t: torch.Tensor, row: torch.Tensor, skip_recompute: bool = False) -> None:
        """Merge ``t`` into the row whose index ``row`` holds (on ``t``'s device; gated), as
        the by-row op does when a compiled backward runs it."""
        dev = self._devices.get(t.device) or self.device_rows(t.device)  # (a row tensor's device has rows)
        if dev is not None:
            accumulate_at = self._accumulate_at if dev.kernel else self._reference
            accumulate_at(t.detach(), dev.acc, row, dev.gate, *self.op_args, skip_recompute)

    def accumulate_by_row(self, t: torch.Tensor, ctx, path: str) -> None:
        """``accumulate_by_key`` for a compiled backward, by the module's row tensor where it
        exists (see :meth:`accumulate_traced`), else by names (also for a context an eager
        forward made, which has no table: its hook traced by compiled autograd)."""
        tensors = ctx._module_tensors
        if tensors is None:
            return self.accumulate_by_key(t, (ctx.name, path, ctx.phase))
        row = tensors.get(self._table_entry(path, ctx.phase, t.device))
        if row is None or self._by_row is None:
            if _is_compiling():
                _hold_for_trace(self.id, ctx.name)
            return self.accumulate_by_key(t, (ctx.name, path, ctx.phase))
        self._by_row(t.detach(), tensors[self.tag], row)

    def _table_entry(self, path: str, phase: str, device) -> Tuple:
        """Where a module's table keeps the row tensor of its key ``(module, path, phase)``:
        under the bank's ``tag`` (its plugin's name in the session, so the entry and a
        graph's guards on it are the same when the plugin is attached again), not its id."""
        return (self.tag, path, phase, device)

    def set_tables(self, table_of: Optional[Callable[[Tuple], Optional[Dict]]],
                   before_trace: Optional[Callable[[], None]] = None, tag: Optional[str] = None) -> None:
        """Where :meth:`make_row_tensors` puts each key's row tensor (a session's module
        bindings: a plugin attached again starts over with the new session's), under
        ``tag`` (the plugin's name in that session: unique there), and what to run when
        dynamo starts compiling a frame (see ``_on_compile_start``)."""
        self.table_of = table_of
        if tag is not None:
            self.tag = tag
        self.before_trace = before_trace
        self._tables_made = (0, 0)
        if before_trace is not None and "torch._dynamo" in sys.modules:
            hook_compile_start()  # (not imported yet: compiled code would import it first)

    @_outside_inference_mode
    def make_row_tensors(self, *, at_compile_start: bool = False) -> None:
        """Put each key's row index, as a one-element int64 tensor on each device of the
        bank, in the per-module table ``table_of(key)`` returns (a module binding's
        ``module_tensors``), under :meth:`_table_entry`: what compiled code passes
        the op instead of a constant row; and the bank's ``token`` under its ``tag`` (what
        the by-row op takes instead of a constant bank id). Outside traced code only (``at_compile_start``:
        dynamo's compile-start callback, compiling but not tracing; a module traced without a
        row tensor in this step gets its new ones at the step's end, see
        :func:`_hold_for_trace`); costs nothing when no key or device was added since the
        last call."""
        if self.before_trace is not None and not at_compile_start and "torch._dynamo" in sys.modules:
            hook_compile_start()  # again after a torch._dynamo.reset(), which drops it
        made = (len(self.keys), len(self._devices))
        if self.table_of is None or made == self._tables_made or (_is_compiling() and not at_compile_start):
            return
        held = self.held_modules if at_compile_start else ()
        devices, done = list(self._devices)[:made[1]], True
        for key in self.keys[:made[0]]:
            row, table = self.rows.get(key), self.table_of(key)
            if row is None or key[0] in held:  # another thread is assigning it (keys first,
                done = False  # then rows), or traced in this step: again next time
                continue
            if table is None:
                continue
            if self.tag not in table:  # the bank, as the by-row op takes it (a graph input)
                table[self.tag] = self.token
            for device in devices:
                entry = self._table_entry(*key[1:], device)
                if entry not in table:
                    # a fill, not torch.tensor([row], device=): no host copy (a stream sync)
                    table[entry] = torch.full((1,), row, dtype=torch.int64, device=device)
        self._tables_made = made if done else (0, 0)
        if not at_compile_start:
            self.held_modules.clear()

    def accumulate_by_key(self, t: torch.Tensor, key: Tuple[str, str, str]) -> None:
        """``accumulate`` as one op that names the bank and key, no bank tensor: what a
        traced backward (a compiled grad hook) calls; rows are assigned when it runs."""
        if self._by_key is None:
            self.prepare()
        if self._by_key is None:  # no by-key op in this torch: as eager code does
            self.accumulate(t, key)
        else:
            self._by_key(t.detach(), self.id, *key)

    def set_live(self, live: bool) -> None:
        if live != self.live:
            self.live = live
            for dev in self._devices.values():
                dev.gate.fill_(live)  # a device op: no sync; never inside a CUDA graph

    # -- step boundary and telemetry ---------------------------------------------------------
    def end_step(self, step: int, *, warn_unflushed: bool = False, final: bool = False) -> None:
        """Snapshot the step that ended and reset the bank in place (folded into the totals
        in batches: see ``_DeviceRows.fold``). ``final``: the step running at ``remove()``,
        kept beside ``max_pending_steps`` ended ones (it is often empty)."""
        if not self.live or not self._devices:
            return
        used = len(self.keys) + 1  # the meta row and every assigned row
        # a step's rows; the steps that fit the byte bound (at least one) are all that are
        # kept, for telemetry and for the fold batch alike (a kept snapshot is a slot of a
        # fold batch's block, which lives while any of its slots does)
        size = sum(used * dev.acc.shape[1] * dev.acc.element_size() for dev in self._devices.values())
        fit = self.max_pending_steps if self.max_pending_bytes is None else max(1, self.max_pending_bytes // size)
        keep, fold_every = min(self.max_pending_steps, fit), min(_FOLD_EVERY, fit)
        snaps = {}
        for device, dev in self._devices.items():
            snaps[device] = dev.end_step(used, fold_every)
        self.pending.append((step, snaps))
        if len(self.pending) > keep + final:
            dropped = [s for s, _ in self.pending[: len(self.pending) - keep - final] if type(s) is int]
            if dropped:
                self.dropped_through = max(dropped + [self.dropped_through or dropped[0]])
            del self.pending[: len(self.pending) - keep - final]
            if (warn_unflushed or self._collected) and not self._warned:
                self._warned = True
                bound = (f"max_pending_steps={self.max_pending_steps}" if keep == self.max_pending_steps else
                         f"max_pending_bytes={self.max_pending_bytes} at {size} bytes a step")
                warnings.warn(
                    f"hookplug plugin {self.who!r}: more ended steps than the {keep} kept were not "
                    f"collected by telemetry ({bound}); older steps are kept in results() only. "
                    "Set flush_every= (or a smaller one), call session.flush() more often, or "
                    "raise the bound.", RuntimeWarning, stacklevel=user_stacklevel())
        for dev in self._devices.values():  # after the step is pending: see _DeviceRows.lock
            dev.fold_due(fold_every)

    def collect_for(self, plugin, session, meta: Callable[[Tuple, int], Dict[str, Any]]
                    ) -> Optional[List[StatsBlock]]:
        """A producer plugin's ``hookplug_collect``: :meth:`collect`, after ending the step
        in progress at the final flush of ``remove()``. Not for a plugin the session
        disabled: its steps stopped at the one it failed in (never ended, so not emitted);
        the steps it ended before still reach the sinks."""
        if session.removed and not any(p is plugin for n, p in session.plugins.items()
                                       if n in session.disabled):
            self.end_step(session.step_index, final=True)
        return self.collect(meta) or None

    def collect(self, meta: Callable[[Tuple, int], Dict[str, Any]]) -> List[StatsBlock]:
        """The ended steps not yet collected, one block per step and device; ``meta(key,
        step)`` describes a row."""
        pending, self.pending = self.pending, []
        dropped, self.dropped_through = self.dropped_through, None
        self._collected = True  # (steps dropped before a later flush are warned about)
        n = len(self.keys)
        out = []
        try:
            for step, snaps in pending:
                metas = [meta(key, step) for key in self.keys]
                for snap in snaps.values():
                    rows = snap[1:n + 1]  # a snapshot taken before the bank grew has fewer rows
                    out.append(StatsBlock(metas[:rows.shape[0]], rows, self.kind, dropped))
        except BaseException:  # (Ctrl-C) the steps stay pending, before any ended since
            self.pending = pending + self.pending
            self.dropped_through = dropped
            raise
        return out

    def total_rows(self, n: Optional[int] = None) -> Optional[torch.Tensor]:
        """The rows of every assigned key (meta row left out), or of the first ``n``: totals
        plus the running step, merged over devices; None before any key or device."""
        if n is None:
            n = len(self.keys)
        if not n or not self._devices:
            return None
        return merge_devices([merge_rows(torch.stack([d.fold()[1:n + 1], d.current()[1:n + 1]]))
                              for d in self._devices.values()])

    def merged(self, select: Callable[[Tuple], Optional[Tuple]]) -> Dict[Tuple, TensorStats]:
        """Totals plus the running step, merged over devices and over the keys ``select``
        maps to one group (``None``: left out); rows never touched are left out."""
        # the keys the rows are read for: a forward on another thread (a server's request
        # thread) may assign more meanwhile
        keys = self.keys[:]
        rows = self.total_rows(len(keys))
        if rows is None:
            return {}
        used = touched(rows).tolist()  # rows assigned in advance may never be used
        groups: Dict[Tuple, List[int]] = {}
        for i, key in enumerate(keys):
            group = select(key) if used[i] else None
            if group is not None:
                groups.setdefault(group, []).append(i)
        return {g: TensorStats(rows[idx[0]] if len(idx) == 1 else merge_rows(rows[idx]), self.kind)
                for g, idx in groups.items()}

