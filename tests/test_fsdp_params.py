"""Parameters FSDP shards (gloo on 127.0.0.1, two ranks).

- FSDP2 (``fully_shard``) writes the reduce-scattered gradient into the sharded parameter's
  ``.grad`` without running its tensor hooks, so a ``hookplug_param_grad`` plugin would
  silently do nothing there; the session says so with one warning, whether it attaches
  before or after ``fully_shard``.
- FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) gives each rank a flat piece of
  every parameter: ``params`` warns when ``plain_tensors`` is left unset, and with
  ``plain_tensors="distinct"`` its records equal the unsharded parameters'."""
import datetime
import json
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookplug

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard", allow_module_level=True)



def _leave() -> None:
    """End a spawned rank: meet the other rank, then exit without tearing gloo down (the
    teardown aborted a run now and then: "terminate called without an active exception",
    SIGABRT after the results were written)."""
    try:
        dist.barrier()
    finally:
        os._exit(0)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out, when):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    result = {}
    try:
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
        result["warnings"] = [str(w.message) for w in caught if "FSDP2" in str(w.message)]
    except BaseException as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(result, f)
        _leave()  # not destroy_process_group(): see _leave


def _fsdp1_worker(rank, world, port, out, plain):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    result = {}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8)).double()
        wrapped = fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                                use_orig_params=True)
        opts = {"sites": ("weight",)} if plain is None else {"sites": ("weight",), "plain_tensors": plain}
        kept = []

        class Keep:
            name, all_ranks = "keep", True

            @hookplug.hookimpl
            def hookplug_flush(self, records):
                kept.extend(records)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hookplug.attach(wrapped, "Linear", plugins=("params", opts), sink=Keep()) as s:
                s.step()
        result["warnings"] = [str(w.message) for w in caught if "FSDP1" in str(w.message)]
        result["records"] = {r["module"]: [r["numel"], r["l2"], r["min"], r["max"]] for r in kept}
    except BaseException as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(result, f)
        _leave()  # not destroy_process_group(): see _leave


@pytest.mark.parametrize("plain", [None, "distinct"])
def test_params_under_fsdp1_flat_shards(tmp_path, plain):
    mp.spawn(_fsdp1_worker, args=(2, _free_port(), str(tmp_path), plain), nprocs=2, join=True)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "error" not in got, got
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
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), when), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "error" not in got, got
        assert len(got["warnings"]) == 1, got
        assert "parameter '0.weight'" in got["warnings"][0]  # the first hooked one
