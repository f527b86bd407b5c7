"""The CUDA promises of the README that no other test ran on a GPU, each checked against a
reference (float64 torch, the same model on the CPU, a run without hooks).

Most tests are parametrized over ``DEVICES`` (conftest): the CPU half runs everywhere and
proves the test's logic, the CUDA half runs where a GPU (and for op-level tests the CUDA
kernels) exist. Each CUDA case is small: a few seconds on a GPU.
"""
import contextlib
import math

import pytest
import torch
from conftest import DEVICES, RecordSink
from test_ops import DEVICES as OP_DEVICES
from test_ops import assert_matches, gen, needs_ext, planted
from test_params import _check_scaler_steps, model_and_data
from test_telemetry import assert_record_matches
from torch import nn

import hookplug
from hookplug import ops
from hookplug.models import MLP

CUDA = torch.cuda.is_available()
TWO_GPUS = CUDA and torch.cuda.device_count() >= 2


def _cuda_param(*values, two=False):
    reason = "needs two CUDA GPUs" if two else "needs a CUDA GPU"
    return pytest.param(*values, marks=[pytest.mark.cuda, pytest.mark.skipif(
        not (TWO_GPUS if two else CUDA), reason=reason)])


@contextlib.contextmanager
def _no_sync(device):
    """On CUDA: any host sync inside raises (``set_sync_debug_mode("error")``)."""
    if torch.device(device).type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _keyed(records):
    out = {}
    for r in records:
        key = (r["step"], r["module"], r["site"], r["phase"])
        assert key not in out, f"record {key} emitted twice"
        out[key] = r
    return out


_EXACT = ("numel", "nan_count", "inf_count", "zero_count", "calls", "first_nonfinite")
_CLOSE = ("min", "max", "mean", "std", "absmax", "l2", "rms")


def _assert_same_records(got, want, *, rel=1e-9):
    """Two runs' telemetry: the same keys, counts exactly, values to ``rel`` of their scale
    (float64 models: CPU and CUDA kernels round matmuls differently in the last bits)."""
    g, w = _keyed(got), _keyed(want)
    assert set(g) == set(w), (sorted(set(g) ^ set(w)))
    for k in w:
        a, b = g[k], w[k]
        for f in _EXACT:
            assert a[f] == b[f], (k, f, a[f], b[f])
        scale = max(abs(b["absmax"]) if math.isfinite(b["absmax"]) else 0.0, 1e-30)
        for f in _CLOSE:
            if math.isnan(b[f]):
                assert math.isnan(a[f]), (k, f, a[f])
            else:
                assert math.isclose(a[f], b[f], rel_tol=rel, abs_tol=rel * scale), (k, f, a[f], b[f])
        assert a["hist_edges"] == b["hist_edges"], k
        assert sum(a["hist"]) == sum(b["hist"]), k


# -- the op on a tensor whose elements are not aligned to their size ----------------------------

def _assert_same_rows(a: torch.Tensor, b: torch.Tensor, msg) -> None:
    """Rows equal: bitwise but for the mean and M2, within float64 rounding (a GPU splits a
    misaligned tensor over its threads otherwise than an aligned one: its copy starts at
    another address, so the partial sums are merged in another order)."""
    from hookplug._stats import M2, MEAN

    a, b = a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0)
    moments = torch.zeros(a.shape[-1], dtype=torch.bool, device=a.device)
    moments[[MEAN, M2]] = True
    assert torch.equal(a[..., ~moments], b[..., ~moments]), msg
    assert torch.allclose(a[..., moments], b[..., moments], rtol=1e-12, atol=0), msg


@needs_ext
@pytest.mark.parametrize("device", OP_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_misaligned_tensor_stats_equal_the_aligned_copy(device, dtype):
    """A tensor ``set_`` on a byte-offset slice of a uint8 storage: its elements sit at
    addresses no multiple of their size (a load of one faults on a GPU; the binding copies
    it aligned). ``tensor_stats`` and ``accumulate_`` give the float64 reference and the
    same as the aligned copy, contiguous and strided."""
    size = torch.tensor([], dtype=dtype).element_size()
    n = 70_001
    src = planted(n, dtype, gen(500), offset=0.5)
    src[::101] = math.nan
    src[1::103] = math.inf
    for off in range(1, size):
        u8 = torch.zeros(n * size + size, dtype=torch.uint8, device=device)
        u8[off:off + n * size] = src.view(torch.uint8).to(device)
        views = {
            "contiguous": (n,), "strided": ((n + 1) // 2,),
        }
        for name, shape in views.items():
            stride = (1,) if name == "contiguous" else (2,)
            x = torch.empty(0, dtype=dtype, device=device).set_(u8.untyped_storage()[off:], 0, shape, stride)
            assert x.data_ptr() % size == off
            # the same layout, aligned, copied from the host (a device copy of x would run
            # torch's elementwise kernel on misaligned elements)
            aligned = src.to(device)[::stride[0]]
            on_host = torch.empty(0, dtype=dtype).set_(u8.cpu().untyped_storage()[off:], 0, shape, stride)
            assert torch.equal(on_host.contiguous().view(torch.uint8), aligned.cpu().contiguous().view(torch.uint8))
            for kw in ({}, {"bins": 0}, {"hist": "linear", "bins": 16, "range": (-4.0, 4.0)}):
                st = ops.tensor_stats(x, **kw)
                assert_matches(st, aligned, **kw, msg=f"{name} offset {off}")
                want = ops.tensor_stats(aligned, **kw)
                _assert_same_rows(st.row, want.row, (name, off, kw))
            from hookplug._stats import empty_rows
            nb = ops.buckets(None, "log2")
            accs = [empty_rows(3, nb, *ops.log2_edges()[[0, -1]].tolist(), device=device) for _ in range(2)]
            # x[5:] is copied aligned by the binding: its reference is a fresh copy too (a view
            # 5 elements into an aligned one starts with a scalar head on a GPU: the planted
            # +-max values then cancel in another order, the means differ entirely)
            tail = src[5 * stride[0]:].to(device)[::stride[0]]
            for acc, (t, t5) in zip(accs, ((x, x[5:]), (aligned, tail))):
                ops.accumulate_(t, acc, 1)
                ops.accumulate_(t5, acc, 1)
            _assert_same_rows(accs[0], accs[1], (name, off))
    if device != "cpu":  # and equal to the CPU kernel on the same values
        cpu = ops.tensor_stats(src)
        gpu = ops.tensor_stats(x.new_empty(0).set_(u8.untyped_storage()[size - 1:], 0, (n,), (1,)))
        for f in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "hist_counts"):
            assert torch.equal(getattr(gpu, f).cpu(), getattr(cpu, f)), f


# -- telemetry from a CUDA model equals the same model's on the CPU ----------------------------------

def _mlp64(device):
    torch.manual_seed(0)
    return MLP().double().to(device)


def _train(m, s, opt, xs, device, *, evals, sync_free_from):
    """Training steps on ``xs``, an evaluation forward under inference_mode after the
    optimizer step of each step in ``evals``; on CUDA the steps from ``sync_free_from`` on
    under ``set_sync_debug_mode("error")``."""
    for step, x in enumerate(xs):
        with _no_sync(device) if step >= sync_free_from else contextlib.nullcontext():
            m(x).square().mean().backward()
            opt.step()
            if step in evals:
                m.eval()
                with torch.inference_mode():
                    m(x * 0.5)
                m.train()
            s.step()
            opt.zero_grad(set_to_none=True)


def _telemetry_run(device, steps=5):
    """A float64 MLP trained with stats (outputs, grads), params and every=2, flush_every=2,
    an eval forward under inference_mode at steps 0 and 2, a NaN in the last step's input;
    on CUDA every step after the first under ``set_sync_debug_mode("error")``."""
    m = _mlp64(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 32, generator=g, dtype=torch.float64) for _ in range(steps)]
    xs[-1][3, 5] = math.nan
    xs = [x.to(device) for x in xs]  # (a copy from pageable memory would sync: before the loop)
    sink = RecordSink()
    with hookplug.attach(m, "Linear", plugins=[("stats", {"sites": ("output", "grad")}), "params"],
                         every=2, flush_every=2, sink=sink) as s:
        _train(m, s, opt, xs, device, evals=(0, 2), sync_free_from=1)
        s.flush()  # wait=True: may sync
        nonfinite = s.nonfinite
        res_dev = {k: v["output"].mean.device.type for k, v in s["stats"].results().items()}
    return sink.records, nonfinite, res_dev


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_telemetry_equals_cpu_telemetry_of_the_same_float64_model(device):
    """Records (stats and params, train and eval, sampled steps only), ``first_nonfinite``
    and ``session.nonfinite`` from the device equal those of the same model on the CPU; the
    training steps never sync (the flush's copy is non-blocking into pinned memory)."""
    got, nonfinite, res_dev = _telemetry_run(device)
    want, nonfinite_cpu, _ = _telemetry_run("cpu")
    _assert_same_records(got, want)
    assert {r["step"] for r in got} == {0, 2, 4}  # every=2
    assert {r["phase"] for r in got} == {"train", "eval"}
    assert {r["site"] for r in got} == {"output", "grad", "weight", "update"}
    first = [(r["step"], r["module"], r["site"]) for r in got if r["first_nonfinite"]]
    assert first == [(4, "fc1", "output")]
    assert nonfinite == nonfinite_cpu and [(d["step"], d["module"]) for d in nonfinite] == [(4, "fc1")]
    assert set(res_dev.values()) == {torch.device(device).type}  # results stay on the device


def _late_rows_run(device):
    torch.manual_seed(0)
    m = MLP().double()
    sink = RecordSink()
    s = hookplug.attach(m, "Linear", plugins=[("stats", {"sites": ("output", "grad")}), "params"],
                        flush_every=2, sink=sink)
    m.to(device)  # after attach: the device's bank is made in the first hooked call
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    with s:  # an evaluation first met at step 2: new rows, new row tensors
        _train(m, s, opt, [x] * 4, device, evals=(2,), sync_free_from=0)
    return sink.records


@pytest.mark.parametrize("device", DEVICES)
def test_a_bank_made_in_a_hook_and_rows_met_late_do_not_sync(device):
    """Attached before the model moves to the device (its bank is made inside the first
    hooked call) and an evaluation first met after some steps (its rows, and the row
    tensors the next step() makes for them): no host sync anywhere in the loop; empty rows,
    gates and row indices are filled on the device, never copied from pageable host memory
    (which waits for the stream). The records equal the CPU run's."""
    got = _late_rows_run(device)
    _assert_same_records(got, _late_rows_run("cpu"))
    assert {(r["step"], r["phase"]) for r in got if r["site"] == "output"} == {
        (0, "train"), (1, "train"), (2, "train"), (2, "eval"), (3, "train")}


# -- a model split over devices ---------------------------------------------------------------------

class _Split(nn.Module):
    def __init__(self, dev_a, dev_b):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32)).double().to(dev_a)
        self.b = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).double().to(dev_b)
        self.dev_a, self.dev_b = torch.device(dev_a), torch.device(dev_b)

    def forward(self, x):
        return self.b(self.a(x.to(self.dev_a)).to(self.dev_b))


def _split_run(dev_a, dev_b):
    m = _Split(dev_a, dev_b)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    sink = RecordSink()
    with hookplug.attach(m, "Linear", plugins=[("stats", {"sites": ("output", "grad")}), "params"],
                         flush_every=1, sink=sink) as s:
        for _ in range(3):
            m(torch.randn(8, 16, generator=g, dtype=torch.float64)).square().mean().backward()
            opt.step()
            s.step()
            opt.zero_grad()
        params = s["params"].results()
        devs = {n: st["weight"].mean.device for n, st in params.items()}
    return sink.records, devs


@pytest.mark.parametrize("dev_a, dev_b", [("cpu", "cpu"), _cuda_param("cpu", "cuda"), _cuda_param("cuda", "cpu"),
                                          _cuda_param("cuda:0", "cuda:1", two=True)])
def test_model_split_over_devices_gives_the_records_of_one_device(dev_a, dev_b):
    """Layers on two devices (the CPU and a GPU, or two GPUs): stats rows live on each
    layer's device, params measure each parameter where it is (its ``results()`` merge the
    devices' rows on the first's); one flush packs and copies each device's rows, and the
    records equal the all-CPU model's."""
    got, devs = _split_run(dev_a, dev_b)
    want, _ = _split_run("cpu", "cpu")
    _assert_same_records(got, want)
    assert len(_keyed(got)) == 3 * (4 * 2 + 8 * 3)  # steps x (4 Linear x 2 sites + 8 params x 3 sites)
    want_dev = torch.device(dev_a)  # (results: every device's rows merged on the first bank's)
    for name in ("a.0.weight", "b.2.bias"):
        assert devs[name].type == want_dev.type and (want_dev.index is None or devs[name] == want_dev), name


# -- capture to the CPU from the device, with inputs and gradients ----------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_capture_to_cpu_of_inputs_outputs_and_grads_equals_plain_hooks(device):
    """``capture(to="cpu", keep="all", inputs=True, grads=True)`` during training: every
    call's input, output and output gradient (the gradients copied on autograd's device
    thread) equal what plain torch hooks saw, in pinned host memory from CUDA."""
    torch.manual_seed(0)
    m = MLP().to(device)
    seen = {"in": {}, "out": {}, "grad": {}}

    def fwd(name):
        def hook(mod, inp, out):
            seen["in"].setdefault(name, []).append(inp[0].detach().clone())
            seen["out"].setdefault(name, []).append(out.detach().clone())
            i = len(seen["out"][name]) - 1
            out.register_hook(lambda g: seen["grad"].setdefault(name, {}).__setitem__(i, g.clone()))
        return hook

    handles = [mod.register_forward_hook(fwd(n)) for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
    opts = {"to": "cpu", "keep": "all", "inputs": True, "grads": True}
    with hookplug.attach(m, "Linear", plugins=("capture", opts)) as s:
        for step in range(2):
            m(torch.randn(8, 32, device=device) * (step + 1)).square().mean().backward()
            s.step()
        cap = s["capture"]
        feats, inputs, grads = cap.features, cap.inputs, cap.grads
    for h in handles:
        h.remove()
    assert set(feats) == {"fc1", "fc2", "fc3"} and len(feats["fc2"]) == 4  # fc2: twice a forward
    for name, outs in seen["out"].items():
        assert len(feats[name]) == len(outs)
        for i, out in enumerate(outs):
            for got, want in ((feats[name][i], out), (inputs[name][i][0], seen["in"][name][i]),
                              (grads[name][i], seen["grad"][name][i])):
                assert got.device.type == "cpu" and got.is_pinned() == (device == "cuda")
                assert torch.equal(got, want.cpu()), (name, i)


# -- nonfinite="raise": at the step on the CPU, one step later on CUDA, never a sync ------------------

@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_raise_comes_at_the_step_on_cpu_and_one_step_later_on_cuda(device):
    torch.manual_seed(0)
    m = MLP().to(device)
    sink = RecordSink()
    s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad"), "nonfinite": "raise"}),
                        sink=sink, flush_every=1)
    try:
        m(torch.randn(4, 32, device=device)).sum().backward()
        s.step()  # warm-up: a clean step
        x = torch.randn(4, 32, device=device)
        x[1, 2] = math.inf
        with _no_sync(device):
            m(x).sum().backward()  # step 1: the Inf
            if device == "cpu":
                with pytest.raises(FloatingPointError, match=r"step 1.*'fc1', output \(train\)"):
                    s.step()
            else:
                s.step()  # the first_bad column's copy starts here: nothing read, no raise
                m(torch.randn(4, 32, device=device)).sum().backward()
        if device != "cpu":
            torch.cuda.synchronize()  # the copy has surely landed
            with _no_sync(device), pytest.raises(FloatingPointError, match=r"step 1.*'fc1', output \(train\)"):
                s.step()
    finally:
        s.remove()
    firsts = [(r["step"], r["module"], r["site"]) for r in sink.records if r["first_nonfinite"]]
    assert firsts == [(1, "fc1", "output")]


# -- GradScaler on the device: params' unscaled gradients, skipped steps gated on the device ---------

@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_skipped_steps_with_params_on_the_device(device, fused):
    """float16 autocast with a ``GradScaler`` on the device, steps 0 and 2 overflowing: the
    grad site is the unscaled gradient, skipped steps have no update record (a fused AdamW
    is stepped with ``found_inf`` on the device and skips there: no host sync decides it),
    and stats on the output gradients shows the scaled overflow."""
    m, x = model_and_data()
    m, x = m.to(device), x.to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    sink = RecordSink()
    want = {}
    plugins = [("params", {"params": "0.weight", "optimizer": opt}), ("stats", {"sites": ("grad",)})]
    with hookplug.attach(m, "Linear", plugins=plugins, sink=sink, flush_every=1) as s:
        for step in range(4):
            with torch.autocast(device, dtype=torch.float16):
                loss = m(x).float().square().mean() * (1e9 if step in (0, 2) else 1.0)
            scaler.scale(loss).backward()
            g = m[0].weight.grad.detach().double() / scaler.get_scale()
            w0 = m[0].weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            want[step] = ((g if fused else m[0].weight.grad.detach().clone()).cpu(), (m[0].weight.detach() - w0).cpu())
            s.step()
            opt.zero_grad()
    params = {(r["step"], r["site"]): r for r in sink.records if r["module"] == "0.weight"}
    assert {k[0] for k in params if k[1] == "grad"} == {0, 1, 2, 3}
    assert {k[0] for k in params if k[1] == "update"} == {1, 3}
    _check_scaler_steps(params, want, skipped_steps=(0, 2))
    bad = {r["step"] for r in sink.records if r["site"] == "grad" and r["module"] == "2"
           and r["inf_count"] + r["nan_count"] > 0}
    assert bad == {0, 2}


# -- hooks change nothing the model computes on the device -------------------------------------------

class _DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.drop = nn.Linear(32, 64), nn.LayerNorm(64), nn.Dropout(0.3)
        self.fc2, self.fc3 = nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        x = self.drop(torch.nn.functional.gelu(self.norm(self.fc1(x))))
        return self.fc3(self.drop(torch.relu(self.fc2(x))))


def _bf16_steps(device, hooked):
    torch.manual_seed(0)
    m = _DropNet().to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(32, 32, generator=g).to(device) for _ in range(3)]
    plugins = [("stats", {"sites": ("output", "grad")}), "params", ("capture", {"to": "cpu"}), "flops"]
    s = hookplug.attach(m, "*", plugins=plugins, flush_every=2, sink=RecordSink()) if hooked else None
    losses = []
    torch.manual_seed(7)  # the dropout masks
    for x in xs:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
        if s is not None:
            s.step()
    if s is not None:
        s.remove()
    return losses, grads, {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_training_with_every_plugin_is_bitwise_the_run_without_hooks(device):
    """bf16 autocast, dropout (flops' counting must not move the device's RNG), stats on
    outputs and gradients, params, capture to the CPU and flops on every module: losses,
    gradients and weights after 3 AdamW steps are bitwise those of the run without hooks."""
    plain, hooked = _bf16_steps(device, False), _bf16_steps(device, True)
    for a, b in zip(plain[0], hooked[0]):
        assert torch.equal(a, b)
    for d_plain, d_hooked in zip(plain[1:], hooked[1:]):
        assert d_plain.keys() == d_hooked.keys()
        for n in d_plain:
            assert torch.equal(d_plain[n], d_hooked[n]), n


# -- flops on the device equal FlopCounterMode ------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_flops_on_the_device_equal_flop_counter_mode(device):
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    m = MLP().to(device)
    x = torch.randn(16, 32, device=device)
    with FlopCounterMode(display=False) as fcm:
        m(x)
    want = {k.split(".")[-1]: sum(v.values()) for k, v in fcm.get_flop_counts().items() if k != "Global"}
    with hookplug.attach(m, "Linear", plugins="flops") as s:
        m(x).sum().backward()
    res = s["flops"].results()
    for name in ("fc1", "fc2", "fc3"):
        assert res[name]["flops"] == want[name] > 0, name
        assert res[name]["backward_flops"] > 0


# -- the bank on the device: materialized from meta, moved after attach, grown mid-step -------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["direct", "meta", "moved"])
def test_bank_follows_the_model_to_its_device(device, how):
    """Attached to the model on the device (reference), attached on ``meta`` and
    materialized there with ``to_empty`` + ``load_state_dict`` (README, "Deferred init"), or
    attached on the CPU and moved with ``.to(device)`` (rows are per device: the split-model
    case): the same records, from rows on the device."""
    def build(on):
        torch.manual_seed(0)
        return MLP().double().to(on)

    def run(how):
        ref_model = build("cpu")
        m = build("meta" if how == "meta" else (device if how == "direct" else "cpu"))
        sink = RecordSink()
        g = torch.Generator().manual_seed(4)
        with hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}), sink=sink,
                             flush_every=1) as s:
            if how == "meta":
                m.to_empty(device=device)
                m.load_state_dict(ref_model.state_dict())
            elif how == "moved":
                m.to(device)
            for _ in range(2):
                m(torch.randn(8, 32, generator=g, dtype=torch.float64).to(device)).square().mean().backward()
                s.step()
            devs = {v["output"].mean.device.type for v in s["stats"].results().values()}
        return sink.records, devs

    got, devs = run(how)
    want, _ = run("direct")
    _assert_same_records(got, want, rel=0.0)
    assert len(_keyed(got)) == 2 * 3 * 2 and devs == {torch.device(device).type}


class _ManyOutputs(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.n = n

    def forward(self, x):
        y = self.fc(x)
        return tuple(y * (i + 1) - i for i in range(self.n))


@pytest.mark.parametrize("device", DEVICES)
def test_bank_grown_mid_step_on_the_device_keeps_every_row(device):
    """A module returning 300 tensors: 300 new keys in one call, more than the room
    reserved at attach, so the device bank grows in the middle of a step; every output's
    record equals the float64 reference of that tensor."""
    torch.manual_seed(0)
    m = nn.Sequential(_ManyOutputs(300)).to(device)
    seen = {}
    m[0].register_forward_hook(lambda mod, i, o: seen.setdefault(len(seen), [t.detach().cpu() for t in o]))
    sink = RecordSink()
    with hookplug.attach(m, "_ManyOutputs", plugins="stats", sink=sink, flush_every=1) as s:
        for _ in range(2):
            m(torch.randn(4, 16, device=device))
            s.step()
    recs = _keyed(sink.records)
    assert len(recs) == 2 * 300
    for step in range(2):
        for i in (0, 1, 63, 64, 65, 128, 200, 299):
            assert_record_matches(recs[(step, "0", f"output[{i}]", "train")], seen[step][i], rel=1e-5)


# -- activation checkpointing on the device (backward on autograd's device thread) -----------------

class _Blocks(nn.Module):
    def __init__(self, use_ckpt):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)) for _ in range(3))
        self.use_ckpt = use_ckpt

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = b(x) if self.use_ckpt is None else checkpoint(b, x, use_reentrant=self.use_ckpt)
        return x


def _blocks_run(device, use_ckpt):
    m = _Blocks(use_ckpt).to(device)
    plugins = [("stats", {"sites": ("output", "grad")}), ("capture", {"keep": "all", "grads": True}), "flops"]
    g = torch.Generator().manual_seed(5)
    with hookplug.attach(m, "Linear", plugins=plugins) as s:
        for _ in range(2):
            x = torch.randn(4, 6, generator=g).to(device).requires_grad_()
            m(x).square().sum().backward()
            s.step()
        stats = {(k, p): st.to_dict() for k, d in s["stats"].results().items() for p, st in d.items()}
        captured = {k: len(v) for k, v in s["capture"].features.items()}
        grads = {k: [g is not None for g in v] for k, v in s["capture"].grads.items()}
        flops = {k: r["flops"] for k, r in s["flops"].results().items()}
    return stats, captured, grads, flops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_on_the_device_is_not_counted_twice(device, use_reentrant):
    plain = _blocks_run(device, None)
    stats, captured, grads, flops = _blocks_run(device, use_reentrant)
    assert stats.keys() == plain[0].keys() and len(stats) == 12
    for k, d in stats.items():
        assert d["numel"] == plain[0][k]["numel"] == 2 * 4 * 6, k
        assert math.isclose(d["std"], plain[0][k]["std"], rel_tol=1e-5), k
    assert captured == plain[1] and set(captured.values()) == {2}
    assert flops == plain[3]
    if not use_reentrant:
        assert grads == plain[2]


# -- torch.func on the device --------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_grad_with_stats_on_the_device_equals_a_plain_backward(device):
    from torch.func import functional_call, grad

    if ops.backend() == "reference":
        pytest.skip("torch.func.grad refuses the reference backend's in-place bank writes (README)")
    torch.manual_seed(0)
    m = MLP().double().to(device)
    x = torch.randn(8, 32, dtype=torch.float64, device=device)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p):
        return functional_call(m, p, (x,)).square().mean()

    with hookplug.attach(m, "Linear", plugins="stats") as s:
        got = grad(loss)(params)
        func_stats = {k: v["output"].to_dict() for k, v in s["stats"].results().items()}
    with hookplug.attach(m, "Linear", plugins="stats") as s:
        m(x).square().mean().backward()
        plain_stats = {k: v["output"].to_dict() for k, v in s["stats"].results().items()}
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-12, atol=1e-15)
    assert func_stats.keys() == plain_stats.keys() == {"fc1", "fc2", "fc3"}
    for k in func_stats:
        for f in ("numel", "min", "max", "mean", "std"):
            assert func_stats[k][f] == pytest.approx(plain_stats[k][f], rel=1e-12), (k, f)


# -- stats results on the device saved in a checkpoint -------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_device_results_load_with_weights_only_and_map_location(device, tmp_path):
    torch.manual_seed(0)
    m = MLP().to(device)
    with hookplug.attach(m, "Linear", plugins=[("stats", {"sites": ("output", "grad")}), "params"]) as s:
        m(torch.randn(4, 32, device=device)).square().mean().backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        res = s.results()
    path = tmp_path / "ckpt.pt"
    torch.save({"hookplug": res}, path)
    back = torch.load(path, weights_only=True, map_location="cpu")["hookplug"]
    st, st_back = res["stats"]["fc1"]["grad"], back["stats"]["fc1"]["grad"]
    assert st_back.row.device.type == "cpu" and st.row.device.type == torch.device(device).type
    assert st_back.to_dict() == st.to_dict()
    assert back["params"]["fc1.weight"]["grad"].to_dict() == res["params"]["fc1.weight"]["grad"].to_dict()


# -- the command on a GPU -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_cli_profile_on_the_device_equals_the_cpu_run(device, tmp_path, capsys):
    """``hookplug profile mlp --device cuda --backward --json``: the input is drawn on the
    CPU and moved, so the per-module stats, FLOPs and telemetry equal the CPU run's to the
    rounding of float32 matmuls."""
    import json

    from hookplug.__main__ import main

    docs = {}
    for dev in dict.fromkeys([device, "cpu"]):
        path = tmp_path / f"{dev}.json"
        assert main(["profile", "mlp", "--device", dev, "--backward", "--steps", "2", "--json", str(path)]) == 0
        docs[dev] = json.loads(path.read_text())
    capsys.readouterr()
    got, want = docs[device], docs["cpu"]
    assert got["device"].startswith(torch.device(device).type)
    assert got["modules"].keys() == want["modules"].keys() == {"fc1", "fc2", "fc3"}
    for name, mod in want["modules"].items():
        assert got["modules"][name]["flops"] == mod["flops"]
        for site, st in mod["stats"].items():
            g = got["modules"][name]["stats"][site]
            assert g["numel"] == st["numel"] and g["nan_count"] == st["nan_count"] == 0
            scale = max(st["absmax"], 1e-30)
            for f in ("min", "max", "mean", "std"):
                assert math.isclose(g[f], st[f], rel_tol=1e-4, abs_tol=1e-5 * scale), (name, site, f)
    assert len(got["telemetry"]) == len(want["telemetry"]) > 0
