"""torch.func (functorch) tensors as hooks meet them: inside ``vmap`` a module's outputs and
gradients are BatchedTensors, unusable once the transform returns; inside ``grad``/``vjp``
they are wrappers of plain tensors (TensorWrapper) that cannot be saved or kept as such."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ._bank import _is_compiling

__all__ = ["is_batched", "unwrapped", "outside_transforms"]

_functorch = getattr(torch._C, "_functorch", None)
_is_legacy_batched = getattr(_functorch, "is_legacy_batchedtensor", None)


def is_batched(t: torch.Tensor) -> bool:
    """A tensor of ``torch.func.vmap``, at any depth of functorch wrapping (``grad`` inside
    ``vmap`` wraps the BatchedTensor once more), or of the older batching of
    ``torch.autograd.grad(is_grads_batched=True)`` and ``autograd.functional.jacobian(...,
    vectorize=True)``. False in code dynamo traces (a hook compiled autograd traces into its
    backward graph): it cannot trace functorch's checks (a graph break per call, with a
    warning), and the tensors it traces are plain."""
    if _functorch is None or _is_compiling():
        return False
    if _is_legacy_batched is not None and _is_legacy_batched(t):
        return True
    if not _functorch.is_functorch_wrapped_tensor(t):
        return False
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return _is_legacy_batched is not None and _is_legacy_batched(t)


def unwrapped(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` as a plain tensor: itself, or the tensor a ``grad``/``vjp`` transform wraps (its
    value; kept, it is an ordinary tensor after the transform returns); None for a batched
    one (:func:`is_batched`), which has no one value."""
    if _is_compiling():  # (see is_batched)
        return t
    if is_batched(t):
        return None
    while _functorch is not None and _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """No ``torch.func`` transform is active inside: ops on plain tensors make plain tensors
    (not wrappers of the transform's level), and an in-place op on a tensor made outside the
    transform is allowed (a counter)."""
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    except ImportError:  # pragma: no cover - every supported torch has it
        yield
        return
    with temporarily_clear_interpreter_stack():
        yield
