"""Walking the outputs of modules: tensors, tuples, lists, dicts, dataclasses, ModelOutput.

``iter_tensors(obj)`` yields ``(path, tensor)`` with paths such as ``"output"``,
``"output[1]"``, ``"output.logits"``, ``"output['x']"``; ``map_tensors`` rebuilds a
structure with each tensor replaced. Both (and every other walker in hookplug) go through
``children``/``rebuild``, the one definition of what a container is and how paths read.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

__all__ = ["iter_tensors", "map_tensors", "children", "rebuild"]


def children(obj: Any, path: str = "output",
             init_only: bool = False) -> Optional[List[Tuple[Any, str, Any]]]:
    """``[(key, path, value)]`` of a container (dict or HF ModelOutput, list, tuple,
    namedtuple, dataclass instance; ``init_only``: only the dataclass fields that
    :func:`rebuild` can set); None for anything else (a leaf)."""
    if isinstance(obj, dict):  # also HF ModelOutput (an OrderedDict subclass)
        return [(k, f"{path}.{k}" if _plain_key(k) else f"{path}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(i, f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # (a field without a default and init=False is unset until the class sets it)
        return [(f.name, f"{path}.{f.name}", getattr(obj, f.name))
                for f in dataclasses.fields(obj) if (f.init or not init_only) and hasattr(obj, f.name)]
    return None


def _plain_key(key: Any) -> bool:
    """Whether a dict key reads as ``.key`` in a path: a non-empty str with no ``.``, ``[``,
    ``]`` or quote (``{"a.b": x}`` is ``output['a.b']``, not ``output.a.b``, the path of
    ``{"a": {"b": x}}``: two tensors would share one key)."""
    return isinstance(key, str) and bool(key) and not any(c in key for c in ".[]'\"")


def rebuild(obj: Any, items: List[Tuple[Any, Any]]) -> Any:
    """A container like ``obj`` holding ``items`` (``(key, value)`` as from
    ``children(obj, init_only=True)``); a class that cannot be rebuilt gives a plain
    dict/list/tuple."""
    if isinstance(obj, dict):
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001 - dict subclasses with odd constructors
            return dict(items)
    values = [v for _, v in items]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        # _make builds through tuple.__new__: a subclass's own __new__ (PackedSequence's
        # checks its fields) must not run on the placeholders some walkers put in
        make = getattr(type(obj), "_make", None)
        try:
            return make(values) if make is not None else type(obj)(*values)
        except Exception:  # noqa: BLE001
            return tuple(values)
    if isinstance(obj, (list, tuple)):
        try:
            return type(obj)(values)
        except Exception:  # noqa: BLE001
            return tuple(values) if isinstance(obj, tuple) else values
    return dataclasses.replace(obj, **dict(items))


def _holds(obj: Any, leaf) -> bool:
    """Whether ``obj`` is or holds a ``leaf``."""
    if isinstance(obj, leaf):
        return True
    return any(_holds(v, leaf) for _, _, v in children(obj) or ())


def _rebuild_fields(obj: Any, items: List[Tuple[Any, Any]]) -> Any:
    """:func:`rebuild`, a dataclass with every field in ``items`` set as it is (no
    ``__init__``/``__post_init__``, which would compute fields from placeholders or
    gradients, or need an InitVar). (A ``ModelOutput`` is a dict: :func:`rebuild`.)"""
    if isinstance(obj, dict) or not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return rebuild(obj, items)
    new = copy.copy(obj)
    for key, value in items:
        object.__setattr__(new, key, value)  # (a frozen dataclass too)
    return new


def iter_tensors(obj: Any, path: str = "output") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside ``obj``, depth first, in order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    for _, sub, value in children(obj, path) or ():
        yield from iter_tensors(value, sub)


def map_tensors(fn: Callable[[str, Any], Any], obj: Any, path: str = "output",
                leaf=torch.Tensor, fields: bool = False) -> Any:
    """``obj`` rebuilt with ``fn(path, x)`` in place of each ``leaf`` ``x`` (paths as
    :func:`iter_tensors` gives them); other leaves are kept. ``fields``: a dataclass's every
    field is mapped and set as it is, without running its ``__init__``/``__post_init__``
    (a record of the values, as capture keeps them: copies, placeholders, gradients)."""
    if isinstance(obj, leaf):
        return fn(path, obj)
    kids = children(obj, path, init_only=not fields)
    if kids is None:
        return obj
    if fields and not isinstance(obj, dict) and dataclasses.is_dataclass(obj):
        # attributes its __post_init__ set beside the fields (``self.probs = ...``), when they
        # hold tensors: mapped too, else the record would keep the live ones
        names = {f.name for f in dataclasses.fields(obj)}
        kids = kids + [(k, f"{path}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items()
                       if k not in names and _holds(v, leaf)]
    items = [(k, map_tensors(fn, value, sub, leaf, fields)) for k, sub, value in kids]
    return _rebuild_fields(obj, items) if fields else rebuild(obj, items)
