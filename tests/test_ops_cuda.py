"""hookplug.ops.tensor_stats on CUDA beyond test_ops.py (whose device-parametrized tests run
the same checks on the GPU kernels): stream, no-sync, CUDA-graph and CPU-agreement checks.
Skipped without a GPU.

HOOKPLUG_TEST_SANITIZER=1 also runs a small workload under compute-sanitizer (memcheck,
racecheck) when the tool is on PATH."""
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from hookplug import ops  # noqa: E402
from hookplug._stats import TensorStats  # noqa: E402

from test_ops import DTYPES, REQUIRE_EXT, _bits, assert_matches, gen, needs_kernels, planted  # noqa: E402

DEV = "cuda"


def test_cuda_kernels_built_when_required():
    if REQUIRE_EXT:
        assert ops.backend() == "compiled"
        assert ops._has_cuda, "HOOKPLUG_REQUIRE_EXT=1: the extension has no CUDA kernels (CUDA_HOME unset at build?)"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log2_exact_and_same_as_cpu(dtype):
    g = gen(112)
    n = 300_001
    mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 100 - 50)
    x = (mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).to(dtype)
    x[::997] = math.nan
    x[1::991] = -math.inf
    x[2::983] = 0
    st = ops.tensor_stats(x.to(DEV))
    assert_matches(st, x.to(DEV))
    cpu = ops.tensor_stats(x)
    assert torch.equal(st.hist_counts.cpu(), cpu.hist_counts)
    for f in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax"):
        assert torch.equal(getattr(st, f).cpu(), getattr(cpu, f)), f


@needs_kernels
def test_linear_histogram_many_bins_uses_global_atomics():
    x = planted(200_000, torch.float32, gen(113)).to(DEV)
    for kw in ({"bins": 20_000}, {"bins": 9000, "range": (-3.0, 3.0)}):
        st = ops.tensor_stats(x, hist="linear", **kw)
        assert_matches(st, x, hist="linear", **kw)


@needs_kernels
def test_deterministic_and_on_the_current_stream():
    x = planted(3_000_000, torch.float32, gen(115)).to(DEV)
    ref = [_bits(ops.tensor_stats(x, **kw)) for kw in ({}, {"bins": 0}, {"hist": "linear", "bins": 50})]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            got = [_bits(ops.tensor_stats(x, **kw)) for kw in ({}, {"bins": 0}, {"hist": "linear", "bins": 50})]
    side.synchronize()
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@needs_kernels
def test_no_host_sync():
    x = planted(100_000, torch.float32, gen(116)).to(DEV)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sts = [ops.tensor_stats(x), ops.tensor_stats(x, bins=0), ops.tensor_stats(x, hist="linear"),
               ops.tensor_stats(x, hist="linear", bins=8, range=(0, 1)), ops.tensor_stats(x[::3])]
        TensorStats.merge_all([sts[0], ops.tensor_stats(x[:10]), ops.tensor_stats(x[10:])])
        TensorStats.unpack(sts[0].pack())
        for st in sts:  # (the log2 edges were a pageable host copy: a sync)
            st.hist_edges
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@needs_kernels
@pytest.mark.skipif(os.environ.get("HOOKPLUG_TEST_SANITIZER") != "1" or not shutil.which("compute-sanitizer"),
                    reason="set HOOKPLUG_TEST_SANITIZER=1 with compute-sanitizer on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tool, tmp_path):
    script = tmp_path / "work.py"
    script.write_text(textwrap.dedent("""
        import torch
        from hookplug import ops
        x = torch.randn(100_003, device="cuda")
        x[::7] = float("nan")
        for v in (x, x[1:], x[::3], x[:0], x.half(), x.double(), x.bfloat16()):
            for kw in ({}, {"bins": 0}, {"hist": "linear"}, {"hist": "linear", "bins": 20_000, "range": (-1, 1)}):
                ops.tensor_stats(v, **kw)
        from hookplug._bank import StatsBank  # the accumulating op, eager entry and torch.ops
        for bank in (StatsBank(), StatsBank(bins=0), StatsBank(bins=64, hist="linear", range=(-1, 1))):
            bank.prepare(x.device)
            for i, v in enumerate((x, x[1:], x[::3], x[:0], x.half(), x.double(), x.bfloat16())):
                bank.accumulate(v, ("m", str(i), "train"))
                torch.ops.hookplug.stats_accumulate_(v, bank.device_rows(x.device).acc, 1, None, *bank.op_args)
                for r in (2, 0, 10_000):  # the row read on the device; out of range: no write
                    row = torch.tensor([r], device=x.device)
                    torch.ops.hookplug.stats_accumulate_at_(v, bank.device_rows(x.device).acc, row, None,
                                                            *bank.op_args)
            bank.end_step(0)
        torch.cuda.synchronize()
        print("done")
    """))
    out = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "3", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


# -- the accumulating op and the bank on CUDA ----------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("kw", [{}, {"bins": 0}, {"hist": "linear", "bins": 16, "range": (-2, 2)}])
def test_accumulate_equals_cpu_and_reference(kw):
    """Many calls merged in place into rows on the GPU equal the CPU kernel and the
    float64 reference of the concatenation; the gate switches calls off on the device."""
    from hookplug._stats import empty_rows

    g = gen(300)
    parts = [planted(n, torch.float32, g, offset=1.0) for n in (1, 1000, 70000, 3, 1 << 18)]
    b, mode, lo, hi = ops.hist_args(kw.get("bins"), kw.get("hist", "log2"), kw.get("range"))
    nb = ops.buckets(b, kw.get("hist", "log2"))
    cols = (ops.log2_edges()[[0, -1]].tolist() if nb and mode == 0 else (kw.get("range") or (0.0, 0.0)))
    accs = {d: empty_rows(4, nb, *cols, device=d) for d in ("cpu", DEV)}
    gates = {d: torch.tensor([True], device=d) for d in ("cpu", DEV)}
    for i, p in enumerate(parts):
        for d in ("cpu", DEV):
            gates[d].fill_(i != 3)  # the fourth call is gated off
            ops.accumulate_(p.to(d), accs[d], 2, gates[d], **kw)
    torch.cuda.synchronize()
    gpu, cpu = TensorStats(accs[DEV][2].cpu()).to_dict(), TensorStats(accs["cpu"][2]).to_dict()
    whole = torch.cat([p for i, p in enumerate(parts) if i != 3])
    assert_matches(TensorStats(accs[DEV][2].cpu(), "log2" if mode == 0 and nb else None), whole, **kw)
    for k in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "hist_counts"):
        assert gpu[k] == cpu[k], k
    assert math.isclose(gpu["std"], cpu["std"], rel_tol=1e-9)
    assert float(accs[DEV][0, 0]) == float(accs["cpu"][0, 0]) == 4  # the clock: 4 calls ran


@needs_kernels
def test_cuda_graph_replay_equals_eager_steps():
    """A training step captured with torch.cuda.graph and replayed N times gives the same
    stats as N eager steps (the bank's memory never moves; the step boundary is outside)."""
    import hookplug
    from hookplug.models import MLP

    torch.manual_seed(0)
    model = MLP().to(DEV)
    x = torch.randn(16, 32, device=DEV)
    static_x = x.clone()

    def train_step(inp):
        model(inp).square().mean().backward()

    with hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")})) as s:
        for _ in range(3):  # warm-up on a side stream, as torch.cuda.graph asks
            train_step(x)
        s["stats"].reset()
        s.step()
        for _ in range(4):
            train_step(x)
        eager = {k: {p: st.to_dict() for p, st in v.items()} for k, v in s["stats"].results().items()}
        s["stats"].reset()
        model.zero_grad(set_to_none=False)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            train_step(static_x)
        torch.cuda.current_stream().wait_stream(side)
        s["stats"].reset()
        with torch.cuda.graph(graph):
            train_step(static_x)
        s["stats"].reset()  # capture does not run the kernels; start from zero anyway
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
        replayed = {k: {p: st.to_dict() for p, st in v.items()} for k, v in s["stats"].results().items()}
    assert replayed.keys() == eager.keys()
    for mod in eager:
        for site in eager[mod]:
            a, b = eager[mod][site], replayed[mod][site]
            assert a["numel"] == b["numel"] and a["hist_counts"] == b["hist_counts"], (mod, site)
            assert math.isclose(a["std"], b["std"], rel_tol=1e-9), (mod, site)


@needs_kernels
def test_row_tensor_read_on_the_device_and_replayed_in_a_cuda_graph():
    """``stats_accumulate_at_`` on CUDA reads the row index on the device: a CUDA graph
    captured once replays into whatever row the tensor holds at replay (no host read at
    capture), equal to the int-row op; an index outside [1, rows) makes the call do nothing
    (the clock does not move)."""
    from hookplug._stats import empty_rows

    b, mode, lo, hi = ops.hist_args(None, "log2", None)
    cols = ops.log2_edges()[[0, -1]].tolist()
    x = planted(5000, torch.float32, gen(301), offset=1.0).to(DEV)
    expected = empty_rows(4, ops.buckets(b, "log2"), *cols, device=DEV)
    for r in (1, 3, 3):
        torch.ops.hookplug.stats_accumulate_(x, expected, r, None, b, mode, lo, hi)
    acc = empty_rows(4, ops.buckets(b, "log2"), *cols, device=DEV)
    row = torch.tensor([1], device=DEV)
    torch.ops.hookplug.stats_accumulate_at_(x, acc, row, None, b, mode, lo, hi)  # warm-up, row 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.hookplug.stats_accumulate_at_(x, acc, row, None, b, mode, lo, hi)
    row.fill_(3)
    graph.replay()
    graph.replay()
    for bad in (0, 4, -5):
        row.fill_(bad)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(acc.nan_to_num(nan=7.0), expected.nan_to_num(nan=7.0))
