"""``prometheus`` sink: telemetry served as Prometheus metrics over HTTP.

    s = hookplug.attach(model, "Linear", plugins="stats", sink=("prometheus", {"port": 0}))
    s["prometheus"].port        # the port it listens on (0 picks a free one)

Serves ``prometheus_client``'s exposition from its own ``CollectorRegistry`` with
``start_http_server(port, addr, registry=...)`` on ``port`` (default 9464) and ``addr``
(``127.0.0.1`` by default: pass ``addr="0.0.0.0"`` to let another host scrape it). With
``all_ranks=True`` every rank serves, rank *r* on ``port + r`` (unless ``port=0``).
``port=None`` serves nothing; ``path``, when given, also writes the exposition to that file
after every flush (node_exporter's textfile collector: give it a ``.prom`` file). The server
stops at the end of the session; one sink instance may serve several sessions one after the
other, each with series of its own (the last one's stay readable until the next starts). A port already taken raises ``OSError`` naming
``addr:port``. A process forked while the sink serves (a DataLoader worker) closes its copy
of the listening socket at once, so the port is free again once the session ends.

Metrics, labelled ``module``, ``site``, ``phase`` (``train``/``eval``: eval-mode forwards
are never mixed into the training series) and ``rank`` (``<namespace>``: the
``namespace=`` option, ``hookplug`` by default):

- ``<namespace>_tensor_<stat>`` gauges, ``stat`` in ``hookplug.STAT_FIELDS`` (``numel,
  nan_count, inf_count, zero_count, calls, min, max, mean, std, absmax, l2, rms, zero_fraction``):
  the statistics of the latest step flushed;
- ``<namespace>_tensor_nonfinite_total`` counter (NaN + Inf values over the whole run);
- ``<namespace>_tensor_values`` histogram: the histogram buckets summed over every step
  flushed, bucket ``le`` = the largest value each bucket holds (a bucket spans
  ``edges[i] <= x < edges[i + 1]``: ``le`` is the float just below its right edge, e.g.
  ``0.9999999999999999`` for log2's ``[0.5, 1)``, so a value on an edge, ``1.0``, counts
  in the next; log2's negative buckets hold their right edge, ``-1.0``; a linear
  histogram's index may round a value within a few ulp of an edge across it), the ``+Inf``
  bucket counting every value seen but NaNs (which no bucket holds; a linear histogram
  leaves out +-Inf too). A linear histogram's
  finite values outside its given range are counted too: below it in every bucket, above
  it in ``+Inf`` only (a step with values on both sides: all in ``+Inf``), so ``_count``
  and ``_sum`` cover the same values. With negative buckets,
  as the log2 layout has, ``_sum`` and ``_count`` are left out (``prometheus_client``'s rule
  for histograms that can see negative values). It restarts (a counter reset) for a
  (module, site) whose bucket edges change;
- ``<namespace>_step`` gauge: the latest step flushed.

Needs ``prometheus_client`` (0.17 or later): ``pip install hookplug[prometheus]``.
"""
from __future__ import annotations

import math
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import hookplug
from hookplug._optional import optional_import
from hookplug._stats import hist_outside, hist_upper_bounds, is_log2_edges

__all__ = ["PrometheusSink"]

STATS = hookplug.STAT_FIELDS


# sinks serving now: a forked child (a DataLoader worker) closes its copy of their listening
# sockets at once, so the port is free again when the parent's session ends
_SERVING: "weakref.WeakSet[PrometheusSink]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sink in list(_SERVING):
        sink._forked()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _stop_server(server, thread, pid: int) -> None:
    """Stop serving and free the port. In a process that did not start the server (a forked
    child) only the inherited socket is closed: ``shutdown()`` would wait forever for a
    serving thread that does not run there (and on the serving thread itself, where a
    collection may run this, it is left to another thread)."""
    if pid != os.getpid():
        server.server_close()
    elif threading.current_thread() is thread:
        threading.Thread(target=_stop_server, args=(server, thread, pid), daemon=True).start()
    else:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _session_dropped(sink_ref, session_id: int) -> None:
    """A session the sink served was collected without ``remove()`` (the serving thread keeps
    the sink alive): it stops serving, freeing the port, once no session it serves is left."""
    sink = sink_ref()
    if sink is not None:
        sink._served.pop(session_id, None)
        if not sink._served:
            sink.close()


def _client():
    return optional_import("prometheus_client", "prometheus_client.core",
                           feature="the hookplug 'prometheus' sink", extra="prometheus",
                           package="prometheus_client")


class _Collector:
    """Builds the metric families from the sink's latest snapshot at scrape time."""

    def __init__(self, sink: "PrometheusSink"):
        self.sink = weakref.ref(sink)  # (the sink holds the registry that holds this: no cycle)

    def collect(self):
        _, core = _client()
        sink = self.sink()
        if sink is None:
            return
        ns = sink.namespace
        labels = ["module", "site", "phase", "rank"]
        with sink._lock:
            latest = dict(sink._latest)
            hists = {k: (v[0], list(v[1]), *v[2:]) for k, v in sink._hists.items()}
            nonfinite = dict(sink._nonfinite)
            step = sink._step
        for stat in STATS:
            g = core.GaugeMetricFamily(f"{ns}_tensor_{stat}",
                                       f"{stat} of the latest step flushed, per module and site",
                                       labels=labels)
            for key, rec in latest.items():
                g.add_metric(list(key), float(rec[stat]))
            yield g
        c = core.CounterMetricFamily(f"{ns}_tensor_nonfinite",
                                     "NaN and Inf values seen since the session started",
                                     labels=labels)
        for key, n in nonfinite.items():
            c.add_metric(list(key), float(n))
        yield c
        h = core.HistogramMetricFamily(f"{ns}_tensor_values",
                                       "value histogram summed over every step flushed",
                                       labels=labels)
        for key, (edges, counts, total, below, above) in hists.items():
            buckets: List[Tuple[str, float]] = []
            running = below  # below a linear range: at most every bound
            bounds = hist_upper_bounds(edges)
            if is_log2_edges(edges):  # its outermost bucket, [2**32, +Inf], is +Inf's
                bounds, above = bounds[:-1], above + counts[-1]
            for bound, n in zip(bounds, counts):
                running += n
                buckets.append((repr(float(bound)), running))
            buckets.append(("+Inf", running + above))
            h.add_metric(list(key), buckets, total)
        yield h
        if step is not None:
            yield core.GaugeMetricFamily(f"{ns}_step", "the latest step flushed", value=step)


class PrometheusSink(hookplug.Sink):
    """Serve telemetry records as Prometheus metrics (see the module docstring)."""

    name = "prometheus"

    def __init__(self, port: Optional[int] = 9464, *, addr: str = "127.0.0.1",
                 path: Union[str, os.PathLike, None] = None, all_ranks: bool = False,
                 namespace: str = "hookplug"):
        self._prom, _ = _client()
        if port is not None and not 0 <= port < 65536:
            raise ValueError(f"prometheus sink: port must be None or an int in [0, 65535], got {port!r}")
        super().__init__(path, all_ranks=all_ranks)
        self.requested_port = port
        self.addr = addr
        self.namespace = namespace
        self.port: Optional[int] = None
        self.registry = self._prom.CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server = None
        self._thread = None
        self._server_pid: Optional[int] = None  # the process serving (its thread runs there only)
        self._lock = threading.Lock()
        self._latest: Dict[Tuple[str, str, str, str], Dict[str, Any]] = {}
        # (edges, counts, sum, below, above): summed over the steps flushed
        self._hists: Dict[Tuple[str, str, str, str], Tuple[list, list, float, int, int]] = {}
        self._nonfinite: Dict[Tuple[str, str, str, str], int] = {}
        self._step: Optional[int] = None
        self._ended = False  # a session ended: the next one starts its own series
        # the sessions served now (a sink may serve several at once), each with the finalizer
        # that frees the port if it is dropped without remove(): serving stops with the last
        self._served: Dict[int, weakref.finalize] = {}

    # -- serving -------------------------------------------------------------------------------

    @hookplug.hookimpl
    def hookplug_session_start(self, session) -> None:
        if self._ended:  # served a session before: its latest steps would hide this one's
            with self._lock:
                self._latest, self._hists, self._nonfinite, self._step = {}, {}, {}, None
            self._ended = False
        if self.path_option is not None:
            self.path = self.resolve_path(session)
        rank = self.current_rank()
        if self.requested_port is not None and self._server is None and self.writes_on(rank, session):
            self._serve(self.requested_port + rank if self.requested_port else 0)
        self._served[id(session)] = weakref.finalize(session, _session_dropped, weakref.ref(self), id(session))

    def _serve(self, port: int) -> None:
        try:
            started = self._prom.start_http_server(port, addr=self.addr, registry=self.registry)
        except OSError as exc:  # e.g. the port is taken: say which
            raise OSError(exc.errno, f"prometheus sink: cannot serve on {self.addr}:{port}: "
                          f"{exc.strerror or exc}") from exc
        if started is None:  # prometheus_client < 0.17 gives no handle to stop or query it
            raise RuntimeError("the hookplug 'prometheus' sink needs prometheus_client >= 0.17: "
                               "pip install -U prometheus_client")
        self._server, self._thread = started
        self._server_pid = os.getpid()
        self.port = self._server.server_address[1]
        _SERVING.add(self)
        # the sink collected while serving (dropped with the session that made it): the
        # server holds no reference to the sink, so it stops then
        self._stop = weakref.finalize(self, _stop_server, self._server, self._thread, self._server_pid)

    @property
    def url(self) -> Optional[str]:
        """Where to scrape, e.g. ``http://127.0.0.1:9464/metrics``."""
        return None if self.port is None else f"http://{self.addr}:{self.port}/metrics"

    # -- records ---------------------------------------------------------------------------------

    @hookplug.hookimpl
    def hookplug_flush(self, session, records: List[Dict[str, Any]]) -> None:
        with self._lock:
            for rec in records:
                key = (rec["module"], rec["site"], rec.get("phase", "train"), str(rec.get("rank", 0)))
                prev = self._latest.get(key)
                if prev is None or rec["step"] >= prev["step"]:
                    self._latest[key] = rec
                self._nonfinite[key] = self._nonfinite.get(key, 0) + rec["nan_count"] + rec["inf_count"]
                counts, edges = rec.get("hist"), rec.get("hist_edges")
                if counts and edges:
                    n_finite = rec["numel"] - rec["nan_count"] - rec["inf_count"]
                    part = rec["mean"] * n_finite if n_finite > 0 and math.isfinite(rec["mean"]) else 0.0
                    below, above = hist_outside(rec)
                    old = self._hists.get(key)
                    if old is None or old[0] != edges:
                        self._hists[key] = (list(edges), list(counts), part, below, above)
                    else:
                        self._hists[key] = (old[0], [a + b for a, b in zip(old[1], counts)], old[2] + part,
                                            old[3] + below, old[4] + above)
                self._step = rec["step"] if self._step is None else max(self._step, rec["step"])
        if self.path:
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._prom.write_to_textfile(self.path, self.registry)

    def exposition(self) -> str:
        """The metrics in the Prometheus text format, as a scrape would return them."""
        return self._prom.generate_latest(self.registry).decode("utf-8")

    def _forked(self) -> None:
        """In a forked child: close the inherited listening socket (the serving thread is the
        parent's; a copy of its socket here would keep the port open after the parent's
        session ends)."""
        if self._server is not None:
            self._server.server_close()

    @hookplug.hookimpl
    def hookplug_session_end(self, session) -> None:
        """Serving (and the metrics' series) end with the last session the sink serves."""
        stopper = self._served.pop(id(session), None)
        if stopper is not None:
            stopper.detach()
        if not self._served:
            super().hookplug_session_end(session)

    def close(self) -> None:
        """Stop serving (see ``_stop_server``). The metrics stay readable (``exposition()``)
        until the next session the sink serves starts."""
        self._ended = True
        for stopper in self._served.values():
            stopper.detach()
        self._served.clear()
        if self._server is not None:
            self._stop()
            self._server = self._thread = None
            _SERVING.discard(self)

    def __repr__(self) -> str:
        return f"<PrometheusSink {self.url or 'not serving'}>"
