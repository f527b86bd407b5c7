"""Where the every-step telemetry cost of ``bench_telemetry.py`` goes, layer by layer.

On the same models and training step, interleaved rounds time: no hooks; a bare forward
hook on every Conv2d/Linear; that hook calling ``StatsBank.accumulate`` on the output (the
op alone); the same plus the bank's per-step snapshot; the ``stats`` plugin with no sink;
and with a JSONL flush every 10 steps. Prints median ms/step and the paired ratio (median
over rounds of the ratio to that round's no-hooks time), then the op's own time measured
inside the hooks.

    python benchmarks/telemetry_breakdown.py [--models cnn,transformer] [--rounds 12] [--steps 30]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_telemetry as bt  # noqa: E402

import hookplug  # noqa: E402
from hookplug._bank import StatsBank  # noqa: E402

KINDS = ("no hooks", "bare hook", "hook + op", "hook + op + step snapshot", "stats, no sink",
         "stats, jsonl flush/10")


def _attach(kind, model, mods, bank, out_dir, spent):
    """(torch hook handles, per-step callback, session) for one kind."""
    def op_hook(m, i, o, key):
        t0 = time.perf_counter()
        bank.accumulate(o, key)
        spent[0] += time.perf_counter() - t0

    if kind == "bare hook":
        return [m.register_forward_hook(lambda m, i, o: None) for m in mods], None, None
    if kind.startswith("hook + op"):
        hs = [m.register_forward_hook(lambda m, i, o, key=(j,): op_hook(m, i, o, key))
              for j, m in enumerate(mods)]
        if kind == "hook + op":
            return hs, None, None
        step = [0]

        def snapshot():
            step[0] += 1
            bank.end_step(step[0])
            bank.pending.clear()

        return hs, snapshot, None
    if kind.startswith("stats"):
        sink = {} if kind == "stats, no sink" else {
            "sink": ("jsonl", {"path": tempfile.mkdtemp(dir=out_dir)}), "flush_every": 10}
        s = hookplug.attach(model, "Conv2d|Linear", plugins="stats", **sink)
        return [], s.step, s
    return [], None, None


def breakdown(name, rounds, steps):
    model, x, y = bt.make(name, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mods = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    bank = StatsBank()
    bank.prepare(torch.device("cpu"))
    spent = [0.0]

    def run(n, cb):
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if cb:
                cb()
        return (time.perf_counter() - t0) / n

    times = {k: [] for k in KINDS}
    op_share = []
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(rounds):
            for kind in KINDS:
                hs, cb, s = _attach(kind, model, mods, bank, out_dir, spent)
                run(3, cb)
                spent[0] = 0.0
                t = run(steps, cb)
                times[kind].append(t)
                if kind == "hook + op":
                    op_share.append(spent[0] / steps / t)
                for h in hs:
                    h.remove()
                if s is not None:
                    s.remove()
    base = statistics.median(times["no hooks"])
    print(f"\n{name}: {len(mods)} Conv2d/Linear modules, {rounds} rounds x {steps} steps")
    print(f"  {'variant':<28}{'ms/step':>9}{'+ms':>8}{'paired':>9}")
    for k in KINDS:
        med = statistics.median(times[k])
        paired = statistics.median(a / b for a, b in zip(times[k], times["no hooks"]))
        print(f"  {k:<28}{med * 1e3:>9.3f}{(med - base) * 1e3:>+8.3f}{paired:>8.3f}x")
    print(f"  the op itself, timed inside the hooks: {statistics.median(op_share) * 100:.1f} % of the step")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,transformer")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"telemetry_breakdown: torch {torch.__version__}, CPU, {torch.get_num_threads()} threads")
    for name in args.models.split(","):
        breakdown(name, args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
