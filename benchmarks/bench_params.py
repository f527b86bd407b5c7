"""Per-parameter gradient stats on every parameter of a ~20M-parameter MLP, per training
step, measured side by side in one run:

- ``none``: forward + backward + SGD step, no hooks;
- ``params``: the same with ``hookplug`` ``params`` plugin, ``sites=("grad",)``, every step
  (full stats: counts, min/max, mean/std, l2/rms, log2 histogram; with ``--bins 0`` no
  histogram) and a telemetry flush at the end;
- ``torch loop``: the same with a plain-torch loop ``torch.linalg.vector_norm(p.grad)``
  per parameter before the optimizer step (norms only, kept on the device).

    python benchmarks/bench_params.py [--steps 10] [--width 2048] [--depth 5] [--bins 0]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

import hookplug


def make(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bins", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    model = make(a.width, a.depth)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.width)

    def step(extra=None):
        model(x).square().mean().backward()
        if extra is not None:
            extra()
        opt.step()
        opt.zero_grad()

    def run_none():
        for _ in range(a.steps):
            step()

    norms = []

    def torch_loop():
        norms.append([torch.linalg.vector_norm(p.grad) for p in model.parameters()])

    def run_loop():
        norms.clear()
        for _ in range(a.steps):
            step(torch_loop)

    def run_params():
        opts = {"sites": ("grad",)}
        if a.bins is not None:
            opts["bins"] = a.bins
        with hookplug.attach(model, "Linear", plugins=("params", opts)) as s:
            for _ in range(a.steps):
                step()
                s.step()
            recs = s.flush()
        assert len(recs) == a.steps * 2 * a.depth, len(recs)

    runs = {"none": run_none, "params": run_params, "torch loop": run_loop}
    for fn in runs.values():  # warm-up
        fn()
    times = {k: [] for k in runs}
    for _ in range(a.repeats):  # interleaved, so drift hits all alike
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) / a.steps)
    base = statistics.median(times["none"])
    print(f"model: {a.depth} x Linear({a.width}, {a.width}) = {n_params / 1e6:.1f}M parameters, "
          f"{2 * a.depth} tensors; batch {a.batch}; torch threads {torch.get_num_threads()}; "
          f"stats backend {hookplug.ops.backend()}; bins={a.bins if a.bins is not None else 'log2'}")
    print(f"{'variant':<12} {'ms/step':>9} {'vs none':>8} {'overhead ms':>12}")
    for k in runs:
        t = statistics.median(times[k])
        print(f"{k:<12} {t * 1e3:>9.2f} {t / base:>7.3f}x {(t - base) * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
