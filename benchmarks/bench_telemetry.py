"""Telemetry overhead on a training loop: hookplug stats + sinks against no hooks and against
wandb-style hooks that read every statistic back to the host (``.item()``) each step.

For a CNN (``hookplug.models.tiny_cnn``) and a transformer block
(``hookplug.models.tiny_transformer``), one run times these variants side by side
(interleaved rounds; the median and the best per-round step time, the best being the
least disturbed by other load on a shared machine, and the paired ratio: the median over
rounds of each round's ratio to that round's no-hooks time):

- ``no hooks``: the bare training step (forward, cross-entropy, backward, SGD);
- ``hook + torch.sum (floor)``: a bare forward hook per module running one ``torch.sum``
  over the output (kept nowhere): the least any hook that reads every activation once
  costs; on the CPU it runs in the step, like the stats op;
- ``stats every step, no sink``: the hooks and the op alone (no telemetry);
- ``stats every step, records dropped/10``: telemetry every 10 steps into a sink that drops
  the records (the flush without any format's encoding);
- ``stats every step, flush/10``: ``stats`` on every Conv2d/Linear output, every step, the
  JSONL sink, ``flush_every=10``;
- ``stats every step, flush/1``: the same, flushing every step;
- ``stats every 10th step``: ``every=10, flush_every=10``;
- ``sync per step (.item())``: a plain forward hook per module computing min, max, mean,
  std and the NaN count and reading each back with ``.item()`` (what a per-step logger does).

It also measures what an *unsampled* step costs per module call (the session's sampling
flag checked first in the torch hook) against no hook and a bare torch hook.

Targets: GPU (DESIGN, issue 15): every-step telemetry <= 5 % over no hooks, every-10 <= 1 %.
CPU (issue 10, revised in session 6): every step with a JSONL flush every 10 steps <= 1.05 x
the floor (paired), i.e. the whole telemetry path costs at most 5 % of a step more than one
torch reduction per hooked tensor. Also printed: the same ratio against no hooks.

    python benchmarks/bench_telemetry.py [--device cpu|cuda] [--steps 300] [--rounds 10] [--threads N]
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookplug
from hookplug.models import tiny_cnn, tiny_transformer

FLOOR = "hook + torch.sum (floor)"
VARIANTS = ("no hooks", FLOOR, "stats every step, no sink", "stats every step, records dropped/10",
            "stats every step, flush/10", "stats every step, flush/1",
            "stats every 10th step", "sync per step (.item())")
SELECT = "Conv2d|Linear"


def sum_hooks(model):
    """The floor: per module, per call, one ``torch.sum`` over the output, discarded."""
    def hook(m, inp, out):
        out.detach().sum()

    return [mod.register_forward_hook(hook)
            for mod in model.modules() if isinstance(mod, (nn.Conv2d, nn.Linear))]


def sync_per_step_hooks(model, log):
    """The baseline: per module, per call, five statistics read back to the host."""
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            def hook(m, inp, out, name=name):
                x = out.detach()
                log.append((name, x.min().item(), x.max().item(), x.float().mean().item(),
                            x.float().std().item(), torch.isnan(x).sum().item()))
            handles.append(mod.register_forward_hook(hook))
    return handles


class DropSink(hookplug.Sink):
    """A sink that receives the records and drops them: telemetry's cost without a format."""

    name = "drop"

    @hookplug.hookimpl
    def hookplug_flush(self, session, records):
        pass


class Variant:
    def __init__(self, kind, model, out_dir):
        self.kind, self.session, self.handles, self.log = kind, None, [], []
        path = os.path.join(out_dir, kind.replace(" ", "_").replace("/", "-").replace(".", ""))
        jsonl = ("jsonl", {"path": path})
        if kind == FLOOR:
            self.handles = sum_hooks(model)
        elif kind == "stats every step, no sink":  # the hooks and the op alone
            self.session = hookplug.attach(model, SELECT, plugins="stats")
        elif kind == "stats every step, records dropped/10":  # + telemetry, no encoding
            self.session = hookplug.attach(model, SELECT, plugins="stats", sink=DropSink(), flush_every=10)
        elif kind == "stats every step, flush/10":
            self.session = hookplug.attach(model, SELECT, plugins="stats", sink=jsonl, flush_every=10)
        elif kind == "stats every step, flush/1":
            self.session = hookplug.attach(model, SELECT, plugins="stats", sink=jsonl, flush_every=1)
        elif kind == "stats every 10th step":
            self.session = hookplug.attach(model, SELECT, plugins="stats", sink=jsonl, every=10, flush_every=10)
        elif kind == "sync per step (.item())":
            self.handles = sync_per_step_hooks(model, self.log)

    def step(self):
        if self.session is not None:
            self.session.step()
        elif self.log:
            self.log.clear()  # a logger would ship them here

    def close(self):
        if self.session is not None:
            self.session.remove()
        for h in self.handles:
            h.remove()


def make(name, device):
    torch.manual_seed(0)
    if name == "cnn":
        model = tiny_cnn(width=16).to(device)
        x = torch.randn(16, 3, 32, 32, device=device)
    else:
        model = tiny_transformer(dim=64, depth=2).to(device)
        x = torch.randint(0, 1000, (16, 32), device=device)
    y = torch.randint(0, 10, (x.shape[0],), device=device)
    return model, x, y


def run_steps(model, opt, x, y, variant, n, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        variant.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def bench_model(name, device, steps, rounds, out_dir):
    model, x, y = make(name, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_round = max(10, steps // rounds)
    times = {k: [] for k in VARIANTS}
    for _ in range(rounds):
        for kind in VARIANTS:  # interleaved, so drift hits every variant alike
            v = Variant(kind, model, out_dir)
            run_steps(model, opt, x, y, v, 3, device)  # warm-up
            times[kind].append(run_steps(model, opt, x, y, v, per_round, device))
            v.close()
    n_mod = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    return times, per_round * rounds, n_mod


def unsampled_cost(n_modules=200, iters=50, rounds=9):
    """us per module call on a step that is not sampled, vs no hook and a bare torch hook."""
    model = nn.Sequential(*[nn.Identity() for _ in range(n_modules)])
    x = torch.zeros(1)
    kinds = ("no hook", "bare torch hook", "hookplug stats, unsampled step")
    out = {k: [] for k in kinds}
    with torch.no_grad():
        for _ in range(rounds):
            for k in kinds:
                detach = lambda: None  # noqa: E731
                if k == "bare torch hook":
                    hs = [m.register_forward_hook(lambda m, i, o: None) for m in model]
                    detach = lambda hs=hs: [h.remove() for h in hs]  # noqa: E731
                elif k.startswith("hookplug"):
                    s = hookplug.attach(model, "Identity", plugins="stats", every=10**9)
                    s.step()  # step 1 of every=10**9: not sampled
                    assert not s._sampling
                    detach = s.remove
                for _ in range(3):
                    model(x)
                t0 = time.perf_counter()
                for _ in range(iters):
                    model(x)
                out[k].append((time.perf_counter() - t0) / (iters * n_modules) * 1e6)
                detach()
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant (default: 300 on cuda, 100 on cpu)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--models", default="cnn,transformer")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    steps = args.steps or (300 if device.type == "cuda" else 100)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"bench_telemetry: torch {torch.__version__}, {where}, hookplug ops backend {hookplug.ops.backend()}")
    with tempfile.TemporaryDirectory() as out_dir:
        for name in args.models.split(","):
            times, total, n_mod = bench_model(name, device, steps, args.rounds, out_dir)
            med = {k: statistics.median(v) for k, v in times.items()}
            best = {k: min(v) for k, v in times.items()}
            print(f"\n{name}: {n_mod} Conv2d/Linear modules, {total} timed steps per variant "
                  f"({args.rounds} interleaved rounds; median and best round)")
            # paired: each round's ratio to the no-hooks run of the same round, then the median
            # (drift over the run cancels; the column to read on a shared machine)
            paired = {k: statistics.median(t / b for t, b in zip(v, times["no hooks"]))
                      for k, v in times.items()}
            print(f"  {'variant':<30}{'ms/step':>10}{'vs no hooks':>13}{'best ms':>10}{'best vs no':>12}"
                  f"{'paired':>9}")
            for k in VARIANTS:
                print(f"  {k:<30}{med[k] * 1e3:>10.3f}{med[k] / med['no hooks']:>12.3f}x"
                      f"{best[k] * 1e3:>10.3f}{best[k] / best['no hooks']:>11.3f}x{paired[k]:>8.3f}x")
            target = "stats every step, flush/10"
            over_floor = statistics.median(t / f for t, f in zip(times[target], times[FLOOR]))
            print(f"  {target} vs {FLOOR}, paired: {over_floor:.3f}x (CPU target <= 1.05x)")
    cost = unsampled_cost()
    print("\nunsampled step, per module call (200 Identity modules, no grad):")
    for k, v in cost.items():
        print(f"  {k:<32}{v:>8.3f} us")
    print(f"  sampling check over a bare torch hook: {cost['hookplug stats, unsampled step'] - cost['bare torch hook']:+.3f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
