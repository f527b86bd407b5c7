"""``flops``: FLOPs of the selected modules, forward and backward, counted at the aten level.

    with hookplug.attach(model, "*, *:", plugins="flops") as session:   # every module + root
        model(x).sum().backward()
    session["flops"].results()["layer1.0"]   # {"flops", "macs", "params", "backward_flops"}
    session["flops"].total()                 # the whole session, nothing counted twice
    session["flops"].uncounted()             # {"aten.add": 12, ...}: ops with no formula

What is counted. Every aten op the session runs goes through a ``TorchDispatchMode``; an op
with a formula in ``torch.utils.flop_counter.flop_registry`` (matmuls, convolutions,
attention kernels: the formulas ``FlopCounterMode`` uses) adds ``formula(args, out)`` FLOPs,
where FLOPs = 2 x MACs as PyTorch counts them, so ``macs == flops // 2``. Ops without a
formula are executed as ``FlopCounterMode`` does (a composite op is decomposed first, so its
matmuls are seen), and every such op that does arithmetic is tallied in ``uncounted()``.

Beyond ``torch.utils.flop_counter`` (``extra_formulas=True``): attention kernels that torch
runs but its registry has no formula for get the formula of the other SDPA kernels:
``aten._scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_attention``
runs on CPU) and its backward, ``_scaled_dot_product_fused_attention_overrideable`` (+
backward), ``_scaled_dot_product_attention_math_for_mps``,
``_flash_attention_forward_no_dropout_inplace``, and ``_native_multi_head_attention`` (the
inference fast path of ``nn.MultiheadAttention``: input/output projections + attention).
So an SDPA layer and the same layer written with ``softmax(q @ k.T) @ v`` count the same
forward FLOPs. Backward differs by design of the formulas: torch's SDPA backward formula
includes recomputing ``q @ k.T`` (5 matmuls), the eager backward runs 4.

Attribution. Forward: an op counts for every selected module whose forward is running
(inclusive of children; a module called twice counts twice; a module nested in itself counts
once per op). Backward: an op counts for every selected module whose forward *created the
autograd node that runs it* (``torch._C._current_autograd_node()``, matched against the
autograd sequence numbers handed out during each module call). This is exact also for
branches (q/k/v projections reading one tensor, a residual shortcut), where
``FlopCounterMode``'s time-window tracking charges a module for the backward of its siblings.
Backward ops run outside any module's nodes (the loss, a custom ``backward`` hook) count in
``total()`` only.

Lifetime. The mode is pushed on the dispatch-mode stack of the thread that calls ``attach``
(``hookplug_session_start``) and taken off at ``session.remove()``; ops of other threads are
not seen, except the autograd engine's, which inherits the mode from the thread calling
``backward()`` (so call ``backward()`` inside the session). If sessions end out of order the
mode is taken out of the middle of the stack, leaving the others in place. With
``every=N`` only sampled steps are counted.

``uncounted()`` leaves out ops that only create, move or reinterpret data: views, copies and
dtype/device conversions, creation/fill ops, random-number generation, concatenation,
padding, gather/index/select ops and scalar reads, plus the ``hookplug`` namespace (other
plugins' statistics). Everything else without a formula is listed (pointwise ops, reductions,
normalizations, softmax, ... : torch counts those as 0 FLOPs and so does this plugin).

Options (keyword-only):

- ``formulas``: ``{op: formula}`` extra formulas, like ``FlopCounterMode(custom_mapping=)``:
  ``op`` an ``OpOverloadPacket`` (``torch.ops.mylib.myop``), ``formula(*arg_shapes,
  out_shape=..., **kwargs) -> int`` called with shapes in place of tensors (or with the
  tensors themselves if it has ``_get_raw = True``). They override the built-in ones.
- ``extra_formulas=True``: count the attention kernels listed above (False: exactly torch's
  registry, e.g. to compare with ``FlopCounterMode``).

``results()``: ``{module name: {"flops", "macs", "params", "backward_flops"}}`` (ints;
``params`` counts the module's parameters including its children's). ``total()``: the same
keys for the whole session (``params``: the model's). ``reset()`` forgets the counts.

Limitations. The dispatch mode sees every aten op the session's thread (and its autograd
engine) runs, including the ops that *other plugins' hooks* run inside the session, e.g.
``gradclamp``'s clamp (and norm) of a gradient in backward, or a third-party plugin's
arithmetic. Those without a formula show up in ``uncounted()``; a matmul or convolution run
by another plugin is counted like the model's own (in ``total()``, and in the module it is
attributed to by the rules above). Only the ``hookplug`` namespace (the ``stats`` op) is
left out. For an exact count of the model alone, run ``flops`` in a session of its own.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter, defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode

import hookplug
from hookplug import hookimpl
from hookplug.structures import iter_tensors

__all__ = ["FlopsPlugin", "count_flops"]

aten = torch.ops.aten

_META_KEY = "hookplug_flops"

# -- torch internals, guarded (torch >= 2.4) ------------------------------------------------------

_current_node = getattr(torch._C, "_current_autograd_node", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_peek_seq = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None) or getattr(
    torch.autograd, "_get_sequence_nr", None)
_HOP = getattr(getattr(torch, "_ops", None), "HigherOrderOperator", ())


def _in_backward() -> bool:
    return _graph_task_id is not None and _graph_task_id() != -1


# Ops FlopCounterMode hands back untouched (size/stride queries of tensor subclasses).
_PASS_THROUGH = set()
for _n, _o in (("sym_is_contiguous", "default"), ("is_contiguous", "default"),
               ("is_contiguous", "memory_format"), ("is_strides_like_format", "default"),
               ("is_non_overlapping_and_dense", "default"), ("size", "default"),
               ("sym_size", "default"), ("stride", "default"), ("sym_stride", "default"),
               ("storage_offset", "default"), ("sym_storage_offset", "default"),
               ("numel", "default"), ("sym_numel", "default"), ("dim", "default")):
    _op = getattr(getattr(aten, _n, None), _o, None)
    if _op is not None:
        _PASS_THROUGH.add(_op)
_PRIM_LAYOUT = getattr(getattr(torch.ops.prim, "layout", None), "default", None)
if _PRIM_LAYOUT is not None:
    _PASS_THROUGH.add(_PRIM_LAYOUT)
_PRIM_DEVICE = torch.ops.prim.device.default

# Ops that only create, move or reinterpret data: never listed in ``uncounted()``.
_NO_ARITHMETIC = frozenset("""
    copy_ _to_copy clone contiguous detach detach_ lift lift_fresh lift_fresh_copy alias
    _copy_from _copy_from_and_resize _to_dense to_dense _unsafe_view view_copy expand_copy
    permute_copy t_copy transpose_copy _reshape_alias_copy _reshape_copy
    empty empty_like empty_strided empty_permuted new_empty new_empty_strided zeros zeros_like
    new_zeros ones ones_like new_ones full full_like new_full scalar_tensor arange eye fill fill_
    zero_ resize_ resize_as_ set_ _local_scalar_dense item _assert_async _assert_tensor_metadata
    sym_constrain_range sym_constrain_range_for_size _assert_scalar record_stream
    rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_
    bernoulli bernoulli_ random_ exponential_ geometric_ log_normal_ cauchy_
    cat stack hstack vstack constant_pad_nd reflection_pad1d reflection_pad2d replication_pad1d
    replication_pad2d index index_select gather embedding masked_fill masked_fill_ where
    index_put index_put_ _index_put_impl_ _unsafe_index _unsafe_index_put scatter scatter_
    slice_scatter select_scatter as_strided_scatter diagonal_scatter repeat roll flip tril triu
    tril_ triu_ masked_select nonzero view_as_real view_as_complex _conj _neg_view
    _conj_physical resolve_conj resolve_neg _unsafe_split split_with_sizes_copy unbind_copy
""".split())


def _is_view(func) -> bool:
    try:
        return bool(func.is_view)
    except AttributeError:
        rets = func._schema.returns
        return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _shift(formula: Callable, n: int = 1) -> Callable:
    """``formula`` for an op that takes ``n`` extra leading arguments (an out tensor)."""
    def shifted(*args, **kwargs):
        return formula(*args[n:], **kwargs)
    return shifted


def _native_mha_flop(query, key, value, embed_dim, num_head, *args, out_val=None, **kwargs) -> int:
    """``aten._native_multi_head_attention``: q/k/v projections, attention, out projection,
    composed from torch's ``mm`` and SDPA formulas."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3 or query.is_nested:
        raise NotImplementedError("only dense (batch, seq, embed) inputs are counted")
    mm = _fc.flop_registry[aten.mm]
    b, t, e = query.shape
    s = key.shape[1]
    d = embed_dim // num_head
    flops = mm((b * t, e), (e, embed_dim)) + 2 * mm((b * s, e), (e, embed_dim))
    flops += _fc.sdpa_flop_count((b, num_head, t, d), (b, num_head, s, d), (b, num_head, s, d))
    flops += mm((b * t, embed_dim), (embed_dim, embed_dim))
    return flops


_native_mha_flop._get_raw = True


def _extra_formulas() -> Dict[Any, Callable]:
    """Formulas for attention kernels that torch runs but its registry does not count, built
    from the registry's own entries for the other SDPA kernels (same argument layout)."""
    reg = _fc.flop_registry
    fwd = reg.get(aten._scaled_dot_product_flash_attention)
    bwd = reg.get(aten._scaled_dot_product_flash_attention_backward)
    out: Dict[Any, Callable] = {}

    def add(name: str, formula: Optional[Callable]) -> None:
        op = getattr(aten, name, None)
        if op is not None and formula is not None and op not in reg:
            out[op] = formula

    # (query, key, value, ...) -> like the other SDPA forwards
    add("_scaled_dot_product_flash_attention_for_cpu", fwd)
    add("_scaled_dot_product_fused_attention_overrideable", fwd)
    add("_scaled_dot_product_attention_math_for_mps", fwd)
    # (grad_out, query, key, value, ...) -> like the other SDPA backwards
    add("_scaled_dot_product_flash_attention_for_cpu_backward", bwd)
    add("_scaled_dot_product_fused_attention_overrideable_backward", bwd)
    raw_flash = reg.get(aten._flash_attention_forward)
    add("_flash_attention_forward_no_dropout_inplace", raw_flash and _shift(raw_flash))
    if hasattr(_fc, "sdpa_flop_count"):
        add("_native_multi_head_attention", _native_mha_flop)
    return out


def _formula_table(formulas: Optional[Dict[Any, Callable]], extra: bool) -> Dict[Any, Callable]:
    table = dict(_fc.flop_registry)
    if extra:
        table.update(_extra_formulas())
    for op, fn in (formulas or {}).items():
        if isinstance(op, torch._ops.OpOverload):
            op = op.overloadpacket
        if not callable(fn):
            raise TypeError(f"flops: formulas[{op}] must be callable, got {type(fn).__name__}")
        table[op] = fn if getattr(fn, "_get_raw", False) else _fc.shape_wrapper(fn)
    return table


# -- the dispatch mode ----------------------------------------------------------------------------

class _CountingMode(TorchDispatchMode):
    """Counts FLOPs for ``plugin``; a pass-through once ``plugin`` is None."""

    supports_higher_order_operators = True

    def __init__(self, plugin: "FlopsPlugin"):
        super().__init__()
        self.plugin: Optional[FlopsPlugin] = plugin

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plugin = self.plugin
        if plugin is None or not plugin._counting or plugin._session_gone():
            return func(*args, **kwargs)
        if func in _PASS_THROUGH:
            return NotImplemented
        if isinstance(func, _HOP):
            out = func(*args, **kwargs)
            self._count(plugin, func, func, args, kwargs, out)
            return out
        packet = func._overloadpacket
        if packet not in plugin._formulas and func is not _PRIM_DEVICE:
            # as FlopCounterMode: a composite op is counted through its decomposition
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        self._count(plugin, func, packet, args, kwargs, out)
        return out

    def _count(self, plugin, func, packet, args, kwargs, out) -> None:
        try:
            formula = plugin._formulas.get(packet)
            if formula is not None:
                plugin._add(packet, formula, args, kwargs, out)
            elif func not in plugin._quiet:
                plugin._note_uncounted(func, packet)
        except Exception as exc:  # noqa: BLE001 - never alter the model's computation
            self.plugin = None
            warnings.warn(f"flops: counting failed on {func} ({type(exc).__name__}: {exc}); the "
                          "plugin stops counting for this session", RuntimeWarning, stacklevel=2)


class _Call:
    """One call of a selected module: the autograd sequence numbers ``[lo, hi)`` of the nodes
    its forward created. Kept alive by the metadata of its output's ``grad_fn``, so it lives
    exactly as long as the graph that can run its backward."""

    __slots__ = ("name", "lo", "hi", "__weakref__")

    def __init__(self, name: str, lo: int, hi: int):
        self.name, self.lo, self.hi = name, lo, hi


def _stack_of_modes() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return _get_current_dispatch_mode_stack()


def _leave_mode(mode: TorchDispatchMode) -> bool:
    """Take ``mode`` off this thread's dispatch-mode stack, wherever it is. False if it is not
    on this thread's stack."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode
    stack = _stack_of_modes()
    if not any(m is mode for m in stack):
        return False
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return True
    above = []
    while True:
        m = _pop_mode()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        _push_mode(m)
    # Modes above are still active: keep the "in a mode" flags set, only drop what our
    # __enter__ saved so the bookkeeping stays balanced.
    for attr in ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                 "old_without_ignore_compile_internals_dispatch_mode_flags"):
        saved = getattr(mode, attr, None)
        if saved:
            saved.pop()
    return True


# -- the plugin -----------------------------------------------------------------------------------

class FlopsPlugin(hookplug.Plugin):
    """FLOPs (and MACs) of the selected modules, forward and backward, inclusive of children.
    See the module docstring for what is counted and the options."""

    name = "flops"

    def __init__(self, *, formulas: Optional[Dict[Any, Callable]] = None,
                 extra_formulas: bool = True):
        if formulas is not None and not isinstance(formulas, dict):
            raise TypeError("flops: formulas must be a dict {op: formula}, got "
                            f"{type(formulas).__name__}")
        self.extra_formulas = bool(extra_formulas)
        self._formulas = _formula_table(formulas, self.extra_formulas)
        self._quiet: set = set()          # op overloads that never go to uncounted()
        self._counting = False
        self._mode: Optional[_CountingMode] = None
        self._thread: Optional[int] = None
        self._names: List[str] = []
        self._params: Dict[str, int] = {}
        self._model_params = 0
        self._warned: set = set()
        self._live: "weakref.WeakSet[_Call]" = weakref.WeakSet()
        self._session_ref: Callable[[], Any] = lambda: None
        self._stack: List[Tuple[Any, int]] = []   # (ctx, sequence number at entry) per open call
        self._active: Tuple[str, ...] = ()        # names of the selected modules running now
        self._reset_state()

    # -- public -----------------------------------------------------------------------------------

    def results(self) -> Dict[str, Dict[str, int]]:
        """``{module name: {"flops", "macs", "params", "backward_flops"}}`` for every selected
        module, in model order (zeros for a module that did not run)."""
        names = self._names or sorted(set(self._fwd) | set(self._bwd))
        return {n: self._row(self._fwd.get(n, 0), self._bwd.get(n, 0), self._params.get(n, 0))
                for n in names}

    def total(self) -> Dict[str, int]:
        """The whole session (every op counted once, whatever the selection): the same keys as
        a row of ``results()``; ``params`` is the model's parameter count."""
        return self._row(self._total_fwd, self._total_bwd, self._model_params)

    def uncounted(self) -> Dict[str, int]:
        """``{op name: calls}`` of the ops that ran while counting, do arithmetic and have no
        formula (see the module docstring for what is left out), most called first."""
        return dict(self._uncounted.most_common())

    def by_op(self) -> Dict[str, Dict[str, int]]:
        """``{op name: {"flops", "backward_flops"}}`` over the whole session."""
        ops = sorted(set(self._op_fwd) | set(self._op_bwd))
        return {op: {"flops": self._op_fwd.get(op, 0), "backward_flops": self._op_bwd.get(op, 0)}
                for op in ops}

    def reset(self) -> None:
        self._reset_state()

    def report(self) -> str:
        rows = self.results()
        tot = self.total()
        header = ("module", "params", "FLOPs", "MACs", "backward FLOPs", "% fwd")
        body = []
        for name, r in rows.items():
            pct = f"{100.0 * r['flops'] / tot['flops']:.1f}" if tot["flops"] else "-"
            body.append((name or "(root)", f"{r['params']:,}", f"{r['flops']:,}", f"{r['macs']:,}",
                         f"{r['backward_flops']:,}", pct))
        body.append(("total", f"{tot['params']:,}", f"{tot['flops']:,}", f"{tot['macs']:,}",
                     f"{tot['backward_flops']:,}", "100.0" if tot["flops"] else "-"))
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]

        def fmt(row):
            return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths)))

        lines = [fmt(header), fmt(tuple("-" * w for w in widths))]
        lines += [fmt(r) for r in body[:-1]]
        lines += [fmt(tuple("-" * w for w in widths)), fmt(body[-1])]
        unc = self.uncounted()
        if unc:
            shown = ", ".join(f"{op} x{n}" for op, n in list(unc.items())[:12])
            more = f", ... ({len(unc) - 12} more)" if len(unc) > 12 else ""
            lines.append(f"ops without a FLOP formula (counted as 0): {shown}{more}")
        return "\n".join(lines)

    # -- session hooks ----------------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        self._reset_state()
        self._live = weakref.WeakSet()
        self._session_ref = weakref.ref(session)
        mods = session.modules_of(self)
        self._names = list(mods)
        self._params = {n: sum(p.numel() for p in m.parameters()) for n, m in mods.items()}
        model = session.model
        self._model_params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        self._stack = []
        self._active = ()
        self._thread = threading.get_ident()
        self._counting = session.step_index % session.every == 0
        if _peek_seq is None or _current_node is None:
            warnings.warn("flops: this torch has no autograd node introspection; backward FLOPs "
                          "are counted in total() only", RuntimeWarning, stacklevel=2)
        self._mode = _CountingMode(self)
        self._mode.__enter__()

    @hookimpl
    def hookplug_session_end(self, session):
        mode, self._mode = self._mode, None
        self._counting = False
        self._stack = []
        self._active = ()
        if mode is None:
            return
        mode.plugin = None  # a pass-through from now on, wherever it is
        if not _leave_mode(mode):
            warnings.warn(
                "flops: the session ended in another thread than the one that attached it; its "
                "(now inactive) dispatch mode stays on that thread's mode stack", RuntimeWarning,
                stacklevel=2)

    @hookimpl
    def hookplug_step(self, session):
        self._counting = self._mode is not None and session.step_index % session.every == 0

    # -- per-call hooks ---------------------------------------------------------------------------

    @hookimpl
    def hookplug_forward_input(self, ctx):
        if self._mode is None or threading.get_ident() != self._thread or _in_backward():
            return None
        self._stack.append((ctx, _peek_seq() if _peek_seq is not None else 0))
        self._active = tuple(dict.fromkeys(c.name for c, _ in self._stack))
        return None

    @hookimpl
    def hookplug_forward_output(self, ctx, output):
        if self._mode is None or threading.get_ident() != self._thread or _in_backward():
            return None
        stack = self._stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is ctx:
                break
        else:
            return None
        lo = stack[i][1]
        del stack[i:]  # drops entries left by a forward that raised, too
        self._active = tuple(dict.fromkeys(c.name for c, _ in stack))
        if _peek_seq is None or not torch.is_grad_enabled():
            return None
        hi = _peek_seq()
        if hi <= lo:
            return None
        call = None
        for _, t in iter_tensors(output):
            fn = t.grad_fn
            if fn is None:
                continue
            if call is None:
                call = _Call(ctx.name, lo, hi)
                self._live.add(call)
            fn.metadata.setdefault(_META_KEY, []).append(call)
        return None

    # -- counting ---------------------------------------------------------------------------------

    def _session_gone(self) -> bool:
        """The session was removed without ending this plugin (a plugin disabled under
        ``on_error="warn"`` gets no ``hookplug_session_end``): stop counting."""
        s = self._session_ref()
        if s is None or s.removed:
            self._counting = False
            return True
        return False

    def _reset_state(self) -> None:
        self._fwd: Dict[str, int] = defaultdict(int)
        self._bwd: Dict[str, int] = defaultdict(int)
        self._op_fwd: Dict[str, int] = defaultdict(int)
        self._op_bwd: Dict[str, int] = defaultdict(int)
        self._total_fwd = 0
        self._total_bwd = 0
        self._uncounted: Counter = Counter()
        self._bw_task = None
        self._bw_cache: Dict[int, Tuple[str, ...]] = {}

    @staticmethod
    def _row(fwd: int, bwd: int, params: int) -> Dict[str, int]:
        return {"flops": int(fwd), "macs": int(fwd) // 2, "params": int(params),
                "backward_flops": int(bwd)}

    def _add(self, op, formula, args, kwargs, out) -> None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception as exc:  # noqa: BLE001 - a formula that cannot handle these inputs
            name = f"{op} (formula failed)"
            self._uncounted[name] += 1
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"flops: the FLOP formula of {op} failed ({type(exc).__name__}: "
                              f"{exc}); counted as 0 and listed in uncounted()", RuntimeWarning,
                              stacklevel=2)
            return
        key = str(op)
        if _in_backward():
            self._total_bwd += flops
            self._op_bwd[key] += flops
            for name in self._backward_owners():
                self._bwd[name] += flops
        else:
            self._total_fwd += flops
            self._op_fwd[key] += flops
            for name in self._active:
                self._fwd[name] += flops

    def _backward_owners(self) -> Tuple[str, ...]:
        """The selected modules whose forward created the autograd node now running."""
        if _current_node is None:
            return ()
        node = _current_node()
        if node is None:
            return ()
        task = _graph_task_id()
        if task != self._bw_task:
            self._bw_task, self._bw_cache = task, {}
        seq = node._sequence_nr()
        owners = self._bw_cache.get(seq)
        if owners is None:
            owners = tuple(dict.fromkeys(c.name for c in list(self._live) if c.lo <= seq < c.hi))
            self._bw_cache[seq] = owners
        return owners

    def _note_uncounted(self, func, packet) -> None:
        if isinstance(func, _HOP):
            self._uncounted[f"higher_order.{getattr(func, '_name', func)}"] += 1
            return
        ns, _, name = packet._qualified_op_name.partition("::")
        if ns in ("hookplug", "prim") or (ns == "aten" and name in _NO_ARITHMETIC) \
                or _is_view(func):
            self._quiet.add(func)
            return
        self._uncounted[str(packet)] += 1


def count_flops(model: torch.nn.Module, *inputs, selector: str = "*, *:", backward: bool = False,
                **options) -> FlopsPlugin:
    """Run ``model(*inputs)`` (and ``.sum().backward()`` with ``backward=True``) under a flops
    session on the modules ``selector`` picks (all of them and the root by default); return
    the plugin, whose ``results()``/``total()``/``report()`` hold the counts."""
    plugin = FlopsPlugin(**options)
    with hookplug.attach(model, selector, plugins=plugin):
        out = model(*inputs)
        if backward:
            loss = sum(t.float().sum() for _, t in iter_tensors(out) if t.requires_grad)
            loss.backward()
    return plugin
