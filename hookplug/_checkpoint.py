"""Gradients that arrive through a reentrant activation checkpoint, tied back to their call.

Under ``torch.utils.checkpoint.checkpoint(fn, use_reentrant=True)`` (HF's
``gradient_checkpointing_enable()`` default), the first forward of ``fn`` runs without
autograd, so no gradient can be hooked there. Backward runs ``fn`` again (the recompute) and
the gradients arrive on the recompute's outputs. The recompute is not a new call: the
gradient hooks must see the context (call index, step, phase) of the call it repeats.

How: forward calls made while autograd is off and the model (its root) is in training mode,
by modules with a gradient plugin, are remembered in the order they finish (a frozen
submodule in eval mode is remembered too: its recompute is part of the sequence). A checkpoint's recompute runs inside one
backward node (the checkpoint's own) and is over before any of its gradients arrive. When the
first one arrives, the node's recomputed calls (the same modules, in the same order) take the
contexts of the latest unmatched run of remembered calls with those modules: backward visits
checkpoints last to first. A recompute that matches nothing keeps ``call_index`` -1.
Everything is forgotten at ``session.step()``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_MAX_REMEMBERED = 1 << 16  # forward calls without autograd kept per step (no step() ever: bounded)


class RecomputeMatcher:
    """Per session: hands recomputed calls the contexts of the forward calls they repeat."""

    __slots__ = ("_forward", "_group", "_group_node", "_pending")

    def __init__(self) -> None:
        self._forward: List[Tuple[Any, Any]] = []  # (binding, ctx) of calls made without autograd
        self._group: Optional[List[Tuple[Any, Any]]] = None  # the recomputed calls of one node
        self._group_node: Any = None
        self._pending: Dict[int, List[Tuple[Any, Any]]] = {}  # id(recompute ctx) -> its group

    def forward_call(self, binding, ctx) -> None:
        """A call that finished while autograd was off in a training model (maybe a
        checkpoint's first forward)."""
        if len(self._forward) >= _MAX_REMEMBERED:
            del self._forward[: _MAX_REMEMBERED // 2]
        self._forward.append((binding, ctx))

    def recompute_call(self, binding, ctx) -> None:
        """A call that finished inside backward (a recompute); ``ctx`` is completed by
        :meth:`resolve` when its first gradient arrives."""
        if not self._forward:  # nothing ran without autograd: not a reentrant checkpoint
            return
        node = _current_node()
        if node is None:
            return
        if self._group is None or self._group_node is not node:
            self._group, self._group_node = [], node
        self._group.append((binding, ctx))
        self._pending[id(ctx)] = self._group

    def resolve(self, ctx) -> None:
        """Give ``ctx``'s recompute group the contexts of the forward calls it repeats."""
        group = self._pending.get(id(ctx))
        if group is None:
            return
        for _, c in group:
            self._pending.pop(id(c), None)
        if group is self._group:
            self._group = self._group_node = None
        forward, n = self._forward, len(group)
        first = group[0][0]
        for start in range(len(forward) - n, -1, -1):
            if forward[start][0] is first and all(
                    forward[start + i][0] is group[i][0] for i in range(1, n)):
                for (_, c), (_, orig) in zip(group, forward[start:start + n]):
                    c.call_index, c._step, c.phase = orig.call_index, orig._step, orig.phase
                del forward[start:start + n]
                return

    def clear(self) -> None:
        self._forward.clear()
        self._pending.clear()
        self._group = self._group_node = None
