"""Hot-path cost per module call: no hook, a bare torch forward hook, hookplug with one
no-op plugin, and a forward hook that calls pluggy's ``pm.hook`` on every call.

All four are measured side by side in one run: interleaved rounds, each variant timed as
the best of ``--repeat`` passes per round, and the overheads taken as medians of the
per-round differences (paired, so a noisy neighbour slows both sides of a difference). Target
(DESIGN.md): hookplug with one no-op plugin costs <= 1.5 us per module call over the bare
torch hook.

    python benchmarks/bench_dispatch.py [--modules 200] [--rounds 15]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

import hookplug
from hookplug import HookContext, hookimpl
from hookplug._manager import new_plugin_manager


class NoOp(hookplug.Plugin):
    name = "noop"

    @hookimpl
    def hookplug_forward_output(self, ctx, module, args, kwargs, output):
        return None


def make_model(n):
    return nn.Sequential(*[nn.Identity() for _ in range(n)])


def time_forward(model, x, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        model(x)
    return time.perf_counter() - t0


def setup_variant(kind, model):
    """Attach variant ``kind``; return a function that detaches it."""
    if kind == "no hook":
        return lambda: None
    if kind == "bare torch hook":
        hs = [m.register_forward_hook(lambda m, i, o: None) for m in model]
        return lambda: [h.remove() for h in hs]
    if kind == "hookplug, 1 no-op plugin":
        s = hookplug.attach(model, "Identity", plugins=NoOp())
        return s.remove
    if kind == "pm.hook per call":
        pm = new_plugin_manager()
        pm.register(NoOp())
        hook = pm.hook.hookplug_forward_output

        def per_call(m, args, kwargs, out):
            hook(ctx=HookContext("", 0, 0, None), module=m, args=args, kwargs=kwargs, output=out)

        hs = [m.register_forward_hook(per_call, with_kwargs=True) for m in model]
        return lambda: [h.remove() for h in hs]
    raise ValueError(kind)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, default=200)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=3, help="timed passes per variant and round (best kept)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    kinds = ["no hook", "bare torch hook", "hookplug, 1 no-op plugin", "pm.hook per call"]
    model = make_model(args.modules)
    x = torch.zeros(1)
    samples = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:  # interleaved so drift hits every variant alike
            detach = setup_variant(k, model)
            time_forward(model, x, 3)
            best = min(time_forward(model, x, args.iters) for _ in range(args.repeat))
            samples[k].append(best / (args.iters * args.modules) * 1e6)
            detach()
    med = {k: statistics.median(v) for k, v in samples.items()}

    def over(k, base):  # median of the paired per-round differences
        return statistics.median(a - b for a, b in zip(samples[k], samples[base]))

    print(f"per module call, {args.modules} modules x {args.iters} forwards, median of {args.rounds} rounds "
          f"(torch {torch.__version__})")
    print(f"{'variant':<28}{'us/call':>10}{'over no hook':>15}{'over bare hook':>16}")
    for k in kinds:
        print(f"{k:<28}{med[k]:>10.3f}{over(k, 'no hook'):>+15.3f}{over(k, 'bare torch hook'):>+16.3f}")
    ours = over("hookplug, 1 no-op plugin", "bare torch hook")
    print(f"hookplug over bare torch hook: {ours:+.3f} us/call (target <= 1.5): {'PASS' if ours <= 1.5 else 'FAIL'}")
    ratio = over("pm.hook per call", "no hook") / max(1e-9, over("hookplug, 1 no-op plugin", "no hook"))
    print(f"pm.hook per call / hookplug: {ratio:.1f}x the hook overhead")
    return 0 if ours <= 1.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
