"""``jsonl`` sink: telemetry records as JSON lines, the embedded default.

    hookplug.attach(model, "Linear", plugins="stats", sink=("jsonl", {"path": "runs/exp1"}))

``path`` is a directory (the file is ``<path>/telemetry.jsonl``) or a file ending in
``.jsonl``/``.json``/``.ndjson``; unset, it is ``runs/<run-id>/telemetry.jsonl``. ``{rank}``
and ``{run_id}`` in ``path`` are filled in (a file per rank with ``all_ranks=True`` on a
network file system).

The file is opened with ``O_APPEND`` and every flush goes out in ``os.write`` calls that each
carry whole lines, so a line is never torn or interleaved with another writer's, a reader
(``tail -f``) sees the records as soon as the flush is written, and a killed run loses only
what was not flushed yet. ``fsync=True`` also forces them to disk.

One JSON object a line: the record as the session emits it (``step, time, rank, module,
site, numel, nan_count, inf_count, zero_count, min, max, mean, std, absmax, hist``), strict
JSON: a float that is NaN or infinite is written as ``null`` (``nan_count``/``inf_count``
and ``numel`` say why). ``hist_edges`` is written on the first line of each
``(module, site)`` and again only when it changes (the log2 layout never does); a reader
carries the last one forward. One sink instance may serve several sessions one after the
other: ``close()`` (at the end of each session) forgets which edges were written, so every
file (or every session's part of an appended file) starts with its own ``hist_edges``.
``lines`` counts the lines written to the current (or last) file by this sink.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import hookplug

__all__ = ["JsonlSink", "read_jsonl"]

_SUFFIXES = (".jsonl", ".json", ".ndjson")
_CHUNK = 1 << 20  # bytes per os.write (whole lines)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_FLOATS = ("min", "max", "mean", "std", "absmax", "time")


def _clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class JsonlSink:
    """Append telemetry records to a JSON-lines file (see the module docstring)."""

    name = "jsonl"

    def __init__(self, path: Optional[str] = None, *, all_ranks: bool = False, fsync: bool = False):
        self.path_option = None if path is None else os.fspath(path)
        self.all_ranks = bool(all_ranks)
        self.fsync = bool(fsync)
        self.path: Optional[str] = None
        self.lines = 0
        self._fd: Optional[int] = None
        self._edges: Dict[Tuple[str, str], Any] = {}

    def _resolve(self, session, rank: int) -> str:
        from hookplug._telemetry import default_run_dir

        if self.path_option is None:
            return os.path.join(default_run_dir(session), "telemetry.jsonl")
        path = self.path_option.format(rank=rank, run_id=getattr(session, "run_id", "run"))
        if not path.endswith(_SUFFIXES):
            path = os.path.join(path, "telemetry.jsonl")
        return path

    def _open(self, session, rank: int) -> int:
        if self._fd is None:
            self.path = self._resolve(session, rank)
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._edges = {}  # a new file (or a new session's records): write the edges again
            self.lines = 0
        return self._fd

    def encode(self, record: Dict[str, Any]) -> str:
        """One record as a JSON line (with its newline)."""
        out = dict(record)
        edges = out.pop("hist_edges", None)
        if edges:
            key = (record.get("module"), record.get("site"))
            last = self._edges.get(key)
            if last is not edges and last != edges:
                self._edges[key] = edges
                out["hist_edges"] = edges
        for k in _FLOATS:
            v = out.get(k)
            if v is not None and not math.isfinite(v):
                out[k] = None
        try:
            text = _ENCODER.encode(out)
        except ValueError:  # a non-finite float elsewhere (a producer's own meta)
            text = _ENCODER.encode(_clean(out))
        return text + "\n"

    @hookplug.hookimpl
    def hookplug_flush(self, session, records: List[Dict[str, Any]]) -> None:
        if not records:
            return
        fd = self._open(session, records[0].get("rank", 0))
        chunk: List[bytes] = []
        size = 0
        for rec in records:
            line = self.encode(rec).encode("utf-8")
            if size and size + len(line) > _CHUNK:
                self._write(fd, b"".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write(fd, b"".join(chunk))
        self.lines += len(records)
        if self.fsync:
            os.fsync(fd)

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a short write happens only on a full disk or a signal
            view = view[os.write(fd, view):]

    @hookplug.hookimpl
    def hookplug_session_end(self, session) -> None:
        self.close()

    def close(self) -> None:
        """Close the file and forget what is per file (the ``hist_edges`` already written), so
        the sink can serve another session: its file gets every ``hist_edges`` again.
        ``path`` and ``lines`` keep describing the file just closed until the next one opens."""
        self._edges = {}
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        return f"<JsonlSink {self.path or self.path_option or '(runs/<run-id>)'}>"


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """Read a telemetry file back, carrying ``hist_edges`` forward to every record and
    turning ``null`` statistics back into NaN."""
    if not path.endswith(_SUFFIXES):
        path = os.path.join(path, "telemetry.jsonl")
    edges: Dict[Tuple[str, str], Any] = {}
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            key = (rec.get("module"), rec.get("site"))
            if "hist_edges" in rec:
                edges[key] = rec["hist_edges"]
            elif rec.get("hist"):
                rec["hist_edges"] = edges.get(key)
            for k in ("min", "max", "mean", "std", "absmax"):
                if k in rec and rec[k] is None:
                    rec[k] = math.nan
            out.append(rec)
    return out
