"""Pipeline-parallel training (``torch.distributed.pipelining``: ``PipelineStage`` with
``ScheduleGPipe`` and ``Schedule1F1B``, micro-batches) on gloo ranks, each holding one stage
of a small MLP built as torchtitan builds it (the other stage's layers deleted from the full
model, so names stay the full model's, ``layers.3.fc``), hookplug attached to each rank's
stage with the same selector. Every reference is computed here: the full model in one
process on the same micro-batches, the run without hookplug, a plain torch clamp hook,
``FlopCounterMode``."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hookplug

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(),
                                                   reason="torch.distributed is not available")]

D = 8
LAYERS = 4
NMB = 2  # micro-batches per step
ROWS = 2  # rows per micro-batch
STEPS = 2
LO = -2e-3  # a lower bound only: a symmetric one keeps the upstream stage's gradients within it
FIELDS = ("numel", "calls", "nan_count", "inf_count", "min", "max", "mean", "std", "l2")
STATS = ("stats", {"sites": ("output", "grad")})


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(x)


def _full():
    torch.manual_seed(0)
    return Net()


def _stage(index):
    """Stage ``index`` of two, torchtitan's way: the full model less the other stage's layers."""
    m = _full()
    for i in range(LAYERS):
        if (i < LAYERS // 2) != (index == 0):
            del m.layers[str(i)]
    if index == 0:
        m.head = None
    return m


def _batches(replica=0, steps=STEPS):
    g = torch.Generator().manual_seed(7 + replica)
    return [(torch.randn(NMB * ROWS, D, generator=g), torch.randn(NMB * ROWS, 3, generator=g))
            for _ in range(steps)]


def _loss(out, y):
    return (out - y).square().mean()


def _rec(r):
    return {k: r[k] for k in ("step", "module", "site", "phase", *FIELDS)}


def _clamp_by_hand(model):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(
                # (torch 2.11's PipelineStage infers shapes by a forward under no_grad)
                lambda m, a, o: (o.register_hook(lambda g: g.clamp(min=LO)) and None)
                if o.requires_grad else None)


def _full_tensor(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _pp(rank, world, cfg):
    """Runs of ``STEPS`` SGD steps of this rank's stage under ``cfg["schedule"]``: without
    hookplug (``cfg["manual"]``: a bare run, then one with a plain torch clamp), then with
    ``cfg["plugins"]`` on the Linears. With 4 ranks, 2 stages x 2 data-parallel replicas:
    DDP per stage over its replica group, or ``cfg["fsdp"]`` FSDP2 over the "dp" dimension
    of a (dp, pp) mesh (hookplug attached to the stage module before wrapping)."""
    from _gloo import Dump
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages = 2
    index, replica = rank % stages, rank // stages
    pp_group, dp_group, mesh = None, None, None
    if cfg.get("fsdp"):  # rank = replica * stages + stage
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // stages, stages), mesh_dim_names=("dp", "pp"))
        pp_group = mesh["pp"].get_group()
    elif world > stages:  # every rank makes every group, in the same order
        for rep in range(world // stages):
            g = dist.new_group([rep * stages + i for i in range(stages)])
            if rep == replica:
                pp_group = g
        for i in range(stages):
            g = dist.new_group([rep * stages + i for rep in range(world // stages)])
            if i == index:
                dp_group = g
    out = {}
    runs = ("bare", "plain") if cfg.get("manual") else ("plain",) if cfg.get("plain", True) else ()
    for run in runs + ("hooked",):
        m = _stage(index)
        sink, s = Dump(), None
        if run == "hooked":
            s = hookplug.attach(m, "Linear", plugins=cfg["plugins"], sink=sink)
        elif run == "plain" and cfg.get("manual"):
            _clamp_by_hand(m)
        module = m
        if dp_group is not None:
            module = nn.parallel.DistributedDataParallel(m, process_group=dp_group)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(m, mesh=mesh["dp"])
        kw = {}
        if cfg.get("static"):  # shapes given: no metadata inference
            kw = {"input_args": (torch.zeros(ROWS, D, requires_grad=index > 0),),
                  "output_args": (torch.zeros(ROWS, D if index == 0 else 3, requires_grad=True),)}
        stage = PipelineStage(module, index, stages, torch.device("cpu"), group=pp_group, **kw)
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg["schedule"]](
            stage, NMB, loss_fn=_loss)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        grads = []
        for x, y in _batches(replica):
            if index == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            grads.append({n: _full_tensor(p.grad).norm().item() for n, p in m.named_parameters()})
            opt.step()
            if s is not None:
                s.step()
            opt.zero_grad()
        out[run] = {n: _full_tensor(p.detach()).tolist() for n, p in m.named_parameters()}
        if s is not None:
            res = s.results()
            s.remove()
            out["records"] = [_rec(r) for r in sink.records]
            out["grads"] = grads
            if "flops" in res:
                out["flops"] = {k: [v["flops"], v["backward_flops"]]
                                for k, v in res["flops"].items()}
            if "capture" in res:
                out["capture"] = {k: [t.tolist() for t in v]
                                  for k, v in s["capture"].features.items()}
            if "gradclamp" in res:
                out["changed"] = sum(v["changed"] for v in res["gradclamp"].values())
    return out


def _reference(plugins, replicas=1):
    """The full model in this process on the same micro-batches (each replica's in turn, the
    gradient averaged over micro-batches and replicas as the schedule and DDP do), with
    ``plugins``: records, captures, and FlopCounterMode's forward and backward per module."""
    from _gloo import Dump
    from torch.utils.flop_counter import FlopCounterMode

    m = _full()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    sink = Dump()
    data = [_batches(r) for r in range(replicas)]
    fwd, total = {}, {}
    with hookplug.attach(m, "Linear", plugins=plugins, sink=sink) as s:
        for step in range(STEPS):
            for r in range(replicas):
                x, y = data[r][step]
                for xm, ym in zip(x.chunk(NMB), y.chunk(NMB)):
                    with FlopCounterMode(display=False) as fc_all:
                        with FlopCounterMode(display=False) as fc_fwd:
                            out = m(xm)
                        _loss(out, ym).backward()
                    for counts, got in ((fwd, fc_fwd), (total, fc_all)):
                        for k, v in got.get_flop_counts().items():
                            if k.startswith("Net."):
                                counts[k[4:]] = counts.get(k[4:], 0) + sum(v.values())
            for p in m.parameters():
                p.grad /= NMB * replicas
            opt.step()
            s.step()
            opt.zero_grad()
        capture = ({k: [t.tolist() for t in v] for k, v in s["capture"].features.items()}
                   if "capture" in s else None)
    flops = {k: [fwd[k], total[k] - fwd[k]] for k in fwd}
    trained = {n: p.detach() for n, p in m.named_parameters()}
    return [_rec(r) for r in sink.records], capture, flops, trained


def _by_key(records):
    out = {}
    for r in records:
        key = (r["step"], r["module"], r["site"])
        assert key not in out, key  # one record per step, module and site
        out[key] = r
    return out


def _assert_records_equal(got, want, sharded=False):
    """Equal records; ``sharded``: a parameter's ``calls`` is its shards' (FSDP2: one per rank
    of its replica's mesh holding a piece), not checked."""
    got, want = _by_key(got), _by_key(want)
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        for f in FIELDS:
            if sharded and f == "calls" and key[2] in ("weight", "grad", "update"):
                continue
            assert math.isclose(g[f], w[f], rel_tol=1e-5, abs_tol=1e-7), (key, f, g[f], w[f])


@pytest.mark.parametrize("schedule, static", [("gpipe", False), ("1f1b", False), ("gpipe", True)],
                         ids=["gpipe", "1f1b", "gpipe-static"])
def test_pipeline_stages_give_the_full_models_records(tmp_path, schedule, static):
    """stats (output and grad sites), params, flops and capture on each rank's stage: training
    unchanged; the merged records of both stages (full-model names) equal the full model's
    in one process (every micro-batch's call counted once; the metadata-inference forward
    and backward a PipelineStage given no shapes runs first, on uninitialized inputs, is no
    call); each stage's parameters counted once, their grad l2 torch's norm of the
    accumulated gradient; flops per module FlopCounterMode's; capture one entry per call."""
    from _gloo import spawn

    plugins = [STATS, "params", "flops", ("capture", {"keep": "all"})]
    got = spawn(_pp, tmp_path, {"schedule": schedule, "static": static, "plugins": plugins})
    want, capture, flops, _ = _reference(plugins)
    assert got[0]["records"] == got[1]["records"]  # every rank gets the merged records
    _assert_records_equal(got[0]["records"], want)
    for r, g in enumerate(got):
        assert g["hooked"] == g["plain"], r  # training unchanged, bitwise
        names = set(g["plain"])
        for step, grads in enumerate(g["grads"]):
            for name, l2 in grads.items():
                rec = [x["l2"] for x in g["records"]
                       if (x["step"], x["module"], x["site"]) == (step, name, "grad")]
                assert len(rec) == 1 and math.isclose(rec[0], l2, rel_tol=1e-6), (r, step, name)
        mods = {n.rsplit(".", 1)[0] for n in names}
        assert set(g["flops"]) == mods == set(g["capture"]), r
        for k, v in g["flops"].items():
            assert v == flops[k], (r, k)
        for k, v in g["capture"].items():
            assert v == capture[k], (r, k)  # one entry per micro-batch call, in order


def test_gradclamp_steers_the_schedule_backward_as_a_torch_clamp(tmp_path):
    """gradclamp on the Linears' outputs under Schedule1F1B (stage backward per micro-batch,
    a stage given no shapes: metadata inference first) trains as a plain torch clamp hook."""
    from _gloo import spawn

    got = spawn(_pp, tmp_path, {"schedule": "1f1b", "manual": True,
                                "plugins": [("gradclamp", {"min": LO})]})
    for r, g in enumerate(got):
        assert g["hooked"] == g["plain"], r
        assert g["changed"] > 0 and g["plain"] != g["bare"], r  # the clamp did bite


@pytest.mark.parametrize("dp", ["ddp", "fsdp2"])
def test_two_stages_by_two_data_parallel_replicas(tmp_path, dp):
    """4 ranks: 2 stages x 2 replicas, DDP per stage over its replica group or FSDP2 over the
    "dp" dimension of a (dp, pp) mesh, hookplug attached to the stage module before wrapping:
    the parameters and records of the full model trained on both replicas' data (each
    parameter counted once, by one replica of its stage). The DDP stages are given their
    shapes: with metadata inference DDP's reducer fails, hookplug or not (torch's "rebuilt
    parameter indices size is not same as original model parameters size")."""
    from _gloo import spawn

    plugins = [STATS, "params"]
    got = spawn(_pp, tmp_path, {"schedule": "gpipe", "static": dp == "ddp", "plain": False,
                                "fsdp": dp == "fsdp2", "plugins": plugins}, world=4)
    want, _, _, trained = _reference(plugins, replicas=2)
    for r, g in enumerate(got):
        for name, p in g["hooked"].items():  # trained as the full model
            assert torch.allclose(torch.tensor(p), trained[name], rtol=1e-5, atol=1e-7), (r, name)
        assert g["records"] == got[0]["records"], r
    _assert_records_equal(got[0]["records"], want, sharded=dp == "fsdp2")
