"""NanGuard: raise naming the first module whose output holds a NaN or an Inf.

    hookplug.attach(model, "*", plugins="nanguard")          # forward only
    hookplug.attach(model, "*", plugins=("nanguard", {"grads": True}))

Checking needs the host to look at one flag per module call (a device sync on CUDA): this
is a debugging tool, not production telemetry.
"""
import torch

import hookplug

__all__ = ["NanGuard", "NonFiniteError"]


class NonFiniteError(FloatingPointError):
    """Raised with the module name, the output path and what was found."""


class NanGuard(hookplug.Plugin):
    name = "nanguard"

    def __init__(self, *, grads: bool = False):
        if not isinstance(grads, bool):
            raise TypeError(f"nanguard: grads must be a bool, got {type(grads).__name__}")
        self.grads = grads
        self.checked = 0

    @staticmethod
    def _check(where: str, path: str, t: torch.Tensor) -> None:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            raise NonFiniteError(f"{where}: {path} has {nan} NaN and {inf} Inf of {t.numel()} values")

    @hookplug.hookimpl
    def hookplug_forward_output(self, ctx, output):
        for path, t in hookplug.structures.iter_tensors(output):
            self._check(f"module {ctx.name!r} (call {ctx.call_index})", path, t)
        self.checked += 1

    @hookplug.hookimpl
    def hookplug_output_grad(self, ctx, grad, path):
        if self.grads:
            self._check(f"gradient of module {ctx.name!r}", path, grad)

    def results(self):
        return {"checked": self.checked}
