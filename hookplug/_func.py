"""torch.func (functorch) tensors as hooks meet them: inside ``vmap`` a module's outputs and
gradients are BatchedTensors, unusable once the transform returns."""
from __future__ import annotations

import torch

__all__ = ["is_batched"]

_functorch = getattr(torch._C, "_functorch", None)


def is_batched(t: torch.Tensor) -> bool:
    """A tensor of ``torch.func.vmap``, at any depth of functorch wrapping (``grad`` inside
    ``vmap`` wraps the BatchedTensor once more)."""
    if _functorch is None or not _functorch.is_functorch_wrapped_tensor(t):
        return False
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return False
