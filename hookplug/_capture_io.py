"""Reading and writing captures (the ``capture`` plugin) as safetensors files — never pickle.

The file holds one tensor per captured leaf, keyed ``"<module>/<path>"`` (``keep="last"``) or
``"<module>/<i>/<path>"`` (call ``i`` of a ``keep="all"|N`` list), where ``path`` is
``output…``, ``grad…``, ``input…`` or ``kwargs…`` (keyword arguments); and, under the metadata key ``"hookplug.capture"``, a
JSON description of every structure (tuples, lists, dicts; dataclasses and ``ModelOutput``\\ s
are written as dicts) from which :func:`load_capture` rebuilds the dicts of the plugin.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, List, Optional, Union

import torch

from ._optional import optional_import
from .structures import children

__all__ = ["load_capture", "save_capture"]

META_KEY = "hookplug.capture"
# 2: complex dtypes safetensors lacks, stored as real views (see _AS_REAL); 3: tuple dict keys
FORMAT_VERSION = 3
# safetensors has no complex32/complex128: those are written as their ``view_as_real``
# (float16/float64, a trailing dimension of 2) and the entry says ``"complex": true``
_AS_REAL = (torch.complex32, torch.complex128)
_WHAT = ("features", "grads", "inputs", "input_kwargs")
_PREFIX = {"features": "output", "grads": "grad", "inputs": "input", "input_kwargs": "kwargs"}


def _require_safetensors():
    (st,) = optional_import("safetensors.torch", feature="hookplug capture files",
                            extra="capture", package="safetensors")
    return st


def _plain_tuple(k: Any) -> bool:
    return isinstance(k, tuple) and all(
        isinstance(i, (str, int, float, bool)) or i is None or _plain_tuple(i) for i in k)


def _json_key(k: Any):
    """A dict key as JSON: strings, numbers, booleans and null as they are; a tuple of them
    (``{("a", 0): t}``) as ``{"tuple": [...]}``, read back a tuple; anything else as its repr."""
    if isinstance(k, (str, int, float, bool)) or k is None:
        return k
    if _plain_tuple(k):
        return {"tuple": [_json_key(i) for i in k]}
    return repr(k)


def _has_tuple_key(desc: Any) -> bool:
    """Whether an encoded layout holds a tuple dict key (format version 3)."""
    if isinstance(desc, dict):
        if "dict" in desc and isinstance(desc["dict"], list):
            if any(isinstance(p[0], dict) for p in desc["dict"]):
                return True
            return any(_has_tuple_key(p[1]) for p in desc["dict"])
        return any(_has_tuple_key(v) for v in desc.values())
    if isinstance(desc, list):
        return any(_has_tuple_key(v) for v in desc)
    return False


def _read_key(k: Any, where: str) -> Any:
    if isinstance(k, (str, int, float, bool)) or k is None:
        return k
    if isinstance(k, dict) and set(k) == {"tuple"} and isinstance(k["tuple"], list):
        return tuple(_read_key(i, where) for i in k["tuple"])
    raise _BadFile(f"{where}: a key must be a string, a number or {{\"tuple\": [...]}}, got {_short(k)}")


def _encode(obj: Any, key: str, tensors: Dict[str, torch.Tensor], dropped: Optional[List[str]] = None) -> Any:
    """A JSON-able description of ``obj``; its tensors go into ``tensors``, keyed from ``key``."""
    if isinstance(obj, torch.Tensor):
        # should two paths ever read alike, the later one gets a key of its own, else it
        # would overwrite the first in the file
        unique, n = key, 1
        while unique in tensors:
            unique, n = f"{key}#{n}", n + 1
        tensors[unique] = obj
        return {"t": unique, "complex": True} if obj.dtype in _AS_REAL else {"t": unique}
    if obj is None:
        return None
    kids = children(obj, key)
    if kids is not None:
        enc = [(k, _encode(v, sub, tensors, dropped)) for k, sub, v in kids]
        if isinstance(obj, (list, tuple)):
            return {"list" if isinstance(obj, list) else "tuple": [e for _, e in enc]}
        return {"dict": [[_json_key(k), e] for k, e in enc]}
    if isinstance(obj, (str, int, float, bool)):
        return {"value": obj}
    if dropped is not None:
        dropped.append(f"{key} ({type(obj).__name__})")
    return {"value": None, "repr": repr(obj)[:200]}


_MAX_DEPTH = 200  # structures nested deeper are refused when reading


class _BadFile(Exception):
    """What is wrong with a capture file's metadata (becomes one ValueError naming the file)."""


def _decode(desc: Any, tensors: Dict[str, torch.Tensor], where: str, depth: int = 0) -> Any:
    """Rebuild one structure from its JSON description, checking every entry."""
    if depth > _MAX_DEPTH:
        raise _BadFile(f"{where}: structures nested more than {_MAX_DEPTH} deep")
    if desc is None:
        return None
    if not isinstance(desc, dict) or len(desc) not in (1, 2):
        raise _BadFile(f"{where}: expected an entry such as {{\"t\": key}}, got {_short(desc)}")
    if "t" in desc:
        key = desc["t"]
        if not isinstance(key, str) or key not in tensors:
            raise _BadFile(f"{where}: names tensor {_short(key)}, which the file does not hold")
        if len(desc) == 1:
            return tensors[key]
        t = tensors[key]
        if desc.get("complex") is not True or t.dtype not in (torch.float16, torch.float64) \
                or t.dim() == 0 or t.shape[-1] != 2:
            raise _BadFile(f"{where}: expected {{\"t\": key}} or {{\"t\": key, \"complex\": true}} naming "
                           f"a float16/float64 tensor whose last dimension is 2, got {_short(desc)} "
                           f"({t.dtype}, shape {tuple(t.shape)})")
        return torch.view_as_complex(t.contiguous())
    if "dict" in desc:
        items = desc["dict"]
        if not isinstance(items, list):
            raise _BadFile(f"{where}: \"dict\" must be a list of [key, value] pairs, got {_short(items)}")
        out = {}
        for i, pair in enumerate(items):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise _BadFile(f"{where}.dict[{i}]: expected a [key, value] pair, got {_short(pair)}")
            k, v = pair
            k = _read_key(k, f"{where}.dict[{i}]")
            out[k] = _decode(v, tensors, f"{where}.{k}", depth + 1)
        return out
    for kind, build in (("list", list), ("tuple", tuple)):
        if kind in desc:
            items = desc[kind]
            if not isinstance(items, list):
                raise _BadFile(f"{where}: \"{kind}\" must be a list, got {_short(items)}")
            return build(_decode(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(items))
    if "value" in desc:
        value = desc["value"]
        if not (isinstance(value, (str, int, float, bool)) or value is None):
            raise _BadFile(f"{where}: \"value\" must be a string, number, boolean or null, got "
                           f"{_short(value)}")
        return value
    raise _BadFile(f"{where}: unknown structure entry {_short(desc)}")


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)[:80] if isinstance(value, (dict, list)) else repr(value)
    except (RecursionError, TypeError, ValueError):
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def save_capture(
    path: Union[str, os.PathLike], stores: Dict[str, Dict[str, Any]], *, keep: Any = "last"
) -> None:
    """Write ``{"features"|"grads"|"inputs"|"input_kwargs": {module: value or [values]}}`` to ``path``."""
    st = _require_safetensors()
    tensors: Dict[str, torch.Tensor] = {}
    dropped: List[str] = []
    layout: Dict[str, Dict[str, Any]] = {}
    for what, store in stores.items():
        if what not in _WHAT:
            raise ValueError(f"save_capture: unknown kind {what!r}; expected one of {_WHAT}")
        prefix = _PREFIX[what]
        layout[what] = {}
        for name, value in store.items():
            if keep != "last":  # a list of calls (with keep="last", a list is one call's output)
                layout[what][name] = {
                    "list": [
                        _encode(v, f"{name}/{i}/{prefix}", tensors, dropped) for i, v in enumerate(value)
                    ]
                }
            else:
                layout[what][name] = {"one": _encode(value, f"{name}/{prefix}", tensors, dropped)}
    if dropped:
        shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
        warnings.warn(f"save_capture({os.fspath(path)!r}): {len(dropped)} value(s) that are neither "
                      f"tensors, containers nor plain numbers/strings are written as None: {shown}",
                      RuntimeWarning, stacklevel=3)
    out: Dict[str, torch.Tensor] = {}
    seen_storage = set()
    for k, t in tensors.items():
        # a lazy conj/neg view (clone=False) has its bit resolved: safetensors writes the storage
        t = t.detach().to("cpu").resolve_conj().resolve_neg()
        if t.dtype in _AS_REAL:
            t = torch.view_as_real(t)
        if not t.is_contiguous():
            t = t.contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.device.type)
        if t.numel() and ptr in seen_storage:  # safetensors refuses shared storage
            t = t.clone()
        elif t.numel():
            seen_storage.add(ptr)
        out[k] = t
    meta = {
        "format": "hookplug.capture",
        # the oldest version that reads it: older hookplugs still read such files
        "version": 3 if _has_tuple_key(layout) else 2 if any(t.dtype in _AS_REAL for t in tensors.values()) else 1,
        "keep": keep if isinstance(keep, (str, int)) else str(keep),
        "layout": layout,
    }
    st.save_file(out, os.fspath(path), metadata={META_KEY: json.dumps(meta)})


def load_capture(
    path: Union[str, os.PathLike],
    *,
    what: str = "features",
    device: Union[str, torch.device] = "cpu",
):
    """Read a file written by ``CapturePlugin.save`` back into the plugin's dict shape.

    ``what="features"`` (default) returns ``{module: output}`` (or ``{module: [outputs]}`` for
    ``keep="all"|N``) like ``plugin.features``; ``"grads"``, ``"inputs"`` and
    ``"input_kwargs"`` likewise; ``"all"`` returns ``{"features": ..., "grads": ...,
    "inputs": ..., "input_kwargs": ...}``. Tensors are loaded
    onto ``device``. Dataclass outputs come back as dicts.
    """
    if what not in (*_WHAT, "all"):
        raise ValueError(f"load_capture: what must be one of {(*_WHAT, 'all')}, got {what!r}")
    st = _require_safetensors()
    from safetensors import safe_open

    name = os.fspath(path)
    if os.path.isdir(name):
        raise IsADirectoryError(f"load_capture: {name!r} is a directory, not a capture file")
    if not os.path.isfile(name):
        raise FileNotFoundError(f"load_capture: no such file {name!r}")
    try:
        with safe_open(name, framework="pt", device=str(device)) as f:
            meta_raw = (f.metadata() or {}).get(META_KEY)
            if meta_raw is None:
                raise ValueError(
                    f"load_capture: {name!r} is not a hookplug capture file (no {META_KEY!r} metadata)"
                )
            layout = _read_meta(meta_raw)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        result = {}
        for kind in _WHAT:
            store = {}
            for module, entry in layout.get(kind, {}).items():
                where = f"layout.{kind}.{module}"
                if not isinstance(entry, dict) or not ({"list", "one"} & set(entry)):
                    raise _BadFile(f"{where}: expected {{\"one\": ...}} or {{\"list\": [...]}}, got "
                                   f"{_short(entry)}")
                if "list" in entry:
                    if not isinstance(entry["list"], list):
                        raise _BadFile(f"{where}: \"list\" must be a list, got {_short(entry['list'])}")
                    store[module] = [_decode(d, tensors, f"{where}[{i}]") for i, d in enumerate(entry["list"])]
                else:
                    store[module] = _decode(entry["one"], tensors, where)
            result[kind] = store
    except _BadFile as exc:
        raise ValueError(f"load_capture: {name!r} has bad hookplug metadata: {exc}") from None
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors (a corrupt header)
        if type(exc).__name__ != "SafetensorError" and not isinstance(exc, (OSError, RuntimeError)):
            raise
        raise ValueError(f"load_capture: {name!r} is not a readable safetensors file: {exc}") from None
    del st
    return result if what == "all" else result[what]


def _read_meta(meta_raw: str) -> Dict[str, Any]:
    """The checked ``layout`` of the metadata JSON."""
    try:
        meta = json.loads(meta_raw)
    except (ValueError, RecursionError) as exc:
        raise _BadFile(f"the {META_KEY!r} metadata is not JSON ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise _BadFile(f"the metadata must be a JSON object, got {_short(meta)}")
    version = meta.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise _BadFile(f"version must be an integer, got {_short(version)}")
    if version > FORMAT_VERSION:
        raise _BadFile(f"format version {version}; this hookplug reads up to {FORMAT_VERSION}")
    layout = meta.get("layout")
    if not isinstance(layout, dict):
        raise _BadFile(f"layout must be an object, got {_short(layout)}")
    for kind, store in layout.items():
        if kind in _WHAT and not isinstance(store, dict):
            raise _BadFile(f"layout.{kind} must be an object, got {_short(store)}")
    return layout
