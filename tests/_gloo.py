"""What the spawned gloo tests share (two CPU processes on 127.0.0.1): a free port, the way
a rank leaves, and a sink that keeps every record on every rank."""
import os
import socket

import torch.distributed as dist

import hookplug


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave() -> None:
    """End a spawned rank once its results are written: meet the other rank, then exit
    without tearing gloo down (the teardown aborted a run now and then: "terminate called
    without an active exception", SIGABRT after the results were written)."""
    try:
        dist.barrier()
    finally:
        os._exit(0)


class Dump:
    """A sink keeping every record it gets, on every rank."""

    name = "dump"
    all_ranks = True

    def __init__(self):
        self.records = []

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        self.records.extend(records)


def _run_rank(rank, world, port, out, fn, args):
    """One spawned rank: join the group, ``fn(rank, world, *args)`` (a dict, picklable to
    JSON), its error caught and reported, the result written, then leave."""
    import datetime
    import json
    import traceback

    import torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    result = {}
    try:
        result = fn(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
    finally:
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(result, f)
        leave()


def spawn(fn, tmp_path, *args, world: int = 2) -> list:
    """Run the module-level ``fn(rank, world, *args)`` on ``world`` gloo ranks; their
    results, each checked for an error."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_run_rank, args=(world, free_port(), str(tmp_path), fn, args), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for r, got in enumerate(results):
        assert "error" not in got, (r, got.get("error"), got.get("tb"))
    return results


def init(rank: int, world: int, port: int) -> None:
    """Join the gloo group (for a rank :func:`spawn_bare` runs, when it chooses)."""
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def _run_bare(rank, world, port, out, fn, args):
    import json
    import traceback

    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, world, port, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def spawn_bare(fn, tmp_path, *args, world: int = 2) -> list:
    """:func:`spawn` where ``fn(rank, world, port, *args)`` joins the group itself (with
    :func:`init`, before or after attaching) and may destroy it; each rank exits when its
    result is written."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_run_bare, args=(world, free_port(), str(tmp_path), fn, args), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for r, got in enumerate(results):
        assert "error" not in got, (r, got.get("error"), got.get("tb"))
    return results
