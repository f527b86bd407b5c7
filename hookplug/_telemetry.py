"""The telemetry flush engine behind ``Session.step()``, ``Session.flush()`` and ``remove()``.

A flush:

1. asks the producers (``hookplug_collect``) for what they gathered: ``StatsBlock``s
   (``metas`` + a ``[R, HEAD + B]`` tensor of stats rows, the stats plugin's bank
   snapshots) or ``(meta, TensorStats)`` pairs (stacked into blocks here);
2. concatenates the rows of each device into **one** float64 buffer (one ``torch.cat``;
   CPU rows are host memory already and are converted to Python numbers at once instead);
3. under ``torch.distributed`` (available and initialized), merges the rows across ranks
   in one collective round: an ``all_gather`` of the buffer, then the same
   :func:`hookplug._stats.merge_rows` that merges steps and calls (exact counts, extremes
   and buckets; mean/M2 by the parallel formula). Rows are statistics, never activations.
   The ranks first agree on the layout (the record keys) whenever it changed since the
   last flush (``all_gather_object`` of a signature); a mismatch raises a clear error on
   every rank instead of a collective on buffers of different shapes;
4. copies the buffer to pinned host memory with ``non_blocking=True`` and records a CUDA
   event behind the copy (on the CPU the buffer already is host memory);
5. once the event has completed, turns the rows into flat records and hands them to
   every sink (``hookplug_flush``). Rows no call touched (``calls`` and ``numel`` 0) give
   no record.

The training loop never waits: ``step()`` starts a flush every ``flush_every`` steps and
only *polls* the flushes in flight (``event.query()``). ``session.flush()`` (``wait=True``)
waits for every flush in flight; ``remove()`` finishes everything. Records come out in
flush order.

Records (flat dicts, one per ``(step, module, site, phase)``)::

    {"step", "time", "rank", "module", "site", "phase", "run_id",
     "numel", "nan_count", "inf_count", "zero_count", "calls",
     "min", "max", "mean", "std", "absmax", "l2", "rms", "zero_fraction",
     "hist": [int, ...], "hist_edges": [float, ...], "first_nonfinite": bool}

``time`` is the wall-clock time at which the record's step ended. ``calls`` counts the
tensors folded into the record (a module called twice in the step: 2; ``numel`` 0 with
``calls`` > 0: the site saw only empty tensors, e.g. an expert no token was routed to). ``hist`` is empty
without a histogram, otherwise ``len(hist_edges) == len(hist) + 1``; records with equal
edges share one list. Extra keys a producer puts in ``meta`` are kept. min/max/mean/std/
absmax/rms are NaN where the tensor had no finite value. ``first_nonfinite`` marks, per
step and rank, the record whose module produced that step's first NaN/Inf in execution
order (forward and backward; the bank's clock, no extra sync); the same facts land in
``session.nonfinite``.

Sinks: every plugin implementing ``hookplug_flush``. On a rank other than 0 a sink is
called only if it has a true ``all_ranks`` attribute.
"""
from __future__ import annotations

import collections
import itertools
import math
import os
import time
import zlib
from typing import Any, Deque, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import _stats, ops
from ._bank import host_copy
from ._stats import FIRST_BAD, STAT_FIELDS, StatsBlock, TensorStats, merge_rows, rows_to_values

__all__ = ["Telemetry", "new_run_id", "STAT_FIELDS"]

_MAX_STEP_TIMES = 4096
_PACK_CPU_ROWS = False  # tests: CPU rows take the packed path of device rows (one buffer, one copy)
_run_counter = itertools.count()


def new_run_id() -> str:
    """``$HOOKPLUG_RUN_ID`` or ``<YYYYmmdd-HHMMSS>-<pid>[-<n>]`` (unique in this process)."""
    env = os.environ.get("HOOKPLUG_RUN_ID")
    if env:
        return env
    n = next(_run_counter)
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}" + (f"-{n}" if n else "")


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d
    return None


def _as_blocks(name, res) -> List[StatsBlock]:
    """A producer's result as blocks (pairs of one width and device stacked together)."""
    if res is None:
        return []
    expected = ("a list of StatsBlock or (meta, TensorStats) pairs, meta a dict with 'step', "
                "'module' and 'site'")
    if not isinstance(res, (list, tuple)):
        raise TypeError(f"plugin {name!r}: hookplug_collect must return None or {expected}, "
                        f"got {type(res).__name__}")
    blocks: List[StatsBlock] = []
    pairs: Dict[Tuple[torch.device, int], List[Tuple[dict, TensorStats]]] = {}
    for item in res:
        if isinstance(item, StatsBlock):
            if item.rows.dim() != 2 or len(item.metas) != item.rows.shape[0]:
                raise TypeError(f"plugin {name!r}: a StatsBlock needs one meta per row, got "
                                f"{len(item.metas)} metas for rows of shape {tuple(item.rows.shape)}")
            blocks.append(item)
        elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], dict)
              and {"step", "module", "site"} <= item[0].keys() and isinstance(item[1], TensorStats)):
            row = item[1].row
            pairs.setdefault((row.device, row.numel()), []).append(item)
        else:
            raise TypeError(f"plugin {name!r}: hookplug_collect must return None or {expected}, "
                            f"got an item {item!r:.100}")
    for items in pairs.values():
        blocks.append(StatsBlock([m for m, _ in items], torch.stack([st.row for _, st in items]),
                                 items[0][1].hist))
    return blocks


class _Group(NamedTuple):
    """One producer block in a flush: its metas, each row's step end time, where its rows
    and first_bad column start in the packed buffer, its row count, width and histogram kind."""

    metas: List[Dict[str, Any]]
    times: List[float]
    offset: int
    rows: int
    width: int
    hist: Any


class _Flight:
    """One flush on its way to the host: its ``groups``, their rows and first_bad columns
    packed in ``host`` at each group's ``offset``; or, for CPU rows (host memory already: no
    packing, no copy), ``built``, its records built at once (so a producer may refill its
    rows right after returning them, even while an earlier flush still waits for its
    device copy)."""

    __slots__ = ("host", "event", "groups", "rank", "device_buf", "built")

    def __init__(self, host, event, groups, rank, device_buf, built=None):
        self.host = host
        self.event = event
        self.groups = groups
        self.rank = rank
        self.device_buf = device_buf  # kept alive until the copy is done
        self.built = built

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Telemetry:
    """Per-session flush state: flushes in flight, step end times, the agreed layout."""

    def __init__(self):
        self.in_flight: Deque[_Flight] = collections.deque()
        self.step_times: Dict[int, float] = {}
        self.flushes = 0
        self.records_emitted = 0
        self._agreed: Optional[int] = None  # layout signature all ranks agreed on

    # -- driven by the session --------------------------------------------------------------------

    def on_step(self, session, ended: int) -> None:
        """At ``session.step()``: note when the step ended, emit finished flushes, and start
        a flush every ``flush_every`` steps. Never waits for the device."""
        times = self.step_times
        times[ended] = time.time()
        if len(times) > _MAX_STEP_TIMES:  # nobody flushes: keep the newest only
            for old in list(times)[: len(times) // 2]:
                del times[old]
        if self.in_flight:
            self.poll(session)
        fe = session.flush_every
        if fe and session._steps_done % fe == 0:
            self.flush(session, wait=False)

    def flush(self, session, *, wait: bool = True) -> List[dict]:
        """Start a flush and emit every finished one; with ``wait`` finish them all.
        Returns the records emitted by this call."""
        emitted = self.poll(session)
        flights = self._start(session)
        self.in_flight.extend(flights)
        emitted += self.poll(session, wait=wait)
        return emitted

    def poll(self, session, *, wait: bool = False) -> List[dict]:
        """Emit the flushes in flight whose copy is done (all of them with ``wait``)."""
        out: List[dict] = []
        while self.in_flight and (wait or self.in_flight[0].ready()):
            flight = self.in_flight.popleft()
            flight.wait()
            records = self._records(session, flight)
            if records:
                session._dispatch("hookplug_flush", records=records,
                                  skip=lambda p: flight.rank != 0 and not getattr(p, "all_ranks", False))
                out.extend(records)
        return out

    # -- collect and pack (device side, no sync) ----------------------------------------------------

    def _collect(self, session) -> List[StatsBlock]:
        blocks: List[StatsBlock] = []

        def take(name, res):
            blocks.extend(_as_blocks(name, res))

        session._dispatch("hookplug_collect", step=session.step_index, on_result=take)
        return blocks

    def _start(self, session) -> List[_Flight]:
        blocks = self._collect(session)
        if not blocks:
            self._prune_times(session)
            return []
        now = time.time()
        times = self.step_times
        by_device: Dict[torch.device, List[StatsBlock]] = {}
        for b in blocks:
            by_device.setdefault(b.rows.device, []).append(b)
        dist = _dist()
        rank = dist.get_rank() if dist is not None else 0
        run_id = getattr(session, "run_id", None)
        flights = []
        for dev, items in by_device.items():
            groups = []
            offset = 0
            for b in items:
                # the step's end time, looked up now: the times are pruned below
                stamps = [times.get(m["step"], now) for m in b.metas]
                groups.append(_Group(b.metas, stamps, offset, b.rows.shape[0], b.rows.shape[1], b.hist))
                offset += b.rows.numel() + b.rows.shape[0]
            rows = [b.rows for b in items]
            if dist is not None and dist.get_world_size() > 1:
                parts = self._reduce(groups, rows, dist)
            else:  # (rows, None): the first_bad clocks are the rows' own column
                parts = [(r, None) for r in rows]
            if dev.type == "cpu" and not _PACK_CPU_ROWS:  # host memory already: no packing, no copy
                built = _build_records(groups, parts, rank, run_id)
                flights.append(_Flight(None, None, groups, rank, None, built))
                continue
            buf = torch.cat([m.reshape(-1) for r, bad in parts
                             for m in (r, r[:, FIRST_BAD] if bad is None else bad)])
            flights.append(self._copy(buf, groups, rank))
        self._prune_times(session)  # after the lookups: a record's time is its step's end
        self.flushes += 1
        return flights

    def _copy(self, buf: torch.Tensor, groups, rank: int) -> _Flight:
        host, event = host_copy(buf)
        return _Flight(host, event, groups, rank, buf if event is not None else None)

    def _prune_times(self, session) -> None:
        cur = session.step_index
        for s in [s for s in self.step_times if s < cur]:
            del self.step_times[s]

    # -- torch.distributed -----------------------------------------------------------------------------

    def _reduce(self, groups, rows, dist) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Merge every group's rows across ranks (one all_gather, then merge_rows): per group
        ``(merged rows, this rank's first_bad column)``."""
        keys = [(m["step"], m["module"], m["site"], m.get("phase")) for g in groups for m in g.metas]
        shape = [(g.rows, g.width) for g in groups]
        signature = zlib.crc32(repr((keys, shape)).encode())
        if signature != self._agreed:
            seen: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(seen, signature)
            if len(set(seen)) != 1:
                raise RuntimeError(
                    "hookplug telemetry: the ranks flushed different (step, module, site) records "
                    f"(layout signatures by rank: {seen}); under torch.distributed every rank must "
                    "run the same selected modules on the same sampled steps and flush together")
            self._agreed = signature
        flat = torch.cat([r.reshape(-1) for r in rows])
        world = dist.get_world_size()
        gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat)
        gathered = gathered.view(world, -1)
        out, start = [], 0
        for r in rows:
            part = gathered[:, start:start + r.numel()].reshape(world, *r.shape)
            start += r.numel()
            out.append((merge_rows(part), r[:, FIRST_BAD]))
        return out

    # -- host side --------------------------------------------------------------------------------------

    @staticmethod
    def _unpack(flight: _Flight):
        """The copied buffer as per-group ``(rows, first_bad column)`` host tensors."""
        host = flight.host
        return [(host[g.offset:g.offset + g.rows * g.width].view(g.rows, g.width),
                 host[g.offset + g.rows * g.width:g.offset + g.rows * (g.width + 1)])
                for g in flight.groups]

    def _records(self, session, flight: _Flight) -> List[dict]:
        built = flight.built
        if built is None:
            built = _build_records(flight.groups, self._unpack(flight), flight.rank,
                                   getattr(session, "run_id", None))
        out, bad = built
        first_bad: Dict[Any, Tuple[float, dict]] = {}
        for rec, clock in bad:  # rows that saw a NaN/Inf, with the clock of the first
            best = first_bad.get(rec["step"])
            if best is None or clock < best[0]:
                first_bad[rec["step"]] = (clock, rec)
        for step, (_, rec) in sorted(first_bad.items()):
            rec["first_nonfinite"] = True
            session._note_nonfinite({k: rec[k] for k in ("step", "module", "site", "phase", "rank")})
        self.records_emitted += len(out)
        return out


# A record's keys in order (a producer's own meta keys follow).
_CALLS_AT = STAT_FIELDS.index("calls")
_RECORD_KEYS = ("step", "time", "rank", "module", "site", "phase", "run_id", *STAT_FIELDS,
                "hist", "hist_edges", "first_nonfinite")


def _build_records(groups, parts, rank, run_id) -> Tuple[List[dict], List[Tuple[dict, float]]]:
    """The records of a flush from per-group host ``(rows, first_bad clocks)`` (clocks None:
    the rows' own column), and
    ``(record, clock)`` for each record whose row saw a NaN/Inf. Built by the compiled
    ``rows_to_records`` where the extension is loaded (the flush's hot loop), else (the
    reference backend, or a producer's metas that are not plain dicts) by
    :func:`_python_records`, the reference it is tested against."""
    fast = ops.rows_to_records()
    records: List[dict] = []
    bad: List[Tuple[dict, float]] = []
    cache: Dict[Any, list] = {}  # (lo, hi, buckets) -> edges: equal edges, one list
    for grp, (rows, clocks) in zip(groups, parts):
        if rows.dtype != torch.float64:  # a producer's own rows
            rows = rows.to(torch.float64)
        if clocks is not None and clocks.dtype != torch.float64:
            clocks = clocks.to(torch.float64)
        metas = grp.metas if type(grp.metas) is list else list(grp.metas)
        if fast is not None and all(type(m) is dict for m in metas):
            kind = grp.hist
            recs, bads = fast(rows, clocks, metas, grp.times, rank, run_id, _RECORD_KEYS,
                              _stats._LOG2_EDGES_LIST, isinstance(kind, str) and kind == "log2",
                              kind is None, cache)
        else:
            recs, bads = _python_records(rows, clocks, grp, metas, rank, run_id, cache)
        records += recs
        bad += bads
    return records, bad


def _python_records(rows, clocks, grp: _Group, metas, rank, run_id, edges_cache):
    """:func:`_build_records` for one group in Python (the reference of ``rows_to_records``);
    ``edges_cache`` (``(lo, hi, buckets) -> edges``, shared with the compiled builder) makes
    equal edge lists one list."""
    out: List[dict] = []
    bad: List[Tuple[dict, float]] = []
    log2_edges = _stats._LOG2_EDGES_LIST
    values = rows_to_values(rows, grp.hist)
    clocks = (rows[:, FIRST_BAD] if clocks is None else clocks.reshape(-1)).tolist()
    for meta, stamp, (stats, counts, edges), clock in zip(metas, grp.times, values, clocks):
        if stats[0] <= 0 and stats[_CALLS_AT] <= 0:  # numel and calls: a row no call touched
            continue
        if edges and edges is not log2_edges:  # (lo, hi, buckets) decide the edges
            edges = edges_cache.setdefault((edges[0], edges[-1], len(edges) - 1), edges)
        rec = dict(zip(_RECORD_KEYS, (
            meta["step"], stamp, rank, meta["module"], meta["site"],
            meta.get("phase", "train"), run_id, *stats, counts, edges, False)))
        if len(meta) > 4 or "phase" not in meta:  # a producer's own keys are kept
            for key, val in meta.items():
                if key not in rec:
                    rec[key] = val
        if math.isfinite(clock):
            bad.append((rec, clock))
        out.append(rec)
    return out, bad
