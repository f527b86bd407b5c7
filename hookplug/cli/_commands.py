"""The ``hookplug`` command: ``plugins``, ``select`` and ``profile``.

User errors (a bad model spec, selector, shape, plugin name or file, a selector that matches
nothing) print one line on stderr and exit with status 2; set ``HOOKPLUG_DEBUG=1`` to see
the traceback instead. So does a stdout or report file that cannot be written (a full
disk), after writing the other reports; a stdout closed early (``| head``) is no error.

A MODEL given as ``path/to/file.py:factory`` runs that file's code (it is imported, with its
folder put first on ``sys.path``), and ``package.module:factory`` imports that module: both
execute code, as ``python file.py`` would. ``--help`` says so.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

import hookplug
from hookplug import PluginError, SelectorError, hookimpl, plugin_info, select
from hookplug._manager import is_plugin_class
from hookplug._options import close_matches
from hookplug.models import DEMO_MODELS
from hookplug.structures import iter_tensors

from . import _html, _report

__all__ = ["main", "UsageError", "load_model", "parse_shape"]

PROG = "hookplug"
DEFAULT_SELECTOR = "Conv2d|Linear"
DEFAULT_PLUGINS = "stats,flops"
EXIT_USAGE = 2

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64,
    "int32": torch.int32, "int": torch.int32,
}


class UsageError(Exception):
    """A mistake in what the user asked for: one line on stderr, exit status 2."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is one line (raised as UsageError) instead of usage + message."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- arguments ---------------------------------------------------------------------------

_MAX_NUMEL = 2**63 - 1  # torch sizes are int64


def parse_shape(text: str) -> Tuple[int, ...]:
    """``"8x3x64x64"`` (or ``8,3,64,64``) -> ``(8, 3, 64, 64)``."""
    parts = [p.strip() for p in re.split(r"[x×X,*]", str(text).strip())]
    if not parts or any(not p.isascii() or not p.isdigit() or int(p) <= 0 for p in parts):
        raise UsageError(
            f"--input {text!r}: expected a shape such as 8x3x64x64 (positive integers joined by 'x')"
        )
    shape = tuple(int(p) for p in parts)
    numel = 1
    for n in shape:
        numel *= n
    if numel > _MAX_NUMEL:
        raise UsageError(f"--input {text!r}: the shape is too large ({numel} elements, a tensor holds "
                         f"at most 2**63-1)")
    return shape


def _parse_dtype(text: str) -> torch.dtype:
    dtype = _DTYPES.get(text.strip().lower().replace("torch.", ""))
    if dtype is None:
        raise UsageError(f"--dtype {text!r}: expected one of float32, float64, float16, bfloat16, int64, int32")
    return dtype


def _parse_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {text!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UsageError(f"--device {text}: CUDA is not available ({why})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type != "cpu":
        raise UsageError(f"--device {text!r}: expected cpu, cuda or cuda:N")
    return device


def _split_top_level(text: str) -> List[str]:
    """Split on commas outside parentheses, brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_plugins(text: str) -> List[Tuple[str, Dict[str, Any]]]:
    """``"stats(bins=0),flops"`` -> ``[("stats", {"bins": 0}), ("flops", {})]``."""
    out: List[Tuple[str, Dict[str, Any]]] = []
    for part in _split_top_level(str(text)):
        name, argstr = _split_call(part)
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
            raise UsageError(f"--plugins {text!r}: {part!r} is not a plugin name (e.g. stats or stats(bins=0))")
        args, kwargs = _parse_call_args(part, argstr, what="--plugins")
        if args:
            raise UsageError(f"--plugins {part!r}: give options by name, e.g. {name}(bins=0)")
        if name in [n for n, _ in out]:
            raise UsageError(f"--plugins {text!r}: plugin {name!r} is given twice; name each plugin "
                             f"once, with all its options, e.g. {name}(bins=0)")
        out.append((name, kwargs))
    if not out:
        raise UsageError(f"--plugins {text!r}: expected plugin names separated by commas, e.g. stats,flops")
    return out


class _Created:
    """What ``profile`` creates before its run (report folders, the TensorBoard folder and
    events file), so that a run that fails (a bad model, a selector that matches nothing)
    removes it again and leaves nothing behind: only what this run created, never a file or
    folder that was there before or that something else put in a folder since."""

    def __init__(self):
        self.folders: List[Path] = []  # outermost first
        self.files: List[Path] = []
        self.writer: Any = None        # closed before its events file is removed

    def mkdir(self, path: Path) -> None:
        """``path.mkdir(parents=True, exist_ok=True)``, noting the folders it creates."""
        missing = []
        while not os.path.lexists(path) and path != path.parent:
            missing.append(path)
            path = path.parent
        try:
            if missing:
                missing[0].mkdir(parents=True, exist_ok=True)
        finally:
            self.folders += [p for p in reversed(missing) if p.is_dir()]

    def undo(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for path in self.files:
            with contextlib.suppress(OSError):
                path.unlink()
        for path in reversed(self.folders):  # a folder holding something else stays
            with contextlib.suppress(OSError):
                path.rmdir()


def _output_dir(option: str, value: str) -> None:
    """Check early that ``value`` can be a folder (one that does not exist yet is created by
    the caller, who turns its OSError into a UsageError)."""
    if not value.strip():
        raise UsageError(f"{option}: expected a folder name, got {value!r}")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {value}: is a file, expected a folder")


def _output_path(option: str, value: Optional[str], created: _Created) -> Optional[Path]:
    """Check early that a report can be written where asked (parent folders are created, and
    noted in ``created``)."""
    if value is None or value == "-":
        return None
    if not value.strip():
        raise UsageError(f"{option}: expected a file name or '-', got {value!r}")
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{option} {value}: is a directory, expected a file name")
    try:
        created.mkdir(path.parent)
    except OSError as exc:
        raise UsageError(f"{option} {value}: cannot create folder {str(path.parent)!r}: {exc.strerror}") from None
    existed = path.exists()
    try:  # open it now, so a path that cannot be written fails before the run, not after
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {value}: cannot write the file: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()
    return path


# -- models --------------------------------------------------------------------------------

@dataclass
class LoadedModel:
    """A model built from a MODEL spec, with what the CLI knows about its input."""

    model: nn.Module
    spec: str
    label: str                                   # "cnn", "torchvision.models:resnet18", ...
    example_shape: Optional[Tuple[int, ...]] = None
    example_dtype: Optional[torch.dtype] = None


def _split_call(spec: str) -> Tuple[str, Optional[str]]:
    """``"mod:fn(a=1)"`` -> ``("mod:fn", "a=1")``; no parentheses -> ``(spec, None)``."""
    if not spec.endswith(")"):
        return spec, None
    head_start = spec.rfind(":") + 1
    open_at = spec.find("(", head_start)
    if open_at < 0:
        return spec, None
    return spec[:open_at], spec[open_at + 1 : -1]


def _parse_call_args(spec: str, argstr: Optional[str], what: str = "model") -> Tuple[list, dict]:
    if argstr is None or not argstr.strip():
        return [], {}
    try:
        call = ast.parse(f"f({argstr})", mode="eval").body
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        if len(kwargs) != len(call.keywords):
            raise ValueError("**kwargs")
    except (SyntaxError, ValueError) as exc:
        example = "stats(bins=0, sites=('output',))" if what == "--plugins" else \
            "cnn(width=32) or torchvision.models:resnet18(num_classes=10)"
        raise UsageError(
            f"{what} {spec!r}: cannot read the arguments ({exc.__class__.__name__}); "
            f"use Python literals, e.g. {example}"
        ) from None
    return args, kwargs


def _import_module_or_file(spec: str, target: str) -> Any:
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise UsageError(f"model {spec!r}: no such file {target!r}")
        mod_name = "_hookplug_user_" + re.sub(r"\W", "_", path.stem)
        module_spec = importlib.util.spec_from_file_location(mod_name, str(path.resolve()))
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"model {spec!r}: cannot import {target!r} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))  # so the file's own local imports work
        argv, sys.argv = sys.argv, [str(path)]  # as `python file.py` (an argparse at the top)
        try:
            module_spec.loader.exec_module(module)
        except SystemExit as exc:
            sys.modules.pop(mod_name, None)
            raise UsageError(f"model {spec!r}: running {target!r} called sys.exit({exc.code!r}); "
                             "put its script part under `if __name__ == \"__main__\":`") from None
        except Exception as exc:  # noqa: BLE001 - the user's file: report, don't trace back
            sys.modules.pop(mod_name, None)
            raise UsageError(f"model {spec!r}: running {target!r} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.argv = argv
        return module
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", target):
        raise UsageError(f"model {spec!r}: {target!r} is neither a module path (package.module) nor a .py file")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules in the current folder import
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise UsageError(
                f"model {spec!r}: cannot import module {target!r} (no module named {exc.name!r})"
            ) from None
        raise UsageError(f"model {spec!r}: importing {target!r} failed: {exc}") from exc
    except SystemExit as exc:
        raise UsageError(f"model {spec!r}: importing {target!r} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"model {spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}") from exc


def _unknown_model(spec: str) -> UsageError:
    close = close_matches(spec, DEMO_MODELS)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return UsageError(
        f"unknown model {spec!r}: expected a built-in demo ({', '.join(DEMO_MODELS)}), "
        f"'package.module:factory' or 'path/to/file.py:factory'.{hint}"
    )


def load_model(spec: str) -> LoadedModel:
    """Build the model named by ``spec``: a built-in demo name, ``package.module:factory`` or
    ``path/to/file.py:factory``, optionally with literal arguments: ``cnn(width=32)``."""
    spec = spec.strip()
    target, argstr = _split_call(spec)
    args, kwargs = _parse_call_args(spec, argstr)
    if ":" not in target:
        if target not in DEMO_MODELS:
            raise _unknown_model(spec)
        factory, shape, dtype = DEMO_MODELS[target]
        label, obj = target, factory
    else:
        mod_part, attr = target.rsplit(":", 1)
        if not mod_part or not attr:
            raise UsageError(f"model {spec!r}: expected 'package.module:factory' or 'path/to/file.py:factory'")
        module = _import_module_or_file(spec, mod_part)
        obj = module
        for piece in attr.split("."):
            if not hasattr(obj, piece):
                public = [n for n in dir(obj) if not n.startswith("_")]
                close = close_matches(piece, public)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise UsageError(f"model {spec!r}: {mod_part!r} has no attribute {attr!r}{hint}")
            obj = getattr(obj, piece)
        label, shape, dtype = target, None, None
    if isinstance(obj, nn.Module):
        if argstr is not None:
            raise UsageError(f"model {spec!r}: {label!r} is already a model instance; it takes no arguments")
        model = obj
    elif callable(obj):
        try:
            model = obj(*args, **kwargs)
        except SystemExit as exc:
            raise UsageError(f"model {spec!r}: the factory called sys.exit({exc.code!r})") from None
        except Exception as exc:  # noqa: BLE001 - the user's factory: report, don't trace back
            raise UsageError(f"model {spec!r}: calling the factory failed: {type(exc).__name__}: {exc}") from exc
    else:
        raise UsageError(
            f"model {spec!r}: {label!r} is a {type(obj).__name__}, not a factory or a torch.nn.Module"
        )
    if not isinstance(model, nn.Module):
        raise UsageError(f"model {spec!r}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return LoadedModel(model, spec, label, shape, dtype)


def _first_leaf(model: nn.Module) -> Optional[nn.Module]:
    for _, mod in model.named_modules():
        if next(mod.children(), None) is None and next(mod.parameters(recurse=False), None) is not None:
            return mod
    return None


def _guess_dtype(model: nn.Module) -> torch.dtype:
    """Integer tokens when the model starts with an embedding, float32 otherwise."""
    return torch.int64 if isinstance(_first_leaf(model), nn.Embedding) else torch.float32


def _vocab_size(model: nn.Module) -> int:
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            return int(mod.num_embeddings)
    return 100


# -- inputs --------------------------------------------------------------------------------

def _read_input_file(path_text: str) -> Dict[str, torch.Tensor]:
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--input-file {path_text}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise UsageError("--input-file: reading .safetensors needs the safetensors package "
                                 "(pip install safetensors)") from None
            tensors = load_file(str(path))
        elif suffix in (".pt", ".pth"):
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
            if isinstance(obj, torch.Tensor):
                tensors = {"input": obj}
            elif isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
                tensors = {str(k): v for k, v in obj.items()}
            elif isinstance(obj, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in obj):
                tensors = {str(i): v for i, v in enumerate(obj)}
            else:
                raise UsageError(f"--input-file {path_text}: expected a tensor, or a dict or list of tensors")
        else:
            raise UsageError(f"--input-file {path_text}: expected a .safetensors (or .pt) file")
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file
        raise UsageError(f"--input-file {path_text}: cannot read it: {type(exc).__name__}: {exc}") from None
    if not tensors:
        raise UsageError(f"--input-file {path_text}: the file holds no tensors")
    return tensors


def _file_call(tensors: Dict[str, torch.Tensor]) -> Tuple[tuple, dict]:
    """One tensor: ``model(t)``; keys ``0, 1, ...``: positional; other keys: keyword arguments."""
    if len(tensors) == 1:
        return (next(iter(tensors.values())),), {}
    if all(k.isdigit() for k in tensors):
        return tuple(tensors[k] for k in sorted(tensors, key=int)), {}
    return (), dict(tensors)


def _describe_inputs(args: tuple, kwargs: dict) -> str:
    parts = ["x".join(map(str, t.shape)) + f" {str(t.dtype).replace('torch.', '')}" for t in args]
    parts += [f"{k}={'x'.join(map(str, t.shape))} {str(t.dtype).replace('torch.', '')}" for k, t in kwargs.items()]
    return ", ".join(parts)


# -- what profile attaches besides the user's plugins ----------------------------------------

class RunRecords:
    """A sink that keeps every telemetry record of the run."""

    name = "_cli_records"

    def __init__(self):
        self.records: List[dict] = []

    @hookimpl
    def hookplug_flush(self, records):
        self.records.extend(records)


class ShapeRecorder:
    """Observe-only: the shape and dtype of every output tensor of the selected modules
    (last call) and how many times each module ran in the first step."""

    name = "_cli_shapes"

    def __init__(self):
        self.shapes: Dict[str, Dict[str, List[int]]] = {}
        self.dtypes: Dict[str, Dict[str, str]] = {}
        self.calls: Dict[str, int] = {}

    @hookimpl
    def hookplug_forward_output(self, ctx, output):
        if ctx.step == 0:
            self.calls[ctx.name] = self.calls.get(ctx.name, 0) + 1
        tensors = list(iter_tensors(output))
        self.shapes[ctx.name] = {p: list(t.shape) for p, t in tensors}
        self.dtypes[ctx.name] = {p: str(t.dtype).replace("torch.", "") for p, t in tensors}

    @hookimpl
    def hookplug_report_section(self):
        return {"outputs": {n: {"calls": self.calls.get(n, 0),
                                "outputs": {p: {"shape": s, "dtype": self.dtypes[n][p]} for p, s in shapes.items()}}
                            for n, shapes in self.shapes.items()}}


# -- output helpers -------------------------------------------------------------------------

def _use_rich(args) -> bool:
    if getattr(args, "plain", False) or os.environ.get("HOOKPLUG_PLAIN", "") not in ("", "0"):
        return False
    return importlib.util.find_spec("rich") is not None


def _silence_stdout() -> None:
    """Point stdout's file descriptor at os.devnull, so that what is left in its buffer
    goes nowhere at exit instead of failing again there ("Exception ignored ...")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture): no exit flush to fail
        pass


def _print_stdout(emit: Callable[[], Any]) -> Optional[str]:
    """Run ``emit`` (it prints to stdout) and flush stdout; returns None, or the error line
    for a stdout that cannot be written (a full disk, ENOSPC). A stdout closed early
    (``| head``, a broken pipe) is no error: None too, as the reader has what it wanted."""
    try:
        emit()
        sys.stdout.flush()
    except OSError as exc:
        _silence_stdout()
        if isinstance(exc, BrokenPipeError):
            return None
        return f"cannot write to stdout: {exc.strerror or exc}"
    return None


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _loss_of(output) -> torch.Tensor:
    terms = [t.float().mean() for _, t in iter_tensors(output) if t.requires_grad and t.is_floating_point()]
    if not terms:
        raise UsageError("--backward: no output of the model requires grad (nothing to differentiate)")
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


@contextlib.contextmanager
def _progress(total: int, enabled: bool, use_rich: bool):
    """Yields ``advance()``; a rich progress bar on stderr (or a plain counter on a terminal)."""
    if not enabled or total <= 1:
        yield lambda: None
        return
    if use_rich:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("steps", total=total)
            yield lambda: progress.advance(task)
        return
    tty = sys.stderr.isatty()
    done = [0]

    def advance():
        done[0] += 1
        if tty:
            sys.stderr.write(f"\rprofiling: step {done[0]}/{total}")
            sys.stderr.flush()

    try:
        yield advance
    finally:
        if tty:
            sys.stderr.write("\r" + " " * 40 + "\r")
            sys.stderr.flush()


# -- commands -----------------------------------------------------------------------------

def _doc_summary(doc: Optional[str]) -> str:
    """A plugin's docstring as one line of plain text: its first paragraph, Sphinx roles
    (``:class:`~a.B``` -> ``B``) and literals unmarked, pointers to the module docstring
    dropped."""
    import inspect

    text = " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())

    def role(match):
        target = match.group(1).strip()
        return target.rsplit(".", 1)[-1] if target.startswith("~") else target

    text = re.sub(r":[\w:.+-]+:`([^`<]*?)(?:\s*<[^>]*>)?`", role, text).replace("``", "")
    text = re.sub(r"\s*\(see the module docstring[^)]*\)", "", text, flags=re.IGNORECASE)
    return re.sub(r"\s*See the module docstring\b.*$", "", text).strip()


def cmd_plugins(args) -> int:
    rows = []
    for src in plugin_info():
        # (what a plugin's module prints as it imports goes to stderr: stdout is the listing)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            factory = src.load()
        status = "ok" if factory is not None and src.error is None else f"failed: {src.error}"
        if status == "ok" and isinstance(factory, type) and not is_plugin_class(factory):
            status = (f"failed: it names the class {factory.__name__}, which has no "
                      "@hookplug.hookimpl method (not a plugin)")
        doc = factory.__dict__.get("__doc__") if isinstance(factory, type) else getattr(factory, "__doc__", None)
        if not doc and factory is not None:  # (a class without a docstring: its module's)
            doc = getattr(sys.modules.get(getattr(factory, "__module__", None) or ""), "__doc__", None)
        rows.append({
            "name": src.name,
            "origin": src.origin,
            "status": status,
            "entry_point": getattr(src.entry_point, "value", ""),
            "description": _doc_summary(doc),
        })
    if args.json:
        import json

        error = _print_stdout(lambda: print(json.dumps(rows, indent=2)))
    else:
        error = _print_stdout(lambda: _report.print_plugins(rows, use_rich=_use_rich(args)))
    if error:
        raise UsageError(error)
    return 0


def cmd_select(args) -> int:
    loaded = load_model(args.model)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            matched = select(loaded.model, args.selector)
    except SelectorError as exc:
        raise UsageError(_selector_message(exc)) from None
    if matched:  # a term matching nothing, containers no forward calls: said before the list
        for w in seen:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    else:  # (the error below says it)
        raise UsageError(f"selector {args.selector!r} matched no module of {type(loaded.model).__name__}; "
                         f"try {_select_all(args.model)} to see its modules (\"*:\" is the root)")
    if args.names:
        error = _print_stdout(lambda: print("\n".join(name for name, _ in matched)))
    else:
        error = _print_stdout(lambda: _report.print_selection(
            loaded.model, loaded.label, args.selector, [n for n, _ in matched], use_rich=_use_rich(args)))
    if error:
        raise UsageError(error)
    return 0


def _tensorboard_writer(logdir: str, created: _Created):
    """A ``SummaryWriter`` for the ``tensorboard`` sink (``writer=``), made now so that a
    missing package or an unwritable folder is a usage error before the model runs; the
    folder (if new), the events file and the writer are noted in ``created``."""
    _output_dir("--tensorboard", logdir)
    try:
        import tensorboard  # noqa: F401 - torch's SummaryWriter needs it and says so less clearly
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'hookplug[tensorboard]' "
                         "(or pip install tensorboard)") from None
    folder = Path(logdir)
    try:
        created.mkdir(folder)
        before = set(folder.iterdir())
        created.writer = SummaryWriter(log_dir=logdir)
    except OSError as exc:
        raise UsageError(f"--tensorboard {logdir}: cannot create or write the folder: {exc.strerror or exc}") from None
    created.files += [p for p in folder.iterdir() if p not in before]  # its events file
    return created.writer


def _show(recorded) -> None:
    """Show warnings recorded (under the filters in force) as they would have been."""
    for w in recorded:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _select_all(model_spec: str) -> str:
    """The command listing every module of the model, quoted for a shell."""
    return f"`{PROG} select {shlex.quote(model_spec)} \"*, *:\"`"


def _selector_message(exc: SelectorError, model_spec: Optional[str] = None) -> str:
    if "matched no module" in exc.reason:
        hint = (f"; try {_select_all(model_spec)} to see its modules (\"*:\" is the root)"
                if model_spec else "")
        return f"{exc.reason}{hint}"
    return f"bad selector {exc.selector!r} (column {exc.column + 1}): {exc.reason}"


def cmd_profile(args) -> int:
    created = _Created()
    try:
        doc, json_path, html_path = _run_profile(args, created)
    except Exception:  # a failed run leaves nothing behind (a Ctrl-C keeps its steps' TensorBoard events)
        created.undo()
        raise
    status = _write_reports(args, doc, json_path, html_path)
    failed = getattr(args, "failed_plugins", None)
    if failed and status == 0:  # a plugin switched off in the run (warned): not a clean run
        print(f"{PROG}: error: plugin(s) {', '.join(map(repr, failed))} failed during the run "
              "(see the warnings above)", file=sys.stderr)
        return 1
    return status


def _run_profile(args, created: _Created) -> Tuple[Dict[str, Any], Optional[Path], Optional[Path]]:
    """Check the arguments, run the model and build the run document; returns it with the
    paths of the reports asked for (what it creates on the way is noted in ``created``)."""
    plugin_options = _parse_plugins(args.plugins)
    plugin_names = [n for n, _ in plugin_options]
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: expected a number >= 1")
    if not -(2**63) <= args.seed < 2**64:  # what torch.manual_seed takes
        raise UsageError(f"--seed {args.seed}: expected an integer that fits in 64 bits")
    shape = parse_shape(args.input) if args.input is not None else None
    dtype = _parse_dtype(args.dtype) if args.dtype is not None else None
    device = _parse_device(args.device)
    json_path = _output_path("--json", args.json, created)
    html_path = _output_path("--html", args.html, created)
    if args.json == args.html == "-" or (
            json_path is not None and html_path is not None and json_path.resolve() == html_path.resolve()):
        raise UsageError(f"--json and --html name the same file {args.json!r}; give each its own")
    tb_writer = _tensorboard_writer(args.tensorboard, created) if args.tensorboard is not None else None
    file_tensors = _read_input_file(args.input_file) if args.input_file else None

    torch.manual_seed(args.seed)
    loaded = load_model(args.model)
    model = loaded.model
    if file_tensors is None:
        shape = shape or loaded.example_shape
        if shape is None:
            raise UsageError(
                f"model {args.model!r}: --input SHAPE is required for a model that is not a built-in demo "
                "(e.g. --input 1x3x224x224), or give --input-file"
            )
        dtype = dtype or loaded.example_dtype or _guess_dtype(model)
    if dtype is not None and dtype.is_floating_point and dtype != torch.float32:
        model.to(dtype)
    model.to(device)
    model.train(args.backward)

    gen = torch.Generator().manual_seed(args.seed)
    vocab = _vocab_size(model)

    def make_inputs() -> Tuple[tuple, dict]:
        if file_tensors is not None:
            call_args, call_kwargs = _file_call(file_tensors)
            if dtype is not None:
                call_args = tuple(t.to(dtype) if t.is_floating_point() else t for t in call_args)
                call_kwargs = {k: t.to(dtype) if t.is_floating_point() else t for k, t in call_kwargs.items()}
        else:
            try:
                if dtype.is_floating_point:
                    x = torch.randn(shape, generator=gen).to(dtype)
                else:
                    x = torch.randint(0, vocab, shape, generator=gen, dtype=dtype)
            except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UsageError(f"--input {args.input}: cannot create the input: {msg}") from None
            call_args, call_kwargs = (x,), {}
        return (tuple(t.to(device) for t in call_args), {k: t.to(device) for k, t in call_kwargs.items()})

    plugin_specs: List[Any] = []
    for name, options in plugin_options:
        if name == "stats" and args.backward and "sites" not in options:
            options = {**options, "sites": ("output", "grad")}
        plugin_specs.append((name, options))
    recorder, run_records = ShapeRecorder(), RunRecords()
    plugin_specs.append(recorder)
    sinks = [run_records] + ([("tensorboard", {"writer": tb_writer})] if tb_writer is not None else [])
    try:
        # one process, never a rank of a job: a RANK left in the environment (a torchrun
        # worker's) must not turn its sinks off as on a rank other than 0
        # (recorded as the filters in force let them through, shown below)
        with warnings.catch_warnings(record=True) as attach_warnings:
            session = hookplug.attach(model, args.select, plugins=plugin_specs, sink=sinks, flush_every=1,
                                      on_error="warn", strict=True, distributed=False)
    except SelectorError as exc:
        _show(attach_warnings)
        raise UsageError(_selector_message(exc, args.model)) from None
    except (PluginError, TypeError, ValueError) as exc:  # unknown plugin, bad options
        _show(attach_warnings)
        raise UsageError(str(exc).splitlines()[0]) from None
    except BaseException:
        _show(attach_warnings)
        raise
    # a plugin asked for that could not be made or started (gradclamp with nothing to do, a
    # sink whose folder is a file) is an error of the command, not a warning of the run
    lost = [n for n in plugin_names if n not in session.plugins or n in session.disabled]
    said = [w for w in attach_warnings if lost and f"plugin {lost[0]!r}" in str(w.message)]
    _show([w for w in attach_warnings if w not in said])
    if lost:
        session.remove()
        raise UsageError(session.disabled.get(lost[0]) and f"plugin {lost[0]!r}: {session.disabled[lost[0]]}"
                         or (str(said[0].message).split("; attached without it")[0] if said
                             else f"plugin {lost[0]!r} could not be attached"))

    step_times: List[float] = []
    input_desc = ""
    try:
        with _progress(args.steps, not args.no_progress, _use_rich(args)) as advance:
            for _ in range(args.steps):
                call_args, call_kwargs = make_inputs()
                input_desc = input_desc or _describe_inputs(call_args, call_kwargs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                try:
                    if args.backward:
                        model.zero_grad(set_to_none=True)
                        output = model(*call_args, **call_kwargs)
                        _loss_of(output).backward()
                    else:
                        with torch.no_grad():
                            output = model(*call_args, **call_kwargs)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except UsageError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a shape the model does not take, mostly
                    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise UsageError(
                        f"model {args.model!r} failed on input {input_desc}: {type(exc).__name__}: {msg}"
                    ) from exc
                step_times.append(time.perf_counter() - t0)
                session.step()
                advance()
        session.flush()
        doc = _report.build_document(session, run_records.records, hidden=(recorder.name,), meta={
            "model": {"spec": args.model, "label": loaded.label, "class": type(model).__name__,
                      "params": _param_count(model), "modules": sum(1 for _ in model.modules())},
            "input": {"description": input_desc, "shape": list(shape) if shape else None,
                      "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                      "source": args.input_file or "random"},
            "selector": args.select, "plugins": plugin_names, "device": str(device), "seed": args.seed,
            "steps": args.steps, "backward": bool(args.backward), "step_seconds": step_times})
    finally:
        session.remove()
        # (in the run, at its end or in its report: status 1)
        args.failed_plugins = {**session.section_failures, **session.disabled}
        if tb_writer is not None:
            tb_writer.close()

    return doc, json_path, html_path


def _write_reports(args, doc: Dict[str, Any], json_path: Optional[Path], html_path: Optional[Path]) -> int:
    """The table (or ``--json -``) on stdout, then each report file: one that cannot be
    written (a full disk) does not keep the others from being written; the failures are
    one error line at the end (exit status 2)."""
    if args.json == "-":
        error = _print_stdout(lambda: sys.stdout.write(_report.to_json(doc) + "\n"))
    else:
        error = _print_stdout(lambda: _report.print_profile(doc, use_rich=_use_rich(args)))
    errors = [error] if error else []
    for path, text, what in ((json_path, lambda: _report.to_json(doc), "JSON"),
                             (html_path, lambda: _html.render_html(doc), "HTML")):
        if path is None:
            continue
        try:
            path.write_text(text(), encoding="utf-8")
        except OSError as exc:
            errors.append(f"cannot write {what} report {str(path)!r}: {exc.strerror or exc}")
            continue
        print(f"{PROG}: wrote {path}", file=sys.stderr)
    if args.tensorboard is not None:
        print(f"{PROG}: wrote TensorBoard events to {args.tensorboard}", file=sys.stderr)
    if errors:
        raise UsageError("; ".join(errors))
    return 0


# -- the parser ------------------------------------------------------------------------------

_MODEL_NOTE = """\
MODEL is a built-in demo ({demos}), 'package.module:factory' (e.g.
torchvision.models:resnet18) or 'path/to/file.py:factory'; literal arguments may follow:
'cnn(width=32)'. A file.py:factory RUNS THAT FILE'S CODE (it is imported like 'python
file.py' would run it, its folder first on sys.path) and package.module:factory imports
that module: give only code you trust.""".format(demos=", ".join(DEMO_MODELS))

_PROFILE_EPILOG = f"""\
{_MODEL_NOTE} --input is optional for the built-in demos.

examples:
  hookplug profile cnn
  hookplug profile resnet34 --select 'Conv2d:layer1.*' --backward --steps 5 --html report.html
  hookplug profile torchvision.models:resnet18 --input 1x3x224x224 --json resnet18.json
"""


def _model_command(sub, common, name: str, help: str, description: str, epilog: str):  # noqa: A002
    """A subcommand that takes a MODEL argument first."""
    p = sub.add_parser(name, parents=[common], help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="built-in demo name, package.module:factory or file.py:factory "
                        "(runs that file's code)")
    return p


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--plain", action="store_true",
                        help="plain-text output even when rich is installed (or set HOOKPLUG_PLAIN=1)")

    parser = _ArgumentParser(
        prog=PROG,
        description="Attach plugins (stats, FLOPs, capture, ...) to any PyTorch model through a selector.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {hookplug.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", parents=[common], help="list the available plugins and where they come from",
                       description="List the available plugins: name, origin (first-party or the "
                                   "distribution that provides it) and whether it loads.")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_plugins)

    p = _model_command(sub, common, "select", help="show the modules a selector matches (a dry run)",
                       description="Show the modules SELECTOR matches in MODEL as a tree, with class "
                                   "names and parameter counts. The model is built but not run. A "
                                   "selector that matches nothing is an error (exit status 2).",
                       epilog=_MODEL_NOTE)
    p.add_argument("selector", metavar="SELECTOR",
                   help="e.g. 'Conv2d', 'Conv2d|Linear:layer1.*', '*:re:.*\\.fc\\d'")
    p.add_argument("--names", action="store_true", help="print only the matched names, one per line")
    p.set_defaults(func=cmd_select)

    p = _model_command(sub, common, "profile", help="run a model with plugins attached and report per module",
                       description="Run MODEL on a random input (or --input-file) with plugins attached to\n"
                                   "the modules --select picks, and print a per-module table: output shape,\n"
                                   "parameters, FLOPs, min/max/mean/std, NaN/Inf counts, and totals.",
                       epilog=_PROFILE_EPILOG)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", metavar="SHAPE", help="random input of this shape, e.g. 8x3x64x64")
    src.add_argument("--input-file", metavar="FILE",
                     help="input tensors from a .safetensors file (one tensor: positional; several: keywords)")
    p.add_argument("--dtype", metavar="DTYPE",
                   help="input dtype (float32, bfloat16, int64, ...); default: the demo's, else int64 tokens "
                        "for a model that starts with an Embedding, else float32")
    p.add_argument("--select", default=DEFAULT_SELECTOR, metavar="SELECTOR",
                   help=f"modules to attach to (default: {DEFAULT_SELECTOR!r})")
    p.add_argument("--plugins", default=DEFAULT_PLUGINS, metavar="NAMES",
                   help=f"comma-separated plugin names, each with optional options: "
                        f"'stats(bins=0),gradclamp(max_norm=1.0)' (default: {DEFAULT_PLUGINS}); "
                        "see 'hookplug plugins'")
    p.add_argument("--backward", action="store_true",
                   help="also run backward on the mean of the output (model in train mode)")
    p.add_argument("--steps", type=int, default=1, metavar="N", help="number of steps (default: 1)")
    p.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu (default), cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the random input (default: 0)")
    p.add_argument("--json", metavar="FILE", help="write the full results as JSON ('-': to stdout, no table)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--tensorboard", metavar="DIR", help="write scalars and histograms per step for TensorBoard")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)
    return parser


# -- entry point --------------------------------------------------------------------------

def _show_warning(message, category, filename, lineno, file=None, line=None):
    text = str(message).strip().replace("\n", " ")
    print(f"{PROG}: warning: {text}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``hookplug`` with ``argv``; return the exit status (2 for a user error)."""
    for stream in (sys.stdout, sys.stderr):  # never die of an unencodable character
        try:
            stream.reconfigure(errors="replace")
        except (AttributeError, ValueError):
            pass
    parser = build_parser()
    debug = os.environ.get("HOOKPLUG_DEBUG", "") not in ("", "0")
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
            if not getattr(args, "func", None):
                parser.print_help(sys.stderr)
                return EXIT_USAGE
            return int(args.func(args) or 0)
        except UsageError as exc:
            if debug:
                raise
            text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            print(f"{PROG}: error: {text}", file=sys.stderr)
            return EXIT_USAGE
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `hookplug profile ... | head`
            _silence_stdout()
            return 0
