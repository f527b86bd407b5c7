"""A plugin's errors in code torch calls directly, outside the session's own hook calls
(flops' dispatch mode, ops a compiled backward runs, compile-start callbacks), go through
``on_error`` as its hook errors do: under "warn" the training is bitwise that of the run
without the failing plugin, one warning, the plugin disabled and its code not run again;
under "raise" the error is raised with a note naming the plugin. Failures are injected into
the plugins' internals (no natural input makes them fail)."""
import warnings

import pytest
import torch
import torch.nn as nn

import hookplug


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model, session=None, compiled=False):
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    outs, depths = [], []
    for _ in range(3):
        y = fwd(torch.randn(5, 8, generator=g))
        y.square().sum().backward()
        outs.append(y.detach())
        opt.step()
        opt.zero_grad()
        if session is not None:
            session.step()
        depths.append(torch._C._len_torch_dispatch_stack())
    return outs, [p.detach().clone() for p in model.parameters()], depths


def _in_backward():
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _flops_count(s, boom):
    p = s["flops"]
    p._add = lambda *a, **k: boom()


def _flops_forward_output(s, boom):
    p = s["flops"]
    orig = p._set_active

    def failing(*a, **k):  # (the call forward_output makes as a module's call ends)
        if len(p._calls) == 1:
            boom()
        return orig(*a, **k)
    p._set_active = failing


def _stats_backward_op(s, boom):
    bank = s["stats"].bank
    orig = bank.accumulate_at
    bank.accumulate_at = lambda *a, **k: boom() if _in_backward() else orig(*a, **k)


def _stats_compile_start(s, boom):
    s["stats"].bank.before_trace = lambda: boom()


def _gradclamp_count(s, boom):
    p = s["gradclamp"]
    orig = p._count
    p._count = lambda *a, **k: boom() if _in_backward() else orig(*a, **k)


def _gradclamp_compile_start(s, boom):
    s["gradclamp"]._put_scale = lambda init: boom()


CASES = {
    "flops counting": ("flops", "flops", False, _flops_count),
    "flops disabled mid-call": ("flops", "flops", False, _flops_forward_output),
    "stats op in a compiled backward": ("stats", ("stats", {"sites": ("output", "grad")}), True, _stats_backward_op),
    "stats compile start": ("stats", "stats", True, _stats_compile_start),
    "gradclamp count in a compiled backward": ("gradclamp", ("gradclamp", {"min": -1e9, "max": 1e9}), True,
                                               _gradclamp_count),
    "gradclamp compile start": ("gradclamp", ("gradclamp", {"max": 1e9, "scaler": "scaler"}), True,
                                _gradclamp_compile_start),
}


@pytest.mark.parametrize("on_error", ["warn", "raise"])
@pytest.mark.parametrize("case", list(CASES))
def test_errors_where_torch_calls_a_plugin_go_through_on_error(case, on_error):
    name, spec, compiled, inject = CASES[case]
    if isinstance(spec, tuple) and spec[1].get("scaler") == "scaler":
        spec = (spec[0], {**spec[1], "scaler": torch.amp.GradScaler("cpu")})
    torch._dynamo.reset()
    want = _train(_model(), compiled=compiled)
    torch._dynamo.reset()
    model = _model()
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError(f"injected into {case}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = hookplug.attach(model, "Linear", plugins=[spec], on_error=on_error)
        inject(s, boom)
        if on_error == "raise":
            with pytest.raises(Exception) as info:
                _train(model, s, compiled=compiled)
            s.remove()
            exc = info.value
            while (exc.__cause__ or exc.__context__) is not None and not getattr(exc, "__notes__", None):
                exc = exc.__cause__ or exc.__context__  # (dynamo wraps an error of a compile start)
            assert f"injected into {case}" in str(exc)
            assert any(f"plugin {name!r}" in n for n in getattr(exc, "__notes__", [])), exc
            assert torch._C._len_torch_dispatch_stack() == 0
            return
        got = _train(model, s, compiled=compiled)
        disabled = dict(s.disabled)
        s.remove()
    ours = [str(w.message) for w in caught if "hookplug" in str(w.message) or name in str(w.message)]
    assert len(ours) == 1 and f"hookplug plugin {name!r} failed" in ours[0], ours
    assert list(disabled) == [name] and f"injected into {case}" in disabled[name]
    assert len(calls) == 1  # not run again once disabled
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
    assert got[2] == [0, 0, 0]  # no dispatch mode left on the stack after a step


def test_a_traceable_plugin_failing_in_compiled_code_warns_once():
    """A third-party plugin (traceable) that raises inside a compiled forward: one warning,
    the session's; dynamo does not trace the warning's frame walk (it warned about
    ``sys._getframe`` too); the training is the compiled run's without the plugin."""
    class Bad(hookplug.Plugin):
        name = "bad"

        @hookplug.hookimpl
        def hookplug_forward_output(self, output):
            raise RuntimeError("bad plugin")

    torch._dynamo.reset()
    want = _train(_model(), compiled=True)
    torch._dynamo.reset()
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookplug.attach(model, "Linear", plugins=[Bad()], on_error="warn") as s:
            got = _train(model, s, compiled=True)
            assert list(s.disabled) == ["bad"]
    assert [str(w.message)[:32] for w in caught] == ["hookplug plugin 'bad' failed and"]
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


def test_a_plugin_instance_attached_again_after_a_failure_works_again():
    """The same ``stats`` instance attached again after its compiled-backward op failed (and
    stopped its bank's ops) in an earlier session records gradients again, and the same
    ``flops`` instance after a counting error kept for a hook that never came (a backward
    node that raised) starts clean: the error was warned about at that session's end."""
    from hookplug_plugins.flops import FlopsPlugin
    from hookplug_plugins.stats import StatsPlugin

    stats = StatsPlugin(sites=("output", "grad"))
    torch._dynamo.reset()
    model = _model()
    with pytest.warns(RuntimeWarning, match="'stats' failed"):
        with hookplug.attach(model, "Linear", plugins=[stats], on_error="warn") as s:
            _stats_backward_op(s, lambda: (_ for _ in ()).throw(RuntimeError("once")))
            _train(model, s, compiled=True)
    del stats.bank.accumulate_at  # (the injection: the bank's own method again)
    torch._dynamo.reset()
    model = _model()
    with hookplug.attach(model, "Linear", plugins=[stats], on_error="warn") as s:
        _train(model, s, compiled=True)
        assert not s.disabled
        assert all("grad" in sites for sites in stats.results().values())

    flops = FlopsPlugin()
    flops._failure = RuntimeError("kept from a node that raised")  # (as _fail leaves it)
    with pytest.warns(RuntimeWarning, match="stopped counting after an error: RuntimeError: kept"):
        with hookplug.attach(_model(), "Linear", plugins=[flops]):
            assert flops._failure is None  # not the new session's
            flops._failure = RuntimeError("kept from a node that raised")
    assert flops._failure is None


def test_flops_bookkeeping_around_an_op_failing_leaves_the_op_alone(monkeypatch):
    """flops' own work in its dispatch mode around an op (is it a composite?) failing: the
    op's result stands, one warning, flops disabled."""
    import hookplug_plugins.flops as flops_module

    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("injected into _decomposes")

    monkeypatch.setattr(flops_module, "_decomposes", boom)
    want = _train(_model())
    model = _model()
    with pytest.warns(RuntimeWarning, match="'flops' failed") as caught:
        with hookplug.attach(model, "Linear", plugins=["flops"], on_error="warn") as s:
            got = _train(model, s)
            assert list(s.disabled) == ["flops"]
    assert len([w for w in caught if "flops" in str(w.message)]) == 1 and len(calls) == 1
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
    assert got[2] == [0, 0, 0]
