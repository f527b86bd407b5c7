import copy
import dataclasses
import gc
import warnings
import weakref
from collections import OrderedDict

import pluggy
import pytest
import torch
import torch.nn as nn

import hookplug
from hookplug import PluginError, hookimpl
from hookplug.models import MLP, resnet34_like, tiny_cnn, tiny_transformer


class Recorder(hookplug.Plugin):
    """Observe-only: records what it sees."""

    def __init__(self, name="rec"):
        self.name = name
        self.calls = []
        self.grads = []

    @hookimpl
    def hookplug_forward_output(self, ctx, module, output):
        self.calls.append((ctx.name, ctx.call_index, ctx.step, type(module).__name__))

    @hookimpl
    def hookplug_output_grad(self, ctx, grad, path):
        self.grads.append((ctx.name, path, grad.clone()))


class AddOutput(hookplug.Plugin):
    def __init__(self, name, value, log):
        self.name, self.value, self.log = name, value, log

    @hookimpl
    def hookplug_forward_output(self, output):
        self.log.append(self.name)
        return output + self.value


class ScaleOutput(hookplug.Plugin):
    def __init__(self, name, factor, log):
        self.name, self.factor, self.log = name, factor, log

    @hookimpl
    def hookplug_forward_output(self, output):
        self.log.append(self.name)
        return output * self.factor


def all_hook_dicts(model):
    snap = {}
    for n, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            if hasattr(m, attr):
                snap[(n, attr)] = dict(getattr(m, attr))
    for n, p in model.named_parameters():
        snap[(n, "param_hooks")] = dict(p._backward_hooks or {})
    return snap


def train_step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- plugin forms -----------------------------------------------------------------------------

def test_plugin_forms_and_lookup():
    m = MLP()
    rec = Recorder()
    with hookplug.attach(m, "Linear", plugins=rec) as s:
        assert s["rec"] is rec and "rec" in s
        assert list(s.modules) == ["fc1", "fc2", "fc3"]
        with pytest.raises(KeyError, match="it has: rec"):
            s["nope"]
    with pytest.raises(PluginError, match="unknown hookplug plugin 'nosuch'.*Available:"):
        hookplug.attach(m, "Linear", plugins="nosuch")
    with pytest.raises(PluginError, match="the class Recorder"):
        hookplug.attach(m, "Linear", plugins=Recorder)
    with pytest.raises(PluginError, match="plugins= is required"):
        hookplug.attach(m, "Linear")


def test_two_instances_need_distinct_names():
    m = MLP()
    with pytest.raises(PluginError, match="used twice"):
        hookplug.attach(m, "Linear", plugins=[Recorder("a"), Recorder("a")])
    with hookplug.attach(m, "Linear", plugins=[Recorder("a"), Recorder("b")]) as s:
        m(torch.randn(2, 32))
    assert len(s["a"].calls) == len(s["b"].calls) == 4


def test_selector_dict_gives_each_plugin_its_modules():
    m = MLP()
    a, b = Recorder("a"), Recorder("b")
    with hookplug.attach(m, {"*:fc1": a, "*:fc3, *:fc1": b}) as s:
        m(torch.randn(2, 32))
    assert [c[0] for c in a.calls] == ["fc1"]
    assert [c[0] for c in b.calls] == ["fc1", "fc3"]
    assert list(s.modules) == ["fc1", "fc3"]
    assert list(s.modules_of("b")) == ["fc1", "fc3"]


def test_selector_dict_edge_cases():
    """An empty dict is refused (it hooked nothing, silently); one plugin under two
    selectors with equal options given once as a list and once as a tuple is one plugin."""
    m = MLP()
    with pytest.raises(hookplug.PluginError, match=r"the \{selector: plugins\} dict is empty"):
        hookplug.attach(m, {})
    with hookplug.attach(m, {"*:fc1": ("stats", {"sites": ("output",)}),
                             "*:fc3": ("stats", {"sites": ["output"]})}) as s:
        m(torch.randn(2, 32))
        assert list(s.modules_of("stats")) == ["fc1", "fc3"]


# -- folding and context -----------------------------------------------------------------------------

def test_fold_in_plugin_order():
    m = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ref = m(x)
    log = []
    with hookplug.attach(m, "*:", plugins=[AddOutput("add", 1.0, log), ScaleOutput("mul", 2.0, log)]):
        y = m(x)
    assert log == ["add", "mul"]
    torch.testing.assert_close(y, (ref + 1) * 2)
    log.clear()
    with hookplug.attach(m, "*:", plugins=[ScaleOutput("mul", 2.0, log), AddOutput("add", 1.0, log)]):
        y = m(x)
    assert log == ["mul", "add"]
    torch.testing.assert_close(y, ref * 2 + 1)
    torch.testing.assert_close(m(x), ref)  # removed


def test_tryfirst_is_honoured():
    log = []

    class Late(AddOutput):
        @hookimpl(trylast=True)
        def hookplug_forward_output(self, output):
            self.log.append(self.name)
            return output + self.value

    m = nn.Linear(2, 2)
    with hookplug.attach(m, "*:", plugins=[Late("late", 1.0, log), ScaleOutput("mul", 3.0, log)]):
        m(torch.randn(1, 2))
    assert log == ["mul", "late"]


def test_forward_input_fold_and_kwargs():
    class Block(nn.Module):
        def forward(self, x, *, scale=1.0):
            return x * scale

    class Shift(hookplug.Plugin):
        name = "shift"

        @hookimpl
        def hookplug_forward_input(self, args, kwargs):
            return (args[0] + 1,), {**kwargs, "scale": kwargs.get("scale", 1.0) * 10}

    class Seen(hookplug.Plugin):
        name = "seen"

        def __init__(self):
            self.kwargs = None

        @hookimpl
        def hookplug_forward_input(self, args, kwargs):
            self.kwargs = dict(kwargs)

    m = nn.Sequential()
    m.add_module("blk", Block())
    seen = Seen()
    with hookplug.attach(m, "Block", plugins=["shift" and Shift(), seen]):
        y = m.blk(torch.zeros(2), scale=2.0)
    assert seen.kwargs == {"scale": 20.0}
    torch.testing.assert_close(y, torch.full((2,), 20.0))


def test_context_call_index_and_step():
    m = MLP()
    rec = Recorder()
    with hookplug.attach(m, "Linear", plugins=rec) as s:
        m(torch.randn(2, 32))
        s.step()
        m(torch.randn(2, 32))
    assert rec.calls[:4] == [("fc1", 0, 0, "Linear"), ("fc2", 0, 0, "Linear"), ("fc2", 1, 0, "Linear"),
                             ("fc3", 0, 0, "Linear")]
    assert rec.calls[4:] == [("fc1", 1, 1, "Linear"), ("fc2", 2, 1, "Linear"), ("fc2", 3, 1, "Linear"),
                             ("fc3", 1, 1, "Linear")]


def test_every_n_samples_steps():
    m = MLP()
    rec = Recorder()
    with hookplug.attach(m, "*:fc1", plugins=rec, every=3) as s:
        for _ in range(7):
            m(torch.randn(2, 32))
            s.step()
    assert [c[2] for c in rec.calls] == [0, 3, 6]


# -- observe-only is exact ---------------------------------------------------------------------------

@pytest.mark.parametrize("factory, shape", [(tiny_cnn, (2, 3, 32, 32)), (MLP, (4, 32))])
def test_observe_only_is_bitwise_identical(factory, shape):
    torch.manual_seed(1)
    model = factory()
    x = torch.randn(*shape)
    ref_out, ref_grads = train_step(copy.deepcopy(model), x)
    rec = Recorder()
    with hookplug.attach(model, "*", plugins=rec):
        out, grads = train_step(model, x)
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    assert rec.calls and rec.grads


def test_output_grad_equals_true_gradient(true_output_grads):
    model = MLP()
    x = torch.randn(4, 32)
    true = true_output_grads(model)
    model(x).sum().backward()
    rec = Recorder()
    with hookplug.attach(model, "*:fc1", plugins=rec):
        model(x).sum().backward()
    assert rec.grads[0][:2] == ("fc1", "output")
    assert torch.equal(rec.grads[0][2], true["fc1"][0])


def test_inplace_relu_after_hooked_conv_trains():
    class Clamp(hookplug.Plugin):
        name = "clamp"

        @hookimpl
        def hookplug_output_grad(self, grad):
            return grad.clamp(min=0)

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3))
    x = torch.randn(2, 3, 10, 10)
    ref = copy.deepcopy(model)
    # by hand: the same clamp with a plain tensor hook on conv0's output
    def by_hand(m, i, o):
        o.register_hook(lambda g: g.clamp(min=0))

    h = ref[0].register_forward_hook(by_hand)
    ref(x).sum().backward()
    h.remove()
    rec = Recorder()
    with hookplug.attach(model, "Conv2d", plugins=[Clamp(), rec]):
        model(x).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert {g[0] for g in rec.grads} == {"0", "2"}


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple


class ModelOutputLike(OrderedDict):
    pass


class Structured(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.kind = kind

    def forward(self, x):
        a = self.lin(x)
        b = a * 2
        if self.kind == "tuple":
            return a, [b]
        if self.kind == "dict":
            return {"a": a, "b": b}
        if self.kind == "dataclass":
            return Out(logits=a, hidden=(b,))
        return ModelOutputLike(logits=a, hidden=b)


@pytest.mark.parametrize("kind, paths", [
    ("tuple", {"output[0]", "output[1][0]"}),
    ("dict", {"output.a", "output.b"}),
    ("dataclass", {"output.logits", "output.hidden[0]"}),
    ("modeloutput", {"output.logits", "output.hidden"}),
])
def test_structured_outputs_get_grad_hooks_per_tensor(kind, paths):
    outer = nn.Sequential()
    outer.add_module("s", Structured(kind))
    rec = Recorder()
    with hookplug.attach(outer, "Structured", plugins=rec):
        out = outer(torch.randn(2, 3))
        tensors = [t for _, t in hookplug.structures.iter_tensors(out)]
        sum(t.sum() for t in tensors).backward()
    assert {g[1] for g in rec.grads} == paths


def test_param_grad_hook_replaces_gradient():
    class ZeroBias(hookplug.Plugin):
        name = "zb"

        def __init__(self):
            self.seen = []

        @hookimpl
        def hookplug_param_grad(self, ctx, name, param, grad):
            self.seen.append(name)
            if name.endswith("bias"):
                return torch.zeros_like(grad)

    model = MLP()
    zb = ZeroBias()
    with hookplug.attach(model, "*:fc3", plugins=zb):
        model(torch.randn(4, 32)).sum().backward()
    assert sorted(zb.seen) == ["fc3.bias", "fc3.weight"]
    assert torch.count_nonzero(model.fc3.bias.grad) == 0
    assert torch.count_nonzero(model.fc1.bias.grad) > 0


# -- hot path ------------------------------------------------------------------------------------------

def test_pluggy_not_called_per_forward(monkeypatch):
    model = MLP()
    rec = Recorder()
    with hookplug.attach(model, "Linear", plugins=rec):
        def boom(*a, **k):
            raise AssertionError("pm.hook called on the hot path")

        monkeypatch.setattr(pluggy.HookCaller, "__call__", boom)
        model(torch.randn(2, 32)).sum().backward()
        monkeypatch.undo()
    assert len(rec.calls) == 4


@pytest.mark.parametrize("all_args", [True, False])
def test_eager_forward_hook_calls_no_helper_of_ours(all_args):
    """The hot path (benchmarks/bench_dispatch.py: <= 1.5 us over a bare torch hook) stays
    inline: one output plugin costs the hook, its context and the plugin's method (behind
    one lambda when it takes fewer arguments than the spec); a helper of ours per call (a
    fold loop, a closure, a ctx factory) added 0.1-0.35 us each. Python functions called
    while the module runs, as a profiler sees them."""
    import os
    import sys

    class AllArgs(hookplug.Plugin):
        name = "o"

        @hookimpl
        def hookplug_forward_output(self, ctx, module, args, kwargs, output):
            return None

    class OnlyOutput(hookplug.Plugin):
        name = "o"

        @hookimpl
        def hookplug_forward_output(self, output):
            return None

    root = os.path.dirname(hookplug.__file__)
    model = nn.Sequential(nn.Identity())
    x = torch.zeros(2)
    with hookplug.attach(model, "Identity", plugins=AllArgs() if all_args else OnlyOutput()):
        model[0](x)  # warm
        seen = []

        def prof(frame, event, arg):
            if event == "call":
                code = frame.f_code
                if code.co_filename.startswith(root) or code.co_filename == __file__:
                    seen.append(code.co_name)

        sys.setprofile(prof)
        try:
            model[0](x)
        finally:
            sys.setprofile(None)
    adapter = [] if all_args else ["<lambda>"]
    assert seen == ["post_hook", "__init__", *adapter, "hookplug_forward_output"]


def test_only_needed_torch_hooks_are_registered():
    class OnlyOutput(hookplug.Plugin):
        name = "o"

        @hookimpl
        def hookplug_forward_output(self, output):
            return None

    model = MLP()
    with hookplug.attach(model, "Linear", plugins=OnlyOutput()):
        for m in (model.fc1, model.fc2, model.fc3):
            assert len(m._forward_hooks) == 1 and len(m._forward_pre_hooks) == 0
        assert all(not p._backward_hooks for p in model.parameters())


# -- safety ----------------------------------------------------------------------------------------------

def test_remove_restores_every_hook_dict_and_is_idempotent():
    model = resnet34_like()
    model.fc.register_forward_hook(lambda *a: None)  # the user's own hook survives
    before = all_hook_dicts(model)
    sd_keys = list(model.state_dict().keys())

    class Everything(Recorder):
        @hookimpl
        def hookplug_forward_input(self, args):
            return None

        @hookimpl
        def hookplug_param_grad(self, grad):
            return None

    s = hookplug.attach(model, "*", plugins=Everything())
    assert all_hook_dicts(model) != before
    assert list(model.state_dict().keys()) == sd_keys
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    s.remove()
    s.remove()
    assert all_hook_dicts(model) == before
    assert s.removed


def test_model_is_garbage_collected_after_remove():
    model = tiny_cnn()
    ref = weakref.ref(model)
    with hookplug.attach(model, "*", plugins=Recorder()) as s:
        model(torch.randn(2, 3, 64, 64)).sum().backward()
    del model
    gc.collect()
    assert ref() is None
    assert s.modules == {}


def test_model_freed_by_refcount_even_while_attached():
    model = MLP()
    ref = weakref.ref(model)
    s = hookplug.attach(model, "Linear", plugins=Recorder())
    gc.disable()
    try:
        del model
        assert ref() is None, "a reference cycle keeps the model alive"
    finally:
        gc.enable()
    s.remove()


class Twice(nn.Module):
    """Returns one tensor at two paths (its tensor hook runs both paths' plugins)."""

    def forward(self, x):
        return x, x


@pytest.mark.parametrize("plugins", [
    ("stats", {"sites": ("output", "grad")}),
    [("stats", {"sites": ("output", "grad")}), ("capture", {"grads": True}), "flops"],
], ids=["stats", "stats+capture+flops"])
def test_an_output_kept_after_remove_does_not_keep_the_session(plugins):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), Twice())
    s = hookplug.attach(model, "Linear|Twice", plugins=plugins)
    a, b = model(torch.randn(3, 4))
    s.remove()
    gone = weakref.ref(s)
    del s
    gc.collect()
    assert gone() is None, "the output's tensor hooks keep the removed session alive"
    (a + b).sum().backward()  # the hooks left on the graph do nothing
    assert model[0].weight.grad is not None


def test_grads_of_an_output_reach_a_session_the_user_dropped():
    """A session held only by the model's hooks still records the gradients of outputs."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    seen = []

    class Grads(hookplug.Plugin):
        @hookimpl
        def hookplug_output_grad(self, ctx, grad):
            seen.append((ctx.name, ctx.session is not None))

    hookplug.attach(model, "Linear", plugins=Grads())
    out = model(torch.randn(3, 4))
    gc.collect()
    out.sum().backward()
    assert seen == [("2", True), ("0", True)]


class Failing(hookplug.Plugin):
    name = "failing"

    def __init__(self):
        self.calls = 0

    @hookimpl
    def hookplug_forward_output(self, output):
        self.calls += 1
        raise RuntimeError("plugin bug")


def test_on_error_warn_disables_plugin_and_keeps_result():
    model = MLP()
    x = torch.randn(4, 32)
    ref_out, ref_grads = train_step(copy.deepcopy(model), x)
    bad, rec = Failing(), Recorder()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with hookplug.attach(model, "Linear", plugins=[bad, rec], on_error="warn") as s:
            out, grads = train_step(model, x)
            out2, _ = train_step(model, x)
    msgs = [str(x.message) for x in w if "failing" in str(x.message)]
    assert len(msgs) == 1 and "plugin bug" in msgs[0]
    assert bad.calls == 1
    assert "failing" in s.disabled
    assert torch.equal(out, ref_out) and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    assert len(rec.calls) == 8  # the other plugin kept working
    assert "failing was disabled" in s.report()


def test_on_error_raise_names_plugin():
    model = MLP()
    with hookplug.attach(model, "Linear", plugins=Failing()):
        with pytest.raises(RuntimeError, match="plugin bug") as info:
            model(torch.randn(2, 32))
    notes = getattr(info.value, "__notes__", [])
    assert any("failing" in n and "hookplug_forward_output" in n for n in notes)


def test_bad_arguments_get_clear_errors():
    m = MLP()
    with pytest.raises(ValueError, match="on_error must be one of"):
        hookplug.attach(m, "Linear", plugins=Recorder(), on_error="ignore")
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        hookplug.attach(m, "Linear", plugins=Recorder(), every=0)
    with pytest.raises(ValueError, match="flush_every must be None or an int >= 1, got True"):
        hookplug.attach(m, "Linear", plugins=Recorder(), flush_every=True)
    with pytest.raises(TypeError, match="strict must be True or False, got 'no'"):
        hookplug.attach(m, "Linear", plugins=Recorder(), strict="no")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hookplug.attach([1], "Linear", plugins=Recorder())
    with pytest.raises(hookplug.SelectorError):
        hookplug.attach(m, "Lineer", plugins=Recorder())
    assert all_hook_dicts(m) == all_hook_dicts(MLP())  # nothing left behind by failed attaches

    class BadArg(hookplug.Plugin):
        name = "badarg"

        @hookimpl
        def hookplug_forward_output(self, outputs):
            pass

    with pytest.raises(Exception, match="outputs"):
        hookplug.attach(m, "Linear", plugins=BadArg())


def test_transformer_model_with_kwargs_hooks():
    model = tiny_transformer()
    rec = Recorder()
    tokens = torch.randint(0, 1000, (2, 8))
    ref = model(tokens)
    with hookplug.attach(model, "EncoderLayer, Linear:*.out", plugins=rec):
        out = model(tokens)
    assert torch.equal(out, ref)
    assert [c[0] for c in rec.calls] == ["layers.0.out", "layers.0", "layers.1.out", "layers.1"]


# -- regressions found in review --------------------------------------------------------------------

class ParamOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4))

    def forward(self):
        return self.pos


def test_leaf_output_gets_no_lingering_tensor_hook():
    m = nn.Sequential()
    m.add_module("pos", ParamOut())
    rec = Recorder()
    with hookplug.attach(m, "ParamOut", plugins=rec):
        for _ in range(3):
            m.pos().sum().backward()
        assert not m.pos.pos._backward_hooks
    assert len(rec.calls) == 3


def test_forward_that_raises_unwinds_per_call_state():
    class Stack(Recorder):
        def __init__(self):
            super().__init__("stack")
            self.open = []

        @hookimpl
        def hookplug_forward_input(self, ctx):
            self.open.append(ctx)

        @hookimpl
        def hookplug_forward_output(self, ctx, output):
            assert self.open.pop() is ctx

    m = MLP()
    st = Stack()
    with hookplug.attach(m, "Linear", plugins=st) as s:
        with pytest.raises(RuntimeError):
            m(torch.randn(2, 5))  # wrong width: fc1 raises
        m(torch.randn(2, 32))
        assert st.open == []
        assert all(not b._pending for b in s._bindings.values())


def test_input_only_plugin_keeps_no_pending_contexts():
    class InputOnly(hookplug.Plugin):
        name = "in"

        @hookimpl
        def hookplug_forward_input(self, ctx):
            return None

    m = MLP()
    with hookplug.attach(m, "Linear", plugins=InputOnly()) as s:
        for _ in range(5):
            m(torch.randn(2, 32))
        assert all(not b._pending and not b.has_post for b in s._bindings.values())


def test_unsampled_steps_still_run_plugins_that_opt_out_of_sampling():
    class Always(Recorder):
        sampled = False

    m = MLP()
    always, sampled = Always("always"), Recorder("sampled")
    with hookplug.attach(m, "*:fc1", plugins=[always, sampled], every=3) as s:
        for _ in range(6):
            m(torch.randn(2, 32)).sum().backward()
            s.step()
    assert [c[2] for c in always.calls] == [0, 1, 2, 3, 4, 5]
    assert [c[2] for c in sampled.calls] == [0, 3]
    # call_index counts every call, sampled or not
    assert [c[1] for c in sampled.calls] == [0, 3]
    assert len(always.grads) == 6 and len(sampled.grads) == 2


def test_gradclamp_acts_on_unsampled_steps():
    m = MLP()
    x = torch.randn(4, 32)
    with hookplug.attach(m, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "fc3.bias"}), every=4) as s:
        for _ in range(3):
            m.zero_grad()
            m(x).sum().backward()
            assert torch.count_nonzero(m.fc3.bias.grad) == 0
            s.step()


@pytest.mark.parametrize("plugin, data", [
    ("capture", lambda p: p.features["fc1"]),
    ("stats", lambda p: p.bank),  # its bank reaches the session's module tables while attached
])
def test_del_session_frees_plugin_data_without_gc(plugin, data):
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins=plugin)
    m(torch.randn(2, 32))
    s.step()
    ref = weakref.ref(data(s[plugin]))
    s.remove()
    gc.disable()
    try:
        del s
        assert ref() is None
    finally:
        gc.enable()


def test_attach_to_a_compiled_wrapper_uses_plain_names():
    m = MLP()
    rec = Recorder()
    with hookplug.attach(torch.compile(m, backend="eager"), "Linear", plugins=rec) as s:
        assert list(s.modules) == ["fc1", "fc2", "fc3"]
        m(torch.randn(2, 32))
    assert [c[0] for c in rec.calls] == ["fc1", "fc2", "fc2", "fc3"]


@pytest.mark.parametrize("traceable", [True, False])
def test_untraceable_plugin_runs_as_eager_code_inside_compiled_models(traceable):
    """``traceable = False``: under torch.compile the hooks run outside the graph, with the
    contexts of eager code (call_index counts calls); traceable plugins get -1 there."""
    class Calls(hookplug.Plugin):
        name = "calls"

        def __init__(self):
            self.seen = []

        @hookimpl
        def hookplug_forward_output(self, ctx, output):
            self.seen.append((ctx.name, ctx.call_index))

    Calls.traceable = traceable
    torch._dynamo.reset()
    model = MLP(8, 16, 4)
    plugin = Calls()
    with hookplug.attach(model, "Linear", plugins=plugin):
        compiled = torch.compile(model, backend="eager")
        for _ in range(2):
            compiled(torch.randn(3, 8))
    torch._dynamo.reset()
    if traceable:  # traced: appended at trace time only, call_index -1
        assert plugin.seen and all(i == -1 for _, i in plugin.seen)
    else:
        assert plugin.seen == [("fc1", 0), ("fc2", 0), ("fc2", 1), ("fc3", 0),
                               ("fc1", 1), ("fc2", 2), ("fc2", 3), ("fc3", 1)]


def test_untraceable_plugin_under_fullgraph_names_itself():
    """fullgraph=True forbids the graph break of a ``traceable = False`` plugin's hooks:
    dynamo's error names hookplug, the plugin(s) and fullgraph=True."""
    class Keeps(hookplug.Plugin):
        name = "keeps"
        traceable = False

        @hookimpl
        def hookplug_forward_output(self, output):
            pass

    torch._dynamo.reset()
    model = MLP(8, 16, 4)
    with hookplug.attach(model, "Linear", plugins=[Keeps(), "stats", "capture"]):
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=r"hookplug plugins 'keeps', 'capture' set traceable = False"
                                            r".*torch.compile\(fullgraph=True\) forbids"):
            compiled(torch.randn(3, 8))
    torch._dynamo.reset()


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_an_attached_model_runs_no_plugin(strict):
    """torch.export of an attached model: the hooks run no plugin, so the program holds no
    hookplug op (nor the session's bank), computes what the model computes without hooks,
    and nothing of the export (or of running the program) reaches the session."""
    torch._dynamo.reset()
    model, x = MLP(8, 16, 4), torch.randn(3, 8)
    expected = model(x)
    log = []
    plugins = [("stats", {"sites": ("input", "output", "grad")}), "capture", AddOutput("add", 1.0, log)]
    with hookplug.attach(model, "Linear", plugins=plugins) as s:
        program = torch.export.export(model, (x,), strict=strict)
        assert not [n.target for n in program.graph.nodes if "hookplug" in str(n.target)]
        assert not program.constants
        torch.testing.assert_close(program.module()(x), expected)
        assert s["stats"].results() == {} and not s["capture"].features and not log
        model(x)  # eager calls are still observed
        assert set(s["stats"].results()) == {"fc1", "fc2", "fc3"} and len(log) == 4
    torch._dynamo.reset()


def test_jit_trace_of_an_attached_model_runs_no_plugin():
    """torch.jit.trace (also what the TorchScript ONNX exporter runs): as under torch.export
    the hooks run no plugin. Before, stats' op was traced into the graph (the traced module
    went on accumulating into the removed session's bank) and capture's per-call state made
    trace's own check fail ("Graphs differed across invocations")."""
    model, x = MLP(8, 16, 4), torch.randn(3, 8)
    expected = model(x)
    log = []
    plugins = [("stats", {"sites": ("input", "output", "grad")}), "capture", "flops",
               ("gradclamp", {"min": -1}), AddOutput("add", 1.0, log)]
    with hookplug.attach(model, "Linear", plugins=plugins) as s:
        traced = torch.jit.trace(model, x, check_trace=False)
        assert "hookplug::" not in str(traced.inlined_graph)
        assert s["stats"].results() == {} and not s["capture"].features and not log
        torch.testing.assert_close(traced(x), expected)
        assert s["stats"].results() == {} and not log
        traced = torch.jit.trace(model, x)  # trace's check: an eager run besides (observed)
        torch.testing.assert_close(traced(x), expected)
        model(x)  # eager calls are still observed
        assert set(s["stats"].results()) == {"fc1", "fc2", "fc3"} and log


def test_fx_tracing_of_an_attached_model_runs_no_plugin():
    """torch.fx tracing (symbolic_trace, torchvision's get_graph_node_names and
    create_feature_extractor, make_fx), as jit.trace: the hooks run no plugin. Before,
    symbolic_trace ran the hooks of the modules it traces through (not leaves) on Proxies:
    capture kept Proxy objects (and put dead get_attr nodes in the graph); make_fx traced
    stats' op into its graph and flops counted its ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model, x = nn.Sequential(MLP(8, 16, 4)), torch.randn(3, 8)  # "0": traced through, not a leaf
    expected = model(x)
    log = []
    plugins = [("stats", {"sites": ("input", "output", "grad")}), ("capture", {"grads": True}), "flops",
               ("gradclamp", {"min": -1, "params": "*"}), AddOutput("add", 1.0, log)]
    with hookplug.attach(model, "*, *:", plugins=plugins) as s:
        gm = torch.fx.symbolic_trace(model)
        assert [n.op for n in gm.graph.nodes].count("get_attr") == 0
        graph = make_fx(model)(x)
        assert "hookplug" not in graph.code
        assert s["stats"].results() == {} and not s["capture"].features and not log
        assert s["flops"].total()["flops"] == 0
        model(x)  # eager calls are still observed, the GraphModule's too (it calls the leaves)
        gm(x)
        assert set(s["stats"].results()) == {"", "0", "0.fc1", "0.fc2", "0.fc3"} and len(log) == 6 + 4
    torch.testing.assert_close(gm(x), expected)
    torch.testing.assert_close(graph(x), expected)


def test_only_plugin_objects_are_taken_as_instances():
    m = MLP()
    for spec, got in [({"stats", "flops"}, "got set "), (3, "got int 3"), (b"stats", "got bytes b'stats'"),
                      (print, "got builtin_function_or_method"), (["stats", range(2)], r"got range range\(0, 2\)")]:
        with pytest.raises(PluginError, match=r"plugins= takes a plugin name, \(name, \{options\}\), a list of these, "
                                              r"a dict \{name: options\} or a plugin instance .*" + got) as info:
            hookplug.attach(m, "Linear", plugins=spec)
        assert ("pass a list" in str(info.value)) == isinstance(spec, set)
    with pytest.raises(PluginError, match=r"sink= takes .*got set \{'jsonl'\}; pass a list \(sinks run in list order\)"):
        hookplug.attach(m, "Linear", plugins="stats", sink={"jsonl"})
    with pytest.raises(PluginError, match=r"a spec tuple is \(name, options\), got a tuple of 3 items"):
        hookplug.attach(m, "Linear", plugins=[("stats", {"bins": 0}, "x")])
    assert all_hook_dicts(m) == all_hook_dicts(MLP())

    class NoHooks(hookplug.Plugin):  # a Plugin is one even with no hook (results() only)
        name = "nohooks"

    with hookplug.attach(m, "Linear", plugins=[NoHooks(), Recorder()]) as s:
        assert list(s.plugins) == ["nohooks", "rec"]


class TypoHook(hookplug.Plugin):
    name = "typo"

    @hookimpl
    def hookplug_forward_outptu(self, ctx, output):
        pass


class WrongArg(hookplug.Plugin):
    name = "wrong-arg"  # a '-' in the name: pluggy knows plugins by their session names

    @hookimpl
    def hookplug_forward_output(self, ctx, out):
        pass


@pytest.mark.parametrize("plugin, message", [
    (TypoHook(), r"hookplug plugin 'typo': unknown hook 'hookplug_forward_outptu' "
                 r"\(did you mean 'hookplug_forward_output'\?\)"),
    (WrongArg(), r"hookplug plugin 'wrong-arg' does not fit hookplug's hook specs: .*\{'out'\} are declared in the "
                 r"hookimpl but can not be found in the hookspec; the spec is "
                 r"hookplug_forward_output\(ctx, module, args, kwargs, output\)"),
])
def test_plugin_not_fitting_the_specs_is_a_plugin_error_or_left_out(plugin, message):
    m = MLP()
    with pytest.raises(PluginError, match=message):
        hookplug.attach(m, "Linear", plugins=[Recorder(), plugin])
    assert all_hook_dicts(m) == all_hook_dicts(MLP())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = hookplug.attach(m, "Linear", plugins=[Recorder(), plugin], on_error="warn")
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and msgs[0].endswith("; attached without it (on_error='warn')") and w[0].filename == __file__
    m(torch.randn(2, 32))
    assert list(s.plugins) == ["rec"] and len(s["rec"].calls) == 4
    s.remove()


class BadReport(hookplug.Plugin):
    name = "badreport"

    def report(self):
        raise RuntimeError("report bug")

    def results(self):
        raise RuntimeError("results bug")


def test_report_and_results_isolate_a_failing_plugin_under_warn():
    m = MLP()
    with hookplug.attach(m, "Linear", ["stats", BadReport()], on_error="warn") as s:
        m(torch.randn(2, 32))
        report = s.report()
        assert "== stats ==" in report and "!! badreport: report failed: RuntimeError: report bug" in report
        with pytest.warns(RuntimeWarning, match=r"plugin 'badreport': results\(\) failed \(RuntimeError: results bug\); "
                                                r"left out of session.results\(\)"):
            assert list(s.results()) == ["stats"]
    with hookplug.attach(m, "Linear", ["stats", BadReport()]) as s:
        for method, text in (("report", "report bug"), ("results", "results bug")):
            with pytest.raises(RuntimeError, match=text) as info:
                getattr(s, method)()
            assert f"(raised by hookplug plugin 'badreport' in {method}())" in info.value.__notes__


def test_select_checks_strict_as_attach_does():
    with pytest.raises(TypeError, match="select\\(\\): strict must be True or False, got 'x'"):
        hookplug.select(MLP(), "Linear", strict="x")


def test_with_session_step_is_refused_with_what_to_write():
    """``with s.step():`` ended the step before its body ran: each body was recorded one step
    late and the last ended only at remove(). The form is refused by name."""
    m = MLP()
    with hookplug.attach(m, "*:fc1", plugins=Recorder()) as s:
        with pytest.raises(TypeError, match=r"call session\.step\(\) after each step's work"):
            with s.step():
                m(torch.randn(2, 32))
        s.step()


def test_a_tensor_returned_at_two_paths_is_steered_once():
    """``return y, y`` (HF's ``last_hidden_state is hidden_states[-1]``): a tensor hook per
    path made a plugin doubling the gradient double it twice in eager code (compiled code
    ran every path's hooks once, on one gradient). Observers still see each path."""

    class Scale(hookplug.Plugin):
        name = "scale"

        @hookimpl
        def hookplug_output_grad(self, grad):
            return grad * 2

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y, y

    torch.manual_seed(0)
    m, x = nn.Sequential(Twice()), torch.randn(2, 4)
    m(x)[0].sum().backward()
    plain = m[0].lin.weight.grad.clone()
    m.zero_grad()
    with hookplug.attach(m, "Twice", plugins=[Scale(), ("stats", {"sites": ("grad",)})]) as s:
        m(x)[0].sum().backward()
    torch.testing.assert_close(m[0].lin.weight.grad, 2 * plain)
    seen = s["stats"].results()["0"]
    assert set(seen) == {"grad[0]", "grad[1]"} and all(int(v.calls) == 1 for v in seen.values())
    # gradclamp counts what it changed once, not once per path
    counts = []
    for n in (1, 2, 3):
        m2 = nn.Sequential(Twice())
        m2[0].forward = (lambda mod, k: lambda x: (mod.lin(x),) * k)(m2[0], n)
        with hookplug.attach(m2, "Twice", plugins=("gradclamp", {"max": 0.5})) as s2:
            (m2(x)[0] * torch.arange(8.0).view(2, 4)).sum().backward()
        counts.append(int(s2["gradclamp"].results()["0"]["changed"]))
    assert counts == [7, 7, 7]


def test_a_module_replaced_after_attach_is_named_in_a_warning_at_the_first_step():
    """A selected module replaced after attach keeps its hooks on the old object, which the
    model no longer calls: the first step() says so (once), rather than record nothing."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    s = hookplug.attach(model, "Linear", plugins="stats")
    model[2] = nn.Linear(4, 2)  # as timm's reset_classifier does
    model(torch.randn(3, 4))
    with pytest.warns(RuntimeWarning, match=r"no longer in the model.*'2'") as rec:
        s.step()
    assert all("'0'" not in str(w.message) for w in rec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        model(torch.randn(3, 4))
        s.step()
        s.remove()
    assert set(s["stats"].results()) == {"0"}  # the replaced module's old object was never called


def test_a_module_replaced_after_the_first_step_is_named_at_remove():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = hookplug.attach(model, "Linear", plugins="stats")
        model(torch.randn(3, 4))
        s.step()
    model[0] = nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match=r"no longer in the model.*'0'"):
        s.remove()


@pytest.mark.parametrize("dynamo", [False, True])
def test_session_warnings_name_the_callers_line(fresh_python, dynamo):
    """step() and remove() run through dynamo's disable wrapper once dynamo is imported: the
    replaced-module warnings name the line of the user's call, not hookplug's or dynamo's."""
    fresh_python("""
import warnings, torch, torch.nn as nn, hookplug
if DYNAMO:
    import torch._dynamo
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
s = hookplug.attach(model, "Linear", plugins="stats")
model[2] = nn.Linear(4, 2)
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    s.step()  # STEP
    model[0] = nn.Linear(4, 4)
    with s:  # WITH
        pass  # PASS
lines = {l.split("# ")[-1]: i + 1 for i, l in enumerate(open(__file__).read().splitlines()) if "  # " in l}
seen = [(w.filename, w.lineno) for w in rec if "no longer in the model" in str(w.message)]
assert seen[0] == (__file__, lines["STEP"]) and len(seen) == 2, seen
assert seen[1] in ((__file__, lines["WITH"]), (__file__, lines["PASS"])), seen
print("ok")
""".replace("DYNAMO", str(dynamo)))


@pytest.mark.parametrize("where", ["forward", "backward", "unknown"])
def test_plugin_failure_warnings_name_the_callers_line(where):
    """on_error="warn": a plugin failing in a forward or backward hook, or one that does not
    fit the hook specs, is named in a warning at the user's line (the model call, backward(),
    attach()), not at hookplug's or torch's own code."""
    class Boom(hookplug.Plugin):
        name = "boom"

        @hookplug.hookimpl
        def hookplug_forward_output(self, output):
            if where == "forward":
                raise RuntimeError("boom")

        @hookplug.hookimpl
        def hookplug_output_grad(self, grad):
            raise RuntimeError("boom")

    class Misfit(hookplug.Plugin):
        name = "misfit"

        @hookplug.hookimpl
        def hookplug_no_such_hook(self):
            pass

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plugins = [Boom()] if where != "unknown" else ["stats", Misfit()]
        s = hookplug.attach(model, "Linear", plugins=plugins, on_error="warn"); line = _lineno()
        out = model(x); line_fwd = _lineno()
        out.sum().backward(); line_bwd = _lineno()
        s.remove()
    want = {"forward": line_fwd, "backward": line_bwd, "unknown": line}[where]
    seen = [(w.filename, w.lineno) for w in rec
            if "disabled for this session" in str(w.message) or "attached without it" in str(w.message)]
    assert seen == [(__file__, want)], seen


def test_first_party_plugin_warnings_name_the_callers_line():
    """A plugin's own warnings, given at attach (gradclamp's params= matching nothing) or in
    a backward hook (its sparse-gradient warning), name the user's line too."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Embedding(10, 4, sparse=True))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        hookplug.attach(model, "ReLU", plugins=("gradclamp", {"max": 1, "params": "zzz*"})).remove(); at = _lineno()
        s = hookplug.attach(model, "Embedding", plugins=("gradclamp", {"max": 1.0, "params": "*"}))
        model[2](torch.tensor([1, 2])).sum().backward(); bwd = _lineno()
        s.remove()
    seen = {str(w.message)[:40]: (w.filename, w.lineno) for w in rec if "gradclamp" in str(w.message)}
    assert sorted(seen.values()) == [(__file__, at), (__file__, bwd)], seen


def _lineno() -> int:
    import sys
    return sys._getframe(1).f_lineno


def test_hf_resize_token_embeddings_after_attach_is_warned_of():
    tr = pytest.importorskip("transformers")
    config = tr.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                           tie_word_embeddings=False)
    model = tr.GPT2LMHeadModel(config)
    s = hookplug.attach(model, "Linear|Embedding", plugins="stats")
    model.resize_token_embeddings(120)  # new wte and, untied, a new lm_head
    model(input_ids=torch.randint(0, 120, (2, 8)))
    with pytest.warns(RuntimeWarning, match=r"no longer in the model") as rec:
        s.step()
    msg = " ".join(str(w.message) for w in rec)
    assert "'lm_head'" in msg and "wte" not in msg  # wte is resized in place: still observed
    s.remove()


@pytest.mark.parametrize("plugin", ["'stats'", "('gradclamp', {'max': 0.05})"])
def test_a_compiled_step_calling_backward_after_a_graph_break_under_compiled_autograd_does_not_hang(
        fresh_python, plugin):
    """The backward's lazy compile starts inside code dynamo runs, so dynamo's compile-start
    callbacks run with its frame hook on: hookplug's, converted by dynamo, took the callbacks'
    lock dynamo holds there (a deadlock, with stats or gradclamp attached; none without)."""
    out = fresh_python(f"""
import faulthandler, torch, hookplug
faulthandler.dump_traceback_later(150, exit=True)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
x = torch.randn(5, 8)
s = hookplug.attach(m, "Linear", plugins={plugin})
scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
def step():
    scaler.scale((m(x) * 3).sum()).backward()  # GradScaler.scale: a graph break before backward
fn = torch.compile(step, backend="aot_eager")
torch._dynamo.config.compiled_autograd = True
fn(); fn()
s.step()
print("done", sorted(s.results()[s.plugins and list(s.plugins)[0]]))
""")
    assert out == "done ['0', '2']"


def test_session_step_inside_a_compiled_training_step_runs_as_eager_code(fresh_python):
    """``session.step()`` called inside a compiled training step (forward, backward,
    optimizer step and the step boundary in one ``torch.compile``d function): dynamo traced
    the session's Python (its lock, the bank snapshot, the flush), 10 graph breaks against 4
    without hookplug, 3 graphs against 2, and recompiled hookplug's own functions. It runs as
    eager code now, one graph break, and the records equal an eager loop's."""
    import json

    out = json.loads(fresh_python("""
import json, torch, hookplug
from torch._dynamo.utils import counters

def run(compiled, hooked):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    s = hookplug.attach(m, "Linear", plugins="stats") if hooked else None
    def train(x):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if s is not None:
            s.step()
        return loss
    fn = torch.compile(train, backend="aot_eager") if compiled else train
    torch._dynamo.reset()
    counters.clear()
    for i in range(8):
        fn(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)))
    seen = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    recs = s.flush() if s is not None else []
    if s is not None:
        s.remove()
    return seen, sorted((r["step"], r["module"], r["numel"], r["min"], r["max"]) for r in recs)

plain, _ = run(True, False)
hooked, recs = run(True, True)
_, eager = run(False, True)
print(json.dumps({"plain": plain, "hooked": hooked, "same": recs == eager, "n": len(recs)}))
"""))
    assert out["hooked"] == [out["plain"][0], out["plain"][1] + 1], out
    assert out["same"] and out["n"] == 16, out


class _Ends(hookplug.Plugin):
    """Records its session hooks; ``fail`` names the one that raises."""

    def __init__(self, name="ends", fail=None):
        self.name, self.fail, self.calls = name, fail, []

    @hookplug.hookimpl
    def hookplug_session_start(self, session):
        self.calls.append("start")
        if self.fail == "start":
            raise RuntimeError("the real problem")

    @hookplug.hookimpl
    def hookplug_step(self, step):
        self.calls.append(("step", step))

    @hookplug.hookimpl
    def hookplug_session_end(self, session):
        self.calls.append("end")
        if self.fail == "end":
            raise RuntimeError("teardown failed")


def test_an_error_removing_the_session_does_not_replace_the_with_blocks_own():
    """The block raised: a plugin failing in session_end (or a sink in the last flush) is a
    warning and a note on the block's exception, which the caller's except still catches."""
    plugin = _Ends(fail="end")
    with pytest.warns(RuntimeWarning, match="removing the session failed as well: RuntimeError: teardown failed") as rec:
        with pytest.raises(ValueError, match="bad batch") as info:
            with hookplug.attach(MLP(), "Linear", plugins=plugin):
                raise ValueError("bad batch")
    assert rec[0].filename == __file__
    assert any("teardown failed" in n for n in getattr(info.value, "__notes__", []))
    assert plugin.calls == ["start", "end"]
    with pytest.raises(RuntimeError, match="teardown failed"):  # no error of its own: raised
        with hookplug.attach(MLP(), "Linear", plugins=_Ends(fail="end")):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (python -W error): the block's error still goes on
        with pytest.raises(ValueError, match="bad batch") as info:
            with hookplug.attach(MLP(), "Linear", plugins=_Ends(fail="end")):
                raise ValueError("bad batch")
    assert any("teardown failed" in n for n in info.value.__notes__)


def test_a_failed_last_flush_and_a_failing_session_end_are_both_reported():
    """The sink's last write failed and a plugin's session_end failed too: the session_end
    error replaced the flush's, which went unreported (as a block's note and as the error
    raised)."""

    class FullDisk(hookplug.Sink):
        name = "fulldisk"

        @hookplug.hookimpl
        def hookplug_flush(self, records):
            raise OSError("disk full")

    model = MLP()
    with pytest.warns(RuntimeWarning) as rec:
        with pytest.raises(KeyError, match="block") as info:
            with hookplug.attach(model, "Linear", plugins=["stats", _Ends(fail="end")], sink=FullDisk()):
                model(torch.randn(2, 32))
                raise KeyError("block")
    said = [str(w.message) for w in rec]
    assert any("OSError: disk full" in m for m in said) and any("teardown failed" in m for m in said)
    assert any("disk full" in n for n in info.value.__notes__)
    with pytest.warns(RuntimeWarning, match="removing the session failed as well: RuntimeError: teardown failed"):
        with pytest.raises(OSError, match="disk full") as info:  # the first failure is raised
            with hookplug.attach(model, "Linear", plugins=["stats", _Ends(fail="end")], sink=FullDisk()):
                model(torch.randn(2, 32))
    assert any("teardown failed" in n for n in info.value.__notes__)


def test_a_plugin_failing_to_start_is_the_error_raised_and_only_started_plugins_end():
    first, second = _Ends("first", fail="start"), _Ends("second")
    model = MLP()
    with pytest.raises(RuntimeError, match="the real problem"):
        hookplug.attach(model, "Linear", plugins=[first, second])
    assert first.calls == ["start"] and second.calls == []  # neither started: neither ends
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_step_after_remove_calls_no_plugin():
    plugin = _Ends()
    s = hookplug.attach(MLP(), "Linear", plugins=plugin)
    s.step()
    s.remove()
    index = s.step_index
    s.step()
    assert plugin.calls == ["start", ("step", 0), "end"] and s.step_index == index


def test_a_plugin_disabled_in_a_calls_input_half_gets_no_output_half():
    """on_error="warn": a plugin whose forward_input fails is called no more, also not for
    the output half of that call or of the outer calls running (each call's post hook runs
    the plugins of the step it began in, which are those still enabled)."""
    calls = []

    class Bad(hookplug.Plugin):
        name = "bad"

        @hookplug.hookimpl
        def hookplug_forward_input(self, ctx):
            calls.append(("in", ctx.name))
            if ctx.name == "0.1":
                raise RuntimeError("boom")

        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx):
            calls.append(("out", ctx.name))

    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Linear(3, 3))
    with pytest.warns(RuntimeWarning, match="'bad' failed"):
        with hookplug.attach(model, "*", plugins=[Bad()], on_error="warn") as s:
            model(torch.randn(2, 3))
            assert list(s.disabled) == ["bad"]
    assert calls == [("in", "0"), ("in", "0.0"), ("out", "0.0"), ("in", "0.1")]  # ("*": not the root)
