"""The ``capture`` plugin against values computed without hookplug (layers re-run by hand,
plain torch hooks), plus its options, save/load and memory bound."""

import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookplug
from hookplug import PluginError
from hookplug.models import MLP, resnet34_like
from hookplug.structures import iter_tensors
from hookplug_plugins.capture import CapturePlugin
from conftest import Interruptible


def conv_inputs_by_hand(model, x):
    """Every Conv2d's input (cloned), via a plain forward pre-hook, and the model output."""
    inputs, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach().clone())
                )
            )
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    return inputs, out


def test_every_conv_of_resnet34_equals_layers_run_by_hand():
    model = resnet34_like()
    x = torch.randn(2, 3, 32, 32)
    inputs, out_plain = conv_inputs_by_hand(model, x)
    with hookplug.attach(model, "Conv2d", plugins="capture") as s:
        with torch.no_grad():
            out = model(x)
    feats = s["capture"].features
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert len(feats) == 36 and list(feats) == list(inputs)  # call order, like the seeds' list
    assert set(feats) == set(convs)
    for name, conv in convs.items():
        by_hand = F.conv2d(
            inputs[name],
            conv.weight,
            conv.bias,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
        )
        assert torch.equal(feats[name], by_hand), name
        assert not feats[name].requires_grad
    assert torch.equal(out, out_plain)  # capturing changes nothing


def test_capture_in_training_mode_does_not_change_outputs_or_grads():
    model = resnet34_like()
    x = torch.randn(2, 3, 32, 32)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out0, g0 = step()
    with hookplug.attach(
        model, "Conv2d|BatchNorm2d|ReLU", plugins=("capture", {"grads": True, "keep": "all"})
    ):
        out1, g1 = step()
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


class InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.lin(x))


@pytest.mark.parametrize("clone", [True, False])
def test_clone_protects_against_later_inplace_ops(clone):
    net = InplaceNet()
    x = torch.randn(16, 8)
    with torch.no_grad():
        before = net.lin(x)
    assert (before < 0).any()
    with hookplug.attach(net, "Linear", plugins=("capture", {"clone": clone})) as s:
        with torch.no_grad():
            net(x)
    got = s["capture"].features["lin"]
    if clone:
        assert torch.equal(got, before)
    else:  # a detached view: the in-place ReLU shows through (why clone=True is the default)
        assert torch.equal(got, before.relu())


@pytest.mark.parametrize("to", [None, "cpu"])
def test_captures_made_under_inference_mode_are_ordinary_tensors(to):
    """A feature pass under ``torch.inference_mode``: the copies are made outside it, so a
    capture can train a probe (autograd saves it) and be changed in place afterwards."""
    net = MLP(8, 16, 4)
    x = torch.randn(5, 8)
    with hookplug.attach(net, "Linear", plugins=("capture", {"to": to, "inputs": True, "keep": "all"})) as s:
        with torch.inference_mode():
            net(x)
        net(x)
    cap = s["capture"]
    for got in (cap.features, cap.inputs):
        for name, calls in got.items():
            for t in iter_tensors(calls):
                assert not t[1].is_inference(), name
    first = cap.features["fc1"][0]
    assert torch.equal(first, net.fc1(x).detach())
    probe = torch.ones(first.shape[-1], requires_grad=True)
    (first * probe).sum().backward()  # saved for backward: refused for an inference tensor
    assert torch.equal(probe.grad, first.sum(0))
    first.mul_(2)  # refused for an inference tensor outside inference mode


def test_inputs_are_read_before_forward():
    net = InplaceNet()
    x = torch.randn(4, 8)
    with hookplug.attach(net, "ReLU", plugins=("capture", {"inputs": True})) as s:
        with torch.no_grad():
            net(x)
    inp = s["capture"].inputs["act"]
    with torch.no_grad():
        pre = net.lin(x)
    assert isinstance(inp, tuple) and len(inp) == 1
    assert torch.equal(inp[0], pre)  # not the in-place-modified tensor
    assert torch.equal(s["capture"].features["act"], pre.relu())


def hand_outputs(model, cls=nn.Linear):
    seen, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, cls):
            handles.append(
                m.register_forward_hook(
                    lambda mod, inp, out, name=name: seen.setdefault(name, []).append(
                        out.detach().clone()
                    )
                )
            )
    return seen, handles


@pytest.mark.parametrize("keep", ["last", "all", 4, 1])
def test_keep_modes(keep):
    model = MLP()  # fc2 runs twice per forward
    xs = [torch.randn(3, 32) for _ in range(3)]
    seen, handles = hand_outputs(model)
    with hookplug.attach(model, "Linear", plugins=("capture", {"keep": keep})) as s:
        for x in xs:
            model(x)
    for h in handles:
        h.remove()
    feats = s["capture"].features
    for name, outs in seen.items():
        if keep == "last":
            assert torch.equal(feats[name], outs[-1])
        else:
            want = outs if keep == "all" else outs[-keep:]
            assert isinstance(feats[name], list) and len(feats[name]) == len(want)
            assert all(torch.equal(a, b) for a, b in zip(feats[name], want))
    assert s["capture"].nbytes == sum(
        t.numel() * t.element_size()
        for v in feats.values()
        for t in (v if isinstance(v, list) else [v])
    )


def test_to_cpu_copies_on_cpu():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    out_ref = []
    h = lin.register_forward_hook(lambda m, i, o: out_ref.append(o))
    with hookplug.attach(lin, "*:", plugins=("capture", {"to": "cpu", "clone": False})) as s:
        lin(x)
    h.remove()
    got = s["capture"].features[""]
    assert torch.equal(got, out_ref[0]) and got.data_ptr() != out_ref[0].data_ptr()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_cpu_from_cuda_is_pinned_and_correct():
    model = resnet34_like().cuda()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    inputs, _ = conv_inputs_by_hand(model, x)
    with hookplug.attach(model, "Conv2d", plugins=("capture", {"to": "cpu"})) as s:
        with torch.no_grad():
            model(x)
    feats = s["capture"].features  # waits for the copies
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            assert feats[name].device.type == "cpu" and feats[name].is_pinned()
            assert torch.equal(feats[name], m(inputs[name]).cpu())


def test_max_bytes_bounds_memory_and_warns_once():
    model = resnet34_like()
    x = torch.randn(2, 3, 32, 32)
    with hookplug.attach(model, "Conv2d", plugins="capture") as s:
        with torch.no_grad():
            model(x)
    total = s["capture"].nbytes
    budget = total // 3
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with hookplug.attach(
            model, "Conv2d", plugins=("capture", {"max_bytes": budget, "keep": "all"})
        ) as s2:
            with torch.no_grad():
                for _ in range(2):
                    model(x)
    cap = s2["capture"]
    assert [str(x.message).count("max_bytes") for x in w if "capture" in str(x.message)] == [1]
    assert 0 < cap.nbytes <= budget and cap.skipped > 0
    for name, lst in cap.features.items():  # what was kept is right
        for t in lst:
            assert torch.equal(t, s["capture"].features[name])


def test_grads_equal_true_output_gradients(true_output_grads):
    model = MLP()
    x = torch.randn(5, 32)
    true = true_output_grads(model, nn.Linear)
    with hookplug.attach(model, "Linear", plugins=("capture", {"grads": True, "keep": "all"})) as s:
        model(x).pow(2).sum().backward()
    grads = s["capture"].grads
    assert set(grads) == {"fc1", "fc2", "fc3"}
    # backward sees fc2's second call first; the list is in forward-call order
    assert len(grads["fc2"]) == 2
    assert torch.equal(grads["fc2"][0], true["fc2"][1]) and torch.equal(
        grads["fc2"][1], true["fc2"][0]
    )
    assert torch.equal(grads["fc1"][0], true["fc1"][0]) and torch.equal(
        grads["fc3"][0], true["fc3"][0]
    )
    for name in grads:  # same shape as the activation, for Linear and Conv alike
        assert all(g.shape == f.shape for g, f in zip(grads[name], s["capture"].features[name]))

    true.clear()
    with hookplug.attach(model, "Linear", plugins=("capture", {"grads": True})) as s:
        model(x).pow(2).sum().backward()
    last = s["capture"].grads  # keep="last": the gradient of the last call, like features
    assert torch.equal(last["fc2"], true["fc2"][0]) and not torch.equal(last["fc2"], true["fc2"][1])
    assert torch.equal(last["fc1"], true["fc1"][0])


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "n"


class Structured(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        a = self.lin(x)
        b = a.tanh()
        if self.kind == "tuple":
            return a, (b, a.argmax(-1))
        if self.kind == "dict":
            return {"logits": a, "extra": {"b": b}}
        return Out(a, b)


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_structured_outputs_mirrored_and_grads(kind):
    m = nn.Sequential(Structured(kind))
    x = torch.randn(3, 6)
    with hookplug.attach(m, "Structured", plugins=("capture", {"grads": True})) as s:
        out = m(x)
        a = out[0] if kind == "tuple" else (out["logits"] if kind == "dict" else out.logits)
        a.sum().backward()  # only the first output gets a gradient
    feat = s["capture"].features["0"]
    grad = s["capture"].grads["0"]
    assert type(feat) is type(out)
    leaves_out = list(hookplug.structures.iter_tensors(out))
    leaves_feat = list(hookplug.structures.iter_tensors(feat))
    assert [p for p, _ in leaves_feat] == [p for p, _ in leaves_out]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(leaves_feat, leaves_out))
    assert type(grad) is type(out)
    g_leaves = [t for _, t in hookplug.structures.iter_tensors(grad)]
    assert len(g_leaves) == 1 and torch.equal(g_leaves[0], torch.ones_like(a))
    if kind == "tuple":
        assert grad[1][0] is None and grad[1][1] is None
    elif kind == "dataclass":
        assert grad.hidden is None and grad.note == "n"


def test_save_and_load_roundtrip(tmp_path):
    model = MLP()
    xs = [torch.randn(2, 32) for _ in range(2)]
    m2 = nn.Sequential(Structured("dict"), Structured("dataclass"))
    with hookplug.attach(
        model, "Linear", plugins=("capture", {"keep": "all", "grads": True, "inputs": True})
    ) as s:
        for x in xs:
            model(x).sum().backward()
    with hookplug.attach(m2, "Structured", plugins="capture") as s2:
        m2[1](m2[0](torch.randn(2, 6))["logits"])
    p1, p2 = tmp_path / "mlp.safetensors", tmp_path / "structured.safetensors"
    s["capture"].save(p1)
    s2["capture"].save(p2)

    from safetensors import safe_open

    with safe_open(str(p1), framework="pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["hookplug.capture"])
    assert {"fc1/0/output", "fc2/3/output", "fc1/1/grad", "fc3/0/input[0]"} <= keys
    assert meta["format"] == "hookplug.capture" and meta["keep"] == "all"
    assert b"pickle" not in p1.read_bytes()[:64]

    everything = hookplug.load_capture(p1, what="all")
    for kind in ("features", "grads", "inputs"):
        orig = getattr(s["capture"], kind)
        back = everything[kind]
        assert back.keys() == orig.keys()
        for name in orig:
            assert len(back[name]) == len(orig[name])
            for a, b in zip(back[name], orig[name]):
                la, lb = (
                    list(hookplug.structures.iter_tensors(a)),
                    list(hookplug.structures.iter_tensors(b)),
                )
                assert [p for p, _ in la] == [p for p, _ in lb]
                assert all(torch.equal(t, u) for (_, t), (_, u) in zip(la, lb))
    assert isinstance(everything["inputs"]["fc1"][0], tuple)

    back2 = hookplug.load_capture(p2)
    assert set(back2["0"]) == {"logits", "extra"} and torch.equal(
        back2["0"]["extra"]["b"], s2["capture"].features["0"]["extra"]["b"]
    )
    assert isinstance(back2["1"], dict) and back2["1"]["note"] == "n"  # dataclass -> dict
    assert torch.equal(back2["1"]["hidden"], s2["capture"].features["1"].hidden)


def test_save_single_key_names_and_shared_storage(tmp_path):
    model = resnet34_like()
    with hookplug.attach(model, "Conv2d", plugins=("capture", {"clone": False})) as s:
        with torch.no_grad():
            model(torch.randn(2, 3, 32, 32))
    p = tmp_path / "c.safetensors"
    s["capture"].save(p)
    back = hookplug.load_capture(p)
    assert "layer1.0.conv1" in back and len(back) == 36
    assert all(torch.equal(back[k], v) for k, v in s["capture"].features.items())


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "plain.safetensors"
    save_file({"a": torch.zeros(2)}, str(p))
    with pytest.raises(ValueError, match="not a hookplug capture"):
        hookplug.load_capture(p)
    with pytest.raises(ValueError, match="what"):
        hookplug.load_capture(p, what="weights")


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"keep": 0}, "keep"),
        ({"keep": "first"}, "keep"),
        ({"to": "cuda"}, "to"),
        ({"max_bytes": -1}, "max_bytes"),
        ({"clone": "yes"}, "clone"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(PluginError, match=match):
        hookplug.attach(MLP(), "Linear", plugins=("capture", opts))


def test_report_reset_results():
    model = MLP()
    with hookplug.attach(model, "Linear", plugins=("capture", {"keep": 2})) as s:
        model(torch.randn(2, 32))
    text = s.report()
    assert "== capture ==" in text and "fc2 x2" in text and "(2, 64)" in text and "float32" in text
    assert s["capture"].results() is s["capture"].features
    s["capture"].reset()
    assert s["capture"].features == {} and s["capture"].nbytes == 0


# -- gradient parts of structured outputs are bounded -----------------------------------------


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y, y * 2


@pytest.mark.parametrize("keep", ["all", 2, "last"])
def test_grads_and_inputs_go_call_by_call_with_features_when_some_calls_get_no_gradient(keep, tmp_path):
    """Evaluation between training steps: calls 0 and 2 run without autograd, 1 and 3 get a
    gradient. ``grads[m][i]`` is the gradient of the call of ``features[m][i]`` (None for an
    evaluation call), in memory and in the saved file (the lists were shorter and paired
    call 0's output with call 1's gradient; keep=2 kept call 1's gradient beside calls 2
    and 3; keep="last" showed the training gradient beside the evaluation output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    opts = {"keep": keep, "grads": True, "inputs": True}
    with hookplug.attach(model, "Linear", plugins=("capture", opts)) as s:
        for i in range(4):
            x = torch.full((1, 3), float(i + 1))
            if i % 2 == 0:
                with torch.no_grad():
                    model(x)
            else:
                (model(x).sum() * (i + 1)).backward()
        cap = s["capture"]
        feats, grads, inputs = cap.features["0"], cap.grads.get("0"), cap.inputs["0"]
        path = tmp_path / "cap.safetensors"
        cap.save(path)
    kept = {"all": [0, 1, 2, 3], 2: [2, 3], "last": [3]}[keep]
    want_grads = [None if c % 2 == 0 else torch.full((1, 2), float(c + 1)) for c in kept]
    if keep == "last":
        feats, grads, inputs = [feats], [grads], [inputs]
    assert [float(f.detach().sum() - model[0].bias.sum()) for f in feats] == pytest.approx(
        [float(model[0].weight.sum()) * (c + 1) for c in kept], rel=1e-5)
    assert len(grads) == len(feats) == len(inputs) == len(kept)
    for got, want in zip(grads, want_grads):
        assert (got is None) if want is None else torch.equal(got, want)
    assert [float(a[0][0, 0]) for a in inputs] == [c + 1.0 for c in kept]
    back = hookplug.load_capture(path, what="all")
    saved = back["grads"].get("0") if keep != "last" else [back["grads"].get("0")]
    for got, want in zip(saved, want_grads):
        assert (got is None) if want is None else torch.equal(got, want)
    if keep == "last":  # an evaluation call last: no gradient of it, not the one before
        with hookplug.attach(model, "Linear", plugins=("capture", opts)) as s:
            (model(torch.ones(1, 3)).sum() * 5).backward()
            assert torch.equal(s["capture"].grads["0"], torch.full((1, 2), 5.0))
            with torch.no_grad():
                model(torch.ones(1, 3))
            assert "0" not in s["capture"].grads and s["capture"].nbytes == 2 * 4 + 3 * 4



def test_grads_has_no_entry_for_a_module_whose_kept_calls_got_no_gradient():
    """Inference only (``generate`` under ``no_grad``) with ``grads=True`` and a list
    ``keep``: ``features`` holds every call, ``grads`` has no entry for those modules (as
    documented; a module with one call that got a gradient gets its aligned list)."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    with hookplug.attach(model, "Linear", plugins=("capture", {"keep": "all", "grads": True})) as s:
        with torch.no_grad():
            for _ in range(2):
                model(torch.ones(1, 3))
        cap = s["capture"]
        assert {m: len(v) for m, v in cap.features.items()} == {"0": 2, "1": 2}
        assert cap.grads == {}
        model(torch.ones(1, 3))[0, 0].backward()
        assert {m: [g is None for g in v] for m, v in cap.grads.items()} == {"0": [True, True, False],
                                                                             "1": [True, True, False]}


def _held_part_bytes(cap):
    return sum(t.numel() * t.element_size() for parts in cap._grad_parts.values() for t in parts.values())


@pytest.mark.parametrize("keep", ["last", 3])
def test_grads_of_tuple_outputs_do_not_pile_up(keep):
    """Every call's gradient copies used to stay in _grad_parts after a newer call replaced
    them (26 MB held for a 10 MB max_bytes); now what is held is what nbytes counts."""
    m = nn.Sequential(TwoOut())
    xs = [torch.randn(8, 16) for _ in range(50)]
    opts = {"grads": True, "keep": keep, "max_bytes": 10_000_000}
    with hookplug.attach(m, "TwoOut", plugins=("capture", opts)) as s:
        for x in xs:
            a, b = m(x)
            (a.sum() + 3 * b.sum()).backward()
        cap = s["capture"]
        n = 1 if keep == "last" else keep
        assert len(cap._grad_parts) == n and len(cap._skeletons) == n
        assert _held_part_bytes(cap) == 2 * n * 8 * 16 * 4
        assert cap.nbytes == 2 * (2 * n * 8 * 16 * 4)  # features + grads, parts counted once
    grads = cap.grads["0"]
    last = grads if keep == "last" else grads[-1]
    # the hook on output[0] (y) sees all of y's gradient: 1 + 3 * 2
    assert torch.equal(last[0], torch.full((8, 16), 7.0))
    assert torch.equal(last[1], torch.full((8, 16), 3.0))


def test_late_gradient_of_an_older_call_leaves_nothing_behind():
    m = TwoOut()
    with hookplug.attach(m, "*:", plugins=("capture", {"grads": True})) as s:
        a0, b0 = m(torch.randn(2, 16))
        a1, b1 = m(torch.randn(2, 16))
        (a1.sum() + b1.sum()).backward()  # call 1 first
        (a0.sum() + b0.sum()).backward()  # then call 0: older than the kept one, not kept
        cap = s["capture"]
        assert list(cap._grad_parts) == [("", 1)] and list(cap._skeletons) == [("", 1)]
        assert _held_part_bytes(cap) == 2 * 2 * 16 * 4


def test_no_skeletons_without_gradients():
    m = TwoOut()
    with hookplug.attach(m, "*:", plugins=("capture", {"grads": True})) as s, torch.no_grad():
        for _ in range(10):
            m(torch.randn(2, 16))
        assert not s["capture"]._skeletons


# -- nested tensors, failing forward ---------------------------------------------------------------


def _nested_encoder():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    return enc, x, mask


def test_nested_tensors_captured_and_left_out_of_save_with_a_warning(tmp_path):
    pytest.importorskip("safetensors")
    enc, x, mask = _nested_encoder()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype")
        with torch.no_grad(), hookplug.attach(
            enc, "TransformerEncoderLayer, *:", plugins=("capture", {"to": "cpu"})
        ) as s:
            y = enc(x, src_key_padding_mask=mask)
    feats = s["capture"].features
    assert feats["layers.0"].is_nested and feats["layers.1"].is_nested
    assert [tuple(u.shape) for u in feats["layers.1"].unbind()] == [(5, 16), (3, 16)]
    path = tmp_path / "cap.safetensors"
    with pytest.warns(RuntimeWarning, match=r"left out 2 tensor.*layers\.0/output \(nested\)"):
        s["capture"].save(path)
    back = hookplug.load_capture(path)
    assert back["layers.0"] is None and back["layers.1"] is None
    assert not y.is_nested and torch.equal(back[""], y)  # the dense output is written


def test_sparse_tensor_left_out_of_save(tmp_path):
    pytest.importorskip("safetensors")

    class Sp(nn.Module):
        def forward(self, x):
            return x.to_sparse(), x + 1

    m = Sp()
    x = torch.randn(2, 3)
    with hookplug.attach(m, "*:", plugins=("capture", {"keep": "all"})) as s:
        m(x)
    path = tmp_path / "sp.safetensors"
    with pytest.warns(RuntimeWarning, match=r"<root>/output\[0\] \(sparse_coo\)"):
        s["capture"].save(path)
    back = hookplug.load_capture(path)
    assert back[""][0][0] is None and torch.equal(back[""][0][1], x + 1)


def test_forward_that_raises_keeps_the_last_capture():
    class Flaky(nn.Module):
        fail = False

        def forward(self, x):
            if self.fail:
                raise ValueError("boom in forward")
            return x * 2, x + 1

    m = Flaky()
    x = torch.randn(2, 3, requires_grad=True)
    with hookplug.attach(m, "*:", plugins=("capture", {"grads": True, "inputs": True})) as s:
        m(x)
        m.fail = True
        with pytest.raises(ValueError, match="boom in forward"):
            m(x * 3)
    assert not s.disabled
    feat = s["capture"].features[""]
    assert torch.equal(feat[0], x.detach() * 2) and torch.equal(feat[1], x.detach() + 1)
    # the raised call's inputs were dropped again and the kept call's are back (they were
    # lost: no inputs entry beside the features held)
    assert torch.equal(s["capture"].inputs[""][0], x.detach())
    assert s["capture"].nbytes == sum(t.numel() * t.element_size() for t in (*feat, x))


@pytest.mark.parametrize("keep", ["all", 2])
def test_inputs_and_features_stay_call_by_call_alike_when_a_forward_raises(keep):
    class Flaky(nn.Module):
        def forward(self, x):
            if torch.isnan(x).any():
                raise ValueError("NaN in the batch")
            return x * 2

    m = nn.Sequential(nn.Linear(3, 3), Flaky())
    xs = [torch.randn(2, 3), torch.full((2, 3), float("nan")), torch.randn(2, 3)]
    with hookplug.attach(m, "Flaky", plugins=("capture", {"keep": keep, "inputs": True})) as s:
        for x in xs:
            try:
                m(x)
            except ValueError:
                pass
    cap = s["capture"]
    ins, feats = cap.inputs["1"], cap.features["1"]
    assert len(ins) == len(feats) == 2
    for (inp,), out in zip(ins, feats):
        assert torch.equal(out, inp * 2)
    assert cap.nbytes == sum(t.numel() * t.element_size() for t in (*feats, *(i for (i,) in ins)))


def test_none_returned_while_the_caller_handles_an_exception_is_captured():
    """A module returning None, called from the caller's own ``except`` block (a retry): it
    did not raise, so the call is captured (the exception being handled is not its own)."""
    class Sink(nn.Module):
        def forward(self, x):
            return None

    m = nn.Sequential(Sink())
    x = torch.randn(2, 3)
    with hookplug.attach(m, "Sink", plugins=("capture", {"keep": "all", "inputs": True})) as s:
        m(x)
        try:
            raise ValueError("first attempt failed")
        except ValueError:
            m(x + 1)
    assert s["capture"].features["0"] == [None, None]
    assert [torch.equal(i, v) for (i,), v in zip(s["capture"].inputs["0"], (x, x + 1))] == [True, True]


def test_max_bytes_budget_of_one_step_keeps_refreshing_nested_captures():
    """keep="last" under a budget that fits exactly one step: the next steps replace every
    capture (inputs of an outer module included) and skip none."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    xs = [torch.randn(3, 4) for _ in range(3)]
    with hookplug.attach(m, "*", plugins=("capture", {"inputs": True})) as s:
        m(xs[0])
    budget = s["capture"].nbytes
    with hookplug.attach(m, "*", plugins=("capture", {"inputs": True, "max_bytes": budget})) as s:
        for x in xs:
            y = m(x)
    cap = s["capture"]
    assert cap.skipped == 0 and cap.nbytes == budget
    assert torch.equal(cap.features["0.0"], m[0][0](xs[-1]).detach()) and torch.equal(cap.features["0"], y.detach())


def test_a_module_returning_none_is_captured_as_none(tmp_path):
    class Sink(nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, x):
            self.seen.append(x.sum().item())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.sink = nn.Linear(3, 3), Sink()

        def forward(self, x):
            y = self.lin(x)
            self.sink(y)
            return y

    net = Net()
    x = torch.randn(4, 3)
    with hookplug.attach(net, "Sink", plugins=("capture", {"keep": "all", "inputs": True})) as s:
        y1 = net(x)
        y2 = net(x + 1)
    cap = s["capture"]
    assert cap.features["sink"] == [None, None]
    assert [torch.equal(i, y.detach()) for (i,), y in zip(cap.inputs["sink"], (y1, y2))] == [True, True]
    assert "sink" in s.report()
    path = tmp_path / "none.safetensors"
    cap.save(path)
    back = hookplug.load_capture(path, what="all")
    assert back["features"]["sink"] == [None, None]
    assert [torch.equal(i, y.detach()) for (i,), y in zip(back["inputs"]["sink"], (y1, y2))] == [True, True]


@pytest.mark.parametrize("keep", ["last", "all"])
def test_compiled_model_captures_what_eager_captures(keep):
    """capture is not traceable: under torch.compile its hooks run outside the graph with
    eager contexts, so a module called twice a forward (MLP's fc2) keeps the right call's
    output, input and gradient, call indices included."""
    torch._dynamo.reset()
    got = {}
    for compiled in (False, True):
        torch.manual_seed(1)
        model = MLP(8, 16, 4)
        opts = {"keep": keep, "grads": True, "inputs": True}
        with hookplug.attach(model, "Linear", plugins=("capture", opts)) as s:
            run = torch.compile(model, backend="aot_eager") if compiled else model
            for i in range(3):
                model.zero_grad()
                run(torch.linspace(-1, 1, 40).reshape(5, 8) * (i + 1)).square().sum().backward()
                s.step()
        cap = s["capture"]
        got[compiled] = (cap.features, cap.grads, cap.inputs, cap._calls)
    for what in range(3):  # features, grads, inputs: the same paths and values
        eager, comp = got[False][what], got[True][what]
        assert eager.keys() == comp.keys()
        for name in eager:
            te, tc = list(iter_tensors(eager[name])), list(iter_tensors(comp[name]))
            assert [p for p, _ in te] == [p for p, _ in tc] and te
            assert all(torch.allclose(a, b, atol=1e-6) for (_, a), (_, b) in zip(te, tc))
    assert got[False][3] == got[True][3]  # the call indices kept
    torch._dynamo.reset()


def test_compiled_after_attach_in_a_fresh_process_counts_calls(fresh_python):
    """Attached before torch._dynamo was imported (attach does not import it), then
    compiled: the hooks still run outside the graph, every call counted."""
    last = fresh_python(
        "import sys, torch, hookplug\n"
        "from hookplug.models import MLP\n"
        "model = MLP(8, 16, 4)\n"
        "s = hookplug.attach(model, 'Linear', plugins=('capture', {'keep': 'all'}))\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "run = torch.compile(model, backend='eager')\n"
        "for _ in range(3):\n"
        "    run(torch.randn(2, 8))\n"
        "print(s['capture']._calls['features'])\n")
    assert last == "{'fc1': [0, 1, 2], 'fc2': [0, 1, 2, 3, 4, 5], 'fc3': [0, 1, 2]}"


def test_save_keeps_tensors_whose_paths_read_alike(tmp_path):
    # {"a.b": x, "a": {"b": y}}: both tensors' paths read "output.a.b" once (now
    # "output['a.b']"); the file held one tensor under that key and both loaded back as y
    pytest.importorskip("safetensors")

    class Dotted(nn.Module):
        def forward(self, x):
            return {"a.b": x, "a": {"b": x + 1}}

    m = nn.Sequential(Dotted())
    x = torch.zeros(3)
    with hookplug.attach(m, "*:0", plugins=("capture", {"keep": "all"})) as s:
        m(x)
    path = tmp_path / "dotted.safetensors"
    s["capture"].save(path)
    back = hookplug.load_capture(path)["0"][0]
    assert torch.equal(back["a.b"], x) and torch.equal(back["a"]["b"], x + 1)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_nbytes_of_a_sparse_capture_is_what_it_holds(layout):
    # a sparse tensor was counted at its dense size (numel * element_size): a (10^5, 10^5)
    # tensor of two values was 40 GB in nbytes, and max_bytes=1 MiB skipped it
    class Sp(nn.Module):
        def forward(self, x):
            return x

    idx, vals = torch.tensor([[0, 5], [1, 7]]), torch.tensor([1.0, 2.0])
    sp = torch.sparse_coo_tensor(idx, vals, (100_000, 100_000)).coalesce()
    if layout == "csr":
        sp = sp.to_sparse_csr()
        parts = (sp.crow_indices(), sp.col_indices(), sp.values())
    else:
        parts = (sp.indices(), sp.values())
    held = sum(p.numel() * p.element_size() for p in parts)
    m = nn.Sequential(Sp())
    with hookplug.attach(m, "*:0", plugins=("capture", {"max_bytes": 2**20})) as s:
        m(sp)
    cap = s["capture"]
    assert cap.skipped == 0 and cap.features["0"].layout == sp.layout
    assert cap.nbytes == held


def test_meta_and_complex_captures_run_and_save(tmp_path):
    # a model run on the meta device (shapes only) raised in its forward with to="cpu"
    # ("Cannot copy out of meta tensor"), and save() raised on a meta tensor
    # (NotImplementedError): it is left out with the warning nested and sparse tensors get;
    # complex dtypes safetensors lacks (complex32/complex128, a KeyError there) are written
    # as real views and load back as they were, conjugated and strided ones too
    pytest.importorskip("safetensors")

    class Id(nn.Module):
        def forward(self, x):
            return x * 1

    m = nn.Sequential(Id())
    with hookplug.attach(m, "*:0", plugins=("capture", {"to": "cpu"})) as s:
        y = m(torch.randn(2, 3, device="meta"))
    cap = s["capture"]
    assert y.is_meta and cap.features["0"].is_meta and cap.features["0"].shape == (2, 3)
    assert cap.nbytes == 0
    with pytest.warns(RuntimeWarning, match=r"0/output \(meta\)"):
        cap.save(tmp_path / "meta.safetensors")
    assert hookplug.load_capture(tmp_path / "meta.safetensors") == {"0": None}

    z = torch.randn(4, 6, dtype=torch.complex128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "ComplexHalf support is experimental"
        sent = [z, z.to(torch.complex64), z.conj(), z.t()[::2], z.to(torch.complex32)]
    ident = nn.Sequential(nn.Identity())
    with hookplug.attach(ident, "*:0", plugins=("capture", {"keep": "all"})) as s:
        for x in sent:
            ident(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s["capture"].save(tmp_path / "complex.safetensors")
    back = hookplug.load_capture(tmp_path / "complex.safetensors")["0"]
    assert [b.dtype for b in back] == [x.dtype for x in sent]
    for b, x in zip(back, sent):
        assert b.shape == x.shape
        assert torch.equal(torch.view_as_real(b), torch.view_as_real(x.resolve_conj()))
    # a file with no complex128 stays readable by hookplugs that read format 1
    with hookplug.attach(m, "*:0", plugins="capture") as s:
        m(z.to(torch.complex64))
    s["capture"].save(tmp_path / "c64.safetensors")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "c64.safetensors"), framework="pt") as f:
        assert '"version": 1' in f.metadata()["hookplug.capture"]


@pytest.mark.parametrize("keep", [2, "all"])
def test_a_call_over_max_bytes_drops_no_kept_inputs_and_counts_once(keep):
    # keep=2: the inputs of the call that did not fit had already evicted those of the
    # oldest call features still held (inputs[m][0] became None); and a call whose inputs
    # and output both did not fit was counted twice in skipped
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    m = nn.Sequential(Double())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with hookplug.attach(m, "*:0", plugins=("capture", {"keep": keep, "inputs": True,
                                                            "max_bytes": 88})) as s:
            m(torch.ones(4))
            m(torch.full((4,), 2.0))
            m(torch.full((8,), 3.0))  # 64 bytes more: does not fit
    cap = s["capture"]
    assert cap.skipped == 1
    assert [f[0].item() for f in cap.features["0"]] == [2.0, 4.0]
    assert [i[0][0].item() for i in cap.inputs["0"]] == [1.0, 2.0]
    assert cap.nbytes == 64


def test_a_plugin_attached_again_captures_the_call_its_last_session_skipped_at_that_index():
    """The call skipped last (max_bytes) is remembered by module and call index, so that its
    output is not kept once its inputs were not; a second session counts calls from 0 again
    and its call 0 was left out too, though it fit. (The instance starts afresh: its
    ``skipped`` is the second session's.)"""
    m = nn.Sequential(nn.Linear(4, 4))
    plugin = CapturePlugin(inputs=True, max_bytes=100, keep="all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with hookplug.attach(m, "*:0", plugins=plugin):
            m(torch.randn(100, 4))  # call 0: too big
        assert plugin.skipped == 1 and not plugin.features
        x = torch.randn(1, 4)
        with hookplug.attach(m, "*:0", plugins=plugin):
            y = m(x)  # call 0 again: fits
    assert plugin.skipped == 0
    assert torch.equal(plugin.features["0"][0], y.detach()) and torch.equal(plugin.inputs["0"][0][0], x)


def test_report_lists_each_tensors_dtype_beside_its_shape():
    class Mixed(nn.Module):
        def forward(self, x):
            return x.long().sum(1), x > 0, x.to(torch.int8)

    model = nn.Sequential(Mixed())
    with hookplug.attach(model, "*:0", plugins="capture") as s:
        model(torch.randn(3, 5))
    row = next(line for line in s["capture"].report().splitlines() if line.lstrip().startswith("0"))
    assert "(3,), (3, 5), (3, 5)" in row and "int64, bool, int8" in row  # was: bool, int64, int8


def test_grads_of_an_output_holding_a_cache_object_hold_no_live_object():
    # an output holding an object with tensors (an HF cache): each grads value held the live
    # object, its tensors with their autograd graph, outside nbytes and max_bytes; it is the
    # dict features holds, with None where no gradient came
    class Cache:  # no container (as transformers' DynamicCache)
        def __init__(self):
            self.keys = []

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = nn.Linear(3, 3)

        def forward(self, x, cache):
            k = self.k(x)
            cache.keys.append(k)
            return {"h": k * 2, "cache": cache}

    torch.manual_seed(0)
    m = Attn()
    x = torch.randn(2, 3)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one naming Cache
        with hookplug.attach(m, "*:", plugins=("capture", {"grads": True, "keep": "all"})) as s:
            for _ in range(2):
                out = m(x, Cache())
                out["h"].register_hook(lambda g: seen.append(g.clone()))
                (out["h"] ** 2).sum().backward()
    cap = s["capture"]
    assert len(cap.grads[""]) == len(seen) == 2
    for g, f, ref in zip(cap.grads[""], cap.features[""], seen):
        assert torch.equal(g["h"], ref)
        assert g["cache"] == {"keys": [None]} and torch.equal(f["cache"]["keys"][0], f["h"] / 2)
    held = [t for v in (cap.features[""], cap.grads[""]) for _, t in iter_tensors(v)]
    assert not any(t.requires_grad or t.grad_fn is not None for t in held)
    assert cap.nbytes == sum(t.numel() * t.element_size() for t in held)


def test_keep_last_call_over_max_bytes_keeps_the_kept_calls_inputs():
    # keep="last": the inputs of a call whose output did not fit had replaced those of the
    # call kept and were dropped with it, so features held call 0 and inputs nothing
    class Repeat(nn.Module):
        def forward(self, x, n):
            return x.repeat(n)

    m = nn.Sequential(Repeat())
    args, outs = [], []
    m[0].register_forward_pre_hook(lambda mod, a: args.append(a[0].clone()))
    m[0].register_forward_hook(lambda mod, a, out: outs.append(out.clone()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with hookplug.attach(m, "*:0", plugins=("capture", {"inputs": True, "max_bytes": 40})) as s:
            m[0](torch.ones(4), 1)  # 16 bytes in, 16 out: kept
            m[0](torch.full((4,), 2.0), 4)  # 16 in fit (in place of call 0's), 64 out do not
    cap = s["capture"]
    assert len(args) == len(outs) == 2 and cap.skipped == 1
    assert torch.equal(cap.features["0"], outs[0])
    assert torch.equal(cap.inputs["0"][0], args[0]) and cap.inputs["0"][1] == 1
    assert cap.nbytes == 32


@pytest.mark.parametrize("keep", [1, 2])
def test_keep_n_with_inputs_and_grads_under_a_budget_of_n_steps_keeps_the_last_n(keep):
    # a budget that fits exactly N steps: the inputs of step N + 1 did not fit beside the N
    # calls kept (those of the oldest, dropped once its output is kept, were not credited),
    # so every later call was skipped and features held the first N steps
    torch.manual_seed(0)
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    xs = [torch.randn(3, 4) for _ in range(5)]
    names = ["0", "0.0", "0.1"]
    ref = {n: {"in": [], "out": [], "grad": []} for n in names}
    for n in names:  # plain torch hooks: every call's input, output and output gradient
        mod = m.get_submodule(n)
        mod.register_forward_pre_hook(
            lambda mod, a, n=n: ref[n]["in"].append(a[0].detach().clone()))

        def fwd(mod, a, out, n=n):
            ref[n]["out"].append(out.detach().clone())
            out.register_hook(lambda g: ref[n]["grad"].append(g.clone()))

        mod.register_forward_hook(fwd)
    opts = {"keep": keep, "inputs": True, "grads": True}
    held = sum(t.numel() * t.element_size()
               for n in names for k in ("in", "out") for t in ref[n][k])
    with hookplug.attach(m, "*", plugins=("capture", opts)):
        for x in xs[:keep]:
            m(x).sum().backward()
    budget = sum(t.numel() * t.element_size() for n in names for v in ref[n].values() for t in v)
    assert budget > held  # (the gradients counted too)
    for v in ref.values():
        for lst in v.values():
            lst.clear()
    with hookplug.attach(m, "*", plugins=("capture", {**opts, "max_bytes": budget})) as s:
        for x in xs:
            m(x).sum().backward()
    cap = s["capture"]
    assert cap.skipped == 0 and cap.nbytes == budget
    for n in names:
        assert len(cap.features[n]) == keep
        for got, want in zip(cap.features[n], ref[n]["out"][-keep:]):
            assert torch.equal(got, want)
        for (got,), want in zip(cap.inputs[n], ref[n]["in"][-keep:]):
            assert torch.equal(got, want)
        for got, want in zip(cap.grads[n], ref[n]["grad"][-keep:]):
            assert torch.equal(got, want)


def test_save_resolves_lazy_conj_and_neg_views(tmp_path):
    # clone=False keeps a module's conj view as it is; save() wrote the storage of a complex64
    # one as it lies (only complex32/128 were resolved), so it loaded back conjugated again
    pytest.importorskip("safetensors")

    class Conj(nn.Module):
        def forward(self, z):
            return z.conj()

    class Imag(nn.Module):
        def forward(self, z):
            return z.conj().imag  # a neg view

    m = nn.Sequential(Conj(), Imag())
    z = torch.complex(torch.randn(3, 2), torch.randn(3, 2))
    outs = {}
    for name in ("0", "1"):
        def hook(mod, a, out, name=name):
            outs[name] = out.resolve_conj().resolve_neg().clone()

        m.get_submodule(name).register_forward_hook(hook)
    with hookplug.attach(m, "Conj, Imag", plugins=("capture", {"clone": False})) as s:
        for x in (z, z.to(torch.complex128)):
            outs.clear()
            m[1](m[0](x).conj())
            assert s["capture"].features["0"].is_conj()
            s["capture"].save(tmp_path / "conj.safetensors")
            back = hookplug.load_capture(tmp_path / "conj.safetensors")
            assert back["0"].dtype == x.dtype and torch.equal(back["0"], outs["0"])
            assert torch.equal(back["1"], outs["1"]) and torch.equal(back["1"], -x.imag)


def test_skipped_counts_each_call_not_captured_once():
    # gradient parts of a tuple output interleaving with another module's gradient counted
    # the call again, and a refused gradient counted a call whose output was kept: 3 calls
    # skipped of 2 that ran, both captured
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Identity()

        def forward(self, x):
            y1 = x * 2  # part [0]'s node: made first, its backward runs last
            y2 = self.b(x * 5) * 3  # b's node in between
            return y1, y2

    net = Pair()
    outs = {}
    for name in ("", "b"):
        def hook(mod, a, out, name=name):
            outs[name] = [t.detach().clone() for _, t in iter_tensors(out)]

        net.get_submodule(name).register_forward_hook(hook)
    x = torch.ones(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # features: 32 + 16 bytes fit, no gradient does
        opts = {"grads": True, "max_bytes": 48}
        with hookplug.attach(net, "*:, *:b", plugins=("capture", opts)) as s:
            y1, y2 = net(x)
            (y1.sum() + y2.sum()).backward()
    cap = s["capture"]
    assert [str(x.message).count("max_bytes") for x in w if "capture" in str(x.message)] == [1]
    assert cap.skipped == 0 and cap.grads == {} and cap.nbytes == 48
    assert len(outs[""]) == 2 and all(torch.equal(a, b) for a, b in zip(cap.features[""], outs[""]))
    assert torch.equal(cap.features["b"], outs["b"][0])

    # a call whose inputs did not fit, then a child's call that did not fit either: the
    # outer call's output was then kept without its inputs, and the two counted as 3 skips
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Identity()

        def forward(self, x):
            return self.inner(x[:8] * 1)[:4] * 1

    m = Outer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # inputs: 64 and 32 bytes, outputs 32 and 16: only the outer output fits alone
        opts = {"inputs": True, "max_bytes": 20}
        with hookplug.attach(m, "*:, *:inner", plugins=("capture", opts)) as s:
            m(torch.randn(16))
    cap = s["capture"]
    assert cap.skipped == 2 and cap.features == {} and cap.inputs == {} and cap.nbytes == 0


@pytest.mark.parametrize("keep", ["last", 2])
def test_calls_stopped_by_ctrl_c_hold_nothing_past_the_step(keep):
    """A KeyboardInterrupt in forward (torch runs no post hook): the inputs the call set
    aside go back at the next session.step(), and nothing is held outside ``nbytes``."""
    plugin = CapturePlugin(keep=keep, inputs=True)
    model = nn.Sequential(Interruptible())
    with hookplug.attach(model, "Interruptible", plugins=plugin) as s:
        model(torch.zeros(100))
        for _ in range(3):
            model[0].interrupted_call(model, torch.ones(100))
            s.step()
        assert not plugin._set_aside and not plugin._refused and not plugin._open
        inputs, features = plugin.inputs["0"], plugin.features["0"]
        kept_inputs = [inputs] if keep == "last" else inputs
        kept_features = [features] if keep == "last" else features
        assert len(kept_inputs) == len(kept_features) == 1 and torch.equal(kept_inputs[0][0], torch.zeros(100))
        assert plugin.nbytes == 2 * 100 * 4


@pytest.mark.parametrize("keep", ["last", 2])
def test_calls_stopped_by_ctrl_c_hold_nothing_past_the_next_call_without_steps(keep):
    """No session.step() at all (serving, forward-only): each call Ctrl-C stopped kept its
    inputs (and what it set aside) for good, 200 calls 200 copies; the module's next call
    drops them. Calls of a module nested in itself keep their inputs."""
    plugin = CapturePlugin(keep=keep, inputs=True)
    model = nn.Sequential(Interruptible())
    with hookplug.attach(model, "Interruptible", plugins=plugin):
        model(torch.zeros(100))
        for i in range(20):
            model[0].interrupted_call(model, torch.ones(100))
            assert len(plugin._open) <= 1 and len(plugin._set_aside) <= 1
            x = torch.full((100,), float(i))
            model[0](x, depth=2)  # three nested calls, each captured whole
            assert not plugin._open and not plugin._set_aside
        inputs, features = plugin.inputs["0"], plugin.features["0"]
        kept = [(inputs, features)] if keep == "last" else list(zip(inputs, features))
        for args, out in kept:  # each call's inputs with its own output
            depth = args[1] if len(args) > 1 else 2  # (the outermost call's depth is a keyword)
            assert torch.equal(out, args[0] * 2 ** depth + 1)
        assert plugin.nbytes == len(kept) * 2 * 100 * 4


def test_grads_of_a_module_nested_in_itself_are_dropped_with_its_calls():
    """keep=2 on a module that calls itself: the inner call ends first, so calls are not
    stored oldest first; the gradient parts of every call no longer kept are dropped."""
    class Recursive(nn.Module):
        def forward(self, x, depth=2):
            y = x * 2
            return (self(y, depth - 1)[0] + 1,) if depth else (y,)

    plugin = CapturePlugin(keep=2, grads=True)
    model = nn.Sequential(Recursive())
    with hookplug.attach(model, "Recursive", plugins=plugin):
        for _ in range(4):
            x = torch.randn(8, requires_grad=True)
            model(x)[0].sum().backward()
        held = {name: set(calls) for name, calls in plugin._skel_calls.items()}
        assert held == {"0": set(plugin._calls["features"]["0"])}


def test_a_step_ended_on_another_thread_keeps_a_running_calls_inputs():
    """session.step() on a timer thread while a forward runs: only the stepping thread's
    unfinished calls are dropped (the running call lost its inputs, and the last step's came
    back in nbytes, not in inputs)."""
    import threading

    started, stepped = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def forward(self, x):
            started.set()
            if threading.current_thread() is not threading.main_thread():
                assert stepped.wait(timeout=60)  # held open until the main thread stepped
            return x * 2

    model = nn.Sequential(Slow())
    plugin = CapturePlugin(inputs=True)
    with hookplug.attach(model, "Slow", plugins=plugin) as s:
        model(torch.zeros(4))
        s.step()
        started.clear()
        x = torch.ones(4)
        worker = threading.Thread(target=model, args=(x,))
        worker.start()
        started.wait()
        s.step()  # while the worker's call runs
        stepped.set()
        worker.join()
        assert torch.equal(plugin.inputs["0"][0], x) and torch.equal(plugin.features["0"], 2 * x)
        assert plugin.nbytes == 2 * 4 * 4


class _Contended:
    """A stand-in for the plugin's lock that tells (``waiting``) when a thread has to wait
    for it: lets a test pause one thread inside a hook and go on once another thread has
    either finished or is blocked behind it, with no sleeps."""

    def __init__(self, waiting):
        import threading

        self._lock, self.waiting = threading.RLock(), waiting

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            self.waiting.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def _held_bytes(plugin):
    return sum(t.numel() * t.element_size() for store in plugin._store.values()
               for v in store.values() for e in (v if isinstance(v, list) else [v])
               for _, t in iter_tensors(e))


@pytest.mark.parametrize("inputs", [False, True])
def test_forwards_on_two_threads_keep_nbytes_to_the_bytes_held(monkeypatch, inputs):
    """Request threads sharing a model (keep=N): a call captured on another thread while
    this one is between reading and writing ``nbytes`` is not lost from it (a drifting
    ``nbytes`` bounds ``max_bytes`` against a wrong number; the kept lists could get out of
    step, an IndexError inside the user's forward)."""
    import sys
    import threading

    from hookplug_plugins import capture

    model = nn.Sequential(nn.Identity())
    plugin = CapturePlugin(keep=2, inputs=inputs, max_bytes=10**6)
    progressed = threading.Event()  # the other thread's call finished, or waits for this one
    plugin._lock = _Contended(progressed)
    nbytes, paused, errors = capture._nbytes, [], []

    def other():
        try:
            model(torch.full((8,), 9.0))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        progressed.set()

    def nbytes_pausing(obj):  # inside `self.nbytes += / -= _nbytes(...)` of this thread's call
        if (threading.current_thread() is threading.main_thread() and len(calls) == 3
                and not paused and sys._getframe(1).f_code.co_name == "_put"):
            paused.append(threading.Thread(target=other))
            paused[0].start()
            assert progressed.wait(timeout=30)
        return nbytes(obj)

    monkeypatch.setattr(capture, "_nbytes", nbytes_pausing)
    calls = []
    with hookplug.attach(model, "Identity", plugins=plugin):
        for i in range(4):
            calls.append(i)
            model(torch.full((4 + i,), float(i)))
        paused[0].join()
        assert not errors
        assert plugin.nbytes == _held_bytes(plugin)
        assert len(plugin.features["0"]) == 2
        if inputs:
            assert all(v is not None for v in plugin.inputs["0"])


def test_report_on_a_monitoring_thread_while_forwards_add_modules(monkeypatch):
    """``session.report()`` while a request thread's forward captures a module not yet held:
    no ``dictionary changed size during iteration``."""
    import threading

    from hookplug_plugins import capture

    model = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    plugin = CapturePlugin()
    progressed = threading.Event()
    plugin._lock = _Contended(progressed)
    shape_text, started = capture._shape_text, []

    def forward_new_module():
        with torch.no_grad():
            model[2](torch.randn(2, 4))
        progressed.set()

    def shape_text_pausing(t):  # a row of report() is being written
        if not started:
            started.append(threading.Thread(target=forward_new_module))
            started[0].start()
            assert progressed.wait(timeout=30)
        return shape_text(t)

    with hookplug.attach(model, "Linear", plugins=plugin) as s:
        with torch.no_grad():
            model[0](torch.randn(2, 4))
            model[1](torch.randn(2, 4))
        monkeypatch.setattr(capture, "_shape_text", shape_text_pausing)
        text = s.report()
        started[0].join()
        assert "1" in plugin.features and "2" in plugin.features
        assert "0 " in text


def test_a_call_spanning_a_step_boundary_is_captured_whole_or_not_at_all():
    """``every=2``, ``session.step()`` on a timer thread while a call runs: the step the call
    began in decides for both halves. A call from a sampled step into an unsampled one is
    captured whole (its inputs were orphaned: held and counted, in no call), one from an
    unsampled step into a sampled one not at all (its output came without inputs)."""
    import threading

    entered, stepped = threading.Event(), threading.Event()

    class Straddle(nn.Module):
        straddle = False

        def forward(self, x):
            if self.straddle:  # the step boundary lands while this call runs
                entered.set()
                assert stepped.wait(timeout=30)
            return x * 2

    model = nn.Sequential(Straddle())
    plugin = CapturePlugin(keep="all", inputs=True)
    with hookplug.attach(model, "Straddle", plugins=plugin, every=2) as s:

        def timer():
            entered.wait(timeout=30)
            s.step()
            stepped.set()

        model(torch.full((4,), 0.0))  # step 0, sampled
        for x in (1.0, 2.0):  # from step 0 into step 1 (unsampled), from step 1 into step 2
            entered.clear(), stepped.clear()
            model[0].straddle = True
            t = threading.Thread(target=timer)
            t.start()
            model(torch.full((4,), x))
            t.join()
            model[0].straddle = False
        feats, ins = plugin.features["0"], plugin.inputs["0"]
        assert [f[0].item() for f in feats] == [0.0, 2.0]
        assert [i[0][0].item() for i in ins] == [0.0, 1.0]
        assert plugin.nbytes == _held_bytes(plugin) == 4 * 4 * 4


@pytest.mark.parametrize("plugins", [[("capture", {"inputs": True, "grads": True})],
                                     [("capture", {"inputs": True}), ("stats", {"sites": ("output", "grad")})]],
                         ids=["capture-grads", "capture+stats-grad"])
def test_an_output_kept_after_remove_keeps_no_plugin_alive(plugins):
    """A call with an input half (``inputs=True``) and a grad site: its context, held by
    the output's gradient hook, kept the plugins' bound methods (and all they captured)
    while the user kept the output."""
    import gc
    import weakref

    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    s = hookplug.attach(m, "Linear|Tanh", plugins=plugins)
    y = m(torch.randn(2, 4))  # kept, e.g. logits for a metric; no backward
    alive = [weakref.ref(p) for p in s.plugins.values()] + [weakref.ref(s["capture"].features["0"])]
    s.remove()
    del s
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)
    assert y.requires_grad


@dataclasses.dataclass
class _Measured:
    logits: torch.Tensor

    def __post_init__(self):
        self.batch = self.logits.shape[0]  # reads the tensor: a placeholder has no shape


class _DataclassHead(nn.Module):
    """A Linear whose output ``make`` wraps in a dataclass."""

    def __init__(self, make):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.make = make

    def forward(self, x):
        return self.make(self.lin(x))


def test_grads_of_a_dataclass_output_whose_post_init_reads_its_fields():
    """The grads' skeleton rebuilt the user's dataclass with placeholders, running its
    ``__post_init__``: the training forward raised ``'_Slot' object has no attribute 'shape'``."""
    m = nn.Sequential(_DataclassHead(_Measured))
    x = torch.randn(2, 4)
    with hookplug.attach(m, "*:0", plugins=("capture", {"grads": True})) as s:
        out = m(x)
        assert out.batch == 2
        out.logits.sum().backward()
        got = s["capture"].grads["0"]
    assert isinstance(got, _Measured) and torch.equal(got.logits, torch.ones(2, 4))


@dataclasses.dataclass
class _Derived:
    logits: torch.Tensor
    scale: dataclasses.InitVar[float] = 1.0
    probs: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self, scale):
        self.probs = torch.softmax(self.logits * scale, -1)


def test_a_dataclass_output_with_derived_fields_is_kept_as_its_values():
    """Each field is copied and set as it is (no ``__post_init__``): a field computed there
    (``init=False``) is a detached copy, not the live tensor, and its gradient is its own
    (``replace`` ran ``__post_init__`` on the gradients: ``grads.probs`` was
    softmax(grad of logits); with an InitVar ``replace`` raised)."""
    m = nn.Sequential(_DataclassHead(lambda h: _Derived(h, 2.0)))
    x = torch.randn(2, 4)
    with hookplug.attach(m, "*:0", plugins=("capture", {"grads": True})) as s:
        out = m(x)
        out.probs[:, 0].sum().backward()
        feat, grad = s["capture"].features["0"], s["capture"].grads["0"]
    assert feat.probs is not out.probs and not feat.probs.requires_grad
    assert torch.equal(feat.probs, out.probs.detach()) and torch.equal(feat.logits, out.logits.detach())
    want = torch.zeros(2, 4)
    want[:, 0] = 1
    assert torch.equal(grad.probs, want)


class _ListOut(nn.Module):
    def forward(self, x):
        return [x[:, :2], x.sum(1), x]


def test_a_list_output_with_keep_last_is_one_call(tmp_path):
    """With ``keep="last"`` a list output was read as a list of calls: the report showed
    ``x3`` with the last element's shape, save() wrote per-call keys, plot_features drew the
    last element."""
    pytest.importorskip("safetensors")
    m = nn.Sequential(_ListOut())
    x = torch.randn(1, 3, 4, 4)
    with hookplug.attach(m, "*:0", plugins="capture") as s:
        m(x)
        report = s["capture"].report()
        s["capture"].save(tmp_path / "c.safetensors")
    row = next(line for line in report.splitlines() if line.startswith("0 "))
    assert " x3" not in row and "(1, 2, 4, 4), (1, 4, 4), (1, 3, 4, 4)" in row, report
    from safetensors import safe_open

    with safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["0/output[0]", "0/output[1]", "0/output[2]"]
    back = hookplug.load_capture(tmp_path / "c.safetensors")["0"]
    assert [torch.equal(a, b) for a, b in zip(back, [x[:, :2], x.sum(1), x])] == [True] * 3
    from hookplug.cli._plot import _features_of, _tensor_of

    assert torch.equal(_tensor_of(_features_of(s["capture"])["0"], "'0'"), x[:, :2])


class _Raises(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


@pytest.mark.parametrize("inputs", [False, True])
def test_a_call_whose_forward_raised_is_not_counted_as_skipped(inputs):
    m = nn.Sequential(_Raises())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (max_bytes reached)
        with hookplug.attach(m, "*:0", plugins=("capture", {"inputs": inputs, "max_bytes": 0})) as s:
            with pytest.raises(ValueError, match="boom"):
                m(torch.randn(2, 4))
            assert s["capture"].skipped == 0


@pytest.mark.parametrize("then", ["step", "next call"])
def test_a_call_ctrl_c_stopped_is_not_counted_as_skipped(then):
    """Its inputs did not fit (counted then), Ctrl-C stopped it: dropped at the step or at
    the module's next call, the count is taken back, as for a forward that raised."""
    m = Interruptible()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (max_bytes reached)
        with hookplug.attach(m, "*:", plugins=("capture", {"inputs": True, "max_bytes": 0})) as s:
            m.interrupted_call(m, torch.randn(2, 4))
            if then == "step":
                s.step()
            else:
                m(torch.randn(2, 4))  # (does not fit either: one skip, its own)
            assert s["capture"].skipped == (0 if then == "step" else 1)


class _OutputsAModelOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput

        h = self.lin(x)
        return BaseModelOutput(last_hidden_state=h, hidden_states=(h * 2,))


def test_a_model_output_is_captured_as_copies_with_its_own_gradients():
    """A ModelOutput is a dict as well as a dataclass: its items and attributes are the
    copies, and its gradients its own (a rebuild by fields kept the live items)."""
    pytest.importorskip("transformers")
    m = _OutputsAModelOutput()
    with hookplug.attach(m, "*:", plugins=("capture", {"grads": True})) as s:
        out = m(torch.randn(2, 3))
        out.last_hidden_state.sum().backward()
        feat, grad = s["capture"].features[""], s["capture"].grads[""]
    for value in (feat.last_hidden_state, feat["last_hidden_state"], feat.to_tuple()[0]):
        assert value.grad_fn is None and torch.equal(value, out.last_hidden_state.detach())
    assert torch.equal(grad.last_hidden_state, torch.ones(2, 3)) and torch.equal(grad["last_hidden_state"], torch.ones(2, 3))
    assert grad.hidden_states == (None,)


@dataclasses.dataclass
class _WithAttribute:
    logits: torch.Tensor

    def __post_init__(self):
        self.probs = self.logits.softmax(-1)  # an attribute, not a field


def test_a_tensor_attribute_set_beside_a_dataclasses_fields_is_copied_too():
    m = nn.Sequential(_DataclassHead(_WithAttribute))
    with hookplug.attach(m, "*:0", plugins=("capture", {"grads": True})) as s:
        out = m(torch.randn(2, 4))
        out.logits.sum().backward()
        feat, grad = s["capture"].features["0"], s["capture"].grads["0"]
    assert feat.probs is not out.probs and feat.probs.grad_fn is None and torch.equal(feat.probs, out.probs.detach())
    assert grad.probs is None and torch.equal(grad.logits, torch.ones(2, 4))


class _CheckpointedNet(nn.Module):
    """Linears run plain, in a non-reentrant and in a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.nr = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.re = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(self.nr, self.inp(x), use_reentrant=False)
        return self.out(checkpoint(self.re, x, use_reentrant=True))


@pytest.mark.parametrize("step", [False, True])
def test_keep_all_on_threads_with_checkpointing_keeps_each_forward_once(step):
    """Threads share a module's list of pending calls. A post hook took another thread's
    entry (a check and a pop apart; a recompute's untagged mark taken as its own), so a
    forward was taken for a recompute or the reverse: calls lost, one too many, grads paired
    with the wrong call, an IndexError out of forward (15% of rounds before the fix)."""
    import sys
    import threading
    from collections import Counter

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(12):
            model, truth, lock, errors = _CheckpointedNet(), Counter(), threading.Lock(), []

            def count(module, args, output, name):
                if torch._C._current_graph_task_id() == -1:  # a forward, not a recompute
                    with lock:
                        truth[name] += 1
            for n, m in model.named_modules():
                if isinstance(m, nn.Linear):
                    m.register_forward_hook(lambda mod, a, o, n=n: count(mod, a, o, n))
            with hookplug.attach(model, "Linear:*", plugins=[("capture", {"keep": "all", "grads": True,
                                                                           "inputs": True})]) as s:
                barrier = threading.Barrier(3)

                def work():
                    try:
                        barrier.wait()
                        for _ in range(5):
                            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
                            if step:
                                s.step()
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)

                threads = [threading.Thread(target=work) for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                cap = s["capture"]
                assert not errors, errors
                for name, n in truth.items():
                    assert len(cap.features[name]) == len(cap.inputs[name]) == n == 15, (name, n)
                    assert sorted(cap._calls["features"][name]) == list(range(n)), name
                    assert all(g is not None for g in cap.grads[name]), name
    finally:
        sys.setswitchinterval(old)


class _CacheLike:
    """A plain object holding tensors, as an HF cache (no container)."""

    def __init__(self, t):
        self.keys = [t]


@dataclasses.dataclass
class _OutWithCache:
    hidden: torch.Tensor
    cache: object
    n_layers: int = dataclasses.field(init=False)

    def __post_init__(self):
        _POST_INIT_SEEN.append(type(self.cache).__name__)
        self.n_layers = len(self.cache.keys)  # reads the cache object


_POST_INIT_SEEN: list = []


def test_a_dataclass_output_holding_a_cache_object_is_captured_without_running_post_init():
    """The cache object became a dict through ``dataclasses.replace``, which ran
    ``__post_init__`` again on the dict: the model's forward raised under capture."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return _OutWithCache(self.fc(x), _CacheLike(self.fc(x) * 2))

    m, x = M(), torch.randn(2, 4)
    want = m(x)
    _POST_INIT_SEEN.clear()
    with pytest.warns(RuntimeWarning, match="_CacheLike object"):
        with hookplug.attach(m, "*:", plugins="capture") as s:
            out = m(x)
    assert _POST_INIT_SEEN == ["_CacheLike"]  # the model's own, once
    assert isinstance(out.cache, _CacheLike) and out.n_layers == 1
    got = s["capture"].features[""]
    assert isinstance(got, _OutWithCache) and got.n_layers == 1
    assert torch.equal(got.hidden, want.hidden) and got.hidden is not out.hidden
    assert torch.equal(got.cache["keys"][0], want.cache.keys[0])


def test_an_object_nested_past_the_depth_limit_is_not_kept_live():
    """An object holding tensors more than 8 objects deep was kept as the live object (its
    tensor requiring grad, with the graph) without a warning; it is None now, with one."""

    class Node:
        def __init__(self, child):
            self.child = child

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            node = y
            for _ in range(12):
                node = Node(node)
            return y, node

    m = M()
    with pytest.warns(RuntimeWarning, match="Node object.*as None"):
        with hookplug.attach(m, "*:", plugins="capture") as s:
            m(torch.randn(2, 4))
    kept = s["capture"].features[""][1]
    live = [t for _, t in iter_tensors(kept)]
    assert live == []
    depth, node = 0, kept
    while isinstance(node, dict):
        node, depth = node["child"], depth + 1
    assert node is None and depth >= 8


def test_objects_without_tensors_past_the_depth_limit_stay_as_they_are():
    """A parent/child tree (a cycle) holding no tensor stays the object it is, without a
    warning (only an object reaching a tensor past the limit is None)."""

    class Node:
        def __init__(self, parent=None):
            self.parent, self.children, self.name = parent, [], "n"
            if parent is not None:
                parent.children.append(self)

    class Info:
        def __init__(self):
            self.root = Node()
            Node(Node(self.root))

    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2, Info()

    m = M()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hookplug.attach(m, "*:", plugins="capture") as s:
            m(torch.randn(2))
    assert isinstance(s["capture"].features[""][1], Info)


@pytest.mark.parametrize("keep", ["last", "all", 2])
def test_inputs_keep_keyword_arguments_call_by_call_and_save_them(keep, tmp_path):
    """Keyword arguments (an HF attention's ``hidden_states=``) were left out of ``inputs``
    with a warning: they are kept in ``input_kwargs``, aligned with ``inputs``, counted in
    ``nbytes`` and written by ``save()``."""
    class Attn(torch.nn.Module):
        def forward(self, hidden_states=None, scale=1.0, mask=None):
            return hidden_states * scale

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, x):
            return self.attn(hidden_states=x, scale=2.0, mask=x > 0) + self.attn(x)

    m = M()
    xs = [torch.randn(2, 3) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hookplug.attach(m, "*:attn", plugins=("capture", {"inputs": True, "keep": keep})) as s:
            for x in xs:
                m(x)
            cap = s["capture"]
            kept_bytes = cap.nbytes
    calls = [c for x in xs for c in (((), {"hidden_states": x, "scale": 2.0, "mask": x > 0}), ((x,), {}))]
    want = calls[-1:] if keep == "last" else calls[-2:] if keep == 2 else calls
    got_args, got_kwargs = cap.inputs["attn"], cap.input_kwargs["attn"]
    if keep == "last":
        got_args, got_kwargs = [got_args], [got_kwargs]
    assert len(got_args) == len(got_kwargs) == len(want)
    for (args, kwargs), a, k in zip(want, got_args, got_kwargs):
        assert len(a) == len(args) and all(torch.equal(u, v) for u, v in zip(a, args))
        assert set(k) == set(kwargs)
        for name, v in kwargs.items():
            assert torch.equal(k[name], v) if isinstance(v, torch.Tensor) else k[name] == v
    feats = [cap.features["attn"]] if keep == "last" else cap.features["attn"]
    feat = sum(t.numel() * t.element_size() for t in feats)
    held = sum(t.numel() * t.element_size() for a, k in zip(got_args, got_kwargs)
               for t in [*a, *[v for v in k.values() if isinstance(v, torch.Tensor)]])
    assert kept_bytes == feat + held
    path = tmp_path / "cap.safetensors"
    cap.save(path)
    back = hookplug.load_capture(path, what="all")
    b_args, b_kwargs = back["inputs"]["attn"], back["input_kwargs"]["attn"]
    if keep == "last":  # the last call had no keywords
        assert b_kwargs == {} and torch.equal(b_args[0], xs[-1])
        return
    for k, bk in zip(got_kwargs, b_kwargs):
        assert (bk or {}).keys() == k.keys()
        for name, v in k.items():
            assert torch.equal(bk[name], v) if isinstance(v, torch.Tensor) else bk[name] == v


def test_keep_n_grads_has_no_entry_for_a_module_none_of_whose_kept_calls_got_one():
    """As documented (and as ``keep="last"`` does): a module whose kept calls all ran without
    a gradient has no ``grads`` entry; ``keep=2`` gave ``[None, None]``. One with a gradient
    in a kept call keeps its aligned list."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4)
    with hookplug.attach(m, "*", plugins=("capture", {"keep": 2, "grads": True})) as s:
        m(x).sum().backward()
        with torch.no_grad():
            m(x), m(x)
        assert s["capture"].grads == {}
        m(x).sum().backward()
        grads = s["capture"].grads
    assert set(grads) == {"0", "1"} and grads["0"][0] is None and grads["0"][1] is not None


def test_input_kwargs_keep_an_object_argument_by_its_class_name_only():
    """An HF cache handed to every attention call (``cache=``): copied per call, a short
    ``generate()`` held every layer's keys and values once per call."""

    class Cache:
        def __init__(self):
            self.keys = [torch.randn(64, 64) for _ in range(4)]

    class Vocab:  # a tokenizer's: no tensor, 50k entries
        def __init__(self):
            self.ids = {f"t{i}": i for i in range(50_000)}

    class Attn(torch.nn.Module):
        def forward(self, hidden_states, cache=None, use_cache=True, mask=None, layout=None, where=None,
                    vocab=None):
            return hidden_states + cache.keys[0].sum()

    m = torch.nn.Sequential(Attn())
    cache, x = Cache(), torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no objects-as-dicts warning: nothing copied)
        with hookplug.attach(m, "*:0", plugins=("capture", {"inputs": True, "keep": "all"})) as s:
            for _ in range(3):
                m[0](x, cache=cache, use_cache=True, mask=(x > 0, None), layout=torch.channels_last,
                     where=slice(0, 2), vocab=Vocab())
    cap = s["capture"]
    for kw in cap.input_kwargs["0"]:
        assert kw["cache"] == "<Cache: not kept>" and kw["use_cache"] is True
        assert kw["layout"] == torch.channels_last and kw["where"] == slice(0, 2)  # (no tensor in them)
        assert kw["vocab"] == "<Vocab: not kept>"  # (too large to walk or copy per call)
        assert torch.equal(kw["mask"][0], x > 0) and kw["mask"][1] is None
    held = 3 * (2 * x.numel() * x.element_size() + x.numel())  # x twice (input, output), the mask
    assert cap.nbytes == held


def test_tuple_dict_keys_load_back_as_tuples(tmp_path):
    """A dict keyed by tuples (``{("layer", 0): t}``) loaded back keyed by their repr
    strings; now a tuple key is written as ``{"tuple": [...]}`` (format version 3, only in
    files that need it) and other objects' keys still as their repr."""
    from safetensors import safe_open

    class Keyed(torch.nn.Module):
        def forward(self, x):
            return {("a", 0): x, ("a", (1, None)): x * 2, "plain": x + 1, 3: x - 1}

    m = torch.nn.Sequential(Keyed())
    x = torch.randn(2, 3)
    with hookplug.attach(m, "*:0", plugins="capture") as s:
        m(x)
    s["capture"].save(tmp_path / "k.safetensors")
    back = hookplug.load_capture(tmp_path / "k.safetensors")["0"]
    assert list(back) == [("a", 0), ("a", (1, None)), "plain", 3]
    for k, v in s["capture"].features["0"].items():
        assert torch.equal(back[k], v)
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as f:
        assert '"version": 3' in f.metadata()["hookplug.capture"]
