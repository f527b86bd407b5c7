"""The telemetry flush engine behind ``Session.step()``, ``Session.flush()`` and ``remove()``.

A flush:

1. asks the producers (``hookplug_collect``) for what they gathered: ``StatsBlock``s
   (``metas`` + a ``[R, HEAD + B]`` tensor of stats rows, the stats plugin's bank
   snapshots) or ``(meta, TensorStats)`` pairs (stacked into blocks here);
2. concatenates the rows of each device into **one** float64 buffer (one ``torch.cat``;
   CPU rows are host memory already and are converted to Python numbers at once instead);
3. under ``torch.distributed`` (available and initialized, world size > 1), merges the
   rows across ranks: an ``all_gather`` of the rows, then the same
   :func:`hookplug._stats.merge_rows` that merges steps and calls (exact counts, extremes
   and buckets; mean/M2 by the parallel formula). Rows are statistics, never activations.
   The ranks may hold different keys (an eval forward or a module run on some ranks only,
   a producer disabled on one rank): they reduce by the *union* of their keys. One
   ``all_gather_object`` exchanges the layouts (a rank sends its own only when it changed
   since it last sent it); every rank lays its rows out in the union order (a key it lacks:
   empty rows, which merge as identity) and one ``all_gather_single`` per device type
   gathers them. Every rank gets the same merged records. ``first_nonfinite`` stays per
   rank (each rank's own clock). The first exchange also gives every rank rank 0's
   ``run_id`` (``session.run_id`` changes to it there).

   **Collective-safe.** Whether and how many collectives a flush runs depends only on what
   is the same on every rank: a session is *collective* when torch.distributed runs more
   than one rank and some plugin of the session implements ``hookplug_collect`` (disabled
   or not). Its flushes (every ``flush_every`` steps, ``session.flush()``, and the final
   one of ``remove()``, which then runs on every rank even without a sink there) run the
   exchange on every rank, a rank with nothing to contribute included; records go only to
   the sinks the rank has. So a collective session must be attached on every rank, and
   ``step()``/``flush()``/``remove()`` called as often on each. A rank leaving with an
   exception (``remove()`` while one propagates, a failed attach) flushes its own rows
   alone, with no collective. ``step()`` flushes even
   when a plugin's ``hookplug_step`` raised (the error is raised after it);
4. copies the buffer to pinned host memory with ``non_blocking=True`` and records a CUDA
   event behind the copy (on the CPU the buffer already is host memory);
5. once the event has completed, turns the rows into flat records and hands them to
   every sink (``hookplug_flush``). Rows no call touched (``calls`` and ``numel`` 0) give
   no record.

The training loop never waits for the device: ``step()`` starts a flush every
``flush_every`` steps and only *polls* the flushes in flight (``event.query()``).
``session.flush()`` (``wait=True``) waits for every flush in flight; ``remove()`` finishes
everything. Records come out in flush order. The sinks run in these calls, on the training
thread: a sink's own work (a write, an upload) is part of the step that hands it a flush.

Errors: a producer or sink that raises goes through the session's ``on_error`` like any
plugin hook (under ``"raise"`` every sink still gets the flush, then the first error is
raised). A flush that fails outside them (a collective, a producer's block that cannot
be laid out) does too: a ``RuntimeWarning`` under ``"warn"``, the error under ``"raise"``,
raised once the flush's collectives are done; the rows of a failed collective are sent
again by the next flush (once). A ``BaseException`` (Ctrl-C, a signal handler's
``SystemExit``) loses nothing that was taken: blocks collected but not sent yet go back to
``_carry``, a flight whose records did not reach every sink stays first in ``in_flight``
with the sinks that got it noted; the next flush (``remove()``'s final one) sends them on.
A forked child (``Session._in_child``) flushes nothing: its steps and sinks are the parent's.

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
import contextlib
import functools
import itertools
import math
import os
import pickle
import time
import warnings
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from . import _stats, ops
from ._bank import host_copy
from ._plugin import user_stacklevel
from ._sink import current_rank
from ._stats import (FIRST_BAD, HEAD, HIST_HI, HIST_LO, STAT_FIELDS, StatsBlock, TensorStats, empty_rows,
                     merge_rows, rows_to_values, touched)

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


def initialized_dist():
    """``torch.distributed`` where a default process group exists, else None."""
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
              and RECORD_KEYS <= item[0].keys() and isinstance(item[1], TensorStats)):
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


@contextlib.contextmanager
def on_interrupt(undo: Callable[[], Any]) -> Iterator[None]:
    """Run ``undo()`` when a ``BaseException`` that is not an ``Exception`` (Ctrl-C, a signal
    handler's ``SystemExit``) leaves the block, then let it go on; errors pass untouched."""
    try:
        yield
    except Exception:
        raise
    except BaseException:
        undo()
        raise


class _Flight:
    """One flush on its way to the host: its ``groups``, their rows and first_bad columns
    packed in ``host`` at each group's ``offset``; or, for CPU rows (host memory already: no
    packing, no copy), ``built``, its records built at once (so a producer may refill its
    rows right after returning them, even while an earlier flush still waits for its
    device copy)."""

    __slots__ = ("host", "event", "groups", "rank", "device_buf", "built", "records", "delivered", "cut")

    def __init__(self, host, event, groups, rank, device_buf, built=None):
        self.host = host
        self.event = event
        self.groups = groups
        self.rank = rank
        self.device_buf = device_buf  # kept alive until the copy is done
        self.built = built
        self.records: Optional[List[dict]] = None  # once built (built once, emitted once)
        self.delivered: set = set()  # the sinks (names) that got the records already
        # {(module, site, phase): step}: that row's steps up to this one are left out (see
        # _Layouts.agree)
        self.cut: Optional[Dict[tuple, int]] = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def _collects(session, plugin) -> bool:
    """Whether ``plugin``'s ``hookplug_collect`` is called: live, or disabled and set
    ``collect_when_disabled`` (it then hands over only what it had finished before)."""
    entry = session._entry_of.get(id(plugin))
    return entry is None or entry.disabled is None or getattr(plugin, "collect_when_disabled", False)


def watch_join(joinable=None) -> None:
    """Mark each ``Join`` block on its joinables (``_hookplug_join_block``: a token new at each
    entry of an outermost block, None after it; the config torch sets stays after it), so
    that a session's periodic flushes keep off the steps where a rank may have joined
    (``Telemetry.on_step``). Wraps ``Join.__enter__``/``__exit__`` once. ``joinable`` (the
    DDP a session is attached through) already enabled by a ``Join`` entered before: taken
    as inside that block (its exit, or the next entry, sets it right)."""
    try:
        from torch.distributed.algorithms.join import Join
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if (joinable is not None and getattr(getattr(joinable, "_join_config", None), "enable", False)
            and "_hookplug_join_depth" not in joinable.__dict__):
        joinable._hookplug_join_block = object()
        joinable._hookplug_join_depth = 1
        joinable._hookplug_join_assumed = True
    if getattr(Join.__enter__, "_hookplug_watched", False):
        return
    enter, exit_ = Join.__enter__, Join.__exit__

    @functools.wraps(enter)
    def entered(self):
        out = enter(self)
        if self._enable:  # (nested blocks: the outermost one decides)
            for joinable in self._joinables:
                depth = 0 if joinable.__dict__.pop("_hookplug_join_assumed", False) else \
                    getattr(joinable, "_hookplug_join_depth", 0)
                if not depth:
                    joinable._hookplug_join_block = object()
                joinable._hookplug_join_depth = depth + 1
        return out

    @functools.wraps(exit_)
    def exited(self, *exc):
        try:
            return exit_(self, *exc)
        finally:
            if self._enable:
                for joinable in self._joinables:
                    depth = getattr(joinable, "_hookplug_join_depth", 1) - 1
                    joinable._hookplug_join_depth = max(depth, 0)
                    if depth <= 0:
                        joinable._hookplug_join_block = None

    entered._hookplug_watched = True
    Join.__enter__, Join.__exit__ = entered, exited


class Telemetry:
    """Per-session flush state: flushes in flight, step end times, and under torch.distributed
    the layout the ranks agreed on (see :class:`_Layouts`)."""

    def __init__(self):
        self.in_flight: Deque[_Flight] = collections.deque()
        self.step_times: Dict[int, float] = {}
        self.flushes = 0
        self.records_emitted = 0
        self._join_seen = None  # the DDP Join block of the last step() (on_step)
        self._flush_base = 0  # flush_every counts step() calls from here (a Join block's edge)
        # blocks of a failed collective flush (sent again once), or taken by a flush that a
        # BaseException (Ctrl-C) interrupted
        self._carry: List[StatsBlock] = []
        self._layouts = _Layouts()
        # this process's rank, noted at each step and flush while torch.distributed runs: the
        # flushes after destroy_process_group() keep it (they took rank 0: another rank's
        # records went to rank 0's sinks and file)
        self._rank = current_rank()  # (before init_process_group: torchrun's RANK)
        self._was_collective = False  # a flush of this session ran collectively
        self._warned_ungrouped = False
        self._warned_env_rank = False
        self._warned_cut = False  # steps another rank dropped, left out here (said once)
        self.note_rank()

    def note_rank(self) -> None:
        dist = initialized_dist()
        if dist is not None:
            self._rank = dist.get_rank()

    @staticmethod
    def collective(session) -> bool:
        """Whether this session's flushes are collective: torch.distributed is initialized
        with more than one rank and some plugin of the session (disabled or not) implements
        ``hookplug_collect``. Then every flush runs the same collectives on every rank."""
        dist = initialized_dist()
        return (dist is not None and session.distributed and dist.get_world_size() > 1
                and bool(session._call_order.get("hookplug_collect")))

    # -- driven by the session --------------------------------------------------------------------

    def on_step(self, session, ended: int) -> None:
        """At ``session.step()``: note when the step ended, emit finished flushes, and start
        a flush every ``flush_every`` steps. Never waits for the device."""
        self.note_rank()
        times = self.step_times
        times[ended] = time.time()
        if len(times) > _MAX_STEP_TIMES:  # nobody flushes: keep the newest only
            for old in list(times)[: len(times) // 2]:
                del times[old]
        if session._in_child():
            return
        fe = session.flush_every
        block = session._join_block() if fe and self.collective(session) else None
        if block is not None or self._join_seen is not None:
            # DDP's Join (uneven inputs): a rank that has joined answers DDP's collectives
            # only, which a flush's would meet (a hang until the group's timeout). Flushes
            # run at the first step() of each Join block and the first after one (every rank
            # is there: none has joined), and counting starts again from there.
            if block is not self._join_seen:
                self._join_seen = block
                self._flush_base = session._steps_done
                self.flush(session, wait=False)
                return
        elif fe and (session._steps_done - self._flush_base) % fe == 0:
            self.flush(session, wait=False)
            return
        if self.in_flight:
            self.poll(session)

    def flush(self, session, *, wait: bool = True, local: bool = False) -> List[dict]:
        """Start a flush and emit every finished one; with ``wait`` finish them all.
        Returns the records emitted by this call. The collectives of a distributed flush
        run before anything that may raise on one rank only (sinks, record building); a
        failure goes through the session's ``on_error`` once the flush is done. ``local``:
        no collective, this rank's rows only (a rank ending with an exception). Nothing in
        a forked child (``session._in_child()``)."""
        if session._in_child():
            return []
        try:
            flights, error = self._start(session, local=local)
        except Exception as exc:  # noqa: BLE001 - on_error decides
            flights, error = [], exc
        self.in_flight.extend(flights)
        emitted = self.poll(session, wait=wait)
        if error is not None:
            session._telemetry_failed(error)
        return emitted

    def poll(self, session, *, wait: bool = False) -> List[dict]:
        """Emit the flushes in flight whose copy is done (all of them with ``wait``).

        Every sink gets a flush's records, also when one raises (``on_error="raise"``: the
        first error is raised once all have run). A flight leaves ``in_flight`` only once
        its records went to the sinks: a ``BaseException`` on the way (Ctrl-C, a signal
        handler's ``SystemExit``) leaves it at the front, with the sinks that already got it
        noted, and the next flush (``remove()``'s final one) hands it to the others."""
        out: List[dict] = []
        in_flight = self.in_flight
        while in_flight and (wait or in_flight[0].ready()):
            flight = in_flight[0]
            flight.wait()
            records = flight.records
            if records is None:
                try:
                    records = flight.records = self._records(session, flight)
                except Exception as exc:  # noqa: BLE001 - on_error decides
                    self._done(flight)
                    session._telemetry_failed(exc)
                    continue
            if records:
                delivered, entry_of = flight.delivered, session._entry_of
                if flight.rank != 0 and session.distributed and not self._warned_env_rank:
                    self._warn_env_rank(session, flight.rank)
                try:
                    session._dispatch(
                        "hookplug_flush", records=records, run_all=True, returned=delivered.add,
                        skip=lambda p: (entry_of[id(p)].name in delivered
                                        or (flight.rank != 0 and session.distributed
                                            and not getattr(p, "all_ranks", False))))
                except Exception:  # a sink's error (every sink ran): the flush is done
                    self._done(flight)
                    raise
            self._done(flight)
            out.extend(records)
        return out

    def _warn_env_rank(self, session, rank: int) -> None:
        """Once: a rank other than 0 with no process group (``RANK`` from the environment:
        before ``init_process_group``, or a launcher's variable left set) skips its sinks
        without ``all_ranks``, as under torch.distributed, where rank 0 writes."""
        if initialized_dist() is not None:
            return
        self._warned_env_rank = True
        if any(e.is_sink and not getattr(e.plugin, "all_ranks", False) for e in session._entries.values()):
            warnings.warn(
                f"hookplug telemetry: RANK={rank} (from the environment) and no torch.distributed "
                "process group yet: this rank's sinks without all_ranks=True write nothing, as rank "
                "0's write for every rank; set all_ranks=True, attach with distributed=False, or "
                "unset RANK", RuntimeWarning, stacklevel=user_stacklevel())

    def _done(self, flight: _Flight) -> None:
        """``flight`` leaves ``in_flight`` (unless a flush nested in its delivery, e.g. a
        signal handler's ``remove()``, emitted it already)."""
        try:
            self.in_flight.remove(flight)
        except ValueError:
            pass

    # -- collect and pack (device side, no sync) ----------------------------------------------------

    def _collect(self, session) -> Tuple[List[StatsBlock], Optional[BaseException]]:
        """The producers' blocks (after those of a failed collective flush), and the error
        that stopped the round (``on_error="raise"``), if any: the blocks gathered before it
        are still flushed."""
        blocks, self._carry = self._carry, []

        def take(name, res):
            blocks.extend(_as_blocks(name, res))

        try:
            # a producer disabled by an error (on_error="warn") that sets collect_when_disabled
            # still hands over the steps it ended before (e.g. nonfinite="raise" failing stats
            # at the step with the NaN); others are not asked again
            session._dispatch("hookplug_collect", step=session.step_index, on_result=take,
                              include_disabled=True, skip=lambda plugin: not _collects(session, plugin))
        except Exception as exc:  # noqa: BLE001 - raised after the flush (the ranks flush together)
            return blocks, exc
        except BaseException:  # Ctrl-C: what was taken waits for the next flush
            self._keep(blocks)
            raise
        return blocks, None

    def has_unsent(self) -> bool:
        """Whether blocks a failed flush kept wait for the next one."""
        return bool(self._carry)

    def _keep(self, blocks: List[StatsBlock]) -> None:
        """Put ``blocks`` (taken from the producers, not emitted) first in line for the next
        flush, as copies: a producer may refill its own rows."""
        self._carry = [StatsBlock(b.metas, b.rows.clone(), b.hist, getattr(b, "dropped_through", None))
                       for b in blocks] + self._carry

    def _start(self, session, local: bool = False) -> Tuple[List[_Flight], Optional[BaseException]]:
        """Collect and start this flush: its flights, and an error to report once it is done."""
        carried = {id(b) for b in self._carry}
        blocks, error = self._collect(session)
        with on_interrupt(lambda: self._keep(blocks)):  # Ctrl-C: they wait for the next flush
            return self._pack(session, blocks, error, carried, local)

    def _pack(self, session, blocks: List[StatsBlock], error: Optional[BaseException], carried: set,
              local: bool) -> Tuple[List[_Flight], Optional[BaseException]]:
        """:meth:`_start` once the blocks are collected: their flights (collectives run here)."""
        dist = initialized_dist()
        if not local and self.collective(session):
            self._was_collective = True
            try:
                flights, prep_error = self._start_collective(session, blocks, dist)
            except Exception as exc:  # a collective failed: send the steps again once
                self._layouts = _Layouts()
                # (at remove() all: they go out in a local flush, see Session._remove)
                fresh = blocks if session.removed else [b for b in blocks if id(b) not in carried]
                self._carry = []
                self._keep(fresh)
                lost = len(blocks) - len(fresh)
                kept = ("go out unmerged, this rank's own" if session.removed
                        else "are kept for the next flush")
                raise RuntimeError(
                    f"hookplug telemetry: the distributed flush failed ({type(exc).__name__}: {exc}); "
                    f"{len(fresh)} block(s) of stats rows {kept}"
                    + (f", {lost} block(s) that had failed before are dropped" if lost else "")) from exc
            self._prune_times(session)
            self.flushes += 1
            return flights, error or prep_error
        if self._was_collective and dist is None and blocks and not self._warned_ungrouped:
            self._warned_ungrouped = True  # (a failing rank's local flush says so itself)
            warnings.warn(
                "hookplug telemetry: torch.distributed's process group is gone (destroyed before "
                "session.remove()?): the last steps' records are this rank's own, not merged "
                "over the ranks, and params has no record of the parameters other ranks measure; "
                "remove() the session before destroy_process_group()", RuntimeWarning,
                stacklevel=user_stacklevel())
        if not blocks:
            self._prune_times(session)
            return [], error
        now = time.time()
        times = self.step_times
        by_device: Dict[torch.device, List[StatsBlock]] = {}
        for b in blocks:
            by_device.setdefault(b.rows.device, []).append(b)
        self.note_rank()
        rank = self._rank
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
            parts = [(b.rows, None) for b in items]  # first_bad clocks: the rows' own column
            flights.append(self._flight(dev, groups, parts, rank, run_id))
        self._prune_times(session)  # after the lookups: a record's time is its step's end
        self.flushes += 1
        return flights, error

    def _flight(self, dev, groups, parts, rank: int, run_id) -> _Flight:
        if dev.type == "cpu" and not _PACK_CPU_ROWS:  # host memory already: no packing, no copy
            return _Flight(None, None, groups, rank, None, _build_records(groups, parts, rank, run_id))
        buf = torch.cat([m.reshape(-1) for r, bad in parts
                         for m in (r, r[:, FIRST_BAD] if bad is None else bad)])
        return self._copy(buf, groups, rank)

    def _copy(self, buf: torch.Tensor, groups, rank: int) -> _Flight:
        host, event = host_copy(buf)
        return _Flight(host, event, groups, rank, buf if event is not None else None)

    def _prune_times(self, session) -> None:
        cur = session.step_index
        for s in [s for s in self.step_times if s < cur]:
            del self.step_times[s]

    # -- torch.distributed -----------------------------------------------------------------------------

    def _start_collective(self, session, blocks, dist):
        """A flush every rank runs alike, whatever it holds: one ``all_gather_object`` (the
        layouts, see :class:`_Layouts`), then per device type of the union one
        ``all_gather_single`` of the rows laid out in the union order (a key this rank
        lacks: empty rows, which merge as identity) and ``merge_rows``. Returns the flights
        and the error of blocks this rank could not lay out (they are left out; raised or
        warned once the flush is done)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        local, error = _describe(blocks)
        union = self._layouts.agree(session, local, dist, world, rank)
        now = time.time()
        times = self.step_times
        run_id = getattr(session, "run_id", None)
        homes: Dict[str, torch.device] = {}
        for c in local.classes.values():
            homes.setdefault(c.key[0], c.parts[0][0].device)
        by_type: Dict[str, list] = {}
        for ucls in union.classes:
            by_type.setdefault(ucls.key[0], []).append(ucls)
        flights = []
        for dev_type, uclasses in by_type.items():
            home = homes.get(dev_type) or _default_device(dev_type)
            lays, groups, offset = [], [], 0
            for ucls in uclasses:
                c = local.classes.get(ucls.key)
                laid, metas = union.lay_out(ucls, c, local.base, home)
                lays.append(laid)
                stamps = [times.get(m["step"], now) for m in metas]
                groups.append(_Group(metas, stamps, offset, laid.shape[0], laid.shape[1],
                                     c.hist if c is not None else ucls.key[2]))
                offset += laid.numel() + laid.shape[0]
            flat = torch.cat([laid.reshape(-1) for laid in lays]) if len(lays) > 1 else lays[0].reshape(-1)
            via = _gather_device(dist, dev_type)
            if via is not None:  # CPU rows (FSDP2's CPU offload) under an NCCL-only group
                flat = flat.to(via)
            gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
            # (all_gather_single where torch has it: all_gather_into_tensor warns, deprecated)
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, flat)
            gathered = gathered.view(world, -1).to(home)
            parts, start = [], 0
            for laid in lays:
                part = gathered[:, start:start + laid.numel()].view(world, *laid.shape)
                start += laid.numel()
                parts.append((_merge_ranks(part), laid[:, FIRST_BAD]))  # this rank's clocks
            flight = self._flight(home, groups, parts, rank, run_id)
            flight.cut = union.cut
            flights.append(flight)
        mine = local.dropped or {}
        if union.cut and not self._warned_cut and any(mine.get(k, -math.inf) < step for k, step in union.cut.items()):
            self._warned_cut = True
            last = max(union.cut.values())
            warnings.warn(f"hookplug telemetry: another rank dropped steps (up to {last}) before this "
                          "flush (more ended steps than its producers keep: max_pending_steps/"
                          "max_pending_bytes); every rank leaves those rows out, so no record holds "
                          "only some ranks' data. Set flush_every= (or a smaller one), or raise the "
                          "bound.", RuntimeWarning, stacklevel=user_stacklevel())
        return flights, error

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
        cut = flight.cut
        if cut:  # steps some rank's producer dropped: left out on every rank
            def kept(r):
                last = cut.get((r["module"], r["site"], r.get("phase")))
                return last is None or not (type(r["step"]) is int and r["step"] <= last)

            out = [r for r in out if kept(r)]
            bad = [(r, c) for r, c in bad if kept(r)]
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


# -- the layout of a distributed flush ------------------------------------------------------------
#
# A row's *ident* is ``(step, module, site, phase, extras)``: ``step`` relative to the
# smallest int step of the rank's flush (other steps as they are), ``extras`` the repr of a
# producer's own meta keys (None without). A *class* of rows shares ``(device type, width,
# histogram kind)``: one class's rows merge row by row; each device type is gathered apart.

_META_KEYS = ("step", "module", "site", "phase")
RECORD_KEYS = frozenset(("step", "module", "site"))  # what every record has


def _hashable(kind):
    try:
        hash(kind)
        return kind
    except TypeError:
        return repr(kind)


def _gather_device(dist, dev_type: str) -> Optional[torch.device]:
    """Where rows of ``dev_type`` are gathered when the default group's backend has no
    collective for that device type (``init_process_group("nccl")`` holds only ``cuda``):
    the current device of a type it has (the rows go there and back, a copy that waits for
    the device); None where it has one, or its configuration cannot be read."""
    try:
        config = str(dist.get_backend_config())
    except Exception:  # noqa: BLE001 - an older torch, a backend without a config
        return None
    types = [part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part]
    if not types or dev_type in types:
        return None
    for other in types:
        if other == "cuda" and torch.cuda.is_available():
            return _default_device("cuda")
    return None


def _default_device(dev_type: str) -> torch.device:
    """Where a rank with no rows of a device type lays out its (empty) rows of it."""
    if dev_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dev_type)


class _Class:
    """This rank's rows of one class: unique ``idents`` in first-seen order with their
    ``metas`` and ``extras`` (a producer's own meta keys, or None), and ``parts`` (each
    block's rows and the ident index of every row; ``dups``: an ident came twice)."""

    __slots__ = ("key", "hist", "idents", "extras", "metas", "index", "parts", "dups")

    def __init__(self, key, hist):
        self.key, self.hist = key, hist
        self.idents: List[tuple] = []
        self.extras: List[Optional[dict]] = []
        self.metas: List[dict] = []
        self.index: Dict[tuple, int] = {}
        self.parts: List[Tuple[torch.Tensor, List[int]]] = []
        self.dups = False


class _Local(NamedTuple):
    base: Optional[int]  # the smallest int step (idents' steps are relative to it)
    classes: Dict[tuple, _Class]
    # {(module, site, phase): the last step dropped} of the producers that dropped steps here
    # (StatsBlock.dropped_through: every key of such a producer, touched in a step or not)
    dropped: Optional[Dict[tuple, int]] = None

    def describe(self) -> list:
        """What the other ranks need of this rank's layout (plain data)."""
        return [(c.key, c.idents, c.extras) for c in self.classes.values()]


def _describe(blocks: List[StatsBlock]) -> Tuple[_Local, Optional[BaseException]]:
    """This rank's blocks by class; a block whose metas cannot be described (no ``step``,
    ``module`` or ``site``) is left out and its error returned."""
    error = None
    steps = []
    for b in blocks:
        for m in b.metas:
            try:
                s = m["step"]
            except Exception:  # noqa: BLE001 - the block is reported below
                continue
            if type(s) is int:
                steps.append(s)
    base = min(steps) if steps else None
    classes: Dict[tuple, _Class] = {}
    for b in blocks:
        try:
            rows = b.rows
            idents = []
            for m in b.metas:
                step = m["step"]
                if type(step) is int:
                    step -= base
                if len(m) == 4 and "phase" in m:
                    idents.append(((step, m["module"], m["site"], m["phase"], None), None))
                else:
                    extras = {k: v for k, v in m.items() if k not in _META_KEYS} or None
                    idents.append(((step, m["module"], m["site"], m.get("phase"),
                                    None if extras is None else repr(sorted(extras.items()))), extras))
            if _unpicklable(idents):
                raise TypeError("a meta's own keys must be picklable (they travel to the other ranks)")
            key = (rows.device.type, rows.shape[1], _hashable(b.hist))
        except Exception as exc:  # noqa: BLE001 - reported once the flush is done
            error = error or exc
            continue
        c = classes.get(key)
        if c is None:
            c = classes[key] = _Class(key, b.hist)
        idx = []
        for (ident, extras), meta in zip(idents, b.metas):
            i = c.index.get(ident)
            if i is None:
                i = c.index[ident] = len(c.idents)
                c.idents.append(ident)
                c.extras.append(extras)
                c.metas.append(meta)
            else:
                c.dups = True
            idx.append(i)
        c.parts.append((rows, idx))
    dropped: Dict[tuple, int] = {}
    for b in blocks:
        d = getattr(b, "dropped_through", None)
        if type(d) is int:
            for m in b.metas:
                k = (m.get("module"), m.get("site"), m.get("phase"))
                if dropped.get(k, d - 1) < d:
                    dropped[k] = d
    return _Local(base, classes, dropped or None), error


def _unpicklable(idents) -> bool:
    """Whether a producer's own meta keys cannot travel to the other ranks."""
    for _, extras in idents:
        if extras is not None:
            try:
                pickle.dumps(extras)
            except Exception:  # noqa: BLE001
                return True
    return False


class _UnionClass:
    """One class of the union layout: its key and idents (steps relative to the union's
    ``ref``), in step order; and, for this rank, where its local idents go (``where``, None:
    the local idents are the union's, in order) and which local ident each row holds
    (``local``, -1: none)."""

    __slots__ = ("key", "idents", "extras", "where", "local")

    def __init__(self, key, idents, extras):
        self.key, self.idents, self.extras = key, idents, extras
        self.where: Optional[List[int]] = None
        self.local: Optional[List[int]] = None


class _Union:
    """The union of every rank's layout, and this rank's place in it."""

    def __init__(self, descs, shifts, mine: Optional[list], my_shift: int):
        merged: Dict[tuple, Dict[tuple, Any]] = {}
        for desc, shift in zip(descs, shifts):
            for key, idents, extras in desc:
                u = merged.setdefault(key, {})
                for ident, ex in zip(idents, extras):
                    if shift and type(ident[0]) is int:
                        ident = (ident[0] + shift,) + ident[1:]
                    if ident not in u:
                        u[ident] = ex
        self.classes: List[_UnionClass] = []
        for key, u in merged.items():
            items = list(u.items())
            first: Dict[Any, int] = {}
            for ident, _ in items:
                first.setdefault(ident[0], len(first))
            # step order (int steps by value, others by first appearance), then first seen
            items.sort(key=lambda it: (0, it[0][0], 0) if type(it[0][0]) is int else (1, 0, first[it[0][0]]))
            self.classes.append(_UnionClass(key, [i for i, _ in items], [e for _, e in items]))
        mine_by_key = {key: idents for key, idents, _ in (mine or ())}
        for ucls in self.classes:
            idents = mine_by_key.get(ucls.key)
            if idents is None:
                continue
            if my_shift:
                idents = [(i[0] + my_shift,) + i[1:] if type(i[0]) is int else i for i in idents]
            if idents == ucls.idents:
                continue  # the common case: every rank has the same rows
            pos = {ident: p for p, ident in enumerate(ucls.idents)}
            ucls.where = [pos[i] for i in idents]
            ucls.local = [-1] * len(ucls.idents)
            for li, p in enumerate(ucls.where):
                ucls.local[p] = li
        self.ref: Optional[int] = None  # set by the caller at every flush
        self.cut: Optional[Dict[tuple, int]] = None  # rows' steps a rank dropped (all leave them out)

    def lay_out(self, ucls: _UnionClass, c: Optional[_Class], base: Optional[int], home):
        """This rank's rows of ``ucls`` in the union order on ``home`` (float64; rows of an
        ident seen twice here merged) and the metas of the union's rows."""
        n, width = len(ucls.idents), ucls.key[1]
        if c is None:
            return empty_rows(n, width - HEAD, device=home), [self._meta(ucls, p) for p in range(n)]
        rows = [r if r.device == home and r.dtype == torch.float64 else r.to(home, torch.float64)
                for r, _ in c.parts]
        if ucls.where is None and not c.dups:
            return (rows[0] if len(rows) == 1 else torch.cat(rows)), c.metas
        where = ucls.where if ucls.where is not None else list(range(n))
        target, count = [], {}
        for _, idx in c.parts:
            for i in idx:
                p = where[i]
                k = count.get(p, 0)  # the k-th row of this ident here: layer k
                count[p] = k + 1
                target.append(k * n + p)
        layers = max(count.values()) if count else 1
        laid = empty_rows(layers * n, width - HEAD, device=home)
        laid.index_copy_(0, _stats.host_to_device(target, torch.int64, home),
                         torch.cat(rows) if len(rows) > 1 else rows[0])
        laid = laid[:n] if layers == 1 else merge_rows(laid.view(layers, n, -1))
        if ucls.local is None:
            return laid, c.metas
        metas = [c.metas[li] if li >= 0 else self._meta(ucls, p) for p, li in enumerate(ucls.local)]
        return laid, metas

    def _meta(self, ucls: _UnionClass, p: int) -> dict:
        """The meta of a union row this rank has no row of (its step made absolute)."""
        step, module, site, phase, _ = ucls.idents[p]
        if type(step) is int and self.ref is not None:
            step += self.ref
        meta = {"step": step, "module": module, "site": site}
        if phase is not None:
            meta["phase"] = phase
        extras = ucls.extras[p]
        if extras:
            meta.update(extras)
        return meta


_FLUSH_ALIKE = (
    "hookplug telemetry: this was a flush's exchange of layouts between the ranks of the "
    "session's process group. If it timed out, a rank did not come to this flush: every rank "
    "must attach the session and flush alike (as many session.step() calls with "
    "flush_every=, session.flush() and remove() calls); a session attached on some ranks "
    "only takes distributed=False.")


class _Layouts:
    """The ranks' layouts, agreed on in one ``all_gather_object`` per flush of
    ``(version, base step, layout or None, run_id)``: a rank sends its layout only when it
    changed since it last sent one (else its version, which every rank knows); the union is
    rebuilt only when a version or a rank's base step relative to the others changed. The
    first exchange also hands rank 0's ``run_id`` to every rank."""

    def __init__(self):
        self.version = 0
        self.sent: Optional[list] = None  # what this rank sent last
        self.known: Dict[int, Tuple[int, list]] = {}  # rank -> (version, layout)
        self.union_key: Any = None
        self.union: Optional[_Union] = None
        self.run_id_agreed = False

    def agree(self, session, local: _Local, dist, world: int, rank: int) -> _Union:
        desc = local.describe()
        changed = desc != self.sent
        if changed:
            self.version += 1
        run_id = getattr(session, "run_id", None) if rank == 0 and not self.run_id_agreed else None
        seen: List[Any] = [None] * world
        try:
            dist.all_gather_object(seen, (self.version, local.base, desc if changed else None, run_id,
                                          local.dropped))
        except RuntimeError as exc:  # (a timeout: some rank never came to this flush)
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(_FLUSH_ALIKE)
            raise
        self.sent = desc
        for r, (version, _, layout, _, _) in enumerate(seen):
            if layout is not None:
                self.known[r] = (version, layout)
            elif self.known.get(r, (None,))[0] != version:
                raise RuntimeError(f"hookplug telemetry: rank {r}'s layout (version {version}) is "
                                   "unknown here (a flush failed part way before)")
        if not self.run_id_agreed:
            self.run_id_agreed = True
            if seen[0][3]:
                session.run_id = seen[0][3]
        bases = [b for _, b, _, _, _ in seen]
        ints = [b for b in bases if b is not None]
        ref = min(ints) if ints else None
        shifts = [0 if b is None else b - ref for b in bases]
        key = tuple((v, s) for (v, _, _, _, _), s in zip(seen, shifts))
        if key != self.union_key:
            self.union = _Union([self.known[r][1] for r in range(world)], shifts, desc, shifts[rank])
            self.union_key = key
        self.union.ref = ref
        cut: Dict[tuple, int] = {}
        for *_, dropped in seen:
            for k, step in (dropped or {}).items():
                if cut.get(k, step - 1) < step:
                    cut[k] = step
        self.union.cut = cut or None
        return self.union


def _merge_ranks(part: torch.Tensor) -> torch.Tensor:
    """``[world, R, W]`` gathered rows merged over the ranks; the histogram range of each row
    is that of the first rank that touched it (a rank without the row sent an empty one)."""
    merged = merge_rows(part)
    if part.shape[-1] > HEAD and part.shape[0] > 1:
        first = touched(part).to(torch.float64).argmax(0)  # the first touched rank (0: none)
        idx = first.view(1, -1, 1).expand(1, -1, 2)
        merged[:, HIST_LO:HIST_HI + 1] = part[:, :, HIST_LO:HIST_HI + 1].gather(0, idx)[0]
    return merged


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
