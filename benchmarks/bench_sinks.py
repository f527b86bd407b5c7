"""What a sink costs the training thread, side by side in one run: a model of ``--modules``
``Linear(16, 16)`` layers with stats on outputs and gradients (2 records per module per
step, log2 histograms), ``--steps`` steps flushed once at the end of each round:

- ``flush``: the ``session.step()`` that hands the sink its records (training thread);
- ``after``: the mean step time over ``--after`` steps that follow it (a writer thread that
  still writes holds the GIL for part of them), as a ratio to the same steps with no sink.

    python benchmarks/bench_sinks.py [--modules 1000] [--steps 3] [--after 20] [--rounds 3]
"""
import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn as nn

import hookplug


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--after", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sinks", default="none,jsonl,tensorboard")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(a.modules)])
    x = torch.randn(4, 16)
    tmp = tempfile.mkdtemp()

    def step():
        model(x).sum().backward()

    def sink_of(name, r):
        if name == "none":
            return ()
        return (name, {"path": f"{tmp}/{name}{r}"})

    results = {}
    for r in range(a.rounds):
        for name in a.sinks.split(","):
            s = hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                                sink=sink_of(name, r), flush_every=a.steps)
            for _ in range(a.steps - 1):
                step()
                s.step()
            step()
            t = time.perf_counter()
            s.step()  # the flush
            flush = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(a.after):
                step()
            after = (time.perf_counter() - t) / a.after
            s.remove()
            results.setdefault(name, []).append((flush, after))
    shutil.rmtree(tmp, ignore_errors=True)
    records = 2 * a.modules * a.steps
    base = statistics.median(v[1] for v in results.get("none", [(0, 1.0)]))
    print(f"{records} records a flush ({a.modules} modules x 2 sites x {a.steps} steps), "
          f"median of {a.rounds} rounds")
    for name, vals in results.items():
        flush = statistics.median(v[0] for v in vals)
        after = statistics.median(v[1] for v in vals)
        print(f"  {name:12s} flush {flush * 1e3:8.1f} ms ({flush / records * 1e6:6.1f} us/record)"
              f"   steps after: {after / base:5.2f} x no sink")


if __name__ == "__main__":
    main()
