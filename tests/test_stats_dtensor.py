"""The ``stats`` plugin on DTensor activations (tensor / sequence parallel, 2 gloo ranks on
127.0.0.1): the merged telemetry records equal the statistics of the same model run in one
process on the whole input (float64, plain torch hooks, no hookplug), for inputs, outputs
and output gradients whose placements are ``Shard`` (counted by their local shards) and
``Replicate`` (counted once), next to plain local tensors holding distinct pieces (counted
on every rank). A ``Partial`` output is skipped with one warning, and every rank keeps the
same row layout."""
import datetime
import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookplug
from _gloo import Dump, free_port, leave, spawn

WORLD = 2
SEQ = 4  # per rank: the sequence dimension is sharded
SITES = ("input", "output", "grad")
# Replicate() DTensors: counted by one rank (calls 1); Shard DTensors and plain local pieces
# by every rank
REPLICATED = {("fc1", "input[0]"), ("rep", "input[0]"), ("rep", "output"), ("rep", "grad"),
              ("part", "input[0]")}


class ToPartial(nn.Module):
    """Returns a ``Partial()`` DTensor (pending sum over ranks) of its Replicate input."""

    def forward(self, r):
        from torch.distributed.tensor import DTensor, Partial

        return DTensor.from_local(r.to_local() / WORLD, r.device_mesh, [Partial()], run_check=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.rep = nn.Linear(8, 8)
        self.part = ToPartial()

    def forward(self, x):
        h = self.norm(x)
        y = self.fc2(torch.relu(self.fc1(h)))
        r = self.rep(h)
        if isinstance(r, torch.Tensor) and hasattr(r, "device_mesh"):
            self.part(r.detach())
        return y, r


def make_model():
    torch.manual_seed(0)
    m = Block().double()
    with torch.no_grad():  # LayerNorm's affine parameters away from their 1 / 0 init
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.5, 0.5)
    return m


def rank_input(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, SEQ, 8, generator=g, dtype=torch.float64)


def worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        m = make_model()
        mesh = init_device_mesh("cpu", (WORLD,))
        parallelize_module(m, mesh, {
            "norm": SequenceParallel(),  # output: a DTensor Shard(1)
            "fc1": ColwiseParallel(input_layouts=Shard(1)),  # input Replicate DTensor, output local
            "fc2": RowwiseParallel(output_layouts=Shard(1)),  # input Shard(-1) DTensor, out local
            "rep": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                   use_local_output=False),  # output: a DTensor Replicate
        })
        sink = Dump()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hookplug.attach(m, "LayerNorm|Linear|ToPartial",
                                 plugins=("stats", {"sites": SITES}), sink=sink) as s:
                for step in range(2):
                    y, r = m(rank_input(rank) * (step + 1))
                    assert type(r).__name__ == "DTensor"
                    # the global loss y.sum() + r.sum(): y's shards, r (Replicate) once
                    (y.sum() + r.to_local().sum()).backward()
                    s.step()
                s.flush()
        partial = [str(w.message) for w in caught if "Partial" in str(w.message)]
        with open(os.path.join(out, f"r{rank}.json"), "w") as f:
            json.dump({"records": sink.records, "partial": partial,
                       "disabled": dict(s.disabled)}, f)
    finally:
        leave()  # not destroy_process_group(): see _gloo.leave


def reference():
    """Per step, ``{(module, site): float64 tensor}`` of the unsharded model on the whole
    input (the ranks' inputs concatenated along the sharded sequence dimension)."""
    m = make_model()
    out = []
    for step in range(2):
        seen = {}

        def keep(name):
            def pre(mod, args):
                seen[(name, "input[0]")] = args[0].detach().clone()

            def post(mod, args, o):
                seen[(name, "output")] = o.detach().clone()
                o.register_hook(lambda g: seen.__setitem__((name, "grad"), g.detach().clone()))

            return pre, post

        hs = []
        for name in ("norm", "fc1", "fc2", "rep"):
            pre, post = keep(name)
            mod = getattr(m, name)
            hs += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        x = torch.cat([rank_input(r) for r in range(WORLD)], dim=1) * (step + 1)
        y, r = m(x)
        (y.sum() + r.sum()).backward()
        for h in hs:
            h.remove()
        out.append(seen)
    return out


def stats_of(t):
    t = t.double().reshape(-1)
    return {"numel": t.numel(), "min": float(t.min()), "max": float(t.max()),
            "mean": float(t.mean()), "std": float(t.std(correction=0)),
            "l2": float(torch.linalg.vector_norm(t))}


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_dtensor_activations_merge_to_the_whole_tensor(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    want = reference()
    keys = {(step, mod, site) for step in range(2) for (mod, site) in want[step]}
    for rank in range(WORLD):
        got = json.load(open(tmp_path / f"r{rank}.json"))
        assert got["disabled"] == {}
        assert len(got["partial"]) == 1, got["partial"]  # one warning, the Partial output
        recs = {(r["step"], r["module"], r["site"]): r for r in got["records"]}
        # part: its Replicate input (once); its Partial output skipped, no grad
        assert set(recs) == keys | {(step, "part", "input[0]") for step in range(2)}, \
            set(recs) ^ keys
        for step in range(2):
            for (mod, site), t in list(want[step].items()) + [(("part", "input[0]"),
                                                               want[step][("rep", "output")])]:
                r, w = recs[(step, mod, site)], stats_of(t)
                assert r["numel"] == w["numel"], (rank, step, mod, site, r["numel"], w["numel"])
                assert r["calls"] == (1 if (mod, site) in REPLICATED else WORLD), \
                    (rank, step, mod, site, r["calls"])
                for k in ("min", "max", "std", "l2"):
                    assert math.isclose(r[k], w[k], rel_tol=1e-9, abs_tol=1e-12), \
                        (rank, step, mod, site, k, r[k], w[k])
                assert abs(r["mean"] - w["mean"]) <= 1e-9 * w["std"] + 1e-15, \
                    (rank, step, mod, site, r["mean"], w["mean"])


def _replicate_after_a_key_of_one_rank(rank, world, first):
    """Rank ``first`` runs a plain module in eval mode alone (a key the other rank has not
    got), then both run ``rep``, whose output is a ``Replicate()`` DTensor, in eval mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = nn.ModuleDict({"rep": nn.Linear(4, 4), "extra": nn.Linear(4, 4)}).double()
    parallelize_module(m, init_device_mesh("cpu", (world,)),
                       {"rep": ColwiseParallel(output_layouts=Replicate(), use_local_output=False)})
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sink = Dump()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink) as s:
        m.eval()
        with torch.no_grad():
            if rank == first:
                m["extra"](x)
            m["rep"](x)
        s.step()
    return {"recs": sorted([r["module"], r["numel"], r["calls"]] for r in sink.records)}


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("first", [0, 1])
def test_a_replicate_output_is_counted_once_when_the_ranks_met_other_keys_first(tmp_path, first):
    """A ``Replicate()`` DTensor is counted on one rank, picked per key. The pick was the
    key's bank row, which differs between ranks once one met a key the other did not (a
    module run on one rank only): ``rep``'s eval output was counted on both ranks (numel
    24 for its 12 elements) or on none (no record at all)."""
    for got in spawn(_replicate_after_a_key_of_one_rank, tmp_path, first):
        assert got["recs"] == [["extra", 12, 1], ["rep", 12, 1]]


def _capture_a_dtensor_output(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(8))
    parallelize_module(m, init_device_mesh("cpu", (world,)), {"0": SequenceParallel()})
    with hookplug.attach(m, "LayerNorm", plugins="capture") as s:
        m(torch.randn(2, 4, 8))
    cap = s["capture"]
    feature = cap.features["0"]
    path = os.path.join(out, f"c{rank}.safetensors")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cap.save(path)
    loaded = hookplug.load_capture(path)
    return {"local_bytes": feature.to_local().numel() * feature.element_size(), "nbytes": cap.nbytes,
            "warnings": [str(w.message) for w in caught], "loaded": repr(loaded.get("0"))}


def test_a_dtensor_capture_counts_its_shard_and_is_left_out_of_the_file(tmp_path):
    """A SequenceParallel LayerNorm's output is a DTensor (``use_local_output=False``):
    ``nbytes`` counted its global size (``max_bytes`` too), and ``save()`` raised "invalid
    python storage". Its shard is counted; the file leaves it out, with a warning."""
    for got in spawn(_capture_a_dtensor_output, tmp_path, str(tmp_path)):
        assert got["nbytes"] == got["local_bytes"] == 2 * 4 * 8 * 4  # (global: twice)
        assert got["loaded"] == "None"
        assert any("DTensor" in w for w in got["warnings"]), got["warnings"]


def _gradclamp_on_tp_gradients(rank, world, opts):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    parallelize_module(m, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    want = {}
    for name, p in m.named_parameters():
        def before(g, name=name):  # registered first: the gradient before the clamp, this rank's part
            local = g.to_local()
            if rank == 1 and name == "0.weight" and opts["nan"] == "raise":
                local[0, 0] = math.nan  # (in rank 1's shard only)
            want[name] = int(((local < opts["min"]) | (local > opts["max"])).sum())
        p.register_hook(before)
    with hookplug.attach(m, "Linear", plugins=("gradclamp", {**opts, "params": "*", "outputs": False})) as s:
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 5
        try:
            m(x).square().sum().backward()
            raised = None
        except FloatingPointError as exc:
            raised = str(exc)
        got = {k: v["changed"] for k, v in s.results()["gradclamp"].items()}
    return {"got": got, "want": want, "raised": raised}


@pytest.mark.parametrize("nan", ["keep", "raise"])
def test_gradclamp_on_tensor_parallel_gradients_counts_this_ranks_shard(tmp_path, nan):
    """A DTensor gradient's ``changed`` was a Partial sum: ``int()`` read this rank's part of
    a sharded parameter and the whole count of a replicated one; ``nan="raise"`` ran a
    collective on torch 2.14 (both ranks raised) and none on 2.13. Now both are this
    rank's shard's, on every torch."""
    opts = {"min": -0.5, "max": 0.5, "nan": nan}
    got = spawn(_gradclamp_on_tp_gradients, tmp_path, opts)
    if nan == "raise":
        assert got[0]["raised"] is None and "NaN in the gradient" in got[1]["raised"], got
        return
    for r in got:
        assert r["got"] == r["want"] and sum(r["want"].values()) > 0, r
    assert got[0]["want"] != got[1]["want"]  # (the shards differ: counted per rank)
