"""The ``flops`` plugin's cost on a training step, beside torch's own ``FlopCounterMode``.

For a small CNN, a ResNet-18-shaped CNN and a transformer encoder (CPU, one thread, small
inputs so that per-op Python cost shows), the median time of one training step (forward,
``.sum().backward()``, ``session.step()``) with:

- no hooks;
- ``flops`` on every module and the root (``"*, *:"``: per-module forward and backward
  FLOPs);
- ``torch.utils.flop_counter.FlopCounterMode`` around the step (its module tracking on).

All configurations run in one process, interleaved round by round, and the FLOPs the plugin
counted are checked against ``FlopCounterMode``'s total (``extra_formulas=False``: the
CPU SDPA kernel, which ``FlopCounterMode`` counts as 0, not counted either). Ratios are against "no hooks" from
the same run; "overhead" is the time over no hooks, plugin vs ``FlopCounterMode``.

    python benchmarks/bench_flops.py [--rounds 12] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import hookplug
from hookplug.models import ResNetLike, tiny_transformer


def models():
    torch.manual_seed(0)
    yield "cnn (ResNetLike width 8)", ResNetLike((2, 2, 2, 2), width=8), torch.randn(2, 3, 32, 32)
    yield "resnet18-shaped (width 64)", ResNetLike((2, 2, 2, 2), width=64), torch.randn(2, 3, 32, 32)
    yield "transformer (dim 32, depth 2)", tiny_transformer(dim=32, depth=2), torch.randn(2, 16, 32)


def step(model, x):
    model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)


def timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(model, x, rounds: int, steps: int):
    session = hookplug.attach(model, "*, *:", plugins="flops")
    session.remove()  # (the import and first attach out of the timings)

    def none():
        step(model, x)

    def plugin(**options):
        with hookplug.attach(model, "*, *:", plugins=("flops", options)) as s:
            for _ in range(steps):
                step(model, x)
                s.step()
        return s["flops"].total()

    def fcm():
        with FlopCounterMode(display=False):
            step(model, x)

    for _ in range(2):  # warm-up
        none(), fcm(), plugin()
    got = {"none": [], "flops": [], "fcm": []}
    for r in range(rounds):
        order = [("none", lambda: timed(none, steps)),
                 ("flops", lambda: _timed_session(model, x, steps)),
                 ("fcm", lambda: timed(fcm, steps))]
        for name, run in order[r % 3:] + order[:r % 3]:
            got[name].append(run())
    with FlopCounterMode(display=False) as mode:
        step(model, x)
    total = plugin(extra_formulas=False)  # (what FlopCounterMode counts: no CPU SDPA kernel)
    counted = (total["flops"] + total["backward_flops"]) // steps
    return {k: statistics.median(v) for k, v in got.items()}, counted, mode.get_total_flops()


def _timed_session(model, x, steps: int) -> float:
    times = []
    with hookplug.attach(model, "*, *:", plugins="flops") as s:
        for _ in range(steps):
            t0 = time.perf_counter()
            step(model, x)
            s.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, hookplug op backend {hookplug.ops.backend()}, 1 thread")
    print(f"{'model':32} {'no hooks':>9} {'flops':>8} {'FlopCounterMode':>16} {'overhead flops/FCM':>19}  FLOPs == FCM")
    for name, model, x in models():
        med, counted, want = bench(model, x, args.rounds, args.steps)
        base = med["none"]
        over = (med["flops"] - base) / (med["fcm"] - base) if med["fcm"] > base else float("nan")
        print(f"{name:32} {base * 1e3:8.2f}ms {med['flops'] / base:7.2f}x {med['fcm'] / base:15.2f}x "
              f"{over:18.2f}x  {counted == want}")


if __name__ == "__main__":
    main()
