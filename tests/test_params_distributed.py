"""The ``params`` plugin under torch.distributed (gloo, CPU processes on 127.0.0.1): the
records of a DDP / FSDP2 / HSDP run, of FSDP2 attached on a meta model before ``to_empty``
(deferred init), and of DDP with ``ZeroRedundancyOptimizer`` (a wrapper whose step() calls
its inner optimizer's, given the loss as a closure), equal those of the same model trained
unsharded in one process (counts exact, float fields to 1e-6 relative), with one packed
collective per flush and no gather of parameters or gradients. ``head`` has one output row,
so under FSDP2 a rank holds an empty shard of it and still takes part in every collective."""
import datetime
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookplug
from _gloo import Dump, free_port, leave, spawn

STEPS = 3
BATCH = 16
SITES = ("weight", "grad", "update")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 1)  # fewer rows than ranks: an empty shard under FSDP2

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model():
    torch.manual_seed(0)
    return Net().double()


def batches():
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, 12, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 1, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def train(model, wrapped, chunk, world, zero=False, materialize=None):
    sink = Dump()
    calls = {"gather": 0}
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, gather)
    with hookplug.attach(wrapped, "Linear", plugins=["params", ("stats", {"sites": "output"})],
                         sink=sink) as s:
        if materialize is not None:  # attached on meta (FSDP2's deferred init)
            materialize(model)
        if zero:  # each rank's inner SGD steps its partition, then ZeRO broadcasts the others
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.SGD,
                                          lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches():
            xc, yc = x.chunk(world)[chunk], y.chunk(world)[chunk]
            if zero:
                def closure():
                    opt.zero_grad()
                    loss = (wrapped(xc) - yc).square().mean()
                    loss.backward()
                    return loss

                opt.step(closure)
            else:
                (wrapped(xc) - yc).square().mean().backward()
                opt.step()
                opt.zero_grad()
            s.step()

        def counting(*a, **k):
            calls["gather"] += 1
            return real(*a, **k)

        setattr(dist, gather, counting)
        try:
            s.flush()
        finally:
            setattr(dist, gather, real)
    return sink.records, calls["gather"]


def load_full_weights(model):
    """to_empty(), then each rank's shard of make_model()'s weights."""
    from torch.distributed.tensor import distribute_tensor

    model.to_empty(device="cpu")
    full = dict(make_model().named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(distribute_tensor(full[name].detach(), p.device_mesh, p.placements,
                                                 src_data_rank=None).to_local())


def worker(rank, mode, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        materialize = None
        if mode == "fsdp_meta":  # built on meta, sharded, attached, then to_empty + init
            with torch.device("meta"):
                model = Net().double()
            materialize = load_full_weights
        else:
            model = make_model()
        if mode in ("ddp", "zero"):
            wrapped = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = (init_device_mesh("cpu", (world,)) if mode in ("fsdp", "fsdp_meta")
                    else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")))
            for m in (model.fc1, model.fc2, model.head):
                fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped = model
        records, gathers = train(model, wrapped, rank, world, zero=mode == "zero",
                                 materialize=materialize)
        with open(os.path.join(out, f"r{rank}.json"), "w") as f:
            json.dump({"records": records, "gathers": gathers}, f)
    finally:
        leave()  # not destroy_process_group(): see _gloo.leave


def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sink = Dump()
    norms = []
    with hookplug.attach(model, "Linear", plugins="params", sink=sink) as s:
        for x, y in batches():
            (model(x) - y).square().mean().backward()
            norms.append({n: float(torch.nn.utils.get_total_norm([p.grad]))
                          for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            s.step()
        s.flush()
    return sink.records, norms


def close(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("mode,world", [("ddp", 2), ("fsdp", 2), ("hsdp", 4), ("zero", 2),
                                        ("fsdp_meta", 2)])
def test_sharded_param_stats_equal_unsharded(tmp_path, mode, world):
    mp.spawn(worker, args=(mode, world, free_port(), str(tmp_path)), nprocs=world, join=True)
    want, norms = reference()
    want = {(r["step"], r["module"], r["site"]): r for r in want}
    assert len(want) == STEPS * 6 * 3
    for rank in range(world):
        got = json.load(open(tmp_path / f"r{rank}.json"))
        assert got["gathers"] == 1  # one packed collective round for params + stats rows
        recs = [r for r in got["records"] if r["site"] in SITES]
        assert len(recs) == len(want)
        for r in recs:
            w = want[(r["step"], r["module"], r["site"])]
            for k in ("numel", "nan_count", "inf_count", "zero_count"):
                assert r[k] == w[k], (mode, rank, r["module"], r["site"], k, r[k], w[k])
            for k in ("min", "max", "mean", "std", "absmax", "l2", "rms", "zero_fraction",
                      "update_to_weight"):
                if k in w or k in r:
                    assert close(r[k], w[k]), (mode, rank, r["module"], r["site"], k, r[k], w[k])
            assert r["hist"] == w["hist"]
            if r["site"] == "grad":
                assert close(r["l2"], norms[r["step"]][r["module"]])


def _ddp_params(rank, world, port, attach_first, singleton_groups):
    from _gloo import init

    if not attach_first:
        init(rank, world, port)
    groups = [dist.new_group([r]) for r in range(world)] if singleton_groups else None
    torch.manual_seed(0 if not singleton_groups else rank)  # a stage of its own per rank
    m = nn.Sequential()
    m.add_module(f"s{rank if singleton_groups else 0}", nn.Linear(4, 4))
    sink = Dump()
    ddp = None
    opts = {"sites": ("weight", "grad", "update")}
    if attach_first:  # attached before the group exists (the DDP comes later)
        s = hookplug.attach(m, "Linear", plugins=("params", opts), sink=sink)
        init(rank, world, port)
        ddp = nn.parallel.DistributedDataParallel(m)
    else:
        ddp = nn.parallel.DistributedDataParallel(m, process_group=groups[rank] if groups else None)
        s = hookplug.attach(ddp, "Linear", plugins=("params", opts), sink=sink)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(2, 4)).sum().backward()
    opt.step()
    s.step()
    copies = sum(pr.prev is not None for pr in s["params"]._params)  # the update's weight copies
    s.remove()
    recs = {(r["module"], r["site"]): r["numel"] for r in sink.records}
    dist.barrier()
    dist.destroy_process_group()
    return {"recs": [[k[0], k[1], v] for k, v in sorted(recs.items())], "copies": copies}


@pytest.mark.parametrize("attach_first, singleton_groups", [(True, False), (False, True)])
def test_ddp_replicas_are_counted_once_per_replica_group(tmp_path, attach_first, singleton_groups):
    """A replicated parameter is counted by one rank of the ranks holding it. Attached before
    ``init_process_group``, the world was read as 1 (each replica counted on every rank:
    numel 32 for a 4x4 weight); with DDP over a process group of its own (a pipeline stage
    per rank), the owner was picked over the whole world (half the parameters unrecorded)."""
    from _gloo import spawn_bare

    got = spawn_bare(_ddp_params, tmp_path, attach_first, singleton_groups)
    names = ["s0", "s1"] if singleton_groups else ["s0"]
    want = sorted([f"{n}.{p}", site, 16 if p == "weight" else 4]
                  for n in names for p in ("weight", "bias") for site in ("weight", "grad", "update"))
    for r in got:
        assert r["recs"] == want
    # each parameter's weight copy (for its update) kept on the rank that counts it only;
    # attached before the group existed, every rank had copied every parameter
    assert sum(r["copies"] for r in got) == 2 * len(names), [r["copies"] for r in got]


class _TiedStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def _stage_untied_after_attach(rank, world):
    torch.manual_seed(0)
    m = _TiedStage() if rank == 0 else nn.Sequential(nn.Linear(4, 4))
    dump = Dump()
    with hookplug.attach(m, "*", plugins=("params", {"bins": 0, "sites": ["weight"]}), sink=dump) as s:
        for step in range(3):
            if step == 1 and rank == 0:
                m.emb.weight = nn.Parameter(m.emb.weight.detach().clone())  # untied: head keeps the old
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            x = torch.randint(0, 20, (2, 3)) if rank == 0 else torch.randn(2, 4)
            m(x).sum().backward()
            opt.step()
            m.zero_grad()
            s.step()
    return {"weights": sorted((r["step"], r["module"]) for r in dump.records if r["site"] == "weight")}


@pytest.mark.slow
def test_a_name_an_untie_makes_on_a_pipeline_stage_is_counted_by_that_stage(tmp_path):
    """Two stages holding different layers (no data parallelism): rank 0's tied embedding
    and head untied after attach. The new name was counted round-robin (rank 1, which does
    not hold it): no ``head.weight`` record at all. Now by the rank that counted its slot's
    parameter."""
    for got in spawn(_stage_untied_after_attach, tmp_path):
        heads = [step for step, module in got["weights"] if module == "head.weight"]
        assert heads == [2], got  # (step 1 ends with the selection before the untie)
        assert [step for step, module in got["weights"] if module == "emb.weight"] == [0, 1, 2]
