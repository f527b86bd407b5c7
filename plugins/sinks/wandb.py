"""``wandb`` sink: telemetry logged to a Weights & Biases run.

    wandb.init(project="exp1")                        # or a WandbLogger / report_to="wandb"
    hookplug.attach(model, "Linear", plugins="stats", sink="wandb", flush_every=10)

Logs into ``run=`` (a ``wandb`` Run), else the run active at the first flush
(``wandb.run``: the one ``wandb.init``, Lightning's ``WandbLogger`` or the 🤗 Trainer's
``report_to="wandb"`` started), else a run of its own: ``wandb.init(project=project or
"hookplug", dir=path, name=<run-id>, **init)`` (``path`` unset: ``runs/<run-id>``; ``{rank}`` and
``{run_id}`` are filled in; ``all_ranks=True`` beside an active ``wandb.run``: with
``reinit="create_new"``, wandb 0.19.10+; a run ``wandb.init`` hands back that was already
active, e.g. one the user made with ``reinit="create_new"``, is logged into, never finished). It is finished when the
session ends (one sink serving several sessions: when the last ends; a session dropped
without ``remove()``: when its sink is collected; another session's sink given it as
``run=``: when the last of them ends). A run it did not start is never finished by it. A
session never removed flushes its last steps into the run at interpreter exit, before
wandb's own exit handler (registered at ``wandb.init``) ends it.

Names are the TensorBoard sink's: ``hookplug/<stat>/<module>/<site>`` (``hookplug_eval/...``
for eval-phase records; ``stats=`` picks which, by default ``min, max, mean, std, absmax,
rms, zero_fraction, nan_count, inf_count``) and, when the record has a histogram,
``hookplug/hist/<module>/<site>`` as a ``wandb.Histogram`` of its buckets (empty buckets
at either end left out, the outer edges widened to the record's finite min/max, adjacent
buckets summed to at most 512, wandb's limit; ``histogram=False`` leaves them out). One ``run.log`` per step holds every record
of that step with ``hookplug/step`` (the record's step, declared the x-axis of
``hookplug/*`` and ``hookplug_eval/*`` through ``define_metric``), without ``step=``:
each call adds a row and moves the run's step on by one, as Lightning's ``WandbLogger`` and
the 🤗 Trainer's callback do (they plot against step metrics of their own). A script
logging its own rows with ``wandb.log(..., step=i)`` has them dropped by wandb once the
run's step passed ``i``; such rows need ``define_metric`` with a step metric instead.

With ``all_ranks=True`` every rank logs to a run of its own (``name=<run-id>-rank<r>``,
``group=<run-id>``) unless ``run=`` is given.

Needs the ``wandb`` package: ``pip install 'hookplug[wandb]'``.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
import re
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import hookplug
from hookplug._optional import optional_import
from hookplug._session import exit_flush_first
from hookplug._stats import hist_outside

from ._tags import DEFAULT_SCALARS, hist_tag, scalar_tag

__all__ = ["WandbSink", "histogram_bins"]

STATS = hookplug.STAT_FIELDS  # what stats= may name
MAX_BINS = 512  # wandb.Histogram's limit
STEP_KEY = "hookplug/step"


# The runs wandb sinks started (id(run) -> the sink, weakly) and the sinks logging into a
# run they found active (id(run) -> {token}). A run is finished by the sink that started it,
# at its session's end or when it is collected (a session dropped without remove()); where
# other sinks log into it then, by the last of them to end (or be collected).
_STARTED: Dict[int, "weakref.ref[WandbSink]"] = {}
_ADOPTERS: Dict[int, set] = {}
_ORPHANED: Dict[int, Any] = {}  # runs whose sink ended while others logged into them
_TOKENS = itertools.count()


def _finish(run, quiet: bool) -> None:
    for table in (_STARTED, _ADOPTERS, _ORPHANED):
        table.pop(id(run), None)
    try:
        run.finish()
    except Exception:
        if not quiet:  # (a sink's close(): the session's on_error decides)
            raise  # (quiet: a finalizer, which must not raise; wandb may be torn down at exit)


def _starter_ended(pid: int, run, quiet: bool = True) -> None:
    """The sink that started ``run`` ended (or was collected): finish it, unless other sinks
    log into it. Only in the process that started it (a forked child's copy of a
    collected sink leaves the parent's run alone)."""
    if os.getpid() != pid:
        return
    _STARTED.pop(id(run), None)
    if _ADOPTERS.get(id(run)):
        _ORPHANED[id(run)] = run
    else:
        _finish(run, quiet)


def _adopter_ended(pid: int, run_id: int, token: int, quiet: bool = True) -> None:
    """A sink logging into a run it did not start ended (or was collected)."""
    if os.getpid() != pid:
        return
    tokens = _ADOPTERS.get(run_id)
    if tokens is not None:
        tokens.discard(token)
        if not tokens:
            del _ADOPTERS[run_id]
            orphan = _ORPHANED.get(run_id)
            if orphan is not None:  # its sink ended first: the last to log into it finishes it
                _finish(orphan, quiet)


def _new_run_setting(wandb) -> Dict[str, Any]:
    """``reinit="create_new"`` where this wandb has it (0.19.10+), for a run of its own while
    another is the process's ``wandb.run`` (``all_ranks=True``): ``wandb.init`` would hand
    that one back. (Not otherwise: a ``create_new`` run is not ``wandb.run``, and a later
    ``wandb.init()``, the 🤗 Trainer's, would get it back with ``wandb.run`` unset.)"""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", getattr(wandb, "__version__", ""))
    if match is None:
        return {}
    return {"reinit": "create_new"} if tuple(map(int, match.groups())) >= (0, 19, 10) else {}


def _wandb():
    (wandb,) = optional_import("wandb", feature="the hookplug 'wandb' sink", extra="wandb",
                               package="wandb")
    return wandb


def histogram_bins(counts: Sequence[int], edges: Sequence[float], lo: float = math.nan,
                   hi: float = math.nan, max_bins: int = MAX_BINS, *, below: int = 0,
                   above: int = 0) -> Optional[Tuple[List[int], List[float]]]:
    """``(counts, edges)`` for a plot: empty buckets at either end dropped, the outer
    edges widened to ``lo``/``hi`` (the finite min/max) where the data lies beyond them,
    groups of adjacent buckets summed so at most ``max_bins`` remain (exact: only edges are
    dropped). ``below``/``above``: values a linear histogram's range left out
    (:func:`hookplug._stats.hist_outside`), given buckets of their own out to ``lo``/``hi``.
    None when every bucket is empty."""
    counts, edges = list(counts), list(edges)
    if below and math.isfinite(lo) and lo < edges[0]:
        counts, edges = [below] + counts, [lo] + edges
    if above and math.isfinite(hi) and hi > edges[-1]:
        counts, edges = counts + [above], edges + [hi]
    nz = [i for i, c in enumerate(counts) if c]
    if not nz:
        return None
    first, last = nz[0], nz[-1]
    counts = [int(c) for c in counts[first:last + 1]]
    edges = [float(e) for e in edges[first:last + 2]]
    group = -(-len(counts) // max_bins)
    if group > 1:
        counts = [sum(counts[i:i + group]) for i in range(0, len(counts), group)]
        edges = edges[::group] + ([] if (len(edges) - 1) % group == 0 else [edges[-1]])
    if math.isfinite(lo) and lo < edges[0]:
        edges[0] = lo
    if math.isfinite(hi) and hi > edges[-1]:
        edges[-1] = hi
    return counts, edges


class WandbSink(hookplug.Sink):
    """Log telemetry records to a Weights & Biases run (see the module docstring)."""

    name = "wandb"

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, run: Any = None,
                 project: Optional[str] = None, init: Optional[Mapping[str, Any]] = None,
                 stats: Sequence[str] = DEFAULT_SCALARS, histogram: bool = True,
                 all_ranks: bool = False):
        super().__init__(path, all_ranks=all_ranks)
        if isinstance(stats, str):
            stats = (stats,)
        unknown = [s for s in stats if s not in STATS]
        if unknown:
            raise ValueError(f"wandb sink: unknown stats {unknown}; choose from {list(STATS)}")
        if run is not None:
            if not (callable(getattr(run, "log", None)) and callable(getattr(run, "define_metric", None))):
                raise TypeError("wandb sink: run= must be a wandb Run (log, define_metric), got "
                                f"{type(run).__name__}")
            if path is not None or project is not None or init:
                raise ValueError("wandb sink: give run= or path=/project=/init=, not both")
        self._wandb = _wandb()  # fail at attach time, not at the first flush
        self.run = self._given_run = run
        self.project = project
        self.init = dict(init or {})
        self.stats = tuple(stats)
        self.histogram = histogram
        self._own_run = False
        self._adopted: Optional[weakref.finalize] = None  # counted in _ADOPTERS (a run found active)
        self._run_finisher: Optional[weakref.finalize] = None  # of its own run
        # the sessions it serves (one sink may serve several; weakly: one dropped without
        # remove() is no longer counted once collected)
        self._sessions: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._declared: Optional[int] = None  # id() of the run the x-axis was declared on

    def _open(self, session, rank: int):
        if self.run is None and not self.all_ranks and self._wandb.run is not None:
            found = id(self._wandb.run)
            if found in _STARTED or found in _ORPHANED:
                # another sink's run: one of a session dropped without remove() (its sink, or
                # the sinks logging into it) ends when collected, which may not have happened
                gc.collect()
            active = self._wandb.run
            if active is not None:
                self.run = active
                self._adopt(active)
        elif self.run is not None and self._adopted is None and (
                id(self.run) in _STARTED or id(self.run) in _ORPHANED):
            self._adopt(self.run)  # run= another sink's own run: not finished under this one
        if self.run is None:
            self.path = self.resolve_path(session, rank)
            os.makedirs(self.path, exist_ok=True)
            run_id = getattr(session, "run_id", None) or "run"
            kwargs: Dict[str, Any] = {"project": self.project or "hookplug", "dir": self.path,
                                      "name": run_id}
            if self.all_ranks:
                kwargs.update(name=f"{run_id}-rank{rank}", group=run_id)
            if self._wandb.run is not None:
                kwargs.update(_new_run_setting(self._wandb))
            kwargs.update(self.init)
            before = self._wandb.run
            self.run = self._wandb.init(**kwargs)
            if self.run is before or getattr(self.run, "name", kwargs["name"]) != kwargs["name"] \
                    or any(id(self.run) in t for t in (_STARTED, _ADOPTERS, _ORPHANED)):
                # wandb handed back a run already active (the user's, made with
                # reinit="create_new" and so not wandb.run): logged into, never finished
                self._adopt(self.run)
                self._declared = None
                return self._open_declared()
            self._own_run = True
            # a session dropped without remove(): its run is finished when the sink is
            # collected (else the next sink would find it active and log into it); at exit
            # wandb's own handler finishes it, after the exit flush
            _STARTED[id(self.run)] = weakref.ref(self)
            self._run_finisher = weakref.finalize(self, _starter_ended, os.getpid(), self.run)
            self._run_finisher.atexit = False
        return self._open_declared()

    def _adopt(self, run) -> None:
        """Log into ``run``, which another sink or the user started: counted, so that a sink
        that started it does not finish it under this one (see ``_ADOPTERS``)."""
        token = next(_TOKENS)
        _ADOPTERS.setdefault(id(run), set()).add(token)
        self._adopted = weakref.finalize(self, _adopter_ended, os.getpid(), id(run), token)
        self._adopted.atexit = False

    def _open_declared(self):
        if self._declared != id(self.run):
            # a run started after attach tears itself down at exit before a never-removed
            # session's exit flush would reach it: that flush goes first
            exit_flush_first()
            self.run.define_metric(STEP_KEY)
            for root in ("hookplug/*", "hookplug_eval/*"):
                self.run.define_metric(root, step_metric=STEP_KEY)
            self._declared = id(self.run)
        return self.run

    @hookplug.hookimpl
    def hookplug_flush(self, session, records: List[Dict[str, Any]]) -> None:
        if not records:
            return
        run = self._open(session, records[0].get("rank", 0))
        rows: Dict[int, Dict[str, Any]] = {}
        for rec in records:
            module, site, phase = rec["module"], rec["site"], rec.get("phase", "train")
            row = rows.setdefault(rec["step"], {STEP_KEY: rec["step"]})
            for stat in self.stats:
                row[scalar_tag(stat, module, site, phase)] = rec[stat]
            if self.histogram and rec.get("hist") and rec.get("hist_edges"):
                below, above = hist_outside(rec)
                bins = histogram_bins(rec["hist"], rec["hist_edges"], rec["min"], rec["max"],
                                      below=below, above=above)
                if bins is not None:
                    row[hist_tag(module, site, phase)] = self._wandb.Histogram(np_histogram=bins)
        for step in sorted(rows):
            run.log(rows[step])

    @hookplug.hookimpl
    def hookplug_session_start(self, session) -> None:
        self._sessions.add(session)

    @hookplug.hookimpl
    def hookplug_session_end(self, session) -> None:
        self._sessions.discard(session)
        super().hookplug_session_end(session)

    def close(self) -> None:
        """Finish the run the sink started (a run given to it or found active is left open)."""
        if self._sessions:  # another session this sink serves goes on logging into the run
            return
        try:
            if self._adopted is not None:
                adopted, self._adopted = self._adopted, None
                info = adopted.detach()
                if info is not None:  # (the last to log into a run whose sink ended finishes it)
                    _adopter_ended(*info[2], quiet=False)
            if self.run is not None and self._own_run and self._run_finisher is not None:
                finisher, self._run_finisher = self._run_finisher, None
                info = finisher.detach()
                if info is not None:
                    _starter_ended(*info[2], quiet=False)
        finally:  # (also after a failed finish: a next session gets a run of its own)
            self.run = self._given_run  # a run found active may be gone by the next session
            self._own_run = False
            self._declared = None
