"""A model with lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``) attached before its first
forward: its parameters are ``UninitializedParameter``s until that forward materializes them
in place. Every plugin works on it and gives the numbers of a session attached after a dry
run, and those of plain torch (attach raised ``ValueError: Attempted to use an uninitialized
parameter`` for params, gradclamp ``params=`` and flops)."""
import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import hookplug


def lazy_cnn():
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(8), nn.ReLU(),
                         nn.LazyLinear(3))


def _assert_no_hooks(model):
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and not m._backward_hooks
    for p in model.parameters():
        assert p._backward_hooks in (None, {})


def _train(model, opt, session, x, steps=2):
    grads = []
    for step in range(steps):
        opt.zero_grad()
        model(x * (step + 1)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        session.step()
    return grads


class _NoSession:
    def step(self):
        pass

    def results(self):
        return {}

    def remove(self):
        pass


def _run(attach_first: bool, plugins):
    """Two training steps; the lazy model materialized by the first (``attach_first``) or by
    a dry run under ``no_grad`` before attach. The same initial weights either way.
    ``plugins=None``: plain torch, no session."""
    x = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    model = lazy_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the same Parameter objects once materialized
    if attach_first:
        session = hookplug.attach(model, "Conv2d|Linear", plugins=plugins) if plugins else _NoSession()
        torch.manual_seed(1)  # the init the first forward draws
    else:
        torch.manual_seed(1)
        with torch.no_grad():
            model(x)
        session = hookplug.attach(model, "Conv2d|Linear", plugins=plugins)
    grads = _train(model, opt, session, x)
    results = session.results()
    session.remove()
    _assert_no_hooks(model)
    return model, results, grads


def _plain(results):
    out = {}
    for plugin, res in results.items():
        out[plugin] = {n: {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in r.items()}
                       for n, r in res.items()}
    return out


def test_a_lazy_model_attached_before_its_first_forward_equals_one_attached_after():
    plugins = ["params", ("stats", {"sites": ("output", "grad")}), "flops"]
    model, first, _ = _run(True, plugins)
    _, after, _ = _run(False, plugins)
    assert _plain(first) == _plain(after)
    names = {n for n, _ in model.named_parameters()}
    assert set(first["params"]) == names  # every parameter measured, from the first step
    assert all(set(r) == {"weight", "grad", "update"} for r in first["params"].values())
    for name, p in model.named_parameters():
        assert first["params"][name]["weight"].numel == p.numel()  # the last step's
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_modules()
             if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert {n: r["params"] for n, r in first["flops"].items()} == sizes
    assert all(r["flops"] > 0 and r["backward_flops"] > 0 for r in first["flops"].values())


def test_flops_of_a_lazy_model_equal_flop_counter_mode():
    x = torch.randn(2, 2, 6, 6)
    model = lazy_cnn()
    with hookplug.attach(model, "Conv2d|Linear", plugins="flops") as s:
        assert s["flops"].total()["params"] == 0  # no size before the first forward
        model(x).sum().backward()
        got = s["flops"].results()
        total = s["flops"].total()
    with FlopCounterMode(display=False) as fcm:
        model(x).sum().backward()
    counts = fcm.get_flop_counts()
    for name, row in got.items():
        want = sum(counts[f"Sequential.{name}"].values())
        assert row["flops"] + row["backward_flops"] == want, name
    assert total["params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("where", ["params", "outputs"])
def test_gradclamp_steers_a_lazy_model_from_its_first_backward(where):
    """gradclamp on a lazy model attached before its first forward: the parameters, hooked
    once their module's first forward has materialized them, are steered in that first
    backward already, as plain clamping after backward does (outputs: unchanged)."""
    opts = {"min": -1e-3, "max": 1e-3}
    if where == "params":
        opts["params"] = "*"
    model, _, grads = _run(True, [("gradclamp", opts)])
    _, _, plain = _run(True, None)
    if where == "params":
        for step in range(2):
            for name, g in grads[step].items():
                # step 2 differs from plain in its weights (a clamped step 1): the bound alone
                assert g.abs().max() <= 1e-3, (step, name)
        for name, g in plain[0].items():
            assert torch.equal(grads[0][name], g.clamp(-1e-3, 1e-3)), name
    else:
        assert any(not torch.equal(grads[0][n], plain[0][n]) for n in plain[0])


def test_a_lazy_parameter_is_hooked_by_the_forward_that_materializes_it():
    """The check that hooks it sits on the lazy module (after torch's own init hook) and
    comes off once its parameters hold values; remove() before any forward leaves none."""
    seen = []

    class Seen(hookplug.Plugin):
        name = "seen"

        @hookplug.hookimpl
        def hookplug_param_grad(self, ctx, name, grad):
            seen.append(name)

    model = lazy_cnn()
    with hookplug.attach(model, "Linear", plugins=[Seen()]):
        assert len(model[3]._forward_pre_hooks) == 2 and len(model[5]._forward_pre_hooks) == 2
        model(torch.randn(2, 2, 6, 6)).sum().backward()
        assert sorted(seen) == ["3.bias", "3.weight", "5.bias", "5.weight"]
        assert not model[3]._forward_pre_hooks and not model[5]._forward_pre_hooks
    _assert_no_hooks(model)
    model = lazy_cnn()
    hookplug.attach(model, "Linear", plugins=[Seen()]).remove()
    assert all(len(m._forward_pre_hooks) == 1 for m in (model[0], model[3], model[5]))  # torch's own


def test_params_update_of_a_lazy_model_without_an_optimizer_has_its_first_step():
    """No optimizer (weights changed by hand): the update is the change between two steps,
    from the weights the first forward materialized (a lazy parameter had no baseline at
    attach: step 0 had no update record); the records equal a session attached after a dry
    run, and the change plain torch made."""
    x = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(3))

    def run(attach_first):
        model = lazy_cnn()
        if not attach_first:
            torch.manual_seed(1)
            with torch.no_grad():
                model(x)
        s = hookplug.attach(model, "Conv2d|Linear", plugins=("params", {"sites": ("update",)}))
        if attach_first:
            torch.manual_seed(1)
        changes = []
        for step in range(2):
            model.zero_grad()
            model(x * (step + 1)).square().mean().backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            changes.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
            s.step()
        recs = s.flush()
        s.remove()
        _assert_no_hooks(model)
        return {(r["step"], r["module"]): r for r in recs}, changes

    first, changes = run(True)
    after, _ = run(False)
    strip = lambda rs: {k: {f: v for f, v in r.items() if f not in ("time", "run_id")} for k, r in rs.items()}  # noqa: E731
    assert strip(first) == strip(after)
    assert {k[0] for k in first} == {0, 1}
    for step, change in enumerate(changes):
        for name, d in change.items():
            r = first[(step, name)]
            assert r["numel"] == d.numel() and r["max"] == float(d.max()) and r["min"] == float(d.min())
