"""The ``gradclamp`` plugin against hand-written ``register_hook`` versions."""

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn

import hookplug
from conftest import DEVICES
from hookplug import PluginError
from hookplug.models import MLP, tiny_cnn


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(model, x, loss=lambda out: out.square().mean()):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss(out).backward()
    return grads_of(model)


def assert_grads_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@contextlib.contextmanager
def hand_output_hooks(model, names, fn):
    """Apply ``fn`` to the gradient of each named module's output with plain torch hooks."""
    mods = dict(model.named_modules())

    def fwd(m, i, o):
        o.register_hook(fn)

    handles = [mods[n].register_forward_hook(fwd) for n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def test_clamp_min_on_every_conv_output_matches_register_hook():
    model = tiny_cnn(width=8)
    x = torch.randn(2, 3, 32, 32)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    plain = run(model, x)
    with hand_output_hooks(model, convs, lambda g: torch.clamp(g, min=0)):
        want = run(model, x)
    with hookplug.attach(model, "Conv2d", plugins=("gradclamp", {"min": 0})):
        got = run(model, x)
    assert_grads_equal(got, want)
    assert any(not torch.equal(plain[k], want[k]) for k in plain)  # the clamp does something
    assert run(model, x).keys() == plain.keys()
    assert_grads_equal(run(model, x), plain)  # removed: back to plain


def test_changed_counter_equals_hand_count():
    model = MLP()
    x = torch.randn(7, 32)
    seen = {}

    def count(name):
        def hook(m, i, o):
            o.register_hook(lambda g: seen.setdefault(name, []).append(int((g > 0.002).sum())))

        return hook

    handles = [
        m.register_forward_hook(count(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"max": 0.002})) as s:
        run(model, x, lambda out: (out * torch.linspace(-3, 3, 10)).sum())
        counters = dict(s["gradclamp"]._changed)
        res = s["gradclamp"].results()
    for h in handles:
        h.remove()
    assert all(isinstance(c, torch.Tensor) and c.dtype == torch.int64 for c in counters.values())
    # the hand hooks run first on the same output tensors, so they see what hookplug clamps
    assert set(res) == {"fc1", "fc2", "fc3"} and len(seen["fc2"]) == 2
    assert {n: v["changed"] for n, v in res.items()} == {n: sum(c) for n, c in seen.items()}
    assert all(v["changed"] > 0 for v in res.values())


def test_changed_counter_is_exact_and_sync_free(monkeypatch):
    lin = nn.Linear(5, 5)
    x = torch.randn(4, 5)
    g_out = torch.randn(4, 5)
    with hookplug.attach(lin, "*:", plugins=("gradclamp", {"max": 0.25})) as s:
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__"):
                mp.setattr(
                    torch.Tensor,
                    name,
                    lambda *a, **k: (_ for _ in ()).throw(AssertionError("sync")),
                )
            for _ in range(2):
                lin(x).backward(g_out)
        assert s["gradclamp"].results() == {"": {"changed": 2 * int((g_out > 0.25).sum())}}
        s["gradclamp"].reset()
        assert s["gradclamp"].results() == {}


def test_max_norm_per_tensor():
    model = MLP()
    x = torch.randn(6, 32)

    def clip(g, max_norm=0.05):
        norm = torch.linalg.vector_norm(g)
        return g * (max_norm / (norm + 1e-6)) if norm > max_norm else g

    names = ["fc1", "fc2", "fc3"]
    with hand_output_hooks(model, names, clip):
        want = run(model, x, lambda out: out.sum() * 10)
    norms = []
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"max_norm": 0.05})):
        with hand_output_hooks(
            model, ["fc3"], lambda g: norms.append(float(torch.linalg.vector_norm(g)))
        ):
            got = run(model, x, lambda out: out.sum() * 10)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)
    assert norms and norms[0] > 0.05  # it did clip


class PoisonGrad(torch.autograd.Function):
    """Identity forward; backward puts NaN where ``mask`` is set."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g.masked_fill(mask, float("nan")), None


class NanNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.head = nn.Linear(6, 1)
        self.mask = torch.zeros(3, 6, dtype=torch.bool)
        self.mask[0, 1] = self.mask[2, 4] = True

    def forward(self, x):
        return self.head(PoisonGrad.apply(self.lin(x), self.mask))


def test_nan_zero_matches_hand_hook_and_counts():
    net = NanNet()
    x = torch.randn(3, 4)
    with hand_output_hooks(net, ["lin"], lambda g: torch.nan_to_num(g, nan=0.0).clamp(min=-0.5)):
        want = run(net, x, lambda out: out.sum())
    with hookplug.attach(net, "*:lin", plugins=("gradclamp", {"nan": "zero", "min": -0.5})) as s:
        got = run(net, x, lambda out: out.sum())
    assert_grads_equal(got, want)
    assert all(torch.isfinite(g).all() for g in got.values())
    with hand_output_hooks(net, ["lin"], lambda g: g.clamp(min=-0.5)):
        raw = []
        with hand_output_hooks(net, ["lin"], lambda g: raw.append(g.clone())):
            run(net, x, lambda out: out.sum())
    expected = int(torch.isnan(raw[0]).sum()) + int((raw[0] < -0.5).sum())
    assert s["gradclamp"].results()["lin"]["changed"] == expected >= 2


def test_nan_keep_does_not_count_nans():
    net = NanNet()
    x = torch.randn(3, 4)
    with hookplug.attach(net, "*:lin", plugins=("gradclamp", {"max": 1e9})) as s:
        got = run(net, x, lambda out: out.sum())
    assert torch.isnan(got["lin.weight"]).any()
    assert s["gradclamp"].results()["lin"]["changed"] == 0


def test_nan_raise_names_the_module():
    net = NanNet()
    with hookplug.attach(net, "*:lin", plugins=("gradclamp", {"nan": "raise"})):
        with pytest.raises(FloatingPointError, match="'lin'"):
            run(net, torch.randn(3, 4), lambda out: out.sum())


def test_params_glob_zero_fc_bias_like_the_seeds():
    model = MLP()
    x = torch.randn(4, 32)
    handles = [
        p.register_hook(lambda g: torch.zeros_like(g))
        for n, p in model.named_parameters()
        if "fc" in n and "bias" in n
    ]
    want = run(model, x)
    for h in handles:
        h.remove()
    plain = run(model, x)
    with hookplug.attach(
        model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "fc*.bias"})
    ) as s:
        got = run(model, x)
    assert_grads_equal(got, want)
    for n in got:  # only the biases changed; weights as without hooks
        assert torch.equal(got[n], want[n])
        if n.endswith("weight"):
            assert torch.equal(got[n], plain[n])
        else:
            assert not got[n].any()
    res = s["gradclamp"].results()
    assert set(res) == {"fc1.bias", "fc2.bias", "fc3.bias"}
    assert res["fc1.bias"]["changed"] == int((plain["fc1.bias"] != 0).sum())


def test_params_and_outputs_together():
    model = MLP()
    x = torch.randn(4, 32)
    with hand_output_hooks(model, ["fc3"], lambda g: g.clamp(max=0.0)):
        hs = [model.fc3.weight.register_hook(lambda g: g.clamp(max=0.0))]
        want = run(model, x)
        for h in hs:
            h.remove()
    with hookplug.attach(
        model,
        "Linear:fc3",
        plugins=("gradclamp", {"max": 0.0, "params": "*.weight", "outputs": True}),
    ):
        got = run(model, x)
    assert_grads_equal(got, want)


def test_params_steer_each_micro_batch_gradient_before_it_is_accumulated():
    """Gradient accumulation: a parameter's hook steers each backward's gradient before it
    is added into ``.grad`` (README), not the accumulated one the optimizer gets."""
    model = MLP()
    xs = torch.randn(4, 4, 32).unbind(0)
    parts, nonzero = [], 0
    for x in xs:  # each micro-batch's gradient, clipped to norm 1e-3 by hand
        g = run(model, x)["fc1.weight"]
        assert g.norm() > 1e-3
        parts.append(g * (1e-3 / (g.norm() + 1e-6)))
        nonzero += int(g.count_nonzero())
    model.zero_grad(set_to_none=True)
    with hookplug.attach(model, "*", plugins=("gradclamp", {"max_norm": 1e-3, "params": "fc1.weight"})) as s:
        for x in xs:
            model(x).square().mean().backward()
    g = model.fc1.weight.grad
    assert torch.allclose(g, sum(parts), rtol=1e-5, atol=0)
    assert g.norm() > 2e-3  # four clipped parts add up past the bound
    assert s["gradclamp"].results()["fc1.weight"]["changed"] == nonzero  # 4 times steered


@pytest.mark.parametrize("swap", [False, True])
def test_params_still_steered_after_a_dtype_change(swap):
    """``model.double()`` while attached: with ``swap_module_params_on_conversion`` torch
    swaps each parameter's at::Tensor (refused while a weak reference to it exists; tensor
    hooks stay with the old one): the session hooks the new one at the next step()."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        torch.manual_seed(0)
        model = MLP(8, 16, 4)
        x = torch.randn(5, 8, dtype=torch.float64)
        with hookplug.attach(model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "*.bias"})) as s:
            model.double()
            s.step()
            grads = run(model, x)
        assert all(p.dtype == torch.float64 for p in model.parameters())
        biases = [n for n in grads if n.endswith("bias")]
        assert biases and all(torch.count_nonzero(grads[n]) == 0 for n in biases)
        assert any(torch.count_nonzero(g) > 0 for n, g in grads.items() if n.endswith("weight"))
        assert all(p._backward_hooks in (None, {}) for p in model.parameters())  # removed
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_param_hooks_survive_round_trips_and_replaced_parameters():
    """``double()`` then ``float()`` between steps (the tensor's address often comes back:
    the hook must not be taken for installed), then a parameter replaced by a frozen one
    (skipped, no error) and by a trainable one (hooked at the next step)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = nn.Sequential(nn.Linear(3, 3))
        x = torch.randn(2, 3)
        with hookplug.attach(model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "*"})) as s:
            for _ in range(4):
                model.double()
                model.float()
                s.step()
                grads = run(model, x)
                assert all(torch.count_nonzero(g) == 0 for g in grads.values())
            model[0].bias = nn.Parameter(torch.zeros(3), requires_grad=False)
            s.step()
            model[0].bias = nn.Parameter(torch.ones(3))
            s.step()
            grads = run(model, x)
            assert torch.count_nonzero(grads["0.bias"]) == 0 and torch.count_nonzero(grads["0.weight"]) == 0
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_param_frozen_at_attach_is_steered_once_unfrozen():
    """Staged fine-tuning: a backbone frozen at attach, unfrozen later, is steered in the
    very next backward (it got no hook at all: its gradients went through untouched); the
    hook leaves ``requires_grad`` as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)
    x = torch.randn(3, 4)
    with hookplug.attach(model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "*.weight"})) as s:
        assert not model[0].weight.requires_grad
        grads = run(model, x)
        assert "0.weight" not in grads and torch.count_nonzero(grads["1.weight"]) == 0
        s.step()
        model[0].weight.requires_grad_(True)  # no step() between: the next backward is steered
        grads = run(model, x)
        assert torch.count_nonzero(grads["0.weight"]) == 0
        assert torch.count_nonzero(grads["0.bias"]) > 0
        assert s["gradclamp"].results()["0.weight"]["changed"] > 0
    assert all(p._backward_hooks in (None, {}) for p in model.parameters())  # removed


def test_frozen_inference_tensor_parameter_is_left_without_a_hook():
    """A teacher made under ``torch.inference_mode()`` and frozen: its parameters cannot
    require grad, so they get no hook (attach raised trying to switch requires_grad on)."""
    with torch.inference_mode():
        teacher = nn.Linear(4, 4)
    teacher.requires_grad_(False)
    model = nn.Sequential(teacher, nn.Linear(4, 4))
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"min": 0, "max": 0, "params": "*"})):
        grads = run(model, torch.randn(2, 4))
        assert set(grads) == {"1.weight", "1.bias"} and all(torch.count_nonzero(g) == 0 for g in grads.values())
    assert teacher.weight._backward_hooks in (None, {}) and not teacher.weight.requires_grad


def test_params_loaded_with_assign_are_steered_in_the_next_backward():
    """``load_state_dict(assign=True)`` makes new Parameter objects: they get their hooks
    when it returns (they waited for the next step() before)."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    with hookplug.attach(model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "*.bias"})):
        old = model.fc1.bias
        model.load_state_dict(state, assign=True)
        assert model.fc1.bias is not old
        grads = run(model, x)
    biases = [n for n in grads if n.endswith("bias")]
    assert biases and all(torch.count_nonzero(grads[n]) == 0 for n in biases)
    assert any(torch.count_nonzero(g) > 0 for n, g in grads.items() if n.endswith("weight"))
    assert all(p._backward_hooks in (None, {}) for p in model.parameters())
    assert not model.fc1._load_state_dict_post_hooks  # removed with the session


@pytest.mark.parametrize("how", ["to_empty", "accelerate"])
def test_params_attached_on_meta_are_steered_in_the_first_backward_after_materializing(how):
    """Deferred init: a model attached on ``meta`` and materialized afterwards gets new
    Parameter objects without ``load_state_dict`` (``to_empty()`` then an init of its own,
    FSDP2's recipe; accelerate's ``init_empty_weights`` + ``load_checkpoint_and_dispatch``
    sets each one with ``set_module_tensor_to_device``): they are steered from the first
    backward (they waited for the first ``session.step()``, so step 1 went unsteered)."""
    torch.manual_seed(0)
    real = MLP(8, 16, 4)
    x = torch.randn(5, 8)
    with torch.device("meta"):
        model = MLP(8, 16, 4)
    with hookplug.attach(model, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "*"})) as s:
        if how == "to_empty":
            model.to_empty(device="cpu")
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(real.get_parameter(name))
        else:
            accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
            for name, p in real.named_parameters():
                accelerate_modeling.set_module_tensor_to_device(model, name, "cpu", value=p.detach())
        assert not any(p.is_meta for p in model.parameters())
        grads = run(model, x)
        assert grads.keys() == {n for n, _ in model.named_parameters()}
        assert all(torch.count_nonzero(g) == 0 for g in grads.values())
        assert s["gradclamp"].results()["fc1.weight"]["changed"] > 0
        assert not model._forward_pre_hooks  # the check comes off once nothing is on meta
    assert all(p._backward_hooks in (None, {}) for p in model.parameters())


class DoubleParamGrads(hookplug.Plugin):
    """Doubles every parameter gradient; ``seen``: the names it was called with."""

    name = "double"

    def __init__(self):
        self.seen = []

    @hookplug.hookimpl
    def hookplug_param_grad(self, ctx, name, grad):
        self.seen.append(name)
        return grad * 2


def test_a_parameter_tied_after_attach_is_steered_once():
    """Weights tied after attach (🤗 ``tie_weights()`` once ``tie_word_embeddings`` is set,
    ``dec.weight = enc.weight``): the shared Parameter is steered once, under its first
    name, as when tied before attach (both names' bindings hooked it: doubled twice)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    x = torch.randn(3, 4)
    double = DoubleParamGrads()
    seen = double.seen

    with hookplug.attach(model, "Linear", plugins=[double]) as s:
        model[2].weight = model[0].weight
        s.step()
        for _ in range(2):  # the next step puts the hooks back again: still once
            seen.clear()
            got = run(model, x)["0.weight"]
            s.step()
            assert seen == ["0.weight"]
        model[2].weight = nn.Parameter(model[0].weight.detach().clone())  # untied again
        s.step()
        seen.clear()
        run(model, x)
        assert sorted(seen) == ["0.weight", "2.weight"]
        model[2].weight = model[0].weight
    want = run(model, x)["0.weight"] * 2
    assert torch.equal(got, want)
    assert model[0].weight._backward_hooks in (None, {})


@pytest.mark.parametrize("selector", ["Linear", "Linear:2"])
def test_a_parameter_untied_after_attach_is_steered_under_its_own_name(selector):
    """Tied at attach (``2.weight`` is ``0.weight``), untied after (an LM head fine-tuned apart
    from its embedding): the next step() hooks the new Parameter under its own name, if its
    module is selected. Only the first name had a binding: the untied one was never steered."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    x = torch.randn(3, 4)
    double = DoubleParamGrads()
    seen = double.seen

    with hookplug.attach(model, selector, plugins=[double]) as s:
        run(model, x)
        assert seen == ["0.weight"]  # tied: once
        model[2].weight = nn.Parameter(model[0].weight.detach().clone())
        s.step()
        seen.clear()
        got = run(model, x)
        # module 0 unselected ("Linear:2"): its Parameter, no longer tied, is not steered
        assert sorted(seen) == (["0.weight", "2.weight"] if selector == "Linear" else ["2.weight"])
    want = run(model, x)
    assert torch.equal(got["2.weight"], want["2.weight"] * 2)
    assert torch.equal(got["0.weight"], want["0.weight"] * (2 if selector == "Linear" else 1))
    assert all(p._backward_hooks in (None, {}) for p in model.parameters())


@pytest.mark.parametrize("tied_at_attach", [True, False])
def test_params_glob_follows_a_tie_or_untie_after_attach(tied_at_attach):
    """``params="2.*"`` matched once at attach, by the hook's name: untied after, the first
    name's Parameter (``0.weight``, never named by the glob) was still clamped; tied after,
    the shared Parameter's hook (named ``0.weight``) was never steered, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    if tied_at_attach:
        model[2].weight = model[0].weight
    x = torch.randn(5, 4)
    opts = ("gradclamp", {"min": -0.01, "max": 0.01, "params": "2.*"})
    with hookplug.attach(model, "Linear", plugins=opts) as s:
        if tied_at_attach:
            model[2].weight = nn.Parameter(model[0].weight.detach().clone())
        else:
            model[2].weight = model[0].weight
        s.step()
        got = run(model, x)
        res = s["gradclamp"].results()
    want = run(model, x)
    if tied_at_attach:  # only 2.weight
        assert torch.equal(got["0.weight"], want["0.weight"]) and want["0.weight"].abs().max() > 0.01
        assert torch.equal(got["2.weight"], want["2.weight"].clamp(-0.01, 0.01))
        assert list(res) == ["2.weight"]
    else:  # the shared Parameter, once, under its first name
        assert torch.equal(got["0.weight"], want["0.weight"].clamp(-0.01, 0.01))
        assert list(res) == ["0.weight"] and res["0.weight"]["changed"] > 0


def _tied_pair():
    """Two bias-free Linears around a Tanh, ``2.weight`` tied to ``0.weight``; an input; a
    plugin doubling parameter gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    return model, torch.randn(3, 4), DoubleParamGrads()


def test_untying_the_first_owner_of_a_parameter_tied_to_the_selected_module():
    """``2.weight`` is ``0.weight``, only module 2 selected: untied by giving module 0 a new
    Parameter, module 2's (the old one) stays steered (under the name it was keyed by at
    attach) and module 0's new one is not (an unselected module); the hook was held through
    module 2, not through the first owner ``named_parameters()`` names."""
    model, x, double = _tied_pair()
    with hookplug.attach(model, "Linear:2", plugins=[double]) as s:
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        s.step()
        got = run(model, x)
        assert double.seen == ["0.weight"]  # the key of module 2's Parameter since attach
    want = run(model, x)
    assert torch.equal(got["2.weight"], want["2.weight"] * 2)
    assert torch.equal(got["0.weight"], want["0.weight"])
    assert all(p._backward_hooks in (None, {}) for p in model.parameters())


def test_a_tied_parameter_reloaded_on_its_first_owner_stays_steered_on_the_other():
    """Tied at attach, then ``load_state_dict(assign=True)`` on the first owner only (which
    unties them): the other owner's Parameter stays steered before the next step() (the
    first binding's hook was taken off it), and from that step under its own name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    double = DoubleParamGrads()
    x = torch.randn(3, 4)
    with hookplug.attach(model, "Linear", plugins=[double]) as s:
        model[0].load_state_dict({"weight": model[0].weight.detach().clone()}, assign=True)
        assert model[2].weight is not model[0].weight
        got = run(model, x)
        assert sorted(double.seen) == ["0.weight", "0.weight"]  # the old hook, until step()
        s.step()
        double.seen.clear()
        got_after = run(model, x)
        assert sorted(double.seen) == ["0.weight", "2.weight"]
    want = run(model, x)
    for g in (got, got_after):
        assert torch.equal(g["0.weight"], want["0.weight"] * 2) and torch.equal(g["2.weight"], want["2.weight"] * 2)
    assert all(not p._backward_hooks for p in model.parameters())


def test_a_parameter_replaced_every_step_keeps_one_hook_and_one_handle():
    """``module.weight = nn.Parameter(...)`` (or ``load_state_dict(assign=True)``) every step:
    the next step() hooks the new Parameter and takes the hook off the old one; the session
    held one more handle per replacement, and the old Parameters kept their hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    olds = []
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"min": 0.0, "max": 0.0, "params": "*"})) as s:
        s.step()
        held = len(s._handles)
        for _ in range(20):
            olds.append(model[0].weight)
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())
            s.step()
            grads = run(model, torch.randn(3, 4))
            assert torch.count_nonzero(grads["0.weight"]) == 0
        assert len(s._handles) == held
        assert all(not p._backward_hooks for p in olds)
    assert not model[0].weight._backward_hooks


def test_an_untied_parameter_of_a_module_not_selected_is_left_alone():
    """Tied at attach to a selected module's weight, then untied: the other owner is not
    selected, so its new Parameter gets no hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    with hookplug.attach(model, "Linear:0", plugins=("gradclamp", {"min": 0.0, "max": 0.0, "params": "*"})) as s:
        model[2].weight = nn.Parameter(model[0].weight.detach().clone())
        s.step()
        grads = run(model, torch.randn(3, 4))
        assert torch.count_nonzero(grads["0.weight"]) == 0 and torch.count_nonzero(grads["2.weight"]) > 0
        assert not model[2].weight._backward_hooks


def test_params_glob_matching_nothing_warns():
    with pytest.warns(RuntimeWarning, match="matches no parameter"):
        hookplug.attach(
            MLP(), "Linear:fc1", plugins=("gradclamp", {"max": 1, "params": "fc3.*"})
        ).remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookplug.attach(
            MLP(), "Linear:fc3", plugins=("gradclamp", {"max": 1, "params": "fc3.*"})
        ).remove()


def test_report():
    model = MLP()
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"min": 0})) as s:
        run(model, torch.randn(3, 32))
    text = s.report()
    assert "== gradclamp ==" in text and "fc2" in text and "changed" in text and "min=0" in text


def test_report_columns_line_up_with_short_names_and_the_root():
    """The name column is as wide as its widest cell, the header and ``<root>`` included: it
    was sized from the module names alone ("0", "1", the root's "")."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with hookplug.attach(model, "Linear, *:", plugins=("gradclamp", {"max": 0.01})) as s:
        model(torch.randn(3, 4)).sum().backward()
    lines = s["gradclamp"].report().splitlines()[1:]
    assert lines[0] == "name    changed" and lines[1] == "------  -------", lines
    assert [line.split()[0] for line in lines[2:]] == ["1", "<root>", "0"]
    assert {len(line) for line in lines} == {len(lines[0])}  # the counts right-aligned under "changed"


@pytest.mark.parametrize(
    "opts,match",
    [
        ({}, "nothing to do"),
        ({"min": 1, "max": 0}, "min must be <= max"),
        ({"max_norm": 0}, "max_norm"),
        ({"max_norm": float("inf")}, "max_norm"),
        ({"nan": "ignore"}, "nan"),
        ({"min": "0"}, "min"),
        ({"min": 0, "params": 3}, "params"),
        ({"min": 0, "outputs": False}, "outputs=False"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(PluginError, match=match):
        hookplug.attach(MLP(), "Linear", plugins=("gradclamp", opts))


def test_params_glob_names_a_submodule_compiled_in_place_as_the_plain_model():
    """``self.net = torch.compile(self.net)``: the ``params`` glob matches the names the
    hooks use (no ``_orig_mod`` segment): ``net.0.weight`` is steered without a
    "matches no parameter" warning."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.compile(nn.Sequential(nn.Linear(8, 4)), backend="eager")

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    m = M()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "matches no parameter"
        s = hookplug.attach(m, "*", plugins=("gradclamp", {"min": 0, "max": 0, "params": "net.0.weight"}))
    with s:
        m(torch.randn(2, 8)).sum().backward()
    fc = m.net._orig_mod[0]
    assert torch.count_nonzero(fc.weight.grad) == 0
    assert torch.count_nonzero(fc.bias.grad) == 4
    assert s["gradclamp"].results() == {"net.0.weight": {"changed": 32}}


@pytest.mark.parametrize("value, n", [(10000.0, 10**6), (60000.0, 4096)])
def test_max_norm_float16_large_norm_is_clipped_to_max_norm(value, n):
    # max_norm / norm is a float16 subnormal here: the scale must not be rounded to float16
    class Id(nn.Module):
        def forward(self, x):
            return x * 1

    model = nn.Sequential(Id())
    x = torch.zeros(n, dtype=torch.float16, requires_grad=True)
    seen = []
    with hookplug.attach(model, "Id", plugins=("gradclamp", {"max_norm": 1.0})):
        out = model(x)
        out.register_hook(lambda g: seen.append(g.clone()))
        out.backward(torch.full((n,), value, dtype=torch.float16))
    want = torch.full((n,), value) * (1.0 / (value * n**0.5 + 1e-6))
    torch.testing.assert_close(seen[0], want.half())
    assert float(torch.linalg.vector_norm(seen[0].float())) <= 1.0 + 1e-3


def _near_max_bounds(dtype):
    """Bounds around ``dtype``'s largest finite value: the value itself, one a quarter of
    its last ulp past it (rounds to it), one half an ulp past it (rounds to inf: the tie
    goes to the even mantissa), and twice it."""
    fi = torch.finfo(dtype)
    ulp = fi.max * fi.eps / (2 - fi.eps)
    bounds = [fi.max, fi.max + ulp / 4, fi.max + ulp / 2, 2 * fi.max]
    if dtype == torch.float16:
        bounds += [65510.0, 65519.0, 65520.0, 1e5]
    return bounds


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", ["max", "min", "both"])
def test_bounds_near_the_dtype_max_agree_with_torch_clamp(dtype, which):
    """A bound just past the largest finite value of the gradient's dtype is the value that
    dtype rounds it to (float16: 65504 for 65504 < b < 65520, inf from 65520 on), as
    ``torch.clamp`` with a tensor bound, in float64 then cast, or compiled gives (eager
    ``torch.clamp`` with such a Python number raises "cannot be converted ... without
    overflow"). Before, any bound past the max counted as no bound: with ``max=65510`` an
    inf float16 gradient stayed inf."""
    big = torch.finfo(dtype).max

    class Id(nn.Module):
        def forward(self, x):
            return x * 1

    g_out = torch.tensor([float("inf"), float("-inf"), big, -big, 1.0, -1.0, float("nan")],
                         dtype=dtype)
    for b in _near_max_bounds(dtype):
        opts = {"max": {"max": b}, "min": {"min": -b}, "both": {"min": -b, "max": b}}[which]
        ref64 = torch.clamp(g_out.double(), **opts)
        want = ref64.to(dtype)
        # torch.clamp with tensor bounds on the gradient itself gives the same
        t_opts = {k: torch.tensor(v, dtype=torch.float64) for k, v in opts.items()}
        torch.testing.assert_close(torch.clamp(g_out, **t_opts), want, equal_nan=True,
                                   rtol=0, atol=0)
        model = nn.Sequential(Id())
        x = torch.zeros(len(g_out), dtype=dtype, requires_grad=True)
        seen = []
        with hookplug.attach(model, "Id", plugins=("gradclamp", opts)) as s:
            out = model(x)
            out.register_hook(lambda g: seen.append(g.clone()))
            out.backward(g_out)
            changed = s["gradclamp"].results().get("0", {"changed": 0})["changed"]
        torch.testing.assert_close(seen[0], want, equal_nan=True, rtol=0, atol=0,
                                   msg=f"{dtype} {opts}")
        moved = int(((want != g_out) & ~torch.isnan(g_out)).sum())
        assert changed == moved, (dtype, opts, changed, moved)


# -- under AMP's GradScaler ---------------------------------------------------------------------

def _amp_step(model, x, init_scale, plugins=None, hand=None, backend=None, device="cpu"):
    """One float16 autocast step with a ``GradScaler`` on ``device``: ``(param grads
    unscaled, weights after the step, the scale after update(), the gradclamp results)``.
    ``hand(scale)``: a function clamping an output gradient with plain torch hooks on every
    Linear. ``backend``: the model compiled with it (the scaler gets no scale before the
    forward)."""
    model, x = model.to(device), x.to(device)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if plugins is not None:
        name, opts = plugins
        session = hookplug.attach(model, "Linear", plugins=(name, {**opts, "scaler": scaler}))
    else:
        session = contextlib.nullcontext()
    hooks = (hand_output_hooks(model, ["fc1", "fc2", "fc3"], hand(init_scale)) if hand
             else contextlib.nullcontext())
    with session as s, hooks:
        with torch.autocast(device, dtype=torch.float16):
            loss = run(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = grads_of(model)
        scaler.step(opt)
        scaler.update()
        res = s["gradclamp"].results() if s is not None else None
    return grads, [p.detach().clone() for p in model.parameters()], scaler.get_scale(), res


@pytest.mark.parametrize("opts", [{"min": -1.0, "max": 1.0}, {"max": 0.0},
                                  {"max": 1.0, "params": "*", "outputs": True}, {"max_norm": 1.0}])
@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_still_sees_an_overflow(opts, device):
    """The hooks run inside backward, where ``GradScaler``'s gradients are scaled. An
    overflow there (inf in a float16 gradient) that a bound clamps to a finite value is
    hidden from the scaler, whose ``unscale_``/``step`` look for inf/NaN only afterwards:
    it stepped with the clamped garbage and never lowered its scale. With ``scaler=`` the
    non-finite elements are left for the scaler: the step is skipped and the scale backs
    off, as without hooks (torch's own clipping comes after ``unscale_``, for that reason)."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(6, 32)
    w0 = [p.detach().to(device) for p in base.parameters()]
    _, plain_w, plain_scale, _ = _amp_step(copy.deepcopy(base), x, 2.0**40, device=device)
    assert plain_scale == 2.0**39 and all(torch.equal(a, b) for a, b in zip(plain_w, w0))
    grads, w, scale, _ = _amp_step(copy.deepcopy(base), x, 2.0**40, ("gradclamp", opts), device=device)
    assert scale == plain_scale
    assert all(torch.equal(a, b) for a, b in zip(w, w0))  # the step was skipped
    assert any(not torch.isfinite(g).all() for g in grads.values())


def test_grad_scaler_bounds_and_max_norm_are_in_unscaled_units():
    """With ``scaler=``, ``min``/``max``/``max_norm`` bound the gradient the optimizer will
    use (unscaled): a hand-written hook clamping to the bounds times the scale gives the
    same gradients, and ``changed`` counts the elements moved."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(6, 32)
    b, scale = 2.0**-9, 2.0**12  # exact in float16, times the scale too
    want, want_w, _, _ = _amp_step(copy.deepcopy(base), x, scale,
                                   hand=lambda s: lambda g: torch.clamp(g, -b * s, b * s))
    got, got_w, _, res = _amp_step(copy.deepcopy(base), x, scale,
                                   ("gradclamp", {"min": -b, "max": b}))
    assert_grads_equal(got, want)
    assert all(torch.equal(p, q) for p, q in zip(got_w, want_w))
    assert sum(r["changed"] for r in res.values()) > 0
    # the same bound on the scaled values (the rule without scaler=) is another clamp
    loose, _, _, _ = _amp_step(copy.deepcopy(base), x, scale,
                               hand=lambda s: lambda g: torch.clamp(g, -b, b))
    assert any(not torch.equal(loose[k], want[k]) for k in want)

    def clip(s, max_norm=0.01):
        def fn(g):
            norm = torch.linalg.vector_norm(g, dtype=torch.float32) / s
            return (g.float() * (max_norm / (norm + 1e-6))).half() if norm > max_norm else g
        return fn

    want, _, _, _ = _amp_step(copy.deepcopy(base), x, scale, hand=clip)
    got, _, _, res = _amp_step(copy.deepcopy(base), x, scale, ("gradclamp", {"max_norm": 0.01}))
    assert res and sum(r["changed"] for r in res.values()) > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("opts", [{"min": -1.0, "max": 1.0}, {"max_norm": 1.0},
                                  {"min": -2.0**-9, "max": 2.0**-9}, {"max_norm": 0.01}])
@pytest.mark.parametrize("init_scale", [2.0**40, 2.0**12])
@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_compiled_equals_eager(opts, init_scale, device):
    """Compiled (fullgraph, the steering traced into the backward), the ``scaler=`` rules
    hold as in eager code: an overflow is left for the scaler (the step is skipped, the scale
    backs off) and the bounds are in unscaled units. The scale the traced backward reads is
    the scaler's own tensor, which compile start makes where the scaler has none yet (the
    first forward runs before the first ``scaler.scale(loss)``)."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(6, 32)
    want = _amp_step(copy.deepcopy(base), x, init_scale, ("gradclamp", opts), device=device)
    torch._dynamo.reset()
    try:
        got = _amp_step(copy.deepcopy(base), x, init_scale, ("gradclamp", opts),
                        backend="aot_eager", device=device)
    finally:
        torch._dynamo.reset()
    # (compiled float16 code sums fc2's two calls' weight gradients in another order, also
    # without hooks: not bitwise)
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-3, atol=1e-5, equal_nan=True)
    for p, q in zip(got[1], want[1]):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    assert got[2] == want[2] and got[3] == want[3]
    assert (got[2] < init_scale) == (init_scale == 2.0**40)


def test_a_dynamo_reset_after_attach_keeps_the_compiled_steering_in_unscaled_units():
    """``torch.compiler.reset()`` after attach (a notebook cell, a test fixture) cleared
    hookplug's compile-start callbacks: gradclamp's scale tensor was never made, and the
    first compiled backward clamped in scaled units (gradients differed from eager)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    xs = [torch.randn(4, 8) for _ in range(2)]
    opts = ("gradclamp", {"min": -0.01, "max": 0.01})

    def run(compiled):
        m = copy.deepcopy(base)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        s = hookplug.attach(m, "Linear", plugins=[(opts[0], {**opts[1], "scaler": scaler})])
        if compiled:
            torch.compiler.reset()
        run_m = torch.compile(m, backend="aot_eager") if compiled else m
        grads = []
        for x in xs:
            m.zero_grad()
            scaler.scale(run_m(x).square().mean()).backward()
            grads.append([p.grad / scaler.get_scale() for p in m.parameters()])
            s.step()
        changed = {k: v["changed"] for k, v in s["gradclamp"].results().items()}
        s.remove()
        return grads, changed

    want = run(False)
    torch._dynamo.reset()
    try:
        got = run(True)
    finally:
        torch._dynamo.reset()
    assert got[1] == want[1] and sum(want[1].values()) > 0
    for g, w in zip(got[0], want[0]):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_grad_scaler_option_checks():
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="scaler"):
        hookplug.attach(MLP(), "Linear", plugins=("gradclamp", {"nan": "zero", "scaler": scaler}))
    with pytest.raises(PluginError, match="scaler"):
        hookplug.attach(MLP(), "Linear", plugins=("gradclamp", {"max": 1.0, "scaler": "amp"}))
    # a scaler switched off (enabled=False) scales nothing: the bounds are the plain ones
    off = torch.amp.GradScaler("cpu", enabled=False)
    model = MLP()
    x = torch.randn(6, 32)
    with hand_output_hooks(model, ["fc1", "fc2", "fc3"], lambda g: g.clamp(max=0.0)):
        want = run(model, x)
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"max": 0.0, "scaler": off})):
        got = run(model, x)
    assert_grads_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_bounds_keep_a_scalar_gradients_dtype(dtype):
    """With ``scaler=`` the bounds are float32 tensors (times the scale): on a 0-d float16 or
    bfloat16 gradient (a module whose output is a scalar, e.g. a loss module) ``torch.clamp``
    promoted the result to float32, a gradient of another dtype (a PluginError)."""
    class Sq(nn.Module):
        def forward(self, x):
            return x.square().sum()

    model = nn.Sequential(nn.Linear(4, 4), Sq()).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    g = {}
    model[0].weight.register_hook(lambda t: g.setdefault("w", t))
    with hookplug.attach(model, "Sq", plugins=("gradclamp", {"max": 0.25, "scaler": scaler})) as s:
        scaler.scale(model(x).float()).backward()
        assert s["gradclamp"].results() == {"1": {"changed": 1}}
    ref = nn.Sequential(nn.Linear(4, 4)).to(dtype)
    ref[0].load_state_dict(model[0].state_dict())
    ref(x).square().sum().backward()  # the scalar's gradient, 4 (scaled), clamped to 0.25 * 4
    torch.testing.assert_close(g["w"], ref[0].weight.grad)


# -- under torch.compile ------------------------------------------------------------------------

def _counting(backend, frames):
    """``backend`` that counts the graphs it compiles (``frames[0]``)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def counting(gm, example_inputs):
        frames[0] += 1
        return inner(gm, example_inputs)
    return counting


_W = torch.linspace(-3, 3, 10)
_W_NAN = _W.clone()
_W_NAN[[1, 6]] = float("nan")  # NaN in two columns of fc3's output gradient


def _sgd(base, x, *, plugins=None, backend=None, steps=3, loss=None, scaler=False, read=None,
         fullgraph=True, device="cpu", weights=_W, dynamic=None):
    """``steps`` SGD steps of a copy of ``base``, compiled with a counting ``backend`` (or
    eager), gradclamp/stats attached to every Linear by ``plugins(scaler)`` (``scaler``: a
    ``GradScaler`` on the CPU scales the loss, steps and updates). Returns the parameter
    gradients of every step (unscaled), the parameters after the last, the graphs compiled,
    the graph breaks and ``read(session)``. The loss: ``(out * weights).sum()``, unless
    ``loss`` is given; all on ``device``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, x, w = copy.deepcopy(base).to(device), x.to(device), weights.to(device)
    loss = loss or (lambda out: (out * w).sum())
    frames = [0]
    run = (torch.compile(model, backend=_counting(backend, frames), fullgraph=fullgraph, dynamic=dynamic)
           if backend else model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = torch.amp.GradScaler(device, init_scale=2.0**10) if scaler else None
    session = hookplug.attach(model, "Linear", plugins=plugins(amp)) if plugins else None
    grads = []
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            value = loss(run(x))
            if amp is not None:
                amp.scale(value).backward()
                amp.unscale_(opt)
                grads.append(grads_of(model))
                amp.step(opt)
                amp.update()
            else:
                value.backward()
                grads.append(grads_of(model))
                opt.step()
            if session is not None:
                session.step()
        got = read(session) if read is not None and session is not None else None
    finally:
        if session is not None:
            session.remove()
        torch._dynamo.reset()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "frames": frames[0], "breaks": dict(counters["graph_break"]), "read": got}


def _changed(session):
    return {k: v["changed"] for k, v in session["gradclamp"].results().items()}


_COMPILED_CASES = {
    "min_max": ({"min": -0.02, "max": 0.02}, {}),
    "max": ({"max": 0.01}, {}),
    "max_norm": ({"max_norm": 0.05}, {}),
    "nan_zero": ({"nan": "zero", "min": -0.05}, {"weights": _W_NAN}),
    "scaler": ({"min": -0.02, "max": 0.02}, {"scaler": True}),
    "scaler_max_norm": ({"max_norm": 0.05}, {"scaler": True}),
    # a scaler switched off: the plain bounds
    "scaler_off": ({"max": 0.01, "scaler": torch.amp.GradScaler("cpu", enabled=False)}, {}),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(_COMPILED_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_output_steering_has_no_graph_break_and_equals_eager(case, backend, device):
    """gradclamp on the outputs of every Linear of a compiled MLP (fc2 called twice) is
    traced into the compiled backward: as many graphs as the model without hooks, no graph
    break (fullgraph=True), and the steered gradients, the parameters after three SGD steps
    and the ``changed`` counts equal eager (bitwise under aot_eager)."""
    opts, kw = _COMPILED_CASES[case]
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(8, 32)
    kw = dict(kw)
    scaler = kw.pop("scaler", False)

    def plugins(amp):
        return ("gradclamp", {**opts, "scaler": amp} if amp is not None else opts)

    kw.update(scaler=scaler, device=device)
    plain = _sgd(base, x, backend=backend, **kw)
    eager = _sgd(base, x, plugins=plugins, read=_changed, **kw)
    compiled = _sgd(base, x, plugins=plugins, backend=backend, read=_changed, **kw)
    assert compiled["breaks"] == {}
    assert compiled["frames"] == plain["frames"] == 1
    assert eager["read"] == compiled["read"]
    assert set(eager["read"]) == {"fc1", "fc2", "fc3"} and sum(eager["read"].values()) > 0
    # steering changed the training
    assert any(not torch.equal(a, b) for a, b in zip(plain["params"], eager["params"]))
    close = (assert_grads_equal if backend == "aot_eager" else
             lambda a, b: [torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a])
    for a, b in zip(eager["grads"], compiled["grads"]):
        close(a, b)
    close(dict(enumerate(eager["params"])), dict(enumerate(compiled["params"])))


@pytest.mark.parametrize("case", ["max_norm", "scaler", "scaler_max_norm", "min_max"])
def test_compiled_steering_with_dynamic_shapes_equals_eager(case):
    """``torch.compile(dynamic=True)``: dynamo made the plugin's float options symbolic
    graph inputs, which the traced backward could not take (max_norm raised "lift_tracked_
    freevar_to_input should not be called on root SubgraphTracer" at the first call). They
    are constants of the graph now; steering equals eager."""
    opts, kw = _COMPILED_CASES[case]
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(8, 32)
    kw = dict(kw)

    def plugins(amp):
        return ("gradclamp", {**opts, "scaler": amp} if amp is not None else opts)

    eager = _sgd(base, x, plugins=plugins, read=_changed, **kw)
    compiled = _sgd(base, x, plugins=plugins, backend="aot_eager", read=_changed, dynamic=True, **kw)
    assert eager["read"] == compiled["read"] and sum(eager["read"].values()) > 0
    for a, b in zip(eager["grads"], compiled["grads"]):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaler"])
@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("opts", [({"max_norm": 1e-3}, {"max_norm": 1e3}),
                                  ({"min": -1e-3, "max": 1e-3}, {"min": -1e3, "max": 1e3})])
def test_compiled_model_attached_again_with_other_bounds_steers_with_the_new_ones(opts, dynamic, scaled):
    """A compiled model, gradclamp attached, removed, and attached again with other bounds:
    the second session's backward uses its own (the options are graph constants guarded by
    their values; read as marked constants they were guarded by the code alone, and the
    second session ran with the first one's bounds). Gradients equal eager's."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 32)
    compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
    try:
        for opt in opts:
            opt = {**opt, "scaler": scaler} if scaled else opt
            got, want = [], []
            for run, out in ((compiled, got), (model, want)):
                with hookplug.attach(model, "Linear", plugins=("gradclamp", opt)):
                    model.zero_grad(set_to_none=True)
                    loss = run(x).sum()
                    (scaler.scale(loss) if scaled else loss).backward()
                    out.append([p.grad.clone() for p in model.parameters()])
            for a, b in zip(got[0], want[0]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("first", ["gradclamp", "stats"])
def test_compiled_steering_and_measuring_one_output_keep_the_eager_order(first):
    """gradclamp and stats' grad site on the same modules, both traced into the compiled
    backward (no graph break): in plugin order, as eager runs them, stats measures the
    steered gradient when gradclamp comes first and the incoming one when it comes after."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(8, 32)
    pair = [("gradclamp", {"min": -0.02, "max": 0.02}), ("stats", {"sites": ("grad",)})]
    if first == "stats":
        pair.reverse()

    def read(session):
        st = session["stats"].results()
        return _changed(session), {m: {f: getattr(st[m]["grad"], f).item()
                                       for f in ("numel", "min", "max", "mean", "zero_count")}
                                   for m in st}

    eager = _sgd(base, x, plugins=lambda _: pair, read=read)
    compiled = _sgd(base, x, plugins=lambda _: pair, backend="aot_eager", read=read)
    plain = _sgd(base, x, backend="aot_eager")
    assert compiled["breaks"] == {} and compiled["frames"] == plain["frames"]
    assert eager["read"][0] == compiled["read"][0] and sum(eager["read"][0].values()) > 0
    assert set(eager["read"][1]) == {"fc1", "fc2", "fc3"}
    for m, e in eager["read"][1].items():
        c = compiled["read"][1][m]
        assert e["numel"] == c["numel"] and e["min"] == c["min"] and e["max"] == c["max"], m
        assert math.isclose(e["mean"], c["mean"], rel_tol=1e-6, abs_tol=1e-12), m
    steered = max(e["max"] for e in eager["read"][1].values()) <= 0.02
    assert steered == (first == "gradclamp")
    for a, b in zip(eager["grads"], compiled["grads"]):
        assert_grads_equal(a, b)


def test_compiled_output_steering_under_compiled_autograd_equals_eager():
    """Compiled autograd (its config flag, a compiled training step): the grad hooks go
    through tensor hooks it traces; gradients, parameters and counts equal eager."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(8, 32)
    opts = {"min": -0.02, "max": 0.02, "max_norm": 0.5}
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            (model(x) * _W).sum().backward()

        grads = []
        try:
            with hookplug.attach(model, "Linear", plugins=("gradclamp", opts)) as s:
                if compiled:
                    torch._dynamo.config.compiled_autograd = True
                    fn = torch.compile(step, backend="aot_eager")
                else:
                    fn = step
                for _ in range(3):
                    opt.zero_grad(set_to_none=True)
                    fn()
                    grads.append(grads_of(model))
                    opt.step()
                    s.step()
                res = _changed(s)
        finally:
            torch._dynamo.config.compiled_autograd = False
            torch._dynamo.reset()
        runs.append((grads, [p.detach().clone() for p in model.parameters()], res))
    (ge, pe, re), (gc, pc, rc) = runs
    assert re == rc and sum(re.values()) > 0
    for a, b in zip(ge, gc):
        assert_grads_equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(pe, pc))


@pytest.mark.parametrize("opts", [{"max": 0.001, "params": "*"},
                                  {"max": 0.01, "nan": "raise"}])
def test_compiled_training_step_compiles_no_graph_for_the_tensor_hooks(opts):
    """A whole training step compiled (``loss.backward()``, a graph break, then the optimizer
    step: PyTorch's tutorials do this) runs backward with dynamo's frame hook on: it compiled
    the parameter hooks into graphs of their own, one per parameter (10 graphs for the 2 of
    the step without hooks here), and each output hook of ``nan="raise"`` likewise. They run
    as in eager: no graph of their own, and equal counts and parameters."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(8, 32)
    out = {}
    for mode in ("eager", "plain", "compiled"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        # lr 2**-3: lr * grad is exact, so torch 2.11's compiled SGD step rounds as eager's
        opt = torch.optim.SGD(model.parameters(), lr=0.125)
        frames = [0]

        def step():
            (model(x) * _W).sum().backward()
            opt.step()
            opt.zero_grad()

        session = (contextlib.nullcontext() if mode == "plain" else
                   hookplug.attach(model, "Linear", plugins=("gradclamp", opts)))
        with session as s:
            fn = step if mode == "eager" else torch.compile(step, backend=_counting("aot_eager", frames))
            for _ in range(3):
                fn()
                if s is not None:
                    s.step()
            out[mode] = (_changed(s) if s is not None else None,
                         [p.detach().clone() for p in model.parameters()], frames[0])
    torch._dynamo.reset()
    # nan="raise": the forward's graph break at each of the 4 module calls splits it into 6
    # more graphs (16 with the hooks compiled too)
    # (torch 2.11 compiles 3 of those 6: fewer frames after the breaks get graphs)
    extra = out["compiled"][2] - out["plain"][2]
    assert extra == 0 if "params" in opts else 0 < extra <= 6, extra
    assert out["eager"][0] == out["compiled"][0] and len(out["eager"][0]) > 0
    assert sum(out["eager"][0].values()) > 0
    assert all(torch.equal(a, b) for a, b in zip(out["eager"][1], out["compiled"][1]))


@pytest.mark.parametrize("how", ["config", "enable"])
@pytest.mark.parametrize("opts", [{"max": 0.001, "params": "*"}, {"max": 0.01}])
def test_compiled_training_step_under_compiled_autograd_compiles_its_backward_once(opts, how):
    """Compiled autograd (its config flag and a compiled training step, or
    ``compiled_autograd._enable`` around ``backward()`` of a compiled model) traces the eager
    hooks' count into its backward graph: the first trace added each counter to the
    plugin's table and guarded on it, so the whole backward compiled again at the second
    step. The counters are made at compile start: nothing compiles after the first step,
    and the counts and parameters equal eager."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(8, 32)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base)
        # lr 2**-3: lr * grad is exact, so torch 2.11's compiled SGD step rounds as eager's
        opt = torch.optim.SGD(model.parameters(), lr=0.125)
        enable = compiled and how == "enable"
        run = torch.compile(model, backend="aot_eager") if enable else model

        def step():
            loss = (run(x) * _W).sum()
            with (compiled_autograd._enable(torch.compile(backend="aot_eager")) if enable
                  else contextlib.nullcontext()):
                loss.backward()
            opt.step()
            opt.zero_grad()

        graphs = []
        try:
            with hookplug.attach(model, "Linear", plugins=("gradclamp", opts)) as s:
                if compiled and how == "config":
                    torch._dynamo.config.compiled_autograd = True
                fn = torch.compile(step, backend="aot_eager") if compiled and not enable else step
                for _ in range(3):
                    fn()
                    s.step()
                    graphs.append(counters["stats"]["unique_graphs"])
                out[compiled] = (_changed(s), [p.detach().clone() for p in model.parameters()],
                                 graphs)
        finally:
            torch._dynamo.config.compiled_autograd = False
            torch._dynamo.reset()
    assert out[True][2][0] > 0 and out[True][2][0] == out[True][2][-1], out[True][2]
    assert out[False][0] == out[True][0] and sum(out[False][0].values()) > 0
    assert all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1]))


def test_compiled_nan_raise_keeps_the_tensor_hooks_and_raises():
    """``nan="raise"`` must read the device (a sync) to decide: it is not traced into the
    compiled backward, its tensor hooks graph-break per module call, and a NaN raises."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    net = NanNet()
    with hookplug.attach(net, "*:lin", plugins=("gradclamp", {"nan": "raise"})) as s:
        assert not s["gradclamp"].grad_in_graph
        with pytest.raises(FloatingPointError, match="'lin'"):
            torch.compile(net, backend="aot_eager")(torch.randn(3, 4)).sum().backward()
    assert counters["graph_break"]
    torch._dynamo.reset()


def test_counter_tokens_of_a_session_never_removed_go_with_its_plugin():
    """A session dropped without ``remove()`` (its model gone) never ends: the count op's
    token entries of its plugin stayed in the module-global table, two per session here."""
    import gc

    import hookplug_plugins.gradclamp as gcm

    before = set(gcm._COUNTERS)
    for _ in range(3):
        model = MLP()
        s = hookplug.attach(model, "Linear", plugins=("gradclamp", {"max": 0.01}))
        assert s["gradclamp"].grad_in_graph and set(gcm._COUNTERS) - before
        del model, s
    gc.collect()
    assert set(gcm._COUNTERS) == before


def test_compiled_steering_shares_one_graph_between_identical_blocks():
    """Blocks compiled one by one (``block.compile()``) share their graphs with gradclamp on
    their Linears, as without hooks: the traced steering reads nothing of its module (a
    module's name read on the way made each block's graph its own), and each module's
    counter is reached through its own per-module tensor."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    torch.manual_seed(0)
    base = nn.Sequential(*(Block() for _ in range(3)))
    x = torch.randn(4, 8)
    out = {}
    for mode in ("eager", "plain", "compiled"):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        frames = [0]
        plugins = ("gradclamp", {"min": -0.1, "max": 0.1})
        session = contextlib.nullcontext() if mode == "plain" else hookplug.attach(m, "Linear",
                                                                                  plugins=plugins)
        with session as s:
            if mode != "eager":
                backend = _counting("aot_eager", frames)  # one backend: graphs can be shared
                for block in m:
                    block.compile(backend=backend)
            for _ in range(2):
                (m(x) * 3).sum().backward()
                if s is not None:
                    s.step()
            out[mode] = (_changed(s) if s is not None else None, grads_of(m), frames[0])
        for block in m:
            block._compiled_call_impl = None
    torch._dynamo.reset()
    # the first block's input needs no grad, the others' do: two graphs without hooks too
    assert out["compiled"][2] == out["plain"][2] == 2
    assert out["eager"][0] == out["compiled"][0] and len(out["eager"][0]) == 3
    assert sum(out["eager"][0].values()) > 0
    assert_grads_equal(out["eager"][1], out["compiled"][1])


@pytest.mark.parametrize("plugins", [("gradclamp", {"min": 0.0, "max": 0.0}), ("stats", {"sites": ("grad",)})],
                         ids=["gradclamp", "stats"])
def test_compiled_identity_on_a_graph_input_steers_and_measures_as_eager(plugins):
    """``nn.Identity`` on the input of a compiled region (a block compiled alone, regional
    compilation): dynamo traces a graph input as a leaf, which was skipped like a returned
    Parameter, before the test for a returned input: no grad site, gradclamp steered nothing
    (grads differed from eager), stats recorded nothing. It takes the tensor hook, as eager."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.skip = nn.Identity()

        def forward(self, x):
            return self.fc(x) + self.skip(x)

    torch.manual_seed(0)
    base, x0 = Block(), torch.randn(2, 4)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        x = x0.clone().requires_grad_()
        with hookplug.attach(m, "Identity", plugins=plugins) as s:
            f = torch.compile(m, backend="aot_eager") if compiled else m
            f(x).square().sum().backward()
            out[compiled] = (x.grad, s.results())
    torch._dynamo.reset()
    assert torch.equal(out[True][0], out[False][0])
    assert str(out[True][1]) == str(out[False][1]) and out[False][1][plugins[0]]["skip"]


@pytest.mark.parametrize("returns", ["view", "input"])
def test_compiled_module_returning_a_keyword_input_leaves_its_alias(returns):
    """A hooked module called with a keyword argument that returns it (or a view of it),
    changed in place by the caller: compiled code took it for a fresh tensor (inputs were
    compared with the positional arguments only) and cloned it for the grad site, so the
    in-place change no longer reached the input: outputs and grads differed from the
    model without hooks."""
    class Pick(nn.Module):
        def forward(self, x):
            return x[:, :2] if returns == "view" else x

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.sub = Pick()

        def forward(self, x):
            h = self.fc(x)
            self.sub(x=h).mul_(10)
            return h

    torch.manual_seed(0)
    base, x = M(), torch.randn(2, 4)
    out = {}
    for hooks in (False, True):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        session = (hookplug.attach(m, "*:sub", plugins=("stats", {"sites": ("output", "grad")}))
                   if hooks else contextlib.nullcontext())
        with session:
            y = torch.compile(m, backend="aot_eager")(x)
            y.sum().backward()
        out[hooks] = (y.detach(), m.fc.weight.grad)
    torch._dynamo.reset()
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


class _Times(hookplug.Plugin):
    """Multiplies every parameter gradient by ``k``; ``seen``: the names it was called with."""

    def __init__(self, name, k):
        self.name, self.k, self.seen = name, k, []

    @hookplug.hookimpl
    def hookplug_param_grad(self, ctx, name, grad):
        self.seen.append(name)
        return grad * self.k


@pytest.mark.parametrize("untie", [0, 2])
def test_an_untied_parameter_is_steered_by_the_plugins_of_the_modules_holding_it(untie):
    """``0.weight`` is ``2.weight`` is ``4.weight``; plugin A (x2) selects module ``untie``, B
    (x3) module 4. Untying A's module (a new Parameter of its own):
    each Parameter is steered by the plugins covering a module that holds it now, not by
    those of the Parameter it replaced (nor by a plugin covering only another owner)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False), nn.Tanh(),
                          nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    model[4].weight = model[0].weight
    x = torch.randn(3, 4)
    a, b = _Times("A", 2.0), _Times("B", 3.0)
    with hookplug.attach(model, {f"Linear:{untie}": [a], "Linear:4": [b]}) as s:
        model[untie].weight = nn.Parameter(model[untie].weight.detach().clone())
        s.step()
        got = run(model, x)
        assert (a.seen, b.seen) == ([f"{untie}.weight"], ["4.weight"])  # (B's binding took it over)
    want = run(model, x)
    other = "0.weight" if untie == 2 else "2.weight"  # (still tied to 4.weight: one tensor)
    assert torch.equal(got[f"{untie}.weight"], want[f"{untie}.weight"] * 2)
    assert torch.equal(got[other], want[other] * 3)


def test_a_parameter_tied_again_to_a_new_one_keeps_its_name():
    """Tied at attach, then both owners given one new shared Parameter (🤗
    ``resize_token_embeddings`` then ``tie_weights()``), only the second owner selected: the
    new Parameter is named as the old one was, by its first name, and steered once."""
    model, x, double = _tied_pair()
    with hookplug.attach(model, "Linear:2", plugins=[double]) as s:
        new = nn.Parameter(model[0].weight.detach().clone())
        model[0].weight = model[2].weight = new
        s.step()
        double.seen.clear()
        got = run(model, x)
        assert double.seen == ["0.weight"]
    assert torch.equal(got["0.weight"], run(model, x)["0.weight"] * 2)


def test_reloading_every_parameter_with_assign_rebinds_once(monkeypatch):
    """``load_state_dict(assign=True)`` replaces every Parameter: the session re-reads who
    holds them once, at the next step, not once per Parameter or module (quadratic: 15 s for
    800 parameters), and each stays steered."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    x = torch.randn(3, 4)
    double = DoubleParamGrads()
    rebinds = []
    with hookplug.attach(model, "Linear", plugins=[double]) as s:
        orig = type(s)._rebind
        monkeypatch.setattr(type(s), "_rebind", lambda self: (rebinds.append(1), orig(self))[1])
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        s.step()
        assert len(rebinds) == 1
        got = run(model, x)
    want = run(model, x)
    assert all(torch.equal(got[k], want[k] * 2) for k in want)


def test_bounds_set_after_construction_apply_without_a_scaler():
    """``min``/``max`` set on the plugin after it was made: the scaler-free path read the
    bounds cached per dtype at construction (the scaler path read the new ones)."""
    from hookplug_plugins.gradclamp import GradClampPlugin

    plugin = GradClampPlugin(min=-1.0, max=1.0)
    plugin.min, plugin.max = -0.01, 0.01
    model = nn.Sequential(nn.Linear(4, 4))
    with hookplug.attach(model, "Linear", plugins=[plugin]):
        (model(torch.randn(2, 4)) * 3.0).sum().backward()
    torch.testing.assert_close(model[0].bias.grad, torch.full((4,), 0.02))  # 2 rows x 0.01
