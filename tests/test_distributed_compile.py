"""Compiled data-parallel training on two gloo ranks: ``torch.compile(DDP(model))`` and
``DDP(torch.compile(model))`` (dynamo's DDPOptimizer splits the graph at the buckets), and
DDP's python reducer under compiled autograd, hookplug attached before or after wrapping.
Every reference is computed here: the same run without hookplug, in eager mode, with plain
torch hooks, under ``FlopCounterMode``."""
import math

import pytest
import torch
import torch.distributed as dist

import hookplug

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(),
                                                   reason="torch.distributed is not available")]

LO, HI = -2e-4, 2e-4


class Net(torch.nn.Module):
    """Two 1 MiB Linears: with ``bucket_cap_mb=1`` DDP (and DDPOptimizer) puts them in
    buckets of their own, so the compiled forward is split in three graphs."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 512)
        self.fc2 = torch.nn.Linear(512, 512)
        self.fc3 = torch.nn.Linear(512, 512)
        self.fc4 = torch.nn.Linear(512, 4)

    def forward(self, x):
        return self.fc4(torch.relu(self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))))


def _counting(counts, base):
    """``base`` that counts the graphs it compiles, their hookplug ops, and the runs of
    graphs holding one."""
    from torch._dynamo.backends.registry import lookup_backend

    compile_fn = lookup_backend(base)

    def counting(gm, example_inputs):
        ops = sum("hookplug" in str(n.target) for n in gm.graph.nodes)
        counts["graphs"] += 1
        counts["ops"] += ops
        compiled = compile_fn(gm, example_inputs)

        def run(*args):
            counts["op_runs"] += bool(ops)
            return compiled(*args)
        return run
    return counting


def _train(rank, cfg, plugins=None, manual=None, compiled=True, steps=3, extra=0):
    """``steps`` SGD steps of ``Net`` under DDP as ``cfg`` asks (``wrap``: "compile_ddp" or
    "ddp_compile", ``backend``, ``attach``: "before"/"after" wrapping, ``ca``: DDP's python
    reducer in a compiled step under compiled autograd), hookplug (``plugins`` on the
    Linears) or plain torch hooks (``manual``); then remove() and ``extra`` steps more."""
    from _gloo import Dump
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(100 + rank)
    data = [torch.randn(4, 8, generator=g) for _ in range(steps + extra)]
    counts = {"graphs": 0, "ops": 0, "op_runs": 0}
    backend = _counting(counts, cfg["backend"])
    sink, s = Dump(), None
    if plugins is not None and cfg["attach"] == "before":
        s = hookplug.attach(model, "Linear", plugins=plugins, sink=sink)
    if manual is not None:
        manual(model)
    ca = cfg.get("ca") and compiled
    if cfg.get("ca"):
        torch._dynamo.config.optimize_ddp = "python_reducer"  # read when DDP is made
    try:
        if cfg.get("wrap") == "ddp_compile":
            inner = torch.compile(model, backend=backend) if compiled else model
            ddp = run = torch.nn.parallel.DistributedDataParallel(inner, bucket_cap_mb=1)
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
            run = torch.compile(ddp, backend=backend) if compiled and not ca else ddp
        if plugins is not None and cfg["attach"] == "after":
            s = hookplug.attach(ddp if ca else run, "Linear", plugins=plugins, sink=sink)

        def step(x):
            run(x).square().mean().backward()

        if ca:
            torch._dynamo.config.compiled_autograd = True
            step = torch.compile(step, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, at_remove = [], None
        for i, x in enumerate(data):
            if i == steps:
                at_remove = dict(counts, breaks=sum(counters["graph_break"].values()))
                if s is not None:
                    s.remove()
            step(x)
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
            opt.step()
            if s is not None and i < steps:
                s.step()
            opt.zero_grad()
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.config.optimize_ddp = True
    if s is not None:
        s.remove()
    return {"params": {k: p.detach().clone() for k, p in model.named_parameters()}, "grads": grads,
            "counts": dict(counts, breaks=sum(counters["graph_break"].values())),
            "at_remove": at_remove,
            "reasons": [str(k) for k in counters["graph_break"]], "records": sink.records,
            "results": s.results() if s is not None else None}


def _clamp_by_hand(model):
    """The plain torch clamp gradclamp's options ask for: parameters and Linear outputs."""
    for p in model.parameters():
        p.register_hook(lambda gr: gr.clamp(LO, HI))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(
                lambda m, a, o: o.register_hook(lambda gr: gr.clamp(LO, HI)) and None)


CLAMP = ("gradclamp", {"min": LO, "max": HI, "params": "*", "outputs": True})


def _key(r):
    return f"{r['step']}|{r['site']}|{r['module']}"


def _observe(rank, world, cfg):
    """stats (outputs, grads) and params on a compiled DDP model: training unchanged, the
    graphs of the run without hooks, records equal eager, one grad record per step with
    the l2 of the averaged gradient; after remove() no hookplug op runs and nothing
    recompiles but the one recompile the removed hooks ask for."""
    plugins = [("stats", {"sites": ("output", "grad")}), "params"]
    ref = _train(rank, cfg, steps=2, extra=1)
    eager = _train(rank, cfg, plugins, compiled=False, steps=2)
    got = _train(rank, cfg, plugins, steps=2, extra=1)
    exact = cfg["backend"] == "aot_eager"
    out = {"moved": [k for k in ref["params"] if not (
        torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7))(
            ref["params"][k], got["params"][k])]}
    rc, gc = ref["counts"], got["at_remove"]
    out["graphs"] = [rc["graphs"], gc["graphs"], rc["breaks"], gc["breaks"], gc["ops"],
                     gc["op_runs"]]
    out["after_remove"] = {k: got["counts"][k] - gc[k]
                           for k in ("graphs", "ops", "op_runs", "breaks")}
    e = {_key(r): r for r in eager["records"]}
    c = {_key(r): r for r in got["records"]}
    out["keys"] = [sorted(e), sorted(c)]
    out["differ"] = [(k, f, e[k][f], c[k][f]) for k in set(e) & set(c) for f in (
        "numel", "nan_count", "zero_count", "calls", "min", "max", "mean", "std", "l2")
        if not math.isclose(e[k][f], c[k][f], rel_tol=1e-4, abs_tol=1e-9)]
    out["grad_l2"] = sorted([r["step"], r["module"], r["l2"]] for r in got["records"]
                            if r["site"] == "grad" and r["module"].endswith((".weight", ".bias")))
    out["want_l2"] = sorted([i, k, float(torch.linalg.vector_norm(g[k].double()))]
                            for i, g in enumerate(ref["grads"][:2]) for k in g)
    return out


def _steer(rank, world, cfg):
    """gradclamp (outputs and params=) on a compiled DDP model: the parameters of a plain
    torch clamp compiled the same way; flops: FlopCounterMode's per module and step."""
    from torch.utils.flop_counter import FlopCounterMode

    want = _train(rank, cfg, manual=_clamp_by_hand)
    got = _train(rank, cfg, [CLAMP])
    out = {"clamped": [k for k in got["params"]
                       if not torch.equal(got["params"][k], want["params"][k])],
           "changed": sum(v["changed"] for v in got["results"]["gradclamp"].values())}
    flops = _train(rank, cfg, ["flops"], steps=2)["results"]["flops"]
    torch.manual_seed(0)
    m = Net()
    with FlopCounterMode(display=False) as fc:
        m(torch.randn(4, 8)).square().mean().backward()
    per = {k.rsplit(".", 1)[-1]: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    out["flops"] = {k: [v["flops"] + v["backward_flops"], 2 * per[k]] for k, v in flops.items()}
    return out


@pytest.mark.parametrize("cfg", [
    {"wrap": "compile_ddp", "backend": "aot_eager", "attach": "before"},
    {"wrap": "ddp_compile", "backend": "aot_eager", "attach": "after"},
    {"wrap": "compile_ddp", "backend": "inductor", "attach": "after"},
], ids=lambda c: "-".join(c.values()))
def test_compiled_ddp_observed_as_eager_with_the_graphs_of_the_plain_run(tmp_path, cfg):
    from _gloo import spawn

    for r, got in enumerate(spawn(_observe, tmp_path, cfg)):
        assert got["moved"] == [], (r, got["moved"])
        rg, hg, rb, hb, ops, op_runs = got["graphs"]
        assert rg == hg and rg >= 3 and rb == hb, (r, got["graphs"])  # split at the buckets
        assert ops == 4 and op_runs > 0, (r, got["graphs"])  # the output sites, in the graphs
        # remove(): the hooked frames compile once more (the hook guards), with no op
        assert got["after_remove"] == {"graphs": rg, "ops": 0, "op_runs": 0, "breaks": 0}, r
        assert got["keys"][0] == got["keys"][1] and got["differ"] == [], (r, got["differ"])
        assert [x[:2] for x in got["grad_l2"]] == [x[:2] for x in got["want_l2"]]
        for (_, name, l2), (_, _, want) in zip(got["grad_l2"], got["want_l2"]):
            assert math.isclose(l2, want, rel_tol=1e-6), (r, name, l2, want)


@pytest.mark.parametrize("cfg", [
    {"wrap": "compile_ddp", "backend": "aot_eager", "attach": "after"},
    {"wrap": "ddp_compile", "backend": "aot_eager", "attach": "before"},
], ids=lambda c: "-".join(c.values()))
def test_compiled_ddp_clamps_as_plain_hooks_and_counts_flops_as_flop_counter_mode(tmp_path, cfg):
    from _gloo import spawn

    for r, got in enumerate(spawn(_steer, tmp_path, cfg)):
        assert got["clamped"] == [] and got["changed"] > 0, (r, got)
        assert len(got["flops"]) == 4, (r, got["flops"])
        assert all(a == b for a, b in got["flops"].values()), (r, got["flops"])


def _compiled_autograd(rank, world, cfg):
    import warnings

    want = _train(rank, cfg, manual=_clamp_by_hand, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(rank, cfg, [CLAMP], steps=2)
    return {"reasons": [x[:200] for x in got["reasons"]],
            "warned": [str(w.message)[:160] for w in caught if "Dynamo" in str(w.message)],
            "clamped": [k for k in got["params"]
                        if not torch.equal(got["params"][k], want["params"][k])]}


def test_gradclamp_under_compiled_autograd_breaks_no_backward_graph(tmp_path):
    """DDP's python reducer in a compiled training step under compiled autograd, which traces
    gradclamp's gradient hooks into its backward graph: they add no graph break there (its
    functorch checks did, with a dynamo warning each: 64 breaks in 2 steps), so the graph
    breaks where a grad site of stats breaks it (the tensor hooks' ``grad_fn``, README) and
    at ``backward()``, and gradclamp steers as a plain torch clamp does."""
    from _gloo import spawn

    cfg = {"backend": "aot_eager", "attach": "after", "ca": True}
    for r, got in enumerate(spawn(_compiled_autograd, tmp_path, cfg)):
        assert all("grad_fn" in x or "backward()" in x for x in got["reasons"]), (r, got["reasons"])
        assert got["warned"] == [], (r, got["warned"])
        assert got["clamped"] == [], (r, got["clamped"])
