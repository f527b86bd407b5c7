"""Real but unusual modules: shortcuts that return their input, packed sequences, the
nested-tensor fast path of nn.TransformerEncoder, float16 and sparse gradients. Each case
is compared with what plain torch (hooks, FlopCounterMode) gives."""
import collections
import copy
import dataclasses
import gc
import math
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence

import hookplug


class Residual(nn.Module):
    """The CIFAR ResNet block: ``body(x) + shortcut(x)`` with an empty Sequential shortcut,
    so the shortcut's output is the very tensor the body also reads."""

    def __init__(self, shortcut):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.shortcut = shortcut

    def forward(self, x):
        h = self.stem(x)
        return (self.body(h) + 2 * self.shortcut(h)).square().sum()


@pytest.mark.parametrize("shortcut", [nn.Sequential(), nn.Identity(), nn.Dropout(0.5)])
def test_a_shortcut_returning_its_input_sees_only_its_own_gradient(shortcut):
    model = Residual(shortcut).eval() if isinstance(shortcut, nn.Dropout) else Residual(shortcut)
    x = torch.randn(3, 4)
    seen = []
    handle = model.shortcut.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].clone()))
    model(x).backward()
    handle.remove()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plugins = [("stats", {"sites": ("output", "grad")}), ("capture", {"grads": True})]
    with hookplug.attach(model, "*:shortcut", plugins=plugins) as s:
        model(x).backward()
    got = s["capture"].grads["shortcut"]
    assert torch.equal(got, seen[0])  # the gradient through the shortcut, not through h
    st = s["stats"].results()["shortcut"]["grad"]
    assert float(st.max) == float(seen[0].max()) and int(st.numel) == seen[0].numel()
    assert all(torch.equal(p.grad, want_grads[n]) for n, p in model.named_parameters())
    # steering the shortcut's gradient leaves the body's alone
    model.zero_grad()
    with hookplug.attach(model, "*:shortcut", plugins=("gradclamp", {"min": 0, "max": 0})):
        model(x).backward()
    body_only = Residual(nn.Sequential())
    body_only.load_state_dict(model.state_dict())
    (body_only.body(body_only.stem(x)) + 2 * body_only.stem(x).detach()).square().sum().backward()
    assert torch.allclose(model.stem.weight.grad, body_only.stem.weight.grad)


@pytest.mark.parametrize("plugins", ["stats+capture", "gradclamp", "stats+capture, args replaced after"])
def test_a_module_appending_its_new_output_to_a_list_argument_keeps_its_grad_site(plugins):
    """``feats.append(y); return y`` (torchvision's FPN extra blocks append p6/p7, or the
    pooled level, to the list they get): read after ``forward``, ``y`` was among the inputs,
    taken for one passed through: the module returned a view of it (``feats[-1] is y`` no
    longer), its grad site saw only the gradient through the returned value, and gradclamp
    clamped only that part (parameter gradients changed, silently). The inputs are now read
    as the call begins: ``y`` is the module's own, hooked as it is (also where a pre hook
    registered after hookplug's replaces the argument tuple)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, feats):
            y = self.lin(x).tanh()
            feats.append(y)
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.b1, self.b2 = Block(), Block()

        def forward(self, x):
            feats = []
            y = self.b2(self.b1(x, feats), feats)
            return y.sum() + sum(f.square().sum() for f in feats), feats, y

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    ref = Net()
    m = copy.deepcopy(ref)
    seen = {}

    def on_grad(g):
        seen["b1"] = g.clone()
        return g.clamp(-0.1, 0.1) if plugins == "gradclamp" else None

    ref.b1.register_forward_hook(lambda mod, a, out: out.register_hook(on_grad) and None)
    loss, _, _ = ref(x)
    loss.backward()
    spec = ([("stats", {"sites": ("output", "grad")}), ("capture", {"grads": True})] if plugins != "gradclamp"
            else [("gradclamp", {"min": -0.1, "max": 0.1})])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hookplug.attach(m, "*:b1", plugins=spec) as s:
            if "replaced" in plugins:
                m.b1.register_forward_pre_hook(lambda mod, a: (*a,))
            loss, feats, y = m(x)
            assert feats[-1] is y and feats[0] is not None
            loss.backward()
            assert not s._bindings["b1"]._pending  # every call's context taken
    if plugins == "gradclamp":
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
    else:
        assert torch.equal(s["capture"].grads["b1"], seen["b1"])
        st = s["stats"].results()["b1"]["grad"]
        want = seen["b1"].double()
        assert int(st.numel) == want.numel() and math.isclose(float(st.mean), float(want.mean()),
                                                              rel_tol=1e-6, abs_tol=1e-9)


def test_identity_on_a_leaf_input_reports_its_gradient():
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 1))
    x = torch.randn(2, 3, requires_grad=True)
    with hookplug.attach(model, "Identity", plugins=[("capture", {"grads": True}),
                                                    ("stats", {"sites": ("output", "grad")})]) as s:
        out = model(x)
        out.sum().backward()
    assert torch.equal(s["capture"].grads["0"], model[1].weight.expand(2, 3))
    assert int(s["stats"].results()["0"]["grad"].numel) == 6
    assert torch.equal(x.grad, model[1].weight.expand(2, 3).detach())


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_on_a_packed_sequence_with_output_gradients(bidirectional):
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, batch_first=True, bidirectional=bidirectional)
    model = nn.ModuleDict({"lstm": lstm})
    x = torch.randn(3, 6, 4)
    packed = pack_padded_sequence(x, torch.tensor([6, 2, 4]), batch_first=True, enforce_sorted=False)
    ref = {}

    def hook(m, a, out):
        out[0].data.register_hook(lambda g: ref.setdefault("data", g))

    handle = lstm.register_forward_hook(hook)
    out, (h, _) = lstm(packed)
    (out.data.square().sum() + h.sum()).backward()
    handle.remove()
    want = {n: p.grad.clone() for n, p in lstm.named_parameters()}
    lstm.zero_grad()
    plugins = [("capture", {"grads": True}), ("stats", {"sites": ("output", "grad")})]
    with hookplug.attach(model, "LSTM", plugins=plugins) as s:
        out2, (h2, _) = lstm(packed)
        (out2.data.square().sum() + h2.sum()).backward()
    assert torch.equal(out2.data, out.data) and type(out2) is type(out)
    assert all(torch.equal(p.grad, want[n]) for n, p in lstm.named_parameters())
    got = s["capture"].grads["lstm"]
    assert type(got[0]).__name__ == "PackedSequence" and torch.equal(got[0].data, ref["data"])
    assert int(s["stats"].results()["lstm"]["grad[0][0]"].numel) == ref["data"].numel()


def test_transformer_encoder_nested_fast_path_runs_with_flops_and_capture():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 6, 8)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2, 2:] = True
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested linear has no FLOP formula: listed, warned
        with hookplug.attach(enc, "*", plugins=["flops", "capture"]) as s, torch.no_grad():
            got = enc(x, src_key_padding_mask=mask)
            report = s.report()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert s["capture"].features["layers.0.linear1"].is_nested
    assert "nested(3 tensors)" in report


def test_gradclamp_bounds_past_float16_saturate_like_the_comparison():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4)).to(dtype)
        x = torch.randn(2, 4, dtype=dtype)
        with hookplug.attach(m, "Linear", plugins=("gradclamp", {"min": -1e5, "max": 0.5})) as s:
            (m(x) * torch.tensor([[1.0, -1e3, 2.0, 0.1]], dtype=dtype)).sum().backward()
        changed = int(s["gradclamp"].results()["0"]["changed"])
        assert changed == 4, dtype  # the 1.0 and 2.0 columns of both rows; -1e5 clamps nothing
        want = torch.tensor([[0.5, -1e3, 0.5, 0.1]] * 2, dtype=dtype)
        assert torch.equal(m[0].bias.grad, want.sum(0))


def test_gradclamp_leaves_a_sparse_gradient_alone_and_says_so():
    emb = nn.Embedding(10, 3, sparse=True)
    model = nn.Sequential(emb)
    with hookplug.attach(model, "*", plugins=("gradclamp", {"max": 0.0, "params": "*"})):
        with pytest.warns(RuntimeWarning, match="sparse_coo tensor; only strided"):
            model(torch.tensor([1, 2, 2])).sum().backward()
    assert emb.weight.grad.layout == torch.sparse_coo
    assert torch.equal(emb.weight.grad.to_dense()[2], torch.full((3,), 2.0))


def test_gradclamp_leaves_a_complex_gradient_alone_and_says_so():
    """A complex model (``.to(torch.cfloat)``): min/max have no meaning on complex values;
    the gradient is left as it is, with a warning (it was left silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3)).to(torch.cfloat)
    x = torch.randn(2, 3, dtype=torch.cfloat)
    model(x).abs().sum().backward()
    want = model[0].weight.grad.clone()
    model.zero_grad()
    with hookplug.attach(model, "*", plugins=("gradclamp", {"max_norm": 1e-3, "params": "*"})) as s:
        with pytest.warns(RuntimeWarning, match="is torch.complex64; only real floating"):
            model(x).abs().sum().backward()
    assert torch.equal(model[0].weight.grad, want) and s["gradclamp"].results() == {}


def _per_sample_loss():
    """A small model, its detached parameters, a batch and a per-sample loss for
    ``vmap(grad(loss), in_dims=(None, 0))(params, x)``."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 4)

    def loss(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).square().sum()

    return model, params, x, loss


def test_stats_under_vmap_says_what_it_cannot_measure():
    from torch.func import grad, vmap

    model, params, x, loss = _per_sample_loss()

    with hookplug.attach(model, "Linear", plugins="stats") as s:
        with pytest.raises(RuntimeError, match="batched by torch.func"):
            vmap(grad(loss), in_dims=(None, 0))(params, x)
        per_sample_free = grad(loss)(params, x[0])  # grad alone is measured
        assert int(s["stats"].results()["0"]["output"].numel) == 8 and per_sample_free


def test_calls_of_one_module_overlapping_on_two_threads_keep_their_own_context():
    """Thread A enters forward, thread B (an inference_mode server thread) enters and
    leaves, then A leaves: each call's input, output and phase stay together."""
    import threading

    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    class Double(nn.Module):
        def forward(self, x):
            if threading.current_thread().name == "A":
                a_in.set()
                b_in.wait(10)
            else:
                b_in.set()
                a_done.wait(10)
            return x * 2

    model = nn.Sequential(Double())

    def run_a():
        model(torch.full((2,), 1.0))
        a_done.set()

    def run_b():
        a_in.wait(10)
        with torch.inference_mode():
            model(torch.full((2,), 100.0))

    plugins = [("capture", {"inputs": True, "keep": "all"}), ("stats", {"sites": ("input", "output")})]
    with hookplug.attach(model, "*", plugins=plugins) as s:
        threads = [threading.Thread(target=run_a, name="A"), threading.Thread(target=run_b, name="B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    cap = s["capture"]
    pairs = [(float(i[0][0]), float(o[0])) for i, o in zip(cap.inputs["0"], cap.features["0"])]
    assert sorted(pairs) == [(1.0, 2.0), (100.0, 200.0)]
    means = {ph: {k: float(v.mean) for k, v in s["stats"].results(phase=ph)["0"].items()}
             for ph in ("train", "eval")}
    assert means == {"train": {"input[0]": 1.0, "output": 2.0}, "eval": {"input[0]": 100.0, "output": 200.0}}


def test_capture_under_vmap_keeps_nothing_and_says_so():
    from torch.func import grad, vmap

    model, params, x, loss = _per_sample_loss()

    with hookplug.attach(model, "Linear", plugins=("capture", {"grads": True})) as s:
        with pytest.warns(RuntimeWarning, match="batched by torch.func.vmap"):
            vmap(grad(loss), in_dims=(None, 0))(params, x)
        assert s["capture"].features == {} and s["capture"].grads == {}
        out = model(x)  # outside vmap: captured as usual
        assert torch.equal(s["capture"].features["2"], out)


def test_gradclamp_under_vmap_steers_and_keeps_working():
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 8)

    def loss(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).pow(2).sum()

    def clamp_hook(mod, a, out):
        out.register_hook(lambda g: g.clamp(max=0.01))

    handles = [m.register_forward_hook(clamp_hook) for m in (model[0], model[2])]
    want = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for h in handles:
        h.remove()
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"max": 0.01})) as s:
        got = vmap(grad(loss), in_dims=(None, 0))(params, x)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert s["gradclamp"].results() == {}  # vmapped gradients are not counted
        model(x).pow(2).sum().backward()  # the session goes on as usual
        assert int(s["gradclamp"].results()["2"]["changed"]) > 0


def test_gradclamp_under_grad_steers_counts_and_runs_again():
    """The count under ``torch.func.grad`` is a wrapper of the transform: kept as the counter
    it escaped, and the next call's in-place add to it raised (so did a counter made by a
    plain backward before)."""
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 8)

    def loss(p):
        return functional_call(model, p, (x,)).pow(2).sum()

    def clamp_hook(mod, a, out):
        out.register_hook(lambda g: g.clamp(max=0.01))

    handles = [m.register_forward_hook(clamp_hook) for m in (model[0], model[2])]
    want = grad(loss)(params)
    for h in handles:
        h.remove()
    out2 = model(x).detach()
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"max": 0.01})) as s:
        model(x).pow(2).sum().backward()  # a plain counter first
        for _ in range(2):
            got = grad(loss)(params)
            assert all(torch.equal(got[k], want[k]) for k in want)
        changed = s["gradclamp"].results()
    assert int(changed["2"]["changed"]) == 3 * int((2 * out2 > 0.01).sum())
    assert not torch._C._functorch.is_functorch_wrapped_tensor(s["gradclamp"]._changed["2"])


def test_capture_under_grad_keeps_plain_tensors():
    """Captures made inside ``torch.func.grad`` were the transform's TensorWrappers: right
    values, but ``torch.save`` and ``data_ptr()`` refused them."""
    import io

    from torch.func import grad

    model, params, x, loss = _per_sample_loss()
    with hookplug.attach(model, "Linear", plugins=("capture", {"grads": True})) as s:
        grad(loss)(params, x[0])
    feats, grads = s["capture"].features, s["capture"].grads
    for t in list(feats.values()) + list(grads.values()):
        assert not torch._C._functorch.is_functorch_wrapped_tensor(t)
        t.data_ptr()
    torch.save((feats, grads), io.BytesIO())
    assert torch.equal(feats["0"], model[0](x[0].unsqueeze(0)))
    want = torch.func.grad(lambda y: loss_tail(model, y))(model[0](x[0].unsqueeze(0)).detach())
    assert torch.equal(grads["0"], want)


def loss_tail(model, h):
    return model[2](model[1](h)).square().sum()


def test_legacy_batched_gradients_are_treated_like_vmapped_ones():
    """``autograd.grad(is_grads_batched=True)`` and ``jacobian(vectorize=True)`` batch with the
    older BatchedTensor, which ``is_batched`` missed: capture's backward raised, gradclamp
    kept one as its counter (``results()`` raised), stats gave the raw batching error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(4)
    want = torch.autograd.functional.jacobian(model, x, vectorize=False)
    with hookplug.attach(model, "Linear", plugins=("gradclamp", {"min": -10.0, "max": 10.0})) as s:
        got = torch.autograd.functional.jacobian(model, x, vectorize=True)
    torch.testing.assert_close(got, want)
    assert s["gradclamp"].results() == {}
    with hookplug.attach(model, "Linear", plugins=("capture", {"grads": True})) as s:
        xr = x.clone().requires_grad_()
        with pytest.warns(RuntimeWarning, match="batched by torch.func"):
            torch.autograd.grad(model(xr), xr, torch.eye(3), is_grads_batched=True)
        assert s["capture"].grads == {}
    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")})):
        xr = x.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="batched by torch.func"):
            torch.autograd.grad(model(xr), xr, torch.eye(3), is_grads_batched=True)


_GRAD_PLUGINS = [[("stats", {"sites": ("output", "grad")})], [("gradclamp", {"min": -1.0, "max": 1.0})],
                 [("capture", {"grads": True})]]


def _layouts():
    dense = torch.randn(4, 3)
    yield "sparse_coo", lambda: dense.to_sparse().requires_grad_()
    yield "sparse_csr", lambda: dense.to_sparse_csr().requires_grad_()
    if torch.backends.mkldnn.is_available():
        yield "mkldnn", lambda: dense.to_mkldnn().requires_grad_()
    yield "nested_strided", lambda: torch.nested.nested_tensor([dense[:2], dense[2:3]], requires_grad=True)


@pytest.mark.parametrize("plugins", _GRAD_PLUGINS, ids=lambda p: p[0][0])
@pytest.mark.parametrize("layout,make", list(_layouts()), ids=[n for n, _ in _layouts()])
def test_identity_on_a_tensor_without_views_runs_as_without_hooks(layout, make, plugins):
    """A sparse, mkldnn or strided nested tensor passed through ``nn.Identity`` cannot be
    given a view of its own: it is returned as is, with no grad site (the forward raised)."""
    model = nn.Sequential(nn.Identity())
    x = make()
    want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stats: these layouts are skipped, and says so
        with hookplug.attach(model, "*", plugins=plugins) as session:
            got = model(x)
            results = session[plugins[0][0]].results()
    assert got is x and want is x
    if plugins[0][0] == "stats":
        assert "grad" not in results.get("0", {})
    if plugins[0][0] == "capture":
        assert not session["capture"].grads


class _Tagged(list):
    pass


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    x: torch.Tensor
    note: str = dataclasses.field(init=False, default="")


class _ReturnsInputInside(nn.Module):
    """Returns its input ``x`` beside a computed tensor, in a container of ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 3)
        self.cache = []

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "dataclass":
            out = _Out(y, x)
            out.note = "set after construction"
            return out
        if self.kind == "defaultdict":
            out = collections.defaultdict(lambda: torch.zeros(()))
            out["y"], out["x"] = y, x
            return out
        if self.kind == "list_subclass":
            out = _Tagged([y, x])
            out.note = "an attribute"
            return out
        if self.kind == "own_list":
            self.cache[:] = [y, x]
            return self.cache
        return (y, x)  # tuple


@pytest.mark.parametrize("kind", ["dataclass", "defaultdict", "list_subclass", "own_list", "tuple"])
def test_an_input_returned_inside_a_container_keeps_the_container_as_the_module_made_it(kind):
    """Only tuples (and namedtuples, HF ModelOutputs) are rebuilt to give a returned input
    its own view; any other container comes back as the module made it, the input there
    without a grad site. The computed tensor's grad site works in every container."""
    torch.manual_seed(0)
    model = nn.Sequential(_ReturnsInputInside(kind))
    x = torch.randn(2, 3, requires_grad=True)
    with hookplug.attach(model, "*:0", plugins=[("capture", {"grads": True})]) as session:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(x)
            model(x)
        told = [w for w in caught if "has no gradient site there" in str(w.message)]
        assert len(told) == (0 if kind == "tuple" else 1)  # once a module
        assert all(w.filename == __file__ for w in told)
        out = model(x)
        parts = _parts(kind, out)  # (y, the returned x)
        if kind == "dataclass":
            assert out.note == "set after construction"
        elif kind == "defaultdict":
            assert isinstance(out, collections.defaultdict) and out["absent"].shape == ()
        elif kind == "list_subclass":
            assert type(out) is _Tagged and out.note == "an attribute"
        elif kind == "own_list":
            assert out is model[0].cache
        if kind == "tuple":  # rebuilt: x has its own view, and a grad site
            assert parts[1] is not x and parts[1]._base is x
        else:
            assert parts[1] is x
        (parts[0].sum() + 2 * parts[1].sum()).backward()
        gy, gx = _parts(kind, session["capture"].grads["0"])
    assert torch.equal(gy, torch.ones(2, 3))
    if kind == "tuple":
        assert torch.equal(gx, torch.full((2, 3), 2.0))
    else:
        assert gx is None
    assert torch.equal(x.grad, model[0].lin.weight.sum(0).expand(2, 3) + 2)


def _parts(kind, out):
    if kind == "dataclass":
        return out.y, out.x
    if kind == "defaultdict":
        return out["y"], out["x"]
    return out[0], out[1]


def test_an_input_returned_twice_is_one_view_and_both_places_see_the_whole_gradient():
    class Twice(nn.Module):
        def forward(self, x):
            return x, x

    model = nn.Sequential(Twice())
    x = torch.randn(3, requires_grad=True)
    with hookplug.attach(model, "*:0", plugins=[("stats", {"sites": ("grad",)})]) as session:
        a, b = model(x)
        assert a is b and a is not x
        (2 * a + 3 * b).sum().backward()
        grads = session["stats"].results()["0"]
    assert set(grads) == {"grad[0]", "grad[1]"}
    for path in ("grad[0]", "grad[1]"):
        assert float(grads[path].min) == float(grads[path].max) == 5.0
    assert torch.equal(x.grad, torch.full((3,), 5.0))


def test_a_parameter_returned_as_is_stays_the_parameter():
    class PosEmbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 3))

        def forward(self):
            return self.weight

    model = nn.Sequential()
    model.add_module("pos", PosEmbed())
    with hookplug.attach(model, "*:pos", plugins=[("stats", {"sites": ("output", "grad")})]):
        out = model.pos()
        assert out is model.pos.weight
        (3 * out).sum().backward()
    assert torch.equal(model.pos.weight.grad, torch.full((2, 3), 3.0))


def test_an_output_kept_after_remove_keeps_no_hooked_module_alive():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    sub = weakref.ref(model[0])
    with hookplug.attach(model, "*:0", plugins=[("stats", {"sites": ("output", "grad")})]):
        kept = model(torch.randn(2, 3))
    del model
    gc.collect()
    assert sub() is None
    kept.sum().backward()  # the output's hook outlives its module and does nothing


def test_a_packed_sequence_passed_through_identity_keeps_its_grad_site():
    """PackedSequence, a namedtuple subclass with no attributes of its own, is rebuilt with
    a view of its data like a namedtuple: the Identity has a grad site, results unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("i", nn.Identity())
    model.add_module("r", nn.LSTM(3, 4))
    x = torch.randn(5, 2, 3, requires_grad=True)
    packed = pack_padded_sequence(x, torch.tensor([5, 3]))
    out, _ = model.r(model.i(packed))
    out.data.sum().backward()
    want = x.grad.clone()
    x.grad = None
    packed = pack_padded_sequence(x, torch.tensor([5, 3]))
    with hookplug.attach(model, "*:i", plugins=[("stats", {"sites": ("grad",)})]) as s:
        got_packed = model.i(packed)
        assert type(got_packed) is type(packed) and got_packed.data is not packed.data
        out, _ = model.r(got_packed)
        out.data.sum().backward()
        grads = s["stats"].results()["i"]
    assert torch.equal(x.grad, want)
    assert int(grads["grad[0]"].numel) == packed.data.numel()


def test_a_module_graph_with_a_cycle_attaches():
    """A child holding its parent as a submodule (a back reference registered as one):
    named_modules() visits each module once; attach with parameter hooks works. A walk over
    every path never ended (RecursionError)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x)

    model = nn.Sequential(Block(), Block())
    model[1].owner = model
    x = torch.randn(2, 3)
    want = model[1](model[0](x))
    with hookplug.attach(model, "Linear", plugins=["stats", ("gradclamp", {"max": 1.0, "params": "*"})]) as s:
        got = model[1](model[0](x))
        got.sum().backward()
        assert set(s["stats"].results()) == {"0.lin", "1.lin"}
    assert torch.equal(got, want)


def test_ensemble_on_a_meta_base_model_with_parameter_steering():
    """torch.func's ensembling recipe (``stack_module_state``, a base model on ``meta``,
    ``vmap(functional_call)``) with gradclamp ``params=`` on the base: the session waits for
    the base's own Parameters, the substituted tensors are neither hooked nor steered (the
    vmapped forward raised in ``requires_grad_``; a plain call's tensors were steered)."""
    import copy

    from torch.func import functional_call, stack_module_state, vmap

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(3)]
    x = torch.randn(3, 8)
    params, buffers = stack_module_state(models)
    want = torch.stack([m(x) for m in models])
    base = copy.deepcopy(models[0]).to("meta")
    with hookplug.attach(base, "Linear", plugins=("gradclamp", {"min": 0, "params": "*"})) as s:
        got = vmap(lambda p, b, xx: functional_call(base, (p, b), (xx,)), in_dims=(0, 0, None))(
            params, buffers, x)
        torch.testing.assert_close(got, want)  # (vmap's batched matmul: not bitwise)
        for _ in range(2):
            p = {k: v.detach().clone().requires_grad_() for k, v in models[0].named_parameters()}
            ref = {k: v.detach().clone().requires_grad_() for k, v in models[0].named_parameters()}
            functional_call(base, p, (x,)).sum().backward()
            functional_call(models[0], ref, (x,)).sum().backward()
            assert not any(v._backward_hooks for v in p.values())
            assert all(torch.equal(p[k].grad, ref[k].grad) for k in p)
        assert s["gradclamp"].results() == {}
