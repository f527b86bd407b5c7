"""Benchmark of hookplug.ops.tensor_stats against torch.sum and the naive multi-call.

All candidates are timed side by side in one run (round-robin repetitions, median), so the
ratios compare like with like:

    python benchmarks/bench_stats.py                   # CPU, 2 threads, 1M/16M/64M
    python benchmarks/bench_stats.py --device cuda     # adds copy and achieved bandwidth
    python benchmarks/bench_stats.py --markdown        # the table for RESULTS.md

Rows: ``op`` (log2 histogram), ``op bins=0``, ``op linear`` (100 buckets, automatic
range: two passes), ``torch.sum``, ``naive`` (``x.min(), x.max(), x.mean(), x.std(),
torch.histc(x)``; histc upcasts bfloat16). Cost split: reductions = ``op bins=0``,
histogram = ``op`` - ``op bins=0``. Targets (CPU, 64M float32): op <= 3x sum, bins=0 <=
1.5x sum, >= 25x faster than naive; CUDA: >= 80% of the device-to-device copy bandwidth.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hookplug import ops  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_all(fns: dict, dev, repeat: int, warmup: int = 2) -> dict:
    """Median seconds per candidate, measured round-robin."""
    times = {k: [] for k in fns}
    for _ in range(warmup):
        for f in fns.values():
            f()
    _sync(dev)
    for _ in range(repeat):
        for k, f in fns.items():
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def naive(x):
    return x.min(), x.max(), x.mean(), x.std(), torch.histc(x if x.dtype in (torch.float32, torch.float64) else x.float())


def run(args):
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.isa and ops.backend() != "reference":
        ops._C.set_cpu_isa(args.isa)
    info = f"backend={ops.backend()}"
    if dev.type == "cpu" and ops.backend() != "reference":
        info += f" isa={ops._C.cpu_isa()} threads={torch.get_num_threads()}"
    else:
        info += f" device={torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}"
    print(f"# hookplug stats op benchmark: {info}, torch {torch.__version__}")
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for n in args.sizes:
            numel = int(n * (1 << 20))
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(numel, generator=g).to(device=dev, dtype=dtype)
            nbytes = x.numel() * x.element_size()
            fns = {
                "op": lambda: ops.tensor_stats(x),
                "op_bins0": lambda: ops.tensor_stats(x, bins=0),
                "op_linear": lambda: ops.tensor_stats(x, hist="linear"),
                "sum": lambda: x.sum(),
            }
            if not args.no_naive:
                fns["naive"] = lambda: naive(x)
            if dev.type == "cuda":
                dst = torch.empty_like(x)
                fns["copy"] = lambda: dst.copy_(x)
            rep = args.repeat if n >= 16 else args.repeat * 3
            t = time_all(fns, dev, rep)
            row = {"dtype": dtype_name, "numel": numel, "label": f"{n:g}M", **t}
            rows.append(row)
            s = t["sum"]
            line = (f"{dtype_name:9s} {n:>4g}M  op {t['op'] * 1e3:8.3f} ms  bins=0 {t['op_bins0'] * 1e3:8.3f} ms"
                    f"  linear {t['op_linear'] * 1e3:8.3f} ms  sum {s * 1e3:8.3f} ms"
                    f" | op/sum {t['op'] / s:5.2f}  bins0/sum {t['op_bins0'] / s:5.2f}")
            if "naive" in t:
                line += f"  naive/op {t['naive'] / t['op']:6.1f}  (naive {t['naive'] * 1e3:.1f} ms)"
            hist = max(t["op"] - t["op_bins0"], 0.0)
            line += (f" | split: reductions {t['op_bins0'] / t['op'] * 100:4.0f}%"
                     f" histogram {hist / t['op'] * 100:4.0f}%")
            line += f" | {numel / t['op'] / 1e9:.2f} Gelem/s, read {nbytes / t['op'] / 1e9:.1f} GB/s"
            if dev.type == "cuda":
                copy_bw = 2 * nbytes / t["copy"] / 1e9
                op_bw = nbytes / t["op"] / 1e9
                line += (f" | copy {copy_bw:.0f} GB/s (read+write), op reads {op_bw:.0f} GB/s"
                         f" = {op_bw / (nbytes / t['copy'] / 1e9) * 100:.0f}% of copy read rate")
            print(line, flush=True)
            del x
    if args.markdown:
        print()
        print("| dtype | numel | op (log2) ms | op bins=0 ms | op linear ms | torch.sum ms | naive ms "
              "| op / sum | bins=0 / sum | naive / op | histogram share |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            nv = r.get("naive")
            print(f"| {r['dtype']} | {r['label']} | {r['op'] * 1e3:.2f} | {r['op_bins0'] * 1e3:.2f} "
                  f"| {r['op_linear'] * 1e3:.2f} | {r['sum'] * 1e3:.2f} "
                  f"| {nv * 1e3:.1f} | " if nv else "| - | ", end="")
            print(f"{r['op'] / r['sum']:.2f} | {r['op_bins0'] / r['sum']:.2f} | "
                  f"{(nv / r['op']) if nv else float('nan'):.1f} | "
                  f"{max(r['op'] - r['op_bins0'], 0) / r['op'] * 100:.0f}% |")
        per = {}
        for r in rows:
            per.setdefault(r["label"], {})[r["dtype"]] = r["op"] / r["numel"]
        for label, d in per.items():
            if "float32" in d and "bfloat16" in d:
                print(f"\nbfloat16 / float32 time per element at {label}: {d['bfloat16'] / d['float32']:.2f}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64], help="in Mi elements")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--isa", choices=["auto", "avx2", "generic"], default=None)
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--markdown", action="store_true")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
