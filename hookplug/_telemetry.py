"""The telemetry flush engine behind ``Session.step()``, ``Session.flush()`` and ``remove()``.

A flush:

1. asks the producers (``hookplug_collect``) for their ``(meta, TensorStats)`` pairs, whose
   fields are still device tensors;
2. packs all of them into **one** float64 buffer on their device with a handful of
   ``torch.stack``/``torch.cat`` calls (one per field, not one per record), a row per record:
   ``numel, nan_count, inf_count, zero_count, min, max, mean, std, absmax, hist[B],
   edges[B+1]`` (``B = 0``: no histogram, no edges);
3. under ``torch.distributed`` (available and initialized), reduces the rows across ranks
   in one round of two ``all_reduce`` calls issued together (see *Distributed* below);
4. copies the buffer to pinned host memory with ``non_blocking=True`` and records a CUDA
   event behind the copy (on the CPU the buffer already is host memory);
5. once the event has completed, turns the buffer into flat records and hands them to
   every sink (``hookplug_flush``).

The training loop never waits: ``step()`` starts a flush every ``flush_every`` steps and
only *polls* the flushes in flight (``event.query()``), emitting those whose copy is done.
``session.flush()`` (``wait=True``) starts one and waits for every flush in flight (a sync
is fine there); ``session.flush(wait=False)`` starts one without waiting; ``remove()``
finishes everything. Records come out in flush order.

Records (flat dicts, one per ``(step, module, site)``)::

    {"step": int, "time": float, "rank": int, "module": str, "site": str,
     "numel": int, "nan_count": int, "inf_count": int, "zero_count": int,
     "min": float, "max": float, "mean": float, "std": float, "absmax": float,
     "hist": [int, ...], "hist_edges": [float, ...]}

``time`` is the wall-clock time (``time.time()``) at which the record's step ended
(``session.step()``), or the flush time for a step still running. ``hist`` is empty
without a histogram, otherwise ``len(hist_edges) == len(hist) + 1`` (bucket ``i`` spans
``hist_edges[i]`` to ``hist_edges[i + 1]``); records with equal edges share one list.
Extra keys a producer puts in ``meta`` are kept. min/max/mean/std/absmax are NaN where
the tensor had no finite value.

Sinks: every plugin implementing ``hookplug_flush``. On a rank other than 0 a sink is
called only if it has a true ``all_ranks`` attribute (the first-party sinks take an
``all_ranks=`` option).

Distributed: every rank must flush the same ``(step, module, site)`` records (the same
modules run on the same sampled steps, ``flush_every``/``flush()``/``remove()`` called
on every rank), as with any collective. The rows become a SUM buffer ``[numel, nan_count,
inf_count, zero_count, n, n*mean, M2 + n*(mean - c)**2, hist...]`` (``n`` the finite count,
``M2 = n*std**2``) and a MAX buffer ``[-min, max, absmax, lo, -lo, hi, -hi]`` (NaN as -inf;
``lo``/``hi`` the first and last histogram edge), reduced with one ``all_reduce`` each;
activations are never gathered. The global mean is ``sum(n*mean)/N`` and the global
``M2 = sum(M2 + n*(mean - c)**2) - N*(mean_g - c)**2``: exact algebra, whose float64
rounding is relative ``~1e-16 * (mean - c)**2 / var``. ``c``, the shift, must be the same
on every rank: it is the global mean of the same ``(module, site)`` at the previous flush,
kept on the device (0 at the first flush), so the cancellation stays negligible unless a
tensor's ``|mean|/std`` exceeds ~1e5 at its first flush. Histograms sum bucket by
bucket; if the ranks' edges differ (a linear histogram with an automatic range) the
record's ``hist`` is left empty, with one warning. A hash of the record keys rides in the
MAX buffer and a mismatch between ranks raises.
"""
from __future__ import annotations

import collections
import itertools
import os
import time
import warnings
import zlib
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from . import _stats

__all__ = ["Telemetry", "new_run_id", "default_run_dir", "RECORD_FIELDS"]

RECORD_FIELDS = ("step", "time", "rank", "module", "site", "numel", "nan_count", "inf_count",
                 "zero_count", "min", "max", "mean", "std", "absmax", "hist", "hist_edges")
_COUNT_FIELDS = _stats._COUNTS
_MOMENT_FIELDS = _stats._MOMENTS
STAT_FIELDS = _COUNT_FIELDS + _MOMENT_FIELDS  # what a record holds per (step, module, site)
_HEAD = len(_COUNT_FIELDS) + len(_MOMENT_FIELDS)  # 9
_MAX_STEP_TIMES = 4096
_run_counter = itertools.count()


def new_run_id() -> str:
    """``$HOOKPLUG_RUN_ID`` or ``<YYYYmmdd-HHMMSS>-<pid>[-<n>]`` (unique in this process)."""
    env = os.environ.get("HOOKPLUG_RUN_ID")
    if env:
        return env
    n = next(_run_counter)
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}" + (f"-{n}" if n else "")


def default_run_dir(session) -> str:
    """``runs/<run-id>``: where sinks write when given no ``path``."""
    return os.path.join("runs", getattr(session, "run_id", None) or new_run_id())


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d
    return None


def _stack(values, device) -> torch.Tensor:
    """``torch.stack`` of 0-d device tensors (the contract); numbers are converted."""
    try:
        return torch.stack(values)
    except (TypeError, RuntimeError):  # Python numbers or 1-element tensors from a producer
        return torch.stack([torch.as_tensor(v, device=device).reshape(()) for v in values])


def _check_pairs(name, res) -> List[Tuple[dict, Any]]:
    if res is None:
        return []
    expected = ("a list of (meta, TensorStats) pairs, meta a dict with 'step', 'module' and "
                "'site'")
    if not isinstance(res, (list, tuple)):
        raise TypeError(f"plugin {name!r}: hookplug_collect must return None or {expected}, "
                        f"got {type(res).__name__}")
    for item in res:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], dict)
                and {"step", "module", "site"} <= item[0].keys() and hasattr(item[1], "hist_counts")):
            raise TypeError(f"plugin {name!r}: hookplug_collect must return None or {expected}, "
                            f"got an item {item!r:.100}")
    return list(res)


class _Flight:
    """One flush on its way to the host."""

    __slots__ = ("host", "event", "metas", "groups", "rank", "check", "device_buf")

    def __init__(self, host, event, metas, groups, rank, check, device_buf):
        self.host = host
        self.event = event
        self.metas = metas
        self.groups = groups  # [(record indices, offset, bins)], rows of 9 + B (+ B + 1) floats
        self.rank = rank
        self.check = check  # offset of the key-hash pair (distributed), or None
        self.device_buf = device_buf  # kept alive until the copy is done

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Telemetry:
    """Per-session flush state: flushes in flight, step end times, the distributed shift."""

    def __init__(self):
        self.in_flight: Deque[_Flight] = collections.deque()
        self.step_times: Dict[int, float] = {}
        self.flushes = 0
        self.records_emitted = 0
        self._shift_index: Dict[Tuple[str, str], int] = {}
        self._shift: Dict[torch.device, torch.Tensor] = {}
        self._warned_edges = False

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
        if fe and session._step % fe == 0:
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
            records = self._records(flight)
            if records:
                self._emit(session, records)
                out.extend(records)
        return out

    def has_consumers(self, session) -> bool:
        return bool(session._call_order.get("hookplug_flush"))

    # -- collect and pack (device side, no sync) ----------------------------------------------------

    def _collect(self, session) -> List[Tuple[dict, Any]]:
        pairs: List[Tuple[dict, Any]] = []
        kwargs = {"session": session, "step": session._step}
        for plugin in session._call_order.get("hookplug_collect", []):
            name = session._key_of.get(id(plugin))
            if name in session._disabled:
                continue
            impl = session._impl_of(plugin, "hookplug_collect")
            try:
                res = impl.function(**{a: kwargs[a] for a in impl.argnames if a in kwargs})
                items = _check_pairs(name, res)
            except Exception as exc:  # noqa: BLE001 - on_error decides
                session._plugin_failed(plugin, "hookplug_collect", exc)
                continue
            pairs.extend(items)
        return pairs

    def _start(self, session) -> List[_Flight]:
        pairs = self._collect(session)
        now = time.time()
        if not pairs:
            self._prune_times(session)
            return []
        step_times = self.step_times
        by_device: Dict[torch.device, List[Tuple[dict, Any]]] = {}
        for meta, st in pairs:
            dev = st.numel.device if isinstance(st.numel, torch.Tensor) else torch.device("cpu")
            by_device.setdefault(dev, []).append(({**meta, "time": step_times.get(meta["step"], now)}, st))
        self._prune_times(session)
        dist = _dist()
        rank = dist.get_rank() if dist is not None else 0
        flights = []
        for dev, items in by_device.items():
            flights.append(self._pack(items, dev, rank, dist))
        self.flushes += 1
        return flights

    def _prune_times(self, session) -> None:
        cur = session._step
        for s in [s for s in self.step_times if s <= cur]:
            del self.step_times[s]

    def _pack(self, items, device, rank, dist) -> _Flight:
        by_bins: Dict[int, List[int]] = {}
        for i, (_, st) in enumerate(items):
            h = st.hist_counts
            by_bins.setdefault(int(h.numel()) if isinstance(h, torch.Tensor) else len(h), []).append(i)
        mats: List[torch.Tensor] = []
        groups: List[Tuple[List[int], int, int]] = []
        offset = 0
        f64 = torch.float64
        for bins, idx in by_bins.items():
            sts = [items[i][1] for i in idx]
            r = len(sts)
            # one stack per kind of field, whatever the number of records
            parts = [_stack([getattr(s, f) for s in sts for f in _COUNT_FIELDS], device).to(f64).view(r, 4),
                     _stack([getattr(s, f) for s in sts for f in _MOMENT_FIELDS], device).to(f64).view(r, 5)]
            if bins:
                parts.append(torch.stack([s.hist_counts for s in sts]).to(f64))
                parts.append(torch.stack([s.hist_edges for s in sts]).to(f64))
            mat = torch.cat(parts, dim=1)
            groups.append((idx, offset, bins))
            offset += mat.numel()
            mats.append(mat)
        metas = [meta for meta, _ in items]
        check = None
        if dist is not None and dist.get_world_size() > 1:
            keys = [(metas[i]["step"], metas[i]["module"], metas[i]["site"]) for idx, _, _ in groups for i in idx]
            mats, tail = self._reduce(mats, keys, dist, device)
            check = offset
            buf = torch.cat([m.reshape(-1) for m in mats] + [tail])
        else:
            buf = mats[0].reshape(-1) if len(mats) == 1 else torch.cat([m.reshape(-1) for m in mats])
        if buf.is_cuda:
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
            with torch.cuda.device(buf.device):
                host.copy_(buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return _Flight(host, event, metas, groups, rank, check, buf)
        host = buf if buf.device.type == "cpu" else buf.to("cpu")
        return _Flight(host, None, metas, groups, rank, check, None)

    # -- torch.distributed -----------------------------------------------------------------------------

    def _shift_rows(self, keys, device) -> Tuple[torch.Tensor, torch.Tensor, Dict[int, int]]:
        index = self._shift_index
        idx = []
        last: Dict[int, int] = {}
        for row, (_, mod, site) in enumerate(keys):
            k = index.setdefault((mod, site), len(index))
            idx.append(k)
            last[k] = row
        table = self._shift.get(device)
        if table is None or table.numel() < len(index):
            grown = torch.zeros(max(len(index), 16) * 2, dtype=torch.float64, device=device)
            if table is not None:
                grown[: table.numel()] = table
            table = self._shift[device] = grown
        key_hash = zlib.crc32(repr(keys).encode()) & ((1 << 31) - 1)
        host = torch.tensor(idx + [key_hash], dtype=torch.int64)
        if device.type == "cuda":
            dev_idx = host.pin_memory().to(device, non_blocking=True)
        else:
            dev_idx = host.to(device)
        return dev_idx[:-1], dev_idx[-1:].to(torch.float64), last

    def _reduce(self, mats, keys, dist, device):
        """SUM/MAX reduction of the packed rows across ranks (see the module docstring)."""
        f64 = torch.float64
        idx, key_hash, last = self._shift_rows(keys, device)
        table = self._shift[device]
        shift = table[idx]
        ninf = float("-inf")
        sums, maxes, shapes = [], [], []
        start = 0
        for mat in mats:
            r, width = mat.shape
            bins = (width - _HEAD - 1) // 2 if width > _HEAD else 0
            c = shift[start:start + r]
            numel, nan, inf = mat[:, 0], mat[:, 1], mat[:, 2]
            n = numel - nan - inf
            has = n > 0
            mean = torch.where(has, mat[:, 6], 0.0)
            std = torch.where(has, mat[:, 7], 0.0)
            d = mean - c
            s_part = [mat[:, :4], n[:, None], (n * mean)[:, None], (n * (std * std + d * d))[:, None]]
            m_part = [-mat[:, 4:5], mat[:, 5:6], mat[:, 8:9]]
            if bins:
                s_part.append(mat[:, _HEAD:_HEAD + bins])
                lo, hi = mat[:, _HEAD + bins:_HEAD + bins + 1], mat[:, -1:]
                m_part += [lo, -lo, hi, -hi]
            sums.append(torch.cat(s_part, dim=1))
            m = torch.cat(m_part, dim=1)
            maxes.append(torch.where(torch.isnan(m), ninf, m))
            shapes.append((r, width, bins))
            start += r
        sum_buf = torch.cat([s.reshape(-1) for s in sums])
        max_buf = torch.cat([m.reshape(-1) for m in maxes] + [key_hash, -key_hash])
        w1 = dist.all_reduce(sum_buf, op=dist.ReduceOp.SUM, async_op=True)
        w2 = dist.all_reduce(max_buf, op=dist.ReduceOp.MAX, async_op=True)
        w1.wait()
        w2.wait()
        out, means = [], []
        so = mo = 0
        start = 0
        nan = float("nan")
        for mat, (r, width, bins) in zip(mats, shapes):
            sw, mw = 7 + bins, 3 + (4 if bins else 0)
            s = sum_buf[so:so + r * sw].view(r, sw)
            m = max_buf[mo:mo + r * mw].view(r, mw)
            so += r * sw
            mo += r * mw
            c = shift[start:start + r]
            start += r
            n = s[:, 4]
            has = n > 0
            safe_n = torch.where(has, n, 1.0)
            mean = s[:, 5] / safe_n
            m2 = (s[:, 6] - n * (mean - c) ** 2).clamp_min(0.0)
            std = torch.sqrt(m2 / safe_n)
            mom = torch.stack([-m[:, 0], m[:, 1], mean, std, m[:, 2]], dim=1)
            mom = torch.where(has[:, None], mom, nan)
            parts = [s[:, :4], mom]
            if bins:
                hist = s[:, 7:7 + bins]
                same = (m[:, 3] == -m[:, 4]) & (m[:, 5] == -m[:, 6])
                hist = torch.where(same[:, None], hist, -1.0)  # -1: edges differ between ranks
                parts += [hist, mat[:, _HEAD + bins:]]
            out.append(torch.cat(parts, dim=1))
            means.append(torch.where(has, mean, c))
        # The next flush's shift: the global mean of the last row of each (module, site).
        rows = torch.tensor(list(last.values()), dtype=torch.int64)
        keys_idx = torch.tensor(list(last.keys()), dtype=torch.int64)
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
            keys_idx = keys_idx.pin_memory().to(device, non_blocking=True)
        else:
            rows, keys_idx = rows.to(device), keys_idx.to(device)
        table.index_copy_(0, keys_idx, torch.cat(means)[rows])
        return out, max_buf[-2:].to(f64)

    # -- host side --------------------------------------------------------------------------------------

    def _records(self, flight: _Flight) -> List[dict]:
        host = flight.host
        if flight.check is not None:
            h, neg = host[flight.check:flight.check + 2].tolist()
            if h != -neg:
                raise RuntimeError(
                    "hookplug telemetry: the ranks flushed different (step, module, site) records; "
                    "under torch.distributed every rank must run the same selected modules on the "
                    "same sampled steps and flush together")
        t_flush = time.time()
        rank = flight.rank
        metas = flight.metas
        out: List[Optional[dict]] = [None] * len(metas)
        for idx, off, bins in flight.groups:
            width = _HEAD + (2 * bins + 1 if bins else 0)
            mat = host[off:off + len(idx) * width].view(len(idx), width)
            heads = mat[:, :_HEAD].tolist()
            if bins:
                counts = mat[:, _HEAD:_HEAD + bins]
                bad = (counts[:, 0] < 0).tolist()  # -1: edges differ between ranks
                counts = counts.to(torch.int64).tolist()
                edges_t = mat[:, _HEAD + bins:]
                if bool((edges_t == edges_t[:1]).all()):  # the log2 layout: one shared list
                    shared = edges_t[0].tolist()
                    edges = [shared] * len(idx)
                else:
                    edges = edges_t.tolist()
            for k, i in enumerate(idx):
                meta, v = metas[i], heads[k]
                rec = {"step": meta["step"], "time": meta.get("time", t_flush), "rank": rank,
                       "module": meta["module"], "site": meta["site"],
                       "numel": int(v[0]), "nan_count": int(v[1]), "inf_count": int(v[2]),
                       "zero_count": int(v[3]), "min": v[4], "max": v[5], "mean": v[6], "std": v[7],
                       "absmax": v[8], "hist": [], "hist_edges": []}
                if bins:
                    if bad[k]:
                        self._warn_edges()
                    else:
                        rec["hist"], rec["hist_edges"] = counts[k], edges[k]
                if len(meta) > 4:  # extra keys from the producer
                    for key, val in meta.items():
                        if key not in rec:
                            rec[key] = val
                out[i] = rec
        self.records_emitted += len(out)
        return out  # type: ignore[return-value]

    def _warn_edges(self) -> None:
        if not self._warned_edges:
            self._warned_edges = True
            warnings.warn("hookplug telemetry: histogram edges differ between ranks (a linear "
                          "histogram without a fixed range?); those records carry no histogram",
                          RuntimeWarning, stacklevel=4)

    def _emit(self, session, records: List[dict]) -> None:
        rank = records[0].get("rank", 0)
        for plugin in session._call_order.get("hookplug_flush", []):
            key = session._key_of.get(id(plugin))
            if key in session._disabled:
                continue
            if rank != 0 and not getattr(plugin, "all_ranks", False):
                continue
            impl = session._impl_of(plugin, "hookplug_flush")
            kwargs = {"session": session, "records": records}
            try:
                impl.function(**{a: kwargs[a] for a in impl.argnames if a in kwargs})
            except Exception as exc:  # noqa: BLE001
                session._plugin_failed(plugin, "hookplug_flush", exc)
