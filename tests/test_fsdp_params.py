"""Parameters FSDP shards, and FSDP2 with regional compilation (gloo on 127.0.0.1, two ranks).

- FSDP2 (``fully_shard``) writes the reduce-scattered gradient into the sharded parameter's
  ``.grad`` without running its tensor hooks, so a ``hookplug_param_grad`` plugin would
  silently do nothing there; the session says so with one warning, whether it attaches
  before or after ``fully_shard``.
- FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) gives each rank a flat piece of
  every parameter: ``params`` warns when ``plain_tensors`` is left unset, and with
  ``plain_tensors="distinct"`` its records equal the unsharded parameters'."""
import warnings

import pytest
import torch
import torch.nn as nn

import hookplug
from _gloo import Dump, spawn
from hookplug._bank import is_dtensor
from test_telemetry import _Block  # the identical block of the regional-compilation tests

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard", allow_module_level=True)


def _fsdp2_gradclamp(rank, world, when):
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
    opts = {"min": 0.0, "max": 0.0, "params": "*bias", "outputs": False}

    def shard():
        mesh = init_device_mesh("cpu", (world,))
        # "after_forward": model[2]'s parameters are the root group's, which FSDP2 leaves
        # unsharded (plain Parameters) after a forward, until the backward
        for layer in (model[0], model[2]) if when not in ("after_forward", "ignored") else (model[0],):
            fsdp.fully_shard(layer, mesh=mesh)
        # "ignored": a parameter FSDP2 leaves alone is a plain one, steered as without FSDP2
        fsdp.fully_shard(model, mesh=mesh, **({"ignored_params": {model[2].bias}} if when == "ignored" else {}))

    zeroed = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if when == "before":
            session = hookplug.attach(model, "Linear", plugins=("gradclamp", opts))
            shard()
        else:
            shard()
            if when == "after_forward":
                with torch.no_grad():
                    model(torch.randn(2, 6))
                assert not is_dtensor(model[2].bias)
            session = hookplug.attach(model, "Linear", plugins=("gradclamp", opts))
        for _ in range(2):
            model(torch.randn(4, 6) + rank).sum().backward()
            local = {n: p.grad.to_local() if is_dtensor(p.grad) else p.grad for n, p in model.named_parameters()}
            zeroed.append([n for n, g in local.items() if g.numel() and not g.any()])  # (shards may be empty)
            model.zero_grad()
            session.step()
        changed = session.results()["gradclamp"]
        session.remove()
    return {"warnings": [str(w.message) for w in caught if "FSDP2" in str(w.message)],
            "zeroed": zeroed, "changed": changed}


def _fsdp1_params(rank, world, plain):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    wrapped = fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                            use_orig_params=True)
    opts = {"sites": ("weight",)} if plain is None else {"sites": ("weight",), "plain_tensors": plain}
    sink = Dump()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookplug.attach(wrapped, "Linear", plugins=("params", opts), sink=sink) as s:
            s.step()
    return {"warnings": [str(w.message) for w in caught if "FSDP1" in str(w.message)],
            "records": {r["module"]: [r["numel"], r["l2"], r["min"], r["max"]] for r in sink.records}}


@pytest.mark.parametrize("plain", [None, "distinct"])
def test_params_under_fsdp1_flat_shards(tmp_path, plain):
    results = spawn(_fsdp1_params, tmp_path, plain)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    for got in results:
        assert len(got["warnings"]) == (1 if plain is None else 0), got["warnings"]
        if plain is None:
            continue
        assert sorted(got["records"]) == sorted(n for n, _ in ref.named_parameters())
        for name, p in ref.named_parameters():
            numel, l2, lo, hi = got["records"][name]
            assert numel == p.numel() and lo == float(p.min()) and hi == float(p.max())
            assert abs(l2 - float(p.detach().norm())) <= 1e-12 * max(1.0, l2)


@pytest.mark.parametrize("when", ["before", "after", "after_forward", "ignored"])
def test_param_grad_hooks_under_fsdp2_warn_once(tmp_path, when):
    """Whenever attached, FSDP2's parameters are never steered (attached after a forward the
    root group's unsharded copies were, for one step) and the session warns once; one in
    ``ignored_params`` is steered."""
    for got in spawn(_fsdp2_gradclamp, tmp_path, when):
        assert len(got["warnings"]) == 1, got
        assert "parameter '0.weight'" in got["warnings"][0]  # the first hooked one
        if when == "ignored":
            assert got["zeroed"] == [["2.bias"], ["2.bias"]] and list(got["changed"]) == ["2.bias"], got
        else:
            assert got["zeroed"] == [[], []] and got["changed"] == {}, got


def _fsdp1_gradclamp(rank, world, when):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
    opts = {"min": 0.0, "max": 0.0, "params": "*", "outputs": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if when == "before":
            session = hookplug.attach(model, "Linear", plugins=("gradclamp", opts))
        wrapped = fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        if when == "after":
            session = hookplug.attach(wrapped, "Linear", plugins=("gradclamp", opts))
        for _ in range(2):
            wrapped(torch.randn(4, 6) + rank).sum().backward()
            wrapped.zero_grad()
            session.step()
        changed = session.results()["gradclamp"]
        session.remove()
    return {"warnings": [str(w.message) for w in caught if "gets no gradient hook" in str(w.message)],
            "changed": changed}


@pytest.mark.parametrize("when", ["before", "after"])
def test_param_grad_hooks_under_fsdp1_warn_once(tmp_path, when):
    """FSDP1 (``use_orig_params=True``) runs no hook of its original parameters either (it
    computes the flat parameter's gradient): gradclamp ``params=`` did nothing, silently."""
    for got in spawn(_fsdp1_gradclamp, tmp_path, when):
        assert got["changed"] == {}, got
        assert len(got["warnings"]) == 1 and "FSDP1" in got["warnings"][0], got


def _fsdp2_regional(rank, world, variant):
    """torchtitan's layout: each block ``fully_shard``ed, then compiled on its own, the root
    sharded; stats on every Linear (outputs and gradients) or none; two training steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch._dynamo.backends.registry import lookup_backend

    torch.manual_seed(0)
    model = nn.Sequential(*(_Block() for _ in range(4)))
    mesh = init_device_mesh("cpu", (world,))
    if variant != "eager":
        for block in model:
            fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    frames, aot_eager = [0], lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        frames[0] += 1
        return aot_eager(gm, example_inputs)

    sink = Dump()
    session = None if variant == "no hooks" else hookplug.attach(
        model, "Linear", plugins=("stats", {"sites": ("output", "grad")}), sink=sink, flush_every=1)
    if variant != "eager":
        for block in model:
            block.compile(backend=counting)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
        if session is not None:
            session.step()
    if session is not None:
        session.remove()
    return {"frames": frames[0],
            "records": {f"{r['step']} {r['module']} {r['site']}": [r["numel"], r["min"], r["max"], r["mean"]]
                        for r in sink.records}}


def test_fsdp2_blocks_compiled_one_by_one_share_graphs_with_stats(tmp_path):
    """FSDP2 per block + ``block.compile()`` per block (torchtitan's recipe) with stats on
    outputs and gradients: as many graphs as without hooks, and the records (merged over the
    ranks) equal an eager FSDP2 run's."""
    runs = {}
    for variant in ("no hooks", "eager", "compiled"):
        (tmp_path / variant).mkdir()
        runs[variant] = spawn(_fsdp2_regional, tmp_path / variant, variant)
    plain, eager, compiled = runs["no hooks"], runs["eager"], runs["compiled"]
    assert [g["frames"] for g in compiled] == [g["frames"] for g in plain]
    e, c = eager[0]["records"], compiled[0]["records"]
    assert set(e) == set(c) and len(e) == 2 * 8 * 2  # steps x Linears x (output, grad)
    for k in e:
        assert e[k][:3] == c[k][:3], k
        assert abs(e[k][3] - c[k][3]) <= 1e-6 * max(1.0, abs(e[k][3])), k
