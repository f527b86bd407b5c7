"""The ``stats`` plugin against references computed without hookplug (plain torch hooks,
float64 torch reductions and ``hookplug.ops.reference_tensor_stats``)."""

import contextlib
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn as nn

import hookplug
from conftest import RecordSink
from hookplug._stats import TensorStats
from hookplug import PluginError
from hookplug.models import MLP, resnet34_like, tiny_transformer

# -- references -----------------------------------------------------------------------------------


def ref64(x):
    """Statistics of ``x`` in float64 by plain torch calls (finite values only for extremes)."""
    x = x.detach().double().reshape(-1)
    fin = x[torch.isfinite(x)]
    out = {
        "numel": x.numel(),
        "nan_count": int(torch.isnan(x).sum()),
        "inf_count": int(torch.isinf(x).sum()),
        "zero_count": int((x == 0).sum()),
    }
    if fin.numel():
        out.update(
            min=float(fin.min()),
            max=float(fin.max()),
            mean=float(fin.mean()),
            std=float(fin.std(correction=0)),
            absmax=float(fin.abs().max()),
        )
    else:
        out.update(min=math.nan, max=math.nan, mean=math.nan, std=math.nan, absmax=math.nan)
    return out


def _close(a, b, scale):
    if math.isnan(b):
        return math.isnan(a)
    return math.isclose(a, b, rel_tol=2e-5, abs_tol=1e-6 * max(scale, 1e-30))


def assert_stats_match(st, x, *, bins=None, hist="log2", range=None):
    """``st`` (a TensorStats) describes exactly the values of ``x``."""
    r = ref64(x)
    for f in ("numel", "nan_count", "inf_count", "zero_count"):
        assert int(getattr(st, f)) == r[f], (f, int(getattr(st, f)), r[f])
    for f in ("min", "max", "absmax"):  # extremes are values of x: exact
        a = float(getattr(st, f))
        assert (math.isnan(a) and math.isnan(r[f])) or a == r[f], (f, a, r[f])
    scale = r["absmax"] if not math.isnan(r["absmax"]) else 1.0
    for f in ("mean", "std"):
        assert _close(float(getattr(st, f)), r[f], scale), (f, float(getattr(st, f)), r[f])
    kw = {"hist": hist}
    if bins is not None:
        kw["bins"] = bins
    if range is not None:
        kw["range"] = range
    ref = hookplug.ops.reference_tensor_stats(x.detach(), **kw)
    assert torch.equal(st.hist_counts.cpu(), ref.hist_counts.cpu())
    assert torch.equal(st.hist_edges.cpu().double(), ref.hist_edges.cpu().double())


def plain_capture(model, cls=(nn.Conv2d, nn.Linear)):
    """Outputs of every module of the given classes, via plain torch forward hooks."""
    seen = {}
    handles = []
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


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Any Python-level device->host read (item, tolist, bool(), cpu(), ...) fails."""

    def boom(*args, **kwargs):
        raise AssertionError("host sync inside a hook")

    with monkeypatch.context() as mp:
        for name in (
            "item",
            "tolist",
            "cpu",
            "numpy",
            "__bool__",
            "__float__",
            "__int__",
            "__index__",
        ):
            mp.setattr(torch.Tensor, name, boom)
        yield


# -- results against references -------------------------------------------------------------------


def test_every_conv_and_linear_matches_reference():
    model = resnet34_like()
    x = torch.randn(2, 3, 32, 32)
    seen, handles = plain_capture(model)
    with hookplug.attach(model, "Conv2d|Linear", plugins="stats") as s:
        model(x)
    for h in handles:
        h.remove()
    res = s["stats"].results()
    order = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert (
        list(res) == order and len(res) == 37 and set(seen) == set(order)
    )  # 36 convs + fc, model order
    for name, outs in seen.items():
        assert list(res[name]) == ["output"]
        assert_stats_match(res[name]["output"], outs[0])


@pytest.mark.parametrize(
    "opts", [{"bins": 0}, {"bins": 16, "hist": "linear", "range": (-2.0, 2.0)}, {"bins": 32}]
)
def test_histogram_options(opts):
    model = MLP()
    x = torch.randn(8, 32)
    seen, handles = plain_capture(model)
    with hookplug.attach(model, "Linear:fc1", plugins=("stats", opts)) as s:
        model(x)
    for h in handles:
        h.remove()
    st = s["stats"].results()["fc1"]["output"]
    assert_stats_match(st, seen["fc1"][0], **opts)
    if opts.get("bins") == 0:
        assert st.hist_counts.numel() == 0


def test_merge_over_calls_equals_concatenation():
    model = MLP()  # fc2 runs twice per forward
    xs = [torch.randn(5, 32) for _ in range(3)]
    seen, handles = plain_capture(model)
    with hookplug.attach(model, "Linear", plugins="stats") as s:
        for i, x in enumerate(xs):
            model(x)
            if i == 1:
                s.step()  # merges across steps too
    for h in handles:
        h.remove()
    res = s["stats"].results()
    assert [len(v) for v in seen.values()] == [3, 6, 3]
    for name, outs in seen.items():
        assert_stats_match(res[name]["output"], torch.cat([o.reshape(-1) for o in outs]))


def test_many_calls_compact_and_stay_exact():
    lin = nn.Linear(4, 4)
    xs = [torch.randn(3, 4) * (i + 1) for i in range(40)]
    with hookplug.attach(lin, "*:", plugins="stats") as s:
        for x in xs:
            lin(x)
        plugin = s["stats"]
        # merged in place into one row per (module, path, phase): nothing piles up per call
        assert plugin._keys == [("", "output", "train")] and not plugin._pending
        st = plugin.results()[""]["output"]
    with torch.no_grad():
        assert_stats_match(st, torch.cat([lin(x) for x in xs]))


def test_nan_inf_and_integer_outputs():
    class Odd(nn.Module):
        def forward(self, x):
            y = x.clone()
            y[0, 0] = float("nan")
            y[0, 1] = float("inf")
            y[1, 0] = 0.0
            return y, y.argmax(dim=1), (y > 0)

    m = nn.Sequential(Odd())
    x = torch.randn(4, 5)
    with hookplug.attach(m, "Odd", plugins="stats") as s:
        y = m(x)
    res = s["stats"].results()["0"]
    assert list(res) == ["output[0]"]  # the int64 and bool outputs are skipped, not errors
    assert_stats_match(res["output[0]"], y[0])
    assert int(res["output[0]"].nan_count) == 1 and int(res["output[0]"].inf_count) == 1


@pytest.mark.parametrize("dtype", [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2")
                                   if hasattr(torch, n)], ids=str)
def test_float8_outputs_are_measured_exactly(dtype):
    """float8 activations (FP8 training) are floating tensors the op has no kernel for:
    measured through a float32 copy (exact), not an error that disables the plugin."""
    class ToFloat8(nn.Module):
        def forward(self, x):
            return x.to(dtype), x

    m = nn.Sequential(ToFloat8())
    x = torch.randn(6, 7) * 4
    with hookplug.attach(m, "ToFloat8", plugins="stats") as s:
        y, _ = m(x)
    res = s["stats"].results()["0"]
    assert list(res) == ["output[0]", "output[1]"]
    assert_stats_match(res["output[0]"], y.float())
    assert_stats_match(res["output[1]"], x)


# -- structures and sites -------------------------------------------------------------------------


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    label: str = "x"


class Structured(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)

    def forward(self, x, *, scale=None):
        a = self.lin(x)
        b = a.relu() * (scale if scale is not None else 1.0)
        if self.kind == "tuple":
            return a, (b, a.argmax(-1))
        if self.kind == "dict":
            return {"logits": a, "extra": {"b": b}}
        return Out(a, b)


@pytest.mark.parametrize(
    "kind,paths",
    [
        ("tuple", ["output[0]", "output[1][0]"]),
        ("dict", ["output.logits", "output.extra.b"]),
        ("dataclass", ["output.logits", "output.hidden"]),
    ],
)
def test_structured_outputs_keyed_by_path(kind, paths):
    m = nn.Sequential(Structured(kind))
    x = torch.randn(3, 6)
    with hookplug.attach(m, "Structured", plugins=("stats", {"sites": ("output", "grad")})) as s:
        out = m(x)
    res = s["stats"].results()["0"]
    assert [p for p in res if p.startswith("output")] == paths
    leaves = dict(hookplug.structures.iter_tensors(out))
    for p in paths:
        assert_stats_match(res[p], leaves[p])


def test_dict_keys_that_read_as_paths_get_keys_of_their_own():
    """``{"a.b": x, "a": {"b": y}}``: both tensors' paths read ``output.a.b`` and their
    statistics were merged into one key (counted twice as many elements). A key holding
    ``.``, ``[``, ``]`` or a quote, or an empty one, reads as ``output['a.b']``."""
    class Odd(nn.Module):
        def forward(self, x):
            return {"a.b": x, "a": {"b": x * 3 + 1}, "": -x, "c[0]": x + 2}

    m = nn.Sequential(Odd())
    x = torch.randn(4, 5)
    with hookplug.attach(m, "Odd", plugins="stats") as s:
        out = m(x)
    res = s["stats"].results()["0"]
    assert list(res) == ["output['a.b']", "output.a.b", "output['']", "output['c[0]']"]
    for path, tensor in zip(res, (out["a.b"], out["a"]["b"], out[""], out["c[0]"])):
        assert_stats_match(res[path], tensor)


def test_grad_site_equals_true_output_gradient(true_output_grads):
    model = MLP()
    x = torch.randn(6, 32)
    true = true_output_grads(model, nn.Linear)
    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": "grad"})) as s:
        model(x).pow(2).sum().backward()
    res = s["stats"].results()
    assert set(res) == {"fc1", "fc2", "fc3"}
    for name, grads in true.items():
        assert list(res[name]) == ["grad"]
        assert_stats_match(res[name]["grad"], torch.cat([g.reshape(-1) for g in grads]))


def test_grad_site_of_tuple_output():
    m = nn.Sequential(Structured("tuple"))
    x = torch.randn(3, 6)
    true = {}

    def fwd(mod, inp, out):
        out[0].register_hook(lambda g: true.setdefault("a", g.clone()))
        out[1][0].register_hook(lambda g: true.setdefault("b", g.clone()))

    h = m[0].register_forward_hook(fwd)
    with hookplug.attach(m, "Structured", plugins=("stats", {"sites": "grad"})) as s:
        a, (b, _) = m(x)
        ga, gb = torch.randn_like(a), torch.randn_like(b)
        torch.autograd.backward([a, b], [ga, gb])
    h.remove()
    res = s["stats"].results()["0"]
    assert sorted(res) == ["grad[0]", "grad[1][0]"]
    assert torch.equal(true["b"], gb) and not torch.equal(true["a"], ga)  # a also feeds b
    assert_stats_match(res["grad[1][0]"], true["b"])
    assert_stats_match(res["grad[0]"], true["a"])


def test_input_site_positional_and_keyword():
    m = nn.Sequential(Structured("tuple"))
    x = torch.randn(3, 6)
    scale = torch.rand(3, 6)
    with hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("input",)})) as s:
        m(x)
    assert list(s["stats"].results()["0.lin"]) == ["input[0]"]
    assert_stats_match(s["stats"].results()["0.lin"]["input[0]"], x)
    with hookplug.attach(m, "Structured", plugins=("stats", {"sites": ("input", "output")})) as s:
        m[0](x, scale=scale)
    res = s["stats"].results()["0"]
    assert list(res) == ["input[0]", "input.scale", "output[0]", "output[1][0]"]
    assert_stats_match(res["input.scale"], scale)


def test_only_requested_sites_get_torch_hooks():
    model = MLP()
    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": "output"})):
        assert all(not m._forward_pre_hooks for m in model.modules())
    plugin = hookplug._manager.create_plugin("stats", {"sites": ("grad",)})
    assert plugin.hookplug_forward_output is None and plugin.hookplug_forward_input is None


# -- observe only, no sync ------------------------------------------------------------------------


def _train_step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    return out.detach().clone(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize(
    "factory,x",
    [
        (resnet34_like, lambda: torch.randn(2, 3, 32, 32)),
        (tiny_transformer, lambda: torch.randint(0, 1000, (2, 8))),
    ],
)
def test_observe_only_outputs_and_grads_bitwise_identical(factory, x):
    model = factory()
    inp = x()
    out0, g0 = _train_step(model, inp)
    with hookplug.attach(
        model,
        "*",
        plugins=[
            ("stats", {"sites": ("input", "output", "grad")}),
            ("capture", {"grads": True, "inputs": True}),
        ],
    ):
        out1, g1 = _train_step(model, inp)
    out2, g2 = _train_step(model, inp)
    for out, g in ((out1, g1), (out2, g2)):
        assert torch.equal(out, out0)
        assert g.keys() == g0.keys() and all(torch.equal(g[k], g0[k]) for k in g0)


def test_hooks_never_read_device_values(monkeypatch):
    model = MLP()
    x = torch.randn(4, 32)
    with hookplug.attach(
        model, "Linear", plugins=("stats", {"sites": ("input", "output", "grad")})
    ) as s:
        with no_host_sync(monkeypatch):
            for _ in range(3):
                model(x).sum().backward()
                s.step()
            for _ in range(20):  # past the in-step compaction threshold
                model(x)
            out = s["stats"].hookplug_collect(
                session=s, step=s.step_index
            )  # collect stays on device too
        assert out
        assert isinstance(s["stats"].results()["fc1"]["output"].max, torch.Tensor)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_training_step_has_no_sync():
    model = resnet34_like().cuda()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hookplug.attach(
        model, "Conv2d|Linear", plugins=("stats", {"sites": ("output", "grad")})
    ) as s:
        model(x).sum().backward()  # warm-up (lazy init may sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                s.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    res = s["stats"].results()
    assert res["conv1"]["output"].max.device.type == "cuda"


# -- telemetry collection -------------------------------------------------------------------------


class NullSink:
    """A telemetry consumer that is never flushed (``flush_every`` unset)."""

    name = "null"

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        pass


def test_collect_per_step_then_results_cover_everything():
    model = MLP()
    xs = [torch.randn(4, 32) for _ in range(3)]
    seen, handles = plain_capture(model)
    with hookplug.attach(model, "Linear:fc[13]", plugins="stats", sink=NullSink()) as s:
        plugin = s["stats"]
        model(xs[0])
        s.step()
        model(xs[1])
        model(xs[2])
        s.step()
        got = plugin.hookplug_collect(session=s, step=s.step_index)
        assert plugin.hookplug_collect(session=s, step=s.step_index) is None  # nothing new
    for h in handles:
        h.remove()
    # one StatsBlock per ended step; rows of modules the selector left out stay empty
    pairs = [(m, TensorStats(r)) for blk in got for m, r in zip(blk.metas, blk.rows)
             if int(r[0]) > 0]
    metas = [m for m, _ in pairs]
    assert metas == [
        {"step": 0, "module": "fc1", "site": "output", "phase": "train"},
        {"step": 0, "module": "fc3", "site": "output", "phase": "train"},
        {"step": 1, "module": "fc1", "site": "output", "phase": "train"},
        {"step": 1, "module": "fc3", "site": "output", "phase": "train"},
    ]
    by = {(m["step"], m["module"]): st for m, st in pairs}
    assert_stats_match(by[(0, "fc1")], seen["fc1"][0])
    assert_stats_match(by[(1, "fc1")], torch.cat([seen["fc1"][1], seen["fc1"][2]]))
    res = plugin.results()  # totals survive the collection
    assert_stats_match(res["fc3"]["output"], torch.cat(seen["fc3"]))


def test_pending_steps_bounded_with_a_sink_never_flushed():
    lin = nn.Linear(3, 3)
    xs = [torch.randn(2, 3) for _ in range(6)]
    opts = {"max_pending_steps": 2}
    with hookplug.attach(lin, "*:", plugins=("stats", opts), sink=NullSink()) as s:
        with pytest.warns(RuntimeWarning, match="not collected"):
            for x in xs:
                lin(x)
                s.step()
        assert len(s["stats"]._pending) <= 2
        st = s["stats"].results()[""]["output"]
    with torch.no_grad():
        assert_stats_match(st, torch.cat([lin(x) for x in xs]))


@pytest.mark.parametrize("plugin", ["stats", "params"])
def test_pending_steps_bounded_by_bytes(plugin):
    """Ended steps wait for telemetry on the device: 1024 steps of a 16,000-row bank were
    19 GB. ``max_pending_bytes`` bounds them (at least one step is kept); the warning (with
    a sink) names the bound; totals stay exact; a flush hands out the steps kept."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    probe = hookplug.attach(model, "Linear", plugins=plugin)
    model(torch.randn(2, 4)).sum().backward()
    probe.step()
    step_bytes = sum(t.numel() * t.element_size() for t in probe[plugin].bank.pending[0][1].values())
    probe.remove()
    opts = {"max_pending_bytes": 2 * step_bytes + 1}
    xs = [torch.randn(2, 4) for _ in range(6)]
    with hookplug.attach(model, "Linear", plugins=(plugin, opts), sink=NullSink()) as s:
        with pytest.warns(RuntimeWarning, match=r"than the 2 kept .*max_pending_bytes=\d+ at \d+ bytes a step"):
            for x in xs:
                model(x).sum().backward()
                s.step()
        bank = s[plugin].bank
        assert len(bank.pending) == 2
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # (snapshots are
                for _, snaps in bank.pending for t in snaps.values()}  # slots of a fold batch's block)
        held.update((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    for dev in bank._devices.values() for t in dev.unfolded)
        assert sum(held.values()) <= 2 * opts["max_pending_bytes"], held
        assert sorted({r["step"] for r in s.flush()}) == [4, 5]
    with hookplug.attach(model, "Linear", plugins=(plugin, opts)) as s:  # no sink, flush() read:
        for x in xs[:3]:  # steps dropped between two reads are warned about
            model(x).sum().backward()
            s.step()
        s.flush()
        with pytest.warns(RuntimeWarning, match="than the 2 kept"):
            for x in xs:
                model(x).sum().backward()
                s.step()
    with hookplug.attach(model, "Linear", plugins=(plugin, opts)) as s:  # read once, then
        model(xs[0]).sum().backward()  # the instance attached again and never read: silent,
        s.step()  # as a new instance would be
        s.flush()
        instance = s[plugin]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hookplug.attach(model, "Linear", plugins=[instance]) as s:
            for x in xs:
                model(x).sum().backward()
                s.step()
    with pytest.raises(hookplug.PluginError, match="max_pending_bytes must be None or >= 1"):
        hookplug.attach(model, "Linear", plugins=(plugin, {"max_pending_bytes": 0}))
    with hookplug.attach(model, "Linear", plugins=(plugin, {"max_pending_bytes": None})) as s:
        for x in xs:
            model(x).sum().backward()
            s.step()
        assert len(s[plugin].bank.pending) == 6


def test_without_telemetry_steps_fold_into_totals_silently():
    """No sink and no flush: each step() folds the bank into the totals with one merge
    (nothing piles up per call or per step, no warning); totals stay exact."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    xs = [torch.randn(2, 4) for _ in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the max_pending_steps warning would raise here
        with hookplug.attach(model, "Linear", plugins=("stats", {"max_pending_steps": 4})) as s:
            plugin = s["stats"]
            for x in xs:
                model(x)
                s.step()
                assert len(plugin._pending) <= 4
                assert len(plugin._keys) == 3  # one row per (module, path, phase), reused
            res = plugin.results()
            # session.flush() right after step() still hands out the steps just ended
            recs = s.flush()
            assert {(r["step"], r["module"]) for r in recs} == {
                (st, n) for st in range(36, 40) for n in ("0", "1", "2")}
    with torch.no_grad():
        outs = {"0": [], "1": [], "2": []}
        for x in xs:
            for i, layer in enumerate(model):
                x = layer(x)
                outs[str(i)].append(x)
    for name, lst in outs.items():
        assert_stats_match(res[name]["output"], torch.cat(lst))


def test_after_a_manual_flush_steps_stay_pending_for_the_next_one():
    lin = nn.Linear(3, 3)
    with hookplug.attach(lin, "*:", plugins="stats") as s:  # no sink: the user flushes by hand
        lin(torch.randn(2, 3))
        s.step()
        assert [r["step"] for r in s.flush()] == [0]
        for _ in range(3):
            lin(torch.randn(2, 3))
            s.step()
        assert [r["step"] for r in s.flush()] == [1, 2, 3]


# -- options, reset, report -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"sites": ("outputs",)}, "sites"),
        ({"sites": ()}, "sites"),
        ({"hist": "log10"}, "hist"),
        ({"bins": -1}, "bins"),
        ({"hist": "linear"}, "range"),
        ({"range": (1.0, 0.0), "hist": "linear"}, "range"),
        ({"max_pending_steps": 0}, "max_pending_steps"),
        ({"bins": 10**9, "hist": "linear", "range": (0, 1)}, "bins"),  # bounded at attach
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(PluginError, match=match):
        hookplug.attach(MLP(), "Linear", plugins=("stats", opts))


def test_unknown_option_names_close_match():
    with pytest.raises(PluginError, match="site"):
        hookplug.attach(MLP(), "Linear", plugins=("stats", {"site": "grad"}))


def test_reset_and_report():
    model = MLP()
    with hookplug.attach(model, "Linear", plugins="stats") as s:
        model(torch.randn(2, 32))
        text = s.report()
        assert "== stats ==" in text
        for word in (
            "module",
            "site",
            "numel",
            "nan",
            "inf",
            "min",
            "max",
            "mean",
            "std",
            "fc1",
            "fc3",
        ):
            assert word in text
        s["stats"].reset()
        assert s["stats"].results() == {} and s["stats"].report() == ""
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(torch.randn(2, 32))
        assert int(s["stats"].results()["fc2"]["output"].numel) == 2 * 64 * 2


def test_many_collections_stay_exact_and_bounded():
    lin = nn.Linear(3, 2)
    xs = [torch.randn(2, 3) for _ in range(70)]
    with hookplug.attach(lin, "*:", plugins="stats") as s:
        plugin = s["stats"]
        for x in xs:
            lin(x)
            s.step()
            got = plugin.hookplug_collect(session=s, step=s.step_index)
            assert len(got) == 1 and got[0].rows.shape[0] == 1
        assert len(plugin._keys) == 1 and not plugin._pending
        st = plugin.results()[""]["output"]
    with torch.no_grad():
        assert_stats_match(st, torch.cat([lin(x) for x in xs]))


# -- nested, sparse, failing forward ----------------------------------------------------------


def _nested_encoder():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    return enc, x, mask


def test_nested_tensors_of_a_transformer_encoder_fast_path():
    """Stock TransformerEncoder with enable_nested_tensor passes nested tensors between its
    layers: stats measure their elements (no padding) instead of failing the forward."""
    enc, x, mask = _nested_encoder()
    seen = {}
    handles = [
        m.register_forward_hook(
            lambda mod, inp, out, name=name: seen.setdefault(name, []).append(
                (inp[0].detach().clone(), out.detach().clone())
            )
        )
        for name, m in enc.layers.named_children()
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype")
        with torch.no_grad():
            ref = enc(x, src_key_padding_mask=mask)
        opts = {"sites": ("input", "output")}
        with torch.no_grad(), hookplug.attach(enc, "TransformerEncoderLayer", plugins=("stats", opts)) as s:
            y = enc(x, src_key_padding_mask=mask)
            res = s["stats"].results()
    for h in handles:
        h.remove()
    assert torch.equal(y, ref)
    for name in ("0", "1"):
        inp, out = seen[name][0]
        assert out.is_nested
        flat_out = torch.cat([u.reshape(-1) for u in out.unbind()])
        assert_stats_match(res[f"layers.{name}"]["output"], flat_out)
        assert int(res[f"layers.{name}"]["output"].numel) == (5 + 3) * 16
        flat_in = torch.cat([u.reshape(-1) for u in inp.unbind()]) if inp.is_nested else inp
        assert_stats_match(res[f"layers.{name}"]["input[0]"], flat_in)


def test_sparse_output_skipped_with_one_warning_nested_measured():
    class Odd(nn.Module):
        def forward(self, x):
            jag = torch.nested.nested_tensor([x[:1], x[1:]], layout=torch.jagged)
            holes = torch.nested.narrow(
                x.unsqueeze(0).expand(2, -1, -1).contiguous(), 1, torch.tensor([0, 1]),
                torch.tensor([2, 1]), layout=torch.jagged)  # not contiguous: read by unbind
            return jag, holes, x.to_sparse()

    m = Odd()
    x = torch.randn(3, 4)
    with hookplug.attach(m, "*:", plugins="stats") as s:
        with pytest.warns(RuntimeWarning, match=r"output\[2\].*sparse_coo.*skipped"):
            m(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            m(x)
        res = s["stats"].results()[""]
    assert set(res) == {"output[0]", "output[1]"}
    assert_stats_match(res["output[0]"], torch.cat([x, x]))
    assert_stats_match(res["output[1]"], torch.cat([x[0:2], x[1:2]] * 2))


class Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = False

    def forward(self, x):
        y = self.lin(x)
        if self.fail:
            raise ValueError("boom in forward")
        return y, y * 2


def test_forward_that_raises_reaches_the_caller_untouched():
    """The core calls forward_output with output=None when forward raised: stats records
    nothing for that call and does not add an error of its own."""
    m = Flaky()
    x = torch.randn(2, 4)
    with hookplug.attach(m, "*:", plugins=("stats", {"sites": ("input", "output")})) as s:
        m(x)
        m.fail = True
        with pytest.raises(ValueError, match="boom in forward"):
            m(x)
        m.fail = False
        s.step()
        res = s["stats"].results()[""]
    assert not s.disabled
    with torch.no_grad():
        y = m.lin(x)
    assert_stats_match(res["output[0]"], y)  # the failed call added nothing
    assert_stats_match(res["input[0]"], torch.cat([x, x]))  # read before forward, both calls
    assert s["stats"].hookplug_forward_output(None, None, (), {}, None) is None


def test_threads_sharing_a_model_lose_nothing():
    """Two threads calling forward on one attached model: every call is merged (the final
    merge into a row is serialized), so the totals equal the whole input."""
    import threading

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    xs = [[torch.randn(8, 16) for _ in range(50)] for _ in range(2)]
    with hookplug.attach(model, "Linear", plugins="stats") as s:
        def run(batch):
            with torch.no_grad():
                for x in batch:
                    model(x)

        threads = [threading.Thread(target=run, args=(b,)) for b in xs]
        [t.start() for t in threads]
        [t.join() for t in threads]
        res = s["stats"].results()
    with torch.no_grad():
        outs = [model[2](model[1](model[0](x))) for b in xs for x in b]
    assert int(res["2"]["output"].numel) == 2 * 50 * 8 * 32
    assert_stats_match(res["2"]["output"], torch.cat(outs))


def test_std_of_tiny_float32_values_does_not_underflow():
    """Squared deviations of values near 1e-23 underflow in float32 lanes: such blocks are
    measured in float64 (was 3.6e-24 against 9.9e-24)."""
    x = torch.randn(4096) * 1e-23
    st = hookplug.ops.tensor_stats(x).to_dict()
    ref = x.double().std(correction=0).item()
    assert math.isclose(st["std"], ref, rel_tol=1e-6)
    acc_model = nn.Identity()
    with hookplug.attach(acc_model, "*:", plugins="stats") as s:
        acc_model(x[:1000])
        acc_model(x[1000:])
        got = s["stats"].results()[""]["output"].to_dict()["std"]
    assert math.isclose(got, ref, rel_tol=1e-6)


def test_results_in_a_checkpoint_load_with_torch_load_defaults(tmp_path):
    """A checkpoint dict holding ``session.results()`` (stats with phases, params) saved with
    ``torch.save`` loads with ``torch.load``'s default ``weights_only=True`` (TensorStats is
    an allowed global rebuilt from its row): the same numbers, histograms and kinds; merge
    still works on what was loaded. It raised UnpicklingError, failing the whole checkpoint."""
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with hookplug.attach(m, "Linear", plugins=[("stats", {"sites": ("output", "grad")}), "params"]) as s:
        for train in (True, False):
            m.train(train)
            out = m(torch.randn(4, 32))
            if train:
                out.square().mean().backward()
                opt.step()
        res = s.results()
    res["linear"] = hookplug.ops.tensor_stats(torch.randn(100), bins=8, hist="linear", range=(-1.0, 1.0))
    res["eval"] = s["stats"].results(phase="eval")
    state = {"model": m.state_dict(), "step": 3, "hookplug": res}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    back = torch.load(path)  # weights_only=True
    back_explicit = torch.load(path, weights_only=True)

    def plain(x):
        if isinstance(x, TensorStats):
            return ("TensorStats", x.hist, x.to_dict())
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    assert plain(back["hookplug"]) == plain(res) == plain(back_explicit["hookplug"])
    st = back["hookplug"]["stats"]["fc1"]["output"]
    assert isinstance(st, TensorStats) and st.row.dtype == torch.float64
    assert torch.equal(st.merge(st).numel, 2 * res["stats"]["fc1"]["output"].numel)
    # a row that is a view of a larger tensor (results' rows may be views of the merged
    # bank) is saved alone, not with the whole tensor
    one = TensorStats(torch.stack([res["stats"]["fc1"]["output"].row] * 50)[7], "log2")
    torch.save(one, tmp_path / "one.pt")
    alone = torch.load(tmp_path / "one.pt")
    assert alone.row.untyped_storage().nbytes() == one.row.numel() * 8
    assert plain(alone) == plain(one)


def test_a_crafted_tensor_stats_pickle_gets_the_constructors_checks():
    """What torch.load(weights_only=True) may build from a file: a TensorStats through its
    constructor (a row that is no 1-D tensor is refused; an unknown histogram kind is None),
    never an object the constructor did not check."""
    import pickle

    from hookplug._stats import _rebuild_tensor_stats

    good = TensorStats(hookplug.ops.tensor_stats(torch.randn(10)).row, "log2")
    assert pickle.loads(pickle.dumps(good)).hist == "log2"
    assert _rebuild_tensor_stats(good.row, {"x": [1, 2]}).hist is None
    assert _rebuild_tensor_stats(good.row, ("linear", -1, 1.5)).hist == ("linear", -1, 1.5)
    with pytest.raises(ValueError, match="stats row"):
        _rebuild_tensor_stats("not a tensor", "log2")


def test_a_linear_range_too_narrow_for_its_bins_is_refused_at_attach():
    from hookplug_plugins.stats import StatsPlugin

    with pytest.raises(ValueError, match=r"range must be finite with lo < hi .*\(hi - lo\) finite\), got \(0.0, 4e-310\)"):
        StatsPlugin(hist="linear", bins=4, range=(0.0, 4e-310))
    assert StatsPlugin(hist="linear", bins=4, range=(0.0, 1e-300)).bank is not None


@pytest.mark.parametrize("n", [1, 2, 3])
def test_remove_hands_the_last_max_pending_steps_to_the_sinks(n):
    """With no flush, ``remove()`` ends the running (empty) step too: it pushed the oldest
    of the ``max_pending_steps`` kept steps out (n=1: no step reached the sink)."""
    lin = nn.Linear(3, 3)
    sink = RecordSink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the not-collected warning)
        with hookplug.attach(lin, "*:", plugins=("stats", {"max_pending_steps": n}), sink=sink) as s:
            for _ in range(5):
                lin(torch.randn(2, 3))
                s.step()
    assert sorted({r["step"] for r in sink.records}) == list(range(5 - n, 5))
