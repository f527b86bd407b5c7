"""``tensorboard`` sink: telemetry as TensorBoard event files.

    hookplug.attach(model, "Linear", plugins="stats", sink=("tensorboard", {"path": "runs/exp1"}))

Writes through ``torch.utils.tensorboard.SummaryWriter`` into ``path`` (the log dir;
unset: ``runs/<run-id>``; ``{rank}``/``{run_id}`` are filled in), or through an existing
writer (``writer=``, e.g. a Lightning ``TensorBoardLogger``'s ``experiment``; it is flushed,
never closed, by the sink). The layout (``hookplug profile --tensorboard`` attaches this
sink) groups one statistic across layers: one scalar per statistic under
``hookplug/<stat>/<module>/<site>`` (``hookplug_eval/...`` for eval-phase records; ``stats=``
picks which: by default ``min, max, mean, std, absmax, rms, zero_fraction, nan_count,
inf_count``, no constant ``numel``) and, when the record has a histogram, a histogram under ``hookplug/hist/<module>/<site>`` built from its buckets
(``bucket_limit`` = the right edges, each run of empty buckets written as one and none
before the first value or after the last: the same histogram in ~12 buckets (one-signed values; ~25 with both signs) where log2 has
131; ``sum``/``sum_squares`` from the finite mean and std).
``histogram=False`` leaves the histograms out. ``global_step`` is the record's step and
``walltime`` its time.

The sink runs on the training thread (``session.step()`` hands it each flush). Through
torch's ``SummaryWriter`` it writes the values of one step in events of up to 1000 values,
not one event per value; another ``writer=`` (tensorboardX's, or a subclass overriding
them) gets ``add_scalar``/``add_histogram_raw`` calls. The writer it opens queues up to
``max_queue=10000`` events for its own writing thread, which writes each as it takes it
(the training thread never waits on the disk; the file is flushed every ``flush_secs=30``
seconds and when the session ends): TensorBoard sees the data at most ``flush_secs`` late. A ``writer=`` given to it is used as
it is and flushed after every telemetry flush. TensorBoard's writer checksums each event
with a pure-Python CRC-32C (~5 MB/s, holding the GIL); with ``google-crc32c`` installed
(the ``tensorboard`` extra) the sink has it use that C implementation instead (the same
checksums; for every TensorBoard writer of the process). A flush of 6000 records
(2000 modules, 3 sites) took ~7 s of the training thread and slowed the steps after it
while the writing thread caught up; now ~0.4 s and nothing after (``benchmarks/RESULTS.md``).
Rank 0 writes; ``all_ranks=True`` makes every rank write (put ``{rank}`` in ``path``).

Needs the ``tensorboard`` package: ``pip install hookplug[tensorboard]``.
"""
from __future__ import annotations

import math
import os
import threading
import weakref
from typing import Any, Dict, List, Sequence, Union

import hookplug
from hookplug._optional import optional_import
from hookplug._options import is_int_at_least
from hookplug._sink import check_writable
from hookplug._stats import hist_outside

from ._tags import DEFAULT_SCALARS, ROOT_NAME, hist_tag, scalar_tag  # noqa: F401

__all__ = ["TensorBoardSink"]

STATS = hookplug.STAT_FIELDS  # what stats= may name
_VALUES_PER_EVENT = 1000  # values in one event (one record of the file, checksummed whole)


def _summary_writer():
    # SummaryWriter needs tensorboard and says so less clearly: import it first
    _, tb = optional_import("tensorboard", "torch.utils.tensorboard",
                            feature="the hookplug 'tensorboard' sink", extra="tensorboard",
                            package="tensorboard")
    return tb.SummaryWriter


def _fast_checksums() -> None:
    """TensorBoard's event writer checksums every record it writes with a pure-Python
    CRC-32C (~5 MB/s, on its writing thread, holding the GIL: a big flush slowed the
    training loop for seconds after it). With ``google-crc32c`` (the ``tensorboard`` extra)
    its C implementation computes the same checksums (checked here on sample data before
    use); TensorBoard's writer module then uses it for every writer of the process."""
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return
    pure = record_writer.masked_crc32c
    if getattr(pure, "hookplug_fast", False) or google_crc32c.implementation != "c":
        return

    def masked_crc32c(data: bytes) -> int:
        x = google_crc32c.value(bytes(data))
        return ((((x >> 15) | (x << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    samples = (b"", b"hookplug", bytes(range(256)) * 3)
    if all(masked_crc32c(d) == pure(d) for d in samples):
        masked_crc32c.hookplug_fast = True
        record_writer.masked_crc32c = masked_crc32c


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
        if not (isinstance(flush_secs, (int, float)) and not isinstance(flush_secs, bool)
                and 0 < flush_secs <= threading.TIMEOUT_MAX):
            raise ValueError(f"tensorboard sink: flush_secs must be a number of seconds > 0 (and at most "
                             f"{threading.TIMEOUT_MAX:.0f}), got {flush_secs!r} (0 keeps the writer's "
                             "thread spinning; more stops it at its first wait)")
        if not is_int_at_least(max_queue, 1):
            raise ValueError(f"tensorboard sink: max_queue must be an int >= 1, got {max_queue!r}")
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

    @hookplug.hookimpl
    def hookplug_session_start(self, session) -> None:
        """Check at attach that the event folder can be written (creates nothing)."""
        rank = self.current_rank()
        if self.writer is None and self.writes_on(rank, session):
            check_writable(self.resolve_path(session, rank), "tensorboard sink", folder=True)

    def _open(self, session, rank: int):
        _fast_checksums()
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
        if self._writes_batched(w):
            self._write_batched(w._get_file_writer(), records)
        else:  # another writer: through its public calls, one value at a time
            for rec in records:
                step, walltime = rec["step"], rec.get("time")
                for tag, value in self._scalars(rec):
                    w.add_scalar(tag, value, global_step=step, walltime=walltime)
                hist = self._histogram(rec)
                if hist is not None:
                    tag, h = hist
                    w.add_histogram_raw(tag, min=h["min"], max=h["max"], num=h["num"], sum=h["sum"],
                                        sum_squares=h["sum_squares"], bucket_limits=h["bucket_limit"],
                                        bucket_counts=h["bucket"], global_step=step, walltime=walltime)
        if not self._own_writer:  # (its own writer: every flush_secs and at close)
            w.flush()

    @staticmethod
    def _writes_batched(w) -> bool:
        """Whether ``w`` is torch's ``SummaryWriter`` (tensorboard's protos) with its own
        ``add_scalar``/``add_histogram_raw``: a subclass overriding them gets the calls."""
        from torch.utils.tensorboard import SummaryWriter

        cls = type(w)
        return (issubclass(cls, SummaryWriter) and cls.add_scalar is SummaryWriter.add_scalar
                and cls.add_histogram_raw is SummaryWriter.add_histogram_raw)

    def _write_batched(self, file_writer, records) -> None:
        """The values of records sharing a step and time in one event (up to
        ``_VALUES_PER_EVENT``): the writer thread checksums and writes each event, and one
        event per value (``add_scalar``) made a big flush hold the training thread (6000
        records: ~7 s) and slowed the loop while the thread caught up."""
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

        values: list = []
        at = None

        def emit():
            for i in range(0, len(values), _VALUES_PER_EVENT):
                file_writer.add_summary(Summary(value=values[i:i + _VALUES_PER_EVENT]),
                                        global_step=at[0], walltime=at[1])
            values.clear()

        for rec in records:
            key = (rec["step"], rec.get("time"))
            if key != at or len(values) >= _VALUES_PER_EVENT:  # (written as they fill: few
                if values:                                     # objects live long enough
                    emit()                                     # for the cyclic GC to scan)
                at = key
            values.extend(Summary.Value(tag=tag, simple_value=value) for tag, value in self._scalars(rec))
            hist = self._histogram(rec)
            if hist is not None:
                values.append(Summary.Value(tag=hist[0], histo=HistogramProto(**hist[1])))
        if values:
            emit()

    def _scalars(self, rec):
        """``(tag, value)`` of each statistic written."""
        module, site, phase = rec["module"], rec["site"], rec.get("phase", "train")
        return [(scalar_tag(stat, module, site, phase), float(rec[stat])) for stat in self.stats]

    def _histogram(self, rec):
        """``(tag, fields of a HistogramProto)``, or None. Runs of empty buckets are written
        as one empty bucket, and none before the first or after the last value: the same
        histogram (a bucket's left edge is the limit before it, the first's the min), in
        ~12 buckets (~25 with values of both signs) where a log2 histogram has 131."""
        counts, edges = rec.get("hist"), rec.get("hist_edges")
        if not (self.histogram and counts and edges):
            return None
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
        kept_limits, kept_counts = [], []
        for limit, count in zip(limits, counts):
            if count:
                kept_limits.append(limit)
                kept_counts.append(count)
            elif kept_counts and kept_counts[-1]:  # the first empty bucket after a value:
                kept_limits.append(limit)          # extended over the run (below)
                kept_counts.append(0)
            elif kept_counts:
                kept_limits[-1] = limit
        if kept_counts and not kept_counts[-1]:
            kept_limits.pop()
            kept_counts.pop()
        if not kept_counts:  # no finite value: one empty bucket
            kept_limits, kept_counts = [limits[-1]], [0]
        return hist_tag(rec["module"], rec["site"], rec.get("phase", "train")), dict(
            min=lo, max=hi, num=int(sum(kept_counts)), sum=total, sum_squares=sum_squares,
            bucket_limit=kept_limits, bucket=kept_counts)

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
