"""Lifecycle under faults: session_end for every plugin, values plugins return, copies and
pickles of an attached model (issue 13, items 2, 6, 10, 11)."""
import collections
import copy
import copyreg
import gc
import io
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import hookplug
from hookplug import PluginError, hookimpl
from hookplug.models import MLP


def hook_dicts(model):
    """Every hook dict of every module and parameter, as plain dicts."""
    snap = {}
    for n, m in model.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, dict) and "hook" in attr:
                snap[(n, attr)] = dict(value)
    for n, p in model.named_parameters():
        snap[(n, "param_hooks")] = dict(p._backward_hooks or {})
    return snap


# -- item 2: every plugin's session_end runs ---------------------------------------------------

class Ender(hookplug.Plugin):
    """Enters a global mode at session start and leaves it at session end (as flops does)."""

    def __init__(self, name, fail=False, log=None):
        self.name, self.fail, self.log = name, fail, log if log is not None else []
        self.active = False

    @hookimpl
    def hookplug_session_start(self):
        self.active = True

    @hookimpl
    def hookplug_forward_output(self, ctx):
        pass

    @hookimpl
    def hookplug_session_end(self):
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} cannot clean up")
        self.active = False


def test_session_end_runs_for_every_plugin_when_one_raises():
    log = []
    model = MLP()
    plugins = [Ender("first", log=log), Ender("bad", fail=True, log=log), Ender("last", log=log)]
    before = hook_dicts(model)
    s = hookplug.attach(model, "Linear", plugins=plugins)
    with pytest.raises(RuntimeError, match="bad cannot clean up") as info:
        s.remove()
    assert log == ["first", "bad", "last"], "a failing session_end stopped the others"
    assert not plugins[0].active and not plugins[2].active
    assert "hookplug plugin 'bad' in hookplug_session_end" in "".join(getattr(info.value, "__notes__", []))
    assert hook_dicts(model) == before
    s.remove()  # a second remove is a no-op: no second session_end, nothing raised
    assert log == ["first", "bad", "last"]


def test_session_end_errors_after_the_first_are_named_too():
    log = []
    s = hookplug.attach(MLP(), "Linear", plugins=[Ender("a", fail=True, log=log), Ender("b", fail=True, log=log)])
    with pytest.raises(RuntimeError, match="a cannot clean up") as info:
        s.remove()
    notes = "".join(getattr(info.value, "__notes__", []))
    assert log == ["a", "b"] and "plugin 'b' also raised in hookplug_session_end" in notes


def test_session_end_failure_under_warn_warns_and_ends_the_others():
    log = []
    model = MLP()
    plugins = [Ender("bad", fail=True, log=log), Ender("good", log=log)]
    s = hookplug.attach(model, "Linear", plugins=plugins, on_error="warn")
    model(torch.randn(2, 32))
    with pytest.warns(RuntimeWarning, match="'bad' failed.*hookplug_session_end.*cannot clean up"):
        s.remove()  # used to raise KeyError: '0' from rebuilding the removed bindings
    assert log == ["bad", "good"] and not plugins[1].active
    assert "bad" in s.disabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.remove()


# -- item 6: values returned by forward_output / output_grad / param_grad are checked -----------

class Returns(hookplug.Plugin):
    """Returns ``value(x)`` from one hook."""

    def __init__(self, hook, value, name="bad"):
        self.name, self.hook, self.value = name, hook, value
        self.calls = 0

    @hookimpl
    def hookplug_forward_input(self, args, kwargs):
        if self.hook == "forward_input":
            self.calls += 1
            return self.value((args, kwargs))

    @hookimpl
    def hookplug_forward_output(self, output):
        if self.hook == "forward_output":
            self.calls += 1
            return self.value(output)

    @hookimpl
    def hookplug_output_grad(self, grad):
        if self.hook == "output_grad":
            self.calls += 1
            return self.value(grad)

    @hookimpl
    def hookplug_param_grad(self, grad):
        if self.hook == "param_grad":
            self.calls += 1
            return self.value(grad)


def relu_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


def run_step(model):
    model.zero_grad(set_to_none=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


BAD_RETURNS = [
    # the 1-tuple forgotten: a batch of one would be unbound into its rows, a larger one raise
    ("forward_input", lambda ak: (ak[0][0], ak[1]), r"hookplug_forward_input must return None or "
     r"\(args: tuple, kwargs: dict\), got \(Tensor, dict\)"),
    ("forward_input", lambda ak: (5, {}), r"hookplug_forward_input .*got \(int, dict\)"),
    ("forward_input", lambda ak: list(ak), r"hookplug_forward_input .*got list"),
    ("forward_output", lambda out: "not a tensor", "hookplug_forward_output for module '0' must return "
     r"None or a tensor like the module's output \(Tensor\(shape=\(4, 6\), dtype=torch.float32, "
     r"device=cpu\)\), got str"),
    ("forward_output", lambda out: (out,), "hookplug_forward_output for module '0' must return None or a "
     "tensor .*got tuple"),
    ("output_grad", lambda g: g[:, :2], r"hookplug_output_grad for module '0' output must return None or a "
     r"tensor like the incoming grad \(Tensor\(shape=\(4, 6\).*got Tensor\(shape=\(4, 2\)"),
    ("output_grad", lambda g: g.double(), "hookplug_output_grad .*got Tensor.*dtype=torch.float64"),
    ("output_grad", lambda g: g.tolist(), "hookplug_output_grad .*got list"),
    ("param_grad", lambda g: g.sum(), r"hookplug_param_grad for parameter '0.(weight|bias)' must return "
     r"None or a tensor like the incoming grad .*got Tensor\(shape=\(\)"),
]


@pytest.mark.parametrize("hook, value, message", BAD_RETURNS)
def test_bad_return_raises_naming_plugin_hook_expected_and_received(hook, value, message):
    model = relu_model()
    with hookplug.attach(model, "*:0", plugins=Returns(hook, value)):
        with pytest.raises(PluginError, match="plugin 'bad': " + message):
            run_step(model)


@pytest.mark.parametrize("hook, value, message", BAD_RETURNS)
def test_bad_return_under_warn_disables_plugin_and_step_is_unaltered(hook, value, message):
    model = relu_model()
    expected_out, expected_grads = run_step(model)
    bad = Returns(hook, value)
    with hookplug.attach(model, "*:0", plugins=bad, on_error="warn") as s:
        with pytest.warns(RuntimeWarning, match="'bad' failed and is disabled"):
            out, grads = run_step(model)
        assert "bad" in s.disabled
        calls = bad.calls
        run_step(model)
        assert bad.calls == calls, "a disabled plugin was called again"
    torch.testing.assert_close(out, expected_out)
    for name, g in expected_grads.items():
        torch.testing.assert_close(grads[name], g)


def test_good_returns_still_change_values():
    model = relu_model()
    _, plain = run_step(model)
    with hookplug.attach(model, "*:0", plugins=[Returns("output_grad", lambda g: g * 0, name="zero")]):
        _, grads = run_step(model)
    assert grads["0.weight"].abs().sum() == 0 and plain["0.weight"].abs().sum() > 0
    with hookplug.attach(model, "*:0", plugins=[Returns("forward_output", lambda o: o[:, :2] + 1, name="narrow")]):
        with pytest.raises(RuntimeError, match="shape"):  # a narrower output is allowed by hookplug,
            run_step(model)                                # the next layer refuses it


# -- items 10, 11: copies and pickles of an attached model carry no hooks ------------------------

class Counting(hookplug.Plugin):
    def __init__(self):
        self.name = "counting"
        self.forward = 0
        self.param = 0
        self.ended = 0

    @hookimpl
    def hookplug_forward_input(self, ctx):
        self.forward += 1

    @hookimpl
    def hookplug_forward_output(self, ctx):
        pass

    @hookimpl
    def hookplug_param_grad(self, grad):
        self.param += 1

    @hookimpl
    def hookplug_session_end(self):
        self.ended += 1


def attached_mlp():
    model = MLP()
    before = hook_dicts(model)
    plugin = Counting()
    session = hookplug.attach(model, "Linear", plugins=plugin)
    assert hook_dicts(model) != before
    return model, before, plugin, session


def check_copy(copied, before, plugin, session, model):
    assert hook_dicts(copied) == before
    assert not any("__getstate__" in vars(m) for m in copied.modules())
    plugin.forward = plugin.param = 0
    copied(torch.randn(2, 32)).sum().backward()
    assert plugin.forward == 0 and plugin.param == 0, "the copy calls the plugin"
    model(torch.randn(2, 32)).sum().backward()
    assert plugin.forward == 4 and plugin.param == 6, "the original lost its hooks"  # fc2 runs twice
    session.remove()
    assert plugin.ended == 1
    assert hook_dicts(model) == before
    assert not any("__getstate__" in vars(m) for m in model.modules())


def test_deepcopy_of_attached_model_has_no_hooks():
    model, before, plugin, session = attached_mlp()
    ema = copy.deepcopy(model)
    torch.testing.assert_close(ema.fc1.weight, model.fc1.weight)
    check_copy(ema, before, plugin, session, model)


def test_shallow_copy_of_attached_module_has_no_hooks():
    model = MLP()  # a shallow copy shares submodules and parameters; its own dicts are clean
    with hookplug.attach(model, "*:", plugins=Counting()):
        shallow = copy.copy(model)
        assert model._forward_hooks and model._forward_pre_hooks
        assert not shallow._forward_hooks and not shallow._forward_pre_hooks
        assert not shallow._forward_hooks_always_called and not shallow._forward_pre_hooks_with_kwargs


def test_pickle_of_attached_model():
    model, before, plugin, session = attached_mlp()
    copied = pickle.loads(pickle.dumps(model))
    check_copy(copied, before, plugin, session, model)


def test_torch_save_load_of_attached_model():
    model, before, plugin, session = attached_mlp()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "backward hook ... will not be serialized"
        torch.save(model, buf)
    buf.seek(0)
    copied = torch.load(buf, weights_only=False)
    torch.testing.assert_close(copied.fc2.bias, model.fc2.bias)
    check_copy(copied, before, plugin, session, model)


def _rebuild_locked(cls, sizes, state):
    layer = cls(*sizes)  # a fresh lock
    layer.load_state_dict(state)
    return layer


class ReducedLinear(nn.Linear):
    """A layer holding a lock (which no copy can take): its class's ``__reduce__`` builds it again."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.lock = threading.Lock()

    def __reduce__(self):
        return _rebuild_locked, (type(self), (self.in_features, self.out_features), self.state_dict())


class CopyregLinear(nn.Linear):
    """The same, its reducer registered with ``copyreg``."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.lock = threading.Lock()


copyreg.pickle(CopyregLinear, lambda m: (_rebuild_locked, (CopyregLinear, (m.in_features, m.out_features),
                                                            m.state_dict())))


@pytest.mark.parametrize("layer", [ReducedLinear, CopyregLinear])
def test_deepcopy_takes_the_classs_own_reduction(layer):
    """A class's ``__reduce__`` or ``copyreg`` reducer (and no ``__deepcopy__``): deepcopy
    takes it with a session attached, as without one. The copy guard took the default route,
    which copied the lock: "cannot pickle '_thread.lock' object"."""
    torch.manual_seed(0)
    model, x = nn.Sequential(layer(4, 3), nn.ReLU()), torch.randn(2, 4)
    with hookplug.attach(model, "Linear", plugins=["stats", Counting()]) as s:
        copied = copy.deepcopy(model)
        assert torch.equal(copied(x), model(x)) and copied[0].lock is not model[0].lock
        _no_hookplug_state(copied)
        assert not s.removed


def test_pickle_of_an_attached_quantized_conv():
    """``torch.ao.nn.quantized.Conv2d``'s ``__getstate__`` returns a tuple of fields: pickle
    and ``torch.save`` of a converted model with a session attached (they failed in the
    copy guard: "'tuple' object has no attribute 'pop'")."""
    qnn = torch.ao.nn.quantized
    torch.manual_seed(0)
    model = nn.Sequential(qnn.Quantize(0.1, 0, torch.quint8), qnn.Conv2d(3, 4, 3), qnn.DeQuantize())
    plain = pickle.loads(pickle.dumps(model))  # (torch's copy does not run: its __setstate__ keeps no hook dict)
    with hookplug.attach(model, "Conv2d", plugins=Counting()):
        copied = pickle.loads(pickle.dumps(model))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
    for c in (copied, saved):
        assert vars(c[1]).keys() == vars(plain[1]).keys()  # no guard, nothing of hookplug's
        assert torch.equal(c[1].weight().int_repr(), model[1].weight().int_repr())
        assert (c[1].scale, c[1].zero_point) == (model[1].scale, model[1].zero_point)


ALL_PLUGINS = ["stats", "capture", "flops", ("gradclamp", {"max": 1e30, "params": "*"}), "params"]


def _no_hookplug_state(copied):
    """``copied`` holds no hook, guard or session of hookplug's (on no module)."""
    from hookplug._binding import _ModuleBinding, _ParamBinding, _Rehook
    from hookplug._session import Session, _HookFreeState

    ours = (_ModuleBinding, _ParamBinding, _Rehook, _HookFreeState, Session)
    for n, m in copied.named_modules():
        assert not any(k in vars(m) for k in ("__getstate__", "__deepcopy__", "__reduce_ex__")), n
        for attr, value in vars(m).items():
            if isinstance(value, dict) and "hook" in attr:
                for hook in value.values():
                    assert not isinstance(getattr(hook, "__self__", hook), ours), (n, attr, hook)


def test_ema_copy_of_an_attached_model_with_a_parametrized_layer():
    """``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``,
    ``orthogonal``) gives the module's class a ``__deepcopy__`` that deep-copies its
    ``__dict__`` whole, without ``__getstate__``: an EMA copy (``AveragedModel``, timm's
    ``ModelEmaV3``, ``copy.deepcopy``) of an attached model failed ("cannot pickle
    '_thread.RLock'", the session reached through a parameter hook's load_state_dict
    post-hook), or with stats alone carried copies of the hooks and a guard pointing at the
    original module."""
    from torch.nn.utils import parametrizations
    from torch.optim import swa_utils

    torch.manual_seed(0)
    model = MLP()
    parametrizations.weight_norm(model.fc1)
    before = hook_dicts(model)
    ids = {k: list(v) for k, v in before.items()}  # (weight_norm's own hooks are copied)
    session = hookplug.attach(model, "Linear", plugins=ALL_PLUGINS)
    ema = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    copied = copy.deepcopy(model)
    for c in (ema.module, copied):
        assert {k: list(v) for k, v in hook_dicts(c).items()} == ids
        _no_hookplug_state(c)
    x = torch.randn(4, 32)
    want = model(x)
    want.sum().backward()
    ema.update_parameters(model)
    for c in (ema.module, copied):
        c(x).sum().backward()  # records nothing
    assert session["stats"].results()["fc1"]["output"].calls == 1
    torch.testing.assert_close(copied(x), want)
    session.step()
    session.remove()
    assert hook_dicts(model) == before
    assert not any(k in vars(m) for m in model.modules() for k in ("__getstate__", "__deepcopy__"))
    assert {k: list(v) for k, v in hook_dicts(copy.deepcopy(model)).items()} == ids


def test_ema_copy_when_the_layer_is_parametrized_after_attach():
    """A parametrization registered after attach swaps the module's class for one with a
    ``__deepcopy__`` of its own: the copy failed ("cannot pickle '_thread.RLock'") or kept
    hookplug's hooks and a guard pointing at the original (saving it went through the
    original). The guards are on every hooked module, whatever its class at attach."""
    from torch.nn.utils import parametrizations
    from torch.optim import swa_utils

    torch.manual_seed(0)
    model = MLP()
    session = hookplug.attach(model, "Linear", plugins=ALL_PLUGINS)
    parametrizations.weight_norm(model.fc1)
    ema = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    copied = copy.deepcopy(model)
    for c in (ema.module, copied):
        _no_hookplug_state(c)
    x = torch.randn(4, 32)
    torch.testing.assert_close(copied(x), model(x))
    session.remove()
    del model, session
    gc.collect()
    again = copy.deepcopy(ema)  # its own state (a guard copied along read the original's)
    _no_hookplug_state(again.module)
    torch.testing.assert_close(again.module(x), copied(x))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_an_attached_fx_graph_module(how):
    """``torch.fx.GraphModule`` has a ``__reduce__`` (and a ``__deepcopy__``) of its own that
    copies its ``__dict__``: a pickle or ``torch.save`` of an attached one (selected itself,
    ``*:``) failed on hookplug's guard (a weak reference)."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(MLP())
    before = hook_dicts(gm)
    x = torch.randn(4, 32)
    with hookplug.attach(gm, "Linear, *:", plugins=ALL_PLUGINS) as s:
        if how == "deepcopy":
            copied = copy.deepcopy(gm)
        elif how == "pickle":
            copied = pickle.loads(pickle.dumps(gm))
        else:
            buf = io.BytesIO()
            torch.save(gm, buf)
            buf.seek(0)
            copied = torch.load(buf, weights_only=False)
        assert hook_dicts(copied) == before
        _no_hookplug_state(copied)
        torch.testing.assert_close(copied(x), gm(x))
        assert s["stats"].results()[""]["output"].calls == 1
    assert hook_dicts(gm) == before
    assert not any(k in vars(m) for m in gm.modules() for k in ("__getstate__", "__deepcopy__", "__reduce_ex__"))


class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(x.mean((2, 3))))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("how", ["fuse_modules", "prepare_convert", "prepare_qat", "quantize_dynamic"])
def test_hooks_torch_copies_onto_swapped_modules_do_nothing_and_come_off(how):
    """torch.ao.quantization's in-place module swaps (fuse_modules, prepare/convert,
    prepare_qat, quantize_dynamic with inplace=True) register the forward hooks of a module
    on the one they swap in, without with_kwargs: the copies of hookplug's hooks raised
    TypeError at the next forward, and remove() left them there, keeping the session alive
    (and a copy or pickle of the model failed on it). Now they do nothing (one warning:
    attach after the swap) and remove() takes them off."""
    import gc
    import weakref

    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model, x = QNet().eval(), torch.randn(2, 3, 8, 8)
    s = hookplug.attach(model, "*", plugins=[("stats", {"sites": ("input", "output")}), "capture", "flops"])
    if how == "fuse_modules":
        tq.fuse_modules(model, [["conv", "bn", "relu"]], inplace=True)
    elif how == "prepare_convert":
        model.qconfig = tq.get_default_qconfig("fbgemm")
        tq.prepare(model, inplace=True)
        model(x)
        tq.convert(model, inplace=True)
    elif how == "prepare_qat":
        model.train().qconfig = tq.get_default_qat_qconfig("fbgemm")
        tq.prepare_qat(model, inplace=True)
    else:
        tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    with pytest.warns(RuntimeWarning, match=r"hookplug: the hooks of module '\w+' were copied by torch onto "
                                            r"another module, \w+ .*attach after"):
        y = model(x)
    model(x)
    assert torch.equal(copy.deepcopy(model)(x), y)  # copies of those copies hold no session
    if how in ("fuse_modules", "quantize_dynamic"):  # torch pickles the others' modules badly
        assert torch.equal(pickle.loads(pickle.dumps(model))(x), y)
    s.remove()
    ours = [(k, fn) for k, d in hook_dicts(model).items() for fn in d.values()
            if type(getattr(fn, "__self__", None)).__module__.startswith("hookplug")]
    assert not ours  # torch's observer hooks stay (prepare_qat)
    assert not any("__getstate__" in vars(m) for m in model.modules())
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None
    assert torch.equal(model(x), y)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_fused_module_half_left_hooked_keeps_no_pending_calls():
    """fuse_modules keeps the selected ReLU inside the fused module, with its pre hook, but
    moves its post hook onto the fused module: each forward left a context in the ReLU's
    pending list (growing without bound where no step() clears it)."""
    import torch.ao.quantization as tq

    model, x = QNet().eval(), torch.randn(2, 3, 8, 8)
    s = hookplug.attach(model, "*", plugins=[("stats", {"sites": ("input", "output")})])
    tq.fuse_modules(model, [["conv", "bn", "relu"]], inplace=True)
    for _ in range(5):
        model(x)
    assert [n for n, b in s._bindings.items() if b._pending] == []
    s.remove()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_copies_remove_cannot_reach_do_not_keep_the_session():
    """The attached module itself swapped by its parent's in-place quantization: remove()
    cannot reach the copy on the module swapped in (it is not inside the attached one); the
    copy stays (torch's), but it no longer keeps the session alive."""
    import gc
    import weakref

    import torch.ao.quantization as tq

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    s = hookplug.attach(model[0], "*:", plugins=[("stats", {"sites": ("output",)})])
    tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    model(torch.randn(2, 4))
    s.remove()
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None
    model(torch.randn(2, 4))  # the copy left behind does nothing


def test_a_hook_call_torch_makes_after_remove_does_nothing():
    """A request thread's forward may run a hook from the list torch took before another
    thread's ``remove()``: the retired binding does nothing there (no plugin, no error)."""
    class AddOne(hookplug.Plugin):
        name = "add"

        @hookimpl
        def hookplug_forward_output(self, output):
            log.append("add")
            return output + 1

    model, log = MLP(), []
    s = hookplug.attach(model, "Linear", plugins=[("stats", {"sites": ("input", "output", "grad")}), AddOne()])
    late = [(m, list(m._forward_pre_hooks.values()), list(m._forward_hooks.values()))
            for m in model.modules() if isinstance(m, nn.Linear)]
    s.remove()
    for m, pres, posts in late:
        args = (torch.randn(2, m.in_features, requires_grad=True),)
        out = m(*args)
        assert all(pre(m, args, {}) is None for pre in pres)
        assert all(post(m, args, {}, out) is None for post in posts)
    assert not log and s["stats"].results() == {}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hooks_copied_onto_swapped_modules_compile_with_fullgraph():
    """The copies torch.ao.quantization's fuse_modules leaves do nothing in compiled code
    too: their once-a-session warning (a builtin dynamo cannot trace) broke the graph there,
    so torch.compile(fullgraph=True) of the fused model failed."""
    torch.manual_seed(0)
    model, x = QNet().eval(), torch.randn(2, 3, 8, 8)
    with hookplug.attach(model, "*", plugins=[("stats", {"sites": ("input", "output")})]) as s:
        expected = model(x)
        torch.ao.quantization.fuse_modules(model, [["conv", "bn", "relu"]], inplace=True)
        torch._dynamo.reset()
        try:
            got = torch.compile(model, fullgraph=True, backend="eager")(x)
        finally:
            torch._dynamo.reset()
        torch.testing.assert_close(got, expected)
        assert "fc" in s["stats"].results()


def test_copy_keeps_hooks_of_others_and_two_sessions_share_one_guard():
    model = MLP()
    seen = []
    own = model.fc1.register_forward_hook(lambda m, i, o: seen.append("user"))
    s1 = hookplug.attach(model, "Linear", plugins=Counting())
    s2 = hookplug.attach(model, "Linear", plugins=Returns("forward_output", lambda o: None, name="other"))
    copied = copy.deepcopy(model)
    assert list(copied.fc1._forward_hooks) == [own.id]
    copied(torch.randn(2, 32))
    assert seen == ["user"]
    s1.remove()
    assert "__getstate__" in vars(model.fc1), "s2's hooks are still on fc1"
    assert list(copy.deepcopy(model).fc1._forward_hooks) == [own.id]
    s2.remove()
    assert "__getstate__" not in vars(model.fc1)
    own.remove()


def test_a_removed_sessions_hook_ids_go_to_the_next_session_never_to_two_live_ones():
    """Sessions alive together have ids of their own; a removed session's ids go to the
    next session attached (so a compiled model's graphs, which guard on the ids, serve it),
    never to a user's handle."""
    model = MLP()

    def ids(module):
        return list(module._forward_pre_hooks), list(module._forward_hooks)

    a = hookplug.attach(model, "Linear", plugins=Counting())
    b = hookplug.attach(model, "Linear", plugins=Counting())
    (pre_a, pre_b), (post_a, post_b) = ids(model.fc1)
    assert len({pre_a, pre_b, post_a, post_b}) == 4
    a.remove()
    user = model.fc2.register_forward_hook(lambda m, i, o: None)
    assert user.id not in (pre_a, post_a)
    c = hookplug.attach(model, "Linear", plugins=Counting())
    assert ids(model.fc1) == ([pre_b, pre_a], [post_b, post_a])  # c took a's ids
    model(torch.randn(2, 32))  # fc2 runs twice
    assert [p.forward for p in (b.plugins["counting"], c.plugins["counting"])] == [4, 4]
    b.remove()
    c.remove()
    assert ids(model.fc1) == ([], [])
    user.remove()


def test_sessions_attached_again_get_their_model_ids_back_whatever_the_order_or_failures():
    """Two sessions alive together, removed in either order: attached again in the same
    order they get the same ids (the graphs compiled for them guard on them); a failed
    attach takes none away; another model's session does not take this model's ids."""
    model, other = MLP(), MLP()

    def ids(module):
        return list(module._forward_pre_hooks), list(module._forward_hooks)

    seen = []
    for first_out in (0, 1, 0):
        pair = [hookplug.attach(model, "Linear", plugins=Counting()) for _ in range(2)]
        seen.append(ids(model.fc1))
        with pytest.raises(PluginError):
            hookplug.attach(model, "Linear", plugins="no-such-plugin")
        pair[first_out].remove()
        pair[1 - first_out].remove()
        with hookplug.attach(other, "Linear", plugins=Counting()):
            assert not set(ids(other.fc1)[0]) & set(seen[0][0])  # fresh ids: none of model's
    assert seen[1] == seen[0] and seen[2] == seen[0]


def test_a_session_gives_its_hooks_one_id_for_every_module_and_no_other_handle_gets_it():
    """Every module's forward hook of a session has the same id (likewise its pre hooks: a
    traced call guards on the ids, see regional compilation), an id no other handle gets;
    hooks registered before and after keep their order and their removal leaves ours."""
    model = MLP()
    first = model.fc1.register_forward_hook(lambda m, i, o: None)
    with hookplug.attach(model, "Linear", plugins=Counting()):
        posts = [list(m._forward_hooks)[-1] for m in (model.fc1, model.fc2, model.fc3)]
        pres = [next(iter(m._forward_pre_hooks)) for m in (model.fc1, model.fc2, model.fc3)]
        assert len(set(posts)) == len(set(pres)) == 1 and posts[0] != pres[0]
        later = model.fc1.register_forward_hook(lambda m, i, o: None)
        assert later.id not in (posts[0], pres[0], first.id)
        assert list(model.fc1._forward_hooks) == [first.id, posts[0], later.id]
        assert list(model.fc1._forward_hooks_always_called) == [posts[0]]
        assert list(model.fc1._forward_pre_hooks_with_kwargs) == [pres[0]]
        first.remove()
        later.remove()
        assert list(model.fc1._forward_hooks) == [posts[0]]
    assert not model.fc1._forward_hooks and not model.fc2._forward_pre_hooks
    assert not model.fc1._forward_hooks_always_called and not model.fc1._forward_hooks_with_kwargs


# -- a forked child, interpreter exit ------------------------------------------------------------

class EndLog(hookplug.Plugin):
    name = "endlog"

    def __init__(self):
        self.ended = False

    @hookimpl
    def hookplug_session_end(self):
        self.ended = True


def test_a_forked_child_leaving_the_session_emits_nothing(tmp_path):
    """A child forked while a session is attached (an async checkpoint writer leaving the
    with block, a DataLoader worker) takes the hooks off its copy and ends its plugins, with
    one warning, but collects nothing and leaves the sinks alone: the steps and the file are
    the parent's, which emits each step once."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    from conftest import run_forked

    m, path = MLP(), tmp_path / "run"
    with hookplug.attach(m, "Linear", plugins=[("stats", {"bins": 0}), EndLog()],
                         sink=("jsonl", {"path": str(path)}), flush_every=2) as s:
        for _ in range(3):  # steps 0 and 1 flushed, step 2 pending
            m(torch.randn(2, 32))
            s.step()
        m(torch.randn(2, 32))  # step 3 running

        def child():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                emitted = s.flush()
                s.remove()  # as leaving the with block does
                hookplug._session._remove_at_exit()  # as sys.exit() would: not the child's session
            return {"emitted": emitted, "hooks": sum(map(len, hook_dicts(m).values())),
                    "ended": s["endlog"].ended, "sink_open": s["jsonl"]._fd is not None,
                    "warnings": [str(w.message) for w in caught]}

        got = run_forked(child)["result"]
        assert got["emitted"] == [] and got["hooks"] == 0 and got["ended"] and got["sink_open"]
        assert len(got["warnings"]) == 1 and "belongs to process" in got["warnings"][0]
        assert "attach a session in the child" in got["warnings"][0].lower()
        assert len(read_jsonl(path)) == 6  # the child wrote nothing
    count = collections.Counter((r["step"], r["module"]) for r in read_jsonl(path))
    assert count == {(step, mod): 1 for step in range(4) for mod in ("fc1", "fc2", "fc3")}


def test_a_child_forked_while_another_thread_ends_a_step_can_remove_its_copy():
    """A server's timer thread inside ``step()`` when a worker is forked: the child's copy of
    the session's step lock stays held by a thread the child does not have, so the child's
    ``remove()`` (leaving a with block) hung; the child takes a lock of its own."""
    import threading

    from conftest import fork_child, join_child

    m = MLP()
    s = hookplug.attach(m, "Linear", plugins="stats")
    held, release = threading.Event(), threading.Event()

    def timer():
        with s._boundary:  # held where step() is while it ends a step
            held.set()
            release.wait(10)

    t = threading.Thread(target=timer)
    t.start()
    assert held.wait(10)
    try:
        def child():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                s.remove()
            return s.removed

        pid, fd = fork_child(child)
    finally:
        release.set()
        t.join()
    assert join_child(pid, fd) == {"result": True}
    s.remove()


def test_a_session_never_removed_is_flushed_at_exit(tmp_path):
    """At interpreter exit a session with a sink that was never removed is removed (its own
    rows, no collective), with one warning naming it, so its last steps are not lost; a
    session without a sink is left alone."""
    import subprocess
    import sys

    from hookplug_plugins.sinks.jsonl import read_jsonl

    script = f"""
import torch, hookplug
from hookplug.models import MLP
m = MLP()
s = hookplug.attach(m, "Linear", plugins=("stats", {{"bins": 0}}),
                    sink=("jsonl", {{"path": {str(tmp_path)!r}}}))
quiet = hookplug.attach(MLP(), "Linear", plugins="stats")
for _ in range(3):
    m(torch.randn(2, 32))
    s.step()
print(s.run_id)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = out.stdout.split()[-1]
    said = [line for line in out.stderr.splitlines() if "RuntimeWarning: hookplug:" in line]
    assert len(said) == 1 and said[0].endswith(
        f"RuntimeWarning: hookplug: session {run_id} was never removed; flushing its "
        "telemetry at exit")
    count = collections.Counter((r["step"], r["module"]) for r in read_jsonl(tmp_path))
    assert count == {(step, mod): 1 for step in range(3) for mod in ("fc1", "fc2", "fc3")}


def test_calls_a_keyboard_interrupt_left_are_forgotten_at_the_next_step():
    """torch runs no post hook when a forward is left by a BaseException (Ctrl-C): the
    context its pre hook kept waited for good, one per interrupted call."""
    import torch.nn as nn

    class Interrupted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.armed = nn.Linear(4, 4), False

        def forward(self, x):
            if self.armed:
                raise KeyboardInterrupt
            return self.lin(x)

    inner = Interrupted()
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 2))
    with hookplug.attach(model, "*", plugins=("stats", {"sites": ("input", "output")})) as s:
        for _ in range(5):
            inner.armed = True
            with pytest.raises(KeyboardInterrupt):
                model(torch.randn(3, 4))
            inner.armed = False
            s.step()
            assert all(not b._pending for b in s._bindings.values())
        model(torch.randn(3, 4))
        res = s["stats"].results()
        assert int(res["1"]["output"].calls) == 1 and int(res["1"]["input[0]"].calls) == 6


def test_calls_a_keyboard_interrupt_left_are_forgotten_at_the_next_call_without_steps():
    """A session that never steps (serving, forward-only): each call Ctrl-C stopped kept its
    context until a step() that never came. The module's next call drops them; a call of a
    module nested in itself keeps its outer calls'."""
    import torch.nn as nn
    from conftest import Interruptible

    inner = Interruptible()
    model = nn.Sequential(nn.Linear(4, 4), inner)
    with hookplug.attach(model, "*", plugins=("stats", {"sites": ("input", "output")})) as s:
        binding = s._bindings["1"]
        for _ in range(50):
            inner.interrupted_call(model, torch.randn(3, 4))
            assert len(binding._pending) <= 1
            inner(torch.randn(3, 4), depth=3)  # nested in itself: each level's call ends whole
            assert not binding._pending
        res = s["stats"].results()
        assert int(res["1"]["output"].calls) == 50 * 4 and int(res["1"]["input[0]"].calls) == 50 * 5


def test_copies_on_several_threads_and_remove_meanwhile_leave_no_guard_behind():
    """Copying a hooked module changed its __dict__ for the call (the guard taken off and
    put back): copies on other threads raised KeyError('__deepcopy__'), and a remove()
    meanwhile left a guard behind. The copy now reads the module without changing it."""
    import threading

    model = MLP()
    session = hookplug.attach(model, "Linear", plugins="stats")
    errors = []

    def copies():
        try:
            for _ in range(200):
                _no_hookplug_state(copy.deepcopy(model))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=copies) for _ in range(3)]
    for t in threads:
        t.start()
    session.remove()
    for t in threads:
        t.join()
    assert errors == []
    assert not any(k in vars(m) for m in model.modules() for k in ("__getstate__", "__deepcopy__", "__reduce_ex__"))


def _lazy_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))


def _torch_save_load(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", [copy.deepcopy, _torch_save_load], ids=["deepcopy", "torch.save"])
@pytest.mark.parametrize("plugins", [[("capture", {"inputs": True})], ["params"],
                                     [("gradclamp", {"min": 0, "params": "*"})]],
                         ids=["capture", "params", "gradclamp"])
def test_copies_of_a_lazy_model_attached_before_its_first_forward(how, plugins):
    """A lazy module keeps handles to its own hook dicts (``_initialize_hook``); their copied
    state was the module's dict with the session's pre-hooks in it (the copy's second forward
    raised, or the copy failed on a lock or a weak reference)."""
    model = _lazy_mlp()
    x = torch.randn(3, 5)
    with hookplug.attach(model, "Linear", plugins=plugins):
        copied = how(model)
        for mod in copied.modules():
            assert not [h for h in mod._forward_pre_hooks.values()
                        if type(h).__module__.startswith(("hookplug", "hookplug_plugins"))], mod
        torch.manual_seed(1)  # (the copy's initialization)
        out = copied(x)
        torch.testing.assert_close(copied(x), out, rtol=0, atol=0)
        assert not copied[0]._forward_pre_hooks, "the lazy init hook took itself off the copy"
    plain = _lazy_mlp()
    torch.manual_seed(1)
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)


class _HandleKeeper(nn.Module):
    """Keeps the handle of a hook on another module's dict, as user code often does."""

    def __init__(self, target):
        super().__init__()
        self.seen = []
        self.h = target.register_forward_hook(lambda m, i, o: self.seen.append(1))

    def forward(self, x):
        return x


@pytest.mark.parametrize("keeper_first", [True, False])
def test_a_copied_handle_on_another_modules_hooks_removes_the_copys_hook(keeper_first):
    """A handle kept on one module for a hook on another's dict, copied before or after that
    module: in the copy it is on the copy's dict, as without a session."""
    fc = nn.Linear(4, 4)
    keeper = _HandleKeeper(fc)
    model = nn.Sequential(keeper, fc) if keeper_first else nn.Sequential(fc, keeper)
    with hookplug.attach(model, "Linear", plugins="stats"):
        copied = copy.deepcopy(model)
    cfc, ckeeper = (copied[1], copied[0]) if keeper_first else (copied[0], copied[1])
    assert ckeeper.h.hooks_dict_ref() is cfc._forward_hooks
    assert list(cfc._forward_hooks) == [keeper.h.id]
    ckeeper.h.remove()
    assert not cfc._forward_hooks
    assert list(fc._forward_hooks) == [keeper.h.id], "the original keeps its hook"


def test_plugin_instances_attached_again_start_afresh():
    """A trainer's callback given plugin instances attaches them again at every ``fit()``:
    each session's results are its own, as with new instances (capture's kept calls of the
    last session mixed with the new ones by call index; stats, params and gradclamp summed
    both sessions)."""
    from hookplug_plugins.capture import CapturePlugin
    from hookplug_plugins.gradclamp import GradClampPlugin
    from hookplug_plugins.params import ParamsPlugin
    from hookplug_plugins.stats import StatsPlugin

    def make():
        return [StatsPlugin(), CapturePlugin(inputs=True, keep="all"), ParamsPlugin(),
                GradClampPlugin(max=0.01, params="*")]

    def run(model, plugins, steps):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hookplug.attach(model, "Linear", plugins=plugins) as s:
            for i in range(steps):
                model(torch.full((2, 4), i + 100.0 * steps)).sum().backward()
                opt.step()
                opt.zero_grad()
                s.step()
            r = s.results()
            return ({m: {k: int(v[k].calls) for k in v} for m, v in r["stats"].items()},
                    {m: {k: float(v[k].l2) for k in v} for m, v in r["params"].items()},
                    {m: int(v["changed"]) for m, v in r["gradclamp"].items()},
                    {m: [float(c[0][0, 0]) for c in v] for m, v in s["capture"].inputs.items()})

    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    second = nn.Sequential(collections.OrderedDict(x=nn.Linear(4, 3), y=nn.Linear(3, 2)))
    twin = copy.deepcopy(second)
    plugins = make()
    run(first, plugins, 3)
    again, fresh = run(second, plugins, 1), run(twin, make(), 1)
    assert again == fresh
    assert fresh[3]["x"] == [100.0] and len(fresh[3]["y"]) == 1 and set(fresh[0]) == {"x", "y"}


def test_a_plugin_instance_serves_one_session_at_a_time():
    """Attached to a second model while its first session is not removed, an instance
    refuses (the second attach emptied the first session's results); once removed, it may
    be attached again; a sink instance may serve two sessions."""
    from hookplug_plugins.stats import StatsPlugin

    class Keep(hookplug.Sink):
        def __init__(self):
            self.records = []

        @hookimpl
        def hookplug_flush(self, session, records):
            self.records.extend(records)

    plugin, sink = StatsPlugin(), Keep()
    a, b = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    first = hookplug.attach(a, "Linear", [plugin], sink=sink)
    a(torch.randn(3, 2))
    with pytest.raises(PluginError, match="'stats' .*another session that is not removed"):
        hookplug.attach(b, "Linear", [plugin])
    assert int(first["stats"].results()["0"]["output"].calls) == 1
    assert not b[0]._forward_hooks, "the refused attach left no hook"
    with hookplug.attach(b, "Linear", [StatsPlugin()], sink=sink) as second:  # a sink: shared
        b(torch.randn(3, 2))
        second.step()
    first.step()
    first.remove()
    with hookplug.attach(b, "Linear", [plugin]) as again:  # removed: free again
        b(torch.randn(3, 2))
        assert int(again["stats"].results()["0"]["output"].calls) == 1
    assert len(sink.records) == 2
    # a sink given among the plugins serves two sessions too; (instance, {name: options}) is
    # two specs, as in a list
    other = nn.Sequential(nn.Linear(2, 2))
    with hookplug.attach(a, "Linear", [StatsPlugin(), sink]), hookplug.attach(other, "Linear", [StatsPlugin(), sink]):
        pass
    with hookplug.attach(a, "Linear", (StatsPlugin(), {"capture": None})) as s:
        assert sorted(s.plugins) == ["capture", "stats"]
    # an attach that fails while adding its plugins leaves none of them claimed
    from hookplug_plugins.capture import CapturePlugin

    held = CapturePlugin()
    blocker = hookplug.attach(other, "Linear", [plugin])
    with pytest.raises(PluginError, match="another session"):
        hookplug.attach(a, "Linear", [held, plugin])
    with hookplug.attach(a, "Linear", [held]):
        pass
    blocker.remove()
    # a session dropped without remove() leaves no claim behind (the registry grew by one
    # entry per plugin of each such session)
    from hookplug._session import _IN_USE

    before = len(_IN_USE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            dropped = hookplug.attach(nn.Sequential(nn.Linear(2, 2)), "Linear", ["stats", "capture"])
            del dropped
        gc.collect()
    assert len(_IN_USE) == before


_Hooks = collections.namedtuple("_Hooks", "fwd pre")


def _no_op(*args):
    return None


class _HandlesInATuple(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.hooks = _Hooks(self.register_forward_hook(_no_op), self.register_forward_pre_hook(_no_op))


def test_copies_of_a_module_keeping_its_handles_in_a_namedtuple():
    """A namedtuple (or a list subclass) of handles is left as it is (rebuilding it as
    ``type(value)(items)`` raised in ``deepcopy`` and ``torch.save``)."""
    model = nn.Sequential(_HandlesInATuple())
    with hookplug.attach(model, "Linear", "stats"):
        copied = copy.deepcopy(model)
        torch.save(model, io.BytesIO())
    assert isinstance(copied[0].hooks, _Hooks)
    assert copied[0].hooks.fwd.hooks_dict_ref() is copied[0]._forward_hooks


def test_attaching_again_from_the_same_line_while_its_session_is_live_warns():
    """A re-run notebook cell or a loop reassigning ``s = attach(...)``: the old session,
    unreachable, stayed attached for good (its hooks still steering and costing time),
    silently. Sessions attached elsewhere, or removed, are no reason to warn."""
    from hookplug_plugins.stats import StatsPlugin

    model = MLP()

    def attach_here():
        return hookplug.attach(model, "Linear", plugins="stats")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = hookplug.attach(model, "Linear", plugins="stats")
        second = hookplug.attach(model, "Linear", plugins="stats")  # another line: on purpose
        for _ in range(2):
            with hookplug.attach(model, "Linear", plugins="stats"):
                pass
        first.remove(), second.remove()
    sessions = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            sessions.append(hookplug.attach(model, "Linear", plugins="stats"))
    said = [str(w.message) for w in seen if "attach() again" in str(w.message)]
    assert len(said) == 2 and "whose session attached there with the same selector and plugins is not removed" in said[0]
    assert all(w.filename == __file__ for w in seen)
    for s in sessions:
        s.remove()
    with warnings.catch_warnings():  # one place, other selectors or plugins: meant to run together
        warnings.simplefilter("error")
        kept = [hookplug.attach(model, sel, plugins=p) for sel, p in
                (("Linear", "stats"), ("*:fc1", "stats"), ("Linear", "flops"), ("Linear", ("stats", {"bins": 0})),
                 ("Linear", StatsPlugin(hist="linear", bins=4, range=(-1.0, 1.0))),
                 ("Linear", StatsPlugin(hist="linear", bins=4, range=(-2.0, 2.0))))]
        for s in kept:
            s.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach_here().remove()
        attach_here().remove()
