"""Distributed flushes are collective-safe: two gloo ranks (CPU processes) whose local state
differs (a plugin disabled on one rank, a sink on rank 0 only, an eval forward or a module
called on one rank only) still flush together, never hang, and reduce by the union of their
keys: a record is the exact statistics of every rank's data for its key, on every rank.

Collectives get a short timeout (a regression fails instead of hanging); each worker writes
what it saw to a JSON file that the test then checks."""
import datetime
import json
import math
import os
import textwrap
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookplug
from _gloo import Dump, free_port, leave

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=60)  # a rank left alone in a collective fails in 60 s (not a hang)


def _worker(rank, fn_name, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=TIMEOUT)
    res = {}
    try:
        torch.set_num_threads(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = globals()[fn_name](rank, out)
        res["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("hookplug")]
        # torch 2.13+ deprecates all_gather_into_tensor (a FutureWarning at every flush: an
        # error under -W error)
        res["deprecated"] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)
                             and "all_gather" in str(w.message)]
        dist.barrier()  # every rank left its session: none is stuck in a collective
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        res = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
    finally:
        with open(os.path.join(out, f"res{rank}.json"), "w") as f:
            json.dump(res, f)
        leave()  # not destroy_process_group(): see _gloo.leave


def spawn(fn_name, tmp_path):
    mp.spawn(_worker, args=(fn_name, free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    res = [json.load(open(tmp_path / f"res{r}.json")) for r in range(WORLD)]
    for r, got in enumerate(res):
        assert "error" not in got, (r, got.get("error"), got.get("tb"))
        assert not got.get("deprecated"), got["deprecated"]
    return res


class Net(nn.Module):
    """fc1 -> fc2 always; ``extra`` only when asked (an early exit, an expert)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.extra = nn.Linear(6, 5), nn.Linear(5, 3), nn.Linear(3, 3)

    def forward(self, x, extra=False):
        y = self.fc2(torch.relu(self.fc1(x)))
        return self.extra(y) if extra else y


def watch(model, state):
    """Every Linear output, seen by plain torch hooks: ``{"step|module|phase": [values]}``."""
    seen = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(
                f"{state['step']}|{name}|{'train' if m.training else 'eval'}", []).extend(
                o.detach().double().reshape(-1).tolist()))
    return seen


def ref_stats(values):
    """Counts over all values, extremes and moments over the finite ones (as the op)."""
    x = torch.tensor(values, dtype=torch.float64)
    fin = x[torch.isfinite(x)]
    return {"numel": x.numel(), "min": float(fin.min()), "max": float(fin.max()),
            "mean": float(fin.mean()), "std": float(fin.std(correction=0)), "zero_count": int((x == 0).sum()),
            "nan_count": int(torch.isnan(x).sum())}


def key(rec):
    return f"{rec['step']}|{rec['module']}|{rec['phase']}"


def assert_exact(records, seen_by_rank, ranks=(0, 1)):
    """Each record: the statistics of what the given ranks computed for its key (float64)."""
    for rec in records:
        values = [v for r in ranks for v in seen_by_rank[r].get(key(rec), [])]
        want = ref_stats(values)
        for k in ("numel", "zero_count", "nan_count", "min", "max"):
            assert rec[k] == want[k], (key(rec), k, rec[k], want[k])
        for k in ("mean", "std"):
            assert math.isclose(rec[k], want[k], rel_tol=1e-6, abs_tol=1e-7), (key(rec), k, rec[k], want[k])
        edges = torch.tensor(rec["hist_edges"], dtype=torch.float64)
        x = torch.tensor(values, dtype=torch.float64)
        assert rec["hist"] == torch.histogram(x[~torch.isnan(x)], bins=edges)[0].long().tolist()


def same_on_every_rank(res):
    strip = lambda recs: sorted(({k: v for k, v in r.items() if k not in ("rank", "time", "first_nonfinite")}
                                 for r in recs),
                                key=lambda r: (r["step"], r["module"], r["phase"]))
    assert strip(res[0]["records"]) == strip(res[1]["records"])


def _watched_net(rank):
    """The same ``Net`` on every rank, watched by plain hooks; a sink; this rank's data."""
    torch.manual_seed(0)
    model, state = Net(), {"step": 0}
    return model, state, watch(model, state), Dump(), torch.Generator().manual_seed(100 + rank)


# -- a module or phase on one rank only -------------------------------------------------------------

def one_rank_keys(rank, out):
    """flush_every=2; step 0: an eval forward on rank 0 only; step 1: ``extra`` runs on rank 1
    only; step 2: ``extra`` on rank 0 only, at step 3 (flushed by remove()) on both."""
    model, state, seen, dump, g = _watched_net(rank)
    with hookplug.attach(model, "Linear", plugins="stats", sink=dump, flush_every=2, on_error="warn") as s:
        for step in range(4):
            state["step"] = step
            extra = (step == 1 and rank == 1) or (step == 2 and rank == 0) or step == 3
            model(torch.randn(4, 6, generator=g) * (1 + step + rank), extra=extra).sum().backward()
            if step == 0 and rank == 0:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(2, 6, generator=g) + 50.0)
                model.train()
            s.step()
        run_id = s.run_id
    return {"records": dump.records, "seen": seen, "run_id": run_id, "disabled": s.disabled}


def test_keys_seen_on_one_rank_only_reduce_by_the_union_exactly(tmp_path):
    res = spawn("one_rank_keys", tmp_path)
    seen = [r["seen"] for r in res]
    for r in res:
        assert not r["warnings"] and not r["disabled"], r["warnings"]
        got = {key(rec) for rec in r["records"]}
        assert got == set(seen[0]) | set(seen[1])  # one record per key seen on any rank
        assert len(r["records"]) == len(got)
        assert "0|fc1|eval" in got and "1|extra|train" in got and "2|extra|train" in got
        assert_exact(r["records"], seen)
        # records come out in step order
        steps = [rec["step"] for rec in r["records"]]
        assert steps == sorted(steps)
    same_on_every_rank(res)


def uneven_pending_bound(rank, out):
    """No flush until remove(); a byte bound that keeps 2 ended steps on rank 1 and 1 on
    rank 0, which also runs an eval forward every step (more rows a step)."""
    model, state, seen, dump, g = _watched_net(rank)
    with hookplug.attach(model, "Linear", plugins=[("stats", {"max_pending_bytes": 1}), ("params", {"bins": 0})],
                         sink=dump) as s:
        bank = s["stats"].bank
        for step in range(4):
            state["step"] = step
            model(torch.randn(4, 6, generator=g)).sum().backward()
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(2, 6, generator=g))
                model.train()
            if step == 0:  # both ranks' bound from rank 1's step size: 2 kept there, 1 on rank 0
                used = torch.tensor([len(bank.keys) + 1])
                dist.all_reduce(used, op=dist.ReduceOp.MIN)
                row_bytes = bank.width * 8
                bank.max_pending_bytes = 2 * int(used) * row_bytes + row_bytes // 2
            s.step()
    stats = [r for r in dump.records if "." not in r["module"]]
    params = [r for r in dump.records if "." in r["module"]]
    return {"records": stats, "params": params, "seen": seen}


def test_steps_one_rank_dropped_are_left_out_on_every_rank(tmp_path):
    """A bound on pending telemetry (``max_pending_bytes``) counted from each rank's own rows
    drops more steps on the rank with more rows: the merged record of a step only the other
    rank kept held that rank's data alone (half the calls), with nothing saying so. Every
    rank now leaves out the steps any rank dropped (and says why on the ranks that kept
    them); what remains is exact. Only that producer's rows: ``params``, which dropped
    nothing, keeps every step (the first version cut every producer's)."""
    res = spawn("uneven_pending_bound", tmp_path)
    seen = [r["seen"] for r in res]
    for r in res:
        steps = sorted({rec["step"] for rec in r["records"]})
        assert steps == [3], steps  # rank 0 kept step 3, rank 1 steps 2 and 3 (step 2: rank 1's alone)
        assert {rec["calls"] for rec in r["records"] if rec["phase"] == "train"} == {2}
        assert_exact(r["records"], seen)
    assert any("were not collected by telemetry" in w for w in res[0]["warnings"]), res[0]["warnings"]
    assert any("another rank dropped steps (up to 2)" in w for w in res[1]["warnings"]), res[1]["warnings"]
    for r in res:
        assert sorted({rec["step"] for rec in r["params"]}) == [0, 1, 2, 3], r["params"][:2]
        assert {rec["module"] for rec in r["params"]} == {f"{m}.{p}" for m in ("fc1", "fc2", "extra") for p in ("weight", "bias")}
    same_on_every_rank(res)


# -- a plugin disabled on one rank -------------------------------------------------------------------

def disabled_on_one_rank(rank, out):
    """stats(nonfinite="raise") under on_error="warn": a NaN on rank 1 at step 1 disables stats
    there; rank 0 goes on (no DDP: the NaN stays on rank 1). A second producer (params) stays
    live on both ranks."""
    model, state, seen, dump, g = _watched_net(rank)
    with hookplug.attach(model, "Linear", plugins=[("stats", {"nonfinite": "raise"}), ("params", {"bins": 0})],
                         sink=dump, flush_every=2, on_error="warn") as s:
        for step in range(5):
            state["step"] = step
            x = torch.randn(4, 6, generator=g)
            if rank == 1 and step == 1:
                x[0, 0] = math.nan
            model(x).nan_to_num().sum().backward()
            model.zero_grad()
            s.step()
    return {"records": dump.records, "seen": seen, "disabled": list(s.disabled)}


def test_a_plugin_disabled_on_one_rank_does_not_hang_the_flush(tmp_path):
    res = spawn("disabled_on_one_rank", tmp_path)
    assert res[0]["disabled"] == [] and res[1]["disabled"] == ["stats"]
    seen = [r["seen"] for r in res]
    for r in res:
        outputs = [rec for rec in r["records"] if rec["site"] == "output"]
        # rank 1's stats rows stop with its plugin: the steps it ended before (0, and 1, the
        # NaN's step) are still flushed; from then on the records are rank 0's data, still
        # written, flush after flush
        assert sorted({rec["step"] for rec in outputs}) == [0, 1, 2, 3, 4]
        assert_exact([rec for rec in outputs if rec["step"] < 2], seen, ranks=(0, 1))
        assert_exact([rec for rec in outputs if rec["step"] >= 2], seen, ranks=(0,))
        assert all(rec["nan_count"] > 0 for rec in outputs if rec["step"] == 1)
        weights = [rec for rec in r["records"] if rec["site"] == "weight"]
        assert sorted({rec["step"] for rec in weights}) == [0, 1, 2, 3, 4]
    same_on_every_rank(res)
    assert any("'stats' failed and is disabled" in w for w in res[1]["warnings"])


# -- a sink on rank 0 only, run ids -----------------------------------------------------------------

def sink_on_rank0(rank, out):
    """The usual "log on rank 0" pattern: a jsonl sink on rank 0, none on rank 1, no
    flush_every: remove() runs the final flush on both ranks."""
    torch.manual_seed(0)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)  # extra: unused
    state = {"step": 0}
    seen = watch(model, state)
    g = torch.Generator().manual_seed(100 + rank)
    sink = ("jsonl", {"path": os.path.join(out, "j")}) if rank == 0 else None
    with hookplug.attach(ddp, "Linear", plugins="stats", sink=sink) as s:
        for step in range(3):
            state["step"] = step
            ddp(torch.randn(4, 6, generator=g)).sum().backward()
            s.step()
        sinks = list(s.sinks)
    return {"seen": seen, "sinks": sinks, "run_id": s.run_id}


def test_a_sink_on_rank_0_only_writes_every_step_without_hanging(tmp_path):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    res = spawn("sink_on_rank0", tmp_path)
    assert res[0]["sinks"] == ["jsonl"] and res[1]["sinks"] == []
    records = read_jsonl(str(tmp_path / "j"))
    assert sorted((rec["step"], rec["module"]) for rec in records) == \
        [(step, m) for step in range(3) for m in ("fc1", "fc2")]
    assert_exact(records, [r["seen"] for r in res])  # both ranks' data, though rank 1 has no sink
    assert {rec["run_id"] for rec in records} == {res[0]["run_id"]} and res[0]["run_id"] == res[1]["run_id"]


def shared_file(rank, out):
    """Both ranks append to one jsonl file (all_ranks=True); their process ids differ, the
    run id they write must not. Read after the first flush."""
    torch.manual_seed(0)
    model = Net()
    before = None
    with hookplug.attach(model, "Linear", plugins="stats", flush_every=1,
                         sink=("jsonl", {"path": os.path.join(out, "shared"), "all_ranks": True})) as s:
        before = s.run_id
        for _ in range(2):
            model(torch.randn(4, 6)).sum().backward()
            s.step()
        after_first_flush = s.run_id
    return {"before": before, "after": after_first_flush}


def test_every_rank_takes_rank_0s_run_id(tmp_path):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    res = spawn("shared_file", tmp_path)
    assert res[0]["before"] != res[1]["before"]  # time + pid: different processes
    assert res[0]["after"] == res[1]["after"] == res[0]["before"]
    records = read_jsonl(str(tmp_path / "shared"))
    assert {rec["rank"] for rec in records} == {0, 1}
    assert {rec["run_id"] for rec in records} == {res[0]["before"]}
    assert len(read_jsonl(str(tmp_path / "shared"), run_id=res[0]["before"])) == len(records) == 2 * 2 * 2


# -- ranks that leave alone: an exception, a failed attach, a session on one rank ------------------

def raising_rank(rank, out):
    """Rank 1 raises inside its ``with`` block of a distributed session: it must not wait in
    a collective flush for rank 0, its own rows go to its own sink at once. (Rank 0, whose
    partner is gone, runs a ``distributed=False`` session here.)"""
    import time
    torch.manual_seed(rank)
    model, state = Net(), {"step": 0}
    seen = watch(model, state)
    dump, took = Dump(), None
    started = time.monotonic()
    try:
        with hookplug.attach(model, "Linear", plugins="stats", sink=dump,
                             distributed=(rank == 1)) as s:
            model(torch.randn(4, 6))
            s.step()
            state["step"] = 1
            model(torch.randn(2, 6))
            if rank == 1:
                raise KeyError("a bad batch")
    except KeyError:
        took = time.monotonic() - started
    return {"took": took, "records": dump.records, "seen": seen}


def test_a_rank_that_raises_flushes_alone_without_waiting(tmp_path):
    res = spawn("raising_rank", tmp_path)
    assert res[1]["took"] is not None and res[1]["took"] < 20  # well inside the 60 s timeout
    for r in (0, 1):  # every step's records hold that rank's own statistics only
        assert {key(rec) for rec in res[r]["records"]} == set(res[r]["seen"])
        assert_exact(res[r]["records"], {r: res[r]["seen"]}, ranks=(r,))
        assert {rec["rank"] for rec in res[r]["records"]} == {r}


def caught_nonfinite(rank, out):
    """stats(nonfinite="raise") under on_error="raise": a NaN on rank 1 at step 1 raises there
    at ``step()``; rank 1 catches it and trains on (skipping the bad batch). params, the
    plugin after stats, measures the weights (no optimizer: at ``step()``) every step."""
    torch.manual_seed(0)
    model = Net()
    caught = []
    with hookplug.attach(model, "Linear", plugins=[("stats", {"nonfinite": "raise"}),
                                                   ("params", {"sites": "weight", "bins": 0})],
                         sink=Dump(), flush_every=1) as s:
        for step in range(3):
            x = torch.randn(4, 6)
            if rank == 1 and step == 1:
                x[0, 0] = math.nan
            model(x)
            try:
                s.step()
            except FloatingPointError:
                caught.append(step)
        dump = s["dump"]
    weights = sorted([rec["step"], rec["module"], rec["numel"]] for rec in dump.records
                     if rec["site"] == "weight")
    return {"caught": caught, "weights": weights}


def test_a_rank_that_catches_nonfinite_raise_keeps_every_plugins_steps(tmp_path):
    """The FloatingPointError of stats' ``hookplug_step`` stopped the step there: params
    (after it) did not end its step on rank 1, so that rank's weights of step 1 went into
    step 2 (numel twice the weight's, no step-1 record of them)."""
    res = spawn("caught_nonfinite", tmp_path)
    assert res[0]["caught"] == [] and res[1]["caught"] == [1]
    numel = {f"{m}.{p}": getattr(getattr(Net(), m), p).numel()
             for m in ("fc1", "fc2", "extra") for p in ("weight", "bias")}
    want = sorted([step, name, n] for step in range(3) for name, n in numel.items())
    assert res[0]["weights"] == res[1]["weights"] == want


def peer_dies(rank, world, out, on_error="warn", flush_every=2):
    """Rank 1 raises at step 2 and its process ends (as under torchrun); rank 0 goes on: its
    collective flushes fail, and remove() sends its rows alone (under on_error="raise",
    then raises)."""
    model, state = Net(), {"step": 0}
    seen = watch(model, state)
    dump = Dump()
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with hookplug.attach(model, "Linear", plugins="stats", sink=dump, flush_every=flush_every,
                                 on_error=on_error) as s:
                for step in range(4):
                    state["step"] = step
                    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank)))
                    if rank == 1 and step == 2:
                        raise RuntimeError("rank 1 fails")
                    s.step()
        except RuntimeError as exc:
            if rank == 1:  # gone at once, no collective left behind
                with open(os.path.join(out, f"{rank}.json"), "w") as f:
                    json.dump({"records": dump.records, "seen": seen}, f)
                os._exit(0)
            raised = str(exc)  # rank 0 under "raise": remove()'s final flush failed
    return {"records": dump.records, "seen": seen, "raised": raised,
            "warnings": [str(w.message) for w in caught if "hookplug" in str(w.message)]}


def peer_dies_no_flush_every(rank, world, out):
    return peer_dies(rank, world, out, on_error="raise", flush_every=None)


def test_under_raise_a_rank_whose_peer_died_sends_its_steps_before_raising(tmp_path):
    """No flush_every: remove()'s final flush is the first, and fails (the peer is gone).
    Under on_error="raise" it raised before this rank's rows went out: every step was lost.
    They go to its sink alone, then the error is raised, saying so."""
    from _gloo import spawn as spawn_fn

    res = spawn_fn(peer_dies_no_flush_every, tmp_path, str(tmp_path))
    recs = res[0]["records"]
    assert sorted({rec["step"] for rec in recs}) == [0, 1, 2, 3]
    assert len({(rec["step"], rec["module"]) for rec in recs}) == len(recs)
    assert_exact(recs, [res[0]["seen"], res[1]["seen"]], ranks=(0,))  # its own
    assert "distributed flush failed" in res[0]["raised"] and "go out unmerged" in res[0]["raised"]


def test_under_warn_a_rank_whose_peer_died_still_sends_its_last_steps(tmp_path):
    """The final collective flush of remove() fails too (the peer is gone): this rank's
    rows, those a failed flush kept included, go to its sink alone. Before, they were
    dropped at the second failure and never sent."""
    from _gloo import spawn as spawn_fn

    res = spawn_fn(peer_dies, tmp_path, str(tmp_path))
    recs = res[0]["records"]
    assert sorted({rec["step"] for rec in recs}) == [0, 1, 2, 3]
    assert len({(rec["step"], rec["module"]) for rec in recs}) == len(recs)  # none twice
    seen = [res[0]["seen"], res[1]["seen"]]
    assert_exact([rec for rec in recs if rec["step"] < 2], seen, ranks=(0, 1))  # merged
    assert_exact([rec for rec in recs if rec["step"] >= 2], seen, ranks=(0,))  # its own
    assert any("distributed flush failed" in w for w in res[0]["warnings"])


class _FailingSink:
    name = "failing"

    @hookplug.hookimpl
    def hookplug_session_start(self, session):
        raise OSError("no space left on device")

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        pass


def failed_attach(rank, out):
    """A sink fails at attach on rank 1 only: rank 1 gets that error at once (no collective
    final flush for a session that never started); rank 0 attached a local session."""
    import time
    model = Net()
    started, error = time.monotonic(), None
    try:
        sink = _FailingSink() if rank == 1 else Dump()
        with hookplug.attach(model, "Linear", plugins="stats", sink=sink, distributed=False) \
                if rank == 0 else hookplug.attach(model, "Linear", plugins="stats", sink=sink):
            model(torch.randn(3, 6))
    except OSError as exc:
        error = str(exc)
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    return {"error_seen": error, "took": time.monotonic() - started, "hooks": hooks}


def test_a_failed_attach_on_one_rank_raises_its_own_error_at_once(tmp_path):
    res = spawn("failed_attach", tmp_path)
    assert res[1]["error_seen"] == "no space left on device" and res[1]["took"] < 20
    assert res[0]["error_seen"] is None
    assert res[0]["hooks"] == res[1]["hooks"] == 0


def session_on_rank0_only(rank, out):
    """Debugging on rank 0 only: ``distributed=False`` never communicates and its sink
    gets that rank's records; rank 1 has no session."""
    model, state = Net(), {"step": 0}
    seen = watch(model, state)
    dump = Dump()
    if rank == 0:
        with hookplug.attach(model, "Linear", plugins=("stats", {"sites": "output"}),
                             sink=dump, flush_every=1, distributed=False) as s:
            for step in range(2):
                state["step"] = step
                model(torch.randn(3, 6))
                s.step()
            s.flush()
    return {"records": dump.records, "seen": seen}


def test_a_session_on_one_rank_with_distributed_false_never_communicates(tmp_path):
    res = spawn("session_on_rank0_only", tmp_path)
    assert {key(rec) for rec in res[0]["records"]} == set(res[0]["seen"])
    assert_exact(res[0]["records"], {0: res[0]["seen"]}, ranks=(0,))
    assert res[1]["records"] == []


def session_on_rank1_only(rank, out):
    """Debugging on rank 1 only (``distributed=False``) into a ``prometheus`` sink and a
    ``jsonl`` sink without ``all_ranks``: both are handed rank 1's records, so they write."""
    import urllib.request

    res = {"served": None, "lines": None}
    if rank == 1:
        model = Net()
        path = os.path.join(out, "r1.jsonl")
        with hookplug.attach(model, "Linear", plugins=("stats", {"sites": "output"}), flush_every=1,
                             sink=[("prometheus", {"port": 0}), ("jsonl", {"path": path})],
                             distributed=False) as s:
            model(torch.randn(3, 6))
            s.step()
            url = s["prometheus"].url
            if url is not None:
                body = urllib.request.urlopen(url, timeout=10).read().decode()
                res["served"] = sorted(line.split(" ")[0] for line in body.splitlines()
                                       if line.startswith("hookplug_tensor_numel{"))
        res["lines"] = len(open(path).read().splitlines())
    return res


def test_a_debug_session_on_a_rank_other_than_0_serves_its_prometheus_sink(tmp_path):
    """A ``distributed=False`` session hands every sink its records on any rank, but the
    prometheus sink decided at attach by the rank alone (``writes_on``: rank 0 or
    ``all_ranks``): on rank 1 it started no server, so the records went nowhere."""
    pytest.importorskip("prometheus_client")
    res = spawn("session_on_rank1_only", tmp_path)
    assert res[0]["served"] is None
    assert res[1]["served"] == ['hookplug_tensor_numel{module="%s",phase="train",rank="1",site="output"}' % m
                                for m in ("fc1", "fc2")]
    assert res[1]["lines"] == 2


def _destroy_before_remove(rank, world, port, out):
    from _gloo import init

    init(rank, world, port)
    torch.manual_seed(rank)
    m = nn.Sequential(nn.Linear(4, 4))
    s = hookplug.attach(m, "Linear", plugins="stats", sink=("jsonl", {"path": out}), flush_every=2)
    for _ in range(3):
        m(torch.randn(3, 4))
        s.step()
    dist.destroy_process_group()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.remove()  # the last step goes out locally, after the group is gone
    return {"warnings": [str(w.message) for w in caught if "hookplug" in str(w.message)]}


def _flush_before_init(rank, world, port, out):
    """Attached before init_process_group, as under torchrun (RANK set): a step flushed
    before the group exists is this rank's, labelled with its rank."""
    from _gloo import init

    os.environ["RANK"] = str(rank)
    torch.manual_seed(rank)
    m = nn.Sequential(nn.Linear(4, 4))
    s = hookplug.attach(m, "Linear", plugins="stats", sink=("jsonl", {"path": out}), flush_every=1)
    m(torch.randn(3, 4))
    s.step()  # flushed alone: no group yet
    init(rank, world, port)
    for _ in range(2):
        m(torch.randn(3, 4))
        s.step()
    s.remove()
    return {}


def test_a_step_flushed_before_init_process_group_is_its_ranks_own(tmp_path):
    """Before the group existed every rank took rank 0: rank 1's step 0 went into rank 0's
    file, labelled rank 0 (twice step 0 there). torchrun's RANK names it now."""
    from _gloo import spawn_bare

    out = tmp_path / "runs"
    spawn_bare(_flush_before_init, tmp_path, str(out))
    lines = [json.loads(x) for f in sorted(out.rglob("*.jsonl")) for x in f.read_text().splitlines()]
    recs = [(r["step"], r["rank"], r["numel"]) for r in lines if "module" in r]
    assert recs == [(0, 0, 12), (1, 0, 24), (2, 0, 24)]


def test_records_flushed_after_destroy_process_group_keep_their_rank(tmp_path):
    """After ``destroy_process_group()`` the rank was read as 0: rank 1's last step was written
    into rank 0's file (rank 1's jsonl sink has no ``all_ranks``), labelled rank 0."""
    from _gloo import spawn_bare

    out = tmp_path / "runs"
    res = spawn_bare(_destroy_before_remove, tmp_path, str(out))
    lines = [json.loads(x) for f in sorted(out.rglob("*.jsonl")) for x in f.read_text().splitlines()]
    recs = [r for r in lines if "module" in r]
    assert [(r["step"], r["rank"], r["numel"]) for r in recs] == [(0, 0, 24), (1, 0, 24), (2, 0, 12)]
    for got in res:  # said, on every rank: the last step is not merged
        assert any("process group is gone" in w for w in got["warnings"]), got


def test_rows_of_a_device_type_the_backend_lacks_are_gathered_through_one_it_has(monkeypatch):
    """``init_process_group("nccl")`` holds only ``cuda``: CPU rows (params under FSDP2's CPU
    offload) went to ``all_gather_into_tensor`` as they were, which NCCL refuses; they are
    gathered through the current CUDA device. Where the backend has the type (gloo, "cpu:gloo,
    cuda:nccl"), or its config cannot be read, they are gathered where they are."""
    from hookplug._telemetry import _gather_device

    class FakeDist:
        def __init__(self, config):
            self.config = config

        def get_backend_config(self, group=None):
            if isinstance(self.config, Exception):
                raise self.config
            return self.config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _gather_device(FakeDist("cuda:nccl"), "cpu") == torch.device("cuda", 3)
    assert _gather_device(FakeDist("cuda:nccl"), "cuda") is None
    assert _gather_device(FakeDist("cpu:gloo,cuda:nccl"), "cpu") is None
    assert _gather_device(FakeDist("cpu:gloo,cuda:gloo"), "cpu") is None
    assert _gather_device(FakeDist("xpu:xccl"), "cpu") is None  # no CUDA to go through: as before
    assert _gather_device(FakeDist(RuntimeError("no config")), "cpu") is None


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA GPU and NCCL")
def test_cpu_rows_flush_through_an_nccl_only_group(fresh_python):
    """A 1-rank NCCL group (no CPU collective) and a model on the CPU (params' rows as under
    FSDP2's CPU offload): the flush gathers the rows through the GPU and gives the records a
    group-less session gives."""
    out = fresh_python(textwrap.dedent("""
        import json, os, socket, torch, torch.nn as nn, torch.distributed as dist, hookplug
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        def run(distributed):
            torch.manual_seed(0)
            model, x = nn.Linear(8, 4), torch.randn(16, 8)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            got = []
            class Keep:
                name = "keep"
                @hookplug.hookimpl
                def hookplug_flush(self, records):
                    got.extend((r["module"], r["site"], r["numel"], round(r["mean"], 6)) for r in records)
            with hookplug.attach(model, "*:", plugins=["stats", ("params", {"sites": ("weight", "grad")})],
                                 sink=Keep(), distributed=distributed) as s:
                model(x).sum().backward(); opt.step(); s.step(); opt.zero_grad()
            return sorted(got)
        merged, alone = run(True), run(False)
        dist.destroy_process_group()
        print(json.dumps({"same": merged == alone, "n": len(merged)}))
    """))
    got = json.loads(out)
    assert got["same"] and got["n"] >= 5


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes: Python 3.11+")
def test_a_failed_layout_exchange_says_every_rank_must_flush_alike():
    """A rank that never comes to a flush (a session attached on one rank only, unequal
    step counts) times the others out in the exchange: the error says what to check."""
    from hookplug._telemetry import _Layouts

    class Local:
        base, dropped = 0, None

        def describe(self):
            return []

    class TimedOut:
        def all_gather_object(self, out, obj):
            raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms")

    with pytest.raises(RuntimeError, match="Timed out") as info:
        _Layouts().agree(None, Local(), TimedOut(), 2, 1)
    assert any("flush alike" in n and "distributed=False" in n for n in info.value.__notes__)


# -- DDP's Join (uneven inputs) with flush_every -------------------------------------------------------

def uneven_inputs_under_join(rank, out):
    """Epochs of uneven batches per rank under ``Join([ddp])``, ``flush_every=2``: rank 1's
    flush after its 4th step met the all-reduces rank 0 shadowed for DDP once it had joined
    (a hang until the process group's timeout). Under Join a flush runs at the first step()
    of each block, where no rank has joined."""
    from torch.distributed.algorithms.join import Join

    ddp, seen, dump, train_step, flushes = _ddp_training(rank)
    with hookplug.attach(ddp, "Linear", plugins=["stats", ("params", {"bins": 0})], sink=dump,
                         flush_every=2) as s:
        join = Join([ddp])  # (one object entered for each epoch)
        for epoch, batches in enumerate(((3, 5), (4, 4), (2, 3))):
            with join:
                for i in range(batches[rank]):
                    train_step(s, 10 * epoch + i)  # (steps 3, 4: rank 1's alone)
        for i in range(4):  # even inputs after the blocks: every flush_every=2 steps again
            train_step(s, 30 + i)
    return {"records": dump.records, "seen": seen, "flushes": flushes}


def _ddp_training(rank):
    """A DDP model watched by plain hooks, a sink, and ``train_step(session, step)``, which
    notes the session's flush count after each step in ``flushes``."""
    torch.manual_seed(0)
    model, state, g = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), {"step": 0}, \
        torch.Generator().manual_seed(100 + rank)
    seen = watch(model, state)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    flushes = []

    def train_step(s, step):
        state["step"] = step
        ddp(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        s.step(step=step)
        flushes.append(s._telemetry.flushes)

    return ddp, seen, Dump(), train_step, flushes


def test_uneven_inputs_under_join_with_flush_every_do_not_hang(tmp_path):
    res = spawn("uneven_inputs_under_join", tmp_path)
    # a flush at the first step of each block, none after it in the block; then at the first
    # step after the last block and every 2 steps from there
    assert res[0]["flushes"] == [1, 1, 1, 2, 2, 2, 2, 3, 3] + [4, 4, 5, 5]
    assert res[1]["flushes"] == [1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3] + [4, 4, 5, 5]
    seen = [r["seen"] for r in res]
    for r in res:
        outputs = [rec for rec in r["records"] if rec["site"] == "output"]
        assert sorted({rec["step"] for rec in outputs}) == [0, 1, 2, 3, 4, 10, 11, 12, 13, 20, 21, 22,
                                                             30, 31, 32, 33]
        assert_exact(outputs, seen, ranks=(0, 1))  # (a step one rank ran: its values alone)
    same_on_every_rank(res)


def join_attached_inside_and_nested(rank, out):
    """A session attached inside a Join block (the wrapper that marks blocks is installed
    at attach: that block was entered before), then a nested Join in an outer one (the
    inner exit ended the outer block's mark): flush_every=2 flushed inside them, a hang."""
    from torch.distributed.algorithms.join import Join

    ddp, seen, dump, train_step, flushes = _ddp_training(rank)
    with Join([ddp]):
        s = hookplug.attach(ddp, "Linear", plugins="stats", sink=dump, flush_every=2)
        for i in range((3, 6)[rank]):
            train_step(s, i)
    with Join([ddp]):
        with Join([ddp]):
            for i in range(2):
                train_step(s, 10 + i)
        for i in range((2, 5)[rank]):
            train_step(s, 20 + i)
    s.remove()
    return {"records": dump.records, "seen": seen, "flushes": flushes}


def test_join_entered_before_attach_and_nested_joins_do_not_hang(tmp_path):
    res = spawn("join_attached_inside_and_nested", tmp_path)
    # one flush at the first step of each (outermost) block, none inside
    assert res[0]["flushes"] == [1, 1, 1] + [2, 2, 2, 2]
    assert res[1]["flushes"] == [1] * 6 + [2] * 7
    seen = [r["seen"] for r in res]
    for r in res:
        outputs = [rec for rec in r["records"] if rec["site"] == "output"]
        assert sorted({rec["step"] for rec in outputs}) == [0, 1, 2, 3, 4, 5, 10, 11, 20, 21, 22, 23, 24]
        assert_exact(outputs, seen, ranks=(0, 1))
    same_on_every_rank(res)
