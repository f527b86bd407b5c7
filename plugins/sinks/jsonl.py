"""``jsonl`` sink: telemetry records as JSON lines, the embedded default.

    hookplug.attach(model, "Linear", plugins="stats", sink=("jsonl", {"path": "runs/exp1"}))

``path`` is a directory (the file is ``<path>/telemetry.jsonl``) or a file ending in
``.jsonl``/``.json``/``.ndjson``; unset, it is ``runs/<run-id>/telemetry.jsonl``. ``{rank}``
and ``{run_id}`` in ``path`` are filled in (a file per rank with ``all_ranks=True`` on a
network file system).

The path is checked when the session starts (at ``attach``), not at the first flush: an
unknown ``{placeholder}`` raises ``ValueError`` when the sink is built, and a file where a
folder must be, a folder where the file must be, or a folder that cannot be written fails
the sink at attach (raised, or warned under ``on_error="warn"``). Nothing is created then.

The file is opened with ``O_APPEND`` and every flush goes out in ``os.write`` calls that each
carry whole lines, so a line is never interleaved with another writer's, a reader
(``tail -f``) sees the records as soon as the flush is written, and a killed run loses only
what was not flushed yet. Each flush's writes hold an exclusive ``flock`` on the file (where
the file system has locks), so writers take turns. A write that fails part way (a full disk) is rolled back to the
last whole line (the file is truncated to where that write began) and the ``OSError`` is
raised, naming the file, to the session, whose ``on_error`` decides. A flush interrupted by
Ctrl-C (any ``BaseException``) is truncated away whole: the session hands it over again at
``remove()``, so its records are written once. ``fsync=True`` also
forces them to disk. A run killed mid-write can still leave a torn last line: the next sink
to open the file ends it with a newline (warning), and :func:`read_jsonl` skips torn lines
with one warning.

One JSON object a line: the record as the session emits it (``step, time, rank, module,
site, phase, numel, nan_count, inf_count, zero_count, calls, min, max, mean, std, absmax, l2, rms,
zero_fraction, hist, hist_edges, first_nonfinite``; ``hookplug.STAT_FIELDS`` are the
statistics) plus
``run_id`` (the session's ``run_id``, unless the record has one), so the runs that append to
one file can be told apart (``read_jsonl(path, run_id=...)`` keeps one); strict
JSON: a float that is NaN or infinite is written as ``null`` (``nan_count``/``inf_count``
and ``numel`` say why). ``hist_edges`` is written on the first line of each
``(module, site)`` and again only when it changes (the log2 layout never does); a reader
carries the last one forward. One sink instance may serve several sessions one after the
other: ``close()`` (at the end of each session) forgets which edges were written, so every
file (or every session's part of an appended file) starts with its own ``hist_edges``.
``lines`` counts the lines written to the current (or last) file by this sink.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import hookplug
from hookplug._plugin import user_stacklevel
from hookplug._sink import check_writable
from hookplug._stats import COUNT_COLUMNS
from hookplug._telemetry import RECORD_KEYS, on_interrupt

__all__ = ["JsonlSink", "read_jsonl"]

_SUFFIXES = (".jsonl", ".json", ".ndjson")
_CHUNK = 1 << 20  # bytes per os.write (whole lines)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_FLOATS = hookplug.STAT_FIELDS[len(COUNT_COLUMNS):] + ("time",)  # the float fields (after the counts)
_NULLABLE = _FLOATS + ("update_to_weight",)  # and params' ratio: null in a file means NaN


@contextlib.contextmanager
def _locked(fd: int):
    """Hold an exclusive ``flock`` on ``fd`` (where the platform has one): the writers of one
    file take turns, so a torn-tail check or a rollback never sees another writer mid-write."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # a file system without locks: appends stay whole lines, unlocked
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _dumps_stdlib(obj: Dict[str, Any]) -> bytes:
    """Compact strict JSON with the standard library; NaN and infinities become null."""
    for k in _FLOATS:  # the usual non-finite values, without a failed first try
        v = obj.get(k)
        if v is not None and not math.isfinite(v):
            obj[k] = None
    try:
        text = _ENCODER.encode(obj)
    except ValueError:  # a non-finite float elsewhere (a producer's own meta)
        text = _ENCODER.encode(_clean(obj))
    return text.encode("utf-8")


_DUMPS = None


def _dumps():
    """The encoder of a record: ``orjson`` where it is installed (``pip install
    hookplug[jsonl]``; 10-15x faster than ``json`` on records with a histogram, and it writes
    NaN and infinities as null too), else the standard library. A record ``orjson`` refuses
    (a type it does not know, a subclass, a dataclass or datetime, an int over 64 bits, a
    key that is not a str) goes to the standard library, which answers as it always did."""
    global _DUMPS
    if _DUMPS is None:
        try:
            import orjson
        except ImportError:
            _DUMPS = _dumps_stdlib
        else:
            # subclasses, dataclasses and datetimes go to json too, which decides as it
            # always did (orjson alone would also write Enum and UUID values)
            opts = (orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
                    | orjson.OPT_PASSTHROUGH_DATETIME)

            def dumps(obj: Dict[str, Any]) -> bytes:
                try:
                    return orjson.dumps(obj, option=opts)
                except TypeError:  # orjson.JSONEncodeError is a TypeError
                    return _dumps_stdlib(obj)

            _DUMPS = dumps
    return _DUMPS


class JsonlSink(hookplug.Sink):
    """Append telemetry records to a JSON-lines file (see the module docstring)."""

    name = "jsonl"
    file_name = "telemetry.jsonl"
    file_suffixes = _SUFFIXES

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, all_ranks: bool = False,
                 fsync: bool = False):
        super().__init__(path, all_ranks=all_ranks)
        self.fsync = fsync
        self.lines = 0
        self._fd: Optional[int] = None
        self._edges: Dict[Tuple[str, str], Any] = {}
        self._written: Optional[list] = None  # the records of the last flush written
        self.run_id: Optional[str] = None

    def _open(self, session, rank: int) -> int:
        if self._fd is None:
            self.path = self.resolve_path(session, rank)
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            # a session dropped without remove(): the file closes when the sink is collected
            self._fd_closer = weakref.finalize(self, os.close, self._fd)
            self._edges = {}  # a new file (or a new session's records): write the edges again
            self.lines = 0
        return self._fd

    @hookplug.hookimpl
    def hookplug_session_start(self, session) -> None:
        """Check at attach that the file can be written (creates nothing)."""
        self.run_id = getattr(session, "run_id", None)
        rank = self.current_rank()
        if self.writes_on(rank, session):
            check_writable(self.resolve_path(session, rank), "jsonl sink")

    def _end_torn_line(self, fd: int) -> None:
        """A file left ending in a partial line (a run that stopped mid-write) gets a newline,
        with a warning, so the records appended now start on a line of their own (the torn
        line is left for :func:`read_jsonl` to skip; never truncated: another writer may be
        appending to the same file)."""
        end = os.lseek(fd, 0, os.SEEK_END)
        if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
            return
        os.write(fd, b"\n")
        warnings.warn(f"jsonl sink: {self.path!r} ended in a torn line (a run that stopped "
                      "mid-write); ended it with a newline before appending (read_jsonl skips it)",
                      RuntimeWarning, stacklevel=user_stacklevel())

    def encode(self, record: Dict[str, Any]) -> str:
        """One record as a JSON line (with its newline)."""
        return self.encode_line(record).decode("utf-8")

    def encode_line(self, record: Dict[str, Any]) -> bytes:
        """One record as a UTF-8 JSON line (with its newline): ``run_id`` added, ``hist_edges``
        only where they changed for the record's ``(run_id, module, site)``, as
        :func:`read_jsonl` carries them forward (a sink shared by two sessions at once)."""
        out = dict(record)
        if "run_id" not in out and self.run_id is not None:
            out["run_id"] = self.run_id
        edges = out.pop("hist_edges", None)
        if edges:
            key = (out.get("run_id"), record.get("module"), record.get("site"))  # (read back per run)
            last = self._edges.get(key)
            if last is not edges and last != edges:
                self._edges[key] = edges
                out["hist_edges"] = edges
        return _dumps()(out) + b"\n"

    @hookplug.hookimpl
    def hookplug_flush(self, session, records: List[Dict[str, Any]]) -> None:
        if not records or records is self._written:  # handed over again after a Ctrl-C that came
            return                                    # as this sink finished writing it
        self.run_id = getattr(session, "run_id", None) or self.run_id
        fd = self._open(session, records[0].get("rank", 0))
        with _locked(fd):
            # at every flush: another writer of this file may have died mid-line since
            self._end_torn_line(fd)
            start, lines, edges = os.lseek(fd, 0, os.SEEK_END), self.lines, dict(self._edges)

            def undo():  # Ctrl-C part way: the session hands this flush over again
                with contextlib.suppress(OSError):  # (remove()'s final flush): written once
                    os.ftruncate(fd, start)
                self.lines, self._edges = lines, edges

            try:
                with on_interrupt(undo):
                    chunk: List[bytes] = []
                    size = 0
                    for rec in records:
                        line = self.encode_line(rec)
                        if size and size + len(line) > _CHUNK:
                            self._write(fd, b"".join(chunk), len(chunk))
                            chunk, size = [], 0
                        chunk.append(line)
                        size += len(line)
                    if chunk:
                        self._write(fd, b"".join(chunk), len(chunk))
                    if self.fsync:
                        os.fsync(fd)
                    self._written = records
            except OSError:  # a failed write's lines are not in the file, nor are their edges:
                self._edges = edges  # later lines carry them (written again at worst: harmless)
                raise

    def _write(self, fd: int, data: bytes, lines: int) -> None:
        """Append ``data`` (whole lines; the caller holds the lock); on an error part way,
        truncate the file back to where this write began, so it still ends with a whole
        line, and raise naming it."""
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):  # a short write happens only on a full disk or a signal
                n = os.write(fd, view[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += n
        except OSError as exc:
            rolled = ""
            if written:
                try:
                    end = os.lseek(fd, 0, os.SEEK_CUR)
                    os.ftruncate(fd, end - written)
                    rolled = f"; the {written} bytes written of them were truncated away"
                except OSError as undo:
                    rolled = (f"; truncating the {written} bytes written failed ({undo.strerror}), "
                              "the last line may be torn")
            raise OSError(
                exc.errno,
                f"jsonl sink: cannot write {lines} record(s) to {self.path!r}: "
                f"{exc.strerror or exc}{rolled}",
            ) from exc
        self.lines += lines

    def close(self) -> None:
        """Close the file and forget what is per file (the ``hist_edges`` already written), so
        the sink can serve another session: its file gets every ``hist_edges`` again.
        ``path`` and ``lines`` keep describing the file just closed until the next one opens."""
        self._edges = {}
        self._written = None
        if self._fd is not None:
            self._fd_closer.detach()
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str, *, run_id: Optional[str] = None) -> List[Dict[str, Any]]:
    """Read a telemetry file back, carrying ``hist_edges`` forward to every record (``[]``
    for one without a histogram, ``bins=0``) and turning ``null`` statistics back into NaN.
    ``run_id`` keeps only that run's records.

    Torn lines (a run that stopped mid-write: the start of a record, not valid JSON) are
    skipped with one warning naming them; any other line (JSON without a record's ``step``,
    ``module`` and ``site``, or not JSON) raises ``ValueError`` naming the file and the line."""
    path = os.fspath(path)
    if not path.endswith(_SUFFIXES):
        if not os.path.isdir(path):
            expected = (f"expected a folder holding telemetry.jsonl or a file ending in "
                        f"{', '.join(_SUFFIXES)} (a compressed file: decompress it first)")
            if os.path.exists(path):
                raise ValueError(f"read_jsonl: {path!r} is not a telemetry file: {expected}")
            raise FileNotFoundError(errno.ENOENT, f"read_jsonl: no such folder or file; {expected}", path)
        path = os.path.join(path, "telemetry.jsonl")
    edges: Dict[Tuple[Any, str, str], Any] = {}
    out = []
    torn: List[int] = []
    with open(path, "rb") as f:
        data = f.read()
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            # a torn line is the start of a record's line, or NUL bytes (a power loss after
            # an append the file system had not written yet)
            if not raw.startswith((b"{", b"\x00")):
                raise ValueError(f"read_jsonl: {path}: line {number} is not a telemetry record "
                                 f"(not JSON, and not the start of a record cut short): "
                                 f"{raw[:60]!r}") from None
            torn.append(number)
            continue
        if not isinstance(rec, dict) or not RECORD_KEYS <= rec.keys():
            got = (f"an object with keys {', '.join(sorted(map(str, rec))[:8])}" if isinstance(rec, dict)
                   else type(rec).__name__)
            raise ValueError(f"read_jsonl: {path}: line {number} is not a telemetry record: expected a "
                             f"JSON object with keys {', '.join(sorted(RECORD_KEYS))}, got {got}")
        if run_id is not None and rec.get("run_id") != run_id:
            continue
        key = (rec.get("run_id"), rec.get("module"), rec.get("site"))
        if "hist_edges" in rec:
            edges[key] = rec["hist_edges"]
        elif "hist" in rec:  # no histogram (bins=0): its edges, [], are never written
            rec["hist_edges"] = edges.get(key) if rec["hist"] else []
        for k in _NULLABLE:  # every float the writer turns to null when not finite
            if k in rec and rec[k] is None:
                rec[k] = math.nan
        out.append(rec)
    if torn:
        shown = ", ".join(map(str, torn[:5])) + (f" and {len(torn) - 5} more" if len(torn) > 5 else "")
        warnings.warn(f"read_jsonl: {path}: skipped {len(torn)} torn line(s) (not valid JSON, from a "
                      f"run that stopped mid-write): line {shown}", RuntimeWarning, stacklevel=user_stacklevel())
    return out
