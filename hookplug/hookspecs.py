"""Hook specifications: the public contract between hookplug and its plugins.

A plugin is any object with a ``name`` whose methods are marked with
``@hookplug.hookimpl`` and named after the specs below. A plugin may accept a subset of a
spec's arguments (pluggy matches them by name).

Per-call hooks (the hot path) are resolved **once, at attach time**, into tuples of bound
methods per module; pluggy is not consulted on each forward. Their results are *folded in
plugin order* (that of ``attach(plugins=[...])``; a hook marked ``tryfirst``/``trylast`` runs
before/after the others, as pluggy orders them): each plugin sees the previous plugin's result, and ``None`` leaves the value
unchanged (observe only).

``ctx`` is a :class:`hookplug.HookContext` with ``name`` (the module's qualified name),
``call_index`` (how many times this module has been called in this session, from 0;
calls of a module nested in its own forward are numbered in the order they start when
a plugin on it has ``forward_input``, in the order they end otherwise),
``step`` (the session's step counter) and ``session``; ``forward_input`` and
``forward_output`` of one call receive the same ``ctx`` object, and so do the gradient hooks
of that call's outputs (under a reentrant activation checkpoint, those of the recompute,
which get the context of the call they repeat). ``output`` is None in ``forward_output``
when ``forward`` raised (the hook still runs so plugins can unwind per-call state;
torch >= 2.1).

Inside ``torch.compile``d code per-call hooks are traced (unless the plugin's class sets
``traceable = False``), and every Python value they read is baked into the graph: a hook
that reads ``ctx.step`` (or ``ctx.session.step_index``, any counter that changes per step)
specialises the graph on it, so dynamo recompiles on every ``session.step()`` until its
recompile limit, then runs the frame eagerly. Either set ``traceable = False`` (the hooks
then run outside the graph, as in eager code: a graph break per hooked call), or decide per
step in ``hookplug_step(session, step)``, which is never traced, and hand the decision to
the per-call hook as a device tensor the graph reads (the ``stats`` plugin's sampling flag,
set from ``session.sampled`` there, works this way).

Sampling (``attach(..., every=N)``): on unsampled steps only plugins whose class sets
``sampled = False`` are called (plugins that steer gradients must run on every step).
"""
import pluggy

hookspec = pluggy.HookspecMarker("hookplug")
hookimpl = pluggy.HookimplMarker("hookplug")


# -- session phase ---------------------------------------------------------------------

@hookspec
def hookplug_session_start(session):
    """Called once after every hook is registered. Result ignored."""


@hookspec
def hookplug_session_end(session):
    """Called once by ``session.remove()`` after every hook is taken off. Result ignored."""


@hookspec
def hookplug_step(session, step):
    """Called by ``session.step()`` at a training-step boundary; ``step`` is the step that
    just ended. Result ignored."""


@hookspec
def hookplug_sampling(session):
    """Called when ``session.sampled`` turns on within a step, for what runs until the next
    ``step()``: a trainer integration's evaluation that follows a step ``every=N`` did not
    sample is recorded (evaluations are rare; a validation run every epoch of a multiple of
    N steps was never recorded). A plugin that keeps a flag of its own from
    ``session.sampled`` (set in ``hookplug_step``) sets it here too. Result ignored."""


# -- forward phase (per module call) ---------------------------------------------------

@hookspec
def hookplug_forward_input(ctx, module, args, kwargs):
    """Before ``module.forward``. Return ``None`` or a new ``(args, kwargs)`` pair, which
    the next plugin and then the module receive."""


@hookspec
def hookplug_forward_output(ctx, module, args, kwargs, output):
    """After ``module.forward``. Return ``None`` or a new output, which the next plugin
    and then the caller receive. ``output`` may be a tensor or any structure of tensors
    (tuple, list, dict, dataclass, HF ``ModelOutput``)."""


# -- backward phase ---------------------------------------------------------------------

@hookspec
def hookplug_output_grad(ctx, module, grad, path):
    """When the gradient with respect to one of the module's output tensors is computed
    (a tensor hook on that output, so in-place ops after the module are safe). ``path``
    names the tensor inside the output structure (``"output"``, ``"output[1]"``,
    ``"output.logits"``). Return ``None`` or a new gradient, which flows on into the
    module's backward."""


@hookspec
def hookplug_param_grad(ctx, name, param, grad):
    """When the gradient of a parameter of a selected module is computed; ``name`` is its
    qualified name in the model. Return ``None`` or a new gradient."""


# -- telemetry --------------------------------------------------------------------------

@hookspec
def hookplug_collect(session, step):
    """Telemetry producers: return what was gathered since the last collection as a list
    of :class:`hookplug.StatsBlock` (``metas`` + a ``[R, HEAD + B]`` tensor of stats rows,
    e.g. a :class:`hookplug._bank.StatsBank` snapshot) and/or ``(meta, TensorStats)`` pairs,
    ``meta`` being ``{"step": int, "module": str, "site": str, ...}``; or ``None``. The rows
    stay on the device: the session concatenates them into one buffer, merges it across
    ranks under ``torch.distributed``, copies it to the host in one non-blocking transfer
    and turns it into flat records for the sinks (rows no call touched, ``calls`` and ``numel`` 0, give no record); CPU
    rows are read at once. Either way the rows are free for the producer to refill once
    this hook has returned (device rows: in stream order). ``step`` is the number of the
    step now running: the steps before it have ended (and at ``remove()`` the running one
    too, with no ``hookplug_step`` call for it); a row's ``meta["step"]`` is the step it was
    gathered in, as ``hookplug_step`` numbered it."""


@hookspec
def hookplug_flush(session, records):
    """Sinks: write ``records`` (a list of flat dicts ``{step, time, rank, module, site,
    stat...}``). Result ignored."""


# -- reports ----------------------------------------------------------------------------

@hookspec
def hookplug_report_section(session):
    """Reports (``session.report_sections()``, ``hookplug profile``): return this plugin's
    section as plain data (a JSON-able dict, host numbers only) or ``None``. Known keys:
    ``"stats"`` ``{module: {site: TensorStats.to_dict()}}``, ``"flops"`` ``{module: {"flops",
    "macs", "params", "backward_flops"}}`` with ``"flops_total"``, ``"outputs"`` ``{module:
    {"calls", "outputs": {path: {"shape", "dtype"}}}}``, ``"summary"`` (lines of text); other
    keys are kept as they are. Every plugin's result is collected (not firstresult)."""
