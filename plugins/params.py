"""``params``: statistics of the parameters of selected modules — weights, gradients and
updates — exact under DDP, FSDP2 and HSDP without gathering a tensor.

    opt = torch.optim.AdamW(model.parameters())
    with hookplug.attach(model, "Linear", plugins=("params", {"params": "*.weight"})) as s:
        for x in data:
            model(x).sum().backward()
            opt.step()          # params measures here: weight + grad before, update after
            s.step()            # the training step ends after optimizer.step()
            opt.zero_grad()     # (after s.step(): see "When it measures")
    st = s["params"].results()["fc1.weight"]["grad"]       # a hookplug.TensorStats
    st.l2, st.rms, st.zero_fraction                         # device tensors
    s["params"].update_to_weight()["fc1.weight"]            # update.l2 / weight.l2

Options (keyword-only):

- ``sites=("weight", "grad", "update")``: any subset; a single string is accepted.
- ``params="*"``: a glob (``fnmatch``) or a list of globs on the qualified parameter name
  (``"*.weight"``, ``"encoder.*"``). The parameters are those of the selected modules
  (their children's included), named as in the unwrapped model; a tied parameter
  (``lm_head.weight`` is ``wte.weight``) is matched by any of its names and named by the
  first that matches. A glob list that matches none warns.
- ``bins``, ``hist``, ``range``, ``max_pending_steps``, ``max_pending_bytes``: as for ``stats``.
- ``optimizer=None``: by default every ``torch.optim.Optimizer`` that holds a selected
  parameter is observed through torch's global optimizer step hooks; pass an optimizer (or
  a list) to observe only those (a wrapper that is no initialized optimizer, accelerate's
  ``AcceleratedOptimizer``, stands for the one it wraps, ``.optimizer``).
- ``plain_tensors="replicated"``: how a plain (non-DTensor) parameter is counted under
  ``torch.distributed``: ``"replicated"`` (DDP, or any data-parallel copy: one rank
  counts it) or ``"distinct"`` (each rank's tensor is a different piece, e.g. hand-made
  model parallelism, or FSDP1 with ``use_orig_params=True`` and ``FULL_SHARD`` /
  ``SHARD_GRAD_OP``: every rank counts its own). Left unset on FSDP1's flat shards, it
  warns (FSDP1 with ``use_orig_params=False`` keeps its parameters on the wrapper as flat
  parameters, which no selected module owns: nothing is measured).

**When it measures (the call order).** Weights and gradients are measured in the
optimizer's step pre-hook: after backward, after DDP's all-reduce / FSDP2's
reduce-scatter, after gradient accumulation over micro-batches, after clipping and
``GradScaler`` unscaling — i.e. the gradient the optimizer is about to use. The update is
``weight after - weight before`` the optimizer step (the step post-hook). Call
``session.step()`` after ``optimizer.step()``: what the optimizer did belongs to the step
that ends there. A parameter no optimizer step touched during a training step (no
optimizer, or ``GradScaler`` skipping a step: the step with the inf/NaN gradients) is
measured at ``session.step()``, weight and ``p.grad`` if it is still set: call
``session.step()`` before ``zero_grad()`` (or zero at the start of the loop), or
``measure_unstepped()`` before ``zero_grad()``; without any optimizer the update is the
change between two ``session.step()`` calls. A skipped step has no update record, except
those before the first optimizer step when no ``optimizer=`` is named (the global hooks
cannot tell them from steps without an optimizer: an update of 0). A fused optimizer (``fused=True``), which
``GradScaler.step`` steps with the gradients still scaled and also when it skips, is
measured the same: the gradient divided by the scale it is handed, no update in a skipped
step. The per-micro-batch gradient tensor hook is not used: it sees the
local, not yet reduced gradient, and FSDP2's sharded parameters get none.

- ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the closure
  computes the gradient inside ``step()`` (zero_grad, forward, backward, Lightning's
  accumulation and clipping), so the pre-hook passes the optimizer a wrapped closure and
  the gradient is measured when the closure **first** returns: the gradient of that
  evaluation, at the weights the pre-hook measured. For every optimizer that evaluates the
  closure once (SGD, Adam, ..., Lightning) that is exactly the gradient it applies. LBFGS
  evaluates it several times per step (more iterations, line search): the grad site is the
  first evaluation, the gradient at the step's starting weights (which LBFGS's first
  inner update uses); later evaluations are not measured; the update is the change over
  the whole step. A closure the optimizer never calls: the gradient present when
  ``step()`` returns.
- An optimizer step inside another (a wrapper whose ``step()`` calls an inner optimizer's,
  e.g. ``ZeroRedundancyOptimizer``, or a subclass calling ``super().step()``): torch's
  hooks fire for both; a parameter is measured by the outermost step that holds it, its
  update when that step returns (after, e.g., ZeRO's broadcast), once. A step that raised
  is forgotten at ``session.step()`` (or when its closure raised).
- The step with zero gradients and ``lr=0`` that ``get_state_dict``/``set_state_dict``
  (``torch.distributed.checkpoint.state_dict``) give an optimizer with no state, to create
  it, is not measured.
- A model built on the ``meta`` device and materialized after ``attach`` (``to_empty()``,
  FSDP2's deferred init): nothing is measured while it is on ``meta``; the parameters are
  found through their modules, so the materialized ones are measured, as if attached
  after ``to_empty``. (Without an optimizer, the first step's update needs the baseline
  taken at ``attach``: it is left out.)

**Memory.** ``"update"`` keeps one copy of the (local shard of the) selected parameters
between the two optimizer hooks; leave it out of ``sites`` to save that memory. Under
replication the copy is kept only on the rank that counts the parameter; a parameter no
optimizer holds (a frozen backbone) drops it at the first step an optimizer ran.

**Sharding-exact.** Every rank measures what it holds and telemetry merges the rows across
ranks (one packed collective per flush, with every other producer's rows): counts add,
min/max combine, mean and M2 by the parallel formula — exactly the statistics of the whole
parameter, with no gather. A DTensor contributes its local shard (``to_local()``) on the
ranks whose coordinate on each ``Replicate()`` mesh dimension is the parameter's owner
(parameters are spread round-robin over replicas); a plain tensor under DDP is counted on
its owner rank only, so a replicated tensor is never counted once per rank. The replicas of a
plain parameter are the ranks of the replica group (DDP's process group, else the world)
holding a parameter of its name, exchanged once at attach: pipeline stages holding different
layers are each counted whole (a session attached before ``init_process_group`` takes every
rank of the group as a replica). A rank whose
shard is empty keeps its (empty) rows, so every rank flushes the same layout.
``results()`` is this rank's part only (unmerged under torch.distributed): the exact
numbers are in the telemetry records (``session.flush()`` returns them; records have
``module`` = the parameter name, ``site`` = ``"weight"``/``"grad"``/``"update"``,
``phase="train"``, and ``update_to_weight`` on ``"update"`` records when ``"weight"`` is
measured too).

**Compile and CUDA graphs.** Nothing runs in the model's forward or backward, so a
compiled model is unaffected. Measurement is eager Python in the optimizer hooks (one
``stats_accumulate_`` op per parameter and site into preallocated rows, no host sync; the
update copy is preallocated and reused). The hooks run outside dynamo
(``torch._dynamo.disable``), so a ``torch.compile``'d ``optimizer.step`` compiles to the
graphs it has without them and is measured around its graph as in eager. A
CUDA-graph-captured ``optimizer.step`` is not observed from inside the graph: measured only
at ``session.step()`` then (weight and grad; update without optimizer hooks).
"""
from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch.nn.parameter import is_lazy

import hookplug
from hookplug import hookimpl
from hookplug._bank import (LATE_CLOCK, MAX_PENDING_BYTES, ON_COMPILE_START, StatsBank, _is_compiling, _outside_inference_mode,
                            as_measured, check_hist_options,
                            check_max_pending, check_sites, dtensor_local, dynamo_disable, is_dtensor, merge_devices,
                            pad_rows, unmaterialized)
from hookplug._binding import _inert_hook
from hookplug._plugin import plugin_failed, plugin_off, user_stacklevel, warn_once
from hookplug._selectors import clean_name, parameter_names
from hookplug._telemetry import initialized_dist
from hookplug._stats import TensorStats, touched

__all__ = ["ParamsPlugin"]

_SITES = ("weight", "grad", "update")
_ROUNDED = (torch.float16, torch.bfloat16)  # an update in these dtypes would be rounded


class _Param:
    """One selected parameter: where to find it (the module and attribute, so wrappers
    that swap parameter objects, like FSDP2, are followed), its row keys and its owner."""

    __slots__ = ("name", "module_ref", "attr", "index", "owner", "prev", "done", "keys")

    def __init__(self, name: str, module, attr: str, index: int):
        self.name = name
        self.module_ref = weakref.ref(module)
        self.attr = attr
        self.index = index
        self.owner: Optional[int] = None  # the replica-group rank counting it (_find_holders)
        self.prev: Optional[torch.Tensor] = None  # the weight before the update (local part)
        self.done = False  # measured in the current step
        self.keys = {s: (name, s) for s in _SITES}

    def tensor(self) -> Optional[torch.Tensor]:
        """The registered parameter, never a tensor computed on access: after pruning or a
        parametrization registered since attach, ``module.weight`` runs code (spectral_norm's
        power iteration updates its buffers) and is no parameter; that one is left out."""
        mod = self.module_ref()
        return None if mod is None else mod._parameters.get(self.attr)


class _Baseline:
    """A forward pre-hook on a lazy module (``nn.LazyLinear``) whose parameters held no values
    at attach: without an optimizer the first step's update is the change from the weights
    its first forward materializes (torch's hook, registered before this one), copied here.
    It takes itself off once they all hold values. (Eager code; parameters on ``meta`` at
    attach get their baseline at the first ``session.step()``.)"""

    __slots__ = ("plugin_ref", "prs", "handle")

    def __init__(self, plugin: "ParamsPlugin", prs: List[_Param]):
        self.plugin_ref = weakref.ref(plugin)
        self.prs = prs
        self.handle = None

    def __reduce__(self):  # (copies and pickles get no session)
        return _inert_hook, ()

    def __call__(self, module, args) -> None:
        plugin = self.plugin_ref()
        if plugin is None or _is_compiling():
            return
        pending = False
        for pr in self.prs:
            t = pr.tensor()
            if t is not None and unmaterialized(t):
                pending = True
            elif t is not None and pr.prev is None and not plugin._opt_seen and plugin.bank.live:
                w = plugin._local(pr, t)
                if w is not None:
                    plugin._snapshot(pr, w)
        if not pending:
            self.handle.remove()


class _Frame:
    """One ``optimizer.step()`` in progress: the parameters its pre-hook measured (those of
    an enclosing step excluded) and whether their gradients wait for its closure."""

    __slots__ = ("opt", "prs", "grad_pending", "caller", "thread")

    def __init__(self, opt, prs: List[_Param], caller):
        self.opt = opt
        self.prs = prs
        self.grad_pending = False
        self.caller = caller  # the frame of torch's step wrapper that runs our hooks
        self.thread = threading.get_ident()

    def running(self, stack: set, thread: int) -> bool:
        """Its ``step()`` has not returned nor raised (``stack``: ids of the live frames of
        ``thread``; a step of another thread is taken as running)."""
        return self.caller is None or self.thread != thread or id(self.caller) in stack


def _live_frames(depth: int = 2) -> set:
    """``id`` of every frame on this thread's stack above our caller's caller."""
    ids = set()
    f = sys._getframe(depth)
    while f is not None:
        ids.add(id(f))
        f = f.f_back
    return ids


def _past_dynamo(frame):
    """``frame``, or the first frame below it that is not one of ``torch._dynamo``'s (the
    ``torch._dynamo.disable`` wrapper the optimizer hooks run in once dynamo is imported)."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch._dynamo"):
        frame = frame.f_back
    return frame


def _outside_dynamo(fn):
    """``fn`` wrapped in ``torch._dynamo.disable`` where dynamo is imported (else ``fn``): an
    optimizer hook dynamo traced (``torch.compile(optimizer.step)``, a compiled training
    step) compiled the measuring code into graphs of its own, one per parameter and
    recompiled, and made the compiled step slower than the eager one."""
    disable = dynamo_disable()
    return fn if disable is None else disable(fn)


# plugins whose optimizer hooks were registered bare (dynamo not imported at attach): wrapped
# in place at the first compile start
_BARE_HOOKS: "weakref.WeakSet[ParamsPlugin]" = weakref.WeakSet()


def _wrap_bare_hooks() -> None:
    for plugin in list(_BARE_HOOKS):
        _BARE_HOOKS.discard(plugin)
        for h in plugin._handles:
            hooks = h.hooks_dict_ref()
            if hooks is not None and h.id in hooks:
                hooks[h.id] = _outside_dynamo(hooks[h.id])  # in place: torch may be iterating


ON_COMPILE_START.append(_wrap_bare_hooks)


def _state_init_step(caller) -> bool:
    """Whether the optimizer step called from ``caller`` is the one
    ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict``) gives
    an optimizer with no state to create it: zero gradients, ``lr=0``, no training step's."""
    return (caller is not None and caller.f_code.co_name == "_init_optim_state"
            and caller.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict")


def _hooked_optimizer(opt):
    """The optimizer whose ``step()`` runs torch's step hooks: ``opt``, or, for a wrapper that
    never ran ``Optimizer.__init__`` and steps an inner optimizer (accelerate's
    ``AcceleratedOptimizer``: 🤗 Trainer's ``trainer.optimizer``), ``opt.optimizer``."""
    outer = opt
    while not hasattr(opt, "_optimizer_step_pre_hooks"):
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            raise TypeError(f"params: optimizer={type(outer).__name__} has no torch optimizer step "
                            "hooks (not a torch.optim.Optimizer, nor a wrapper of one as .optimizer)")
        opt = inner
    return opt


def _grad_scale(opt) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(grad_scale, found_inf)`` that ``GradScaler.step`` sets on an optimizer stepping
    with AMP scaling itself (``fused=True``), for the duration of its ``step()``: the
    gradients are still scaled by ``grad_scale`` (None once ``unscale_`` ran; the fused
    kernel unscales them) and the step is skipped on the device where ``found_inf`` is
    nonzero (the optimizer is stepped all the same, with no host sync)."""
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return None, None
    scale, found = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
    return (scale if isinstance(scale, torch.Tensor) else None,
            found if isinstance(found, torch.Tensor) else None)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, without a sync unless it comes to the CPU (where a non-blocking
    copy from a GPU would be read before it lands)."""
    return t.to(device, non_blocking=device.type != "cpu")


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


def _closure_of(args, kwargs) -> Tuple[Any, Any]:
    """The closure passed to ``optimizer.step`` and where: ``(closure, "closure")`` (keyword),
    ``(closure, 1)`` (positional; ``args[0]`` is the optimizer), or ``(None, None)``."""
    if kwargs:
        c = kwargs.get("closure")
        if c is not None:
            return (c, "closure") if callable(c) else (None, None)
    if args is not None and len(args) > 1 and callable(args[1]):
        return args[1], 1
    return None, None


class ParamsPlugin(hookplug.Plugin):
    """Per parameter and site, a :class:`hookplug.TensorStats` of the weight, its gradient
    and its update. See the module docstring for the options and the call order."""

    watches_parameters = True

    name = "params"
    sampled = False  # sampling is the bank's gate
    collect_when_disabled = True  # its bank hands over only the steps ended before (collect_for)
    all_ranks = True  # hookplug_flush adds update_to_weight to every rank's records
    decorates_records = True  # ... which makes it no sink: session.has_sinks ignores it

    def __init__(
        self,
        *,
        sites: Sequence[str] = _SITES,
        params: Union[str, Sequence[str]] = "*",
        bins: Optional[int] = None,
        hist: Literal["log2", "linear"] = "log2",
        range: Optional[Tuple[float, float]] = None,  # noqa: A002 - the op's own name
        max_pending_steps: int = 1024,
        optimizer: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]] = None,
        plain_tensors: Optional[Literal["replicated", "distinct"]] = None,
        max_pending_bytes: Optional[int] = MAX_PENDING_BYTES,
    ):
        sites = check_sites("params", sites, _SITES)
        params = (params,) if isinstance(params, str) else tuple(params)
        if not params:
            raise ValueError("params: params must be a glob or a non-empty list of globs on "
                             "parameter names")
        bins, hist, range = check_hist_options("params", bins, hist, range)
        check_max_pending("params", max_pending_steps, max_pending_bytes)
        if optimizer is not None:
            optimizer = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
            optimizer = [_hooked_optimizer(o) for o in optimizer]
        self.sites = sites
        self.globs = params
        if plain_tensors not in (None, "replicated", "distinct"):
            raise ValueError("params: plain_tensors must be 'replicated' or 'distinct', got "
                             f"{plain_tensors!r}")
        self.plain_tensors = plain_tensors or "replicated"
        self._plain_given = plain_tensors is not None
        # weakly: a removed session kept for its results must not keep the optimizer, its
        # state and the parameters alive
        self._optimizers = None if optimizer is None else [weakref.ref(o) for o in optimizer]
        self.bank = StatsBank(bins=bins, hist=hist, range=range, max_pending_steps=max_pending_steps,
                              max_pending_bytes=max_pending_bytes, who=self.name,
                              clock_base=LATE_CLOCK)  # measured after activations
        self._params: List[_Param] = []
        self._ever_named: set = set()  # every name selected (records flushed after a retie keep theirs)
        # (module weakly, attribute, id of its parameter) of every slot the selection read (_retied);
        # not the parameter weakly: torch.utils.swap_tensors (to_empty under FSDP2) refuses those
        self._slots: List[Tuple[Any, str, int]] = []
        # id -> (ref, its parameters' ids, our params among them, their tensors' ids)
        self._opt_cache: Dict[int, Tuple[Any, Tuple[int, ...], List[_Param], List[int]]] = {}
        self._frames: List[_Frame] = []  # optimizer steps in progress, outermost first
        self._handles: List[Any] = []
        self._baselines: List[Any] = []  # _Baseline hooks' handles
        self._unhook: Optional[weakref.finalize] = None
        self._session_ref = None
        self._opt_seen = False
        self._last: Optional[Dict[torch.device, torch.Tensor]] = None
        self._warned_partial = False
        self._warned_layouts: set = set()

    # -- which parameters ------------------------------------------------------------------------

    def _select(self, session, within: Optional[set] = None) -> None:
        """The parameters to measure (``within``: only those of these ids, the ones the slots
        listed at attach hold now)."""
        model = session.model
        seen = set()
        found: List[Tuple[str, Any, str, int]] = []  # (name, module, attribute, id of the parameter)
        owner: Dict[int, Tuple[str, Any, str]] = {}
        holder: Dict[str, Tuple[Any, str]] = {}  # every name of a parameter -> (module, attr)
        if model is not None:
            for mname, mod in model.named_modules(remove_duplicate=False):
                for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                    qualified = clean_name(f"{mname}.{attr}" if mname else attr)
                    holder.setdefault(qualified, (mod, attr))
                    if id(p) not in owner:
                        owner[id(p)] = (qualified, mod, attr)
        aliases = parameter_names(model) if model is not None else {}
        for mod in session.modules_of(self).values():
            for p in mod.parameters():
                if id(p) in seen or id(p) not in owner:
                    continue
                seen.add(id(p))
                _, m, attr = owner[id(p)]
                # a tied parameter is matched by any of its names, and named by the first that matches
                name = next((n for n in aliases.get(id(p), ()) if any(fnmatch.fnmatchcase(n, g) for g in self.globs)),
                            None)
                if name is not None:  # read where that name holds it (untied later: its own)
                    m, attr = holder.get(name, (m, attr))
                    found.append((name, m, attr, id(p)))
        if not found and seen:
            warnings.warn(f"hookplug plugin 'params': params={list(self.globs)!r} matches no parameter of the "
                          f"{len(session.modules_of(self))} selected module(s) (by any of their names); "
                          "nothing is measured", RuntimeWarning, stacklevel=user_stacklevel())
        if within is not None:  # (new ones are warned about: see Session._warn_new_parameters)
            found = [f for f in found if f[3] in within]
        found.sort(key=lambda f: f[0])  # the same order (and rows) on every rank
        self._warn_fsdp1([getattr(m, "_parameters", {}).get(a) for _, m, a, _ in found])
        self._params = [_Param(n, m, a, i) for i, (n, m, a, _) in enumerate(found)]
        self._ever_named.update(pr.name for pr in self._params)
        if within is not None:
            return  # (the slots of attach)
        slots = {(id(m), a): (m, a) for _, m, a, _ in found}
        for top in session.modules_of(self).values():
            for m in top.modules():
                for a in m._parameters:
                    slots.setdefault((id(m), a), (m, a))
        self._slots = [(weakref.ref(m), a, id(m._parameters.get(a))) for m, a in slots.values()]

    def _retied(self) -> bool:
        """Whether a slot the selection read holds another parameter now: tied or untied
        after attach (``head.weight = nn.Parameter(...)``), where the names measured change."""
        for mod_ref, attr, pid in self._slots:
            mod = mod_ref()
            if mod is not None and id(mod._parameters.get(attr)) != pid:
                return True
        return False

    def _select_again(self, session) -> None:
        """Select again after ties or unties (:meth:`_retied`): the parameters that keep
        their name keep their update copy and counting rank; new names get rows after the
        others (an untied head is measured from now on; one tied to another is recorded
        under its first matching name only, as at attach)."""
        old = {pr.name: pr for pr in self._params}
        # the rank counting each parameter read before: a slot's new name (untied) is counted
        # where the parameter its slot held was (a pipeline stage's rank, not round-robin)
        was_in = {(id(ref()), attr): pid for ref, attr, pid in self._slots if ref() is not None}
        owner_of = {was_in[k]: pr.owner for pr in self._params if (k := (id(pr.module_ref()), pr.attr)) in was_in}
        self._slots = [(ref, attr, id(ref()._parameters.get(attr)) if ref() is not None else 0)
                       for ref, attr, _ in self._slots]  # (found again only when it changes again)
        self._select(session, within={pid for ref, _, pid in self._slots if ref() is not None})
        listed = set(was_in)
        for pr in self._params:  # a slot read now that attach did not list (a tie to an unselected
            mod = pr.module_ref()  # module's parameter): watched from now on
            if mod is not None and (id(mod), pr.attr) not in listed:
                listed.add((id(mod), pr.attr))
                self._slots.append((weakref.ref(mod), pr.attr, id(mod._parameters.get(pr.attr))))
        for pr in self._params:
            was = old.get(pr.name)
            if was is not None and was.module_ref() is pr.module_ref() and was.attr == pr.attr:
                pr.prev, pr.owner = was.prev, was.owner  # (the same slot, as before)
            else:
                pr.owner = owner_of.get(was_in.get((id(pr.module_ref()), pr.attr)), pr.owner)
            for s in self.sites:
                self.bank.row_of(pr.keys[s])
        self._opt_cache = {}

    def _warn_fsdp1(self, params) -> None:
        """FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``) hands every rank a
        flat piece of each parameter, marked ``_fsdp_flattened``: counted as replicated, each
        would be one rank's piece only. Say what to pass (the sharding strategy that decides
        it is not visible from the parameter)."""
        if self._plain_given or not any(getattr(p, "_fsdp_flattened", False) for p in params):
            return
        warnings.warn(
            "hookplug plugin 'params': the parameters are FSDP1 (FullyShardedDataParallel) "
            "flat shards, counted as replicated copies by default: pass "
            "plain_tensors='distinct' for exact records under FULL_SHARD / SHARD_GRAD_OP with "
            "use_orig_params=True ('replicated' under NO_SHARD; HYBRID_SHARD is not exact "
            "either way; FSDP2's fully_shard is)", RuntimeWarning, stacklevel=user_stacklevel())

    def _local(self, pr: _Param, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The part of ``t`` this rank counts (None: nothing)."""
        if t is None:
            return None
        if is_dtensor(t):
            placements = t.placements
            t, partial = dtensor_local(t, pr.index)  # owner on Replicate dims: round-robin
            if partial and not self._warned_partial:
                self._warned_partial = True
                warnings.warn(f"hookplug plugin 'params': {pr.name} is a DTensor with a "
                              f"Partial placement ({placements}); partial sums have no "
                              "mergeable statistics, it is skipped", RuntimeWarning)
            if t is None:
                return None
        elif self._world > 1 and self.plain_tensors == "replicated":
            if self._rank != (pr.index % self._world if pr.owner is None else pr.owner):
                return None
        if unmaterialized(t):
            return None  # not materialized yet (meta, a lazy module's): no values
        if t.layout is not torch.strided:
            warn_once(self._warned_layouts, t.layout, lambda: (
                f"hookplug plugin 'params': {pr.name} has a {t.layout} tensor (a sparse gradient: "
                "nn.Embedding(sparse=True)); only strided tensors are measured, this one is left out"))
            return None
        return as_measured(t.detach())  # float8 through float64 (exact); no integers

    # -- measuring ---------------------------------------------------------------------------------

    def _measure(self, prs, *, snapshot: bool, grads: bool = True,
                 scale: Optional[torch.Tensor] = None) -> None:
        """Weight and grad of ``prs`` (and the weight copy for the update); ``grads=False``:
        the gradients are measured later (``_measure_grads``, after the step's closure);
        ``scale``: the gradients are still scaled by it (``_grad_scale``)."""
        self._refresh_replicas()
        bank, sites = self.bank, self.sites
        grads = grads and "grad" in sites
        for pr in prs:
            pr.done = True
            p = pr.tensor()
            w = self._local(pr, p)
            if w is None:  # another rank counts it (or nothing to measure yet): a copy taken
                pr.prev = None  # at attach, before the process group existed, goes
                continue
            if "weight" in sites:
                bank.accumulate(w, pr.keys["weight"])
            if grads:
                self._accumulate_grad(pr, p, scale)
            if snapshot:
                self._snapshot(pr, w)

    def _measure_grads(self, prs) -> None:
        """The gradients of ``prs`` alone, after the step's closure (as ``_measure``)."""
        self._refresh_replicas()
        for pr in prs:
            p = pr.tensor()
            if self._local(pr, p) is not None:  # what this rank counts
                self._accumulate_grad(pr, p)

    def _accumulate_grad(self, pr: _Param, p: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        g = self._local(pr, p.grad)
        if g is not None:
            if scale is not None:  # in the gradient's dtype, as GradScaler's unscale_ leaves it
                g = torch.div(g, _to(scale, g.device))
            self.bank.accumulate(g, pr.keys["grad"])

    @_outside_inference_mode  # (a copy taken under inference_mode could not be refilled)
    def _snapshot(self, pr: _Param, w: torch.Tensor) -> None:
        prev = pr.prev
        if (prev is None or prev.shape != w.shape or prev.dtype != w.dtype or prev.device != w.device
                or prev.is_inference()):
            pr.prev = w.clone()
        else:
            prev.copy_(w)

    def _update(self, prs, found_inf: Optional[torch.Tensor] = None) -> None:
        """The update of ``prs``; ``found_inf``: a step ``GradScaler`` skipped on the device
        where it is nonzero (``_grad_scale``), which then records no update, as a step it
        skipped on the host (no sync: the sampling gate and'ed with it on the device)."""
        gates: Dict[torch.device, torch.Tensor] = {}
        for pr in prs:
            prev = pr.prev
            if prev is None:
                continue
            w = self._local(pr, pr.tensor())
            if w is None or w.shape != prev.shape or w.device != prev.device:
                continue
            gate = None
            if found_inf is not None:
                gate = gates.get(w.device)
                if gate is None:
                    dev = self.bank._devices.get(w.device) or self.bank.device_rows(w.device)
                    gate = gates[w.device] = dev.gate & (_to(found_inf, w.device) == 0)
            if prev.dtype in _ROUNDED:  # 16-bit weights: their difference is exact in float32
                self.bank.accumulate(w.to(torch.float32).sub_(prev), pr.keys["update"], gate=gate)
                continue
            torch.sub(w, prev, out=prev)  # prev now holds the update (refilled before the next)
            self.bank.accumulate(prev, pr.keys["update"], gate=gate)

    def _of_optimizer(self, opt) -> List[_Param]:
        # the parameters' ids, not their number: a group's list replaced by as many others
        ids = tuple(map(id, itertools.chain.from_iterable(g["params"] for g in opt.param_groups)))
        hit = self._opt_cache.get(id(opt))
        if (hit is not None and hit[0]() is opt and hit[1] == ids  # (an id is reused once freed)
                and all(id(pr.tensor()) == i for pr, i in zip(hit[2], hit[3]))):  # (nor replaced in the
            return hit[2]  # model: load_state_dict(assign=True) leaves the optimizer the old ones)
        prs, held = [], []
        members = set(ids)
        for pr in self._params:
            t = pr.tensor()
            if t is not None and id(t) in members:
                prs.append(pr)
                held.append(id(t))  # (ids: the optimizer holds the tensors)
        cache = self._opt_cache
        if len(cache) >= 16:  # optimizers made and dropped (one per phase, an LR finder)
            for key in [k for k, v in cache.items() if v[0]() is None]:
                del cache[key]
        cache[id(opt)] = (weakref.ref(opt), ids, prs, held)
        return prs

    def _opt_pre(self, opt, args=None, kwargs=None):
        """The step pre-hook: weight (and the copy for the update) now; the gradient now, or,
        when a closure is passed, once the closure first returns (see the module docstring).
        A step inside another optimizer's step (a wrapper calling its inner optimizer)
        leaves out the parameters the enclosing step measures. An error is the plugin's
        (``on_error``): under "warn" the step goes on, and the plugin is off from then."""
        if not self.bank.live or self._off():
            return None
        try:
            return self._pre(opt, args, kwargs, sys._getframe(1))
        except Exception as exc:  # noqa: BLE001 - the plugin's, not the optimizer's
            self._hook_failed("its optimizer step pre-hook", exc)
            return None

    def _pre(self, opt, args, kwargs, caller):
        frames = self._frames
        if frames:  # a step that raised never ran its post-hook: not an enclosing step
            live, me = _live_frames(), threading.get_ident()
            frames[:] = [f for f in frames if f.running(live, me)]
        wrapper = _past_dynamo(caller)  # torch's step wrapper, which runs the hooks
        prs = [] if _state_init_step(_past_dynamo(wrapper.f_back)) else self._of_optimizer(opt)
        if frames and prs:  # nested (a wrapper's inner optimizer, a subclass's super().step()):
            # what an enclosing step measures is its own
            outer = {pr.index for f in frames for pr in f.prs}
            prs = [pr for pr in prs if pr.index not in outer]
        frame = _Frame(opt, prs, wrapper)
        frames.append(frame)
        if not prs:
            return None
        self._opt_seen = True
        snapshot = "update" in self.sites
        closure, where = _closure_of(args, kwargs) if "grad" in self.sites else (None, None)
        if closure is None:
            self._measure(prs, snapshot=snapshot, scale=_grad_scale(opt)[0])
            return None
        # optimizer.step(closure): the closure computes the gradient (zero_grad, forward,
        # backward, clipping: Lightning's automatic optimization): measure it when it returns
        self._measure(prs, snapshot=snapshot, grads=False)
        frame.grad_pending = True
        wrapped = self._wrap_closure(closure, frame)
        if where == "closure":
            kwargs = {**kwargs, "closure": wrapped}
        else:
            args = (*args[:where], wrapped, *args[where + 1:])
        return args, kwargs

    def _wrap_closure(self, closure, frame: _Frame):
        ref = weakref.ref(self)

        @functools.wraps(closure)
        def measured_closure(*a, **k):
            try:
                out = closure(*a, **k)
            except BaseException:
                me = ref()
                if me is not None:
                    me._pop_frame(frame.opt, frame)  # the step raises: it never finishes
                raise
            if frame.grad_pending:  # the first call: the gradient at the weights measured
                frame.grad_pending = False
                me = ref()
                if me is not None and me.bank.live and not me._off():
                    try:
                        me._measure_grads(frame.prs)
                    except Exception as exc:  # noqa: BLE001 - the plugin's, not the closure's
                        me._hook_failed("its optimizer step closure", exc)
            return out

        return measured_closure

    def _pop_frame(self, opt, frame: Optional[_Frame] = None) -> Optional[_Frame]:
        """Take ``opt``'s step (or ``frame``) and any step left open inside it off the stack."""
        frames = self._frames
        for i in range(len(frames) - 1, -1, -1):
            f = frames[i]
            if (f is frame) if frame is not None else (f.opt is opt):
                del frames[i:]
                return f
        return None

    def _opt_post(self, opt, args=None, kwargs=None):
        frame = self._pop_frame(opt)
        if frame is None or not frame.prs or not self.bank.live or self._off():
            return None
        try:
            if frame.grad_pending:  # a closure the optimizer never called: the grad as it is
                frame.grad_pending = False
                self._measure_grads(frame.prs)
            if "update" in self.sites:
                self._update(frame.prs, _grad_scale(opt)[1])
        except Exception as exc:  # noqa: BLE001 - the plugin's, not the optimizer's
            self._hook_failed("its optimizer step post-hook", exc)
        return None

    def _off(self) -> bool:
        """Removed, or disabled by an error under ``on_error="warn"``: the optimizer hooks
        (torch's, which the session does not route) do nothing from then on."""
        return plugin_off(self, self._session_ref() if self._session_ref is not None else None)

    def _hook_failed(self, where: str, exc: Exception) -> None:
        """An error in an optimizer hook, through the session's ``on_error``."""
        plugin_failed(self, self._session_ref() if self._session_ref is not None else None, where, exc)

    def _refresh_replicas(self) -> None:
        """This rank and the number of ranks holding replicas of a plain parameter (the
        process group of the DistributedDataParallel attached through, else the world), read
        until there is a process group: a session attached before ``init_process_group``
        counted each replica on every rank."""
        if self._world > 1 or self._session_ref is None:
            return
        session = self._session_ref()
        d = initialized_dist() if session is not None and session.distributed else None
        if d is not None:
            group = session._replica_group
            self._rank, self._world = d.get_rank(group), d.get_world_size(group)

    def _find_holders(self, session) -> None:
        """Which ranks of the replica group hold each parameter, from one ``all_gather_object``
        of the names at attach (every rank attaches): a replicated parameter is counted by one
        of the ranks holding a parameter of its name, round-robin over them, so the stages of a
        pipeline (each rank holding other parameters) are each counted whole. Attached before
        ``init_process_group``: every rank of the group is taken as holding every parameter."""
        if self.plain_tensors != "replicated" or self._world < 2:
            return
        d = initialized_dist()
        names = [pr.name for pr in self._params]
        held: List[Any] = [None] * self._world
        d.all_gather_object(held, names, group=session._replica_group)
        holders: Dict[str, List[int]] = {}
        for r, ns in enumerate(held):
            for n in ns:
                holders.setdefault(n, []).append(r)
        index = {n: i for i, n in enumerate(sorted(holders))}  # the same on every rank
        for pr in self._params:
            ranks = holders[pr.name]
            pr.owner = ranks[index[pr.name] % len(ranks)]

    # -- session -----------------------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        self.bank.reset()  # an instance attached again starts afresh, as a new one would
        self._last = None
        # (the last session's optimizer entries name its _Param objects: measured in place of
        # this session's, which were then measured again at step())
        self._opt_cache, self._frames, self._opt_seen = {}, [], False
        self._session_ref = weakref.ref(session)
        self._rank, self._world = 0, 1
        self._refresh_replicas()
        self._ever_named = set()
        self._select(session)
        self._find_holders(session)
        # every row now, in name order: the same layout on every rank, whatever each holds
        for pr in self._params:
            for s in self.sites:
                self.bank.row_of(pr.keys[s])
        device = None
        for pr in self._params:
            t = pr.tensor()
            if t is not None:
                device = t.to_local().device if is_dtensor(t) else t.device
                break
        self.bank.prepare(device)  # none on the meta device: made when it is materialized
        self.bank.set_live(session.sampled)
        if self._optimizers is not None:  # a step that runs none of them: GradScaler skipped it
            self._opt_seen = True
        if self._optimizers is None:
            from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                               register_optimizer_step_pre_hook)
            self._handles = [register_optimizer_step_pre_hook(_outside_dynamo(self._opt_pre)),
                             register_optimizer_step_post_hook(_outside_dynamo(self._opt_post))]
        else:
            self._handles = []
            for opt in filter(None, (ref() for ref in self._optimizers)):
                self._handles += [opt.register_step_pre_hook(_outside_dynamo(self._opt_pre)),
                                  opt.register_step_post_hook(_outside_dynamo(self._opt_post))]
        if dynamo_disable() is None:  # (wrapped at the first compile start)
            _BARE_HOOKS.add(self)
        baselines = []
        if "update" in self.sites and not self._opt_seen:  # (see _Baseline)
            owners: Dict[int, Tuple[Any, List[_Param]]] = {}
            for pr in self._params:
                t, mod = pr.tensor(), pr.module_ref()
                if t is not None and mod is not None and is_lazy(t):
                    owners.setdefault(id(mod), (mod, []))[1].append(pr)
            for mod, prs in owners.values():
                baseline = _Baseline(self, prs)
                baseline.handle = mod.register_forward_pre_hook(baseline)
                session._keep_handle(mod, baseline.handle)  # (copies of the model leave it out)
                baselines.append(baseline.handle)
        # a session dropped without remove(): torch's global hooks would keep this plugin (its
        # bank, the update copies) alive and called at every optimizer step of the process
        self._unhook = weakref.finalize(session, _remove_handles, list(self._handles) + baselines)
        self._baselines = baselines
        if "update" in self.sites and session.sampled and not self._opt_seen:  # the baseline without an optimizer
            for pr in self._params:
                w = self._local(pr, pr.tensor())
                if w is not None:
                    self._snapshot(pr, w)

    def measure_unstepped(self) -> None:
        """Measure now what ``session.step()`` would: the weight and gradient of each
        parameter no optimizer step measured in the step in progress (a step ``GradScaler``
        skipped). For a loop that frees the gradients (``zero_grad()``) before it calls
        ``session.step()``: call this before ``zero_grad()``. Hugging Face's Trainer
        callback does (``on_optimizer_step``)."""
        if not self.bank.live or self._off():
            return
        frames, self._frames = self._frames, []  # steps left open (one raised) end here
        for f in frames:
            if f.grad_pending and f.prs:
                f.grad_pending = False
                self._measure_grads(f.prs)
        todo = [pr for pr in self._params if not pr.done]
        if todo:
            if not self._opt_seen and "update" in self.sites:
                self._update(todo)  # no optimizer: the change since the last step()
            elif self._opt_seen:
                self._release_copies(todo)
            self._measure(todo, snapshot=False)

    def _release_copies(self, prs) -> None:
        """Drop the update copy (the attach-time baseline) of each of ``prs`` that no optimizer
        seen so far holds (a frozen backbone left out of the optimizer): with an optimizer
        the update is taken around its steps only, so that copy would be held, unused, for
        the whole run. Parameters of a known optimizer (a step ``GradScaler`` skipped) keep
        theirs for reuse."""
        held = {pr.index for ref, _, ps, _ in self._opt_cache.values() if ref() is not None for pr in ps}
        for pr in prs:
            if pr.index not in held:
                pr.prev = None

    @hookimpl
    def hookplug_step(self, session, step):
        if self.bank.live and not session._evaluation_only:  # (a trainer's evaluation before
            self.measure_unstepped()  # training: no training step to measure)
        self._frames = []
        for pr in self._params:
            pr.done = False
        self.bank.end_step(step, warn_unflushed=session.has_sinks)
        if self.bank.pending:
            self._last = self.bank.pending[-1][1]
        live_next = session.sampled
        if live_next and self._retied():  # (checked before the steps measured only)
            self._select_again(session)
        if "update" in self.sites and not self._opt_seen and live_next:
            for pr in self._params:  # the baseline of the next step's update
                w = self._local(pr, pr.tensor())
                if w is not None:
                    self._snapshot(pr, w)
        self.bank.set_live(live_next)

    @hookimpl
    def hookplug_session_end(self, session):
        if self._unhook is not None:
            self._unhook.detach()
            self._unhook = None
        _remove_handles(self._handles + self._baselines)
        self._handles, self._baselines = [], []
        self._frames = []
        for pr in self._params:
            pr.prev = None  # the update copies' memory

    @hookimpl
    def hookplug_collect(self, session, step):
        return self.bank.collect_for(
            self, session, lambda key, st: {"step": st, "module": key[0], "site": key[1], "phase": "train"})

    @hookimpl
    def hookplug_flush(self, records):
        """Adds ``update_to_weight`` (update.l2 / weight.l2, from the merged rows) to the
        ``"update"`` records of this plugin before the sinks see them."""
        names = self._names
        weight = {(r["step"], r["module"]): r["l2"] for r in records
                  if r.get("site") == "weight" and r["module"] in names}
        for r in records:
            if r.get("site") == "update" and r["module"] in names:
                w = weight.get((r["step"], r["module"]))
                if w is not None:
                    r["update_to_weight"] = r["l2"] / w if w > 0 else math.nan

    @property
    def _names(self) -> set:
        return self._ever_named

    # -- results -----------------------------------------------------------------------------------

    def reset(self) -> None:
        self.bank.reset()
        self._last = None
        for pr in self._params:
            for s in self.sites:
                self.bank.row_of(pr.keys[s])

    def _rows(self, over: str) -> Optional[torch.Tensor]:
        """One row per bank key, merged over the devices the parameters live on (a model
        split over devices: each parameter is measured on its own)."""
        if over == "all":
            return self.bank.total_rows()
        n = len(self.bank.keys)
        if not n or not self.bank._devices:
            return None
        per_device = []
        for device, dev in self.bank._devices.items():
            cur = dev.current()[1:n + 1]
            last = None if self._last is None else self._last.get(device)
            if last is not None:  # a parameter the running step has not measured: the last step's
                last = pad_rows(last, dev.empty[:n + 1])[1:n + 1]
                cur = torch.where(self._measured(touched(cur))[:, None], cur, last)
            per_device.append(cur)
        return merge_devices(per_device)

    def _measured(self, rows_touched: torch.Tensor) -> torch.Tensor:
        """Per row, whether any row of its parameter is touched (a frozen parameter's step has
        a weight and an update but no gradient: its grad is not the last step's then)."""
        keys = self.bank.keys[:rows_touched.shape[0]]
        first: Dict[str, int] = {}
        owner = torch.tensor([first.setdefault(k[0], len(first)) for k in keys], device=rows_touched.device)
        per_param = torch.zeros(len(first), dtype=torch.int32, device=rows_touched.device)
        return per_param.index_add_(0, owner, rows_touched.to(torch.int32))[owner] > 0

    def results(self, over: str = "step") -> Dict[str, Dict[str, TensorStats]]:
        """``{param: {site: TensorStats}}`` of this rank (unmerged under torch.distributed:
        the exact merged numbers are in the telemetry records). ``over="step"``: the step
        in progress if it measured anything, else the last one that ended; ``over="all"``:
        merged over every step."""
        if over not in ("step", "all"):
            raise ValueError(f"params.results: over must be 'step' or 'all', got {over!r}")
        rows = self._rows(over)
        if rows is None:
            return {}
        used = touched(rows).tolist()
        out: Dict[str, Dict[str, TensorStats]] = {}
        for i, key in enumerate(self.bank.keys):
            if used[i]:
                out.setdefault(key[0], {})[key[1]] = TensorStats(rows[i], self.bank.kind)
        return out

    def update_to_weight(self, over: str = "step") -> Dict[str, torch.Tensor]:
        """``{param: update.l2 / weight.l2}`` (0-d device tensors) where both are measured."""
        out = {}
        for name, sites in self.results(over).items():
            if "update" in sites and "weight" in sites:
                out[name] = sites["update"].l2 / sites["weight"].l2
        return out

    def report(self) -> str:
        res = self.results()
        if not res:
            return ""
        lines = [f"{'parameter':<40} {'site':<7} {'numel':>10} {'l2':>11} {'rms':>11} "
                 f"{'absmax':>11} {'zero%':>7}"]
        for name, sites in res.items():
            for site, st in sites.items():
                d = st.to_dict()
                lines.append(f"{name:<40} {site:<7} {d['numel']:>10} {d['l2']:>11.4g} "
                             f"{d['rms']:>11.4g} {d['absmax']:>11.4g} "
                             f"{100 * d['zero_fraction']:>6.2f}%")
        return "\n".join(lines)
