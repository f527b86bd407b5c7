"""Parameters FSDP shards (gloo on 127.0.0.1, two ranks).

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
        for layer in (model[0], model[2]):
            fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if when == "before":
            session = hookplug.attach(model, "Linear", plugins=("gradclamp", opts))
            shard()
        else:
            shard()
            session = hookplug.attach(model, "Linear", plugins=("gradclamp", opts))
        for _ in range(2):
            model(torch.randn(4, 6) + rank).sum().backward()
            session.step()
        session.remove()
    return {"warnings": [str(w.message) for w in caught if "FSDP2" in str(w.message)]}


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


@pytest.mark.parametrize("when", ["before", "after"])
def test_param_grad_hooks_under_fsdp2_warn_once(tmp_path, when):
    for got in spawn(_fsdp2_gradclamp, tmp_path, when):
        assert len(got["warnings"]) == 1, got
        assert "parameter '0.weight'" in got["warnings"][0]  # the first hooked one
