"""Where the time of a training step with stats goes (issue 15's open overhead question).

Profiles a few training steps of one model from ``bench_training.py`` with and without
``stats`` every step (jsonl sink, flush every 10) under ``torch.profiler`` and prints, side
by side: the step time, the device's busy time (sum of kernel and memcpy/memset times)
and idle time, the number of kernel launches, and the top device kernels and host ops by
self time of the hooked run. A step whose device is idle much longer with hooks than
without is waiting on the host (launch-bound or a blocking call); a step whose busy time
grows is paying for the kernels themselves.

Then the op alone on the model's hooked outputs (captured from one forward): the device
time a step's op calls take, and the host time per call, against one ``torch.sum`` per
tensor -- what the kernels cost on the real shapes, apart from hooks and telemetry.

    python benchmarks/profile_step.py --device cuda [--model gpt2] [--steps 10]
    python benchmarks/profile_step.py --quick          # tiny model on the CPU (a smoke test)
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_training as bt  # noqa: E402


def _events_summary(prof, cuda):
    """(device busy seconds, device launches, top device kernels, top host ops)."""
    events = prof.key_averages()
    if cuda:
        from torch.autograd import DeviceType

        # the kernels themselves (a CPU op that launched one reports its time as well)
        dev = [e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
        busy = sum(e.self_device_time_total for e in dev) / 1e6
        launches = sum(e.count for e in dev)
        top_dev = sorted(dev, key=lambda e: e.self_device_time_total, reverse=True)[:12]
        top_dev = [(e.key[:70], e.count, e.self_device_time_total / 1e3) for e in top_dev]
    else:
        busy, launches, top_dev = float("nan"), 0, []
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    top_host = [(e.key[:70], e.count, e.self_cpu_time_total / 1e3) for e in host]
    return busy, launches, top_dev, top_host


def profile(kind, model, opt, loss_fn, device, args, out_dir):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    select = bt.SELECT[args.model]
    with bt.variant(kind, model, out_dir, select) as step:
        bt.run(model, opt, loss_fn, step, 3 if not args.quick else 1, device, cuda)  # warm
        if cuda:
            torch.cuda.synchronize()
        with torch_profile(activities=acts) as prof:
            t0 = time.perf_counter()
            bt.run(model, opt, loss_fn, step, args.steps, device, cuda)
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.steps
    busy, launches, top_dev, top_host = _events_summary(prof, cuda)
    return wall, busy / args.steps, launches / args.steps, top_dev, top_host


def op_alone(model, loss_fn, device, select, reps=10):
    """(tensors, elements, op device ms/step, sum device ms/step, op host us/call, sum host
    us/call): the stats op and torch.sum over the outputs the selector hooks. Device time is
    the kernels' busy time from the profiler (on the CPU: the host time)."""
    from hookplug._bank import StatsBank

    names = set(select.split("|"))
    outs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outs.extend(t.detach() for t in (
                 o if isinstance(o, (tuple, list)) else (o,)) if isinstance(t, torch.Tensor)))
             for m in model.modules() if type(m).__name__ in names]
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                             enabled=device.type == "cuda"):
            loss_fn(model)
    finally:
        for h in hooks:
            h.remove()
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
    bank = StatsBank()
    bank.prepare(device)
    keys = [(i,) for i in range(len(outs))]

    def run_op():
        for t, k in zip(outs, keys):
            bank.accumulate(t, k)

    def run_sum():
        for t in outs:
            torch.sum(t)

    res = []
    for fn in (run_op, run_sum):
        fn()  # warm
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / (reps * max(1, len(outs))) * 1e6
        if device.type == "cuda":  # the kernels' own time (launch gaps left out)
            from torch.profiler import ProfilerActivity, profile as torch_profile

            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
            dev_ms = _events_summary(prof, True)[0] / reps * 1e3
        else:
            dev_ms = host * len(outs) / 1e3
        res.append((dev_ms, host))
    return len(outs), sum(o.numel() for o in outs), res[0][0], res[1][0], res[0][1], res[1][1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="gpt2", choices=sorted(bt.SELECT))
    ap.add_argument("--steps", type=int, default=10,
                    help="profiled steps (10: one jsonl flush falls inside)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 step (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 1
    device = torch.device(args.device)
    model, loss_fn = bt.make(args.model, device, args.quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for kind in ("no hooks", "stats every step, jsonl flush/10"):
            rows[kind] = profile(kind, model, opt, loss_fn, device, args, out_dir)
    print(f"{args.model} on {device}, {args.steps} profiled steps per variant (profiler on: "
          "times are inflated alike)")
    print(f"  {'variant':36s} {'step ms':>9s} {'device busy ms':>15s} {'device idle ms':>15s} "
          f"{'launches/step':>14s}")
    for kind, (wall, busy, launches, _, _) in rows.items():
        print(f"  {kind:36s} {wall * 1e3:9.2f} {busy * 1e3:15.2f} {(wall - busy) * 1e3:15.2f} "
              f"{launches:14.0f}")
    _, _, _, top_dev, top_host = rows["stats every step, jsonl flush/10"]
    if top_dev:
        print("  top device kernels with stats (name, calls, self ms):")
        for name, n, ms in top_dev:
            print(f"    {name:70s} {n:6d} {ms:9.2f}")
    print("  top host ops with stats (name, calls, self ms):")
    for name, n, ms in top_host:
        print(f"    {name:70s} {n:6d} {ms:9.2f}")
    n, numel, op_ms, sum_ms, op_us, sum_us = op_alone(model, loss_fn, device, bt.SELECT[args.model])
    print(f"  op alone on the {n} hooked outputs ({numel / 1e6:.1f} M elements), per step: "
          f"device {op_ms:.2f} ms (torch.sum {sum_ms:.2f} ms); host {op_us:.1f} us/call "
          f"(torch.sum {sum_us:.1f} us/call)")


if __name__ == "__main__":
    main()
