"""The flops plugin against ``torch.utils.flop_counter.FlopCounterMode``.

FlopCounterMode (FCM) keys modules as ``"<RootClass>.<qualified name>"`` (the root as
``"<RootClass>"``, everything as ``"Global"``) and counts forward + backward together.
Forward per module must equal FCM exactly. Backward per module must equal the same module
run alone under FCM (its real inputs, the same ``requires_grad``), and FCM's in-model number
wherever FCM's time-window tracking is not confounded by branches; where it is (a tensor read
by two modules, an identity module), FCM charges a module for its siblings' backward too and
counts more than the module's own backward.
"""
import contextlib
import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import hookplug
from hookplug.models import MLP, EncoderLayer, tiny_cnn, tiny_transformer
from hookplug_plugins.flops import FlopsPlugin, count_flops

ALL = "*, *:"  # every module and the root


def fcm_counts(model, *inputs, backward=False):
    """``{fcm key: flops}`` with FCM around forward (and backward)."""
    with FlopCounterMode(display=False) as fcm:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    return {k: sum(v.values()) for k, v in fcm.get_flop_counts().items()}


def fcm_key(model, name):
    return type(model).__name__ + (f".{name}" if name else "")


def run(model, *inputs, selector=ALL, backward=False, **options):
    plugin = FlopsPlugin(**options)
    with hookplug.attach(model, selector, plugins=plugin) as session:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    assert session.removed
    return plugin


def isolated_backward(model, *inputs):
    """``{name: backward flops}``: each module run alone under FCM on the inputs it received in
    ``model(*inputs)`` (every call), gradients flowing where they flow in the model."""
    def snapshot(args):  # inputs as they were at the call (in-place ops come later)
        return [(a.detach().clone(), a.requires_grad) if isinstance(a, torch.Tensor) else (a, None)
                for a in args]

    def fresh(snap):
        return [a.clone().requires_grad_(rg).clone() if rg else a.clone() if rg is False else a
                for a, rg in snap]

    calls = {}
    handles = [m.register_forward_pre_hook(
        lambda mod, args, n=n: calls.setdefault(n, []).append(snapshot(args)))
        for n, m in model.named_modules()]
    model(*inputs)
    for h in handles:
        h.remove()
    mods = dict(model.named_modules())
    out = {}
    for name, snaps in calls.items():
        mod = copy.deepcopy(mods[name])
        total = 0
        for snap in snaps:
            with FlopCounterMode(display=False) as fw:
                mod(*fresh(snap))
            with FlopCounterMode(display=False) as both:
                res = mod(*fresh(snap))
                if res.requires_grad:
                    res.sum().backward()
            total += both.get_total_flops() - fw.get_total_flops()
        out[name] = total
    return out


def check_against_fcm(model_fn, x, expect_fcm_confounded=()):
    torch.manual_seed(0)
    model = model_fn()
    fwd = fcm_counts(model, x)
    both = fcm_counts(model, x, backward=True)
    plugin = run(model, x, backward=True)
    iso = isolated_backward(model, x)
    res = plugin.results()
    assert set(res) == {n for n, _ in model.named_modules()}
    confounded = set()
    for name, r in res.items():
        key = fcm_key(model, name)
        assert r["flops"] == fwd.get(key, 0), name
        assert r["macs"] == r["flops"] // 2
        assert r["params"] == sum(p.numel() for p in model.get_submodule(name).parameters())
        assert r["backward_flops"] == iso.get(name, 0), name  # never called: 0
        fcm_bw = both.get(key, 0) - fwd.get(key, 0)
        if r["backward_flops"] != fcm_bw:
            assert fcm_bw > r["backward_flops"], name  # FCM over-attributes, never under
            confounded.add(name)
    assert confounded <= set(expect_fcm_confounded)
    tot = plugin.total()
    assert tot["flops"] == fwd["Global"]
    assert tot["flops"] + tot["backward_flops"] == both["Global"]
    assert tot["backward_flops"] == res[""]["backward_flops"]  # the root owns every node
    assert tot["params"] == sum(p.numel() for p in model.parameters())
    return plugin


def test_params_count_what_the_modules_hold_when_read():
    """A layer appended to a selected Sequential and a parametrization registered after
    attach: ``params`` in ``results()`` and ``total()`` are the counts when read (they were
    the counts at attach, also after ``reset()``)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8)
    with hookplug.attach(model, "*, *:", plugins="flops") as s:
        model(x)
        assert s["flops"].total()["params"] == 72
        model.append(nn.Linear(8, 8))
        torch.nn.utils.parametrizations.weight_norm(model[0])
        model(x)
        res, tot = s["flops"].results(), s["flops"].total()
    assert tot["params"] == res[""]["params"] == sum(p.numel() for p in model.parameters()) == 152
    assert res["0"]["params"] == sum(p.numel() for p in model[0].parameters()) == 80


def test_eval_forwards_are_counted_apart_from_training():
    """Training steps with evaluations between them (eval mode, ``inference_mode``, and an
    eval-mode saliency backward): ``results(phase="train")``/``total(phase="train")`` are
    the training steps' FLOPs alone, as ``FlopCounterMode`` counts them; ``phase="eval"``
    the evaluations' (the saliency's backward included); ``phase=None`` (the default) both.
    Evaluations were merged into the training numbers (a fit's FLOPs per step inflated by
    its validation passes)."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)

    def fcm(fn):
        with FlopCounterMode(display=False) as mode:
            fn()
        return {k: sum(v.values()) for k, v in mode.get_flop_counts().items()}

    def train():
        model.train()
        model(x).sum().backward()

    def evaluate():
        model.eval()
        with torch.no_grad():
            model(x)
        with torch.inference_mode():
            model(x)
        model(x.clone().requires_grad_()).sum().backward()  # a saliency map, eval mode

    with hookplug.attach(model, ALL, plugins="flops") as s:
        for _ in range(2):
            train()
            s.step()
            evaluate()
    plugin = s["flops"]
    want_train = fcm(lambda: [train() for _ in range(2)])
    want_eval = fcm(lambda: [evaluate() for _ in range(2)])
    for phase, want in (("train", want_train), ("eval", want_eval)):
        tot = plugin.total(phase=phase)
        assert tot["flops"] + tot["backward_flops"] == want["Global"] > 0, phase
        res = plugin.results(phase=phase)
        for name in ("fc1", "fc2", "fc3"):
            assert res[name]["flops"] + res[name]["backward_flops"] == want[f"MLP.{name}"], (phase, name)
    assert plugin.total()["flops"] == plugin.total("train")["flops"] + plugin.total("eval")["flops"]
    assert plugin.results()["fc1"]["backward_flops"] == sum(
        plugin.results(p)["fc1"]["backward_flops"] for p in ("train", "eval"))
    assert sum(op["flops"] for op in plugin.by_op("eval").values()) == plugin.total("eval")["flops"]
    with pytest.raises(ValueError, match=r"phase must be None or one of \('train', 'eval'\), got 'val'"):
        plugin.results(phase="val")


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("train", [True, False])
def test_a_checkpoints_recompute_counts_in_the_phase_of_its_forward(train, reentrant):
    """A checkpoint called where no selected module runs (the root's forward, selector
    ``Linear``): its recompute in backward has no window of ours around it; it was counted
    as training also when the model was in eval mode (a saliency map with checkpointing).
    Every FLOP goes to the model's phase; none to the other."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=reentrant)

    torch.manual_seed(0)
    model = Net().train(train)
    with hookplug.attach(model, "Linear", plugins="flops") as s:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    phase, other = ("train", "eval") if train else ("eval", "train")
    got, none = s["flops"].total(phase), s["flops"].total(other)
    assert got["flops"] == 2 * 2 * 4 * 8 * 8 and got["backward_flops"] > got["flops"]
    assert none["flops"] == none["backward_flops"] == 0


def test_cnn_matches_flop_counter_mode():
    plugin = check_against_fcm(
        lambda: tiny_cnn(width=8), torch.randn(2, 3, 32, 32),
        expect_fcm_confounded={f"layer{i}.0.conv1" for i in (2, 3, 4)})
    res = plugin.results()
    assert res["conv1"]["flops"] > 0 and res["layer2.0.downsample.0"]["backward_flops"] > 0
    # the stem conv's input needs no gradient: only grad_weight (as many FLOPs as the forward)
    assert res["conv1"]["backward_flops"] == res["conv1"]["flops"]
    assert res["layer1.0.conv2"]["backward_flops"] == 2 * res["layer1.0.conv2"]["flops"]


def test_transformer_matches_flop_counter_mode():
    plugin = check_against_fcm(
        lambda: tiny_transformer(dim=32, sdpa=False), torch.randint(0, 1000, (2, 8)),
        expect_fcm_confounded={f"layers.{i}.{n}" for i in (0, 1)
                               for n in ("key", "value", "dropout")})
    res = plugin.results()
    # q, k, v read the same tensor: each owns exactly its own two backward matmuls
    assert res["layers.0.query"]["backward_flops"] == res["layers.0.key"]["backward_flops"] \
        == res["layers.0.value"]["backward_flops"] == 2 * res["layers.0.query"]["flops"]
    assert res["layers.0.dropout"]["backward_flops"] == 0


def test_mlp_module_called_twice():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    fwd = fcm_counts(model, x)
    both = fcm_counts(model, x, backward=True)
    res = run(model, x, backward=True).results()
    one_call = 2 * 4 * 64 * 64
    assert res["fc2"]["flops"] == 2 * one_call == fwd["MLP.fc2"]
    assert res["fc2"]["backward_flops"] == 2 * 2 * one_call == both["MLP.fc2"] - fwd["MLP.fc2"]
    for name in ("", "fc1", "fc3"):
        key = fcm_key(model, name)
        assert res[name]["flops"] == fwd[key]
        assert res[name]["backward_flops"] == both[key] - fwd[key]
    # fc1's input needs no grad: only the weight gradient
    assert res["fc1"]["backward_flops"] == res["fc1"]["flops"]
    assert count_flops(model, x, backward=True).results() == res  # the one-call helper


def _encoder_pair(dim=32, heads=4):
    torch.manual_seed(0)
    eager = EncoderLayer(dim, heads, 4 * dim, sdpa=False)
    sdpa = EncoderLayer(dim, heads, 4 * dim, sdpa=True)
    sdpa.load_state_dict(eager.state_dict())
    return eager, sdpa


def test_sdpa_counts_like_eager_attention():
    eager, sdpa = _encoder_pair()
    x = torch.randn(2, 8, 32)
    b, h, s, d = 2, 4, 8, 8
    attn_fwd = 2 * (2 * b * h * s * s * d)      # q @ k^T and p @ v
    pe = run(eager, x, backward=True)
    ps = run(sdpa, x, backward=True)
    fe, fs = pe.results()[""], ps.results()[""]
    assert fs["flops"] == fe["flops"] == fcm_counts(eager, x)["Global"]
    # torch's SDPA backward formula recomputes q @ k^T (5 matmuls); the eager backward runs 4
    assert fs["backward_flops"] - fe["backward_flops"] == attn_fwd // 2
    assert pe.by_op()["aten.bmm"]["backward_flops"] == 2 * attn_fwd
    cpu_kernel = "aten._scaled_dot_product_flash_attention_for_cpu"
    if cpu_kernel in ps.by_op():  # the kernel F.scaled_dot_product_attention runs on CPU
        assert ps.by_op()[cpu_kernel]["flops"] == attn_fwd
        # FlopCounterMode misses it; without the extra formulas we count exactly what it does
        fcm = fcm_counts(sdpa, x)["Global"]
        assert fcm == fs["flops"] - attn_fwd
        assert run(sdpa, x, extra_formulas=False).total()["flops"] == fcm


def test_inference_mode_counts_composite_ops_through_their_decomposition():
    # under inference_mode, linear/matmul/SDPA reach the dispatch mode undecomposed
    model, x = tiny_transformer(dim=32, sdpa=True), torch.randint(0, 1000, (2, 8))
    plain = run(model, x).results()
    with torch.inference_mode():
        inference = run(model, x)
        fcm = fcm_counts(model, x)
    assert inference.results() == plain
    assert "aten.linear" not in inference.uncounted()
    assert fcm["Global"] == run(model, x, extra_formulas=False).total()["flops"]


def test_native_multi_head_attention_fast_path():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 6, 32)
    slow = run(mha, x, x, x, selector="*:").total()["flops"]   # train mode: linears + attention
    mha.eval()
    with torch.no_grad():
        plugin = run(mha, x, x, x, selector="*:")
    if "aten._native_multi_head_attention" not in {**plugin.by_op(), **plugin.uncounted()}:
        pytest.skip("this torch did not take the MultiheadAttention fast path")
    assert plugin.total()["flops"] == slow


def _flops_of(model, *inputs, selector, extra_formulas=True, **kwargs):
    """``(plugin, output)`` of one no-grad forward with keyword inputs (``run`` takes none)."""
    plugin = FlopsPlugin(extra_formulas=extra_formulas)
    with torch.no_grad(), hookplug.attach(model, selector, plugins=plugin):
        out = model(*inputs, **kwargs)
    return plugin, out


def test_transformer_encoder_fast_path_counts_what_its_slow_path_does():
    """Hooks on an ``nn.TransformerEncoderLayer`` turn off its inference fast path
    (``aten._transformer_encoder_layer_fwd``, which runs its matmuls unseen): a selection
    that leaves the layers unhooked counted it 0. It now counts what the slow path counts,
    dense or nested (padding left out: each sequence as if run alone)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 7, 32)
    fast, out = _flops_of(enc, x, selector="*:")
    slow, _ = _flops_of(enc, x, selector="*, *:")
    assert "aten._transformer_encoder_layer_fwd" in fast.by_op()  # (the fast path ran)
    assert "aten._transformer_encoder_layer_fwd" not in slow.by_op()
    assert fast.total()["flops"] == slow.total()["flops"] > 0 and not fast.uncounted()
    with torch.no_grad():
        assert torch.equal(out, enc(x))
    plain, _ = _flops_of(enc, x, selector="*:", extra_formulas=False)  # as FlopCounterMode
    assert plain.total()["flops"] == 0 and plain.uncounted() == {"aten._transformer_encoder_layer_fwd": 2}

    lens = (7, 5, 3)
    mask = torch.arange(7)[None, :] >= torch.tensor(lens)[:, None]
    for selector in ("*:", "*, *:"):  # nested rows: linears and attention on a nested tensor
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
            nested, out = _flops_of(enc, x, selector=selector, src_key_padding_mask=mask)
        alone = sum(_flops_of(enc, x[i:i + 1, :n], selector=selector)[0].total()["flops"]
                    for i, n in enumerate(lens))
        assert nested.total()["flops"] == alone > 0, selector
        assert not {"aten.linear", "aten._native_multi_head_attention (formula failed)",
                    "aten._nested_tensor_from_mask", "aten.to_padded_tensor"} & set(nested.uncounted())
        with torch.no_grad():
            assert torch.equal(out, enc(x, src_key_padding_mask=mask))

    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    q = torch.nested.nested_tensor([torch.randn(7, 32), torch.randn(5, 32)])
    nested, _ = _flops_of(mha, q, q, q, selector="*:", need_weights=False)
    alone = sum(_flops_of(mha, t, t, t, selector="*:", need_weights=False)[0].total()["flops"]
                for t in (torch.randn(1, 7, 32), torch.randn(1, 5, 32)))
    assert nested.total()["flops"] == alone > 0 and not nested.uncounted()

    lin = nn.Linear(16, 8)  # linear on a nested tensor, strided or jagged: 2 * rows * in * out
    for layout in (torch.strided, torch.jagged):
        x = torch.nested.nested_tensor([torch.randn(5, 16), torch.randn(2, 16)], layout=layout)
        for mode in (torch.no_grad, torch.inference_mode):
            plugin = FlopsPlugin()
            with warnings.catch_warnings(), mode(), hookplug.attach(lin, "*:", plugins=plugin):
                warnings.simplefilter("error")  # (no "formula failed")
                lin(x)
            assert plugin.total()["flops"] == 2 * 7 * 16 * 8 and not plugin.uncounted(), (layout, mode)


def test_nested_selection_is_inclusive_and_not_double_counted():
    torch.manual_seed(0)
    model, x = tiny_cnn(width=8), torch.randn(2, 3, 32, 32)
    fwd = fcm_counts(model, x)
    plugin = run(model, x, selector="BasicBlock:layer2.0, Conv2d:layer2.0.conv1", backward=True)
    res = plugin.results()
    assert list(res) == ["layer2.0", "layer2.0.conv1"]
    assert res["layer2.0"]["flops"] == fwd[fcm_key(model, "layer2.0")]
    assert res["layer2.0.conv1"]["flops"] == fwd[fcm_key(model, "layer2.0.conv1")]
    assert res["layer2.0"]["flops"] > res["layer2.0.conv1"]["flops"] > 0
    assert res["layer2.0"]["backward_flops"] > res["layer2.0.conv1"]["backward_flops"] > 0
    # the total is the selected windows' (layer2.0 holds conv1): nested ops count once
    assert plugin.total()["flops"] == res["layer2.0"]["flops"] < fwd["Global"]
    assert plugin.total()["backward_flops"] == res["layer2.0"]["backward_flops"]
    full = run(model, x, backward=True).results()
    for name in res:
        assert res[name] == full[name]


def test_reset_and_repeat():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    plugin = FlopsPlugin()
    with hookplug.attach(model, ALL, plugins=plugin) as session:
        model(x).sum().backward()
        first, first_total = plugin.results(), plugin.total()
        session.reset()
        assert all(r["flops"] == r["backward_flops"] == 0 for r in plugin.results().values())
        assert plugin.results()["fc2"]["params"] == first["fc2"]["params"]
        assert plugin.total()["flops"] == 0 and plugin.uncounted() == {}
        model(x).sum().backward()
        assert plugin.results() == first and plugin.total() == first_total
        model(x).sum().backward()
        assert plugin.results()["fc2"]["flops"] == 2 * first["fc2"]["flops"]
    assert "fc2" in session.report() and "== flops ==" in session.report()
    assert "total" in plugin.report()


def test_outputs_and_grads_unchanged():
    torch.manual_seed(0)
    model = tiny_transformer(dim=32, sdpa=True)
    x = torch.randint(0, 1000, (2, 8))
    ref = model(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with hookplug.attach(model, ALL, plugins=FlopsPlugin()):
        out = model(x)
        out.sum().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))


# a custom op: torch has no formula for it
@torch.library.custom_op("flopstest::mymm", mutates_args=())
def mymm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@mymm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


class WithCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = mymm(self.lin(x), x.t().contiguous())
        return y.view(-1).reshape(4, 4).clone()


def test_uncounted_lists_ops_without_formula():
    model, x = WithCustomOp(), torch.randn(4, 8)
    plugin = run(model, x)
    unc = plugin.uncounted()
    assert unc.get("flopstest.mymm") == 1
    # views, copies and creation are not arithmetic: not listed
    for op in ("aten.view", "aten.t", "aten.clone", "aten.reshape", "aten._unsafe_view",
               "aten.contiguous"):
        assert op not in unc
    assert plugin.results()["lin"]["flops"] == 2 * 4 * 8 * 8  # the rest still counts
    assert plugin.total()["flops"] == 2 * 4 * 8 * 8
    assert "flopstest.mymm" in plugin.report()
    # a formula of one's own, with FlopCounterMode's calling convention (shapes)
    mine = run(model, x,
               formulas={torch.ops.flopstest.mymm: lambda a, b, **kw: 2 * a[0] * a[1] * b[1]})
    assert "flopstest.mymm" not in mine.uncounted()
    assert mine.results()[""]["flops"] == mine.results()["lin"]["flops"] + 2 * 4 * 8 * 4
    # a formula that fails: warned once, listed, the model's result is untouched
    with pytest.warns(RuntimeWarning, match="formula of flopstest.mymm failed"):
        broken = run(model, x, formulas={torch.ops.flopstest.mymm: lambda *a, **kw: 1 // 0})
    assert broken.uncounted()["flopstest.mymm (formula failed)"] == 1
    assert broken.total()["flops"] == 2 * 4 * 8 * 8


def test_sessions_end_in_any_order_and_count_their_windows_only():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    model, x = MLP(), torch.randn(4, 32)
    a = hookplug.attach(model, "*:fc1", plugins=FlopsPlugin())
    b = hookplug.attach(model, "*:fc2", plugins=FlopsPlugin())
    assert _get_current_dispatch_mode_stack() == []  # no mode outside a selected forward
    model(x)
    a.remove()  # the first attached ends first
    assert _get_current_dispatch_mode_stack() == []
    model(x)
    b.remove()
    assert _get_current_dispatch_mode_stack() == []
    fc1 = 2 * 4 * 32 * 64          # one fc1 call
    fc2 = 2 * 2 * 4 * 64 * 64      # fc2 runs twice per model call
    assert a["flops"].results()["fc1"]["flops"] == a["flops"].total()["flops"] == fc1
    assert b["flops"].results()["fc2"]["flops"] == b["flops"].total()["flops"] == 2 * fc2
    model(x)  # nothing counts after the end
    assert b["flops"].total()["flops"] == 2 * fc2 and a["flops"].total()["flops"] == fc1
    a.remove()  # idempotent


def test_every_n_counts_sampled_steps_only():
    model, x = MLP(), torch.randn(4, 32)
    plugin = FlopsPlugin()
    with hookplug.attach(model, ALL, plugins=plugin, every=2) as session:
        for _ in range(4):      # steps 0..3: 0 and 2 are sampled
            model(x).sum().backward()
            session.step()
    once = run(model, x, backward=True)

    def twice(r):
        return {**r, "flops": 2 * r["flops"], "macs": 2 * r["macs"],
                "backward_flops": 2 * r["backward_flops"]}

    assert plugin.total() == twice(once.total())
    assert plugin.results() == {n: twice(r) for n, r in once.results().items()}


def test_forward_in_other_thread_is_not_counted_nor_attributed():
    model, x = MLP(), torch.randn(4, 32)
    plugin = FlopsPlugin()
    with hookplug.attach(model, ALL, plugins=plugin):
        with pytest.warns(RuntimeWarning, match="ran on a thread other than the one that called attach"):
            t = threading.Thread(target=lambda: model(x))
            t.start()
            t.join()
        assert plugin.total()["flops"] == 0
        model(x)
    assert plugin.results()["fc2"]["flops"] == 2 * 2 * 4 * 64 * 64


def test_registered_entry_point():
    if "flops" not in hookplug.plugin_names():
        pytest.skip("hookplug is not installed (no entry points)")
    model, x = MLP(), torch.randn(4, 32)
    with hookplug.attach(model, "Linear", plugins="flops") as session:
        model(x)
    assert session["flops"].results()["fc2"]["flops"] == 2 * 2 * 4 * 64 * 64


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sdpa_and_backward_thread():
    eager, sdpa = (m.cuda() for m in _encoder_pair(dim=64))
    x = torch.randn(2, 16, 64, device="cuda")
    pe = run(eager, x, backward=True)
    ps = run(sdpa, x, backward=True)
    assert ps.results()[""]["flops"] == pe.results()[""]["flops"]
    # the CUDA backward runs on an engine thread: it is still seen and attributed
    fcm = fcm_counts(sdpa, x, backward=True)["Global"]
    assert ps.total()["flops"] + ps.total()["backward_flops"] >= fcm
    assert ps.results()["ff1"]["backward_flops"] == 2 * ps.results()["ff1"]["flops"] > 0


class DataAndArithmetic(nn.Module):
    """Ops that only create or move data beside ops that compute."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, idx):
        x = self.emb(idx)                                       # embedding
        x = torch.cat([x, torch.zeros_like(x)], dim=-1)[..., :8]  # cat, zeros_like, slice
        x = F.pad(x, (1, 1))[..., 1:-1].clone()                 # constant_pad_nd, clone
        pick = torch.zeros_like(idx[:2]).unsqueeze(-1).expand(2, idx.shape[1], 8)
        x = x.index_select(0, torch.tensor([0, 1])).gather(-1, pick)  # index_select, gather
        x = torch.where(x > 0, x, x.flip(-1)).repeat(1, 1, 1).tril()  # gt, where, flip, tril
        x = x.masked_fill(x < -1, 0.0).to(torch.float64).float()  # masked_fill, _to_copy
        x = F.relu(x + torch.rand_like(x), inplace=True)         # rand_like, add, relu_
        x = x + torch.empty_like(x).fill_(1.0)                   # empty_like, fill_ (add again)
        return F.silu(self.norm(x)).softmax(-1).sum()            # layer_norm, silu, softmax, sum


def test_uncounted_classified_from_tags_and_schemas():
    plugin = run(DataAndArithmetic(), torch.randint(0, 10, (3, 5)))
    listed = set(plugin.uncounted())
    arithmetic = {"aten.native_layer_norm", "aten.silu", "aten._softmax", "aten.sum",
                  "aten.add", "aten.gt", "aten.lt", "aten.relu_"}
    assert arithmetic <= listed, arithmetic - listed
    moving = {"aten.embedding", "aten.cat", "aten.zeros_like", "aten.slice", "aten.constant_pad_nd",
              "aten.clone", "aten.index_select", "aten.gather", "aten.expand", "aten.where",
              "aten.flip", "aten.repeat", "aten.tril", "aten.masked_fill", "aten._to_copy",
              "aten.rand_like", "aten.uniform_", "aten.empty_like", "aten.lift_fresh",
              "aten.unsqueeze", "aten.view", "aten._unsafe_view", "aten.fill_"}
    assert not (moving & listed), moving & listed
    # everything listed is arithmetic by torch's own tags, or has no tag saying otherwise
    for name in listed:
        packet = getattr(torch.ops.aten, name.split(".", 1)[1])
        tags = {t for ov in packet.overloads() for t in getattr(packet, ov).tags}
        assert not tags & {torch.Tag.view_copy, torch.Tag.nondeterministic_seeded,
                           torch.Tag.data_dependent_output, torch.Tag.inplace_view}, name
    from hookplug_plugins.flops import _does_arithmetic
    # split/select/slice backward copies are data movement; an attention kernel seeded for
    # its dropout is arithmetic
    aten = torch.ops.aten
    for op in (aten.unsafe_split.Tensor, aten.unsafe_chunk.default, aten.slice_backward.default,
               aten.select_backward.default, aten.diagonal_backward.default):
        assert not _does_arithmetic(op), op
    assert _does_arithmetic(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not _does_arithmetic(aten.bernoulli_.float) and not _does_arithmetic(aten.native_dropout.default)
    # communication is data movement (under DDP/FSDP2/TP uncounted() listed the collectives)
    for op in (torch.ops.c10d._allgather_base_.default, torch.ops.c10d.allreduce_.default,
               torch.ops._c10d_functional.all_reduce.default,
               torch.ops._c10d_functional.wait_tensor.default):
        assert not _does_arithmetic(op), op
    # foreach copies are copies (FSDP2's all-gather copy-in); foreach arithmetic is not
    assert not _does_arithmetic(aten._foreach_copy_.default)
    assert _does_arithmetic(aten._foreach_add_.List) and _does_arithmetic(aten._foreach_mul.Scalar)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                    for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@pytest.mark.parametrize("how", ["whole", "per-block"])
def test_flops_under_torch_compile_equal_eager_and_the_flop_counter(how):
    """flops keeps Python state per call (traceable = False): under torch.compile its hooks
    run outside the graph and count what eager code counts, forward and backward, equal to
    FlopCounterMode; fullgraph=True refuses with an error naming the plugin (it failed
    inside dynamo with one that did not)."""
    torch.manual_seed(0)
    base, x = _Blocks(), torch.randn(8, 16)

    def run(compiled):
        m = copy.deepcopy(base)
        model = m
        if compiled and how == "whole":
            model = torch.compile(m, backend="aot_eager")
        elif compiled:
            for b in m.blocks:
                b.compile(backend="aot_eager")
        with hookplug.attach(m, "Linear, Sequential", plugins="flops") as s:
            model(x).sum().backward()
        torch._dynamo.reset()
        return s["flops"].results(), s["flops"].total()

    (eager, total), (compiled, compiled_total) = run(False), run(True)
    assert compiled == eager and compiled_total == total
    with FlopCounterMode(display=False) as fc:
        base(x).sum().backward()
    assert total["flops"] + total["backward_flops"] == fc.get_total_flops() > 0
    m = copy.deepcopy(base)
    with hookplug.attach(m, "Linear", plugins="flops"):
        with pytest.raises(Exception, match="plugin 'flops' sets traceable = False"):
            torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()


def test_flops_in_a_compiled_training_step_run_their_backward_hooks_as_eager_code():
    """A whole training step compiled (``loss.backward()`` a graph break, then the optimizer
    step): the backward runs with dynamo's frame hook on, and dynamo converted the node
    hooks' frames (a graph break of their own in each, 12 breaks for 7). The breaks are
    the step's own and the eager runners', the counts eager's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base, x = MLP(), torch.randn(8, 32)
    out = {}
    for mode in ("eager", "plain", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step():
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        fn = step if mode == "eager" else torch.compile(step, backend="aot_eager")
        if mode == "plain":
            for _ in range(2):
                fn()
            out[mode] = None
        else:
            with hookplug.attach(m, "Linear", plugins="flops") as s:
                for _ in range(2):
                    fn()
                    s.step()
            out[mode] = s["flops"].results()
        out[mode, "breaks"] = {k.splitlines()[0] for k in counters["graph_break"]}
    torch._dynamo.reset()
    assert out["compiled"] == out["eager"] and out["eager"]["fc2"]["backward_flops"] > 0
    runner = "Skip calling `torch.compiler.disable()`d function"
    assert out["compiled", "breaks"] == out["plain", "breaks"] | {runner}


class _CheckpointedEncoder(nn.Module):
    """🤗-style gradient checkpointing: the encoder (a selected module) checkpoints each of
    its layers; the head runs outside any checkpoint."""

    def __init__(self, reentrant=None, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(EncoderLayer(dim, 2, 2 * dim, sdpa=False) for _ in range(2))
        self.head = nn.Linear(dim, 3)
        self.reentrant = reentrant  # None: no checkpoint

    def encode(self, x):
        for layer in self.layers:
            x = layer(x) if self.reentrant is None else torch.utils.checkpoint.checkpoint(
                layer, x, use_reentrant=self.reentrant)
        return x

    def forward(self, x):
        return self.head(self.encode(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recompute_counts_as_backward_of_the_modules_it_reruns(reentrant):
    """Activation checkpointing: the forward counts once; the recompute's ops count as
    backward FLOPs of each module it re-runs and of the modules around the checkpoint, so a
    module's backward is its plain backward plus its own forward, and the session's total is
    FlopCounterMode's (it counted 0 for the layers under a reentrant checkpoint before)."""
    x = torch.randn(2, 5, 16, requires_grad=True)  # (a reentrant checkpoint needs one)

    def counts(ckpt):
        model = _CheckpointedEncoder(ckpt)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            plugin = run(model, x, backward=True, extra_formulas=False)  # as FlopCounterMode
        return plugin.results(), plugin.total()

    (plain, plain_total), (res, total) = counts(None), counts(reentrant)
    assert {n: r["flops"] for n, r in res.items()} == {n: r["flops"] for n, r in plain.items()}
    rerun = {n: r["flops"] if n.startswith("layers.") else 0 for n, r in plain.items()}
    rerun[""] = sum(r["flops"] for n, r in plain.items() if n.count(".") == 1 and n.startswith("layers."))
    assert rerun[""] > rerun["layers.0"] > rerun["layers.0.query"] > 0
    assert {n: r["backward_flops"] for n, r in res.items()} == {
        n: r["backward_flops"] + rerun[n] for n, r in plain.items()}
    assert total["backward_flops"] == plain_total["backward_flops"] + rerun[""]
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), FlopCounterMode(display=False) as fc:
        _CheckpointedEncoder(reentrant)(x).sum().backward()
    assert total["flops"] + total["backward_flops"] == fc.get_total_flops()


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _SquareAct(nn.Module):
    def forward(self, x):
        return _Square.apply(x)


def test_non_reentrant_recompute_unpacked_by_a_custom_function_is_charged_to_the_modules_rerun():
    """A custom ``autograd.Function`` (a fused kernel, flash-attn) inside a block under
    ``use_reentrant=False`` unpacks first: the recompute is still the non-reentrant one, so
    that module gets no FLOPs of the recompute (it got all of them, taken for a reentrant
    checkpoint's node)."""
    x = torch.randn(4, 8, requires_grad=True)

    def counts(ckpt):
        torch.manual_seed(0)
        blk = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), _SquareAct())
        model = nn.Sequential(blk)
        forward = (lambda t: torch.utils.checkpoint.checkpoint(blk, t, use_reentrant=False)) if ckpt else blk
        plugin = FlopsPlugin(extra_formulas=False)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False), \
                hookplug.attach(model, "Linear, _SquareAct", plugins=plugin):
            forward(x).sum().backward()
        return plugin.results()

    plain, ckpt = counts(False), counts(True)
    assert ckpt["0.2"]["backward_flops"] == plain["0.2"]["backward_flops"] == 0
    for name in ("0.0", "0.1"):
        assert ckpt[name]["backward_flops"] == plain[name]["backward_flops"] + plain[name]["flops"] > 0


class _AtenFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op's FLOPs by FlopCounterMode's own formulas, with no module tracking (which
    ``autograd.grad(create_graph=True)`` trips in FlopCounterMode itself)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            def shape(t):
                return t.shape if isinstance(t, torch.Tensor) else t
            self.total += formula(*tree_map(shape, args), **tree_map(shape, kwargs), out_val=tree_map(shape, out))
        return out


@pytest.mark.parametrize("form", ["backward", "autograd.grad"])
def test_a_gradient_penalty_counts_its_second_order_backward(form):
    """Under ``create_graph=True`` a node's backward builds a graph whose second backward is
    the model's work too (WGAN-GP, input-gradient penalties); those nodes got no window:
    1840 of FlopCounterMode's 2560 for this MLP."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x0 = torch.randn(5, 4)

    def penalty():
        x = x0.clone().requires_grad_()
        if form == "backward":
            m(x).sum().backward(create_graph=True)
            g, x.grad = x.grad, None
        else:
            g, = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        (g.norm(dim=1) - 1).pow(2).mean().backward()
        m.zero_grad(set_to_none=True)

    with _AtenFlops() as ref:
        penalty()
    with hookplug.attach(m, "*, *:", plugins="flops") as s:
        penalty()
    t = s["flops"].total()
    assert t["flops"] + t["backward_flops"] == ref.total
    per = s["flops"].results()
    assert per["0"]["backward_flops"] + per["2"]["backward_flops"] == t["backward_flops"]
    if form == "backward":
        with FlopCounterMode(display=False) as fc:
            penalty()
        assert fc.get_total_flops() == ref.total


class _Halves(nn.Module):
    def forward(self, x):
        return x.chunk(2, dim=-1)  # one node (SplitBackward), two outputs


class _HalfUsed(nn.Module):
    """A module with two outputs of one autograd node, only the first reaching the loss:
    torch calls the second output's tensor hook with ``None`` (T5 blocks under 🤗 gradient
    checkpointing: the position bias a later block returns and nothing reads)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.halves = _Halves()
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        a, _unused = self.halves(self.lin(x))
        return self.out(a)


def test_an_output_no_gradient_reaches_is_skipped_by_grad_hooks():
    """With stats, capture and flops on every module (as tests/test_real_models.py), backward
    through a module whose second output got no gradient failed in the stats plugin
    (``'NoneType' object has no attribute 'dtype'``); capture and gradclamp failed too."""
    torch.manual_seed(0)
    model, x = _HalfUsed(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    fwd = fcm_counts(model, x)
    plugins = [("stats", {"sites": ("output", "grad")}), ("capture", {"keep": "all", "grads": True}),
               ("gradclamp", {"max": 1e9}), ("flops", {"extra_formulas": False})]
    with hookplug.attach(model, ALL, plugins=plugins) as s:
        model(x).sum().backward()
        s.step()
        stats, grads, flops = s["stats"].results(), s["capture"].grads, s["flops"].results()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert set(stats["halves"]) == {"output[0]", "output[1]", "grad[0]"}  # no grad[1]
    g0, g1 = grads["halves"][0]
    assert g1 is None and g0.shape == (4, 4)
    assert flops["lin"]["flops"] == fwd[fcm_key(model, "lin")] > 0
    assert flops["lin"]["backward_flops"] == flops["lin"]["flops"]  # (x needs no grad)


class _AfterTranspose(nn.Module):
    """A Linear on a non-contiguous 3-d input (after a transpose, as on an RNN's or a conv's
    output): ``aten.linear`` and ``aten.matmul`` run composite, and what they run inside
    depends on whether a dispatch mode is active (folding the batch into one ``mm``, or not)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 4)
        self.gru = nn.GRU(4, 8, batch_first=True)

    def forward(self, x):
        y = self.proj(x.transpose(1, 2))
        return self.gru(y)[0] @ self.proj.weight[:, :8].t()


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_sdpa_without_extra_formulas_counts_as_flop_counter_mode_in_every_mode(mode):
    """``extra_formulas=False`` is torch's registry: under inference_mode SDPA's decomposition
    was counted on meta copies, where it takes the math path (bmm: counted) where torch runs
    its CPU flash kernel (no formula: 0); that kernel, seeded for its dropout, was not listed
    in ``uncounted()`` as an op without a formula."""
    model, x = tiny_transformer(dim=32, sdpa=True), torch.randint(0, 1000, (2, 8))
    context = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context():
        fcm = fcm_counts(model, x)
        plugin = run(model, x, extra_formulas=False)
        counted = run(model, x)
    assert plugin.total()["flops"] == fcm["Global"]
    kernels = [op for op in plugin.uncounted() if "scaled_dot_product" in op]
    # the CPU kernel torch ran, which FlopCounterMode has no formula for, is listed; the
    # default counts its attention matmuls
    assert bool(kernels) == (counted.total()["flops"] > plugin.total()["flops"])


def test_inference_mode_decomposition_leaves_results_bitwise():
    """Under ``inference_mode`` composite ops reach the dispatch mode undecomposed; running
    their decomposition inside it took other kernels (``bmm`` where torch folds into ``mm``):
    outputs differed in their last bits from the model's without the plugin. They run as
    torch runs them; the decomposition only counts (as FlopCounterMode's)."""
    torch.manual_seed(0)
    model, x = _AfterTranspose().eval(), torch.randn(3, 16, 5)
    with torch.inference_mode():
        ref = model(x)
        fcm = fcm_counts(model, x)
        plugin = run(model, x, extra_formulas=False)
        out = model(x)  # the plugin's session is over: plain again
        with hookplug.attach(model, ALL, plugins="flops"):
            got = model(x)
    assert torch.equal(out, ref)
    assert torch.equal(got, ref)
    res = plugin.results()
    for name in ("", "proj", "gru"):
        assert res[name]["flops"] == fcm[fcm_key(model, name)] > 0, name
    assert plugin.total()["flops"] == fcm["Global"]
    plain = run(model, x, extra_formulas=False)  # autograd on: decomposed by torch itself
    assert {n: r["flops"] for n, r in plain.results().items()} == {n: r["flops"] for n, r in res.items()}


class _Composites(nn.Module):
    """Composite ops that autocast does not cast but whose inner matmuls it does, one in a
    block of the model's own with autocast off (as Llama's rotary embedding)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.lin = nn.Linear(16, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.bil = nn.Bilinear(16, 16, 8)

    def forward(self, x):
        y = torch.einsum("bi,ij->bj", x, self.w)
        with torch.autocast(x.device.type, enabled=False):
            z = torch.einsum("bi,ij->bj", x.float(), self.w)  # plain float32 here
        t = torch.tensordot(x, self.w, dims=1)
        g, _ = self.gru(x[:, None, :])
        mixed = torch.einsum("bi,ij->bj", self.lin(x), self.w)  # bfloat16 and float32 inputs
        return self.lin(y), z, t, g, self.bil(x, x), mixed


def test_autocast_under_inference_mode_leaves_results_bitwise():
    """Inside a dispatch mode torch excludes the autocast keys: a composite op reaching it
    whole under inference_mode ran its matmuls in float32 (einsum's output float32 where the
    plain model's is bfloat16). Autocast's state, noted in the selected modules' hooks, is put
    back around the op; the model's own autocast(enabled=False) block stays off."""
    torch.manual_seed(0)
    model, x = _Composites().eval(), torch.randn(4, 16)

    def forward():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    ref = ref_autocast = forward()
    assert ref[0].dtype == torch.bfloat16 and ref[1].dtype == torch.float32
    stack = torch._C._len_torch_function_stack()
    with hookplug.attach(model, ALL, plugins="flops") as session:
        got = forward()
        assert torch._C._len_torch_function_stack() == stack  # (no mode of its own there)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autograd decomposes first
        plain = run(model, x)
    assert session["flops"].results() == plain.results() and session["flops"].total()["flops"] > 0
    with torch.inference_mode():  # no autocast: no watch
        ref = model(x)
        with hookplug.attach(model, ALL, plugins="flops"):
            assert all(torch.equal(a, b) for a, b in zip(ref, model(x)))

    # torch's fast paths stay on (a TorchFunctionMode on the stack turned MultiheadAttention's
    # off: other numerics, and nested inputs refused)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    nested = torch.nested.nested_tensor([torch.randn(5, 16), torch.randn(3, 16)])
    for q in (torch.randn(2, 5, 16), nested):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = mha(q, q, q, need_weights=False)[0]
            with hookplug.attach(mha, "*:", plugins="flops"):
                got = mha(q, q, q, need_weights=False)[0]
        if q.is_nested:
            want, got = torch.cat(want.unbind()), torch.cat(got.unbind())
        assert torch.equal(want, got)

    class Inner(nn.Module):  # autocast entered inside the window, around a selected module
        def __init__(self):
            super().__init__()
            self.body = _Composites()

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.body(x)

    inner = Inner().eval()
    with torch.inference_mode():
        want = inner(x)
        with hookplug.attach(inner, ALL, plugins="flops"):
            got = inner(x)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got))

    class AmpAdapter(nn.Module):  # a selected Linear run in an autocast block of its own...
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(x)

    class Rotary(nn.Module):  # ...then, at the same nesting depth, a block with autocast off
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return torch.einsum("bi,ij->bj", x.float(), torch.ones(16, 4)).cos()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ad, self.rot = AmpAdapter(), Rotary()
            self.enc = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)

        def forward(self, x):  # (the encoder layer, unhooked, takes its fast path)
            h = self.ad(x)
            return self.rot(h), self.enc(h[:, None, :].float()).squeeze(1)

    layer = Layer().eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        with hookplug.attach(layer, "*:, Linear:ad.*", plugins="flops"):
            got = layer(x)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got))

    class Island(nn.Module):  # two flops plugins, one on the Linear only: its window's note
        def __init__(self):  # (autocast on, in the model's own block) ends with its window
            super().__init__()
            self.w, self.lin = nn.Parameter(torch.randn(16, 16)), nn.Linear(16, 16)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.lin(x)
            with torch.autocast("cpu", enabled=False):  # a float32 island
                return torch.mm(h.float(), self.w)

    island = Island().eval()
    with torch.inference_mode():
        want = island(x)
        for outer in ("*:", "*:, *:lin"):  # (the Linear's own call noted by the outer plugin too)
            for first in (0, 1):  # (hooks run in attach order: windows close out of order)
                with contextlib.ExitStack() as sessions:
                    for i in ((0, 1) if first == 0 else (1, 0)):
                        sessions.enter_context(hookplug.attach(*((island, outer) if i == 0 else (island.lin, "*:")),
                                                               plugins="flops"))
                    got = island(x)
                assert want.dtype == got.dtype == torch.float32 and torch.equal(want, got), (outer, first)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    with hookplug.attach(model, ALL, plugins="flops"):  # a forward left by Ctrl-C
        handle = model.gru.register_forward_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            forward()
        handle.remove()
        assert all(torch.equal(a, b) for a, b in zip(ref_autocast, forward()))
        assert torch._C._len_torch_function_stack() == stack


def test_inference_mode_counts_a_composite_on_meta_copies_and_draws_no_random_number(monkeypatch):
    """The decomposition counted after the op ran is run on ``meta`` copies of its inputs: no
    second matmul on the data, no random draw (a dropout in train mode under
    ``inference_mode`` gives the output of the model without the plugin, and so does the
    next random number); an RNN's, many small ops, runs on the inputs with the random state
    restored."""
    import hookplug_plugins.flops as flops_module

    reruns = []
    real = flops_module._restored_rng
    monkeypatch.setattr(flops_module, "_restored_rng", lambda func, *a: reruns.append(str(func)) or real(func, *a))

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            return F.dropout(self.proj(x.transpose(1, 2)), 0.5, training=True)

    model, x = Drop(), torch.randn(3, 16, 16)
    with torch.inference_mode():
        torch.manual_seed(1)
        ref, after = model(x), torch.rand(3)
        fcm = fcm_counts(model, x)
        torch.manual_seed(1)
        with hookplug.attach(model, ALL, plugins="flops") as s:
            got, got_after = model(x), torch.rand(3)
        assert s["flops"].total()["flops"] == fcm["Global"] > 0
    assert torch.equal(got, ref) and torch.equal(got_after, after)
    assert reruns == []  # linear and dropout counted on meta
    with torch.inference_mode():
        run(_AfterTranspose().eval(), torch.randn(3, 16, 5), extra_formulas=False)
    assert reruns and all("gru" in r for r in reruns)


def test_count_flops_backward_without_a_graph_says_so():
    """A model whose outputs need no grad (frozen) raised ``'int' object has no attribute
    'backward'``."""
    model = nn.Linear(4, 3).requires_grad_(False)
    with pytest.raises(ValueError, match=r"count_flops\(backward=True\): no output of the model requires grad"):
        count_flops(model, torch.randn(2, 4), backward=True)
    assert count_flops(model, torch.randn(2, 4)).total()["flops"] == 2 * 2 * 4 * 3
