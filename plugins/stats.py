"""``stats``: fused tensor statistics of module inputs, outputs and output gradients.

    opts = {"sites": ("output", "grad")}
    with hookplug.attach(model, "Conv2d|Linear", plugins=("stats", opts)) as s:
        model(x).sum().backward()
    st = s["stats"].results()["layer1.0.conv1"]["output"]     # a hookplug.TensorStats
    st.max, st.std, st.hist_counts                             # device tensors

Options (keyword-only):

- ``sites=("output",)``: any of ``"input"`` (the positional and keyword arguments, before
  ``forward``), ``"output"``, ``"grad"`` (the gradient of each output tensor, seen in
  backward). A single string is accepted.
- ``bins``: passed to :func:`hookplug.ops.tensor_stats`: ``0`` turns the histogram off;
  for ``hist="linear"`` the number of buckets (``None``: 100; at most 65,536). The log2
  histogram always has its fixed 131 sign/exponent buckets.
- ``hist="log2"|"linear"`` and ``range=(lo, hi)``: the histogram kind and, for ``"linear"``,
  its fixed range (required: per-call histograms are merged into one row).
- ``max_pending_steps=1024``: how many ended steps wait for telemetry (``hookplug_collect``)
  when nobody flushes; older ones stay in ``results()`` only (one warning if a sink exists).
  ``max_pending_bytes=256 MiB`` (None: no bound) bounds their memory too (the device's,
  where the rows live): a model with many modules keeps fewer steps (at least one).
- ``nonfinite="record"|"raise"``: ``"record"`` (default) reports the first NaN/Inf of a
  step through telemetry (``first_nonfinite`` records, ``session.nonfinite``); ``"raise"``
  also raises ``FloatingPointError`` at ``session.step()`` naming the module, site, phase
  and step of the first non-finite value (execution order, forward and backward) of the
  step that ended. On the CPU that step is checked at once; on an accelerator the bank's
  ``first_bad`` column is copied to the host without blocking when the step ends and read
  at the following ``step()`` (the error comes one step later, the loop never syncs).
  The error goes through the session's ``on_error`` like any plugin error: under
  ``on_error="warn"`` it becomes a warning and switches the stats plugin off.

**The device-resident engine.** Every ``(module, path, phase)`` owns a row of a
persistent float64 bank on the tensor's device (layout: :mod:`hookplug._stats`), assigned
the first time it is seen. A hook call is one ``hookplug::stats_accumulate_`` op that
merges the tensor's statistics into its row in place: no Python object per call, no host
sync, a constant row index (so ``torch.compile`` keeps one graph and CUDA graphs can
replay it). ``session.step()`` acts on the bank as a whole: it copies the rows of the step
that ended into a snapshot and resets them in place (same memory); the snapshots are
folded into the totals in batches (one :func:`hookplug._stats.merge_rows` per 16 steps or
per read of ``results()``). Sampling
(``every=N``) is a one-element device flag the op reads (inside compiled code) and a Python
check in eager code: no recompiles.

Every floating tensor of the structure is measured and keyed by its path: ``"output"``,
``"output[1]"``, ``"output.logits"``; ``"input[0]"``, ``"input.mask"`` (keyword argument
``mask``); ``"grad"``, ``"grad[1]"`` (the gradient of ``output``, ``output[1]``). Integer,
bool, complex and quantized tensors (``torch.ao.quantization``'s quint8 outputs: select the
model before ``convert``, or its ``DeQuantStub``s after) are skipped. A row counts its calls too (``calls``): a site whose
tensors were empty in every call (an expert no token reached) has an entry with ``calls > 0``,
``numel`` 0 and NaN statistics. Phases: forwards of the model in eval mode (the attached
model's mode, not a submodule's) or under ``torch.inference_mode`` are kept apart (``phase="eval"`` in records); activation
checkpointing's recomputed forwards are not counted (the session does not call forward
hooks during a recompute).

``results(phase=None)`` is ``{module: {path: TensorStats}}`` over every call and step of
every phase (``phase="train"``/``"eval"``: one phase); telemetry records are per phase.

**Under torch.distributed** every rank measures its own tensors and telemetry merges the
rows across ranks (one collective per flush): a record describes the tensors of every rank
together (``results()`` is this rank's part). A plain tensor is counted on every rank:
right for data-parallel activations (each rank's batch is different data); a tensor that
is in fact the same on several ranks (the input every tensor-parallel rank is given, or
the output of ``RowwiseParallel`` with its default ``Replicate()`` layout returned as a
local tensor) is then counted once per rank: counts, ``l2`` and histogram scale with the
number of copies, while min/max/mean/std/rms are those of one copy. A **DTensor**
(tensor/sequence parallel activations, e.g. ``SequenceParallel``'s output, and their
gradients) is measured by its local shard, and a ``Replicate()`` mesh dimension is counted
once (on one coordinate of that dimension, chosen per key): the merged record is the
statistics of the whole logical tensor, each element once (replication outside the
DTensor's mesh is not visible). ``Partial()`` DTensors (pending sums) are skipped with one
warning. A model built on the ``meta`` device is measured once materialized
(``to_empty()``): meta tensors are never measured, and the bank of the device it is
materialized on is made when dynamo starts compiling (torch's compile-start callback), so a
compiled model keeps one graph as if attached after ``to_empty``.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import torch

import hookplug
from hookplug import hookimpl
from hookplug._plugin import plugin_failed, plugin_off, user_stacklevel
from hookplug._bank import (MAX_PENDING_BYTES, MEASURED_AS, StatsBank, _is_compiling, accumulate_by_key_op, as_measured, check_hist_options,
                            check_max_pending, check_sites, dtensor_local, host_copy, is_dtensor,
                            param_device)
from hookplug._func import is_batched
from hookplug._stats import FIRST_BAD, TensorStats
from hookplug.structures import iter_tensors

__all__ = ["StatsPlugin"]

_SITES = ("input", "output", "grad")
_PHASES = ("train", "eval")
_STRIDED = torch.strided
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not a DTensor: no isinstance check
# The keys a stats plugin's bank held when its session ended, by model and the plugin's name
# in the session. A session attached to that model again under that name assigns them first,
# in the same order: its modules' row-tensor tables then equal the last session's, and the
# graphs compiled for it (eval keys, tuple outputs included) match with no recompile
# (attaching a session for a window of steps, again and again, to a compiled model).
_LAST_KEYS: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, List[Tuple]]]" = \
    weakref.WeakKeyDictionary()



def _failed(plugin_ref, session_ref, where: str, exc: Exception) -> None:
    """``bank.on_error`` of a stats plugin (weak references: no cycle through the bank)."""
    plugin = plugin_ref()
    if plugin is None:
        raise exc
    plugin_failed(plugin, session_ref(), where, exc)


class StatsPlugin(hookplug.Plugin):
    """Per module and site, a :class:`hookplug.TensorStats` of every floating tensor, merged
    over calls and steps on the device. See the module docstring for the options."""

    name = "stats"  # sampled (every=N): unbound on unsampled steps in eager code; in
    # compiled code (always bound) the bank's device gate skips them
    collect_when_disabled = True  # its bank hands over only the steps ended before (collect_for)

    def __init__(
        self,
        *,
        sites: Sequence[str] = ("output",),
        bins: Optional[int] = None,
        hist: Literal["log2", "linear"] = "log2",
        range: Optional[Tuple[float, float]] = None,  # noqa: A002 - the op's own name
        max_pending_steps: int = 1024,
        nonfinite: Literal["record", "raise"] = "record",
        max_pending_bytes: Optional[int] = MAX_PENDING_BYTES,
    ):
        sites = check_sites("stats", sites, _SITES)
        bins, hist, range = check_hist_options("stats", bins, hist, range)
        check_max_pending("stats", max_pending_steps, max_pending_bytes)
        self.sites = sites
        # hookplug_output_grad can be traced into a compiled backward (no graph break per
        # module) where this torch can keep the by-key op in a graph
        self.grad_in_graph = "grad" in sites and accumulate_by_key_op() is not None
        self.nonfinite = nonfinite
        self._bad_in_flight: list = []  # [(step, [(host column, event)])] copies not yet read
        self.bins = bins
        self.hist = hist
        self.range = range
        self.max_pending_steps = max_pending_steps
        self.max_pending_bytes = max_pending_bytes
        self.bank = StatsBank(bins=bins, hist=hist, range=range, max_pending_steps=max_pending_steps,
                              max_pending_bytes=max_pending_bytes, who=self.name)
        # Switch off the hooks of sites not asked for, so the core registers no torch hook
        # for them (pluggy ignores an instance attribute that is not a function).
        if "input" not in sites:
            self.hookplug_forward_input = None
        if "output" not in sites:  # "grad" alone: the core still hooks outputs for their grads
            self.hookplug_forward_output = None
        if "grad" not in sites:
            self.hookplug_output_grad = None
        self._module_order: Dict[str, int] = {}
        self._grad_rows_done = 0  # bank keys looked at by _grad_rows
        self._spread_done = 0  # bank keys looked at by _before_trace
        self._warned_layout = False
        self._warned_partial = False

    # -- state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every stat gathered so far (pending telemetry included), in place."""
        self.bank.reset()
        self._bad_in_flight.clear()

    @property
    def _keys(self):
        return self.bank.keys

    @property
    def _pending(self):
        return self.bank.pending

    def _record(self, ctx, path: str, t, forward: bool = True) -> None:
        upcast = MEASURED_AS.get(t.dtype, False)  # as_measured(t), inlined: the hot path
        if upcast is not None:
            if upcast is False:  # integer, bool, complex
                return
            t = t.to(upcast)  # float8: measured exactly through a float32 copy
        if type(t) not in _PLAIN_TENSORS and is_dtensor(t):
            t = self._local(ctx, path, t)
            if t is None:
                return
        if t.is_nested or t.layout is not _STRIDED:
            t = self._strided(ctx, path, t)
            if t is None:
                return
        try:
            if ctx._module_tensors is None:  # eager code
                self.bank.accumulate(t, (ctx.name, path, ctx.phase))
            else:  # compiled code: the module's row tensor, not its name (one graph for all)
                self.bank.accumulate_traced(t, ctx, path, forward)
        except RuntimeError as exc:
            if is_batched(t):  # name the problem, not functorch's batching fallback
                raise RuntimeError(
                    f"stats: the {path} of {ctx.name!r} is batched by torch.func (vmap, and "
                    "jacrev/hessian with the grad site); stats cannot measure it: run the "
                    "model outside vmap, or pass on_error='warn' to switch stats off there") from exc
            raise

    def _local(self, ctx, path: str, t):
        """What this rank measures of a DTensor (tensor/sequence parallel activations and
        their gradients): its local shard, counted once over the ``Replicate()`` mesh
        dimensions (``hookplug._bank.dtensor_local``, owner: from the module's place in the
        selection, the path and the phase, the same on every rank; not the key's row, which
        differs between ranks that met other keys first), so telemetry's cross-rank merge
        gives the whole tensor's statistics; None: nothing here (the key still gets its row)."""
        self.bank.row_of((ctx.name, path, ctx.phase))
        owner = self._module_order.get(ctx.name, 0) + len(path) + (ctx.phase == "eval")
        local, partial = dtensor_local(t, owner)
        if partial and not self._warned_partial:
            self._warned_partial = True
            warnings.warn(
                f"hookplug plugin 'stats': {path} of {ctx.name or '<root>'!r} is a DTensor with "
                f"a Partial placement ({t.placements}); partial sums have no mergeable "
                "statistics, such tensors are skipped", RuntimeWarning, stacklevel=user_stacklevel())
        return local

    def _strided(self, ctx, path: str, t):
        """What the op measures of a tensor that is not a plain strided one: a nested
        tensor's elements (no padding), or None (skipped, one warning) for other layouts."""
        if t.is_nested:
            t = t.detach()
            try:
                if t.is_contiguous():
                    return t.values().reshape(-1)
                return torch.cat([u.reshape(-1) for u in t.unbind()])
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                why = f"a nested tensor whose elements cannot be read ({type(exc).__name__}: {exc})"
        else:
            why = f"layout {t.layout}"
        if not self._warned_layout:
            self._warned_layout = True
            warnings.warn(
                f"hookplug plugin 'stats': {path} of {ctx.name or '<root>'!r} has {why}; "
                "the stats op reads strided tensors only, such tensors are skipped",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return None

    # -- hooks (hot path) ------------------------------------------------------------------------

    # The hooks take the specs' full argument lists: the core then calls them directly.

    @hookimpl
    def hookplug_forward_input(self, ctx, module, args, kwargs):
        for path, t in iter_tensors(args, "input"):
            self._record(ctx, path, t)
        if kwargs:
            for path, t in iter_tensors(kwargs, "input"):
                self._record(ctx, path, t)

    @hookimpl
    def hookplug_forward_output(self, ctx, module, args, kwargs, output):
        if isinstance(output, torch.Tensor):  # the common case, without the walker
            self._record(ctx, "output", output)
            return
        # output is None when forward raised: iter_tensors yields nothing
        for path, t in iter_tensors(output):
            self._record(ctx, path, t)

    @hookimpl
    def hookplug_output_grad(self, ctx, module, grad, path):
        site = "grad" + path[6:] if path.startswith("output") else f"grad.{path}"
        if _is_compiling() and self.grad_in_graph:  # a compiled backward: the op names bank and key,
            grad = as_measured(grad)
            if grad is not None:  # no bank tensor (see StatsBank.accumulate_by_key)
                if is_dtensor(grad):
                    grad = self._local(ctx, site, grad)
                    if grad is None:
                        return
                self.bank.accumulate_by_row(grad, ctx, site)
            return
        self._record(ctx, site, grad, forward=False)

    # -- session and telemetry -------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        self.reset()  # an instance attached again starts afresh, as a new one would
        self.bank.on_error = functools.partial(_failed, weakref.ref(self), weakref.ref(session))
        self.bank.broken = False  # (an error in an earlier session's ops stopped them)
        self._module_order = {n: i for i, n in enumerate(session.modules_of(self))}
        tag = next(n for n, p in session.plugins.items() if p is self)
        # The keys of the last session on this model first (see _LAST_KEYS), then the usual
        # keys, so compiled code finds them on its first trace (a row assigned while tracing
        # costs one recompile at warm-up).
        for key in _LAST_KEYS.get(session.model, {}).get(tag, ()):
            if key[0] in self._module_order and key[1].startswith(self.sites):
                self.bank.row_of(key)
        first_path = {"input": "input[0]", "output": "output", "grad": "grad"}
        for name in self._module_order:
            for site in self.sites:
                self.bank.row_of((name, first_path[site], "train"))
        # no growth while compiled code traces: room for each (module, path)'s rows in both
        # phases and 64 more (counted by pairs: the same room, so the same bank shape, when
        # the last session's eval keys were assigned above)
        self.bank.reserve(2 * len({key[:2] for key in self.bank.keys}) + 64)
        self.bank.set_tables(lambda key: session._module_tensors_of(key[0], key[2]),
                             functools.partial(self._before_trace, session),
                             tag=tag)
        model = session.model
        device = param_device(model)
        if device is not None and device.type == "meta":  # materialized later (to_empty)
            ref = weakref.ref(model)
            self.bank.prepare(None, later=lambda: param_device(ref()))
        else:
            self.bank.prepare(device)
        self.bank.make_row_tensors()
        self.bank.set_live(session.sampled)

    @hookimpl
    def hookplug_session_end(self, session):
        if session.model is not None and self.bank.keys:
            _LAST_KEYS.setdefault(session.model, {})[self.bank.tag] = list(self.bank.keys)
        self.bank.close()
        self.bank.set_tables(None)  # let the session go

    @hookimpl
    def hookplug_step(self, session, step):
        """The bank as a whole: snapshot the ended step, reset in place (folded later, in batches)."""
        before = self.bank.pending[-1] if self.bank.pending else None
        self.bank.end_step(step, warn_unflushed=session.has_sinks)
        self._grad_rows()
        self.bank.make_row_tensors()  # keys and devices first seen in this step
        self.bank.set_live(session.sampled)
        if self.nonfinite == "raise":
            ended = self.bank.pending[-1] if self.bank.pending else None
            self._check_nonfinite(ended if ended is not before else None)

    @hookimpl
    def hookplug_sampling(self, session):
        """An evaluation after an unsampled step is measured (see the hookspec)."""
        self.bank.set_live(session.sampled)

    def _before_trace(self, session) -> None:
        """Dynamo starts compiling a frame (an error here is the plugin's: the bank's
        ``on_error``, see ``_on_compile_start``): every key gets its twin in the other phase (the
        training keys' eval rows exist before the first eval pass is traced, so it traces
        once, as without hooks: compiled users only pay for those rows), and a key an
        earlier trace met (an output tuple's ``output[1]``) gets its row for every hooked
        module of the same class too; then the row tensors are made, so the traces of the
        other identical blocks find them and share one graph (only the first block's is its
        own)."""
        if plugin_off(self, session):
            return
        keys = self.bank.keys
        if self._spread_done < len(keys):
            kinds: Dict[type, List[str]] = {}
            for name, module in session.modules_of(self).items():
                kinds.setdefault(type(module), []).append(name)
            of_name = {n: names for names in kinds.values() for n in names}
            while self._spread_done < len(keys):  # the keys made here are spread too
                batch = keys[self._spread_done:]
                self._spread_done += len(batch)
                for name, path, _ in batch:
                    for other in of_name.get(name, ()):
                        for phase in _PHASES:
                            self.bank.row_of((other, path, phase))
                self._grad_rows()
        self.bank.make_row_tensors(at_compile_start=True)

    def _grad_rows(self) -> None:
        """Measuring outputs and their gradients: each output key first seen gets its
        gradient's row (same module, path and phase) too, so a compiled backward traced
        before any such gradient ran (an eval-mode forward with autograd on) finds its
        module's row tensor and stays the graph every block shares."""
        keys = self.bank.keys
        if self._grad_rows_done == len(keys) or not ("grad" in self.sites and "output" in self.sites):
            return
        for name, path, phase in keys[self._grad_rows_done:]:
            if path.startswith("output"):
                self.bank.row_of((name, "grad" + path[6:], phase))
        self._grad_rows_done = len(keys)

    # -- nonfinite="raise" ---------------------------------------------------------------------

    def _check_nonfinite(self, ended) -> None:
        """Raise for the first non-finite value of an ended step: the step that just ended
        when its rows are host memory, else the one whose ``first_bad`` column was copied to
        the host at an earlier ``step()`` (read only once its copy is done: never a sync)."""
        n = len(self.bank.keys)
        found, now = [], []  # (clock, row, step)
        if ended is not None and n:
            step, snaps = ended
            copies = []
            for snap in snaps.values():
                col = snap[1:n + 1, FIRST_BAD]
                if col.device.type == "cpu":
                    now += [(c, r, step) for r, c in enumerate(col.tolist()) if math.isfinite(c)]
                else:
                    copies.append(host_copy(col))
        else:
            step, copies = None, []
        # the copies started at earlier step()s (the one started now is read next time)
        while self._bad_in_flight and not found:
            old_step, old = self._bad_in_flight[0]
            if not all(ev is None or ev.query() for _, ev in old):
                break  # not there yet: look again at the next step()
            self._bad_in_flight.pop(0)
            for host, _ in old:
                found += [(c, r, old_step) for r, c in enumerate(host.tolist()) if math.isfinite(c)]
        if copies:
            self._bad_in_flight.append((step, copies))
        found = found or now  # an earlier step's first NaN/Inf is named first
        if found:
            _, row, step = min(found, key=lambda f: (f[2], f[0]))
            module, site, phase = self.bank.keys[row]
            raise FloatingPointError(
                f"hookplug stats: step {step}: the first non-finite value (NaN/Inf) of the step "
                f"appeared in module {module or '<root>'!r}, {site} ({phase}) "
                "(stats option nonfinite='raise')")

    @hookimpl
    def hookplug_collect(self, session, step):
        """The ended steps not yet collected: one :class:`hookplug.StatsBlock` per step and
        device (rows stay on the device; telemetry drops rows no call touched). A step is
        emitted once, when it ends (``session.step()``) or at ``remove()``: flushing
        mid-step (e.g. per micro-batch) never splits a step into duplicate records."""
        return self.bank.collect_for(  # remove()'s final flush: the step still running ends
            self, session, lambda key, st: {"step": st, "module": key[0], "site": key[1], "phase": key[2]})

    # -- results ----------------------------------------------------------------------------------

    def _merged(self, phase: Optional[str] = None) -> Dict[Tuple[str, str], TensorStats]:
        if phase is not None and phase not in _PHASES:
            raise ValueError(f"stats.results: phase must be None or one of {_PHASES}, got {phase!r}")
        merged = self.bank.merged(lambda k: k[:2] if phase is None or k[2] == phase else None)
        order, big = self._module_order, len(self._module_order)
        first = {k[:2]: i for i, k in reversed(list(enumerate(self.bank.keys)))}
        keys = sorted(merged, key=lambda k: (order.get(k[0], big), _site_rank(k[1]), first[k]))
        return {k: merged[k] for k in keys}

    def results(self, phase: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        """``{module: {path: TensorStats}}`` over every call and step (device rows);
        ``phase="train"``/``"eval"``: that phase only."""
        out: Dict[str, Dict[str, Any]] = {}
        for (mod, site), st in self._merged(phase).items():
            out.setdefault(mod, {})[site] = st
        return out

    @hookimpl
    def hookplug_report_section(self, session):
        """``{"stats": {module: {site: dict}}}`` over the whole session (host numbers)."""
        return {"stats": {mod: {site: st.to_dict() for site, st in sites.items()}
                          for mod, sites in self.results().items()}}

    def report(self) -> str:
        merged = self._merged()
        if not merged:
            return ""
        rows = list(merged.items())
        cols = ("numel", "nan_count", "inf_count", "min", "max", "mean", "std")
        vals = torch.stack(
            [
                torch.stack(
                    [
                        getattr(st, c).detach().to(device="cpu", dtype=torch.float64).reshape(())
                        for c in cols
                    ]
                )
                for _, st in rows
            ]
        ).tolist()  # one host transfer per stat; report() is not on the hot path
        header = ("module", "site", "numel", "nan", "inf", "min", "max", "mean", "std")
        table = [header]
        for ((mod, site), _), v in zip(rows, vals):
            table.append(
                (
                    mod or "<root>",
                    site,
                    f"{int(v[0])}",
                    f"{int(v[1])}",
                    f"{int(v[2])}",
                    *(_fmt(x) for x in v[3:]),
                )
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines = []
        for j, r in enumerate(table):
            lines.append(
                "  ".join(
                    c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                ).rstrip()
            )
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)



def _site_rank(site: str) -> int:
    for i, s in enumerate(_SITES):
        if site.startswith(s):
            return i
    return len(_SITES)


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return f"{x:.4g}"
