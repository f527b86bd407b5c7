"""Training-step time with each first-party plugin on every Conv2d/Linear, side by side.

For a ResNet-style CNN and a transformer encoder, the median time of one training step
(forward + backward + SGD step) with:

- no hooks;
- each plugin attached to every ``Conv2d``/``Linear``: ``stats`` (output), ``stats``
  (output + grad), ``capture``, ``gradclamp``, and ``flops`` when ``plugins/flops.py`` loads;
- the seeds-style Python hook: a plain forward hook doing
  ``x.min().item(), x.max().item(), x.mean().item(), torch.histc(x)``.

All configurations run in one process, interleaved round by round (each round runs every
configuration for a few steps, in a rotating order) so drift affects them alike. Ratios are
against "no hooks" from the same run.

    python benchmarks/bench_plugins.py                 # CPU
    python benchmarks/bench_plugins.py --device cuda   # GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookplug
from hookplug.models import tiny_cnn, tiny_transformer

SELECTOR = "Conv2d|Linear"


def seeds_style_hooks(model):
    """The seeds' way: a Python forward hook reading stats back to the host every call."""
    handles = []

    def hook(module, inp, out):
        x = out.detach()
        x.min().item(), x.max().item(), x.mean().item(), torch.histc(x)

    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            handles.append(m.register_forward_hook(hook))

    class _Handle:
        def step(self):
            pass

        def remove(self):
            for h in handles:
                h.remove()

    return _Handle()


def configs(have_flops: bool):
    out = [
        ("no hooks", None),
        ("stats", ("stats", {})),
        ("stats output+grad", ("stats", {"sites": ("output", "grad")})),
        ("capture", ("capture", {})),
        ("gradclamp", ("gradclamp", {"min": -1.0, "max": 1.0})),
    ]
    if have_flops:
        out.append(("flops", ("flops", {})))
    out.append(("seeds-style hook", "seeds"))
    return out


def flops_available() -> bool:
    try:
        names = hookplug.plugin_names()
        if "flops" not in names:
            return False
        s = hookplug.attach(nn.Sequential(nn.Linear(2, 2)), "Linear", plugins="flops")
        s.remove()
        return True
    except Exception as exc:  # noqa: BLE001
        print(f"(flops plugin skipped: {type(exc).__name__}: {exc})", file=sys.stderr)
        return False


def attach(model, spec):
    if spec is None:
        return None
    if spec == "seeds":
        return seeds_style_hooks(model)
    return hookplug.attach(model, SELECTOR, plugins=[spec])


def make_workloads(device, quick: bool):
    torch.manual_seed(0)
    cnn = tiny_cnn(width=16).to(device)
    b = 4 if quick else 48
    x_cnn = torch.randn(b, 3, 64, 64, device=device)
    y_cnn = torch.randint(0, 10, (b,), device=device)
    tr = tiny_transformer(dim=128, depth=2).to(device)
    tb = 4 if quick else 32
    x_tr = torch.randint(0, 1000, (tb, 16 if quick else 96), device=device)
    y_tr = torch.randint(0, 10, (tb,), device=device)
    if device.type == "cuda" and not quick:  # make GPU steps long enough to measure
        x_cnn = torch.randn(128, 3, 64, 64, device=device)
        y_cnn = torch.randint(0, 10, (128,), device=device)
        x_tr = torch.randint(0, 1000, (128, 128), device=device)
        y_tr = torch.randint(0, 10, (128,), device=device)
    return [
        (
            "ResNet-style CNN (tiny_cnn w16, %s)" % "x".join(map(str, x_cnn.shape)),
            cnn,
            x_cnn,
            y_cnn,
        ),
        (
            "transformer (2 encoder layers d128, %s tokens)" % "x".join(map(str, x_tr.shape)),
            tr,
            x_tr,
            y_tr,
        ),
    ]


def train_step(model, opt, x, y, sync):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    sync()
    return time.perf_counter() - t0


def bench(name, model, x, y, cfgs, rounds, steps, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = {label: [] for label, _ in cfgs}
    n_hooked = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    for r in range(rounds):
        order = cfgs[r % len(cfgs) :] + cfgs[: r % len(cfgs)]
        for label, spec in order:
            session = attach(model, spec)
            try:
                train_step(model, opt, x, y, sync)  # warm-up (first call of a plugin, allocator)
                for _ in range(steps):
                    times[label].append(train_step(model, opt, x, y, sync))
                    if session is not None:
                        session.step()
            finally:
                if session is not None:
                    session.remove()
    base = statistics.median(times["no hooks"])
    print(
        f"\n{name}: {n_hooked} Conv2d/Linear hooked, {rounds} rounds x {steps} steps, "
        f"device {device}, {torch.get_num_threads()} threads"
    )
    best0 = min(times["no hooks"])
    print(
        f"{'configuration':<20} {'median ms':>10} {'ratio':>7} {'overhead ms':>12} "
        f"{'best ms':>9} {'ratio':>7}"
    )
    rows = {}
    for label, _ in cfgs:
        med, best = statistics.median(times[label]), min(times[label])
        rows[label] = med
        print(
            f"{label:<20} {med * 1e3:>10.2f} {med / base:>7.3f} {(med - base) * 1e3:>12.2f} "
            f"{best * 1e3:>9.2f} {best / best0:>7.3f}"
        )
    bests = {label: min(times[label]) for label, _ in cfgs}
    for what, vals, ref in (("median", rows, base), ("best", bests, best0)):
        ov_stats, ov_seeds = vals["stats"] - ref, vals["seeds-style hook"] - ref
        if ov_stats > 0:
            print(
                f"[{what}] stats overhead {ov_stats * 1e3:.2f} ms ({ov_stats / ref:.1%}); "
                f"seeds-style hook overhead {ov_seeds * 1e3:.2f} ms ({ov_seeds / ref:.1%}) = "
                f"{ov_seeds / ov_stats:.1f}x the "
                "stats overhead"
            )
        else:
            print(
                f"[{what}] stats overhead below noise ({ov_stats * 1e3:+.2f} ms); "
                f"seeds-style hook overhead {ov_seeds * 1e3:.2f} ms ({ov_seeds / ref:.1%})"
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    ap.add_argument("--quick", action="store_true", help="small inputs, for a smoke test")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU available")
    try:
        backend = hookplug.ops.backend()
    except Exception as exc:  # noqa: BLE001
        backend = f"unavailable ({exc})"
    print(f"torch {torch.__version__}, hookplug ops backend: {backend}")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    cfgs = configs(flops_available())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, model, x, y in make_workloads(device, args.quick):
            bench(name, model, x, y, cfgs, args.rounds, args.steps, device)


if __name__ == "__main__":
    main()
