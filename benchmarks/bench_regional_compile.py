"""Regional compilation with stats attached: graphs compiled and compile time.

A stack of identical transformer-style blocks (attention projections + MLP, 4 Linears
each), each block compiled on its own (``block.compile()``, as torchtitan and the PyTorch
regional-compilation recipe do). Measured side by side in one run, on fresh copies of the
same model:

- no hooks;
- ``stats`` on every Linear (``sites=("output", "grad")``): the blocks should share one
  forward graph (and its backward), as without hooks.

For each: graphs the backend compiled, the wall time of the first training step (the
compile) and of a later step (median), and the ratio to no hooks (after a one-block run of
each, which pays one-time costs: imports, the backend's first compile, plugin loading).
Then, ``--windows N``:
the compiled model trains without hooks and a session is attached for one step and
removed, N times (a debugging window every few steps): the graphs compiled in windows
after the first, and a window step's time (median over windows 2..N) against a plain
step's; a session attached again should run the graphs compiled for the last one. One process, the
dynamo caches reset between variants, after a one-block warm-up that pays one-time costs
(run with ``TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0`` so that inductor
compiles every graph rather than loading it from its cache).

    python benchmarks/bench_regional_compile.py [--blocks 12] [--width 256] [--backend aot_eager]
                                                [--windows 6]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

import hookplug


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.relu(self.up(x)))


def counting(backend: str, graphs: list):
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_graph(gm, example_inputs):
        graphs[0] += 1
        return inner(gm, example_inputs)
    return compile_graph


def run(variant: str, args) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))
    x = torch.randn(args.batch, args.seq, args.width)
    session = None
    if variant == "stats":
        session = hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")}))
    graphs = [0]
    backend = counting(args.backend, graphs)
    for block in model:
        block.compile(backend=backend)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        if session is not None:
            session.step()
        times.append(time.perf_counter() - t0)
    if session is not None:
        session.remove()
    return {"graphs": graphs[0], "first": times[0], "later": statistics.median(times[1:])}


def run_windows(args) -> dict:
    """Plain steps on the compiled blocks, a stats session attached for one step every few."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))
    x = torch.randn(args.batch, args.seq, args.width)
    graphs = [0]
    backend = counting(args.backend, graphs)
    for block in model:
        block.compile(backend=backend)
    plain, windows, graphs_at = [], [], []

    def step(session=None):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        if session is not None:
            session.step()
        return time.perf_counter() - t0

    for _ in range(args.windows):
        plain += [step() for _ in range(2)]
        with hookplug.attach(model, "Linear", plugins=("stats", {"sites": ("output", "grad")})) as s:
            windows.append(step(s))
        graphs_at.append(graphs[0])
    plain += [step() for _ in range(2)]
    return {"graphs_later": graphs_at[-1] - graphs_at[0], "first": windows[0],
            "window": statistics.median(windows[1:]), "plain": statistics.median(plain[2:])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--windows", type=int, default=6, help="debugging windows (0: none)")
    args = ap.parse_args(argv)
    print(f"regional compilation: {args.blocks} blocks x 4 Linear({args.width}), backend "
          f"{args.backend}, torch {torch.__version__}")
    print(f"  {'variant':10s} {'graphs':>7s} {'first step s':>13s} {'ratio':>6s} {'later ms':>9s} {'ratio':>6s}")
    # one-time costs (imports, the backend's first compile) are paid before timing anything
    for variant in ("no hooks", "stats"):  # (the first attach loads plugins, registers ops)
        run(variant, argparse.Namespace(**{**vars(args), "blocks": 1, "steps": 2}))
    results = {}
    for variant in ("no hooks", "stats"):
        r = results[variant] = run(variant, args)
        base = results["no hooks"]
        print(f"  {variant:10s} {r['graphs']:7d} {r['first']:13.2f} {r['first'] / base['first']:6.2f} "
              f"{1e3 * r['later']:9.2f} {r['later'] / base['later']:6.2f}")
    if args.windows > 1:
        r = results["windows"] = run_windows(args)
        print(f"  a session attached for 1 step, {args.windows} times: graphs compiled after the first "
              f"window {r['graphs_later']}; first window step {r['first']:.2f} s; later window steps "
              f"{1e3 * r['window']:.2f} ms = {r['window'] / r['plain']:.2f} x a plain step "
              f"({1e3 * r['plain']:.2f} ms)")
    torch._dynamo.reset()
    return results


if __name__ == "__main__":
    main()
