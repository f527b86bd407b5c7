"""Telemetry: sampling, the sync-free flush engine, records, torch.compile.

Records are checked against statistics computed here with plain torch hooks and float64
torch reductions, never against values the code under test produced.
"""
import collections
import contextlib
import copy
import dataclasses
import functools
import math
import os
from typing import Any

import pytest
import torch
import torch.nn as nn

import hookplug
from conftest import DEVICES
from hookplug.models import MLP

CUDA = torch.cuda.is_available()
STAT_KEYS = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "mean", "std", "absmax")


class ListSink:
    """A third-party style sink: keeps what it is given."""

    name = "listsink"

    def __init__(self):
        self.records = []
        self.calls = 0
        self.ended = False

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        self.calls += 1
        self.records.extend(records)

    @hookplug.hookimpl
    def hookplug_session_end(self):
        self.ended = True


def ref_stats(x, edges=None):
    """Statistics of ``x`` by plain float64 torch calls (extremes/moments over finite values)."""
    x = x.detach().double().reshape(-1)
    fin = x[torch.isfinite(x)]
    out = {"numel": x.numel(), "nan_count": int(torch.isnan(x).sum()),
           "inf_count": int(torch.isinf(x).sum()), "zero_count": int((x == 0).sum())}
    if fin.numel():
        out.update(min=float(fin.min()), max=float(fin.max()), mean=float(fin.mean()),
                   std=float(fin.std(correction=0)), absmax=float(fin.abs().max()))
    else:
        out.update({k: math.nan for k in ("min", "max", "mean", "std", "absmax")})
    if edges is not None:  # the buckets by torch.histogram; +-Inf fall in the outer ones
        out["hist"] = torch.histogram(x[~torch.isnan(x)].clamp(edges[0], edges[-1]), bins=torch.tensor(edges, dtype=torch.float64)
                                      )[0].long().tolist()
    return out


def assert_record_matches(rec, x, *, rel=2e-5):
    """``rec`` describes the values of ``x``: counts and extremes exactly, mean and std to
    the op's accuracy (float32 data summed in float32 lanes: relative to the magnitude)."""
    ref = ref_stats(x, rec["hist_edges"] or None)
    scale = 1.0 if math.isnan(ref["absmax"]) else max(ref["absmax"], 1e-30)
    for k in ("numel", "nan_count", "inf_count", "zero_count"):
        assert rec[k] == ref[k], (rec["module"], rec["step"], k, rec[k], ref[k])
    for k in ("min", "max", "absmax"):
        assert (math.isnan(rec[k]) and math.isnan(ref[k])) or rec[k] == ref[k], (k, rec[k], ref[k])
    for k in ("mean", "std"):
        assert (math.isnan(rec[k]) and math.isnan(ref[k])) or math.isclose(
            rec[k], ref[k], rel_tol=rel, abs_tol=1e-6 * scale), (k, rec[k], ref[k])
    if rec["hist"]:
        assert sum(rec["hist"]) == ref["numel"] - ref["nan_count"]
        assert rec["hist"] == ref["hist"]


def capture_outputs(model, cls=nn.Linear):
    """``{(step, module): [outputs]}`` seen by plain torch forward hooks; ``state["step"]``
    is the step the test's loop is in."""
    seen, state, handles = {}, {"step": 0}, []
    for name, m in model.named_modules():
        if isinstance(m, cls):
            handles.append(m.register_forward_hook(
                lambda mod, inp, out, name=name: seen.setdefault((state["step"], name), []).append(
                    out.detach().clone())))
    return seen, state, handles


def by_key(records):
    out = {}
    for r in records:
        key = (r["step"], r["module"], r["site"])
        assert key not in out, f"record {key} emitted twice"
        out[key] = r
    return out


# -- records --------------------------------------------------------------------------------------

def test_records_equal_direct_stats_and_flush_every():
    m = MLP()
    seen, state, _ = capture_outputs(m)
    sink = ListSink()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink, flush_every=2) as s:
        for step in range(5):
            state["step"] = step
            m(torch.randn(16, 32) * (step + 1))
            n_before = len(sink.records)
            s.step()
            flushed = {r["step"] for r in sink.records[n_before:]}
            # flushes happen at the steps that complete a multiple of flush_every, on the CPU at once
            assert flushed == ({step - 1, step} if (step + 1) % 2 == 0 else set()), (step, flushed)
        state["step"] = 5
        m(torch.randn(16, 32))  # a step still running when the session ends
    assert sink.ended
    recs = by_key(sink.records)
    assert set(recs) == {(st, mod, "output") for st in range(6) for mod in ("fc1", "fc2", "fc3")}
    for (step, mod, _), rec in recs.items():
        assert rec["rank"] == 0 and isinstance(rec["time"], float)
        assert list(rec)[:6] == ["step", "time", "rank", "module", "site", "phase"]
        # fc2 runs twice a forward: its record covers both calls of the step
        assert_record_matches(rec, torch.cat([o.reshape(-1) for o in seen[(step, mod)]]))
        assert len(rec["hist"]) == 131 and len(rec["hist_edges"]) == 132
    # step times: a step's time is when it ended, so they increase with the step
    times = [recs[(st, "fc1", "output")]["time"] for st in range(6)]
    assert times == sorted(times)


def test_record_time_is_when_its_step_ended_not_when_it_was_flushed():
    import time

    m, sink = nn.Sequential(nn.Linear(4, 4)), ListSink()
    ended = []
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink, flush_every=3) as s:
        for _ in range(3):
            m(torch.randn(2, 4))
            time.sleep(0.02)
            before = time.time()
            s.step()  # the third one flushes all three steps
            ended.append((before, time.time()))
    times = {r["step"]: r["time"] for r in sink.records}
    assert sorted(times) == [0, 1, 2]
    for step, (lo, hi) in enumerate(ended):
        assert lo <= times[step] <= hi, (step, times[step], lo, hi)


def test_session_flush_forces_and_returns_records():
    m = MLP()
    seen, state, _ = capture_outputs(m)
    with hookplug.attach(m, "Linear", plugins=("stats", {"bins": 0})) as s:  # no sink at all
        m(torch.randn(4, 32))
        s.step()
        first = s.flush(wait=False)  # on the CPU a flush completes at once
        assert s.flush() == []  # nothing new since
        state["step"] = 1
        m(torch.randn(4, 32))
        assert s.flush() == []  # a step is emitted once it ended: never split into duplicates
        m(torch.randn(4, 32))  # a second micro-batch of step 1
        s.step()
        second = s.flush()
    assert {(r["step"], r["module"]) for r in first} == {(0, "fc1"), (0, "fc2"), (0, "fc3")}
    assert {(r["step"], r["module"]) for r in second} == {(1, "fc1"), (1, "fc2"), (1, "fc3")}
    for r in first + second:
        assert r["hist"] == [] and r["hist_edges"] == []
        assert_record_matches(r, torch.cat([o.reshape(-1) for o in seen[(r["step"], r["module"])]]))


def test_flushes_in_flight_are_polled_never_awaited_by_step(monkeypatch):
    """The CUDA discipline, on the CPU: a flush whose copy is not done stays in flight;
    step() only polls; flush() (wait=True) waits; records come out in flush order."""
    from hookplug import _telemetry

    gate, waited = {"open": False}, []
    monkeypatch.setattr(_telemetry._Flight, "ready", lambda self: gate["open"])
    monkeypatch.setattr(_telemetry._Flight, "wait", lambda self: waited.append(gate["open"]))
    m, sink = MLP(), ListSink()
    in_flight = None
    with hookplug.attach(m, "Linear", plugins=("stats", {"bins": 0}), sink=sink, flush_every=1) as s:
        in_flight = s._telemetry.in_flight
        for _ in range(2):
            m(torch.randn(2, 32))
            s.step()
        assert sink.records == [] and len(in_flight) == 2 and waited == []
        gate["open"] = True
        m(torch.randn(2, 32))
        s.step()  # both earlier flushes are done: emitted first, then this step's
        assert [r["step"] for r in sink.records] == [0] * 3 + [1] * 3 + [2] * 3 and not in_flight
        gate["open"] = False
        m(torch.randn(2, 32))
        s.step()
        assert len(in_flight) == 1 and len(sink.records) == 9
        assert [r["step"] for r in s.flush()] == [3] * 3  # wait=True: the one sync point
        assert waited[-1] is False and not in_flight


def test_every_n_records_only_sampled_steps():
    m = MLP()
    sink = ListSink()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink, every=3, flush_every=4) as s:
        for _ in range(10):
            m(torch.randn(2, 32))
            s.step()
    assert sorted({r["step"] for r in sink.records}) == [0, 3, 6, 9]


def test_nonfinite_values_and_an_all_nan_tensor():
    class Src(nn.Module):
        def forward(self, x):
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Src(), Src()

        def forward(self, x):
            return self.a(x), self.b(torch.full_like(x, math.nan))

    x = torch.randn(100)
    x[3], x[10], x[20], x[30] = math.nan, math.inf, -math.inf, 0.0
    sink = ListSink()
    net = Net()
    with hookplug.attach(net, "Src", plugins="stats", sink=sink):
        net(x)
    recs = {r["module"]: r for r in sink.records}
    assert_record_matches(recs["a"], x)
    assert recs["a"]["hist"][0] == 1 and recs["a"]["hist"][-1] == 1  # -inf and +inf: outer buckets
    b = recs["b"]
    assert b["nan_count"] == 100 and sum(b["hist"]) == 0
    assert all(math.isnan(b[k]) for k in ("min", "max", "mean", "std", "absmax"))


def test_default_sink_is_jsonl_under_runs_when_flush_every_is_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = MLP()
    with hookplug.attach(m, "Linear", plugins="stats", flush_every=1) as s:
        assert list(s.sinks) == ["jsonl"]
        m(torch.randn(2, 32))
        s.step()
        path = tmp_path / "runs" / s.run_id / "telemetry.jsonl"
        assert path.exists() and len(path.read_text().splitlines()) == 3  # readable mid-run
    with hookplug.attach(m, "Linear", plugins="stats") as s:  # no flush_every: no sink, no file
        assert s.sinks == {}
        m(torch.randn(2, 32))
        s.step()
    assert os.listdir(tmp_path / "runs") == [path.parent.name]


def test_run_id_from_environment(monkeypatch):
    monkeypatch.setenv("HOOKPLUG_RUN_ID", "exp-42")
    with hookplug.attach(MLP(), "Linear", plugins="stats") as s:
        assert s.run_id == "exp-42"


def test_third_party_producer_and_extra_meta():
    class Producer:
        name = "producer"

        @hookplug.hookimpl
        def hookplug_collect(self, session, step):
            x = torch.arange(-3.0, 5.0)
            return [({"step": step, "module": "custom", "site": "weights", "tag": "w"},
                     hookplug.ops.tensor_stats(x, bins=0))]

    sink = ListSink()
    with hookplug.attach(MLP(), "Linear", plugins=Producer(), sink=sink) as s:
        s.step()
        s.flush()
    rec = sink.records[0]
    assert rec["tag"] == "w" and rec["module"] == "custom" and rec["step"] == 1
    assert_record_matches(rec, torch.arange(-3.0, 5.0))


class BadProducer:
    name = "bad"

    @hookplug.hookimpl
    def hookplug_collect(self):
        return [("not a meta", None)]


def test_bad_collect_result_names_the_plugin():
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins=BadProducer(), sink=ListSink())
    with pytest.raises(TypeError, match=r"plugin 'bad': hookplug_collect must return None or a list of "
                                        r"StatsBlock or \(meta, TensorStats\) pairs.*got an item \('not a meta', None\)"):
        s.flush()
    with pytest.raises(TypeError):
        s.remove()  # the final flush raises too; the hooks are off all the same
    assert s.removed
    with hookplug.attach(m, "Linear", plugins=BadProducer(), sink=ListSink(), on_error="warn") as s:
        with pytest.warns(RuntimeWarning, match="'bad' failed and is disabled"):
            assert s.flush() == []
    assert "bad" in s.disabled


def test_a_failing_flush_warns_under_warn_instead_of_raising_from_step():
    """A flush that fails outside any plugin hook (here a producer's block without a step)
    goes through on_error: a warning from session.step() under "warn", the error under "raise"."""
    from hookplug._stats import StatsBlock

    class NoStep:
        name = "nostep"

        @hookplug.hookimpl
        def hookplug_collect(self):
            st = hookplug.ops.tensor_stats(torch.ones(3))
            return [StatsBlock([{"module": "m", "site": "output"}], st.row.reshape(1, -1), st.hist)]

    m = MLP()
    s = hookplug.attach(m, "Linear", plugins=NoStep(), sink=ListSink(), flush_every=1, on_error="warn")
    with pytest.warns(RuntimeWarning, match="hookplug telemetry: a flush failed.*KeyError"):
        s.step()
    with pytest.warns(RuntimeWarning, match="a flush failed"):
        s.remove()
    s = hookplug.attach(m, "Linear", plugins=NoStep(), sink=ListSink(), flush_every=1)
    with pytest.raises(KeyError):
        s.step()
    with pytest.raises(KeyError):
        s.remove()


def test_failing_sink_is_disabled_under_warn():
    class Broken:
        name = "broken"

        @hookplug.hookimpl
        def hookplug_flush(self, records):
            raise OSError("disk full")

    good = ListSink()
    m = MLP()
    with hookplug.attach(m, "Linear", plugins="stats", sink=[Broken(), good], on_error="warn",
                         flush_every=1) as s:
        m(torch.randn(2, 32))
        with pytest.warns(RuntimeWarning, match="broken"):
            s.step()
        m(torch.randn(2, 32))
        s.step()
    assert "broken" in s.disabled and len(good.records) == 6


@pytest.mark.parametrize("fails_in", ["step", "forward"])
def test_a_producer_disabled_under_warn_still_hands_over_the_steps_it_ended(fails_in):
    """stats disabled by an error (``on_error="warn"``) with steps pending (``flush_every``
    not reached): the steps it ended before still reach the sinks, at the next flush and at
    ``remove()``. ``nonfinite="raise"`` failing at the NaN's step: that step too, NaN
    counted and marked first. A forward hook failing mid-step: that step is left out (its
    rows are partial), never emitted under a later step's number."""
    from hookplug_plugins.stats import StatsPlugin

    class FailsInForward(StatsPlugin):
        name = "stats"

        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx, module, args, kwargs, output):
            if ctx.step == 3 and ctx.name == "fc2":
                raise RuntimeError("broken plugin")
            super().hookplug_forward_output(ctx, module, args, kwargs, output)

    torch.manual_seed(0)
    m = MLP()
    plugin = StatsPlugin(nonfinite="raise") if fails_in == "step" else FailsInForward()
    seen, state, _ = capture_outputs(m)
    sink = ListSink()
    with pytest.warns(RuntimeWarning, match="'stats' failed and is disabled"):
        with hookplug.attach(m, "Linear", plugins=plugin, sink=sink, flush_every=10,
                             on_error="warn") as s:
            for step in range(6):
                state["step"] = step
                x = torch.randn(2, 32)
                if step == 3 and fails_in == "step":
                    x[0, 0] = math.nan
                m(x)
                s.step()
    assert "stats" in s.disabled
    recs = by_key(sink.records)
    ended = [0, 1, 2, 3] if fails_in == "step" else [0, 1, 2]
    assert sorted({k[0] for k in recs}) == ended
    for (step, module, site), rec in recs.items():
        outs = seen[(step, module)]
        assert_record_matches(rec, torch.cat([o.reshape(-1) for o in outs]))
    if fails_in == "step":
        assert recs[(3, "fc1", "output")]["nan_count"] == 64
        assert [k for k, r in recs.items() if r["first_nonfinite"]] == [(3, "fc1", "output")]


def test_a_caught_nonfinite_raise_in_step_still_flushes_that_step():
    """stats(nonfinite="raise") raising in ``session.step()`` of a one-process session, the
    error caught and training going on (skip a bad batch): the step's records, NaN counted,
    reach the sink at that step's flush, not one step late."""
    from hookplug_plugins.stats import StatsPlugin

    m, sink = MLP(), ListSink()
    with hookplug.attach(m, "Linear", plugins=StatsPlugin(nonfinite="raise"), sink=sink, flush_every=1) as s:
        flushed = []
        for step in range(3):
            x = torch.randn(2, 32)
            if step == 1:
                x[0, 0] = math.nan
            m(x)
            try:
                s.step()
            except FloatingPointError:
                assert step == 1
            flushed.append(sorted({r["step"] for r in sink.records}))
    assert flushed == [[0], [0, 1], [0, 1, 2]]
    assert by_key(sink.records)[(1, "fc1", "output")]["nan_count"] == 64


def test_a_third_party_producer_disabled_under_warn_is_not_asked_again():
    """A producer without ``collect_when_disabled`` that fails is not collected from again:
    its records stop at the last flush before the error (none later, none twice)."""
    class WeightWatch:
        name = "watch"

        def __init__(self, w):
            self.w = w

        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx, output):
            if ctx.step == 2:
                raise RuntimeError("broken")

        @hookplug.hookimpl
        def hookplug_collect(self, session, step):
            return [({"step": step, "module": "fc", "site": "weight"},
                     hookplug.ops.tensor_stats(self.w.detach(), bins=0))]

    m = nn.Sequential(nn.Linear(4, 4))
    sink = ListSink()
    with pytest.warns(RuntimeWarning, match="'watch' failed and is disabled"):
        with hookplug.attach(m, "Linear", plugins=WeightWatch(m[0].weight), sink=sink,
                             flush_every=1, on_error="warn") as s:
            for _ in range(5):
                m(torch.randn(2, 4))
                s.step()
    assert list(s.disabled) == ["watch"]
    assert [r["step"] for r in sink.records] == [1, 2]  # collected at the ends of steps 0 and 1


# -- torch.compile ----------------------------------------------------------------------------------

def _records_of(model, x, compiled):
    sink = ListSink()
    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                         sink=sink, flush_every=1) as s:
        run = torch.compile(model, backend="eager") if compiled else model
        for _ in range(2):
            run(x).square().mean().backward()
            s.step()
    return by_key(sink.records)


def test_compiled_model_gives_the_eager_records():
    torch._dynamo.reset()
    m = MLP()
    x = torch.randn(8, 32)
    eager = _records_of(m, x, compiled=False)
    compiled = _records_of(m, x, compiled=True)
    assert eager.keys() == compiled.keys() and len(eager) == 2 * 3 * 2
    for k in eager:
        for stat in STAT_KEYS + ("hist",):
            a, b = eager[k][stat], compiled[k][stat]
            if stat in ("mean", "std"):
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (k, stat, a, b)
            else:
                assert a == b, (k, stat, a, b)


def test_stats_on_outputs_cause_no_graph_break():
    """hookplug's forward path (session hooks, stats plugin, the accumulating op with its
    fake kernel) is traced into the graph: one op node per hooked call."""
    torch._dynamo.reset()
    m = MLP()
    x = torch.randn(8, 32)
    with hookplug.attach(m, "Linear", plugins="stats") as s:
        out = torch._dynamo.explain(m)(x)
        assert s["stats"]._keys  # the hooks did run while tracing
    assert out.graph_break_count == 0, [str(b.reason)[:200] for b in out.break_reasons]
    ops = [n for g in out.graphs for n in g.graph.nodes if "stats_accumulate" in str(n.target)]
    assert len(ops) == 4  # fc1, fc2 (called twice), fc3: one node per call


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_grad_site_compiles_without_graph_breaks(backend):
    """Output gradients in compiled code: the stats op runs inside the compiled backward (no
    tensor hook, no graph break, no bank tensor saved for backward), one graph for every
    step with gradient accumulation and an in-place ReLU after a hooked output, and the
    records equal eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 10))
    x = torch.randn(8, 32)
    opts = ("stats", {"sites": ("output", "grad")})

    def train(run, s):
        for _ in range(3):
            for _ in range(2):  # two micro-batches per step
                run(x).square().mean().backward()
            s.step()

    eager, compiled = ListSink(), ListSink()
    with hookplug.attach(m, "Linear", plugins=opts, sink=eager, flush_every=1) as s:
        train(m, s)
    torch._dynamo.reset()
    counters.clear()
    with hookplug.attach(m, "Linear", plugins=opts, sink=compiled, flush_every=1) as s:
        train(torch.compile(m, backend=backend), s)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])
    e, c = by_key(eager.records), by_key(compiled.records)
    assert set(e) == set(c) and sum(k[2] == "grad" for k in e) == 3 * 2
    for k in e:
        for f in ("numel", "nan_count", "zero_count", "min", "max", "hist"):
            assert e[k][f] == c[k][f], (k, f)
        for f in ("mean", "std"):
            assert math.isclose(e[k][f], c[k][f], rel_tol=1e-6, abs_tol=1e-12), (k, f)


class _EagerLinear(nn.Linear):
    @torch.compiler.disable
    def forward(self, x):
        return super().forward(x)


def test_hooks_around_a_module_of_a_frame_dynamo_gave_up_on_run_as_eager_code():
    """A ``torch.compiler.disable``d forward in an ``nn.Sequential``: dynamo gives up on the
    Sequential's frame and runs its module calls from eager code with its frame hook on, so
    each hook call of the session was a frame of its own that it compiled (5 graphs where a
    plain Python hook on each Linear gives the 2 of torch's own rule, the forward of a
    hooked inbuilt module; each step 6 times as slow as eager). The hooks run as in eager:
    the plain hook's graphs, the eager records."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _EagerLinear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))
    x = torch.randn(8, 16)
    out = {}
    for mode in ("eager", "plain", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        m = copy.deepcopy(base)
        sink = ListSink()
        if mode == "plain":
            for layer in m[::2]:  # the Linears
                layer.register_forward_hook(lambda *a: None)
            session = contextlib.nullcontext()
        else:
            session = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                                      sink=sink, flush_every=1)
        with session as s:
            run = m if mode == "eager" else torch.compile(m, backend="aot_eager")
            for _ in range(3):
                run(x).square().mean().backward()
                if s is not None:
                    s.step()
        out[mode] = (by_key(sink.records), counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    # (2 graphs from torch 2.13 on; torch 2.11 compiles none for the plain hooks either)
    assert out["plain"][1] in (0, 2) and out["compiled"][1] == out["plain"][1]
    e, c = out["eager"][0], out["compiled"][0]
    assert set(e) == set(c) and len(e) == 3 * 3 * 2
    for k in e:
        for f in ("numel", "nan_count", "zero_count", "min", "max", "hist"):
            assert e[k][f] == c[k][f], (k, f)
        for f in ("mean", "std"):
            assert math.isclose(e[k][f], c[k][f], rel_tol=1e-6, abs_tol=1e-12), (k, f)


class _AliasOut(nn.Module):
    """Returns its input itself (like nn.Identity): an in-place op on the output changes it."""

    def forward(self, x):
        return x


class _ViewOut(nn.Module):
    def forward(self, x):
        return x.view(-1)


@dataclasses.dataclass
class _Out:
    a: torch.Tensor
    b: Any = dataclasses.field(init=False, default=None)  # not rebuilt by dataclasses.replace


class _DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        o = _Out(self.fc(x))
        o.b = self.fc(x) * 2
        return o


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h


class _SeqAndFirst(nn.Module):
    """Two outputs that share memory: a sequence and its first element (a view of it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h[:, 0]


class _GradSiteCases(nn.Module):
    """Outputs the compiled grad site must leave as eager code sees them."""

    def __init__(self):
        super().__init__()
        self.fc, self.alias, self.view = nn.Linear(4, 4), _AliasOut(), _ViewOut()
        self.dc, self.twice, self.seq = _DataclassOut(), _Twice(), _SeqAndFirst()

    def forward(self, x):
        h = self.fc(self.fc(x))
        g = self.alias(h)
        g += 1  # changes h too
        v = self.view(self.fc(x))
        v.mul_(2)  # changes the Linear's output too
        o = self.dc(x)
        a, b = self.twice(x)
        seq, first = self.seq(x)
        seq.relu_()  # changes first too
        return ((h * 3).sum() + g.sum() + v.sum() + o.a.sum() + o.b.sum() + (2 * a + 3 * b).sum()
                + first.square().sum() + seq.mean())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_grad_site_keeps_aliases_containers_and_shared_tensors(backend):
    """The clone of the compiled grad site never changes what the model computes: an output
    that is a module's input or a view of it, outputs that share memory with each other (a
    sequence and its first element, changed in place through the sequence), or a container
    map_tensors cannot rebuild, keeps the tensor hook; a tensor at two output paths gives both
    the whole gradient."""
    torch.manual_seed(0)
    m = _GradSiteCases()
    x = torch.randn(2, 4)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        sink = ListSink()
        with hookplug.attach(m, "Linear|_AliasOut|_ViewOut|_DataclassOut|_Twice|_SeqAndFirst",
                             plugins=("stats", {"sites": ("grad",)}), sink=sink, flush_every=1) as s:
            loss = (torch.compile(m, backend=backend) if compiled else m)(x)
            loss.backward()
            grads = [p.grad.clone() for p in m.parameters()]
            m.zero_grad()
            s.step()
        runs.append((loss.item(), grads, by_key(sink.records)))
    (le, ge, e), (lc, gc, c) = runs
    assert math.isclose(le, lc, rel_tol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ge, gc))
    # torch drops a tensor hook of a view modified in place (eager records no view/grad);
    # after the compiled code's graph break the hook is registered on the new version. The
    # alias module returns a view of its input (its own gradient, README), then modified in
    # place: no alias/grad in eager (compiled: registered after the graph break, as the view)
    c.pop((0, "view", "grad"), None)
    c.pop((0, "alias", "grad"), None)
    assert set(e) == set(c), (set(e) ^ set(c))
    assert {k[1] for k in e} >= {"dc", "twice"} and (0, "alias", "grad") not in e
    for k in e:
        assert e[k]["numel"] == c[k]["numel"] and e[k]["zero_count"] == c[k]["zero_count"], k
        assert math.isclose(e[k]["mean"], c[k]["mean"], rel_tol=1e-5, abs_tol=1e-7), k


def test_compiled_grad_site_after_remove_records_nothing():
    """A compiled backward that runs after remove() finds no bank (as removed tensor hooks)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    for compiled in (False, True):
        torch._dynamo.reset()
        s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("grad",)}))
        y = (torch.compile(m, backend="aot_eager") if compiled else m)(x).square().sum()
        s.remove()
        y.backward()
        assert s["stats"].results() == {}, compiled


@pytest.mark.parametrize("how", ["config", "enable"])
def test_compiled_grad_site_under_compiled_autograd_equals_eager(how):
    """Compiled autograd (its config flag with a compiled training step, or
    ``compiled_autograd._enable`` around a compiled model's forward and backward) copies the
    AOT backward into its own graph and drops the grad site's effectful op: grad sites take
    the tensor hooks then, which it traces, and the records equal eager."""
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    opts = ("stats", {"sites": ("output", "grad")})

    def step(run):
        loss = run(x).square().mean()
        loss.backward()
        return loss

    eager, compiled = ListSink(), ListSink()
    with hookplug.attach(m, "Linear", plugins=opts, sink=eager, flush_every=1) as s:
        for _ in range(2):
            step(m)
            s.step()
    torch._dynamo.reset()
    try:
        with hookplug.attach(m, "Linear", plugins=opts, sink=compiled, flush_every=1) as s:
            if how == "config":
                torch._dynamo.config.compiled_autograd = True
                train = torch.compile(functools.partial(step, m), backend="aot_eager")
            else:
                run = torch.compile(m, backend="aot_eager")

                def train():
                    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                        return step(run)
            for _ in range(2):
                train()
                s.step()
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    e, c = by_key(eager.records), by_key(compiled.records)
    assert set(e) == set(c) and sum(k[2] == "grad" for k in e) == 2 * 2, set(e) ^ set(c)
    for k in e:
        for f in ("numel", "nan_count", "zero_count", "min", "max", "hist"):
            assert e[k][f] == c[k][f], (k, f)
        for f in ("mean", "std"):
            assert math.isclose(e[k][f], c[k][f], rel_tol=1e-6, abs_tol=1e-12), (k, f)


def test_grad_site_of_an_eager_forward_traces_into_a_compiled_autograd_backward_without_a_break():
    """An eager forward's grad hooks traced by compiled autograd: their context has no row
    table, the traced path read it (AttributeError, caught; dynamo cannot trace the note the
    error got): a graph break per hook, and with a fullgraph compiler an error."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    xs = [torch.randn(4, 8) for _ in range(2)]
    opts = ("stats", {"sites": ("grad",)})
    eager, compiled = ListSink(), ListSink()
    with hookplug.attach(m, "Linear", plugins=opts, sink=eager, flush_every=1) as s:
        for x in xs:
            m(x).square().mean().backward()
            s.step()
    torch._dynamo.reset()
    counters.clear()
    try:
        with hookplug.attach(m, "Linear", plugins=opts, sink=compiled, flush_every=1) as s:
            for x in xs:
                loss = m(x).square().mean()
                with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
                    loss.backward()
                s.step()
            assert not s.disabled
    finally:
        torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    e, c = by_key(eager.records), by_key(compiled.records)
    assert set(e) == set(c) and len(e) == 2 * 2
    for k in e:
        for f in ("numel", "nan_count", "min", "max", "hist"):
            assert e[k][f] == c[k][f], (k, f)
        assert math.isclose(e[k]["mean"], c[k]["mean"], rel_tol=1e-6, abs_tol=1e-12), k


def test_compiled_autograd_around_backward_only_trains_on_with_shared_block_graphs():
    """Blocks compiled one by one (sharing a graph, their row tensors graph inputs) and
    compiled autograd switched on only around ``backward()``: training runs and the records,
    gradients included, equal eager. (The row tensors are saved for backward by
    ``_GradSite``: closed over, compiled autograd failed on them, IndexError in its
    prologue. Compiled autograd copies the AOT backward without its effect tokens and then
    eliminated the grad site's ``with_effects`` node as dead code: no grad records.)"""
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    m = nn.Sequential(*(_Block() for _ in range(3)))
    x = torch.randn(4, 8, requires_grad=True)
    opts = ("stats", {"sites": ("output", "grad")})

    def run(compiled):
        sink, runs, frames = ListSink(), [0], [0]
        with hookplug.attach(m, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
            if compiled:
                _compile_each(m, runs, frames)
            for _ in range(2):
                y = m(x).sum()
                if compiled:
                    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                        y.backward()
                else:
                    y.backward()
                s.step()
        _uncompile(m)
        return by_key(sink.records)

    eager, compiled = run(False), run(True)
    assert len(eager) == 2 * 6 * 2  # steps x Linears x (output, grad)
    _stat_fields_equal(eager, compiled)


def test_compiled_autograd_around_backward_only_with_checkpointed_compiled_blocks_equals_eager():
    """Blocks compiled one by one, checkpointed from eager code, compiled autograd switched
    on around ``backward()`` only: the recompute, traced while compiled autograd runs the
    backward, takes the grad-site path its forward took (it took the tensor-hook path:
    other tensors saved, torch's CheckpointError). Records equal eager."""
    from torch._dynamo import compiled_autograd
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.Sequential(*(_Block() for _ in range(2)))
    x = torch.randn(4, 8, requires_grad=True)
    opts = ("stats", {"sites": ("input", "output", "grad")})

    def run(compiled):
        sink, runs, frames = ListSink(), [0], [0]
        try:
            with hookplug.attach(m, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
                if compiled:
                    _compile_each(m, runs, frames)
                for _ in range(2):
                    h = x
                    for block in m:
                        h = checkpoint(block, h, use_reentrant=False) if compiled else block(h)
                    if compiled:
                        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                            h.sum().backward()
                    else:
                        h.sum().backward()
                    s.step()
        finally:
            _uncompile(m)
        return by_key(sink.records)

    eager, compiled = run(False), run(True)
    assert len(eager) == 2 * 4 * 3  # steps x Linears x (input, output, grad)
    _stat_fields_equal(eager, compiled)


def test_grad_site_without_the_by_key_op_falls_back_to_tensor_hooks(monkeypatch):
    """Where torch cannot keep the by-key op in a graph (no effect registration), grad sites
    take the tensor-hook path in compiled code too: a graph break per module, same records."""
    from torch._dynamo.utils import counters

    from hookplug import _bank

    monkeypatch.setattr(_bank, "_by_key_op", False)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(8, 32)
    opts = ("stats", {"sites": ("output", "grad")})
    eager, compiled = ListSink(), ListSink()
    for sink, run in ((eager, m), (compiled, None)):
        torch._dynamo.reset()
        counters.clear()
        with hookplug.attach(m, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
            assert not s["stats"].grad_in_graph
            fn = run or torch.compile(m, backend="aot_eager")
            for _ in range(2):
                fn(x).square().mean().backward()
                s.step()
    assert counters["graph_break"]  # the tensor hooks' path
    e, c = by_key(eager.records), by_key(compiled.records)
    assert set(e) == set(c) and sum(k[2] == "grad" for k in e) == 2 * 2
    for k in e:
        assert e[k]["hist"] == c[k]["hist"] and e[k]["min"] == c[k]["min"], k


def _compiled_run(model, s, x, steps, backend="eager"):
    from torch._dynamo.utils import counters

    run = torch.compile(model, backend=backend)
    outs = []
    for _ in range(steps):
        outs.append(run(x))
        s.step()
    return counters, outs


@pytest.mark.parametrize("every", [1, 2])
def test_compiled_model_does_not_recompile_every_step(every):
    """No Python counter is read inside compiled code: one graph for every step, sampled or
    not (every=2: the bank's device gate), and the records equal eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(8, 32)
    eager_sink, sink = ListSink(), ListSink()
    with hookplug.attach(m, "Linear", plugins="stats", sink=eager_sink, every=every) as s:
        for _ in range(4):
            m(x)
            s.step()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink, every=every) as s:
        _compiled_run(m, s, x, 4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["recompiles"] == {} or sum(counters["recompiles"].values()) == 0
    assert sorted({r["step"] for r in sink.records}) == list(range(0, 4, every))
    eager, compiled = by_key(eager_sink.records), by_key(sink.records)
    assert set(eager) == set(compiled)
    for k in eager:
        for f in ("numel", "nan_count", "zero_count", "min", "max", "hist"):
            assert eager[k][f] == compiled[k][f], (k, f)
        assert math.isclose(eager[k]["std"], compiled[k]["std"], rel_tol=1e-9)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_model_with_changing_sequence_lengths_compiles_as_without_hooks(dynamic):
    """Batches of varying length (an LLM's variable sequence lengths), compiled with
    automatic dynamic shapes (``dynamic=None``: a second graph with symbolic sizes at the
    second length) or ``dynamic=True``: as many graphs as without hooks, no graph break,
    and the records (outputs, gradients, parameters) equal eager, step by step."""
    from torch._dynamo.utils import counters

    def model():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return nn.Sequential(nn.Linear(8, 16), nn.TransformerEncoder(layer, 1, enable_nested_tensor=False),
                             nn.Linear(16, 4))

    lengths = (5, 7, 12, 6)

    def run(compiled, hooks):
        torch._dynamo.reset()
        counters.clear()
        m = model()
        step = torch.compile(m, backend="aot_eager", dynamic=dynamic) if compiled else m
        sink = ListSink()
        s = hookplug.attach(m, "Linear", plugins=[("stats", {"sites": ("output", "grad")}), "params"],
                            sink=sink, flush_every=1) if hooks else None
        g = torch.Generator().manual_seed(1)
        for n in lengths:
            step(torch.randn(2, n, 8, generator=g)).square().mean().backward()
            if s is not None:
                s.step()
        if s is not None:
            s.remove()
        return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), sink.records

    plain_graphs, _, _ = run(True, False)
    graphs, breaks, records = run(True, True)
    _, _, eager = run(False, True)
    assert (graphs, breaks) == (plain_graphs, 0)
    e, c = by_key(eager), by_key(records)
    assert e.keys() == c.keys() and {k[0] for k in e} == set(range(len(lengths)))
    for k in e:
        for f in ("numel", "nan_count", "zero_count", "hist"):
            assert e[k][f] == c[k][f], (k, f)
        for f in ("min", "max", "mean", "std"):
            assert math.isclose(e[k][f], c[k][f], rel_tol=1e-5, abs_tol=1e-6), (k, f, e[k][f], c[k][f])


def test_attach_after_compile_and_two_compiled_instances():
    """Attaching to a model that was compiled and ran before records every call; so do two
    compiled instances of one class (a model and its EMA copy)."""
    torch._dynamo.reset()
    a, b = MLP(), MLP()
    x = torch.randn(4, 32)
    ra, rb = torch.compile(a, backend="eager"), torch.compile(b, backend="eager")
    ra(x), rb(x)  # compiled and run before anything is attached
    with hookplug.attach(a, "Linear", plugins="stats") as sa, \
            hookplug.attach(b, "Linear", plugins="stats") as sb:
        for _ in range(3):
            ra(x), rb(x)
            sa.step(), sb.step()
        na = {k: v["output"].to_dict()["numel"] for k, v in sa["stats"].results().items()}
        nb = {k: v["output"].to_dict()["numel"] for k, v in sb["stats"].results().items()}
    # fc2 runs twice per forward: 2 * 3 calls of 4 x 64
    assert na == nb == {"fc1": 3 * 4 * 64, "fc2": 6 * 4 * 64, "fc3": 3 * 4 * 10}


def test_hooked_and_plain_instances_of_one_class_compiled_do_not_share_a_graph(fresh_dynamo):
    """A copy of the model without hooks (an EMA copy) compiled before the hooked model was
    attached to: each keeps its own graph, so the hooked one records and the plain one
    records nothing."""
    import copy

    plain = MLP()
    hooked = copy.deepcopy(plain)
    x = torch.randn(4, 32)
    run_plain, run_hooked = torch.compile(plain, backend="eager"), torch.compile(hooked, backend="eager")
    run_plain(x)
    with hookplug.attach(hooked, "Linear", plugins="stats") as s:
        for _ in range(2):
            run_plain(x), run_hooked(x), run_plain(x)
            s.step()
        numel = {k: v["output"].to_dict()["numel"] for k, v in s["stats"].results().items()}
    assert numel == {"fc1": 2 * 4 * 64, "fc2": 4 * 4 * 64, "fc3": 2 * 4 * 10}


def test_hook_guards_switch_on_when_dynamo_is_imported_after_attach(fresh_python):
    """Attached before torch._dynamo was ever imported (a fresh process), then a plain copy
    and the hooked model of one class compiled, the plain one first: still two graphs (and
    the recompile limit is raised for the hooked Linears)."""
    last = fresh_python(
        "import copy, sys, torch, hookplug\n"
        "from hookplug.models import MLP\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "plain = MLP(); hooked = copy.deepcopy(plain); x = torch.randn(4, 32)\n"
        "s = hookplug.attach(hooked, 'Linear', plugins='stats')\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "rp, rh = torch.compile(plain, backend='eager'), torch.compile(hooked, backend='eager')\n"
        "rp(x); rh(x); rp(x); s.step()\n"
        "assert torch._dynamo.config.recompile_limit == 3 + 8  # raised on import, 3 Linears\n"
        "print({k: int(v['output'].numel) for k, v in s['stats'].results().items()})\n")
    assert last == "{'fc1': 256, 'fc2': 512, 'fc3': 40}"


class _Parent(nn.Module):
    """A wrapper whose forward calls a helper with a graph break between two layers."""

    def __init__(self):
        super().__init__()
        self.body = MLP()
        self.a, self.b = nn.Linear(10, 8), nn.Linear(8, 3)

    def _head(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)

    def forward(self, x):
        return self._head(self.body(x))


@pytest.mark.parametrize("where", ["submodule", "helper with a graph break"])
def test_first_attach_recompiles_code_compiled_without_hook_guards(where, fresh_dynamo):
    """Compiled before any attach: attaching to a submodule of the compiled model, or to
    layers called from a helper method with a graph break, still records every call."""
    net, x = _Parent(), torch.randn(4, 32)
    run = torch.compile(net, backend="eager")
    run(x)
    target, expected = ((net.body, {"fc1": 2 * 4 * 64, "fc2": 4 * 4 * 64, "fc3": 2 * 4 * 10})
                        if where == "submodule" else
                        (net, {"body.fc1": 2 * 4 * 64, "body.fc2": 4 * 4 * 64,
                               "body.fc3": 2 * 4 * 10, "a": 2 * 4 * 8, "b": 2 * 4 * 3}))
    with hookplug.attach(target, "Linear", plugins="stats") as s:
        for _ in range(2):
            run(x)
            s.step()
        numel = {k: v["output"].to_dict()["numel"] for k, v in s["stats"].results().items()}
    assert numel == expected


def test_a_compiled_function_calling_the_model_reruns_with_each_attach(fresh_dynamo):
    """A compiled function (not a module) that calls the model, compiled before any attach:
    each later attach, and its removal, reaches the calls inside it."""
    m, x = MLP(), torch.randn(4, 32)
    f = torch.compile(lambda inp: m(inp).sum(), backend="eager")
    f(x)
    seen = []
    for select in ("Linear", "*:fc1"):
        with hookplug.attach(m, select, plugins="stats") as s:
            f(x)
            s.step()
            seen.append({k: v["output"].to_dict()["numel"] for k, v in s["stats"].results().items()})
    assert seen == [{"fc1": 256, "fc2": 512, "fc3": 40}, {"fc1": 256}]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _counting_backend(runs, frames):
    """aot_eager that counts the graphs it compiles (``frames``) and their runs (``runs``)."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        frames[0] += 1
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            runs[0] += 1
            return compiled(*args)
        return run
    return counting


def _compile_each(blocks, runs, frames, **kw):
    """``block.compile()`` on each block with one counting backend (so they can share graphs)."""
    backend = _counting_backend(runs, frames)
    for block in blocks:
        block.compile(backend=backend, **kw)


def _uncompile(blocks):
    for block in blocks:
        block._compiled_call_impl = None
    torch._dynamo.reset()


def _phase_step(m, model, x, train, session, runs, compiled_runs=None):
    """A training step (forward and backward) or an eval pass of ``model`` (``m`` put in
    train or eval mode), ended by ``session.step()``; ``compiled_runs``: how many compiled
    graphs the step must have run (every compiled frame ran its graph, none fell back to
    eager)."""
    m.train(train)
    runs[0] = 0
    y = model(x)
    if train:
        y.sum().backward()
    session.step()
    if compiled_runs is not None:
        assert runs[0] == compiled_runs


def _stat_fields_equal(e, c):
    """Records (by key) of an eager and a compiled run: the same keys, equal fields."""
    assert set(e) == set(c)
    for k in e:
        for f in ("numel", "nan_count", "zero_count", "min", "max", "hist", "calls"):
            assert e[k][f] == c[k][f], (k, f)
        for f in ("mean", "std"):
            assert math.isclose(e[k][f], c[k][f], rel_tol=1e-6, abs_tol=1e-12), (k, f)


@pytest.mark.parametrize("sites", [("input", "output"), ("output", "grad"), ("grad",)])
def test_regional_compilation_of_hooked_blocks_shares_one_graph(sites):
    """Each of 12 identical blocks compiled on its own (``block.compile()``, regional
    compilation) under ``fullgraph=True``: the hooked blocks share one forward graph (the
    traced hooks read no per-module constant: the hook ids are the session's, the row
    index is a per-module tensor passed as a graph input, ``ctx.name`` is never read); with
    output gradients the shared backward graph measures each block into its own rows. The
    eval rows and their tensors are made when dynamo starts the first trace (each training
    key's twin), so the first eval pass compiles one graph for the 12 blocks, as without
    hooks (the module's ``training`` flag is guarded). Records equal eager, train and eval."""
    torch.manual_seed(0)
    m = nn.Sequential(*(_Block() for _ in range(12)))
    x = torch.randn(4, 8, requires_grad=True)
    opts = ("stats", {"sites": sites})

    def run(compiled):
        sink, runs, frames, seen = ListSink(), [0], [0], []
        with hookplug.attach(m, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
            if compiled:
                _compile_each(m, runs, frames, fullgraph=True)
            for train in (True, True, False, False):
                _phase_step(m, m, x, train, s, runs, 12 if compiled else None)
                seen.append(frames[0])
        _uncompile(m)
        return by_key(sink.records), seen

    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        compiled, seen = run(True)  # first: an earlier session's keys would be assigned at attach
        eager, _ = run(False)
    assert seen == [1, 1, 2, 2]  # train: one graph for the 12 blocks; eval: one more
    assert len(eager) == 24 * (4 * len(sites) - 2 * ("grad" in sites))  # no grads in eval
    _stat_fields_equal(eager, compiled)


class _CheckpointedInside(_Block):
    """A block that checkpoints its own body (🤗 transformers 5's gradient checkpointing
    does it inside ``__call__``): compiled, the checkpoint is traced into the graph."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=False)


@pytest.mark.parametrize("sites", [("input", "output"), ("input", "output", "grad")])
@pytest.mark.parametrize("where", ["inside", "around"])
def test_checkpointed_compiled_blocks_with_input_and_output_sites_compile_as_without_hooks(where, sites):
    """Input and output sites on modules inside a checkpoint compiled with them (inside), and
    on compiled blocks checkpointed from eager code and selected themselves (around, torch's
    default ``use_reentrant=False``): as many graphs as without hooks and none after the
    first step. The pre hook no longer hands its context to the post hook through a list
    in compiled code: inside a checkpoint's traced region the list mutation graph-broke
    (the blocks ran eagerly), and around, the checkpoint's early stop raised before the
    post hook's pop, so the list grew each step and the hooks recompiled until the limit.
    Records equal eager without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def run(compiled, hooked=True):
        torch.manual_seed(0)
        blocks = nn.ModuleList((_CheckpointedInside if where == "inside" else _Block)() for _ in range(3))
        x = torch.randn(4, 8, requires_grad=True)
        sink, runs, frames, seen = ListSink(), [0], [0], []
        if compiled:
            _compile_each(blocks, runs, frames)
        selector = "Linear" if where == "inside" else "*"
        s = (hookplug.attach(blocks, selector, plugins=("stats", {"sites": sites}), sink=sink, flush_every=1)
             if hooked else None)
        for _ in range(4):
            h = x
            for block in blocks:
                if where == "around" and compiled:
                    h = checkpoint(block, h, use_reentrant=False)
                elif where == "inside" and not compiled:
                    h = _Block.forward(block, h)  # the eager reference: no checkpoint
                else:
                    h = block(h)
            h.sum().backward()
            if s:
                s.step()
            seen.append(frames[0])
        pending = sum(len(b._pending) for b in s._bindings.values()) if s else 0
        if s:
            s.remove()
        _uncompile(blocks)
        return by_key(sink.records), seen, pending

    eager, _, _ = run(False)
    compiled, seen, pending = run(True)
    _, plain, _ = run(True, hooked=False)
    assert seen[-1] == seen[0] and pending == 0, (seen, pending)
    if where == "inside":
        assert seen == plain == [1] * 4
    # (around: the selected blocks' own hooks, outside their compiled call, are frames of their own)
    _stat_fields_equal(eager, compiled)


def _inference_pass_then_training_step(train_mode: bool, compiled: bool, reset: bool = False):
    """A small MLP (in train or eval mode; compiled with aot_eager or not) attached with
    stats on outputs and gradients: a pass under ``torch.inference_mode``, a step, then
    (after ``torch._dynamo.reset()`` where asked) a training step; its records by (step,
    module, site, phase)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).train(train_mode)
    run = torch.compile(m, backend="aot_eager") if compiled else m
    sink = ListSink()
    x = torch.randn(4, 8)
    with hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}), sink=sink,
                         flush_every=1) as s:
        with torch.inference_mode():
            run(x)
        s.step()
        if reset:
            torch._dynamo.reset()
        run(x).sum().backward()
        s.step()
    torch._dynamo.reset()
    return {(r["step"], r["module"], r["site"], r["phase"]): r for r in sink.records}


def test_a_training_trace_after_dynamo_reset_is_not_labelled_by_an_earlier_inference_trace():
    """An evaluation under ``torch.inference_mode`` compiled, then ``torch._dynamo.reset()``
    (which drops the compile-start callbacks) and a training step traced at once: the
    inference mode noted for the earlier compile does not reach the new trace (noted per
    compile id, cleared at compile end), so training records stay "train"."""
    got = _inference_pass_then_training_step(train_mode=True, compiled=True, reset=True)
    assert {(k[0], k[2], k[3]) for k in got} == {(0, "output", "eval"), (1, "output", "train"),
                                                  (1, "grad", "train")}


def test_a_model_first_compiled_under_inference_mode_trains_in_eval_mode_with_the_grad_site():
    """The first compile under ``torch.inference_mode`` (a validation pass before training)
    makes the eval rows' tensors; a model then trained in eval mode (frozen norms) with
    the grad site saves them for backward: they are not inference tensors ("Inference
    tensors cannot be saved for backward"). Records equal eager."""
    eager = _inference_pass_then_training_step(train_mode=False, compiled=False)
    compiled = _inference_pass_then_training_step(train_mode=False, compiled=True)
    assert len(eager) == 2 + 4
    _stat_fields_equal(eager, compiled)


_SAC_UNDER_AOT_EAGER = pytest.mark.xfail(
    raises=NotImplementedError, strict=False,
    reason="torch: SAC's _CachingTorchDispatchMode has no rule for auto_functionalized_v2 (README)")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective"])
def test_blocks_compiled_one_by_one_and_checkpointed_from_eager_code_count_each_call_once(
        how, backend, request):
    """``block.compile()`` on each block and ``checkpoint(block, x)`` around it in eager code
    (🤗 gradient checkpointing with per-layer compile; selective: a policy saving matmuls):
    the recompute inside backward runs the compiled forward again, traced stats op included;
    the op's kernel sees that it runs inside backward (``skip_recompute``) and does nothing,
    so input and output records count each call once, and the gradient records (the same
    op, in backward) are all kept. Records equal the eager run without checkpointing."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    if how == "selective" and backend == "aot_eager":
        if torch.__version__ < "2.13":  # (compared as versions) its checkpoint keeps SAC's mode pushed
            pytest.skip("torch < 2.13: checkpoint(use_reentrant=False) does not close its "
                        "forward context when the forward raises (later tests would fail)")
        request.applymarker(_SAC_UNDER_AOT_EAGER)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    kw = {"use_reentrant": how == "reentrant"}
    if how == "selective":
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    opts = ("stats", {"sites": ("input", "output", "grad")})

    def run(compiled):
        sink = ListSink()
        try:
            with hookplug.attach(blocks, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
                if compiled:
                    for block in blocks:
                        block.compile(backend=backend)
                for _ in range(2):
                    h = x
                    for block in blocks:
                        h = checkpoint(block, h, **kw) if compiled else block(h)
                    h.sum().backward()
                    s.step()
        finally:
            _uncompile(blocks)
        return by_key(sink.records)

    compiled, eager = run(True), run(False)
    assert len(eager) == 2 * 6 * 3 and {r["calls"] for r in eager.values()} == {1}
    if backend == "aot_eager":
        _stat_fields_equal(eager, compiled)
    else:  # inductor's fused kernels round differently: counts exact, values close
        assert set(eager) == set(compiled)
        for k, e in eager.items():
            c = compiled[k]
            assert (c["calls"], c["numel"], c["nan_count"]) == (e["calls"], e["numel"], e["nan_count"]), k
            for f in ("min", "max", "mean", "std"):
                assert math.isclose(e[f], c[f], rel_tol=1e-5, abs_tol=1e-6), (k, f)


class _TupleBlock(nn.Module):
    """A block whose hooked layer returns a tuple: paths ``output[0]``/``output[1]`` have no
    row until the first call (the row tensors made at attach are the usual keys')."""

    def __init__(self):
        super().__init__()
        self.inner = _Pair()

    def forward(self, x):
        a, b = self.inner(x)
        return x + a * b


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h, torch.sigmoid(h)


def test_keys_first_seen_while_tracing_share_the_graph_from_the_next_step():
    """Output paths no row was made for at attach: the first block's trace uses constant rows
    (a graph of its own); at the start of the next block's trace the rows and row tensors of
    every module of that class are made, so the other blocks share one graph, and from the
    next step on the first block uses it too. Records equal eager."""
    torch.manual_seed(0)
    m = nn.Sequential(*(_TupleBlock() for _ in range(10)))
    x = torch.randn(4, 8, requires_grad=True)  # as every later block's input (one graph for all)

    def run(compiled):
        sink, runs, frames = ListSink(), [0], [0]
        seen = []
        with hookplug.attach(m, "_Pair", plugins="stats", sink=sink, flush_every=1) as s:
            if compiled:
                _compile_each(m, runs, frames, fullgraph=True)
            for _ in range(3):
                m(x)
                s.step()
                seen.append(frames[0])
        _uncompile(m)
        return by_key(sink.records), seen

    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        compiled, seen = run(True)  # first: an earlier session's keys would be assigned at attach
        eager, _ = run(False)
    assert seen == [2, 2, 2]  # the first block's, the shared one; nothing new later
    _stat_fields_equal(eager, compiled)


@pytest.mark.parametrize("how", ["whole-model", "per-block"])
def test_keys_first_seen_inside_a_checkpoint_while_tracing_compile(how):
    """A hooked layer returning a tuple inside activation-checkpointed blocks, no step run
    eagerly first: its ``output[0]``/``output[1]`` rows are first needed while dynamo traces
    the checkpoint. Whole model compiled (``fullgraph=True``): the row was assigned in the
    trace, a side effect dynamo refuses inside a checkpoint (the whole model ran eagerly;
    with fullgraph it raised). Blocks compiled one by one and checkpointed from eager code
    (outputs and gradients): the row tensors made at the next block's compile start made
    the first block's recompute, in backward, trace another graph (CheckpointError: the
    recomputed values differ). Records equal eager."""
    from torch.utils.checkpoint import checkpoint

    class Pair(nn.Module):  # (outputs not computed from each other: see the README on
        def __init__(self):  # a compiled grad site of such an output)
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return h * 2, torch.sigmoid(h)

    class Block(_TupleBlock):
        def __init__(self):
            super().__init__()
            self.inner = Pair()

    class Net(nn.Module):
        def __init__(self, inside):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.inside = inside

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.inside else block(x)
            return x

    def run(compiled):
        torch.manual_seed(0)
        net = Net(inside=how == "whole-model")
        x = torch.randn(4, 8, requires_grad=True)
        sink, runs, frames = ListSink(), [0], [0]
        with hookplug.attach(net, "Pair", plugins=("stats", {"sites": ("output", "grad")}),
                             sink=sink, flush_every=1) as s:
            model = net
            if compiled and how == "whole-model":
                model = torch.compile(net, backend=_counting_backend(runs, frames), fullgraph=True)
            elif compiled:
                _compile_each(net.blocks, runs, frames)
            for _ in range(3):
                runs[0] = 0
                if compiled and how == "per-block":
                    h = x
                    for block in net.blocks:
                        h = checkpoint(block, h, use_reentrant=False)
                else:
                    h = model(x)
                h.sum().backward()
                s.step()
                if compiled:
                    assert runs[0] >= 1  # compiled code ran (not the eager fallback)
        _uncompile(net.blocks)
        return by_key(sink.records)

    compiled, eager = run(True), run(False)
    assert len(eager) == 3 * 3 * 4  # steps x blocks x (output[0], output[1], grad[0], grad[1])
    _stat_fields_equal(eager, compiled)


def test_keys_first_seen_while_tracing_past_the_banks_room_compile_fullgraph():
    """Two hooked modules returning 100-tuples: the rows first needed while tracing outgrow
    the room reserved at attach; the bank grows and dynamo traces the frame again (growing
    in the trace replaced the rows tensor the graph had taken: "Guard failed on the same
    frame it was created"). The compiled model runs; records equal eager."""

    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return tuple(h * (i + 1) for i in range(100))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Many(), Many()

        def forward(self, x):
            return sum(self.a(x)) + sum(self.b(x))

    def run(compiled):
        torch.manual_seed(0)
        net, x = Net(), torch.randn(4, 8)
        sink, runs, frames = ListSink(), [0], [0]
        with hookplug.attach(net, "Many", plugins="stats", sink=sink, flush_every=1) as s:
            f = torch.compile(net, backend=_counting_backend(runs, frames), fullgraph=True) if compiled else net
            for _ in range(2):
                runs[0] = 0
                f(x)
                s.step()
                assert runs[0] == (1 if compiled else 0)
        torch._dynamo.reset()
        return by_key(sink.records)

    compiled, eager = run(True), run(False)
    assert len(eager) == 2 * 2 * 100
    _stat_fields_equal(eager, compiled)


def test_eager_hooks_on_another_thread_during_a_compile_grow_the_bank():
    """torch holds ``is_compiling()`` true for the whole process while a frame compiles, so
    eager hooks on another thread take the traced path; a key there that needs the bank to
    grow grows it (the retrace request, meant for dynamo, reached the eager hook: the
    plugin was switched off)."""
    import threading

    session_context = getattr(torch.compiler, "_compile_session_context", None)
    if session_context is None:
        pytest.skip("this torch has no compile-session flag")

    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return tuple(self.fc(x) * (i + 1) for i in range(100))

    net = nn.Sequential(Many(), Many())
    net.forward = lambda x: (sum(net[0](x)), sum(net[1](x)))
    with hookplug.attach(net, "Many", plugins="stats", on_error="warn") as s:
        compiling, done, errors = threading.Event(), threading.Event(), []

        def compiler():
            with session_context():
                compiling.set()
                done.wait()

        def eager():
            try:
                net[0](torch.randn(4, 8))
                net[1](torch.randn(4, 8))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=compiler)
        t.start()
        compiling.wait()
        e = threading.Thread(target=eager)
        e.start()
        e.join()
        done.set()
        t.join()
        assert errors == [] and s.disabled == {}
        assert len(s["stats"].results()) == 2


@pytest.mark.parametrize("whole", [False, True], ids=["per-block", "whole-model"])
def test_a_session_attached_again_runs_the_graphs_compiled_for_the_last_one(whole):
    """A session attached for a few steps, again and again, to a compiled model (a debugging
    window every N steps): each new session takes the ids the last one's hooks had, its
    stats bank is passed to the traced ops as a tensor, not a constant id, and it assigns the
    last session's keys first (into a bank of the same shape), so from the second session
    on no graph is compiled. Before, every attach compiled anew and past dynamo's recompile
    limit the hooked model ran eagerly. Records equal eager."""
    torch.manual_seed(0)
    m = nn.Sequential(*(_Block() for _ in range(6)))
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(12)]
    opts = ("stats", {"sites": ("output", "grad")})

    def run(compiled):
        records, seen, runs, frames = {}, [], [0], [0]
        model = m
        if compiled:
            if whole:
                model = torch.compile(m, backend=_counting_backend(runs, frames), fullgraph=True)
            else:
                _compile_each(m, runs, frames, fullgraph=True)
        for i, x in enumerate(xs):
            sink = ListSink()
            with hookplug.attach(m, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
                for train in (True, False):
                    _phase_step(m, model, x, train, s, runs, (1 if whole else 6) if compiled else None)
            records.update({(i,) + k: r for k, r in by_key(sink.records).items()})
            seen.append(frames[0])
        _uncompile(m)
        return records, seen

    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        eager, _ = run(False)
        compiled, seen = run(True)
    assert seen[1:] == [seen[0]] * 11, seen  # nothing compiled after the first session
    assert len(eager) == 12 * 12 * 3  # 12 sessions x 12 Linears x (train out, grad; eval out)
    _stat_fields_equal(eager, compiled)


def test_evaluations_between_compiled_training_steps_compile_no_graph_more_than_without_hooks():
    """A compiled model trained with stats on outputs and gradients, evaluated (eval mode,
    no_grad) after steps 1 and 3: as many graphs as without hooks. Before, the first
    evaluation's rows changed the table the training graph's grad sites guard on (the
    training frame compiled again at the next step), and the first evaluation traced
    with constant rows (one more graph at the second). Records equal eager."""
    def run(hooked, compiled):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        runs, frames, seen = [0], [0], []
        model = torch.compile(net, backend=_counting_backend(runs, frames)) if compiled else net
        sink = ListSink()
        s = hookplug.attach(net, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                            sink=sink, flush_every=1) if hooked else None
        x = torch.randn(4, 8)
        for step in range(6):
            model(x).sum().backward()
            if step in (1, 3):
                net.eval()
                with torch.no_grad():
                    model(x)
                net.train()
            if s:
                s.step()
            seen.append(frames[0])
        if s:
            s.remove()
        torch._dynamo.reset()
        return seen, {(r["step"], r["module"], r["site"], r["phase"]): r for r in sink.records}

    plain, _ = run(False, True)
    hooked, compiled = run(True, True)
    _, eager = run(True, False)
    assert hooked == plain == [1, 2, 2, 2, 2, 2]
    assert len(eager) == 6 * 2 * 2 + 2 * 2  # steps x Linears x (output, grad); the evals' outputs
    _stat_fields_equal(eager, compiled)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-model", "per-block"])
def test_a_compiled_model_in_train_mode_called_under_inference_mode_records_eval(whole):
    """A model left in train mode, compiled, called under ``torch.inference_mode()`` between
    training steps (an ad-hoc evaluation): its records are phase "eval", as in eager code
    (dynamo traces with inference mode off; the mode where it started compiling the frame
    is what counts), kept apart from the training rows, with as many graphs as without
    hooks. Records equal eager."""
    def run(hooked, compiled):
        torch.manual_seed(0)
        m = nn.Sequential(*(_Block() for _ in range(3)))
        runs, frames, seen = [0], [0], []
        if compiled and not whole:
            _compile_each(m, runs, frames)
        model = torch.compile(m, backend=_counting_backend(runs, frames)) if compiled and whole else m
        sink = ListSink()
        s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                            sink=sink, flush_every=1) if hooked else None
        x = torch.randn(4, 8)
        for step in range(4):
            model(x).sum().backward()
            if step in (1, 2):
                with torch.inference_mode():
                    model(x)
            if s:
                s.step()
            seen.append(frames[0])
        if s:
            s.remove()
        _uncompile(m)
        return seen, {(r["step"], r["module"], r["site"], r["phase"]): r for r in sink.records}

    plain, _ = run(False, True)
    hooked, compiled = run(True, True)
    _, eager = run(True, False)
    assert hooked == plain
    assert {k[-1] for k in eager} == {"train", "eval"}
    assert len(eager) == 4 * 6 * 2 + 2 * 6  # steps x Linears x (output, grad); the evals' outputs
    _stat_fields_equal(eager, compiled)


@pytest.mark.parametrize("compiled", [None, "whole", "per-block"])
def test_a_frozen_submodule_in_eval_mode_records_with_the_training_step(compiled):
    """A frozen backbone kept in eval mode inside a training model (linear probing, a
    distillation teacher) runs in the training step: phase "train", one row per step; the
    validation between steps (the model in eval mode) is phase "eval" apart (the phase was
    the module's own mode: the backbone's training rows were all "eval", merged with the
    validation's). Compiled: the same records, as many graphs as without hooks."""
    def run(hooked):
        torch.manual_seed(0)
        m = nn.Sequential(*(_Block() for _ in range(3)))
        m[0].requires_grad_(False)
        runs, frames, seen = [0], [0], []
        if compiled == "per-block":
            _compile_each(m, runs, frames)
        model = torch.compile(m, backend=_counting_backend(runs, frames)) if compiled == "whole" else m
        sink = ListSink()
        s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                            sink=sink, flush_every=1) if hooked else None
        x = torch.randn(4, 8)
        for step in range(3):
            m.train()
            m[0].eval()  # the frozen backbone
            model(x).sum().backward()
            if step == 1:
                m.eval()
                with torch.no_grad():
                    model(x * 100)
            if s:
                s.step()
            seen.append(frames[0])
        if s:
            s.remove()
        if compiled == "per-block":
            _uncompile(m)
        torch._dynamo.reset()
        return seen, {(r["step"], r["module"], r["site"], r["phase"]): r for r in sink.records}

    plain, _ = run(False)
    graphs, records = run(True)
    if compiled:
        assert graphs == plain
    frozen = {k: r for k, r in records.items() if k[1].startswith("0.") and k[2] == "output"}
    assert sorted((k[0], k[3]) for k in frozen if k[1] == "0.fc1") == [
        (0, "train"), (1, "eval"), (1, "train"), (2, "train")]
    assert all(r["calls"] == 1 for r in frozen.values())
    assert records[(1, "0.fc1", "output", "eval")]["max"] > 10 * records[(1, "0.fc1", "output", "train")]["max"]
    assert not any(k[2] == "grad" and k[3] == "eval" for k in records)


def test_attached_under_inference_mode_then_compiled_training_measures_gradients():
    """Attached inside ``torch.inference_mode()`` (from an evaluation callback), then
    compiled training with the grad site: nothing the bank saves for backward is an
    inference tensor (the bank's token was: "Inference tensors cannot be saved for
    backward"). Records equal eager."""
    got = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(*(_Block() for _ in range(2)))
        run = torch.compile(m, backend="aot_eager") if compiled else m
        sink = ListSink()
        with torch.inference_mode():
            s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                                sink=sink, flush_every=1)
        x = torch.randn(2, 8, requires_grad=True)
        for _ in range(2):
            run(x).sum().backward()
            s.step()
        s.remove()
        torch._dynamo.reset()
        got[compiled] = by_key(sink.records)
    assert len(got[False]) == 2 * 4 * 2  # steps x Linears x (output, grad)
    _stat_fields_equal(got[False], got[True])


class _CompiledInside(nn.Module):
    """Lightning's recipe: a submodule compiled in place (``self.net = torch.compile(...)``)."""

    def __init__(self, compiled, backend=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if compiled:
            self.net = torch.compile(self.net, backend=backend)

    def forward(self, x):
        return self.net(x)


def test_a_submodule_compiled_in_place_keeps_its_names_and_is_hooked_once():
    """``torch.compile``'s wrapper adds an ``_orig_mod`` segment to every name under it;
    names are the eager model's (selectors written for it match, records line up), the
    wrapper itself is not hooked beside the module it wraps (its output counted twice), and
    records and parameter names equal eager."""
    runs, frames = [0], [0]
    got = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        m = _CompiledInside(compiled, _counting_backend(runs, frames))
        assert [n for n, _ in hookplug.select(m, "*")] == ["net", "net.0", "net.1", "net.2"]
        assert [n for n, _ in hookplug.select(m, "*:net.0", strict=True)] == ["net.0"]
        sink = ListSink()
        with hookplug.attach(m, "*", plugins=["stats", ("params", {"params": "*.weight"})],
                             sink=sink, flush_every=1) as s:
            for _ in range(2):
                m(torch.randn(4, 8)).sum().backward()
                s.step()
        got[compiled] = by_key(sink.records)
    assert frames[0] >= 1 and runs[0] == 2  # the compiled run ran compiled code
    assert {k[1] for k in got[True]} == {"net", "net.0", "net.1", "net.2", "net.0.weight", "net.2.weight"}
    _stat_fields_equal(got[False], got[True])


def test_a_backward_left_from_a_removed_session_records_nothing_in_the_next():
    """A compiled forward run under one session, that session removed and another attached,
    then the backward: the gradients belong to no live session's forward (the new session
    never saw it), so the new session records no gradient, as in eager code."""
    torch.manual_seed(0)
    m = nn.Sequential(*(_Block() for _ in range(3)))
    x = torch.randn(4, 8, requires_grad=True)
    opts = ("stats", {"sites": ("output", "grad")})
    got = {}
    for compiled in (False, True):
        if compiled:
            _compile_each(m, [0], [0], fullgraph=True)
        for _ in range(2):  # the second time, the new session reuses the first's graphs
            first = hookplug.attach(m, "Linear", plugins=opts)
            y = m(x)
            first.remove()
            sink = ListSink()
            with hookplug.attach(m, "Linear", plugins=opts, sink=sink, flush_every=1) as s:
                y.sum().backward()
                s.step()
                m(x).sum().backward()  # its own step: gradients recorded
                s.step()
            got[compiled] = sorted((r["step"], r["site"]) for r in sink.records)
        _uncompile(m)
    assert got[True] == got[False] == [(1, "grad")] * 6 + [(1, "output")] * 6


def test_rows_spread_at_compile_start_when_dynamo_is_imported_after_attach(fresh_python):
    """Attached before torch._dynamo was imported (a fresh process): the compile-start
    callback that gives the training keys their eval twins (and spreads first-seen keys to
    the identical blocks) is registered by the import hook, so an eval pass before any step
    compiles one graph, not one per block."""
    last = fresh_python(
        "import sys, torch, torch.nn as nn, hookplug\n"
        "class B(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return x + self.fc(x)\n"
        "m = nn.Sequential(*(B() for _ in range(6))); x = torch.randn(2, 8, requires_grad=True)\n"
        "s = hookplug.attach(m, 'Linear', plugins='stats')\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "frames = [0]\n"
        "def backend(gm, inputs):\n"
        "    frames[0] += 1\n"
        "    return gm.forward\n"
        "for b in m: b.compile(backend=backend)\n"
        "seen = []\n"
        "m.eval()  # keys no row was made for at attach, met before any step\n"
        "for _ in range(2):\n"
        "    m(x); s.step(); seen.append(frames[0])\n"
        "print(seen)\n")
    assert last == "[1, 1]"  # one graph for the 6 blocks (without the callback: 6, then 7)


def test_inference_mode_is_read_in_compiled_code_when_dynamo_is_imported_after_attach(fresh_python):
    """Attached before torch._dynamo was imported (a fresh process): the compile-start
    callback notes inference mode and the traced reader is marked a trace constant once
    dynamo is imported, so a compiled model in train mode called under inference_mode
    records phase "eval"."""
    last = fresh_python(
        "import sys, torch, torch.nn as nn, hookplug\n"
        "m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "got = []\n"
        "class Sink:\n"
        "    @hookplug.hookimpl\n"
        "    def hookplug_flush(self, records):\n"
        "        got.extend(records)\n"
        "s = hookplug.attach(m, 'Linear', plugins='stats', sink=Sink(), flush_every=1)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "run = torch.compile(m, backend='aot_eager')\n"
        "run(torch.randn(2, 8)); s.step()\n"
        "with torch.inference_mode():\n"
        "    run(torch.randn(2, 8))\n"
        "s.step(); s.remove()\n"
        "print(sorted({(r['step'], r['phase']) for r in got}))\n")
    assert last == "[(0, 'train'), (1, 'eval')]"


class _NamedScale(hookplug.Plugin):
    """A traceable third-party plugin that reads ``ctx.name`` in compiled code (each
    hooked module's traced graph is then its own)."""

    name = "namedscale"

    def __init__(self):
        self.names = []

    @hookplug.hookimpl
    def hookplug_forward_output(self, ctx, module, args, kwargs, output):
        return output * (2.0 if ctx.name.endswith("fc1") else 1.0)


def test_a_plugin_reading_ctx_name_in_compiled_code_gets_each_module_its_graph():
    """Reading ``ctx.name`` inside compiled code makes each hooked block's graph its own:
    attach raises dynamo's recompile limit to cover them, every block runs compiled, and the
    outputs equal eager."""
    torch.manual_seed(0)
    m = nn.Sequential(*(_Block() for _ in range(12)))
    x = torch.randn(4, 8)
    with hookplug.attach(m, "Linear", plugins=_NamedScale()):
        expected = m(x)
    runs, frames = [0], [0]
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        with hookplug.attach(m, "Linear", plugins=_NamedScale()):
            assert torch._dynamo.config.recompile_limit == 24 + 8
            _compile_each(m, runs, frames, fullgraph=True)
            got = m(x)
        with hookplug.attach(m[0], "Linear", plugins=_NamedScale()):  # 2 + 8: never lowered
            assert torch._dynamo.config.recompile_limit == 24 + 8
    _uncompile(m)
    assert frames[0] == 12 and runs[0] == 12
    assert torch.equal(expected, got)


def _decorated(fn):
    """A decorator like transformers' ``can_return_tuple``: forward's code is the wrapped one."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class _BreakingNet(nn.Module):
    """A decorated forward with a graph break between its layers (code after the break is
    compiled as a resume function of its own)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    @_decorated
    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


@pytest.fixture
def fresh_dynamo():
    """dynamo as in a fresh process: no compiled code, hook guards off (the switch that
    attach makes is process-wide and would hide what these tests check)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_attach_after_compile_reaches_wrapped_forwards_and_code_after_graph_breaks(backend, fresh_dynamo):
    net, x = _BreakingNet(), torch.randn(4, 8)
    run = torch.compile(net, backend=backend)
    expected = net(x)
    run(x).sum().backward()  # compiled (two frames) before anything is attached
    with hookplug.attach(net, "Linear", plugins="stats") as s:
        for _ in range(2):
            out = run(x)
            out.sum().backward()
            s.step()
        numel = {k: v["output"].to_dict()["numel"] for k, v in s["stats"].results().items()}
    assert numel == {"a": 2 * 4 * 8, "b": 2 * 4 * 3}
    torch.testing.assert_close(out, expected)


# -- CUDA: the flush never makes the training loop wait ------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_training_step_with_stats_never_syncs():
    m = MLP().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(64, 32, device="cuda")
    sink = ListSink()
    seen, state, _ = capture_outputs(m)
    with hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}), sink=sink,
                         flush_every=2) as s:
        for step in range(2):  # warm-up: allocator, pinned pool, lazy init
            state["step"] = step
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(2, 6):
                state["step"] = step
                m(x * step).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.step()  # flushes at steps 4 and 6: pack, copy to pinned memory, poll
        finally:
            torch.cuda.set_sync_debug_mode(0)
        s.flush()  # wait=True: a sync is allowed here
    recs = by_key(sink.records)
    assert {k[0] for k in recs} == set(range(6))
    for (step, mod, site), rec in recs.items():
        if site == "output":
            assert_record_matches(rec, torch.cat([o.reshape(-1) for o in seen[(step, mod)]]).cpu(), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_every_plugin_in_a_bf16_autocast_training_step_never_syncs(device):
    """stats (outputs and gradients), params, gradclamp, capture (to the CPU) and flops
    together, bf16 autocast, telemetry flushed every 2 steps: on CUDA no step waits for the
    GPU (``set_sync_debug_mode("error")``); the records are those of the values the model
    computed, every step's parameters are measured, the captures are the last outputs."""
    torch.manual_seed(0)
    m = MLP().to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(64, 32, device=device)
    sink = ListSink()
    seen, state, _ = capture_outputs(m)
    plugins = [("stats", {"sites": ("output", "grad")}), "params", ("gradclamp", {"max_norm": 0.05}),
               ("capture", {"to": "cpu"}), "flops"]
    no_sync = _sync_debug_error if device == "cuda" else contextlib.nullcontext
    with hookplug.attach(m, "Linear", plugins=plugins, sink=sink, flush_every=2) as s:
        for step in range(6):
            state["step"] = step
            with no_sync() if step >= 2 else contextlib.nullcontext():  # after 2 warm-up steps
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = m(x * (step + 1)).float().square().mean()
                loss.backward()
                opt.step()
                s.step()  # flushes at steps 2, 4 and 6 (pack, copy to pinned memory, poll)
                opt.zero_grad(set_to_none=True)
        s.flush()  # wait=True: a sync is allowed here
        features = {k: v.clone() for k, v in s["capture"].features.items()}
        changed = {k: v["changed"] for k, v in s["gradclamp"].results().items()}
        flops = s["flops"].total()
    recs = by_key(sink.records)
    assert {k[0] for k in recs} == set(range(6))
    for step in range(6):
        for name in ("fc1", "fc2", "fc3"):
            out, rec = torch.cat([o.reshape(-1) for o in seen[(step, name)]]).cpu(), recs[(step, name, "output")]
            # (log2 buckets put -2^k with -2^k..-2^(k+1), torch.histogram with -2^k..-2^(k-1):
            # bf16 values are often powers of two; the pure-torch reference counts as the op)
            assert rec["hist"] == hookplug.ops.reference_tensor_stats(out).hist_counts.tolist()
            assert_record_matches({**rec, "hist": []}, out.float(), rel=1e-5)
            assert (step, name, "grad") in recs
            for site in ("weight", "grad", "update"):
                assert recs[(step, f"{name}.weight", site)]["numel"] > 0
    for name in ("fc1", "fc3"):
        assert features[name].device.type == "cpu"
        assert torch.equal(features[name], seen[(5, name)][-1].cpu())
    assert set(changed) == {"fc1", "fc2", "fc3"} and flops["flops"] > 0 and flops["backward_flops"] > 0


@contextlib.contextmanager
def _sync_debug_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_flush_in_flight_is_emitted_later_in_order():
    m = MLP().cuda()
    sink = ListSink()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink) as s:
        for _ in range(3):
            m(torch.randn(4096, 32, device="cuda"))
            s.step()
            s.flush(wait=False)
        torch.cuda.synchronize()
        s.step()  # polls: everything finished is emitted now, without waiting
        assert not s._telemetry.in_flight
    assert [r["step"] for r in sink.records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


# -- torch.compile on real models ------------------------------------------------------------------------

def _train_steps(model, s, make_loss, steps):
    for _ in range(steps):
        make_loss(model).backward()
        s.step()


def _compare_compiled_with_eager(model, select, make_loss, steps=3, backend="aot_eager",
                                 sites=("output",), **compile_kw):
    """Graphs and recompiles of the compiled model with stats attached against the same model
    compiled without hooks; records of compiled training steps against eager ones. Returns
    torch._dynamo's counters of the hooked run."""
    from torch._dynamo.utils import counters

    eager = ListSink()
    with hookplug.attach(model, select, plugins=("stats", {"sites": sites}), sink=eager) as s:
        _train_steps(model, s, make_loss, steps)
    torch._dynamo.reset()
    counters.clear()
    plain = torch.compile(model, backend=backend, **compile_kw)
    for _ in range(2):
        make_loss(plain)
    graphs_plain = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    compiled = ListSink()
    hooked = torch.compile(model, backend=backend, **compile_kw)
    with hookplug.attach(model, select, plugins=("stats", {"sites": sites}), sink=compiled) as s:
        _train_steps(hooked, s, make_loss, steps)
    assert counters["stats"]["unique_graphs"] == graphs_plain, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])
    e, c = by_key(eager.records), by_key(compiled.records)
    assert set(e) == set(c) and len(e) >= steps * 4
    for k in e:
        for f in ("numel", "nan_count", "inf_count"):
            assert e[k][f] == c[k][f], (k, f)
        scale = max(abs(e[k]["min"]), abs(e[k]["max"]), 1e-3)
        assert math.isclose(e[k]["mean"], c[k]["mean"], rel_tol=1e-4, abs_tol=1e-5 * scale), k
        assert math.isclose(e[k]["std"], c[k]["std"], rel_tol=1e-4, abs_tol=1e-5 * scale), k
    return dict(counters["inductor"])


def _small_gpt2(device="cpu"):
    """A 2-layer GPT-2 from config (no weights downloaded) and its training loss."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, 100, (2, 16), device=device)
    return model, lambda m: m(ids, labels=ids).loss


def test_regional_compilation_of_gpt2_blocks_compiles_the_graphs_of_no_hooks():
    """transformers' GPT-2 (6 blocks, from config), each ``GPT2Block`` compiled on its own
    and trained with stats on outputs and gradients of every Conv1D/Linear: the blocks share
    one graph as they do without hooks (each compiled its own before), records equal eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=6,
                                     n_head=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 16))

    def run(compiled, hooked=True):
        sink, runs, frames, seen = ListSink(), [0], [0], []
        s = hookplug.attach(model, "Linear|Conv1D", plugins=("stats", {"sites": ("output", "grad")}),
                            sink=sink, flush_every=1) if hooked else None
        if compiled:
            _compile_each(model.transformer.h, runs, frames)
        for _ in range(2):
            model(ids, labels=ids, use_cache=False).loss.backward()  # (a KV cache: a graph per block)
            if s is not None:
                s.step()
            seen.append(frames[0])
        if s is not None:
            s.remove()
        _uncompile(model.transformer.h)
        return by_key(sink.records), seen

    _, plain = run(True, hooked=False)
    eager, _ = run(False)
    compiled, seen = run(True)
    assert plain == seen == [1, 1]
    assert len(eager) == 2 * (6 * 4 + 1) * 2  # steps x (4 per block + lm_head) x (output, grad)
    _stat_fields_equal(eager, compiled)


def test_compiled_gpt2_training_steps_equal_eager_without_extra_graphs():
    """A GPT-2 from config (transformers' Conv1D projections and the LM head), compiled
    (aot_eager) and trained: stats add no graph and no recompile, records equal eager."""
    model, loss = _small_gpt2()
    _compare_compiled_with_eager(model, "Linear|Conv1D", loss)


def test_compiled_gpt2_grad_site_equals_eager_without_extra_graphs():
    """The same with output gradients: their stats run inside the compiled backward graphs
    (several graphs here: the bank is never saved for backward between them)."""
    model, loss = _small_gpt2()
    _compare_compiled_with_eager(model, "Linear|Conv1D", loss, sites=("output", "grad"))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_inductor_on_cuda_gpt2_training_steps_equal_eager():
    """The same with inductor's generated CUDA kernels around the op."""
    model, loss = _small_gpt2("cuda")
    _compare_compiled_with_eager(model, "Linear|Conv1D", loss, backend="inductor")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_reduce_overhead_cuda_graphs_gpt2_training_steps_equal_eager():
    """inductor's CUDA graphs (mode="reduce-overhead"): replayed steps keep accumulating into
    the bank, records equal eager, and stats do not make inductor skip its CUDA graphs."""
    model, loss = _small_gpt2("cuda")
    inductor = _compare_compiled_with_eager(model, "Linear|Conv1D", loss, steps=4,
                                            backend="inductor", mode="reduce-overhead")
    assert not inductor.get("cudagraph_skips"), inductor


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_on_cuda_gpt2_grad_site_equals_eager(mode):
    """Output gradients under inductor on CUDA (and its CUDA graphs): the by-key op inside the
    compiled backward, no extra graph, records equal eager, no CUDA graph skipped."""
    model, loss = _small_gpt2("cuda")
    kw = {"mode": mode} if mode else {}
    inductor = _compare_compiled_with_eager(model, "Linear|Conv1D", loss, steps=4, backend="inductor",
                                            sites=("output", "grad"), **kw)
    assert not inductor.get("cudagraph_skips"), inductor


def test_compiled_resnet18_training_steps_equal_eager_without_extra_graphs():
    try:
        import torchvision
    except Exception as exc:  # noqa: BLE001 - PyPI torchvision does not import beside torch 2.13 CPU
        pytest.skip(f"torchvision does not import here: {exc}")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    _compare_compiled_with_eager(model, "Conv2d|Linear",
                                 lambda m: nn.functional.cross_entropy(m(x), y), steps=2)


def test_packed_device_path_gives_the_records_of_the_host_path(monkeypatch):
    """Device rows are packed into one buffer (rows and first_bad columns of every group)
    and copied to the host once; CPU rows skip that. Forced on the CPU, the packed path
    gives the same records, for two producers of different widths and a NaN step."""
    from hookplug import _telemetry

    def run():
        torch.manual_seed(0)
        m, sink = MLP(), ListSink()
        with hookplug.attach(m, "Linear", plugins=["stats", ("params", {"bins": 0})], sink=sink,
                             flush_every=2) as s:
            for step in range(4):
                x = torch.randn(8, 32)
                if step == 2:
                    x[0, 0] = math.nan
                m(x).sum().backward()
                s.step()
        return [{k: v for k, v in r.items() if k not in ("time", "run_id")} for r in sink.records]

    host = run()
    monkeypatch.setattr(_telemetry, "_PACK_CPU_ROWS", True)
    packed = run()
    assert len(host) == len(packed) > 0
    assert any(r["first_nonfinite"] for r in host)
    for a, b in zip(host, packed):
        assert a.keys() == b.keys()
        for k in a:
            same = a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
            assert same, (k, a[k], b[k])


def test_a_producer_may_refill_its_rows_while_an_earlier_flush_waits(monkeypatch):
    """A producer returning the same preallocated rows at every collect, while the flights
    before are not done (as a device copy still running): each step keeps its own values."""
    from hookplug import _telemetry
    from hookplug._stats import StatsBlock

    class Refill:
        name = "refill"

        def __init__(self):
            self.rows = torch.zeros(1, hookplug.ops.tensor_stats(torch.ones(1), bins=0).row.numel(),
                                    dtype=torch.float64)

        @hookplug.hookimpl
        def hookplug_collect(self, session, step):
            self.rows.copy_(hookplug.ops.tensor_stats(torch.full((4,), float(step)), bins=0).row[None])
            return [StatsBlock([{"step": step, "module": "custom", "site": "w"}], self.rows, "none")]

    done = {"copies": False}
    monkeypatch.setattr(_telemetry._Flight, "ready", lambda self: done["copies"])
    sink = ListSink()
    with hookplug.attach(nn.Sequential(nn.Linear(2, 2)), "Linear", plugins=Refill(), sink=sink,
                         flush_every=1) as s:
        s.step()
        s.step()
        done["copies"] = True
        s.flush()
    means = {r["step"]: r["mean"] for r in sink.records if r["module"] == "custom"}
    assert means[1] == 1.0 and means[2] == 2.0, means


def _same_value(a, b):
    """Equal, or both float NaN; bitwise for floats (0.0 vs -0.0 differ)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return type(a) is type(b) and a == b


def _random_groups(seed):
    """Stats rows of random tensors (every float dtype, NaN/Inf, all-NaN, empty, tiny
    values), one group per histogram kind, with metas of every shape a producer may give."""
    from hookplug import ops
    from hookplug._stats import FIRST_BAD, HEAD, M2, empty_rows
    from hookplug._telemetry import _Group

    g = torch.Generator().manual_seed(seed)

    def tensor(i):
        dt = (torch.float32, torch.float64, torch.float16, torch.bfloat16)[i % 4]
        n = int(torch.randint(0, 3000, (1,), generator=g))
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** float(torch.randint(-30, 5, (1,), generator=g))).to(dt)
        if n and i % 3 == 0:
            x[int(torch.randint(0, n, (1,), generator=g))] = math.nan
        if n and i % 5 == 0:
            x[0] = -math.inf
        if n and i % 7 == 0:
            x[:] = math.nan
        return x

    kinds = [dict(bins=0), dict(hist="log2"), dict(bins=7, hist="linear"),
             dict(bins=5, hist="linear", range=(-1.0, 2.0)), dict(bins=5, hist="linear", range=(-1.0, 2.0))]
    groups, parts = [], []
    for k, kw in enumerate(kinds):
        rows = torch.stack([ops.tensor_stats(tensor(i + 10 * k), **kw).row for i in range(9)])
        rows = torch.cat([rows, empty_rows(1, rows.shape[1] - HEAD)])  # untouched
        rows[1, M2] = -1e-30  # a negative M2 left by a merge is clamped
        rows[2, FIRST_BAD], rows[5, FIRST_BAD] = 7.0, 3.0  # rows that saw a NaN/Inf
        metas = [{"step": 3 + (i % 2), "module": f"g{k}.m{i}", "site": "output"} for i in range(rows.shape[0])]
        metas[0]["phase"] = "eval"
        metas[1]["phase"] = None
        metas[2].update(phase="train", note="a producer's key", step_extra=1.5)
        if k == 4:  # not plain dicts: the Python builder, in the same flush
            metas = [collections.OrderedDict(m) for m in metas]
        times = [100.0 + i for i in range(rows.shape[0])]
        hist = {0: None, 1: "log2", 2: "linear", 3: ("linear", -1.0, 2.0), 4: ("linear", -1.0, 2.0)}[k]
        groups.append(_Group(metas, times, 0, rows.shape[0], rows.shape[1], hist))
        parts.append((rows, None))  # None: the rows' own first_bad column
    return groups, parts


@pytest.mark.parametrize("seed", range(3))
def test_compiled_record_builder_equals_the_python_reference(seed, monkeypatch):
    """The flush's compiled record builder (csrc/stats_records.cpp) gives, record for record,
    the keys, order and values (floats bitwise) of the Python code it replaces, on rows of
    every kind and dtype with NaN/Inf, no finite value, no call, and producers' own keys;
    records with equal edges share one list, and the NaN/Inf rows come with their clocks."""
    from hookplug import _telemetry, ops

    if ops.rows_to_records() is None:
        pytest.skip("the compiled extension is not loaded")
    groups, parts = _random_groups(seed)
    fb = hookplug._stats.FIRST_BAD
    # rows and clocks read in place at their strides: non-contiguous rows with a separate
    # clock tensor of other values, and the clock column as an [R] and an [R, 1] view
    rows1 = parts[1][0].t().contiguous().t()
    clocks1 = torch.full((rows1.shape[0],), math.inf, dtype=torch.float64)
    clocks1[4], clocks1[6] = 11.0, 2.0
    parts[1] = (rows1, clocks1)
    parts[2] = (parts[2][0], parts[2][0][:, fb])
    parts[3] = (parts[3][0], parts[3][0][:, fb:fb + 1])
    fast, fast_bad = _telemetry._build_records(groups, parts, 1, "run-x")
    monkeypatch.setattr(ops, "rows_to_records", lambda: None)
    ref, ref_bad = _telemetry._build_records(groups, parts, 1, "run-x")
    assert len(fast) == len(ref) == sum(int((r[:, 0] > 0).sum()) for r, _ in parts)
    for a, b in zip(fast, ref):
        assert list(a) == list(b)
        for k in a:
            if isinstance(a[k], list):
                assert len(a[k]) == len(b[k]) and all(map(_same_value, a[k], b[k])), k
            else:
                assert _same_value(a[k], b[k]), (k, a[k], b[k])
    assert [(r["module"], c) for r, c in fast_bad] == [(r["module"], c) for r, c in ref_bad]
    assert len(fast_bad) > 0
    assert [(r["module"], c) for r, c in fast_bad if r["module"].startswith("g1.")] == [("g1.m4", 11.0), ("g1.m6", 2.0)]
    assert ("g2.m2", 7.0) in [(r["module"], c) for r, c in fast_bad]
    for recs in (fast, ref):  # equal edges: one list, across both builders in one flush
        by_value = {}
        for r in recs:
            if r["hist_edges"]:
                assert by_value.setdefault(tuple(r["hist_edges"]), r["hist_edges"]) is r["hist_edges"]
    shared = [r["hist_edges"] for r in fast if r["module"][:3] in ("g3.", "g4.")]  # one range
    assert len(shared) == 18 and all(e is shared[0] for e in shared)


def test_compiled_record_builder_rejects_bad_input_by_name():
    from hookplug import ops
    from hookplug._telemetry import _RECORD_KEYS

    fast = ops.rows_to_records()
    if fast is None:
        pytest.skip("the compiled extension is not loaded")
    rows = torch.zeros(2, 12, dtype=torch.float64)
    rows[:, 0] = 1
    metas = [{"step": 0, "module": "a", "site": "output"}] * 2
    args = (metas, [0.0, 0.0], 0, None, _RECORD_KEYS, [], False, False, {})
    with pytest.raises(ValueError, match="expected float64 CPU rows"):
        fast(rows.float(), None, *args)
    with pytest.raises(ValueError, match="expected 2 metas and stamps, got 1"):
        fast(rows, None, metas[:1], *args[1:])
    with pytest.raises(ValueError, match=r"first_bad clocks \(\[R\] or \[R, 1\]\)"):
        fast(rows, torch.zeros(2, 2, dtype=torch.float64), *args)
    with pytest.raises(TypeError, match="every meta must be a dict"):
        fast(rows, None, [metas[0], ("not", "a dict")], *args[1:])
    with pytest.raises(KeyError, match="module"):
        fast(rows, None, [{"step": 0, "site": "output"}] * 2, *args[1:])


def test_both_record_builders_skip_and_refuse_the_same_rows(monkeypatch):
    """A row with numel below 1 is untouched (no record) and a NaN count raises as int()
    does, in the compiled builder and in the Python reference alike."""
    from hookplug import _telemetry, ops
    from hookplug._stats import empty_rows
    from hookplug._telemetry import _Group

    rows = empty_rows(3, 0)
    rows[0, 0], rows[1, 0], rows[2, 0] = 0.5, 1.0, 2.0
    grp = _Group([{"step": 0, "module": f"m{i}", "site": "output"} for i in range(3)],
                 [0.0] * 3, 0, 3, rows.shape[1], None)
    builders = [lambda: _telemetry._build_records([grp], [(rows, None)], 0, None)]
    if ops.rows_to_records() is not None:
        def python_only():
            with monkeypatch.context() as m:
                m.setattr(ops, "rows_to_records", lambda: None)
                return _telemetry._build_records([grp], [(rows, None)], 0, None)
        builders.append(python_only)
    for build in builders:
        records, _ = build()
        assert [r["module"] for r in records] == ["m1", "m2"]
    rows[0, 1] = math.nan  # the untouched row's nan_count
    for build in builders:
        with pytest.raises(ValueError, match="NaN"):
            build()


# -- Ctrl-C (a BaseException) during a flush ----------------------------------------------------

class Interrupting(ListSink):
    """A sink that raises KeyboardInterrupt on its ``at``-th call (Ctrl-C while it writes)."""

    name = "interrupting"

    def __init__(self, at=2):
        super().__init__()
        self.at = at

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        self.records.extend(records)


class InterruptOnce:
    """A producer whose ``hookplug_collect`` raises KeyboardInterrupt once, after the stats
    plugin (before it in the list) handed over its steps."""

    name = "interrupt_once"

    def __init__(self, at=2):
        self.calls, self.at = 0, at

    @hookplug.hookimpl
    def hookplug_collect(self):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["sink", "collect", "pack", "records"])
def test_a_ctrl_c_during_a_flush_loses_and_repeats_no_step(where, monkeypatch):
    """A KeyboardInterrupt in a flush (a sink, a producer's collect, packing the rows, building
    the records) keeps what the flush took: remove()'s final flush (the with block's) hands
    every ended step to each sink once."""
    from hookplug import _telemetry

    plugins, sinks = [("stats", {"bins": 0})], [ListSink()]
    if where == "sink":
        sinks.insert(0, Interrupting())
    elif where == "collect":
        plugins.append(InterruptOnce())
    else:
        if where == "records":  # rows packed and copied: records built when the flight lands
            monkeypatch.setattr(_telemetry, "_PACK_CPU_ROWS", True)
        build, calls = _telemetry._build_records, []

        def interrupted_once(*args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return build(*args)

        monkeypatch.setattr(_telemetry, "_build_records", interrupted_once)
    m, ended = MLP(), 0
    with pytest.raises(KeyboardInterrupt):
        with hookplug.attach(m, "Linear", plugins=plugins, sink=sinks, flush_every=2) as s:
            for _ in range(10):
                m(torch.randn(2, 32))
                s.step()
                ended += 1
    assert ended == 3  # the second flush (steps 2 and 3) was interrupted
    assert s.removed and not s._telemetry.in_flight and not s._telemetry._carry
    everything = {(st, mod, "output") for st in range(4) for mod in ("fc1", "fc2", "fc3")}
    assert set(by_key(sinks[-1].records)) == everything  # by_key: none twice
    if where == "sink":  # the sink that was interrupted gets that flush again
        assert set(by_key(sinks[0].records)) == everything and sinks[0].calls == 3


def test_a_ctrl_c_as_a_sink_returns_gives_no_sink_the_flush_twice():
    """A signal that came during a sink's last (C) code is raised once the sink returned,
    in the session's loop: that sink has the flush, and the final flush skips it (here the
    hook is C code that raises the signal, as such a late Ctrl-C is seen)."""
    import _thread
    import functools

    late, sink, m = ListSink(), ListSink(), MLP()
    late.name = "late"
    s = hookplug.attach(m, "Linear", plugins=("stats", {"bins": 0}), sink=[late, sink], flush_every=1)
    s._entries["late"].impls["hookplug_flush"] = type("Impl", (), {
        "function": functools.partial(_thread.interrupt_main), "argnames": ()})
    m(torch.randn(2, 32))
    with pytest.raises(KeyboardInterrupt) as info:
        s.step()
    assert info.traceback[-1].name == "_dispatch"  # raised in the loop, not inside a hook
    assert len(s._telemetry.in_flight) == 1  # the flight waits for "listsink"
    s.remove()  # no second KeyboardInterrupt: "late" is not called again
    assert set(by_key(sink.records)) == {(0, mod, "output") for mod in ("fc1", "fc2", "fc3")}


def test_every_sink_gets_a_flush_when_one_raises_under_raise():
    class Broken:
        name = "broken"

        @hookplug.hookimpl
        def hookplug_flush(self, records):
            raise OSError("disk full")

    good, m = ListSink(), MLP()
    s = hookplug.attach(m, "Linear", plugins="stats", sink=[Broken(), good], flush_every=1)
    m(torch.randn(2, 32))
    with pytest.raises(OSError, match="disk full"):
        s.step()
    assert {r["step"] for r in good.records} == {0} and len(good.records) == 3
    assert not s._telemetry.in_flight  # the flush is done: not handed over again
    s.remove()
    assert len(good.records) == 3


def test_session_nonfinite_keeps_the_latest_ten_thousand():
    """An Inf in an output every step (masked logits) adds an entry per step: the latest
    10,000 are kept, as a list."""
    class Masked(nn.Module):
        def forward(self, x):
            return x.masked_fill(torch.arange(x.shape[-1]) >= 2, -math.inf)

    m = nn.Sequential(nn.Linear(4, 4), Masked())
    with hookplug.attach(m, "*", plugins=("stats", {"bins": 0}), sink=ListSink(), flush_every=2) as s:
        for _ in range(2):
            m(torch.randn(2, 4))
            s.step()
        assert s.nonfinite == [{"step": st, "module": "1", "site": "output", "phase": "train", "rank": 0}
                               for st in range(2)]
        for step in range(2, 10_005):
            s._note_nonfinite({"step": step})
        kept = s.nonfinite
        assert type(kept) is list and len(kept) == 10_000
        assert kept[0]["step"] == 5 and kept[-1]["step"] == 10_004
        kept.clear()  # a copy
        assert len(s.nonfinite) == 10_000


_GUARDS_ON_ANOTHER_THREAD = """
import sys, threading
import torch, torch.nn as nn
import hookplug
assert "torch._dynamo" not in sys.modules
m = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3)) for _ in range(12)])
s = hookplug.attach(m, "Linear", plugins="stats")
t = threading.Thread(target=lambda: __import__("torch._dynamo"))  # imported elsewhere first
t.start(); t.join()
import torch._dynamo.config as c
torch.compile(m, backend="eager")(torch.randn(2, 3))
seen = [(c.skip_nnmodule_hook_guards, c.recompile_limit)]
def other():
    torch.compile(lambda x: x * 2, backend="eager")(torch.randn(2))
    seen.append((c.skip_nnmodule_hook_guards, c.recompile_limit))
t = threading.Thread(target=other); t.start(); t.join()
print(seen)
"""


def test_a_thread_that_compiles_gets_the_module_hook_guards():
    """dynamo's config settings are per thread (torch 2.13): dynamo first imported on another
    thread, or a compile on a thread other than the one that attached, ran without the
    module-hook guards and with the default recompile limit."""
    import ast
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _GUARDS_ON_ANOTHER_THREAD], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ast.literal_eval(out.stdout.strip().splitlines()[-1]) == [(False, 20), (False, 20)]


def test_remove_while_a_timer_threads_step_is_delivering_sends_each_step_once(tmp_path):
    """A server's timer thread calls ``step()``; the main thread calls ``remove()`` while that
    step hands its flush to a (slow) sink. remove() waits for it, and no sink gets a step
    twice (its final flush handed the flush in delivery to the slow sink again)."""
    import json
    import threading

    entered, release = threading.Event(), threading.Event()

    class Slow(hookplug.Sink):
        def __init__(self):
            super().__init__()
            self.got = []

        @hookplug.hookimpl
        def hookplug_flush(self, session, records):
            self.got.extend((r["step"], r["module"]) for r in records)
            if threading.current_thread() is not threading.main_thread() and not entered.is_set():
                entered.set()
                release.wait(10)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    slow, path = Slow(), str(tmp_path / "t.jsonl")
    s = hookplug.attach(model, "Linear", plugins="stats", sink=[slow, ("jsonl", {"path": path})],
                        flush_every=1)
    model(torch.randn(2, 4))
    errors = []

    def timer():
        try:
            s.step()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=timer, daemon=True)
    t.start()
    assert entered.wait(10)
    model(torch.randn(2, 4))
    threading.Timer(0.2, release.set).start()  # remove() waits for the timer's delivery
    s.remove()
    release.set()
    t.join(10)
    assert not t.is_alive() and not errors
    want = collections.Counter({(0, "0"): 1, (0, "1"): 1, (1, "0"): 1, (1, "1"): 1})
    assert collections.Counter(slow.got) == want
    with open(path) as f:
        assert collections.Counter((r["step"], r["module"]) for r in map(json.loads, f)) == want


def test_a_model_with_no_parameters_compiled_before_any_eager_call_fullgraph():
    """A model with no parameters (its device unknown at attach) compiled before any eager
    call, with stats on outputs and gradients: the bank's rows on the input's device were
    made in the trace under a lock (a graph break; ``fullgraph=True`` raised). The rows are
    made while tracing and dynamo traces the frame again. One graph run a step (compiled
    twice in all: the modules' row tensors, made at the first step's end, change what the
    graph guards on, as for a model whose keys are all new at its first trace); records
    equal eager."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.act, self.out = nn.GELU(), nn.Tanh()

        def forward(self, x):
            return self.out(self.act(x) * 3)

    def run(compiled):
        torch.manual_seed(0)
        net, x = Net(), torch.randn(4, 8, requires_grad=True)
        sink, runs, frames = ListSink(), [0], [0]
        with hookplug.attach(net, "*", plugins=("stats", {"sites": ("output", "grad")}),
                             sink=sink, flush_every=1) as s:
            f = torch.compile(net, backend=_counting_backend(runs, frames), fullgraph=True) if compiled else net
            for _ in range(3):
                runs[0] = 0
                f(x).sum().backward()
                s.step()
                assert runs[0] == (1 if compiled else 0)
        torch._dynamo.reset()
        if compiled:
            assert frames[0] <= 2, frames
        return by_key(sink.records)

    compiled, eager = run(True), run(False)
    assert {key[2] for key in eager} == {"output", "grad"}, sorted(eager)
    _stat_fields_equal(eager, compiled)
