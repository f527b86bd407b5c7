"""The CUDA kernel's moment arithmetic, replayed on the host (no GPU needed).

``csrc/cuda/stats_moments.h`` holds the per-thread sums, the float64 overflow rescue and the
Chan merge the kernels run; ``tests/cuda_moments_sim.cpp`` compiles it with the host
compiler and replays a launch (thread partition, cub's block reduction order, the last
block's merge of the blocks). Compared here with a float64 (long double where there is
one) two-pass reference. The same cases run on a GPU in test_ops.py / test_cuda_paths.py.
"""
import math
import os
import shutil
import subprocess

import pytest
import torch

from hookplug import ops

np = pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMS = 132  # an H100 / H200: grid_size caps a launch at 3 blocks an SM


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no host C++ compiler (CXX, c++ or g++)")
    exe = str(tmp_path_factory.mktemp("sim") / "cuda_moments_sim")
    subprocess.run([cxx, "-O2", "-std=c++17", "-Wall", "-Werror", "-I", os.path.join(ROOT, "csrc"),
                    "-o", exe, os.path.join(ROOT, "tests", "cuda_moments_sim.cpp")],
                   check=True, capture_output=True, text=True)

    def run(values: np.ndarray, grid=None):
        vec = 16 // values.itemsize
        if grid is None:  # as grid_size: a block per 256 vectors, at most 3 an SM
            grid = max(1, min(-(-(-(-values.size // vec)) // 256), 3 * SMS))
        path = exe + ".in"
        values.tofile(path)
        out = subprocess.run([exe, "f64" if values.dtype == np.float64 else "f32", str(grid), path],
                             check=True, capture_output=True, text=True).stdout.split()
        n, mean, m2, mn, mx = (float(v) for v in out[:5])
        nan, inf, zero = (int(v) for v in out[5:])
        return dict(n=n, mean=mean, std=math.sqrt(m2 / n) if n else 0.0, min=mn, max=mx,
                    nan=nan, inf=inf, zero=zero)

    return run


def reference(values: np.ndarray):
    x = values.astype(np.longdouble)
    fin = x[np.isfinite(x)]
    mean = fin.mean()
    return dict(n=float(fin.size), mean=float(mean), std=float(np.sqrt(((fin - mean) ** 2).mean())),
                nan=int(np.isnan(x).sum()), inf=int(np.isinf(x).sum()), zero=int((fin == 0).sum()))


def offset_normal(n, offset, dtype=np.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(n, generator=g, dtype=torch.float64)).numpy().astype(dtype)


@pytest.mark.parametrize("grid", [None, 1])
def test_float64_far_from_zero_keeps_its_std(sim, grid):
    """Chan's merge on means relative to a shift: 2M float64 values at mean/std 1e8 keep
    their std to ~1e-14 (absolute means lost ~2e-10 over the launch's 100K thread partials)."""
    x = offset_normal(2_000_000 if grid is None else 200_000, 1e8)
    got, ref = sim(x, grid), reference(x)
    assert got["n"] == ref["n"]
    assert got["std"] == pytest.approx(ref["std"], rel=1e-12)
    assert got["mean"] == pytest.approx(ref["mean"], rel=1e-15, abs=0)


@pytest.mark.parametrize("first", [float("nan"), float("inf"), 1e12])
def test_first_element_does_not_set_the_shift(sim, first):
    """A NaN/Inf/outlier first element: each thread shifts by its own first finite value."""
    x = offset_normal(20_000, 1e8)
    x[0] = first
    got, ref = sim(x), reference(x)
    assert (got["nan"], got["inf"], got["n"]) == (ref["nan"], ref["inf"], ref["n"])
    assert got["std"] == pytest.approx(ref["std"], rel=1e-12)
    assert got["mean"] == pytest.approx(ref["mean"], rel=1e-15)


def test_a_constant_has_std_zero(sim):
    x = np.full(20_000, 123.456, dtype=np.float32)
    x[0] = np.nan
    got = sim(x)
    assert got["std"] == 0.0 and got["mean"] == float(np.float32(123.456)) and got["nan"] == 1


@pytest.mark.parametrize("values, mean, std", [
    ([1e200, -1e200], 0.0, math.inf),
    ([1.7e308, -1.7e308] * 2, 0.0, math.inf),
    ([1e307, 1.1e307], 1.05e307, math.inf),  # (the sum of squared deviations, 5e611)
])
def test_float64_past_the_largest_double(sim, values, mean, std):
    """Deviations or their squares past the largest double: the rescue's halved deviations
    (never inf - inf = NaN, which became std 0), and the merge's absolute fallback; as the
    CPU op gives them."""
    for grid in (1, 3):
        got = sim(np.array(values, dtype=np.float64), grid)
        assert got["mean"] == pytest.approx(mean, abs=1e292)
        assert got["std"] == std
        cpu = ops.tensor_stats(torch.tensor(values, dtype=torch.float64))
        assert (got["mean"], got["std"]) == pytest.approx((float(cpu.mean), float(cpu.std)), abs=1e292)


def test_halves_at_the_largest_double_in_threads_of_one_sign(sim):
    """2M values +-1.7e308 (each thread sees one sign, shifts of opposite signs merge): the
    mean stays finite (≈ 0 next to 1.7e308) and the std is inf."""
    x = np.where(np.arange(2_000_000) < 1_000_000, 1.7e308, -1.7e308)
    got = sim(x)
    assert math.isfinite(got["mean"]) and abs(got["mean"]) < 1e300
    assert got["std"] == math.inf


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_counts_extremes_and_moments_with_nonfinite_values(sim, dtype):
    g = np.random.default_rng(3)
    x = (g.standard_normal(300_001) * 7 + 3).astype(dtype)
    x[g.integers(0, x.size, 500)] = np.nan
    x[g.integers(0, x.size, 300)] = np.inf
    x[g.integers(0, x.size, 200)] = -np.inf
    x[g.integers(0, x.size, 400)] = 0
    got, ref = sim(x), reference(x)
    assert (got["nan"], got["inf"], got["zero"], got["n"]) == (ref["nan"], ref["inf"], ref["zero"], ref["n"])
    fin = x[np.isfinite(x)]
    assert (got["min"], got["max"]) == (float(fin.min()), float(fin.max()))
    assert got["mean"] == pytest.approx(ref["mean"], rel=1e-13)
    assert got["std"] == pytest.approx(ref["std"], rel=1e-13)
