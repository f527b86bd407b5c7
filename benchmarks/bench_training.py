"""Training-step overhead of stats telemetry on real-sized models (issue 15, item 3).

Models: torchvision ResNet-50 (random init, 224x224) and a GPT-2-small-sized transformer
(HF ``GPT2LMHeadModel`` from config: 12 layers, 768 wide, sequence 512), each trained with
AdamW, bf16 autocast on CUDA. Variants, timed side by side in interleaved rounds (median
of rounds; CUDA events around each round):

- ``no hooks``;
- ``stats every step, jsonl flush/10``: ``stats`` on every Conv2d/Linear/Conv1D output;
- ``stats every 10th step``: ``every=10``, flush every 10;
- ``seeds .item() hook``: min/max/mean/std read back with ``.item()`` per module and step.

Then the stats variant runs a few steps under ``torch.cuda.set_sync_debug_mode("error")``:
a host sync anywhere in hookplug's path raises and the line says which.

Goals (issue 15): every step <= 1.02x, every 10th step <= 1.005x.

``--compile MODELS`` also times each named model compiled with inductor, without hooks and
with stats every step (the hooks are attached to the model the compiled module wraps), and
counts the graphs and the recompiles after warm-up.

    python benchmarks/bench_training.py --device cuda [--models resnet50,gpt2] [--rounds 5] [--steps 20]
    python benchmarks/bench_training.py --quick           # tiny models on the CPU (a smoke test)
"""
import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookplug

SELECT = {"resnet50": "Conv2d|Linear", "gpt2": "Linear|Conv1D"}  # Conv1D: transformers' GPT-2
VARIANTS = ("no hooks", "stats every step, jsonl flush/10", "stats every 10th step",
            "seeds .item() hook")


def make(name, device, quick):
    """(model, loss_fn) for ``name``; quick: a tiny version for a CPU smoke test."""
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10) if quick else torchvision.models.resnet50()
        b, hw = (2, 32) if quick else (64, 224)
        x = torch.randn(b, 3, hw, hw, device=device)
        y = torch.randint(0, 10 if quick else 1000, (b,), device=device)
        return model.to(device), lambda m: F.cross_entropy(m(x), y)
    if name == "gpt2":
        import transformers

        cfg = (dict(n_layer=2, n_embd=64, n_head=2, n_positions=64) if quick
               else dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024))
        config = transformers.GPT2Config(vocab_size=50257 if not quick else 1000, bos_token_id=0,
                                         eos_token_id=0, loss_type="ForCausalLM", **cfg)
        model = transformers.GPT2LMHeadModel(config).to(device)
        b, s = (2, 32) if quick else (8, 512)
        ids = torch.randint(0, config.vocab_size, (b, s), device=device)
        return model, lambda m: m(ids, labels=ids).loss
    raise SystemExit(f"unknown model {name!r}; expected resnet50 or gpt2")


def item_hooks(model):
    """The seeds' logger: per module and call, four statistics read back with .item()."""
    seen = []

    def hook(m, i, o):
        o = o.detach().float() if isinstance(o, torch.Tensor) else None
        if o is not None:
            seen.append((o.min().item(), o.max().item(), o.mean().item(), o.std().item()))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear)) or type(m).__name__ == "Conv1D"]
    return handles, seen


@contextlib.contextmanager
def variant(kind, model, out_dir, select):
    """Attach ``kind``; yields the per-step callback."""
    if kind == "no hooks":
        yield lambda: None
        return
    if kind == "seeds .item() hook":
        handles, seen = item_hooks(model)
        try:
            yield seen.clear
        finally:
            for h in handles:
                h.remove()
        return
    every = 10 if kind == "stats every 10th step" else 1
    sink = ("jsonl", {"path": os.path.join(out_dir, kind.replace(" ", "_").replace("/", "-"))})
    s = hookplug.attach(model, select, plugins="stats", sink=sink, every=every, flush_every=10)
    try:
        yield s.step
    finally:
        s.remove()


def run(model, opt, loss_fn, step, n, device, autocast):
    """Seconds per step over ``n`` training steps (device time on CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model)
        loss.backward()
        opt.step()
        step()
    if cuda:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    return (time.perf_counter() - t0) / n


def sync_check(model, opt, loss_fn, device, autocast, out_dir, select) -> str:
    """Run the stats variant under set_sync_debug_mode("error"): '' or the error."""
    if device.type != "cuda":
        return "skipped (CPU)"
    with variant("stats every step, jsonl flush/10", model, out_dir, select) as step:
        run(model, opt, loss_fn, step, 2, device, autocast)  # warm: allocations, first flush
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(model, opt, loss_fn, step, 12, device, autocast)
            return "no host sync in 12 steps (2 flushes)"
        except RuntimeError as exc:
            return f"SYNC: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode(prev)


def bench(name, args, device, out_dir):
    model, loss_fn = make(name, device, args.quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = device.type == "cuda"
    times = {k: [] for k in VARIANTS}
    for _ in range(args.rounds):
        for kind in VARIANTS:  # interleaved: drift hits every variant alike
            with variant(kind, model, out_dir, SELECT[name]) as step:
                run(model, opt, loss_fn, step, args.warmup, device, autocast)
                times[kind].append(run(model, opt, loss_fn, step, args.steps, device, autocast))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{name}: {args.rounds} rounds x {args.steps} steps per variant, "
          f"{'bf16 autocast, ' if autocast else ''}{device}")
    print(f"  {'variant':36s} {'ms/step':>9s} {'vs no hooks':>12s}")
    for k in VARIANTS:
        print(f"  {k:36s} {med[k] * 1e3:9.3f} {med[k] / med['no hooks']:11.4f}x")
    print(f"  sync check: {sync_check(model, opt, loss_fn, device, autocast, out_dir, SELECT[name])}")


def bench_compiled(name, args, device, out_dir):
    """Compiled training steps: no hooks vs stats every step (jsonl flush/10), on two copies
    of one model, each compiled once (attaching or removing hooks recompiles a model)."""
    import copy

    from torch._dynamo.utils import counters

    model, loss_fn = make(name, device, args.quick)
    twin = copy.deepcopy(model)
    autocast = device.type == "cuda"
    torch._dynamo.reset()
    counters.clear()
    backend = "aot_eager" if args.quick else "inductor"  # quick: no C++/Triton compile time
    kinds = ("compiled, no hooks", "compiled, stats every step, jsonl flush/10")
    sink = ("jsonl", {"path": os.path.join(out_dir, "compiled")})
    s = hookplug.attach(twin, SELECT[name], plugins="stats", sink=sink, flush_every=10)
    setups = {kinds[0]: (torch.compile(model, backend=backend), lambda: None),
              kinds[1]: (torch.compile(twin, backend=backend), s.step)}
    opts = {kinds[0]: torch.optim.AdamW(model.parameters(), lr=1e-4),
            kinds[1]: torch.optim.AdamW(twin.parameters(), lr=1e-4)}
    times = {k: [] for k in kinds}
    graphs = {}
    t0 = time.perf_counter()
    try:
        for kind in kinds:  # warm-up: compilation
            before = counters["stats"]["unique_graphs"]
            run(setups[kind][0], opts[kind], loss_fn, setups[kind][1], args.warmup, device, autocast)
            graphs[kind] = counters["stats"]["unique_graphs"] - before
        warm = counters["stats"]["unique_graphs"]
        for _ in range(args.rounds):
            for kind in kinds:
                times[kind].append(run(setups[kind][0], opts[kind], loss_fn, setups[kind][1],
                                       args.steps, device, autocast))
        later = counters["stats"]["unique_graphs"] - warm
    finally:
        s.remove()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{name}, torch.compile ({backend}): {args.rounds} rounds x {args.steps} steps, "
          f"{time.perf_counter() - t0:.0f} s with compilation; graphs compiled in warm-up: "
          f"{graphs[kinds[0]]} for the plain copy, then {graphs[kinds[1]]} for the hooked copy "
          f"(frames without hooks reuse the plain copy's); compiled after warm-up: {later}")
    for k in kinds:
        print(f"  {k:44s} {med[k] * 1e3:9.3f} {med[k] / med[kinds[0]]:11.4f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny models, 1 round of 2 steps (smoke test)")
    ap.add_argument("--compile", default="", metavar="MODELS",
                    help="also time these models compiled with inductor (e.g. gpt2)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, hookplug ops backend {hookplug.ops.backend()}, "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    with tempfile.TemporaryDirectory() as out_dir:
        for name in filter(None, args.models.split(",")):
            bench(name.strip(), args, device, out_dir)
        for name in filter(None, args.compile.split(",")):
            bench_compiled(name.strip(), args, device, out_dir)


if __name__ == "__main__":
    main()
