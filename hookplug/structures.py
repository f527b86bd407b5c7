"""Walking the outputs of modules: tensors, tuples, lists, dicts, dataclasses, ModelOutput.

``iter_tensors(obj)`` yields ``(path, tensor)`` with paths such as ``"output"``,
``"output[1]"``, ``"output.logits"``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Tuple

import torch

__all__ = ["iter_tensors"]


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
