"""``tensorboard`` sink: telemetry as TensorBoard event files.

    hookplug.attach(model, "Linear", plugins="stats", sink=("tensorboard", {"path": "runs/exp1"}))

Writes through ``torch.utils.tensorboard.SummaryWriter`` into ``path`` (the log dir;
unset: ``runs/<run-id>``; ``{rank}``/``{run_id}`` are filled in), or through an existing
writer (``writer=``, e.g. a Lightning ``TensorBoardLogger``'s ``experiment``; it is flushed,
never closed, by the sink). The layout (``hookplug profile --tensorboard`` attaches this
sink) groups one statistic across layers: one ``add_scalar`` per statistic under
``hookplug/<stat>/<module>/<site>`` (``hookplug_eval/...`` for eval-phase records; ``stats=``
picks which: by default ``min, max, mean, std, absmax, rms, zero_fraction, nan_count,
inf_count``, no constant ``numel``) and, when the record has a histogram, one
``add_histogram_raw`` under ``hookplug/hist/<module>/<site>`` built from its buckets
(``bucket_limits`` = the right edges; ``sum``/``sum_squares`` from the finite mean and std).
``histogram=False`` leaves the histograms out. ``global_step`` is the record's step and
``walltime`` its time.

The sink runs on the training thread (``session.step()`` hands it each flush), so the writer
it opens queues up to ``max_queue=10000`` events for its own writing thread (the
``SummaryWriter`` default, 10, makes every 10 events wait for that thread) and writes them
to disk every ``flush_secs=30`` seconds and when the session ends, not at every telemetry
flush: TensorBoard sees the data at most ``flush_secs`` late. A ``writer=`` given to it is
used as it is and flushed after every telemetry flush, as before.
Rank 0 writes; ``all_ranks=True`` makes every rank write (put ``{rank}`` in ``path``).

Needs the ``tensorboard`` package: ``pip install hookplug[tensorboard]``.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Union

import hookplug
from hookplug._optional import optional_import
from hookplug._stats import hist_outside

from ._tags import DEFAULT_SCALARS, ROOT_NAME, hist_tag, scalar_tag  # noqa: F401

__all__ = ["TensorBoardSink"]

STATS = hookplug.STAT_FIELDS  # what stats= may name


def _summary_writer():
    # SummaryWriter needs tensorboard and says so less clearly: import it first
    _, tb = optional_import("tensorboard", "torch.utils.tensorboard",
                            feature="the hookplug 'tensorboard' sink", extra="tensorboard",
                            package="tensorboard")
    return tb.SummaryWriter


class TensorBoardSink(hookplug.Sink):
    """Write telemetry records as TensorBoard scalars and histograms."""

    name = "tensorboard"

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, stats: Sequence[str] = DEFAULT_SCALARS,
                 histogram: bool = True, all_ranks: bool = False, flush_secs: int = 30,
                 max_queue: int = 10000, writer: Any = None):
        if isinstance(stats, str):
            stats = (stats,)
        unknown = [s for s in stats if s not in STATS]
        if unknown:
            raise ValueError(f"tensorboard sink: unknown stats {unknown}; choose from {list(STATS)}")
        if writer is not None:
            if path is not None:
                raise ValueError("tensorboard sink: give path= or writer=, not both")
            if not (hasattr(writer, "add_scalar") and hasattr(writer, "add_histogram_raw")):
                raise TypeError("tensorboard sink: writer= must be a SummaryWriter (add_scalar, "
                                f"add_histogram_raw), got {type(writer).__name__}")
            self._writer_cls = None
        else:
            self._writer_cls = _summary_writer()  # fail at attach time, not at the first flush
        super().__init__(path, all_ranks=all_ranks)
        self._own_writer = writer is None
        self.stats = tuple(stats)
        self.histogram = histogram
        self.flush_secs = flush_secs
        self.max_queue = max_queue
        self.writer = writer
        if writer is not None:
            log_dir = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
            self.path = None if log_dir is None else os.fspath(log_dir)

    def _open(self, session, rank: int):
        if self.writer is None:
            self.path = self.resolve_path(session, rank)
            self.writer = self._writer_cls(log_dir=self.path, flush_secs=self.flush_secs,
                                           max_queue=self.max_queue)
            # a session dropped without remove(): the writer (and its thread) closes when the
            # sink is collected
            self._writer_closer = weakref.finalize(self, self.writer.close)
        return self.writer

    @hookplug.hookimpl
    def hookplug_flush(self, session, records: List[Dict[str, Any]]) -> None:
        if not records:
            return
        w = self._open(session, records[0].get("rank", 0))
        for rec in records:
            module, site, phase = rec["module"], rec["site"], rec.get("phase", "train")
            step, walltime = rec["step"], rec.get("time")
            for stat in self.stats:
                w.add_scalar(scalar_tag(stat, module, site, phase), rec[stat], global_step=step,
                             walltime=walltime)
            counts = rec.get("hist")
            edges = rec.get("hist_edges")
            if self.histogram and counts and edges:
                self._histogram(w, hist_tag(module, site, phase), rec, counts, edges, step,
                                walltime)
        if not self._own_writer:  # (its own writer: every flush_secs and at close)
            w.flush()

    @staticmethod
    def _histogram(w, tag, rec, counts, edges, step, walltime) -> None:
        n_finite = rec["numel"] - rec["nan_count"] - rec["inf_count"]
        mean, std = rec["mean"], rec["std"]
        if n_finite > 0 and math.isfinite(mean) and math.isfinite(std):
            total = mean * n_finite
            sum_squares = n_finite * (std * std + mean * mean)
        else:
            total = sum_squares = 0.0
        lo = rec["min"] if math.isfinite(rec["min"]) else edges[0]
        hi = rec["max"] if math.isfinite(rec["max"]) else edges[-1]
        limits, counts = list(edges[1:]), list(counts)
        below, above = hist_outside(rec)  # a linear range's outside: buckets of their own,
        if below:                         # so num counts what sum and sum_squares cover
            limits, counts = [edges[0]] + limits, [below] + counts
        if above:
            limits, counts = limits + [hi], counts + [above]
        w.add_histogram_raw(tag, min=lo, max=hi, num=int(sum(counts)), sum=total,
                            sum_squares=sum_squares, bucket_limits=limits,
                            bucket_counts=counts, global_step=step, walltime=walltime)

    def close(self) -> None:
        """Close the writer the sink opened (a ``writer=`` given to it is only flushed)."""
        if self.writer is None:
            return
        if self._own_writer:
            self._writer_closer.detach()
            self.writer.close()
            self.writer = None
        else:
            self.writer.flush()
