"""Reading and writing captures (the ``capture`` plugin) as safetensors files — never pickle.

The file holds one tensor per captured leaf, keyed ``"<module>/<path>"`` (``keep="last"``) or
``"<module>/<i>/<path>"`` (call ``i`` of a ``keep="all"|N`` list), where ``path`` is
``output…``, ``grad…`` or ``input…``; and, under the metadata key ``"hookplug.capture"``, a
JSON description of every structure (tuples, lists, dicts; dataclasses and ``ModelOutput``\\ s
are written as dicts) from which :func:`load_capture` rebuilds the dicts of the plugin.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Union

import torch

from ._optional import optional_import

__all__ = ["load_capture", "save_capture"]

META_KEY = "hookplug.capture"
FORMAT_VERSION = 1
_WHAT = ("features", "grads", "inputs")
_PREFIX = {"features": "output", "grads": "grad", "inputs": "input"}


def _require_safetensors():
    (st,) = optional_import("safetensors.torch", feature="hookplug capture files",
                            extra="capture", package="safetensors")
    return st


def _json_key(k: Any):
    if isinstance(k, (str, int, float, bool)) or k is None:
        return k
    return repr(k)


def _encode(obj: Any, key: str, tensors: Dict[str, torch.Tensor]) -> Any:
    """A JSON-able description of ``obj``; its tensors go into ``tensors``, keyed from ``key``."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return {"t": key}
    if obj is None:
        return None
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            sub = f"{key}.{k}" if isinstance(k, str) else f"{key}[{k!r}]"
            items.append([_json_key(k), _encode(v, sub, tensors)])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [_encode(v, f"{key}[{i}]", tensors) for i, v in enumerate(obj)]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            "dict": [
                [f.name, _encode(getattr(obj, f.name), f"{key}.{f.name}", tensors)]
                for f in dataclasses.fields(obj)
            ]
        }
    if isinstance(obj, (str, int, float, bool)):
        return {"value": obj}
    return {"value": None, "repr": repr(obj)[:200]}


def _decode(desc: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if desc is None:
        return None
    if "t" in desc:
        return tensors[desc["t"]]
    if "dict" in desc:
        return {k: _decode(v, tensors) for k, v in desc["dict"]}
    if "list" in desc:
        return [_decode(v, tensors) for v in desc["list"]]
    if "tuple" in desc:
        return tuple(_decode(v, tensors) for v in desc["tuple"])
    if "value" in desc:
        return desc["value"]
    raise ValueError(f"hookplug capture file: unknown structure entry {desc!r}")


def save_capture(
    path: Union[str, os.PathLike], stores: Dict[str, Dict[str, Any]], *, keep: Any = "last"
) -> None:
    """Write ``{"features"|"grads"|"inputs": {module: value or [values]}}`` to ``path``."""
    st = _require_safetensors()
    tensors: Dict[str, torch.Tensor] = {}
    layout: Dict[str, Dict[str, Any]] = {}
    for what, store in stores.items():
        if what not in _WHAT:
            raise ValueError(f"save_capture: unknown kind {what!r}; expected one of {_WHAT}")
        prefix = _PREFIX[what]
        layout[what] = {}
        for name, value in store.items():
            if isinstance(value, list):
                layout[what][name] = {
                    "list": [
                        _encode(v, f"{name}/{i}/{prefix}", tensors) for i, v in enumerate(value)
                    ]
                }
            else:
                layout[what][name] = {"one": _encode(value, f"{name}/{prefix}", tensors)}
    out: Dict[str, torch.Tensor] = {}
    seen_storage = set()
    for k, t in tensors.items():
        t = t.detach().to("cpu")
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
        "version": FORMAT_VERSION,
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
    ``keep="all"|N``) like ``plugin.features``; ``"grads"`` and ``"inputs"`` likewise;
    ``"all"`` returns ``{"features": ..., "grads": ..., "inputs": ...}``. Tensors are loaded
    onto ``device``. Dataclass outputs come back as dicts.
    """
    if what not in (*_WHAT, "all"):
        raise ValueError(f"load_capture: what must be one of {(*_WHAT, 'all')}, got {what!r}")
    st = _require_safetensors()
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
        meta_raw = (f.metadata() or {}).get(META_KEY)
        if meta_raw is None:
            raise ValueError(
                f"load_capture: {os.fspath(path)!r} is not a hookplug capture file "
                f"(no {META_KEY!r} metadata)"
            )
        meta = json.loads(meta_raw)
        if meta.get("version", 0) > FORMAT_VERSION:
            raise ValueError(
                f"load_capture: {os.fspath(path)!r} has format version {meta.get('version')}, "
                f"this hookplug reads up to {FORMAT_VERSION}"
            )
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    del st
    result = {}
    for kind in _WHAT:
        store = {}
        for name, entry in meta["layout"].get(kind, {}).items():
            if "list" in entry:
                store[name] = [_decode(d, tensors) for d in entry["list"]]
            else:
                store[name] = _decode(entry["one"], tensors)
        result[kind] = store
    return result if what == "all" else result[what]
