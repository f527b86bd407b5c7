"""Walking the outputs of modules: tensors, tuples, lists, dicts, dataclasses, ModelOutput.

``iter_tensors(obj)`` yields ``(path, tensor)`` with paths such as ``"output"``,
``"output[1]"``, ``"output.logits"``; ``map_tensors(fn, obj)`` rebuilds the structure with
``fn`` applied to every tensor (used by plugins that capture or rewrite outputs).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Tuple

import torch

__all__ = ["iter_tensors", "map_tensors"]


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def iter_tensors(obj: Any, path: str = "output") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside ``obj``, depth first, in order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):  # also HF ModelOutput (an OrderedDict subclass)
        for key, value in obj.items():
            sub = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"
            yield from iter_tensors(value, sub)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{path}[{i}]")
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), f"{path}.{f.name}")


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Return ``obj`` rebuilt with ``fn(t)`` in place of every tensor ``t``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        items = [(k, map_tensors(fn, v)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001 - dict subclasses with odd constructors
            return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if _is_dataclass_instance(obj):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
