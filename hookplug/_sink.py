"""``Sink``: the base of telemetry sinks, first- and third-party.

A sink is a plugin that implements ``hookplug_flush(session, records)`` (the record schema:
:mod:`hookplug._telemetry`; the statistics every record carries: ``hookplug.STAT_FIELDS``).
This base supplies what every sink that writes somewhere repeats:

- ``path``: where to write, with ``{rank}`` and ``{run_id}`` filled in (checked when the
  sink is built); unset, the session's run directory ``session.run_dir``
  (``runs/<run-id>``). ``file_name``/``file_suffixes`` (class attributes) make a folder
  path name the file inside it, unless the path already ends in one of the suffixes;
- ``all_ranks``: on a rank other than 0 the session calls a sink only when this is true
  (or the session is attached with ``distributed=False``); ``writes_on(rank, session)``;
- ``close()`` at the end of the session (``hookplug_session_end``).

    class CsvSink(hookplug.Sink):
        name, file_name, file_suffixes = "csv", "stats.csv", (".csv",)

        @hookplug.hookimpl
        def hookplug_flush(self, session, records):
            path = self.resolve_path(session)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "a") as f:
                for r in records:
                    f.write(f"{r['step']},{r['module']},{r['site']},{r['mean']}\\n")
"""
from __future__ import annotations

import dataclasses
import errno
import os
from typing import Optional, Tuple

import torch

from .hookspecs import hookimpl

__all__ = ["Sink", "current_rank"]

PLACEHOLDERS = ("rank", "run_id")


def check_writable(path: str, who: str, folder: bool = False) -> None:
    """Raise ``OSError`` (its message starting with ``who``, naming the path) if a file
    (``folder``: a folder to write files in) cannot be created or appended at ``path``,
    creating nothing: the path itself if it exists, else its nearest existing ancestor, must
    be a writable folder. A sink calls it at attach (``hookplug_session_start``) so a bad
    path fails before training, not at the first flush with the run's telemetry lost."""
    for p in _with_ancestors(path):  # (os.path.exists() is False for a link to nothing)
        if os.path.islink(p) and not os.path.exists(p):
            raise FileNotFoundError(errno.ENOENT, f"{who}: a symbolic link to nothing is in the way", p)
    if os.path.isdir(path) and not folder:
        raise IsADirectoryError(errno.EISDIR, f"{who}: a folder is where the file must be", path)
    if os.path.exists(path):
        if folder and not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, f"{who}: a file is where the folder must be", path)
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise PermissionError(errno.EACCES, f"{who}: the {'folder' if folder else 'file'} is "
                                  "not writable", path)
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"{who}: a file is where a folder must be", parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{who}: cannot create the {'folder' if folder else 'file'}, "
                              "the folder is not writable", parent)


def _with_ancestors(path: str):
    """``path`` and its folders up to the first that exists (as the links they are)."""
    p = os.path.abspath(path)
    while True:
        yield p
        if os.path.exists(p):
            return
        up = os.path.dirname(p)
        if up == p:
            return
        p = up


def current_rank() -> int:
    """This process's rank under torch.distributed; before ``init_process_group`` the
    ``RANK`` a launcher (torchrun) set, else 0 (a rank other than 0 flushing before the group
    exists wrote as rank 0: into rank 0's file, labelled 0)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else 0


class Sink:
    """Base class of telemetry sinks (see the module docstring)."""

    name: str = ""
    file_name: Optional[str] = None  # written inside a folder path (None: the folder itself)
    file_suffixes: Tuple[str, ...] = ()  # a path ending in one of these is the file
    # what __init__ sets, for a subclass whose __init__ does not call it
    path_option: Optional[str] = None
    all_ranks: bool = False
    path: Optional[str] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        from ._manager import check_hook_methods
        from ._options import check_constructor

        check_constructor(cls)  # options of an instance built directly are checked too
        check_hook_methods(cls)  # unmarked hooks (never called), hooks without self

    def __post_init__(self, *init_vars) -> None:
        """A ``@dataclass`` sink's fields are checked as options are (see ``Plugin``); its
        ``path`` and ``all_ranks`` fields, where it declares them, are taken as
        ``Sink.__init__`` takes them (the dataclass's ``__init__`` does not call it)."""
        from ._options import check_dataclass_fields

        check_dataclass_fields(self)
        fields = {f.name for f in dataclasses.fields(self)}
        if fields & {"path", "all_ranks"}:
            Sink._take_path(self, getattr(self, "path", None) if "path" in fields else None,
                            getattr(self, "all_ranks", False) if "all_ranks" in fields else False,
                            resolved="path" not in fields)  # (a field keeps what was given)
        after = getattr(super(), "__post_init__", None)  # (a dataclass mixin after this base)
        if after is not None:
            after(*init_vars)

    def __init__(self, path: "Optional[str | os.PathLike[str]]" = None, *, all_ranks: bool = False):
        self._take_path(path, all_ranks)

    def _take_path(self, path, all_ranks, resolved: bool = True) -> None:
        option = None if path is None else os.fspath(path)
        if option is not None:
            if not isinstance(option, str) or not option.strip():
                raise ValueError(f"{self.name} sink: path= expects a file or folder name (or None: "
                                 f"runs/<run-id>), got {path!r}")
            self._check_placeholders(option)
        set_ = object.__setattr__  # (a frozen dataclass sink too)
        set_(self, "path_option", option)
        set_(self, "all_ranks", bool(all_ranks))
        if resolved:
            set_(self, "path", None)  # the resolved path, once known

    def _check_placeholders(self, path: str) -> None:
        allowed = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
        try:
            path.format(rank=0, run_id="run")
        except KeyError as exc:
            raise ValueError(
                f"{self.name} sink: path {path!r} has the placeholder {{{exc.args[0]}}}; only "
                f"{allowed} are filled in (write {{{{ and }}}} for literal braces)") from None
        except IndexError:  # "{}" or "{0}": format() looked for a positional argument
            raise ValueError(
                f"{self.name} sink: path {path!r} has a positional placeholder ({{}} or {{0}}), "
                f"which is not allowed; only {allowed} are filled in (write {{{{ and }}}} for "
                "literal braces)") from None
        except (ValueError, AttributeError, TypeError) as exc:  # a lone brace, {rank.x}, {rank[0]}
            raise ValueError(f"{self.name} sink: path {path!r} is not a valid template: {exc}; only "
                             f"{allowed} are filled in (write {{{{ and }}}} for literal braces)") from None

    current_rank = staticmethod(current_rank)

    def writes_on(self, rank: int, session=None) -> bool:
        """Whether this sink writes on ``rank`` (rank 0 always; others with ``all_ranks``, or
        in ``session`` when it is attached with ``distributed=False``: the session then hands
        every sink its records, whatever the rank)."""
        return rank == 0 or self.all_ranks or (session is not None and not getattr(session, "distributed", True))

    def resolve_path(self, session, rank: Optional[int] = None) -> str:
        """The path this sink writes for ``session`` on ``rank`` (default: this process's)."""
        rank = self.current_rank() if rank is None else rank
        if self.path_option is None:
            base = session.run_dir
        else:
            base = self.path_option.format(rank=rank, run_id=getattr(session, "run_id", None) or "run")
        if self.file_name and not (self.path_option is not None and base.endswith(self.file_suffixes)):
            return os.path.join(base, self.file_name)
        return base

    @hookimpl
    def hookplug_session_end(self, session) -> None:
        self.close()

    def close(self) -> None:
        """Release what the sink holds (files, writers, servers); it may serve another session."""

    def __repr__(self) -> str:
        where = self.path or self.path_option or os.path.join("runs", "<run-id>")
        return f"<{type(self).__name__} {where}>"


# (imported here: _options imports _manager, which imports this module's users)
from ._options import check_constructor  # noqa: E402

check_constructor(Sink)  # a subclass without __init__ of its own is built through it
