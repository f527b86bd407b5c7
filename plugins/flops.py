"""``flops``: FLOPs of the selected modules, forward and backward, counted at the aten level.

    with hookplug.attach(model, "*, *:", plugins="flops") as session:   # every module + root
        model(x).sum().backward()
    session["flops"].results()["layer1.0"]   # {"flops", "macs", "params", "backward_flops"}
    session["flops"].total()                 # every selected window, nothing counted twice
    session["flops"].uncounted()             # {"aten.add": 12, ...}: ops with no formula
    session["flops"].total(phase="train")    # training forwards and backwards only (no eval)

Windows. A ``TorchDispatchMode`` is on the mode stack only while a selected module runs:
entered when the outermost selected module's forward starts and left when it returns (also
when it raises), and, in backward, around each autograd node that a selected forward created
(node pre/post hooks registered when the outermost selected forward returns). Outside these
windows no mode is active and torch runs at full speed. One mode per thread serves every
flops plugin, so sessions that end in any order leave the stack balanced. A forward left by
``KeyboardInterrupt`` (post hooks do not run) or by another plugin's exception is detected
from the Python call stack: its ops stop counting, and its mode leaves the stack at the next
selected forward, ``session.step()``, ``remove()``, or when the dropped session is collected.

What is counted. An op with a formula in ``torch.utils.flop_counter.flop_registry`` (matmuls,
convolutions, attention kernels: the formulas ``FlopCounterMode`` uses) adds
``formula(args, out)`` FLOPs, where FLOPs = 2 x MACs as PyTorch counts them, so
``macs == flops // 2``. A composite op that reaches the mode undecomposed (e.g. ``linear``
under ``inference_mode``) is counted through its decomposition, but only when its
decomposition is the kernel torch would run anyway: unlike ``FlopCounterMode``, an op with a
kernel of its own (``silu_backward``, ``gelu_backward``, ...) runs that kernel. And the
decomposition gives no result: the op runs as torch runs it outside the mode (autocast
included, which torch turns off inside a mode: see ``_AUTOCAST_KEYS``), then its
decomposition runs for the counts only, on ``meta`` copies of the inputs (shapes, no
arithmetic; an RNN, many small ops, a tensor subclass, or SDPA on CPU with
``extra_formulas=False``, whose kernel is chosen by device: on the inputs again, its result
dropped, the random state it drew restored), because inside a dispatch mode
the same decomposition can take other kernels (``matmul`` of a non-contiguous batch and a
weight: ``bmm`` in place of one folded ``mm``). So results and gradients are bitwise those
of the model without the plugin (in eager code; under
``torch.compile`` the plugin is ``traceable = False``: its hooks run outside the graph, a
graph break per hooked call, so the compiled graphs are split there and their numerics are
those of the split graphs; ``fullgraph=True`` refuses it with an error naming the plugin).

Beyond ``torch.utils.flop_counter`` (``extra_formulas=True``): attention kernels that torch
runs but its registry has no formula for get the formula of the other SDPA kernels:
``aten._scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_attention``
runs on CPU) and its backward, ``_scaled_dot_product_fused_attention_overrideable`` (+
backward), ``_scaled_dot_product_attention_math_for_mps``,
``_flash_attention_forward_no_dropout_inplace``, ``_native_multi_head_attention`` (the
inference fast path of ``nn.MultiheadAttention``: input/output projections + attention),
``_transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer``'s: attention + its two
feed-forward matmuls), and ``linear`` on a strided nested tensor (its NestedTensor kernel);
these three take nested inputs too (a ``TransformerEncoder`` given ``src_key_padding_mask``),
each sequence counted as if run alone, padding left out.
So an SDPA layer and the same layer written with ``softmax(q @ k.T) @ v`` count the same
forward FLOPs. Backward differs by design of the formulas: torch's SDPA backward formula
includes recomputing ``q @ k.T`` (5 matmuls), the eager backward runs 4.

Attribution. Forward: an op counts for every selected module whose forward is running
(inclusive of children; a module called twice counts twice; a module nested in itself counts
once per op). Backward: an op counts for every selected module whose forward *created the
autograd node that runs it* (matched by autograd sequence number). This is exact also for
branches (q/k/v projections reading one tensor, a residual shortcut), where
``FlopCounterMode``'s time-window tracking charges a module for the backward of its siblings.
``total()`` counts every op of every window once: with the root selected (``"*:"``) it is the
whole model; ops outside all selected modules (the loss, the optimizer) are not seen.
Forward runs of other threads are not counted; the backward of a counted forward is, on
whichever thread autograd runs it. Under activation checkpointing (reentrant or not) the
forward is counted once; the recompute's ops, work the device does in backward, count as
backward FLOPs of each module it re-runs and of the selected modules around the checkpoint:
a module's backward FLOPs are its plain backward plus its own forward (less where a
non-reentrant recompute stops early), and ``total()`` equals ``FlopCounterMode``'s. Ops of
the checkpointed code outside every selected module go to the modules around the
checkpoint (reentrant), or (``use_reentrant=False``) to the module whose backward node
unpacked a saved tensor and so ran the recompute. With
``every=N`` only sampled steps are counted.

``uncounted()`` lists the ops without a formula that do arithmetic (pointwise ops,
reductions, normalizations, softmax, ...: torch counts those as 0 FLOPs and so does this
plugin). Left out, from torch's op tags and schemas: views and view copies (alias
annotations, ``Tag.view_copy``/``inplace_view``), random-number generation
(``Tag.nondeterministic_seeded``, except attention kernels, seeded for their dropout), scalar reads (``Tag.data_dependent_output``), ops that
read no tensor (creation, fills, asserts), creation and conversion ops (``device``/``layout``
or ``memory_format`` arguments: ``*_like``, ``new_*``, ``_to_copy``, ``clone``), and the
data-movement families torch has no tag for (``_DATA_MOVEMENT``: concatenation, padding,
gather/scatter/index ops, ``where``/``masked_fill``, ``repeat``/``flip``/``roll``/``tril``,
copies, ``unsafe_split``, ``slice``/``select`` backward), communication (the ``c10d`` collectives and their functional forms, FSDP2's
``fsdp`` copies); plus the ``hookplug`` namespace (other plugins' statistics).

Options (keyword-only):

- ``formulas``: ``{op: formula}`` extra formulas, like ``FlopCounterMode(custom_mapping=)``:
  ``op`` an ``OpOverloadPacket`` (``torch.ops.mylib.myop``), ``formula(*arg_shapes,
  out_shape=..., **kwargs) -> int`` called with shapes in place of tensors (or with the
  tensors themselves if it has ``_get_raw = True``). They override the built-in ones.
- ``extra_formulas=True``: count the attention kernels listed above (False: exactly torch's
  registry, e.g. to compare with ``FlopCounterMode``).

``results()``: ``{module name: {"flops", "macs", "params", "backward_flops"}}`` (ints;
``params`` counts the module's parameters including its children's when read, so a layer
added after attach counts; 0 while one of them is a lazy module's, not yet sized by its
first forward). ``total()``: the same keys for every
window (``params``: the model's, 0 while any lazy parameter is unsized). ``reset()`` forgets
the counts.

Limitations. Inside a window the mode sees the ops that *other plugins' hooks* run in
forward (a third-party plugin's arithmetic in ``forward_input``/``forward_output``); those
without a formula show up in ``uncounted()``, a matmul is counted like the model's own. In
backward, other plugins' gradient hooks (tensor hooks on outputs, e.g. ``gradclamp``) run
before the node's window opens and are not seen. Only the ``hookplug`` namespace (the
``stats`` op) is left out. Autograd nodes that a selected forward created but that are not
reachable from the selected modules' outputs (a tensor kept on ``self`` and used later) get
no backward window.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import sys
import threading
import warnings
import weakref
from collections import Counter, defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.nn.parameter import is_lazy
import torch.utils.flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode

import hookplug
from hookplug import hookimpl
from hookplug._plugin import plugin_failed, user_stacklevel
from hookplug._binding import _phase_of, _run_eagerly
from hookplug._optional import import_off_stack
from hookplug.structures import iter_tensors

__all__ = ["FlopsPlugin", "count_flops"]

aten = torch.ops.aten
_DK = torch._C.DispatchKey

# -- torch internals, read only (torch >= 2.4) ----------------------------------------------------

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_peek_seq = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None) or getattr(
    torch.autograd, "_get_sequence_nr", None)
_HOP = getattr(getattr(torch, "_ops", None), "HigherOrderOperator", ())
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_FunctionNode = getattr(torch.autograd.function, "BackwardCFunction", ())
_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _in_backward() -> bool:
    return _graph_task_id is not None and _graph_task_id() != -1


def _mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return _get_current_dispatch_mode_stack()


# what _get_current_dispatch_mode_stack reads the stack with
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at


def _module_call_frame():
    """The frame of the ``nn.Module._call_impl`` that is running the hook calling us."""
    f = sys._getframe(2)
    while f is not None and f.f_code is not _CALL_IMPL:
        f = f.f_back
    return f


def _settle_when_returns(calls: List["_OpenCall"], thread: int, dispatcher: "_Dispatcher") -> None:
    """The session ended on another thread while ``calls`` (selected forwards, outermost
    first) run on ``thread``: the session's hooks are gone, so nothing of the plugin runs
    there again, and that thread's dispatcher, on a mode stack only that thread can leave,
    leaves at the first of these calls to return (a post hook) or to be called again (a pre
    hook: a forward left by Ctrl-C runs no post hook); the hooks then remove themselves.
    Until then its ops run with the innermost call's autocast note, which holds while it runs."""
    if not dispatcher.windows or any(dispatcher.noted is c.noted for c in calls):
        dispatcher.noted = calls[-1].noted  # (not over another session's window still open)
    handles = []

    def settle(*_):
        if threading.get_ident() == thread:
            _settle_this_thread()
            if not dispatcher.entered:  # (a user's mode above it, another session's window:
                for h in handles:  # it stays, and the next of these hooks tries again)
                    h.remove()

    for module in {id(c.module): c.module for c in calls}.values():
        handles.append(module.register_forward_hook(settle, always_call=True))
        handles.append(module.register_forward_pre_hook(settle))


def _running(frame) -> bool:
    """``frame`` is on the current thread's call stack (its function has not returned)."""
    if frame is None:
        return True  # unknown (no frame found at entry): trust the hooks
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


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
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)

# -- which ops do arithmetic (for uncounted()) ------------------------------------------------------

_QUIET_TAGS = frozenset(getattr(torch.Tag, t) for t in (
    "view_copy", "inplace_view", "nondeterministic_seeded", "data_dependent_output")
    if hasattr(torch.Tag, t))
# Data movement that torch marks with no tag (base names; in-place and ``_copy`` variants too).
_DATA_MOVEMENT = frozenset("""
    cat stack constant_pad_nd reflection_pad1d reflection_pad2d reflection_pad3d
    replication_pad1d replication_pad2d replication_pad3d index _unsafe_index index_select
    gather embedding scatter index_put _index_put_impl _unsafe_index_put slice_scatter
    select_scatter as_strided_scatter diagonal_scatter masked_fill where masked_select
    repeat roll flip tril triu fill zero copy _copy_from _copy_from_and_resize _unsafe_view
    _reshape_copy lift to_dense _to_dense _assert_async _assert_tensor_metadata record_stream
    unsafe_split unsafe_split_with_sizes unsafe_chunk slice_backward select_backward
    diagonal_backward _nested_tensor_from_mask _nested_tensor_from_mask_left_aligned
    to_padded_tensor _nested_from_padded _nested_tensor_from_tensor_list
""".split())


# namespaces of communication ops (c10d collectives, their functional forms, FSDP2's copies
# in and out of its all-gather / reduce-scatter buffers, DTensor's autograd wrappers)
_COMMUNICATION = frozenset(("c10d", "_c10d_functional", "c10d_functional",
                            "_c10d_functional_autograd", "fsdp", "_dtensor"))


def _is_tensor_type(t) -> bool:
    return isinstance(t, torch.TensorType) or (
        isinstance(t, (torch.ListType, torch.OptionalType)) and _is_tensor_type(t.getElementType()))


def _does_arithmetic(func) -> bool:
    """False for an op that only creates, moves or reinterprets data, decided from its tags
    and schema (see the module docstring)."""
    quiet = _QUIET_TAGS.intersection(getattr(func, "tags", ()))
    if quiet and not (quiet == {_SEEDED} and "attention" in func._schema.name):
        return False  # (an attention kernel is seeded for its dropout: arithmetic all the same)
    schema = func._schema
    rets = schema.returns
    if rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write:
        return False  # a view
    reads = [a for a in schema.arguments if _is_tensor_type(a.type)
             and not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)]
    if not reads:
        return False  # creation, assert: reads no tensor (``out=`` is written, not read)
    names = {a.name for a in schema.arguments}
    if {"device", "layout"} <= names or "memory_format" in names:
        return False  # *_like, new_*, _to_copy, clone: creation and conversion
    namespace, _, base = schema.name.partition("::")
    if namespace in _COMMUNICATION:
        return False  # collectives and FSDP2's gather/scatter copies: data movement
    base = base.rstrip("_").removeprefix("_foreach_")  # (_foreach_copy_: FSDP2's copy-in)
    return base not in _DATA_MOVEMENT and base.removesuffix("_copy") not in _DATA_MOVEMENT


# -- which composite ops to decompose --------------------------------------------------------------

_HAS_COMPOSITE: Dict[Any, bool] = {}
_DECOMPOSES: Dict[Tuple[Any, str], bool] = {}
_EXPLICIT_KEYS = tuple(getattr(_DK, k) for k in (
    "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional") if hasattr(_DK, k))


def _backend_key(args, kwargs) -> Optional[str]:
    """The device type of the first tensor argument; None where a nested or sparse tensor
    takes part (its kernels live under other dispatch keys: never decompose)."""
    key = None
    for a in (*args, *kwargs.values()):
        t = a[0] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) else a
        if isinstance(t, torch.Tensor):
            if t.is_nested or t.layout != torch.strided:
                return None
            key = key or t.device.type
    return key


def _nested_input(args) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_nested


def _decomposes(func, args, kwargs) -> bool:
    """True when the kernel torch runs for ``func`` on these arguments is its
    CompositeImplicitAutograd decomposition: counting through it changes no numerics."""
    composite = _HAS_COMPOSITE.get(func)
    if composite is None:
        composite = _HAS_COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), _DK.CompositeImplicitAutograd)
    if not composite:
        return False
    device = _backend_key(args, kwargs)
    if device is None:
        return False
    key = (func, device)
    hit = _DECOMPOSES.get(key)
    if hit is None:
        name = func.name()
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        try:
            backend = torch._C._parse_dispatch_key(torch._C._dispatch_key_for_device(device))
        except Exception:  # noqa: BLE001 - an unknown device: never decompose
            backend = None
        hit = (backend is not None and not has(name, backend) and not any(has(name, k) for k in _EXPLICIT_KEYS))
        _DECOMPOSES[key] = hit
    return hit


def _runs_as_torch_does(func) -> bool:
    """Whether a composite op that reaches the mode runs as torch runs it, then decomposed
    again for its counts: not one that writes its inputs (twice would change them) or returns
    a view (no arithmetic; a view made outside the mode cannot be returned from inside)."""
    schema = func._schema
    return not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns)


def _adinplace_as_outside():
    """Inside ``__torch_dispatch__`` the ADInplaceOrView key is excluded (the op passed it):
    views made there have no autograd metadata, so ``weight.t().requires_grad`` is False and
    ``matmul`` decides otherwise than outside the mode."""
    return torch._C._SetExcludeDispatchKeyGuard(_DK.ADInplaceOrView, False)


_ADINPLACE_AS_OUTSIDE = (_adinplace_as_outside if hasattr(torch._C, "_SetExcludeDispatchKeyGuard")
                         else contextlib.nullcontext)

# Autocast inside the mode. Inside ``__torch_dispatch__`` torch also excludes the autocast keys
# (``is_autocast_enabled()`` reads False there), so a composite op reaching the mode whole
# (``einsum``, an RNN: under inference_mode no autograd key decomposes it first) would run its
# inner matmuls without autocast. Autocast's state is noted where it can be read (each
# selected forward's start) with autocast's nesting count; an op that finds the count of the
# running call's note (see _Dispatcher.autocast) runs with the keys noted turned back on,
# else as before (off). A TorchFunctionMode noting it at every torch
# call would be exact, but any such mode on the stack turns off torch's own fast paths
# (``has_torch_function``: MultiheadAttention's, which then refuses nested tensors).
_AUTOCAST_KEYS = tuple((device, getattr(_DK, key)) for device, key in (
    ("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA"), ("xpu", "AutocastXPU"), ("mps", "AutocastMPS"),
    ("hpu", "AutocastHPU")) if hasattr(_DK, key)) if (
    hasattr(torch._C, "_SetExcludeDispatchKeyGuard") and hasattr(torch, "autocast_increment_nesting")) else ()
_AUTOCAST_KEY_OF = dict(_AUTOCAST_KEYS)


def _autocast_keys_on() -> Tuple:
    """The autocast dispatch keys of the devices autocast is on for (read outside the mode)."""
    return tuple(key for device, key in _AUTOCAST_KEYS if torch.is_autocast_enabled(device))


def _autocast_nesting() -> int:
    """How many autocast contexts (of any device, on or off) this thread is inside."""
    n = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return n - 1


def _autocast_back(autocast_keys: Tuple):
    """Autocast's keys back on (only those: an op that passed ADInplaceOrView must not pass
    it twice)."""
    if len(autocast_keys) == 1:
        return torch._C._SetExcludeDispatchKeyGuard(autocast_keys[0], False)
    guards = contextlib.ExitStack()
    for key in autocast_keys:
        guards.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
    return guards


@contextlib.contextmanager
def _as_outside(autocast_keys: Tuple):
    """The dispatch keys an op passed before reaching the mode, back on for its inner ops:
    ADInplaceOrView, and autocast's where it was on."""
    with _ADINPLACE_AS_OUTSIDE(), _autocast_back(autocast_keys) if autocast_keys else contextlib.nullcontext():
        yield


# Composite ops whose decomposition is many small ops (an RNN: a few per time step), counted
# on the real inputs: on meta each op costs a Python meta kernel (23x the plain GRU, measured
# on the CPU; 6x running it again).
_RERUN_FOR_COUNTS = {getattr(torch.ops.aten, n) for n in ("gru", "lstm", "rnn_tanh", "rnn_relu")}
# SDPA's decomposition picks its kernel by device: on meta the math path (two bmm), which
# counts what the flash/efficient kernels' formulas count; on CPU torch runs a flash kernel
# that a plugin with extra_formulas=False has no formula for (counted 0, as FlopCounterMode
# does): then it runs again on the inputs (the attention computed twice, counting only)
_SDPA = torch.ops.aten.scaled_dot_product_attention
_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _autocast_dtype(args, autocast: Tuple) -> Optional[torch.dtype]:
    """Autocast's dtype for the device of ``args``' first tensor where ``autocast`` (keys)
    holds that device's, else None."""
    if not autocast:
        return None
    for a in args:
        t = a[0] if isinstance(a, (list, tuple)) and a else a
        if isinstance(t, torch.Tensor):
            device = t.device.type
            return torch.get_autocast_dtype(device) if _AUTOCAST_KEY_OF.get(device) in autocast else None
    return None


def _meta_copies(args, kwargs, cast: Optional[torch.dtype] = None):
    """``(args, kwargs)`` with every tensor a ``meta`` tensor of its size, strides and dtype
    (``cast`` for a floating one: autocast's, which no meta kernel applies, so that inputs
    of mixed precision meet as they do under autocast), or None where one is a tensor
    subclass (a DTensor: its own dispatch)."""
    def meta(a):
        if isinstance(a, (list, tuple)):
            return type(a)(meta(x) for x in a)
        if not isinstance(a, torch.Tensor):
            return a
        if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
            raise TypeError
        dtype = cast if cast is not None and a.is_floating_point() else a.dtype
        return torch.empty_strided(a.size(), a.stride(), dtype=dtype, device="meta")
    try:
        return meta(tuple(args)), {k: meta(v) for k, v in kwargs.items()}
    except TypeError:
        return None


def _restored_rng(func, args, kwargs):
    """For an op that draws random numbers (dropout, SDPA's dropout), a context restoring
    the generators of its devices: its counting run draws what the real run drew already."""
    if _SEEDED not in getattr(func, "tags", ()):
        return contextlib.nullcontext()
    devices = {t.device for a in (*args, *kwargs.values())
               for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)}
    accel = [d for d in devices if d.type == "cuda"]
    return torch.random.fork_rng(devices=accel, device_type="cuda")


def _shift(formula: Callable, n: int = 1) -> Callable:
    """``formula`` for an op that takes ``n`` extra leading arguments (an out tensor)."""
    def shifted(*args, **kwargs):
        return formula(*args[n:], **kwargs)
    return shifted


def _rows(x) -> List[int]:
    """The sequence length of each row of a ``(batch, seq, embed)`` input: ``seq`` for each
    of a dense one's rows, each component's own for a nested one (padding left out)."""
    if x.is_nested:
        sizes = x._nested_tensor_size()
        if sizes.dim() != 2 or sizes.shape[1] != 2:
            raise NotImplementedError("only nested inputs of (seq, embed) components are counted")
        return sizes[:, 0].tolist()
    if x.dim() != 3:
        raise NotImplementedError("only (batch, seq, embed) inputs are counted")
    return [x.shape[1]] * x.shape[0]


def _attention_flop(q_rows: List[int], k_rows: List[int], e: int, embed_dim: int, num_head: int) -> int:
    """q/k/v projections, attention and out projection of rows of ``q_rows`` queries over
    ``k_rows`` keys, composed from torch's ``mm`` and SDPA formulas (what the slow path runs)."""
    mm = _fc.flop_registry[aten.mm]
    d = embed_dim // num_head
    flops = 0
    for (t, s), n in Counter(zip(q_rows, k_rows)).items():
        flops += n * (mm((t, e), (e, embed_dim)) + 2 * mm((s, e), (e, embed_dim))
                      + _fc.sdpa_flop_count((1, num_head, t, d), (1, num_head, s, d), (1, num_head, s, d))
                      + mm((t, embed_dim), (embed_dim, embed_dim)))
    return flops


def _native_mha_flop(query, key, value, embed_dim, num_head, *args, out_val=None, **kwargs) -> int:
    """``aten._native_multi_head_attention``, the inference fast path of
    ``nn.MultiheadAttention`` (dense or nested inputs)."""
    return _attention_flop(_rows(query), _rows(key), query.size(-1), embed_dim, num_head)


def _encoder_layer_flop(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                        use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                        ffn_weight_1, *args, out_val=None, **kwargs) -> int:
    """``aten._transformer_encoder_layer_fwd``, the inference fast path of
    ``nn.TransformerEncoderLayer`` (dense or nested input): attention and the two
    feed-forward matmuls, as the slow path counts them (norms and activations: 0)."""
    mm = _fc.flop_registry[aten.mm]
    rows = _rows(src)
    ffn = ffn_weight_1.shape[0]
    flops = _attention_flop(rows, rows, embed_dim, embed_dim, num_heads)
    for t, n in Counter(rows).items():
        flops += n * (mm((t, embed_dim), (embed_dim, ffn)) + mm((t, ffn), (ffn, embed_dim)))
    return flops


def _nested_linear_flop(input, weight, *args, out_val=None, **kwargs) -> int:
    """``aten.linear`` on a nested input (strided: its NestedTensor kernel, not decomposed;
    jagged under inference_mode): one ``mm`` over every component's rows."""
    values = getattr(input, "_values", None)  # a jagged one's (a subclass), else strided
    rows = (values.shape[:-1].numel() if isinstance(values, torch.Tensor)
            else int(input._nested_tensor_size()[:, :-1].prod(dim=1).sum()))
    return _fc.flop_registry[aten.mm]((rows, weight.shape[-1]), (weight.shape[-1], weight.shape[0]))


for _formula in (_native_mha_flop, _encoder_layer_flop, _nested_linear_flop):
    _formula._get_raw = True
# Ops whose kernel for a (strided) nested input does the matmuls inside, unseen by the mode;
# counted by these formulas where such an input takes part (extra_formulas=True)
_NESTED_FORMULAS = {aten.linear: _nested_linear_flop}


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
        add("_transformer_encoder_layer_fwd", _encoder_layer_flop)
    return out


# torch's ``shape_wrapper`` hands a formula its arguments with each tensor replaced by its
# shape, through ``tree_map`` (pytree flattening and rebuilding: ~2/3 of a counted op's cost
# on the CPU, 20 pytree nodes for a conv). ``_shapes`` does the same for the arguments ops
# get (tensors, lists and tuples of them, scalars); any other pytree node falls back to
# torch's own wrapper, so a formula sees what it sees under FlopCounterMode.
_NF_CODE = _fc.shape_wrapper(lambda: None).__code__
_FAST_SHAPES = (_NF_CODE.co_freevars == ("f",) and {"tree_map", "get_shape"} <= set(_NF_CODE.co_names)
                and hasattr(torch.utils._pytree, "SUPPORTED_NODES"))
_PYTREE_NODES = getattr(torch.utils._pytree, "SUPPORTED_NODES", {})
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _PytreeNode(Exception):
    """An argument that is a pytree node other than a plain list or tuple."""


def _shapes(a):
    """``tree_map(get_shape, a)`` for plain lists and tuples (raises :class:`_PytreeNode`
    for another node: a dict, a namedtuple, a registered type)."""
    t = type(a)
    if t in _PLAIN_TENSORS:
        return a.shape
    if t is tuple:
        return tuple([_shapes(x) for x in a])
    if t is list:
        return [_shapes(x) for x in a]
    if t in _PYTREE_NODES or issubclass(t, tuple):
        raise _PytreeNode
    return a.shape if isinstance(a, torch.Tensor) else a


def _key(a):
    """A hashable key for ``_shapes``' result, telling apart what a formula could (a list
    from a tuple, ``1`` from ``1.0`` and ``True``)."""
    t = type(a)
    if t is tuple or t is list:
        return (t, *[_key(x) for x in a])
    return (t, a)


_MEMO_ENTRIES = 4096  # per formula: dynamic shapes keep at most this many


def _calls_wrapped(f: Callable, depth: int = 2) -> bool:
    """Whether ``f``, one of torch's own formulas, calls another through ``shape_wrapper``
    (``addmm``'s ``mm_flop``, SDPA's ``bmm_flop``), directly or through a helper of its
    module (``sdpa_flop_count``): those are worth remembering; the others cost less than
    the key (``conv``'s 1 us against 4 us)."""
    if getattr(f, "__module__", None) != _fc.__name__ or not hasattr(f, "__code__"):
        return False
    for name in f.__code__.co_names:
        g = f.__globals__.get(name)
        if getattr(g, "__code__", None) is _NF_CODE or (depth > 1 and callable(g) and _calls_wrapped(g, depth - 1)):
            return True
    return False


def _fast_shape_wrapper(nf: Callable) -> Callable:
    """``nf`` (a formula wrapped by torch's ``shape_wrapper``) with the shapes taken by
    :func:`_shapes`; anything else as it is. torch's own formulas (pure functions of
    shapes and scalars) are remembered per argument key: ``addmm``'s calls ``mm``'s through
    ``shape_wrapper`` again, whose ``tree_map`` on two sizes costs ~45 us on this CPU."""
    if not _FAST_SHAPES or getattr(nf, "__code__", None) is not _NF_CODE:
        return nf
    f = nf.__closure__[0].cell_contents
    memo: Optional[Dict[Any, Any]] = {} if _calls_wrapped(f) else None

    @functools.wraps(f)
    def shaped(*args, out_val=None, **kwargs):
        try:
            shapes = tuple([_shapes(a) for a in args])
            kw = {k: _shapes(v) for k, v in kwargs.items()} if kwargs else kwargs
            out = _shapes(out_val)
        except _PytreeNode:
            return nf(*args, out_val=out_val, **kwargs)
        if memo is None:
            return f(*shapes, out_shape=out, **kw)
        try:
            key = (_key(shapes), _key(out), *[(k, _key(v)) for k, v in kw.items()])
            flops = memo.get(key)
        except TypeError:  # (a symbolic size: not hashable)
            return f(*shapes, out_shape=out, **kw)
        if flops is None:
            flops = f(*shapes, out_shape=out, **kw)
            if len(memo) >= _MEMO_ENTRIES:
                memo.clear()
            memo[key] = flops
        return flops

    return shaped


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
    return {op: _fast_shape_wrapper(fn) for op, fn in table.items()}


# -- the dispatch mode and its windows -------------------------------------------------------------

class _Window:
    """One open counting window of one plugin: a selected forward (``owners`` is None: the
    plugin's running modules count) or one autograd node's backward (``owners``: the modules
    whose forward created the node)."""

    __slots__ = ("plugin_ref", "owners", "phase", "dispatcher", "noted_before", "noted")

    def __init__(self, plugin: "FlopsPlugin", owners: Optional[Tuple[str, ...]], phase: str = "train"):
        self.plugin_ref = weakref.ref(plugin)  # the mode stack never keeps a plugin alive
        self.owners = owners
        self.phase = phase  # what it counts for: the phase of the forward (see results())
        self.dispatcher: Optional[_Dispatcher] = None
        # the autocast notes it found and made when it opened (see _Dispatcher.open/close)
        self.noted_before: Tuple[Tuple, int] = ((), -1)
        self.noted: Tuple[Tuple, int] = ((), -1)

    def close(self) -> None:
        """Close this window if it is open on the calling thread; elsewhere stop it counting
        (that thread's mode leaves at its next window change)."""
        d, self.dispatcher = self.dispatcher, None
        if d is None:
            return
        if d is getattr(_local, "dispatcher", None):
            d.close(self)
        else:
            d.windows = [w for w in d.windows if w is not self]
            if not d.windows:  # its thread's ops until the forward returns: no hook of ours
                d.noted = self.noted  # restores a note there, so the window's own (see autocast())


class _Dispatcher(TorchDispatchMode):
    """The one dispatch mode of a thread: on the mode stack while any window is open there,
    it hands every op to the innermost open window of each plugin."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.windows: List[_Window] = []
        self.entered = False
        self.dispatching = 0  # inside __torch_dispatch__ we are off the stack for a moment
        self.only_counting = 0  # inside a decomposition run for its counts (result dropped)
        self.deferred: Optional[list] = None  # a meta run's counts, kept until it ends
        self.noted: Tuple[Tuple, int] = ((), -1)  # autocast keys on, nesting count (see _AUTOCAST_KEYS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.dispatching += 1
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            self.dispatching -= 1

    def _dispatch(self, func, args, kwargs):
        windows = self._live_windows()
        if not windows:  # windows ended while we dispatched (see settle), or on another thread
            return self._run(func, args, kwargs)
        if func in _PASS_THROUGH:
            return NotImplemented
        if isinstance(func, _HOP):
            out = func(*args, **kwargs)
            packet = func
        else:
            packet = func._overloadpacket
            try:
                decomposes = func is not _PRIM_DEVICE and _decomposes(func, args, kwargs) and not any(
                    packet in p._formulas for p, _ in windows)
            except Exception as exc:  # noqa: BLE001 - the counting's, never the op's
                self._counting_failed(windows, func, exc)
                return func(*args, **kwargs)
            if decomposes:
                autocast = self.autocast()
                if self.only_counting or not _runs_as_torch_does(func):
                    with self, _as_outside(autocast) if autocast else contextlib.nullcontext():
                        # count the matmuls inside, as FlopCounterMode does
                        return func._op_dk(_DK.CompositeImplicitAutograd, *args, **kwargs)
                # The result is the op's as torch runs it outside the mode: run inside, its
                # decomposition sees views without autograd (ADInplaceOrView is passed here)
                # and takes other kernels (``matmul`` folded no batch into one ``mm``), and
                # its inner ops no autocast. Then the decomposition runs again, for the
                # counts only.
                with _as_outside(autocast) if autocast else _ADINPLACE_AS_OUTSIDE():
                    out = func(*args, **kwargs)
                try:
                    self._count_decomposition(func, args, kwargs, windows, autocast)
                except Exception as exc:  # noqa: BLE001 - the counting's, never the op's
                    self._counting_failed(windows, func, exc)
                return out
            out = self._run(func, args, kwargs)
        deferred = self.deferred
        for plugin, w in windows:
            if deferred is None:
                plugin._count(w, func, packet, args, kwargs, out)
            else:  # a meta run: counted once it has run to its end
                deferred.append((plugin, w, func, packet, args, kwargs, out))
        return out

    @staticmethod
    def _counting_failed(windows, func, exc: Exception) -> None:
        """Counting ``func`` failed outside the plugins' own ``_count``: each plugin counting
        it stops (its error, see ``FlopsPlugin._fail``); the op's result stands."""
        for plugin, _ in windows:
            plugin._fail(func, exc)

    def _run(self, func, args, kwargs):
        """``func`` with autocast's keys back on where the note holds (its kernel may call
        other ops, which would run without autocast inside the mode)."""
        autocast = self.autocast() if self.noted[0] else ()
        if not autocast:
            return func(*args, **kwargs)
        with _autocast_back(autocast):
            return func(*args, **kwargs)

    def note_autocast(self) -> None:
        """Note autocast's state (read outside the mode) for the composite ops that follow;
        only under inference_mode, where they reach the mode whole."""
        keys = _autocast_keys_on() if _AUTOCAST_KEYS and torch.is_inference_mode_enabled() else ()
        # a new tuple each time: a window tells its own note from a later equal one (see close)
        self.noted = tuple([keys, _autocast_nesting() if keys else -1])

    def autocast(self) -> Tuple:
        """The autocast keys noted, where the nesting count is the one noted. A note is taken
        at a selected call's start and stands while that call runs (restored when a call
        inside it returns): a block entered before the call cannot be left while it runs,
        so an equal count there means the same blocks, the same state (a direct
        ``torch.set_autocast_enabled`` call aside)."""
        keys, nesting = self.noted
        return keys if keys and _autocast_nesting() == nesting else ()

    def _count_decomposition(self, func, args, kwargs, windows, autocast: Tuple = ()) -> None:
        """Run ``func``'s decomposition for its ops' counts (the matmuls inside, as
        FlopCounterMode counts them; the formulas read shapes only) and drop its result: on
        ``meta`` copies of the inputs (no arithmetic, no random draw), else (a tensor
        subclass, an op inside with no meta kernel) on the inputs themselves, restoring the
        random state it drew from."""
        self.only_counting += 1
        try:
            packet = func._overloadpacket
            rerun = packet in _RERUN_FOR_COUNTS or (
                packet is _SDPA and args[0].device.type == "cpu"
                and not all(_CPU_SDPA in p._formulas for p, _ in windows))
            meta = None if rerun else _meta_copies(args, kwargs, _autocast_dtype(args, autocast))
            if meta is not None:  # never nested: inside this run composite ops decompose inline
                self.deferred = []
                try:
                    with self:
                        func._op_dk(_DK.CompositeImplicitAutograd, *meta[0], **meta[1])
                    counts = self.deferred
                except Exception:  # noqa: BLE001 - not on meta: counted on the real inputs
                    counts = None
                finally:
                    self.deferred = None
                if counts is not None:
                    for plugin, *count in counts:
                        plugin._count(*count)
                    return
            with self, _restored_rng(func, args, kwargs), _as_outside(autocast):
                func._op_dk(_DK.CompositeImplicitAutograd, *args, **kwargs)
        finally:
            self.only_counting -= 1

    def _live_windows(self) -> List[Tuple["FlopsPlugin", _Window]]:
        """``(plugin, window)``: the innermost open window of each plugin still counting."""
        seen, out = set(), []
        for w in reversed(self.windows):
            p = w.plugin_ref()
            if p is None or id(p) in seen or not p._counting:
                continue
            seen.add(id(p))
            out.append((p, w))
        return out

    def open(self, window: _Window) -> None:
        if self.entered and not self.dispatching and not any(m is self for m in _mode_stack()):
            self._forget()  # autograd dropped us with the TLS of a node that raised
        window.dispatcher = self
        window.noted_before = self.noted
        self.windows.append(window)
        if not self.entered:
            self.__enter__()
            self.entered = True
        self.note_autocast()
        window.noted = self.noted

    def close(self, window: _Window) -> None:
        for i in range(len(self.windows) - 1, -1, -1):
            if self.windows[i] is window:
                del self.windows[i]
                if self.noted is window.noted:  # its note still in force: the one it found
                    self.noted = window.noted_before  # (a call still running around it made it)
                break
        self.settle()

    def settle(self) -> None:
        """Leave the mode stack if no window is open (and we are on top of it)."""
        if self.windows or not self.entered or self.dispatching:
            return  # (while dispatching: the next open or close settles)
        n = _stack_len()  # (the top read alone: the whole stack as a list costs 1-2 us)
        if n and _stack_at(n - 1) is self:
            self.__exit__(None, None, None)
            self.entered = False
        elif not any(m is self for m in _mode_stack()):
            self._forget()
        # else: a mode entered inside a window is still above us; we stay, passing through,
        # and leave at the next settle()

    def _forget(self) -> None:
        """Autograd restored a thread state without us (a backward node raised): undo what
        ``__enter__`` recorded by entering and leaving once more."""
        from torch.utils._python_dispatch import _push_mode
        self.windows.clear()
        _push_mode(self)
        self.__exit__(None, None, None)
        self.entered = False


_local = threading.local()


def _dispatcher() -> _Dispatcher:
    d = getattr(_local, "dispatcher", None)
    if d is None:
        d = _local.dispatcher = _Dispatcher()
    return d


def _settle_this_thread() -> None:
    """Take this thread's mode off the stack if a window ended while it was dispatching."""
    d = getattr(_local, "dispatcher", None)
    if d is not None:
        d.settle()


class _NodeWindow:
    """Node pre/post hooks opening and closing a backward window around one autograd node.
    Under ``create_graph=True`` the node's backward builds a graph of its own (a gradient
    penalty's): its nodes get windows of the same owners, so a second backward through them
    counts as their backward too."""

    __slots__ = ("plugin_ref", "owners", "phase", "open_windows")

    def __init__(self, plugin: "FlopsPlugin", owners: Tuple[str, ...], phase: str):
        self.plugin_ref = weakref.ref(plugin)
        self.owners = owners
        self.phase = phase  # the forward's that created the node
        self.open_windows: List[Tuple[_Window, Optional[int]]] = []

    def pre(self, grad_outputs):
        plugin = self.plugin_ref()
        if plugin is not None and plugin._failure is not None:
            plugin._report_failure("a backward window")
        if plugin is None or not plugin._counting or plugin._session_gone():
            return None
        window = _Window(plugin, self.owners, self.phase)
        _dispatcher().open(window)
        lo = _peek_seq() if _peek_seq is not None and torch.is_grad_enabled() else None
        self.open_windows.append((window, lo))
        return None

    def post(self, grad_inputs, grad_outputs):
        if not self.open_windows:
            return None
        window, lo = self.open_windows.pop()
        window.close()
        failed = self.plugin_ref()
        if failed is not None and failed._failure is not None:
            failed._report_failure("a backward window")
        if lo is not None:  # create_graph: the nodes this backward made
            hi = _peek_seq()
            plugin = self.plugin_ref()
            roots = [g.grad_fn for g in grad_inputs if isinstance(g, torch.Tensor) and g.grad_fn is not None]
            if plugin is not None and roots and hi > lo and not plugin._ended:
                plugin._hook_nodes(roots, lo, hi, [lo], [self.owners], self.phase)
        return None


# autograd calls them: dynamo compiled them in the backward a compiled training step runs
_run_eagerly(_NodeWindow.pre, _NodeWindow.post)


class _Lease:
    """What a plugin has open on a mode stack, without a reference to the plugin or the
    session, so that a finalizer of a dropped session can close it."""

    __slots__ = ("window",)

    def __init__(self):
        self.window: Optional[_Window] = None

    def release(self) -> None:
        window, self.window = self.window, None
        if window is not None:
            window.close()


_PHASES = ("train", "eval")


class _Counts:
    """The FLOPs of one phase: per module and per op, forward and backward, and in total."""

    __slots__ = ("fwd", "bwd", "op_fwd", "op_bwd", "total_fwd", "total_bwd")

    def __init__(self):
        self.fwd: Dict[str, int] = defaultdict(int)
        self.bwd: Dict[str, int] = defaultdict(int)
        self.op_fwd: Dict[str, int] = defaultdict(int)
        self.op_bwd: Dict[str, int] = defaultdict(int)
        self.total_fwd = 0
        self.total_bwd = 0

    @classmethod
    def sum(cls, parts: List["_Counts"]) -> "_Counts":
        out = cls()
        for part in parts:
            for name in ("fwd", "bwd", "op_fwd", "op_bwd"):
                mine = getattr(out, name)
                for key, value in getattr(part, name).items():
                    mine[key] += value
            out.total_fwd += part.total_fwd
            out.total_bwd += part.total_bwd
        return out


class _Recompute:
    """A reentrant checkpoint's recompute running on one thread: the selected modules it
    re-runs (innermost last), their windows and the autograd nodes they create."""

    __slots__ = ("base", "names", "windows", "lo", "seqs", "owners", "roots", "phase")

    def __init__(self, base: Tuple[str, ...], lo: Optional[int], phase: str):
        self.base = base  # owners of the backward window the recompute runs in
        self.phase = phase  # that window's
        self.names: List[str] = []
        self.windows: List[_Window] = []
        self.lo = lo  # the first node's sequence number; None: non-reentrant (no nodes kept)
        self.seqs: List[int] = []
        self.owners: List[Tuple[str, ...]] = []
        self.roots: List[Any] = []

    def running(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys((*self.base, *self.names)))


_CHECKPOINT_FILE = getattr(torch.utils.checkpoint, "__file__", None)


def _reentrant_recompute() -> bool:
    """Whether the forward re-run inside backward is a reentrant checkpoint's (it runs in an
    ``autograd.Function``'s ``backward``: torch's ``use_reentrant=True``, DeepSpeed's,
    Megatron's) rather than ``use_reentrant=False``'s, which runs in the unpack hook of a
    saved tensor (maybe unpacked by a custom ``Function``'s backward): whichever of the two
    frames is nearer on the stack."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_filename == _CHECKPOINT_FILE and code.co_name != "backward":
            return False  # torch.utils.checkpoint's unpack hook / recompute
        if code.co_name == "backward" and code.co_varnames[:1] == ("ctx",):
            return True
        f = f.f_back
    return isinstance(_current_node(), _FunctionNode)


def _note_owners(seqs: List[int], owners: List[Tuple[str, ...]], seq: int,
                 names: Tuple[str, ...]) -> None:
    """Nodes with sequence number ``seq`` and up are owned by ``names`` (a timeline)."""
    if seqs and seqs[-1] == seq:
        owners[-1] = names
    else:
        seqs.append(seq)
        owners.append(names)


class _OpenCall:
    """A selected module's forward that has started and not returned."""

    __slots__ = ("ctx", "name", "frame", "module", "noted")

    def __init__(self, ctx, frame, module, noted):
        self.ctx, self.name, self.frame, self.module = ctx, ctx.name, frame, module
        self.noted = noted  # autocast's state at its start (see _Dispatcher.note_autocast)


# -- the plugin -----------------------------------------------------------------------------------

class FlopsPlugin(hookplug.Plugin):
    """FLOPs (and MACs) of the selected modules, forward and backward, inclusive of children.
    See the module docstring for what is counted, the windows and the options."""

    name = "flops"
    # per-call Python state (windows, the mode stack, the autograd graph task): under
    # torch.compile its hooks run as in eager code, a graph break per hooked call (traced,
    # dynamo broke the graph inside them anyway, and fullgraph=True failed with its own error)
    traceable = False

    def __init__(self, *, formulas: Optional[Dict[Any, Callable]] = None,
                 extra_formulas: bool = True):
        self.extra_formulas = extra_formulas
        self._formulas = _formula_table(formulas, self.extra_formulas)
        self._quiet: set = set()          # op overloads that never go to uncounted()
        self._noisy: Dict[Any, str] = {}  # op overloads that do: their uncounted() key
        self._counting = False
        self._ended = True
        self._thread: Optional[int] = None
        self._names: List[str] = []
        self._params: Dict[str, int] = {}
        self._model_params = 0
        self._sized: Dict[Optional[str], Callable] = {}  # modules (None: the model) counted, weakly
        self._warned: set = set()
        self._session_ref: Callable[[], Any] = lambda: None
        self._failure: Optional[Exception] = None  # met inside dispatch, see _fail
        self._finalizer: Optional[weakref.finalize] = None
        self._lease = _Lease()  # the open forward window, shared with the finalizer
        self._recomputes: Dict[int, _Recompute] = {}  # thread -> its reentrant recompute
        self._clear_forward()
        self._reset_state()

    # -- public -----------------------------------------------------------------------------------

    def results(self, phase: Optional[str] = None) -> Dict[str, Dict[str, int]]:
        """``{module name: {"flops", "macs", "params", "backward_flops"}}`` for every selected
        module, in model order (zeros for a module that did not run); ``phase="train"`` or
        ``"eval"``: the forwards of that phase only (and the backwards of their graphs),
        e.g. training FLOPs per step without the validation passes between steps."""
        c = self._counts_of(phase)
        self._size_params()
        names = self._names or sorted(set(c.fwd) | set(c.bwd))
        return {n: self._row(c.fwd.get(n, 0), c.bwd.get(n, 0), self._params.get(n, 0))
                for n in names}

    def total(self, phase: Optional[str] = None) -> Dict[str, int]:
        """Every window of the session (each op counted once, however many selected modules
        it belongs to): the same keys as a row of ``results()``; ``params`` is the model's.
        ``phase``: as in :meth:`results`."""
        c = self._counts_of(phase)
        self._size_params()
        return self._row(c.total_fwd, c.total_bwd, self._model_params)

    def uncounted(self) -> Dict[str, int]:
        """``{op name: calls}`` of the ops that ran while counting, do arithmetic and have no
        formula (see the module docstring for what is left out), most called first."""
        return dict(self._uncounted.most_common())

    def by_op(self, phase: Optional[str] = None) -> Dict[str, Dict[str, int]]:
        """``{op name: {"flops", "backward_flops"}}`` over the whole session (``phase``: as
        in :meth:`results`)."""
        c = self._counts_of(phase)
        ops = sorted(set(c.op_fwd) | set(c.op_bwd))
        return {op: {"flops": c.op_fwd.get(op, 0), "backward_flops": c.op_bwd.get(op, 0)}
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

    @hookimpl
    def hookplug_report_section(self, session):
        """FLOPs per module and in total over the session, and the ops without a formula."""
        return {"flops": self.results(), "flops_total": self.total(), "uncounted": self.uncounted()}

    # -- session hooks ----------------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        self._failure = None
        if import_off_stack("torch._dynamo"):  # (else first imported by the dispatch mode, in
            from hookplug._compile_guards import _PENDING_RECOMPILE_LIMIT, _guard_module_hooks  # forward)
            # its config is per thread: the guards and the recompile limit the sessions attached
            # before the import asked for, set again on this one
            _guard_module_hooks(_PENDING_RECOMPILE_LIMIT[0])
        self._end_windows()
        self._reset_state()
        self._session_ref = weakref.ref(session)
        mods = session.modules_of(self)
        self._names = list(mods)
        model = session.model
        self._sized = {n: weakref.ref(m) for n, m in mods.items()}
        if model is not None:
            self._sized[None] = weakref.ref(model)
        self._params, self._model_params = {}, 0
        self._size_params()
        self._thread = threading.get_ident()
        self._warned_thread = False
        self._ended = False
        self._counting = session.sampled
        if _peek_seq is None:
            warnings.warn("flops: this torch has no autograd sequence numbers; backward FLOPs "
                          "are not counted", RuntimeWarning, stacklevel=user_stacklevel())
        # a session dropped without remove(): close what a broken forward left open
        self._lease = _Lease()
        self._finalizer = weakref.finalize(session, self._lease.release)

    @hookimpl
    def hookplug_session_end(self, session):
        self._end_windows()

    @hookimpl
    def hookplug_step(self, session):
        self._raise_failure()
        self._prune_stale_calls()
        _settle_this_thread()
        self._counting = not self._ended and session.sampled

    @hookimpl
    def hookplug_sampling(self, session):
        """An evaluation after an unsampled step is counted (see the hookspec)."""
        self._counting = not self._ended and session.sampled

    # -- per-call hooks ---------------------------------------------------------------------------

    @hookimpl
    def hookplug_forward_input(self, ctx, module):
        if not self._counting or _in_backward():
            return None
        if threading.get_ident() != self._thread:
            if not self._warned_thread:
                self._warned_thread = True
                warnings.warn(f"flops: {ctx.name or '<root>'!r} ran on a thread other than the one "
                              "that called attach(); forwards of other threads are not counted "
                              "(attach from the thread that runs the model)", RuntimeWarning,
                              stacklevel=user_stacklevel())
            return None
        if self._calls:
            self._prune_stale_calls()
        seq = _peek_seq() if _peek_seq is not None else 0
        if not self._calls:  # the outermost selected module: open the forward window
            if self._session_gone():
                return None
            self._window = self._lease.window = _Window(self, None, ctx.phase)
            self._window_lo = seq
            _dispatcher().open(self._window)
        else:
            _dispatcher().note_autocast()
        self._calls.append(_OpenCall(ctx, _module_call_frame(), module, _dispatcher().noted))
        self._set_active(seq)
        return None

    @hookimpl
    def hookplug_forward_output(self, ctx, output):
        if self._failure is not None:
            self._raise_failure()
        calls = self._calls
        for i in range(len(calls) - 1, -1, -1):
            if calls[i].ctx is ctx:
                break
        else:
            return None
        del calls[i:]  # drops entries left by a forward that raised, too
        seq = _peek_seq() if _peek_seq is not None else 0
        self._set_active(seq)
        if output is not None and _peek_seq is not None and torch.is_grad_enabled():
            self._roots.extend(t.grad_fn for _, t in iter_tensors(output) if t.grad_fn is not None)
        if not calls:
            self._end_forward(hook_backward=True)
        else:  # back in the caller: its note holds again (a note is trusted only while the
            _dispatcher().noted = calls[-1].noted  # call it was taken at runs: see autocast())
        return None

    # -- windows ----------------------------------------------------------------------------------

    def _set_active(self, seq: int) -> None:
        """The running selected modules changed at autograd sequence number ``seq``."""
        self._active = tuple(dict.fromkeys(c.name for c in self._calls))
        _note_owners(self._timeline_seq, self._timeline_owners, seq, self._active)

    # -- reentrant recomputes (called by the session, see _ModuleBinding.recompute) ----------------

    def _recompute_started(self, name: str) -> None:
        """A selected module's forward runs again inside backward (activation checkpointing):
        its ops count as backward FLOPs of the modules it re-runs and of the modules around
        the checkpoint. Those are the owners of the backward window it runs in: in a
        reentrant checkpoint, the ``torch.autograd.Function`` node made where the checkpoint
        was called; in a non-reentrant one, the node inside the checkpoint that unpacked a
        saved tensor, whose owners count only where they enclose ``name``. The nodes a
        reentrant recompute creates are the ones its backward runs: they get windows as a
        forward's do."""
        try:
            if not self._counting or _peek_seq is None:
                return
            d = _dispatcher()
            rec = self._recomputes.get(threading.get_ident())
            if rec is not None and not any(w is rec.windows[-1] for w in d.windows):
                rec = None  # left by a backward that KeyboardInterrupt stopped (no post hooks)
            if rec is None:  # the outermost re-run module: inside the window it runs in
                outer = next((w for w in reversed(d.windows) if w.plugin_ref() is self), None)
                base = outer.owners or () if outer is not None else ()
                reentrant = _reentrant_recompute()
                if not reentrant:
                    base = tuple(n for n in base if n == "" or name.startswith(n + "."))
                rec = self._recomputes[threading.get_ident()] = _Recompute(
                    base, _peek_seq() if reentrant else None, outer.phase if outer is not None else self._root_phase())
            rec.names.append(name)
            window = _Window(self, rec.running(), rec.phase)
            d.open(window)
            rec.windows.append(window)
            _note_owners(rec.seqs, rec.owners, _peek_seq(), window.owners)
        except Exception as exc:  # noqa: BLE001 - never alter the model's computation
            self._fail("a checkpoint's recompute", exc)

    def _recompute_ended(self, name: str, output) -> None:
        """The recomputed call of ``name`` returned (or raised: ``output`` is None)."""
        try:
            rec = self._recomputes.get(threading.get_ident())
            if rec is None or name not in rec.names:
                return
            i = len(rec.names) - 1 - rec.names[::-1].index(name)
            for window in reversed(rec.windows[i:]):
                window.close()
            del rec.names[i:], rec.windows[i:]
            seq = _peek_seq()
            if rec.lo is not None and output is not None and torch.is_grad_enabled():
                rec.roots.extend(t.grad_fn for _, t in iter_tensors(output) if t.grad_fn is not None)
            if rec.names:
                _note_owners(rec.seqs, rec.owners, seq, rec.running())
                return
            del self._recomputes[threading.get_ident()]
            if rec.roots and seq > rec.lo:  # (roots: reentrant only)
                self._hook_nodes(rec.roots, rec.lo, seq, rec.seqs, rec.owners, rec.phase)
        except Exception as exc:  # noqa: BLE001
            self._fail("a checkpoint's recompute", exc)

    def _root_phase(self) -> str:
        """The phase of the session's model now (a recompute no window of ours runs around:
        the checkpoint called outside every selected module)."""
        s = self._session_ref()
        root = s._model_ref() if s is not None else None
        return _phase_of(root) if root is not None else "train"

    def _clear_forward(self) -> None:
        self._calls: List[_OpenCall] = []
        self._active: Tuple[str, ...] = ()
        self._window: Optional[_Window] = None
        if getattr(self, "_lease", None) is not None:
            self._lease.window = None
        self._window_lo = 0
        self._timeline_seq: List[int] = []
        self._timeline_owners: List[Tuple[str, ...]] = []
        self._roots: List[Any] = []

    def _end_forward(self, hook_backward: bool) -> None:
        """Close the forward window; give the autograd nodes it created backward windows."""
        window, lo, hi = self._window, self._window_lo, _peek_seq() if _peek_seq else 0
        roots, seqs, owners = self._roots, self._timeline_seq, self._timeline_owners
        self._clear_forward()
        if window is not None:
            window.close()
        if hook_backward and roots and hi > lo:
            self._hook_nodes(roots, lo, hi, seqs, owners, window.phase if window is not None else self._root_phase())

    def _hook_nodes(self, roots, lo, hi, seqs, owners, phase: str) -> None:
        """Node pre/post hooks on every node with sequence number in ``[lo, hi)`` reachable from
        ``roots``, each owned by the modules that were running when it was created."""
        seen = set()
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq < lo or seq >= hi or seq in seen:
                continue
            seen.add(seq)
            names = owners[bisect.bisect_right(seqs, seq) - 1] if seqs and seq >= seqs[0] else ()
            if names:
                hooks = _NodeWindow(self, names, phase)
                node.register_prehook(hooks.pre)
                node.register_hook(hooks.post)
            todo.extend(fn for fn, _ in node.next_functions)

    def _prune_stale_calls(self) -> None:
        """Drop the open calls whose forward is gone (left by an exception that skipped our
        post hook, or by KeyboardInterrupt); close the window if none is left."""
        calls = self._calls
        if not calls or threading.get_ident() != self._thread:
            return
        if _running(calls[-1].frame):
            return
        while calls and not _running(calls[-1].frame):
            calls.pop()
        if calls:
            self._set_active(_peek_seq() if _peek_seq is not None else 0)
        else:
            self._end_forward(hook_backward=False)

    def _end_windows(self) -> None:
        """Session over (or dropped): count nothing more; leave no window open."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._ended = True
        self._counting = False
        exc, self._failure = self._failure, None
        if exc is not None:  # kept for a hook that never came (a backward node that raised)
            warnings.warn(f"hookplug plugin 'flops' stopped counting after an error: {type(exc).__name__}: "
                          f"{exc}", RuntimeWarning, stacklevel=user_stacklevel())
        calls, owner = self._calls, self._thread
        dispatcher = self._window.dispatcher if self._window is not None else None
        self._lease.release()
        if calls and dispatcher is not None and owner is not None and owner != threading.get_ident():
            _settle_when_returns(calls, owner, dispatcher)
        self._clear_forward()
        recomputes, self._recomputes = self._recomputes, {}
        for rec in recomputes.values():
            for window in reversed(rec.windows):
                window.close()
        _settle_this_thread()

    def _session_gone(self) -> bool:
        """The session was removed without ending this plugin (its ``session_end`` was not
        called): stop counting."""
        s = self._session_ref()
        if s is None or s.removed:
            if not self._ended:
                self._ended = True
                self._counting = False
            return True
        return False

    # -- counting ---------------------------------------------------------------------------------

    def _reset_state(self) -> None:
        self._counts: Dict[str, _Counts] = {}  # by phase
        self._uncounted: Counter = Counter()

    def _counts_of(self, phase: Optional[str]) -> "_Counts":
        """The counts of ``phase`` (None: every phase's, summed)."""
        if phase is not None and phase not in _PHASES:
            raise ValueError(f"flops: phase must be None or one of {_PHASES}, got {phase!r}")
        parts = [c for p, c in self._counts.items() if phase is None or p == phase]
        return parts[0] if len(parts) == 1 else _Counts.sum(parts)

    def _size_params(self) -> None:
        """The parameter counts of the modules as they are now (a layer added, a
        parametrization registered after attach counts); a module with a lazy module's
        parameter (``nn.LazyLinear``, no size before its first forward) keeps its last count
        (0 at first), a module gone keeps its last."""
        for name, ref in list(self._sized.items()):
            module = ref()
            if module is None:
                del self._sized[name]
                continue
            params = list(module.parameters())
            if any(is_lazy(p) for p in params):
                continue
            count = sum(p.numel() for p in params)
            if name is None:
                self._model_params = count
            else:
                self._params[name] = count

    @staticmethod
    def _row(fwd: int, bwd: int, params: int) -> Dict[str, int]:
        return {"flops": int(fwd), "macs": int(fwd) // 2, "params": int(params),
                "backward_flops": int(bwd)}

    def _count(self, window: _Window, func, packet, args, kwargs, out) -> None:
        """One op in one of this plugin's windows."""
        try:
            formula = self._formulas.get(packet)
            if formula is None and self.extra_formulas and packet in _NESTED_FORMULAS and _nested_input(args):
                formula = _NESTED_FORMULAS[packet]
            if formula is None:
                if func not in self._quiet:
                    self._note_uncounted(func, packet)
                return
            if window.owners is None:  # forward: is the window still a running forward?
                if self._session_gone():
                    return
                self._prune_stale_calls()
                if window is not self._window:
                    return
            self._add(window, packet, formula, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - never alter the model's computation
            self._fail(func, exc)

    def _fail(self, where, exc: Exception) -> None:
        """Counting failed: the plugin stops counting, and the error is the plugin's, through
        the session's ``on_error`` (raised, or one warning and the plugin disabled). Met
        inside the dispatch mode (an op's count), where the mode cannot leave the stack, it
        is raised at the plugin's next hook outside it (the call's ``forward_output``, a
        backward window's end, the step), which the session routes."""
        self._ended = True
        self._counting = False
        s = self._session_ref()
        if s is None or s.removed:
            return
        if hasattr(exc, "add_note"):
            exc.add_note(f"(flops: counting {where})")
        d = getattr(_local, "dispatcher", None)
        if d is not None and d.dispatching:
            if self._failure is None:
                self._failure = exc
            return
        plugin_failed(self, s, f"counting {where}", exc)

    def _raise_failure(self) -> None:
        """Raise the counting error :meth:`_fail` kept (once)."""
        exc, self._failure = self._failure, None
        if exc is not None:
            raise exc

    def _report_failure(self, where: str) -> None:
        """:meth:`_raise_failure` where torch calls the plugin (a node hook): through
        ``on_error`` here (dropped once the session is gone: a retained graph's backward)."""
        s = self._session_ref()
        if s is None or s.removed:
            self._failure = None
            return
        try:
            self._raise_failure()
        except Exception as exc:  # noqa: BLE001 - the plugin's
            plugin_failed(self, self._session_ref(), where, exc)

    def _hookplug_disabled(self) -> None:
        """The session disabled this plugin (an error under ``on_error="warn"``): its
        dispatch windows and node hooks stop now (its forward_output, which would close the
        window of a call in flight, is no longer called)."""
        self._end_windows()

    def _add(self, window: _Window, op, formula, args, kwargs, out) -> None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception as exc:  # noqa: BLE001 - a formula that cannot handle these inputs
            name = f"{op} (formula failed)"
            self._uncounted[name] += 1
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"flops: the FLOP formula of {op} failed ({type(exc).__name__}: "
                              f"{exc}); counted as 0 and listed in uncounted()", RuntimeWarning,
                              stacklevel=user_stacklevel())
            return
        key = str(op)
        counts = self._counts.get(window.phase)
        if counts is None:
            counts = self._counts[window.phase] = _Counts()
        if window.owners is not None:
            counts.total_bwd += flops
            counts.op_bwd[key] += flops
            for name in window.owners:
                counts.bwd[name] += flops
        else:
            counts.total_fwd += flops
            counts.op_fwd[key] += flops
            for name in self._active:
                counts.fwd[name] += flops

    def _note_uncounted(self, func, packet) -> None:
        key = self._noisy.get(func)  # (decided once an op: its tags and schema, 25 us a call)
        if key is None:
            if isinstance(func, _HOP):
                key = f"higher_order.{getattr(func, '_name', func)}"
            else:
                ns = packet._qualified_op_name.partition("::")[0]
                if ns in ("hookplug", "prim") or not _does_arithmetic(func):
                    self._quiet.add(func)
                    return
                key = str(packet)
            self._noisy[func] = key
        self._uncounted[key] += 1


def count_flops(model: torch.nn.Module, *inputs, selector: str = "*, *:", backward: bool = False,
                **options) -> FlopsPlugin:
    """Run ``model(*inputs)`` (and ``.sum().backward()`` with ``backward=True``) under a flops
    session on the modules ``selector`` picks (all of them and the root by default); return
    the plugin, whose ``results()``/``total()``/``report()`` hold the counts."""
    plugin = FlopsPlugin(**options)
    with hookplug.attach(model, selector, plugins=plugin):
        out = model(*inputs)
        if backward:
            parts = [t.float().sum() for _, t in iter_tensors(out) if t.requires_grad]
            if not parts:
                raise ValueError("count_flops(backward=True): no output of the model requires grad "
                                 "(frozen parameters, or run under no_grad/inference_mode): there is "
                                 "no backward to count; pass backward=False")
            sum(parts).backward()
    return plugin
