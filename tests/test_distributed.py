"""Telemetry under torch.distributed: two CPU processes (gloo), each feeding half of every
batch through a DDP-wrapped or FSDP2-sharded (``fully_shard``) model; rank 0's records must be the statistics of the whole
batch, obtained by reducing the packed partial stats (never by gathering activations)."""
import math
import os

import pytest
import torch
import torch.distributed as dist
from _gloo import Dump, spawn

import hookplug
from hookplug.models import MLP

WORLD = 2
STEPS = 3
BATCH = 16


def batches():
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(BATCH, 32, generator=g) * (1 + i) for i in range(STEPS)]


def make_model():
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc1.bias += 100.0  # fc1's outputs: |mean|/std ~ 100, a test of the M2 recombination
    return m


def worker(rank, world, out, mode):
    """One rank's half of every batch through DDP or FSDP2; its records and what plain
    torch hooks saw. Run by ``_gloo.spawn``, which leaves without tearing gloo down (a
    ``destroy_process_group()`` after FSDP2 aborted a CI run: see ``_gloo.leave``)."""
    model = make_model()
    if mode == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:  # FSDP2: every Linear and the root sharded in place (no wrapper module)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    # the activations this rank computed, seen by plain torch hooks (the test's ground truth)
    seen, state = {}, {"step": 0}
    for name, mod in model.named_modules():  # records name the wrapped model's modules
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(
                f"{state['step']}|{name}", []).append(o.detach().reshape(-1).tolist()))
    dump = Dump()
    sinks = [("jsonl", {"path": os.path.join(out, "r{rank}")}), dump]
    with hookplug.attach(ddp, "Linear", plugins="stats", sink=sinks, flush_every=2) as s:
        for step, x in enumerate(batches()):
            state["step"] = step
            ddp(x.chunk(world)[rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
            s.step()  # flushes (and all_reduces) at step 2; remove() flushes step 2
    return {"records": dump.records, "seen": seen}


def ref_stats(x):
    x = x.double()
    return {"numel": x.numel(), "nan_count": 0, "inf_count": 0, "zero_count": int((x == 0).sum()),
            "min": float(x.min()), "max": float(x.max()), "mean": float(x.mean()),
            "std": float(x.std(correction=0)), "absmax": float(x.abs().max())}


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_gloo_ranks_reduce_to_the_whole_batch_stats(tmp_path, mode):
    got = spawn(worker, tmp_path, str(tmp_path), mode, world=WORLD)
    recs = [g["records"] for g in got]
    seen = [g["seen"] for g in got]
    assert len(recs[0]) == STEPS * 3  # fc1, fc2, fc3 each step
    assert {r["rank"] for r in recs[0]} == {0} and {r["rank"] for r in recs[1]} == {1}
    # only rank 0 writes, unless a sink asks for all ranks
    assert (tmp_path / "r0" / "telemetry.jsonl").exists() and not (tmp_path / "r1").exists()
    assert len((tmp_path / "r0" / "telemetry.jsonl").read_text().splitlines()) == STEPS * 3

    # 1. exactly the statistics of everything both ranks computed, in one process
    for rec, rec1 in zip(recs[0], recs[1]):
        key = f"{rec['step']}|{rec['module']}"
        whole = torch.tensor([v for r in range(WORLD) for call in seen[r][key] for v in call])
        want = ref_stats(whole)
        for k in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax"):
            assert rec[k] == want[k], (key, k, rec[k], want[k])
        for k in ("mean", "std"):
            assert math.isclose(rec[k], want[k], rel_tol=1e-6), (key, k, rec[k], want[k])
        # the histogram of the whole batch: bucket counts add up across ranks
        edges = torch.tensor(rec["hist_edges"], dtype=torch.float64)
        assert rec["hist"] == torch.histogram(whole.double(), bins=edges)[0].long().tolist()
        # every rank holds the same reduced values
        assert {k: v for k, v in rec1.items() if k not in ("rank", "time", "run_id")} == \
               {k: v for k, v in rec.items() if k not in ("rank", "time", "run_id")}

    # 2. the same model trained on the whole batch in one process gives the same stats
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outs = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(lambda m, i, o, name=name: outs.setdefault(name, []).append(o.detach()))
    by_key = {(r["step"], r["module"]): r for r in recs[0]}
    for step, x in enumerate(batches()):
        outs.clear()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for name, calls in outs.items():
            rec = by_key[(step, name)]  # DDP is looked through: the plain model's names
            want = ref_stats(torch.cat([c.reshape(-1) for c in calls]))
            assert rec["numel"] == want["numel"]
            for k in ("min", "max", "mean", "std"):
                assert math.isclose(rec[k], want[k], rel_tol=1e-5, abs_tol=1e-5), (step, name, k)


class FakeDist:
    """Two ranks holding identical data, in one process: gathers duplicate."""

    def get_world_size(self):
        return 2

    def get_rank(self):
        return 0

    def all_gather_object(self, out, obj):
        out[:] = [obj, obj]

    def all_gather_into_tensor(self, out, t):
        out.copy_(torch.cat([t, t]))


def test_reduction_merges_rows_exactly_even_far_from_zero(monkeypatch):
    """|mean|/std = 1e6: ranks' rows are gathered and merged by the parallel formula, so
    mean and std are exact to float64 rounding from the first flush."""
    from hookplug import _telemetry

    monkeypatch.setattr(_telemetry, "initialized_dist", lambda: FakeDist())
    g = torch.Generator().manual_seed(0)
    data = [1e6 + torch.randn(4096, dtype=torch.float64, generator=g) * (1 + i) for i in range(3)]

    class Producer:
        name = "producer"

        @hookplug.hookimpl
        def hookplug_collect(self, step):
            if step >= len(data):  # the final flush of remove() (collective: no sink needed)
                return None
            return [({"step": step, "module": "m", "site": "output"}, hookplug.ops.tensor_stats(data[step]))]

    model = MLP()
    recs = []
    with hookplug.attach(model, "Linear", plugins=Producer()) as s:
        for _ in range(3):
            recs += s.flush()
            s.step()
    assert [r["step"] for r in recs] == [0, 1, 2]
    for rec, x in zip(recs, data):
        both = torch.cat([x, x])
        assert rec["numel"] == 8192 and rec["min"] == float(x.min()) and rec["max"] == float(x.max())
        assert sum(rec["hist"]) == 8192
        assert math.isclose(rec["mean"], float(both.mean()), rel_tol=1e-12)
        assert math.isclose(rec["std"], float(both.std(correction=0)), rel_tol=1e-9), (rec["step"], rec["std"])


class ListSink:
    name = "list"

    def __init__(self):
        self.records = []

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        self.records.extend(records)


def test_a_failed_collective_warns_under_warn_and_its_steps_go_out_with_the_next_flush(monkeypatch):
    """on_error="warn": a collective that fails makes session.step() warn, not raise; the
    steps it held are sent again by the next flush, not lost."""
    from hookplug import _telemetry

    class Flaky(FakeDist):
        fail = 1

        def all_gather_into_tensor(self, out, t):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("connection reset by peer")
            super().all_gather_into_tensor(out, t)

    fake = Flaky()
    monkeypatch.setattr(_telemetry, "initialized_dist", lambda: fake)
    model, sink = MLP(), ListSink()
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1, on_error="warn") as s:
        model(torch.randn(2, 32))
        with pytest.warns(RuntimeWarning, match="connection reset by peer.*kept for the next flush"):
            s.step()
        assert sink.records == []
        model(torch.randn(3, 32))
        s.step()
        assert [(r["step"], r["numel"]) for r in sink.records if r["module"] == "fc1"] == [(0, 2 * 2 * 64), (1, 2 * 3 * 64)]
    with hookplug.attach(model, "Linear", plugins="stats", sink=ListSink(), flush_every=1) as s:
        fake.fail = 1
        model(torch.randn(2, 32))
        with pytest.raises(RuntimeError, match="distributed flush failed"):
            s.step()  # on_error="raise"


def test_a_block_that_cannot_be_laid_out_is_left_out_and_reported(monkeypatch):
    """A producer's block without a step: the rank still joins the collectives with the
    rest of its rows, and the error goes through on_error."""
    from hookplug import _telemetry
    from hookplug._stats import StatsBlock

    monkeypatch.setattr(_telemetry, "initialized_dist", lambda: FakeDist())

    class Odd:
        name = "odd"

        @hookplug.hookimpl
        def hookplug_collect(self, step):
            st = hookplug.ops.tensor_stats(torch.ones(5))
            return [StatsBlock([{"module": "m", "site": "output"}], st.row.reshape(1, -1), st.hist),
                    ({"step": step, "module": "m", "site": "output"}, st)]

    model, sink = MLP(), ListSink()
    s = hookplug.attach(model, "Linear", plugins=Odd(), sink=sink, on_error="warn")
    with pytest.warns(RuntimeWarning, match="a flush failed.*KeyError"):
        s.flush()
    assert [(r["module"], r["numel"]) for r in sink.records] == [("m", 10)]
    sink.records.clear()
    with pytest.warns(RuntimeWarning, match="a flush failed.*KeyError"):
        s.remove()  # its final flush: the same
    assert [(r["module"], r["numel"]) for r in sink.records] == [("m", 10)]


# -- DDP variants: static_graph, find_unused_parameters, comm hooks, no_sync accumulation ----------

class Branchy(torch.nn.Module):
    """Two Linears, and a third one (``extra``) that some steps leave out (find_unused)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.extra = torch.nn.Linear(8, 3)

    def forward(self, x, use_extra=True):
        h = torch.relu(self.fc1(x))
        y = self.fc2(h)
        return y + self.extra(h) if use_extra else y


def _ddp_train(rank, cfg, hooks=None, manual=None, state=None, steps=4, micro=2):
    """A few SGD steps of ``Branchy`` under DDP as ``cfg`` asks; hookplug attached before or
    after wrapping (``hooks``: selector and plugins) or plain torch hooks (``manual``). The
    final parameters, the gradient each step applied, the session's results and records
    (``state["step"]``: the step running)."""
    import contextlib

    torch.manual_seed(0)
    model = Branchy()
    g = torch.Generator().manual_seed(100 + rank)
    data = [[torch.randn(4, 6, generator=g) for _ in range(micro)] for _ in range(steps)]
    sink, s = Dump(), None
    if hooks is not None and cfg["attach"] == "before":
        s = hookplug.attach(model, hooks[0], plugins=hooks[1], sink=sink)
    if manual is not None:
        manual(model)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, static_graph=cfg.get("static", False), find_unused_parameters=bool(cfg.get("unused")))
    if cfg.get("comm"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, cfg["comm"]))
    if hooks is not None and cfg["attach"] == "after":
        s = hookplug.attach(ddp, hooks[0], plugins=hooks[1], sink=sink)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step, xs in enumerate(data):
        if state is not None:
            state["step"] = step
        # the branch is unused on alternate steps, on each rank in turn ("rank") or on both
        use_extra = (step + (rank if cfg.get("unused") == "rank" else 0)) % 2 == 0 if cfg.get("unused") else True
        # static_graph records its graph in a first iteration that must sync (a torch limit)
        n = micro if cfg.get("accum") and not (cfg.get("static") and step == 0) else 1
        for i in range(n):
            with ddp.no_sync() if i < n - 1 else contextlib.nullcontext():
                ddp(xs[i], use_extra=use_extra).square().mean().backward()
        grads.append({k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        if s is not None:
            s.step()
        opt.zero_grad()
    results = None
    if s is not None:
        s.remove()
        results = s.results()
    return {k: p.detach().clone() for k, p in model.named_parameters()}, grads, results, sink.records


def _ddp_variant(rank, world, cfg):
    lo, hi = -0.02, 0.02
    out = {}
    # the plain run, watched by plain torch hooks: each Linear output and its gradient
    seen, state = {}, {}

    def watch(model):
        for name in ("fc1", "fc2", "extra"):
            def fwd(m, a, o, name=name):
                step = state["step"]
                seen.setdefault(f"{step}|output|{name}", []).append(o.detach().double().reshape(-1))
                o.register_hook(lambda gr: seen.setdefault(f"{step}|grad|{name}", []).append(gr.double().reshape(-1)))
            getattr(model, name).register_forward_hook(fwd)

    ref_params, ref_grads, _, _ = _ddp_train(rank, cfg, manual=watch, state=state)
    # stats (outputs and grads) and params observe only: training is bitwise the same
    params, grads, _, records = _ddp_train(
        rank, cfg, ("Linear", [("stats", {"sites": ("output", "grad")}), "params"]))
    out["same_params"] = [k for k in params if not torch.equal(params[k], ref_params[k])]
    out["same_grads"] = [(i, k) for i, (a, b) in enumerate(zip(ref_grads, grads)) for k in a
                         if (a[k] is None) != (b[k] is None) or (a[k] is not None and not torch.equal(a[k], b[k]))]
    # params: one grad record per optimizer step and parameter that had a gradient, its l2
    # the norm of the averaged gradient the optimizer applied
    out["grad_recs"] = sorted([r["step"], r["module"], r["l2"]] for r in records
                              if r["site"] == "grad" and r["module"].endswith((".weight", ".bias")))
    out["want_grad_recs"] = sorted([i, k, float(torch.linalg.vector_norm(g[k].double()))]
                                   for i, g in enumerate(ref_grads) for k in g if g[k] is not None)
    # stats: the merged records over both ranks; this rank's values to merge them in the test
    out["stats_recs"] = sorted([r["step"], r["site"], r["module"], r["numel"], r["min"], r["max"], r["mean"], r["std"]]
                               for r in records if r["module"] in ("fc1", "fc2", "extra"))
    out["seen"] = {key: torch.cat(v).tolist() for key, v in seen.items()}
    # gradclamp on outputs and parameters == the same clamp as plain torch hooks
    counts = {}

    def clamp(key):
        def fn(gr):
            counts[key] = counts.get(key, 0) + int(((gr < lo) | (gr > hi)).sum())
            return gr.clamp(lo, hi)
        return fn

    def manual(model):
        for k, p in model.named_parameters():
            p.register_hook(clamp(k))
        for name in ("fc1", "fc2", "extra"):
            getattr(model, name).register_forward_hook(
                lambda m, a, o, name=name: o.register_hook(clamp(name)) and None)

    want, _, _, _ = _ddp_train(rank, cfg, manual=manual)
    got, _, res, _ = _ddp_train(rank, cfg, ("Linear", [("gradclamp", {"min": lo, "max": hi, "params": "*",
                                                                       "outputs": True})]))
    out["clamped_same"] = [k for k in got if not torch.equal(got[k], want[k])]
    out["clamp_moved"] = any(not torch.equal(got[k], ref_params[k]) for k in got)
    out["changed"] = {k: v["changed"] for k, v in res["gradclamp"].items()}
    out["want_changed"] = {k: v for k, v in counts.items() if v or k in out["changed"]}
    return out


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("cfg", [
    {"attach": "before", "static": True},
    {"attach": "after", "static": True, "accum": True, "comm": "fp16_compress_hook"},
    {"attach": "before", "unused": "rank", "accum": True},
    {"attach": "after", "unused": "both"},
    pytest.param({"attach": "after", "comm": "bf16_compress_hook", "accum": True}, marks=pytest.mark.skipif(
        torch.version.cuda is None, reason="DDP's bf16 comm hook refuses a torch built without CUDA")),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_ddp_variants_train_as_without_hooks_and_clamp_as_plain_hooks(tmp_path, cfg):
    """DDP with ``static_graph``, ``find_unused_parameters`` (a branch left out on some
    steps, on one rank or both), a compression comm hook and ``no_sync`` accumulation,
    hookplug attached before or after wrapping: stats (outputs, grads) and params leave
    training bitwise as it is; params records one grad per optimizer step with the l2 of
    the averaged gradient; stats records are the merged statistics of both ranks' tensors;
    gradclamp gives the parameters (and counts) of the same clamp done by plain torch hooks."""
    from _gloo import spawn

    res = spawn(_ddp_variant, tmp_path, cfg)
    for r, got in enumerate(res):
        assert got["same_params"] == [] and got["same_grads"] == [], (r, got)
        assert [x[:2] for x in got["grad_recs"]] == [x[:2] for x in got["want_grad_recs"]]
        for (_, name, l2), (_, _, want) in zip(got["grad_recs"], got["want_grad_recs"]):
            assert math.isclose(l2, want, rel_tol=1e-6), (r, name, l2, want)
        assert got["clamped_same"] == [] and got["clamp_moved"], (r, got)
        assert got["changed"] == got["want_changed"], r
    assert res[0]["stats_recs"] == res[1]["stats_recs"]
    merged = {}
    for got in res:
        for key, values in got["seen"].items():
            merged.setdefault(key, []).extend(values)
    recs = {f"{step}|{site}|{name}": rest for step, site, name, *rest in res[0]["stats_recs"]}
    assert len(recs) == len(res[0]["stats_recs"]) and set(recs) == set(merged)  # one record a step, module and site
    for key, (numel, mn, mx, mean, std) in recs.items():
        x = torch.tensor(merged[key], dtype=torch.float64)
        assert numel == x.numel() and mn == float(x.min()) and mx == float(x.max()), key
        assert math.isclose(mean, float(x.mean()), rel_tol=1e-5, abs_tol=1e-6 * float(x.std())), key
        assert math.isclose(std, float(x.std(correction=0)), rel_tol=1e-5), key
