"""The eager hot path of the stats engine: ``_C.accumulate`` (the op without torch.ops'
argument parsing) and the CPU one-chunk path for small dense tensors, each checked against
the general path and a float64 reference."""
import math

import pytest
import torch
import torch.nn as nn

import hookplug
from hookplug import ops
from hookplug._bank import StatsBank
from hookplug._stats import CALLS, HEAD, TensorStats, empty_rows, merge_rows

pytestmark = pytest.mark.skipif(ops.eager_accumulate() is None, reason="needs the compiled op")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
KINDS = [(None, "log2", None), (0, "log2", None), (10, "linear", (-2.0, 2.0))]


def _values(n, dtype, gen):
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    if n > 8:
        x[::7] = 0.0
        x[3] = -0.0
        x[5], x[6], x[8] = math.nan, math.inf, -math.inf
        x[-1] = 1e-30  # subnormal / underflow in the small dtypes
    return x.to(dtype)


def _rows(x, kind, via):
    bins, hist, rng = kind
    b, mode, lo, hi = ops.hist_args(bins, hist, rng)
    acc = empty_rows(2, ops.buckets(b, hist), *(rng or (0.0, 0.0)))
    if hist == "log2" and b != 0:
        edge = math.ldexp(1.0, ops.LOG2_MAX_EXP + 1)
        acc[:, 8], acc[:, 9] = -edge, edge
    via(x, acc, 1, None, b, mode, lo, hi)
    return acc


@pytest.mark.parametrize("kind", KINDS, ids=["log2", "bins0", "linear"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 512, 2048, 2049, 65536, 70000])
def test_eager_entry_equals_torch_ops_bitwise(n, dtype, kind):
    x = _values(n, dtype, torch.Generator().manual_seed(n))
    a = _rows(x, kind, ops.eager_accumulate())
    b = _rows(x, kind, torch.ops.hookplug.stats_accumulate_)
    assert torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 5, 64, 2048, 2049, 16384, 16385, 65536])
def test_one_chunk_path_equals_general_path_and_reference(n, dtype):
    """A dense tensor of <= 16384 elements takes the one-chunk path (larger ones the chunked
    path, in 16384-element chunks); the same values in a
    strided view take the general path. Counts, extremes and buckets are equal exactly;
    mean and M2 agree with a float64 reference."""
    gen = torch.Generator().manual_seed(100 + n)
    x = _values(n, dtype, gen)
    spread = torch.zeros(2 * n, dtype=dtype)
    spread[::2] = x
    strided = spread[::2]  # not dense: the general (chunked) path
    assert not strided.is_contiguous()
    eager = ops.eager_accumulate()
    for kind in KINDS[:2]:
        fast = _rows(x, kind, eager)[1]
        slow = _rows(strided, kind, eager)[1]
        exact = [0, 1, 2, 3, 4, 5, 8, 9] + list(range(HEAD, fast.numel()))
        assert torch.equal(fast[exact], slow[exact])
        ref = ops.reference_tensor_stats(x.double(), bins=kind[0], hist=kind[1]).row
        finite = x.double()[torch.isfinite(x.double())]
        if finite.numel():
            assert fast[6].item() == pytest.approx(finite.mean().item(), rel=1e-5, abs=1e-6 * finite.abs().max().item())
            assert fast[7].item() == pytest.approx(ref[7].item(), rel=1e-4, abs=1e-9)
        assert torch.equal(fast[:4], ref[:4])


def test_permuted_dense_tensor_takes_the_fast_path_with_the_same_values():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    t = x.t()  # dense, not contiguous
    eager = ops.eager_accumulate()
    a = _rows(t, KINDS[0], eager)[1]
    b = _rows(t.contiguous(), KINDS[0], eager)[1]
    exact = [0, 1, 2, 3, 4, 5] + list(range(HEAD, a.numel()))
    assert torch.equal(a[exact], b[exact])
    assert a[6].item() == pytest.approx(x.double().mean().item(), abs=1e-6)


def test_bank_needs_no_detach_and_leaves_autograd_alone():
    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    w = torch.randn(4, 8, requires_grad=True)
    y = w * 2
    bank.accumulate(y, ("m", "output", "train"))
    bank.accumulate(w, ("p", "weight", "train"))  # a leaf that requires grad
    y.sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 2.0))
    got = bank.merged(lambda k: k)
    assert got[("m", "output", "train")].numel.item() == 32
    ref = TensorStats(ops.reference_tensor_stats(w.detach().double()).row, "log2")
    # a mean near 0 is exact to its float32 sums: compared on the scale of the std
    assert got[("p", "weight", "train")].mean.item() == pytest.approx(ref.mean.item(), abs=1e-6 * ref.std.item())


def test_subclass_inputs_take_the_torch_ops_path():
    class Tagged(torch.Tensor):
        pass

    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    x = torch.randn(3, 5).as_subclass(Tagged)
    bank.accumulate(x, ("m", "output", "train"))
    got = bank.merged(lambda k: k)[("m", "output", "train")]
    assert got.numel.item() == 15
    assert got.max.item() == pytest.approx(x.as_subclass(torch.Tensor).max().item())


def test_stats_plugin_records_equal_reference_on_small_layers():
    """End to end on the eager path: 3 small layers, 2 calls each, totals equal a float64
    reference of the outputs recorded without hooks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    xs = [torch.randn(5, 8), torch.randn(3, 8)]
    outs = {n: [] for n in ("0", "1", "2")}
    hs = [model[int(n)].register_forward_hook(lambda m, i, o, n=n: outs[n].append(o.detach()))
          for n in outs]
    with torch.no_grad():
        for x in xs:
            model(x)
    for h in hs:
        h.remove()
    with hookplug.attach(model, "*", plugins="stats") as s, torch.no_grad():
        for x in xs:
            model(x)
        res = s["stats"].results()
    for n, parts in outs.items():
        v = torch.cat([p.reshape(-1) for p in parts]).double()
        st = res[n]["output"]
        assert st.numel.item() == v.numel()
        assert st.min.item() == v.min().item() and st.max.item() == v.max().item()
        assert st.mean.item() == pytest.approx(v.mean().item(), abs=1e-6)
        assert st.std.item() == pytest.approx(v.std(unbiased=False).item(), rel=1e-5)


# -- the bank across inference mode, growth and threads ---------------------------------------------

def _wide(n):
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)])


def test_results_read_under_inference_mode_then_reset():
    m = _wide(3)
    with hookplug.attach(m, "Linear", plugins="stats") as s:
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward()
            s.step()
        with torch.inference_mode():
            before = s["stats"].results()["0"]["output"].numel.item()
        s.reset()  # in place: would refuse inference tensors
        m(torch.randn(2, 4))
        assert before == 24 and s["stats"].results()["0"]["output"].numel.item() == 8


def test_bank_growth_in_an_eval_forward_under_inference_mode_then_flush_and_step():
    """40 modules: the eval phase's 40 new keys grow the bank past 64 rows while an ended
    step's snapshot (old capacity) waits for telemetry."""
    class Keep(hookplug.Sink):
        name = "keep"

        def __init__(self):
            super().__init__()
            self.records = []

        @hookplug.hookimpl
        def hookplug_flush(self, session, records):
            self.records += records

    m, sink = _wide(40), Keep()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink) as s:
        m(torch.randn(2, 4)).sum().backward()
        s.step()
        m.eval()
        with torch.inference_mode():
            m(torch.randn(2, 4))
        m.train()
        s.flush()
        m(torch.randn(2, 4)).sum().backward()
        s.step()
    phases = [(r["step"], r["phase"]) for r in sink.records]
    assert phases.count((0, "train")) == 40 and phases.count((1, "eval")) == 40
    assert phases.count((1, "train")) == 40


def test_a_reader_thread_loses_no_ended_step():
    import threading

    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    x, key, steps = torch.ones(4), ("m", "output", "train"), 400
    stop = threading.Event()

    def read():
        while not stop.is_set():
            bank.merged(lambda k: k)

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(steps):
            bank.accumulate(x, key)
            bank.end_step(i)
    finally:
        stop.set()
        t.join()
    assert bank.merged(lambda k: k)[key].numel.item() == 4 * steps


def test_threads_meeting_a_new_device_or_key_together_share_its_row(monkeypatch):
    """Threads sharing a model that meet a key or a device first at the same moment (a
    model with no parameters, an eval forward): one row and one device bank, every call
    merged. Made deterministic by slowing the creation down (``time.sleep`` lets the other
    threads run)."""
    import threading
    import time

    from hookplug import _bank

    make_rows = _bank._DeviceRows.__init__

    def slow_rows(self, *args, **kwargs):
        time.sleep(0.05)
        make_rows(self, *args, **kwargs)

    class SlowKeys(list):
        def append(self, key):
            time.sleep(0.05)
            super().append(key)

    monkeypatch.setattr(_bank._DeviceRows, "__init__", slow_rows)
    bank = StatsBank(bins=0)
    bank.prepare()  # the device is not known yet
    bank.keys = SlowKeys()
    threads, start = 4, threading.Barrier(4)
    xs = [torch.full((10,), float(i)) for i in range(threads)]

    def run(i):
        start.wait()
        bank.accumulate(xs[i], ("m", "output", "eval"))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    [w.start() for w in workers]
    [w.join() for w in workers]
    assert list(bank.keys) == [("m", "output", "eval")] and len(bank._devices) == 1
    st = bank.merged(lambda k: k)[("m", "output", "eval")]
    assert st.numel.item() == 10 * threads and st.calls.item() == threads
    assert st.mean.item() == pytest.approx(torch.cat(xs).mean().item())


def _same_stats(row: torch.Tensor, x: torch.Tensor) -> None:
    """``row`` holds exactly the statistics of ``x`` (counts, extremes and buckets equal,
    mean and M2 to float rounding)."""
    ref = ops.tensor_stats(x).row
    exact = [0, 1, 2, 3, 4, 5, 8, 9] + list(range(HEAD, ref.numel()))
    assert torch.equal(row[exact], ref[exact])
    n = ref[0].item()
    spread = (ref[7].item() / n) ** 0.5  # the std: the scale of the mean's rounding
    assert row[6].item() == pytest.approx(ref[6].item(), abs=1e-6 * spread)
    assert row[7].item() == pytest.approx(ref[7].item(), rel=1e-5)


def test_snapshots_of_a_growing_key_set_fold_and_flush_exactly():
    """Keys first met in later steps (earlier snapshots hold fewer rows), a bank that grows
    past its capacity mid-run, then 40 steps waiting for telemetry (more than one snapshot
    block and fold batch): every ended step reaches telemetry with its own statistics, and
    the totals equal the statistics of everything each key saw."""
    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    seen, collected = {}, {}
    for step in range(80):
        for j in range(3 * min(step, 39)):  # 117 keys from step 39: the 64-row bank grows twice
            x = torch.randn(3 + j, generator=gen)
            key = (f"m{j}", "output", "train")
            bank.accumulate(x, key)
            seen.setdefault(key, {})[step] = x
        bank.end_step(step)
        if step % 7 == 6 and step < 40 or step == 79:  # then 40 steps wait (> a snapshot block)
            for block in bank.collect(lambda key, st: {"step": st, "key": key}):
                for meta, row in zip(block.metas, block.rows):
                    if row[0] > 0:
                        collected[(meta["key"], meta["step"])] = row
    assert len(collected) == sum(len(v) for v in seen.values()) == 3 * 39 * 40 // 2 + 117 * 40
    for key, steps in seen.items():
        for step, x in steps.items():
            _same_stats(collected[(key, step)], x)
    merged = bank.merged(lambda k: k)
    for key, steps in seen.items():
        _same_stats(merged[key].row, torch.cat(list(steps.values())))


def test_a_merge_into_the_rows_a_growing_bank_replaced_is_kept():
    """Another thread's op that read ``acc`` before the bank grew and merges after (CPU
    kernels run without the GIL): its merge lands in the old rows, which are kept and merged
    into the step at ``end_step`` (they were copied at growth and the late merge was lost:
    a bug hunt's two threads recorded 297 of 300 calls). The running step read before
    ``end_step`` (``merged``) holds it too."""
    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    key = ("big", "output", "train")
    xs = [torch.randn(5000, generator=gen) for _ in range(3)]
    bank.accumulate(xs[0], key)
    dev = bank.device_rows(torch.device("cpu"))
    before, row = dev.acc, bank.rows[key]
    capacity = bank._capacity
    for j in range(capacity):  # the bank grows
        bank.row_of((f"m{j}", "output", "train"))
    assert bank._capacity > capacity and dev.acc is not before
    torch.ops.hookplug.stats_accumulate_(xs[1], before, row, dev.gate, *bank.op_args)  # the late merge
    bank.accumulate(xs[2], key)
    whole = torch.cat(xs)
    _same_stats(bank.merged(lambda k: k)[key].row, whole)
    bank.end_step(0)
    assert not dev.retired
    (block,) = bank.collect(lambda k, st: {"key": k})
    (got,) = [r for m, r in zip(block.metas, block.rows) if m["key"] == key]
    _same_stats(got, whole)
    assert int(got[CALLS]) == 3


def test_a_merge_running_without_the_gil_lands_in_exactly_one_step():
    """A CPU op on a large tensor (2**16 elements or more) reads it without the GIL and then
    folds it into its row; ``session.step()`` on another thread (a server's timer) copies
    and resets the rows meanwhile. The fold must land before the copy or after the reset,
    never between them (a bug hunt's request threads lost 1 to 2 of 900 calls). Wide rows
    (linear histogram) keep the step's copies long, so each call falls inside one."""
    import threading

    if ops.snapshot_rows() is None:
        pytest.skip("needs the compiled extension")
    bank = StatsBank(bins=32768, hist="linear", range=(-4.0, 4.0))
    bank.prepare(torch.device("cpu"))
    keys = [(f"m{i}", "output", "eval") for i in range(16)]
    for key in keys:
        bank.row_of(key)
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    calls, done, started = 300, threading.Event(), threading.Event()

    def run():
        started.set()
        for _ in range(calls):
            bank.accumulate(x, keys[-1])
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(10)
    step = 0
    while not done.is_set() and step < 100_000:
        bank.end_step(step)
        step += 1
    t.join(10)
    bank.end_step(step)
    st = bank.merged(lambda k: k)[keys[-1]]
    assert (st.calls.item(), st.numel.item()) == (calls, calls * x.numel())


def test_snapshots_keep_no_more_memory_than_they_hold():
    """A key set that grows every step (a snapshot of its own each time) and then stays put
    (slots of one block per fold batch): the ended steps waiting for telemetry keep at most
    about twice the bytes of their rows alive."""
    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    for step in range(60):
        for j in range(min(step, 30) + 1):
            bank.accumulate(torch.ones(3), (f"m{j}", "output", "train"))
        bank.end_step(step)
    snaps = [snap for _, by_dev in bank.pending for snap in by_dev.values()]
    held = sum(s.nbytes for s in snaps)
    storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in snaps}
    assert sum(storages.values()) <= 2 * held, (sum(storages.values()), held)


def test_totals_a_reader_holds_never_change_under_it():
    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    dev = bank.device_rows(torch.device("cpu"))
    bank.accumulate(torch.ones(3), ("m", "output", "train"))
    bank.end_step(0)
    held = dev.fold()
    before = held.clone()
    for step in range(1, 40):  # two more fold batches
        bank.accumulate(torch.ones(3), ("m", "output", "train"))
        bank.end_step(step)
    assert torch.equal(held, before)
    assert dev.fold()[1, 0].item() == 3 * 40


def test_compiled_snapshot_equals_torch_copies_and_advances_versions():
    """``_C.snapshot_rows(acc, empty, snap)``: snap gets acc, acc gets empty (empty itself
    untouched), and both written tensors' version counters advance as ``copy_`` would."""
    snapshot = ops.snapshot_rows()
    gen = torch.Generator().manual_seed(3)
    acc = torch.randn(7, HEAD + 5, generator=gen, dtype=torch.float64)
    empty = torch.randn(7, HEAD + 5, generator=gen, dtype=torch.float64)
    snap = torch.zeros(4, 7, HEAD + 5, dtype=torch.float64).unbind(0)[2]  # a slot, as the bank's
    acc0, empty0 = acc.clone(), empty.clone()
    versions = acc._version, snap._version
    snapshot(acc, empty, snap)
    assert torch.equal(snap, acc0) and torch.equal(acc, empty0) and torch.equal(empty, empty0)
    assert acc._version > versions[0] and snap._version > versions[1]


@pytest.mark.parametrize("case", ["dtype", "shape", "strided", "overlap", "empty_shape"])
def test_compiled_snapshot_refuses_bad_rows_by_name(case):
    snapshot = ops.snapshot_rows()
    acc = torch.zeros(4, HEAD + 2, dtype=torch.float64)
    empty, snap = acc.clone(), acc.clone()
    args = {"dtype": (acc, empty, snap.float()),
            "shape": (acc, empty, snap[:3]),
            "strided": (acc, empty, torch.zeros(HEAD + 2, 4, dtype=torch.float64).t()),
            "overlap": (acc, empty, acc),
            "empty_shape": (acc, empty[:, :3], snap)}[case]
    before = [t.clone() for t in args]
    with pytest.raises(ValueError, match="snapshot_rows: "):
        snapshot(*args)
    assert all(torch.equal(t, b) for t, b in zip(args, before))  # nothing written


def test_bank_step_boundary_is_the_same_with_and_without_the_compiled_snapshot():
    """Snapshots, resets and folds over 40 steps (more than two snapshot blocks) with the
    compiled step boundary equal those of the torch copies it replaces."""
    def run(compiled):
        bank = StatsBank()
        bank.prepare(torch.device("cpu"))
        dev = bank.device_rows(torch.device("cpu"))
        if not compiled:
            dev._snapshot = None
        gen = torch.Generator().manual_seed(5)
        for step in range(40):
            for j in range(3 + (step == 20)):  # a key first met mid-run
                bank.accumulate(torch.randn(17 + j, generator=gen), (f"m{j}", "output", "train"))
            bank.end_step(step)
        snaps = [s.clone() for _, by_dev in bank.pending for s in by_dev.values()]
        return snaps, dev.fold().clone(), dev.acc.clone()

    fast, slow = run(True), run(False)
    assert len(fast[0]) == len(slow[0]) == 40
    for a, b in zip(fast[0], slow[0]):
        assert torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))
    assert torch.equal(fast[1].nan_to_num(nan=7.0), slow[1].nan_to_num(nan=7.0))
    assert torch.equal(fast[2].nan_to_num(nan=7.0), slow[2].nan_to_num(nan=7.0))


def test_compiled_eval_rows_fit_without_growing_the_bank_while_tracing():
    """36 Linear layers: their 36 eval-phase rows, assigned while dynamo traces the first
    eval forward, would pass the bank's first 64 rows; the session reserves room at start,
    so the fullgraph trace never grows it (it used to fail on torch.is_inference_mode_enabled)."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(36)])
    x = torch.randn(2, 4)
    eager = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        with hookplug.attach(m, "Linear", plugins="stats") as s:
            f = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
            m.train()
            f(x).sum().backward()
            m.eval()
            with torch.no_grad():
                f(x)
            m.train()
            res = {(n, ph): float(st["output"].max)
                   for ph in ("train", "eval") for n, st in s["stats"].results(phase=ph).items()}
        if not compiled:
            eager = res
    assert len(res) == 72 and res == pytest.approx(eager, rel=1e-6)


# -- the calls column: every folded call counts, empty tensors included --------------------------

@pytest.mark.parametrize("via", ["eager", "torch_ops", "reference"])
def test_calls_column_counts_every_call_even_empty_ones(via):
    fn = {"eager": ops.eager_accumulate(), "torch_ops": torch.ops.hookplug.stats_accumulate_,
          "reference": ops.reference_accumulate_}[via]
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(5, generator=gen), torch.empty(0), torch.randn(3, 4, generator=gen).t(),
             torch.empty(2, 0), _values(70000, torch.float32, gen)]
    acc = empty_rows(3, ops.LOG2_BINS)
    on, off = torch.tensor([True]), torch.tensor([False])
    for x in parts:
        fn(x, acc, 1, None, 1, 0, None, None)
        fn(x, acc, 2, off, 1, 0, None, None)  # a gated-off call is not a call
    fn(torch.empty(0), acc, 2, on, 1, 0, None, None)
    st, only_empty = TensorStats(acc[1]), TensorStats(acc[2])
    assert int(st.calls) == len(parts) and int(acc[0, 0]) == len(parts) + 1
    assert int(st.numel) == sum(x.numel() for x in parts)
    whole = ops.reference_tensor_stats(torch.cat([x.reshape(-1).float() for x in parts]))
    assert int(whole.calls) == 1 and int(st.nan_count) == int(whole.nan_count)
    assert int(only_empty.calls) == 1 and int(only_empty.numel) == 0
    assert math.isnan(float(only_empty.mean)) and math.isnan(float(only_empty.zero_fraction))
    merged = merge_rows(torch.stack([acc[1], acc[2], empty_rows(1, ops.LOG2_BINS)[0]]))
    assert int(merged[CALLS]) == len(parts) + 1


def test_tensor_stats_is_one_call_on_every_backend():
    for x in (torch.randn(10), torch.empty(0), torch.full((4,), math.nan)):
        assert int(ops.tensor_stats(x).calls) == 1 == int(ops.reference_tensor_stats(x).calls)


class _Router(nn.Module):
    """Two experts; ``idle`` gets no token (an empty slice) in every call."""

    def __init__(self):
        super().__init__()
        self.busy, self.idle = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.busy(self.busy(x)).sum() + self.idle(x[:0]).sum()


def test_a_site_empty_in_every_call_has_an_entry_and_a_record():
    """An expert no token reached ran with empty tensors: it gets stats with ``calls`` and
    ``numel`` 0 (NaN statistics), in ``results()`` and in the telemetry records; a module
    called twice a step has ``calls`` 2."""
    model, kept = _Router(), []

    class Keep(hookplug.Plugin):
        name = "keep"

        @hookplug.hookimpl
        def hookplug_flush(self, records):
            kept.extend(records)

    stats = ("stats", {"sites": ("input", "output", "grad")})
    with hookplug.attach(model, "Linear", plugins=[stats, Keep()], flush_every=1) as s:
        for _ in range(2):
            model(torch.randn(3, 4)).backward()
            s.step()
        res = s["stats"].results()
    assert int(res["idle"]["output"].calls) == 2 and int(res["idle"]["output"].numel) == 0
    assert int(res["idle"]["input[0]"].calls) == 2 and int(res["idle"]["grad"].calls) == 2
    assert math.isnan(float(res["idle"]["output"].max))
    assert int(res["busy"]["output"].calls) == 4 and int(res["busy"]["output"].numel) == 4 * 12
    by = {(r["step"], r["module"], r["site"]): r for r in kept}
    for step in (0, 1):
        idle = by[(step, "idle", "output")]
        assert (idle["calls"], idle["numel"]) == (1, 0)
        assert math.isnan(idle["mean"]) and math.isnan(idle["zero_fraction"]) and idle["l2"] == 0.0
        assert by[(step, "idle", "grad")]["calls"] == 1
        assert by[(step, "busy", "output")]["calls"] == 2


def test_an_interrupted_collect_keeps_its_steps_pending():
    """A KeyboardInterrupt while the bank hands its ended steps to telemetry leaves them
    pending, before any step ended since, for the next collect."""
    bank = StatsBank(bins=0)
    bank.prepare(torch.device("cpu"))
    for step in range(3):
        bank.accumulate(torch.full((2,), float(step)), ("m", "output", "train"))
        bank.end_step(step)

    def interrupted(key, step):
        if step == 1:
            raise KeyboardInterrupt
        return {"step": step}

    with pytest.raises(KeyboardInterrupt):
        bank.collect(interrupted)
    bank.accumulate(torch.ones(2), ("m", "output", "train"))
    bank.end_step(3)
    blocks = bank.collect(lambda key, step: {"step": step})
    assert [b.metas[0]["step"] for b in blocks] == [0, 1, 2, 3]
    assert [TensorStats(b.rows[0], b.hist).max.item() for b in blocks] == [0.0, 1.0, 2.0, 1.0]


def test_a_signal_handler_removing_the_session_inside_a_fold_loses_no_step(monkeypatch):
    """SIGTERM -> session.remove() -> sys.exit(), arriving while step() folds the bank (every
    16th step, under the bank's lock): the final flush ends a step there, taking the lock
    again (it must not deadlock), and the step that was folding reaches the sink too."""
    import collections
    import threading

    from conftest import RecordSink
    from hookplug import _bank

    fold, armed = _bank.merge_rows, {"on": False}
    sink, m = RecordSink(), nn.Sequential(nn.Linear(4, 4))
    s = hookplug.attach(m, "Linear", plugins=("stats", {"bins": 0}), sink=sink, flush_every=10)

    def handler_runs_inside(*args, **kwargs):  # the signal handler, run inside the fold
        if armed["on"]:
            armed["on"] = False
            s.remove()
            raise SystemExit(0)
        return fold(*args, **kwargs)

    monkeypatch.setattr(_bank, "merge_rows", handler_runs_inside)
    ended = []

    def train():
        try:
            for step in range(40):
                m(torch.randn(2, 4))
                armed["on"] = armed["on"] or step == 20  # folds at steps 15 and 31
                s.step()
                ended.append(step)
        except SystemExit:
            pass

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "deadlock: remove() in the fold waits for the lock the fold holds"
    assert ended == list(range(31)) and s.removed
    count = collections.Counter(r["step"] for r in sink.records)
    assert count == {step: 1 for step in range(32)}  # step 31 was folding: not lost


def test_merging_constant_data_keeps_mean_exact_and_std_zero():
    """The weighted mean of equal means rounded an ulp (0.1 merged over 8 steps gave
    0.10000000000000002 > max, std 1.4e-17): a ``std == 0`` dead-unit check failed. Constant
    data merges to mean = min = max and M2 = 0; other data keeps min <= mean <= max."""
    gen = torch.Generator().manual_seed(0)
    for value in (0.1, 1.0 / 3.0, -7.3e-5, 1e300):
        for _ in range(20):
            sizes = torch.randint(1, 40, (8,), generator=gen).tolist()
            rows = torch.stack([ops.tensor_stats(torch.full((n,), value, dtype=torch.float64)).row
                                for n in sizes])
            st = TensorStats(merge_rows(rows))
            assert float(st.mean) == value == float(st.min) == float(st.max)
            assert float(st.std) == 0.0
    parts = [torch.randn(int(n), dtype=torch.float64, generator=gen) * 1e-3 + 5.0 for n in (3, 17, 9)]
    st = TensorStats(merge_rows(torch.stack([ops.tensor_stats(p).row for p in parts])))
    assert float(st.min) <= float(st.mean) <= float(st.max)
    torch.testing.assert_close(st.mean, torch.cat(parts).mean(), rtol=1e-15, atol=0)


def test_merged_while_another_thread_assigns_a_key():
    """``merged`` (a session's ``results()``/``report()`` on a monitoring thread) while a
    request thread's forward meets a key first: the rows it read are of the keys it looks
    at (an IndexError when the loop read the grown key list)."""
    import threading

    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    bank.accumulate(torch.ones(4), ("a", "output", "eval"))
    assigned = []

    def select(key):  # between reading the rows and walking the keys: a new key
        if not assigned:
            t = threading.Thread(target=bank.accumulate, args=(torch.ones(2), ("b", "output", "eval")))
            t.start()
            t.join()
            assigned.append(t)
        return key

    assert list(bank.merged(select)) == [("a", "output", "eval")]
    assert bank.merged(lambda k: k)[("b", "output", "eval")].numel.item() == 2


def test_a_device_the_compiled_op_has_no_kernel_for_uses_the_reference(monkeypatch):
    """Where ``_C`` has no kernel for a device (built without its CUDA kernels, an MPS or
    XPU model) ``ops.tensor_stats`` fell back to the reference, but the bank (stats, params)
    always called the compiled op: NotImplementedError at every hooked call. The bank now
    asks per device (shown on the CPU, the only device here, told it has no kernel)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(4, 6)

    def run():
        m.zero_grad()
        with hookplug.attach(m, "Linear", plugins=["stats", "params"]) as s:
            m(x).square().sum().backward()
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            return s["stats"].results(), s["params"].results()

    with torch.no_grad():
        start = [p.clone() for p in m.parameters()]
    want = run()
    with torch.no_grad():
        for p, w in zip(m.parameters(), start):
            p.copy_(w)
    used = []
    reference = ops.reference_accumulate_
    monkeypatch.setattr(ops, "has_kernel", lambda device: False)
    monkeypatch.setattr(ops, "reference_accumulate_", lambda *a, **k: used.append(1) or reference(*a, **k))
    got = run()
    assert used
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for name in w:
            assert w[name].keys() == g[name].keys()
            for site in w[name]:
                a, b = w[name][site], g[name][site]
                assert (a.numel, a.calls, float(a.min), float(a.max)) == (b.numel, b.calls, float(b.min), float(b.max))
                assert math.isclose(float(a.mean), float(b.mean), rel_tol=1e-5, abs_tol=1e-7)
                assert math.isclose(float(a.std), float(b.std), rel_tol=1e-5, abs_tol=1e-7)
