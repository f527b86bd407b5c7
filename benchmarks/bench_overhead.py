"""Host cost of the stats hot path per hooked tensor, and overhead under torch.compile.

1. Eager: 64 small Linear layers (one hooked output each). Per hooked tensor, over no
   hooks: a bare torch forward hook running one ``torch.sum`` (the floor any per-tensor
   reduction pays), hookplug ``stats`` (log2 histogram, and ``bins=0``), and the seeds'
   ``.item()`` hook (min/max/mean/std read back per call). Target (issue 10): stats <= 1.5x
   the bare-sum hook.
2. Compiled (``--compile``): 16 Linear(1024, 1024) layers, batch 64, compiled with
   ``aot_eager`` and ``inductor``, with and without stats; steps after warm-up, recompiles
   counted. Target: <= 1.05x. (On layers as small as part 1's, one op dispatch per hooked
   tensor is comparable to the layer itself.)

Everything is measured side by side in one run (interleaved rounds, median).

    python benchmarks/bench_overhead.py [--layers 64] [--rounds 15] [--compile]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

import hookplug


def make_model(layers: int, width: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def attach(kind, model):
    """Attach variant ``kind``; return a function that detaches it (and one per step)."""
    if kind == "no hooks":
        return (lambda: None), (lambda: None)
    if kind == "bare hook + torch.sum":
        sink = []

        def hook(m, i, o):
            sink.append(torch.sum(o.detach()))

        hs = [m.register_forward_hook(hook) for m in model]
        return (lambda: [h.remove() for h in hs]), sink.clear
    if kind == "seeds .item() hook":
        seen = []

        def hook(m, i, o):
            o = o.detach()
            seen.append((o.min().item(), o.max().item(), o.mean().item(), o.std().item()))

        hs = [m.register_forward_hook(hook) for m in model]
        return (lambda: [h.remove() for h in hs]), seen.clear
    opts = {"bins": 0} if kind.endswith("bins=0") else {}
    s = hookplug.attach(model, "Linear", plugins=("stats", opts))
    return s.remove, s.step


def time_steps(fn, step, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        step()
    return (time.perf_counter() - t0) / iters


def eager(args):
    torch.manual_seed(0)
    model = make_model(args.layers)
    x = torch.randn(8, 64)
    kinds = ["no hooks", "bare hook + torch.sum", "hookplug stats", "hookplug stats bins=0",
             "seeds .item() hook"]
    times = {k: [] for k in kinds}
    with torch.no_grad():
        for _ in range(args.rounds):
            for k in kinds:
                detach, step = attach(k, model)
                time_steps(lambda: model(x), step, 5)  # warm
                times[k].append(time_steps(lambda: model(x), step, args.iters))
                detach()
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["no hooks"]
    per = {k: (med[k] - base) / args.layers * 1e6 for k in kinds}
    print(f"eager, {args.layers} x Linear(64, 64), batch 8, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, hookplug ops backend {hookplug.ops.backend()}")
    print(f"  {'variant':26s} {'forward':>10s} {'per hooked tensor':>18s} {'vs bare sum':>12s}")
    for k in kinds:
        ratio = per[k] / per["bare hook + torch.sum"] if k != "no hooks" else float("nan")
        print(f"  {k:26s} {med[k] * 1e3:8.3f}ms {per[k]:15.2f} us {ratio:11.2f}x")
    return per


def compiled(args):
    from torch._dynamo.utils import counters

    w = args.compile_width
    x = torch.randn(64, w)
    print(f"compiled, {args.compile_layers} x Linear({w}, {w}), batch 64 (steps after warm-up; "
          "recompiles after warm-up counted)")
    print(f"  {'backend':10s} {'no hooks':>10s} {'stats':>10s} {'ratio':>7s} {'graphs':>7s} {'recompiles':>10s}")
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = make_model(args.compile_layers, w)
        plain = torch.compile(model, backend=backend)
        with torch.no_grad():
            for _ in range(3):
                plain(x)
        t_plain = []
        s = hookplug.attach(model, "Linear", plugins="stats")
        hooked = torch.compile(model, backend=backend)
        with torch.no_grad():
            for _ in range(3):
                hooked(x)
                s.step()
        graphs_warm = counters["stats"]["unique_graphs"]
        t_hooked = []
        for _ in range(args.rounds):
            with torch.no_grad():
                t_hooked.append(time_steps(lambda: hooked(x), s.step, args.iters))
        recompiles = counters["stats"]["unique_graphs"] - graphs_warm
        s.remove()
        with torch.no_grad():
            for _ in range(3):
                plain(x)
            for _ in range(args.rounds):
                t_plain.append(time_steps(lambda: plain(x), lambda: None, args.iters))
        a, b = statistics.median(t_plain), statistics.median(t_hooked)
        print(f"  {backend:10s} {a * 1e3:8.3f}ms {b * 1e3:8.3f}ms {b / a:6.2f}x {graphs_warm:7d} {recompiles:10d}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="also measure torch.compile")
    p.add_argument("--compile-layers", type=int, default=16)
    p.add_argument("--compile-width", type=int, default=1024)
    args = p.parse_args()
    eager(args)
    if args.compile:
        compiled(args)


if __name__ == "__main__":
    main()
