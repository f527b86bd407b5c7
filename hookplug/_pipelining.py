"""``torch.distributed.pipelining``'s metadata inference is no call of the model.

A ``PipelineStage`` given no shapes (``input_args``/``output_args``) learns them at its
schedule's first ``step()`` by running its module forward and backward once more, on a
stand-in input: the first micro-batch, detached, on the first stage; uninitialized tensors of
the received shapes on the others (garbage values, NaN or 1e19). Observed, that run added a
call per selected module to the first step (``stats`` merged the garbage into its rows and
could name it the step's first non-finite value, ``flops`` counted it, ``capture`` kept it,
``gradclamp`` with ``nan="raise"`` could raise on it). The stage's two inference methods are
wrapped, once the module is imported (checked at ``attach``), to run with the hookplug hooks
of the stage's modules idle, their call counters left as they were: the hot path pays
nothing.
"""
from __future__ import annotations

import functools
import sys
from typing import List

from ._binding import _NO_IMPLS, _ModuleBinding, _ParamBinding

# (torch 2.11: ``_shape_inference``, a forward under no_grad on zeros, from
# ``_prepare_forward_infra``; 2.13 on: the forward and backward metadata inference)
_METHODS = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def patch_pipelining() -> None:
    """Wrap ``PipelineStage``'s metadata inference where torch has it and it is imported."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    cls = getattr(stage, "PipelineStage", None)
    if cls is None:
        return
    for name in _METHODS:
        fn = cls.__dict__.get(name)
        if fn is not None and not getattr(fn, "_hookplug_idle", False):
            setattr(cls, name, _idle(fn))


def _idle(fn):
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        module = getattr(self, "submod", None)
        if module is None:
            return fn(self, *args, **kwargs)
        bindings, params, sessions = _bindings_of(module)
        if not bindings and not params:
            return fn(self, *args, **kwargs)
        calls = [b.calls for b in bindings]
        for b in bindings:
            b.fwd_in = b.fwd_out = b.out_grad = ()
            b.impls = _NO_IMPLS
        for pb in params:
            pb.impls = ()
        try:
            return fn(self, *args, **kwargs)
        finally:
            for b, n in zip(bindings, calls):
                b.calls = n
            for s in sessions:  # the step's tuples back (a session removed meanwhile has none)
                if not s.removed:
                    s._apply_sampling()

    run._hookplug_idle = True
    return run


def _bindings_of(module):
    """The live module bindings of every session on ``module``'s modules (found through their
    forward hooks), those sessions' parameter bindings of its parameters, and the sessions."""
    bindings: List[_ModuleBinding] = []
    sessions = {}
    mods = {id(m) for m in module.modules()}
    for m in module.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for h in hooks.values():
                b = getattr(h, "__self__", None)
                if isinstance(b, _ModuleBinding) and b.session is not None and b not in bindings:
                    bindings.append(b)
                    sessions[id(b.session)] = b.session
    params: List[_ParamBinding] = []
    for s in sessions.values():
        for pb in s._param_bindings.values():
            owner = pb.owner_ref()
            if owner is not None and id(owner) in mods and pb.session is not None:
                params.append(pb)
    return bindings, params, list(sessions.values())
