"""The seed articles' examples (/shared/seeds), done through hookplug and checked against the
hand-written hooks the articles use."""

import pytest
import torch
import torch.nn as nn
from hookplug_plugins.gradclamp import GradClampPlugin

import hookplug
from hookplug.models import MLP, resnet34_like

# -- 002: "pytorch hook" --------------------------------------------------------------------------


class myNet(nn.Module):  # noqa: N801 - the seed's name; its model without the hooks inside forward
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 2, stride=2)
        self.relu = nn.ReLU()
        self.flatten = lambda x: x.view(-1)
        self.fc1 = nn.Linear(160, 5)

    def forward(self, x):
        x = self.relu(self.conv(x))
        return self.fc1(self.flatten(x))


class myNetSeed(myNet):  # noqa: N801 - the seed as written: tensor hooks inside forward
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        x = self.relu(self.conv(x))
        # 修改反向传播时，conv输出的梯度不小于0
        x.register_hook(lambda grad: torch.clamp(grad, min=0))
        # 打印确认是否有小于0的梯度
        x.register_hook(lambda grad: self.log.append(bool((grad < 0).any())))
        return self.fc1(self.flatten(x))


def test_seed_002_clamp_conv_output_and_zero_fc_bias():
    log = []
    seed = myNetSeed(log)
    for name, param in seed.named_parameters():
        # 使用named_parameters对fc和bias添加修改，使其梯度全部为0
        if "fc" in name and "bias" in name:
            param.register_hook(lambda grad: torch.zeros(grad.shape))
    x = torch.randn(1, 3, 8, 8)
    (1 - seed(x)).mean().backward()
    assert log == [False]  # "Gradients less than zero: False"
    assert torch.equal(
        seed.fc1.bias.grad, torch.zeros(5)
    )  # "The biases are tensor([0., 0., 0., 0., 0.])"

    net = myNet()
    net.load_state_dict({k: v for k, v in seed.state_dict().items()})
    zero_fc_bias = GradClampPlugin(min=0, max=0, params="fc*.bias")
    zero_fc_bias.name = "zero_fc_bias"
    with hookplug.attach(
        net,
        {
            "ReLU": [
                ("gradclamp", {"min": 0}),
                ("stats", {"sites": "grad"}),
            ],  # stats sees the clamped grad
            "*": zero_fc_bias,
        },
    ) as s:
        (1 - net(x)).mean().backward()
        grad_stats = s["stats"].results()["relu"]["grad"]
    assert not float(grad_stats.min) < 0  # "Gradients less than zero: False"
    assert torch.equal(net.fc1.bias.grad, torch.zeros(5))
    for (n, p), (_, q) in zip(net.named_parameters(), seed.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert s["zero_fc_bias"].results() == {"fc1.bias": {"changed": 5}}
    assert s["gradclamp"].results()["relu"]["changed"] > 0


class myNetSeq(myNet):  # noqa: N801 - the seed's second model (forward returns None, as written)
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))

    def forward(self, x):
        self.seq(super().forward(x))


def test_seed_002_activations_of_all_layers_but_sequentials():
    net = myNetSeq()
    visualisation = {}

    def hook_fn(m, i, o):
        visualisation[m] = o

    def get_all_layers(net):
        handles = []
        for name, layer in net._modules.items():  # noqa: PERF102 - as the seed wrote it
            if isinstance(layer, nn.Sequential):
                handles += get_all_layers(layer)
            else:
                handles.append(layer.register_forward_hook(hook_fn))
        return handles

    handles = get_all_layers(net)
    x = torch.randn(1, 3, 8, 8)
    net(x)
    for h in handles:
        h.remove()

    with hookplug.attach(net, "*, -Sequential", plugins="capture") as s:
        net(x)
    feats = s["capture"].features
    assert list(feats) == ["conv", "relu", "fc1", "seq.0", "seq.1"]
    mods = dict(net.named_modules())
    assert [mods[n] for n in feats] == list(visualisation)
    for name, t in feats.items():
        assert torch.equal(t, visualisation[mods[name]])


def test_seed_002_resnet34_conv_feature_maps():
    model = resnet34_like().eval()

    class SaveOutput:  # the seed's hook object
        def __init__(self):
            self.outputs = []

        def __call__(self, module, module_in, module_out):
            self.outputs.append(module_out)

        def clear(self):
            self.outputs = []

    save_output = SaveOutput()
    hook_handles = []
    for layer in model.modules():
        if isinstance(layer, torch.nn.modules.conv.Conv2d):
            hook_handles.append(layer.register_forward_hook(save_output))
    X = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        out = model(X)
    for h in hook_handles:
        h.remove()
    assert len(save_output.outputs) == 36  # 输出应该是36

    with hookplug.attach(model, "Conv2d", plugins="capture") as s:
        with torch.no_grad():
            out2 = model(X)
    features = list(s["capture"].features.values())
    assert len(features) == 36 and torch.equal(out, out2)
    for a, b in zip(features, save_output.outputs):
        assert torch.equal(a, b)

    def module_output_to_numpy(tensor):
        return tensor.detach().to("cpu").numpy()

    for idx in (0, 15, 30):  # the layers the seed plots
        images = module_output_to_numpy(features[idx])
        assert (images == module_output_to_numpy(save_output.outputs[idx])).all()
        assert images.shape[0] == 1 and images.ndim == 4


# -- 000: "Hook mechanism in Pytorch" -------------------------------------------------------------


class Model(nn.Module):  # the model the article's module-hook examples use
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(4, 1)
        self.initialize()

    def initialize(self):
        with torch.no_grad():
            self.fc1.weight = nn.Parameter(
                torch.Tensor(
                    [[1.0, 2.0, 3.0], [-4.0, -5.0, -6.0], [7.0, 8.0, 9.0], [-10.0, -11.0, -12.0]]
                )
            )
            self.fc1.bias = nn.Parameter(torch.Tensor([1.0, 2.0, 3.0, 4.0]))
            self.fc2.weight = nn.Parameter(torch.Tensor([[1.0, 2.0, 3.0, 4.0]]))
            self.fc2.bias = nn.Parameter(torch.Tensor([1.0]))

    def forward(self, x):
        return self.fc2(self.relu1(self.fc1(x)))


def test_seed_000_forward_and_backward_values_of_every_child():
    model = Model()
    total_feat_out, total_feat_in = [], []
    total_grad_out = []

    def hook_fn_forward(module, input, output):
        total_feat_out.append(output)
        total_feat_in.append(input)

    def hook_fn_backward(module, grad_input, grad_output):
        total_grad_out.append(grad_output)

    handles = []
    for name, module in model.named_children():
        handles.append(module.register_forward_hook(hook_fn_forward))
        handles.append(module.register_full_backward_hook(hook_fn_backward))
    x = torch.Tensor([[1.0, 1.0, 1.0]]).requires_grad_()
    model(x).backward()
    for h in handles:
        h.remove()

    x2 = torch.Tensor([[1.0, 1.0, 1.0]]).requires_grad_()
    with hookplug.attach(model, "*", plugins=("capture", {"inputs": True, "grads": True})) as s:
        model(x2).backward()
    cap = s["capture"]
    names = ["fc1", "relu1", "fc2"]
    assert list(cap.features) == names
    for i, n in enumerate(names):
        assert torch.equal(cap.features[n], total_feat_out[i])
        assert torch.equal(cap.inputs[n][0], total_feat_in[i][0])
        # backward runs last layer first; the grad has the output's shape for every layer kind
        assert torch.equal(cap.grads[n], total_grad_out[len(names) - 1 - i][0])
        assert cap.grads[n].shape == cap.features[n].shape
    assert cap.features["fc1"].tolist() == [[7.0, -13.0, 27.0, -29.0]]
    assert cap.features["fc2"].item() == 1 * 7 + 3 * 27 + 1.0
    assert torch.equal(x.grad, x2.grad)


def test_seed_000_grad_stats_of_intermediates_without_retain_grad():
    model = MLP()
    x = torch.randn(4, 32)
    retained = {}

    def keep(name):
        def hook(mod, inp, out):
            out.retain_grad()  # what the article says costs memory; hookplug does not need it
            retained.setdefault(name, []).append(out)

        return hook

    handles = [
        m.register_forward_hook(keep(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    model(x).square().mean().backward()
    for h in handles:
        h.remove()
    model.zero_grad()

    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": "grad"})) as s:
        model(x).square().mean().backward()
    res = s["stats"].results()
    for name, outs in retained.items():
        g = torch.cat([o.grad.reshape(-1) for o in outs]).double()
        st = res[name]["grad"]
        assert int(st.numel) == g.numel()
        assert float(st.min) == float(g.min()) and float(st.max) == float(g.max())
        torch.testing.assert_close(float(st.mean), float(g.mean()), rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(float(st.std), float(g.std(correction=0)), rtol=1e-5, atol=1e-9)
    assert "grad" in s.report() and "fc2" in s.report()


# -- 003: "gradient clipper": clamp every parameter's gradient through a hook ---------------------


@pytest.mark.parametrize("clip", [0.01])
def test_seed_003_gradient_clipper_on_every_parameter(clip):
    model = MLP()
    x = torch.randn(8, 32)
    handles = [
        p.register_hook(lambda grad: torch.clamp(grad, -clip, clip)) for p in model.parameters()
    ]
    model(x).square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    with hookplug.attach(
        model, "*", plugins=("gradclamp", {"min": -clip, "max": clip, "params": "*"})
    ) as s:
        model(x).square().mean().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
    assert set(s["gradclamp"].results()) == set(want)
