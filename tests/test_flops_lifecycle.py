"""The flops plugin's dispatch mode: on the mode stack only inside a selected module's forward
or backward, balanced on every exit path (issue 13, items 1-5).

References are plain torch: ``FlopCounterMode`` for the counts, the model run without any
session for outputs and gradients.
"""
import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

import hookplug
from hookplug_plugins.flops import FlopsPlugin


def modes():
    return list(_get_current_dispatch_mode_stack())


def flop_counter_mode(model, x, backward=False):
    """``{qualified name: forward FLOPs}`` (and ``"Global"``) from ``FlopCounterMode``."""
    with FlopCounterMode(display=False) as fcm:
        out = model(x)
        if backward:
            out.sum().backward()
    root = type(model).__name__
    return {k[len(root) + 1:] if k.startswith(root + ".") else ("" if k == root else k):
            sum(v.values()) for k, v in fcm.get_flop_counts().items()}


def clean_session_counts(model, x, selector):
    """What a fresh flops session counts for one forward + backward: the reference for a
    session that went through a failure first."""
    plugin = FlopsPlugin()
    with hookplug.attach(model, selector, plugins=plugin):
        model(x).sum().backward()
    model.zero_grad()
    return plugin.results(), plugin.total()


class Probe(nn.Module):
    """Records the dispatch-mode stack depth each time it runs."""

    def __init__(self):
        super().__init__()
        self.depths = []

    def forward(self, x):
        self.depths.append(len(modes()))
        return x


class Interrupt(nn.Module):
    """Raises ``exc`` on the calls listed in ``on``."""

    def __init__(self, exc=KeyboardInterrupt, on=(0,)):
        super().__init__()
        self.exc, self.on, self.calls = exc, set(on), 0

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 in self.on:
            raise self.exc("interrupted on purpose")
        return x


class FailOnce(hookplug.Plugin):
    """A plugin raising in one hook, the first time it is called (for ``where=forward_output``)
    or always (``session_end``)."""

    name = "failonce"

    def __init__(self, where):
        self.where, self.failed = where, False

    def _fail(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError(f"failonce: failing in {self.where} on purpose")

    @hookplug.hookimpl
    def hookplug_forward_output(self, ctx, output):
        if self.where == "forward_output":
            self._fail()

    @hookplug.hookimpl
    def hookplug_session_end(self, session):
        if self.where == "session_end":
            raise RuntimeError("failonce: failing in session_end on purpose")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


# -- windows ---------------------------------------------------------------------------------

def test_mode_only_inside_selected_forward_and_backward():
    torch.manual_seed(0)
    probe_in, probe_out = Probe(), Probe()
    model = nn.Sequential(nn.Linear(4, 8), probe_in, nn.Linear(8, 4))
    outer = nn.Sequential(model, probe_out)
    x = torch.randn(3, 4)
    seen_in_backward = []
    plugin = FlopsPlugin()
    with hookplug.attach(outer, "*:0", plugins=plugin):
        assert modes() == []
        out = outer(x)
        assert modes() == []
        out.register_hook(lambda g: seen_in_backward.append(len(modes())))  # loss side
        out.sum().backward()
        assert modes() == []
    assert probe_in.depths == [1] and probe_out.depths == [0]
    assert seen_in_backward == [0]  # the loss's backward runs outside the window
    ref = flop_counter_mode(model, x, backward=True)
    fwd = flop_counter_mode(model, x)
    assert plugin.results()["0"]["flops"] == fwd["Global"]
    assert plugin.results()["0"]["backward_flops"] == ref["Global"] - fwd["Global"]


# -- item 1: a forward that does not return ---------------------------------------------------

def test_forward_interrupted_by_another_plugins_exception_recovers():
    model, x = mlp(), torch.randn(4, 4)
    ref_res, ref_tot = clean_session_counts(model, x, "Linear")
    fail, plugin = FailOnce("forward_output"), FlopsPlugin()
    session = hookplug.attach(model, "Linear", plugins=[fail, plugin])  # fail runs first
    with pytest.raises(RuntimeError, match="failing in forward_output"):
        model(x)
    plugin.reset()
    torch.mm(torch.randn(4, 4), torch.randn(4, 4))  # outside any selected module
    assert plugin.total()["flops"] == 0, plugin.total()
    model(x).sum().backward()
    assert modes() == []
    assert plugin.results() == ref_res  # '0' was charged for '2' too before the fix
    assert plugin.total() == ref_tot
    session.remove()
    assert modes() == []


def test_keyboard_interrupt_in_forward_leaves_no_mode_and_next_call_counts_right():
    torch.manual_seed(0)
    stop = Interrupt(KeyboardInterrupt, on=(0,))
    model = nn.Sequential(nn.Linear(4, 8), stop, nn.Linear(8, 4))
    x = torch.randn(4, 4)
    stop.on = set()
    ref_res, ref_tot = clean_session_counts(model, x, "*:, Linear")
    stop.on, stop.calls = {0}, 0
    plugin = FlopsPlugin()
    with hookplug.attach(model, "*:, Linear", plugins=plugin) as session:
        try:
            model(x)  # always_call post hooks do not run for KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        plugin.reset()
        torch.mm(torch.randn(4, 4), torch.randn(4, 4))  # the stale window does not count it
        assert plugin.total()["flops"] == 0, plugin.total()
        session.step()  # a step boundary takes the stale mode off the stack
        assert modes() == []
        model(x).sum().backward()
        assert modes() == []
        assert plugin.results() == ref_res
        assert plugin.total() == ref_tot
    assert modes() == []


@pytest.mark.parametrize("reentrant", [True, False])
def test_interrupt_inside_a_checkpoints_recompute_leaves_no_window(reentrant):
    """A recompute (in backward) stopped by KeyboardInterrupt (no post hooks) or by an error
    (post hooks run): the next step counts as a clean session does."""
    torch.manual_seed(0)
    stop = Interrupt(KeyboardInterrupt, on=())
    inner = nn.Sequential(nn.Linear(4, 8), stop, nn.Linear(8, 4))

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = inner, nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=reentrant))

    model = Checkpointed()
    x = torch.randn(3, 4, requires_grad=True)

    def step():
        model(x).sum().backward()

    ref = FlopsPlugin()
    with hookplug.attach(model, "*, *:", plugins=ref):
        step()
    assert ref.results()["inner.0"]["backward_flops"] > ref.results()["inner.0"]["flops"] > 0
    for exc in (KeyboardInterrupt, ValueError):
        stop.exc, stop.calls, stop.on = exc, 0, {1}  # the recompute's call
        plugin = FlopsPlugin()
        with hookplug.attach(model, "*, *:", plugins=plugin) as session:
            with pytest.raises(exc):
                step()
            session.step()
            plugin.reset()
            torch.mm(torch.randn(4, 4), torch.randn(4, 4))  # outside every window
            assert plugin.total()["flops"] + plugin.total()["backward_flops"] == 0
            stop.on = set()
            step()
            assert modes() == []
        assert plugin.results() == ref.results(), exc
        assert plugin.total() == ref.total()
        assert modes() == []


def test_forward_raising_closes_the_window():
    model = nn.Sequential(nn.Linear(4, 8), Interrupt(ValueError, on=(0,)), nn.Linear(8, 4))
    x = torch.randn(4, 4)
    plugin = FlopsPlugin()
    with hookplug.attach(model, "*:", plugins=plugin):
        with pytest.raises(ValueError, match="interrupted on purpose"):
            model(x)
        assert modes() == []
        assert plugin.total()["flops"] == 2 * 4 * 4 * 8  # the first Linear ran
    assert modes() == []


def test_backward_node_raising_leaves_no_mode():
    class BadGrad(torch.autograd.Function):
        fail = True

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if BadGrad.fail:
                raise RuntimeError("BadGrad: backward fails on purpose")
            return g

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(BadGrad.apply(x))

    model, x = Block(), torch.randn(2, 4, requires_grad=True)
    plugin = FlopsPlugin()
    with hookplug.attach(model, "*:", plugins=plugin):
        with pytest.raises(RuntimeError, match="backward fails on purpose"):
            model(x).sum().backward()
        assert modes() == []
        BadGrad.fail = False
        plugin.reset()
        model(x).sum().backward()  # the next forward and backward count, balanced
        assert modes() == []
        counted = plugin.total()
    assert modes() == []
    fwd = flop_counter_mode(model, x)["Global"]
    assert counted["flops"] == fwd
    assert counted["backward_flops"] == flop_counter_mode(model, x, backward=True)["Global"] - fwd


# -- item 2: another plugin's session_end raising --------------------------------------------

@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_other_plugins_session_end_failing_leaves_no_mode(on_error):
    probe = Probe()
    model = nn.Sequential(nn.Linear(4, 8), probe, nn.Linear(8, 4))
    x = torch.randn(4, 4)
    plugin = FlopsPlugin()
    session = hookplug.attach(model, "*:", plugins=[FailOnce("session_end"), plugin],
                              on_error=on_error)
    model(x).sum().backward()
    counted = plugin.total()
    assert counted["flops"] > 0 and probe.depths == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            session.remove()
        except Exception:  # noqa: BLE001 - "raise": the failure; "warn": see the session core
            pass
    assert session.removed
    assert modes() == []
    model(x).sum().backward()  # hooks are off: no window, nothing counted
    assert probe.depths == [1, 0]
    assert plugin.total() == counted
    session.remove()  # idempotent
    assert modes() == []


# -- item 3: a user's own dispatch mode ---------------------------------------------------------

class Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._overloadpacket)
        return func(*args, **(kwargs or {}))


def test_user_mode_opened_before_attach_and_closed_before_remove():
    model, x = mlp(), torch.randn(4, 4)
    user = Recording()
    user.__enter__()
    plugin = FlopsPlugin()
    session = hookplug.attach(model, "*:", plugins=plugin)
    model(x).sum().backward()
    assert modes() == [user]
    user.__exit__(None, None, None)
    assert modes() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "another thread" warning
        session.remove()
    assert modes() == []
    assert torch.ops.aten.addmm in user.ops  # the user's mode saw the model's ops
    fwd = flop_counter_mode(model, x)
    assert plugin.total()["flops"] == fwd["Global"]


def test_flop_counter_mode_around_a_session_counts_as_alone():
    model, x = mlp(), torch.randn(4, 4)
    alone = flop_counter_mode(model, x, backward=True)
    model.zero_grad()
    with FlopCounterMode(display=False) as fcm:
        with hookplug.attach(model, "*:", plugins="flops") as session:
            model(x).sum().backward()
        assert len(modes()) == 1  # FlopCounterMode's own
    assert modes() == []
    assert fcm.get_total_flops() == alone["Global"]
    tot = session["flops"].total()
    assert tot["flops"] + tot["backward_flops"] == alone["Global"]


# -- item 4: a dropped session -----------------------------------------------------------------

@pytest.mark.parametrize("autocast", [False, True])
def test_remove_from_another_thread_mid_forward_leaves_no_mode_on_the_model_thread(autocast):
    """``remove()`` on a timer thread while a forward runs: the model thread's dispatcher
    (and, under autocast with inference_mode, its torch-function watch) stayed on that
    thread's stacks for good, every op of the plain model through Python. It leaves when
    the forward returns, by a post hook that removes itself."""
    import threading

    go, removed = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.wait = nn.Linear(8, 8), False

        def forward(self, x):
            y = self.fc(x)
            if self.wait:
                go.set()
                removed.wait(10)  # the other thread removes the session meanwhile
            return torch.einsum("bi,ij->bj", y, self.fc.weight) * 2  # (bfloat16 and float32 under autocast)

    model, x = nn.Sequential(Slow(), nn.Linear(8, 2)), torch.randn(4, 8)
    hooks_before = {n: dict(m._forward_hooks) for n, m in model.named_modules()}

    def forward():
        with (torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()), \
                torch.inference_mode():
            return model(x)

    want = forward()
    session = hookplug.attach(model, "*", plugins="flops")
    remover = threading.Thread(target=lambda: (go.wait(10), session.remove(), removed.set()))
    remover.start()
    model[0].wait = True
    got = forward()  # (the ops after the removal ran with autocast as outside: no dtype error)
    remover.join()
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert session.removed
    assert _get_current_dispatch_mode_stack() == [] and torch._C._len_torch_function_stack() == 0
    assert {n: dict(m._forward_hooks) for n, m in model.named_modules()} == hooks_before

    class Island(nn.Module):  # removed inside a selected call in an autocast block: the ops
        def __init__(self):  # after it, in a float32 block, keep autocast off
            super().__init__()
            self.inner, self.w = Slow(), nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.inner(x)
            with torch.autocast("cpu", enabled=False):
                return torch.mm(h.float(), self.w)

    island = Island().eval()
    go.clear(), removed.clear()
    with torch.inference_mode():
        want = island(x)
    session = hookplug.attach(island, "*:, *:inner", plugins="flops")
    remover = threading.Thread(target=lambda: (go.wait(10), session.remove(), removed.set()))
    remover.start()
    island.inner.wait = True
    with torch.inference_mode():
        got = island(x)
    remover.join()
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)

    class UserMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Wrapped(nn.Module):  # the first open call to return does so under a user's mode:
        def __init__(self):  # the dispatcher leaves at the next one (the root's)
            super().__init__()
            self.inner = Slow()

        def forward(self, x):
            with UserMode():
                h = self.inner(x)
            return h * 2

    class Root(nn.Module):  # another session's window (on `inner`) still open: its note stays
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(x)

    wrapped = Wrapped()
    for model, sessions in ((wrapped, lambda: [hookplug.attach(wrapped, "*:, *:inner", plugins="flops")]),
                            (Root(Slow()), None)):
        if sessions is None:
            sessions = lambda m=model: [hookplug.attach(m, "*:", plugins="flops"),  # noqa: E731
                                        hookplug.attach(m.inner, "*:", plugins="flops")]
        go.clear(), removed.clear()
        model.inner.wait = False
        with torch.inference_mode():
            want = model(x)
        hooks_before = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
        attached = sessions()
        remover = threading.Thread(target=lambda: (go.wait(10), attached[0].remove(), removed.set()))
        remover.start()
        model.inner.wait = True
        with torch.inference_mode():
            got = model(x)
        remover.join()
        for other in attached[1:]:
            other.remove()
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert _get_current_dispatch_mode_stack() == []
        assert {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()} == hooks_before


def test_dropped_session_leaves_no_mode():
    model, x = mlp(), torch.randn(4, 4)
    session = hookplug.attach(model, "*:", plugins=FlopsPlugin())
    model(x)
    del session
    gc.collect()
    assert modes() == []


def test_dropped_session_after_interrupt_is_cleaned_by_finalizer():
    def interrupted_session():
        model = nn.Sequential(nn.Linear(4, 8), Interrupt(KeyboardInterrupt), nn.Linear(8, 4))
        session = hookplug.attach(model, "*:", plugins=FlopsPlugin())
        try:
            model(torch.randn(4, 4))
        except KeyboardInterrupt:
            pass
        return len(modes())

    assert interrupted_session() == 1  # the stale window's mode, until something ends it
    gc.collect()  # the session (and its model) are gone: the finalizer closes the window
    assert modes() == []


# -- item 5: numerics ---------------------------------------------------------------------------

class MBConv(nn.Module):
    """efficientnet_b0's block: expand, depthwise, squeeze-excite with SiLU, project."""

    def __init__(self, c=8, e=4):
        super().__init__()
        h = c * e
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False),
                                nn.BatchNorm2d(h), nn.SiLU())
        self.se_reduce, self.se_expand = nn.Conv2d(h, c // 2, 1), nn.Conv2d(c // 2, h, 1)
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        y = self.dw(self.expand(x))
        s = torch.sigmoid(self.se_expand(F.silu(self.se_reduce(y.mean((2, 3), keepdim=True)))))
        return x + self.project(y * s)


class LlamaMLP(nn.Module):
    def __init__(self, d=16, h=44):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h, False), nn.Linear(d, h, False), \
            nn.Linear(h, d, False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 64), nn.GELU(),
                           nn.Linear(64, 16), nn.GELU(approximate="tanh")), (8, 16)),
    (MBConv, (2, 8, 12, 12)),
    (LlamaMLP, (2, 5, 16)),
], ids=["mlp-silu-gelu", "mbconv-silu", "llama-mlp"])
def test_gradients_bitwise_equal_with_and_without_flops(make, shape):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape, dtype=torch.float32) * 3
    x.requires_grad_(True)
    out = model(x)
    out.square().sum().backward()
    ref_out = out.detach().clone()
    ref = [g.clone() for g in [x.grad, *(p.grad for p in model.parameters())]]
    model.zero_grad()
    x.grad = None
    plugin = FlopsPlugin()
    with hookplug.attach(model, "*, *:", plugins=plugin):
        out = model(x)
        out.square().sum().backward()
    got = [x.grad, *(p.grad for p in model.parameters())]
    assert torch.equal(out, ref_out)
    differ = [i for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)]
    assert differ == [], f"gradients {differ} of {len(ref)} differ with flops attached"
    assert plugin.total()["backward_flops"] > 0


_FIRST_SESSION_OF_A_PROCESS = """
import gc, sys, weakref
import torch, torch.nn as nn
import hookplug
assert "torch._dynamo" not in sys.modules, "the test needs dynamo not yet imported"
gc.disable()

def run():
    m = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.ReLU()) for _ in range(12)])
    with hookplug.attach(m, "*", plugins="flops") as s:
        m(torch.randn(2, 3)).sum().backward()
        import torch._dynamo.config as c  # imported on another thread: set on this one too
        assert not c.skip_nnmodule_hook_guards and c.recompile_limit >= 12 + 8, (
            c.skip_nnmodule_hook_guards, c.recompile_limit)
    assert s["flops"].total()["flops"] > 0
    return weakref.ref(m)

model = run()
print("freed" if model() is None else "kept")
"""


def test_the_first_flops_session_of_a_process_leaves_the_model_to_refcounting():
    """torch imports dynamo at the first call of a dynamo-disabled function, and ``torch.fx.wrap``
    (run by that import) keeps its frame in a cycle with every frame below: imported inside
    the model's forward, the model waited for the cycle collector (DESIGN: no cycle holds it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_SESSION_OF_A_PROCESS], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "freed"
