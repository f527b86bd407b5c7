"""Gradients that arrive through a reentrant activation checkpoint, tied back to their call.

Under ``torch.utils.checkpoint.checkpoint(fn, use_reentrant=True)`` (or any checkpoint built
as a ``torch.autograd.Function``, e.g. DeepSpeed's or Megatron's), the first forward of ``fn``
runs inside the Function's ``forward``, without autograd, so no gradient can be hooked there.
Backward runs ``fn`` again (the recompute) inside that Function's backward node, and the
gradients arrive on the recompute's outputs. The recompute is not a new call: its gradient
hooks must get the context (call index, step, phase) of the call it repeats.

How: a call that finishes while autograd is off, in a training model, by a module with a
gradient plugin, is remembered under the ``ctx`` of every ``autograd.Function.forward`` on the
stack (found by walking the frames). That ``ctx`` is the very node that
``torch._C._current_autograd_node()`` returns while the Function's backward runs, so the k-th
recomputed call of a module inside that node takes the context of the k-th remembered call of
that module under it (counted per backward pass, so ``retain_graph`` passes repeat it).
Nesting works the same way: the inner checkpoint's first forward runs inside the outer one's,
so its calls are remembered under both nodes. Nodes are held weakly: what is remembered goes
with the graph. A recompute matching nothing gets a context with ``call_index`` -1.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_FunctionCtx = getattr(torch.autograd.function, "BackwardCFunction", None)
_MAX_FRAMES = 256  # how far up the stack an enclosing Function.forward is looked for


def enclosing_function_contexts() -> List[Any]:
    """The ``ctx`` of every ``torch.autograd.Function.forward`` running on this thread's stack,
    innermost first."""
    found: List[Any] = []
    if _FunctionCtx is None:
        return found
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        if code.co_name == "forward" and code.co_varnames[:1] == ("ctx",):
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, _FunctionCtx):
                found.append(ctx)
        frame = frame.f_back
    return found


class RecomputeMatcher:
    """Per session: hands recomputed calls the contexts of the forward calls they repeat."""

    __slots__ = ("_nodes",)

    def __init__(self) -> None:
        # Function ctx (a backward node) -> ({binding: [ctx of its calls, in finish order]},
        #                                    {(backward pass, binding): calls recomputed so far})
        self._nodes: "weakref.WeakKeyDictionary[Any, Tuple[Dict[Any, List[Any]], Dict[Tuple[int, Any], int]]]" = (
            weakref.WeakKeyDictionary())

    def forward_call(self, binding, ctx) -> None:
        """A call that finished with autograd off in a training model: remembered under every
        Function forward it ran inside (nothing when there is none)."""
        for node in enclosing_function_contexts():
            entry = self._nodes.get(node)
            if entry is None:
                entry = self._nodes[node] = ({}, {})
            entry[0].setdefault(binding, []).append(ctx)

    def recompute_ctx(self, binding) -> Optional[Any]:
        """The context of the call this recomputed call (running inside backward) repeats, or
        None when it repeats none that was remembered."""
        node = _current_node()
        if node is None:
            return None
        try:
            entry = self._nodes.get(node)
        except TypeError:  # a node type without weak references: not a Function's
            return None
        if entry is None:
            return None
        calls = entry[0].get(binding)
        if not calls:
            return None
        key = (_graph_task_id(), binding)
        k = entry[1].get(key, 0)
        if k >= len(calls):
            return None
        entry[1][key] = k + 1
        return calls[k]

    def clear(self) -> None:
        self._nodes.clear()
