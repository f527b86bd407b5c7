"""Telemetry sinks: jsonl (appends whole lines), tensorboard (read back with TensorBoard's own
event reader), prometheus (scraped over 127.0.0.1), third-party sinks by instance and by
entry point, and the optional-dependency errors."""
import copy
import gc
import json
import math
import os
import sys
import textwrap
import threading
import types
import urllib.error
import urllib.request
import warnings
import weakref

import pytest
import torch

import hookplug
from hookplug import _manager
from hookplug.models import MLP

from hookplug import STAT_FIELDS as STATS  # noqa: E402
from hookplug_plugins.sinks.tensorboard import DEFAULT_SCALARS as TB_STATS  # noqa: E402


from conftest import RecordSink as ListSink  # noqa: E402
from conftest import fork_child, join_child, no_warnings, run_forked  # noqa: E402


def run_steps(sink, steps=3, flush_every=1, **kw):
    """MLP with stats on its Linear layers for a few steps; returns the records a ListSink saw
    beside ``sink`` (the truth the sink under test must reproduce) and the session."""
    m = MLP()
    ref = ListSink()
    s = hookplug.attach(m, "Linear", plugins="stats", sink=[sink, ref], flush_every=flush_every, **kw)
    for step in range(steps):
        x = torch.randn(8, 32) * (step + 1)
        x[0, 0] = math.nan if step == 1 else x[0, 0]
        m(x)
        s.step()
    return ref.records, s, m


def same(a, b):
    return (isinstance(a, float) and math.isnan(a) and isinstance(b, float) and math.isnan(b)) or a == b


# -- jsonl --------------------------------------------------------------------------------------------

def test_jsonl_lines_are_readable_during_the_run_and_read_back(tmp_path):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    sink = _manager.create_plugin("jsonl", {"path": str(tmp_path / "exp1")})
    truth, s, m = run_steps(sink, steps=3)
    path = tmp_path / "exp1" / "telemetry.jsonl"
    lines = path.read_text().splitlines()  # session still attached: the file is already complete
    assert len(lines) == len(truth) == 9
    raw = [json.loads(line) for line in lines]
    # edges once per (module, site), the lines otherwise self-contained
    assert [("hist_edges" in r) for r in raw] == [True] * 3 + [False] * 6
    m(torch.randn(8, 32))
    s.remove()  # flushes the running step
    back = read_jsonl(str(tmp_path / "exp1"))
    assert len(back) == 12
    for got, want in zip(back, truth):
        for k in ("step", "rank", "module", "site", "time", "hist", "hist_edges") + STATS:
            assert same(got[k], want[k]), (k, got[k], want[k])
    # step 1 fed a NaN, which propagates through its row
    assert {(r["step"], r["module"]) for r in back if r["nan_count"]} == {(1, "fc1"), (1, "fc2"), (1, "fc3")}
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_jsonl_writes_nonfinite_as_null(tmp_path):
    from hookplug_plugins.sinks.jsonl import JsonlSink, read_jsonl

    sink = JsonlSink(str(tmp_path / "t.jsonl"))
    rec = {"step": 0, "time": 1.0, "rank": 0, "module": "m", "site": "output", "numel": 2,
           "nan_count": 2, "inf_count": 0, "zero_count": 0, "calls": 1, "min": math.nan,
           "max": math.nan, "mean": math.nan, "std": math.nan, "absmax": math.nan, "l2": 0.0,
           "rms": math.nan, "zero_fraction": 0.0, "hist": [], "hist_edges": []}
    empty = dict(rec, numel=0, nan_count=0, zero_fraction=math.nan)  # a site that saw only empty tensors
    update = dict(rec, site="update", update_to_weight=math.nan)  # params: a weight of l2 0
    sink.hookplug_flush(session=None, records=[rec, empty, update])
    sink.close()
    line = (tmp_path / "t.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["min"] is None
    back = read_jsonl(str(tmp_path / "t.jsonl"))
    assert len(back) == 3
    for got, want in zip(back, (rec, empty, update)):  # every non-finite float comes back as NaN
        for k, v in want.items():
            if isinstance(v, float) and math.isnan(v):
                assert isinstance(got[k], float) and math.isnan(got[k]), (k, got[k])
            else:
                assert got[k] == v, (k, got[k], v)


def test_jsonl_round_trip_without_histograms(tmp_path):
    """``stats(bins=0)``: records hold ``hist`` and ``hist_edges`` as ``[]``; the writer leaves
    the empty edges out, and reading back gives them again (the reader filled them in only
    for a non-empty ``hist``: the records came back without the key)."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    m, ref = MLP(), ListSink()
    with hookplug.attach(m, "Linear", plugins=("stats", {"bins": 0}), flush_every=1,
                         sink=[("jsonl", {"path": str(tmp_path)}), ref]) as s:
        for _ in range(2):
            m(torch.randn(4, 32))
            s.step()
    back = read_jsonl(str(tmp_path))
    assert len(back) == len(ref.records) == 6
    for got, want in zip(back, ref.records):
        assert want["hist"] == want["hist_edges"] == []
        assert set(want) <= set(got), set(want) - set(got)
        for k, v in want.items():
            assert same(got[k], v), (k, got[k], v)


@pytest.fixture(params=["orjson", "json"])
def jsonl_encoder(request, monkeypatch):
    """The jsonl sink with orjson (where installed) and with the standard library."""
    from hookplug_plugins.sinks import jsonl

    if request.param == "orjson":
        pytest.importorskip("orjson")
        monkeypatch.setattr(jsonl, "_DUMPS", None)
        assert jsonl._dumps() is not jsonl._dumps_stdlib
    else:
        monkeypatch.setattr(jsonl, "_DUMPS", jsonl._dumps_stdlib)
    return request.param


def test_jsonl_encoders_write_the_same_records(tmp_path, jsonl_encoder):
    """orjson and json give the same parsed lines: non-finite floats (stats and a producer's
    own meta) as null, and what orjson refuses (a key that is not a str, an int over 64
    bits, a numpy float) handed to json."""
    np = pytest.importorskip("numpy")
    from hookplug_plugins.sinks.jsonl import JsonlSink

    recs = [
        {"step": 0, "time": 1.5, "rank": 0, "module": "fc1", "site": "output", "numel": 3,
         "nan_count": 1, "inf_count": 1, "zero_count": 0, "min": 0.25, "max": math.inf,
         "mean": math.nan, "std": -math.inf, "absmax": 1e-300, "rms": math.nan,
         "hist": [0, 2, 5], "hist_edges": [0.0, 1.0, 2.0, 4.0], "note": "\u00e9\"q\"",
         "extra": {"x": [math.nan, 1.0, (2, 3)]}},
        {"step": 1, "time": 2.0, "rank": 0, "module": "fc1", "site": "output", "numel": 3,
         "big": 2 ** 70, "np": np.float64(0.5), "nested": {1: "int key"}},
    ]
    sink = JsonlSink(str(tmp_path / "t.jsonl"))
    sink.hookplug_flush(session=None, records=recs)
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lines[0]["max"] is None and lines[0]["mean"] is None and lines[0]["std"] is None
    assert lines[0]["rms"] is None and lines[0]["absmax"] == 1e-300 and lines[0]["time"] == 1.5
    assert lines[0]["extra"] == {"x": [None, 1.0, [2, 3]]} and lines[0]["note"] == "\u00e9\"q\""
    assert lines[0]["hist"] == [0, 2, 5] and lines[0]["hist_edges"] == [0.0, 1.0, 2.0, 4.0]
    assert lines[1]["big"] == 2 ** 70 and lines[1]["np"] == 0.5 and lines[1]["nested"] == {"1": "int key"}
    assert "hist_edges" not in lines[1]  # unchanged for (fc1, output): written once
    assert recs[0]["mean"] is not None and math.isnan(recs[0]["mean"])  # the records are not changed


def test_jsonl_concurrent_writers_never_tear_a_line(tmp_path):
    """Two sinks (two O_APPEND descriptors, as two ranks with all_ranks=True would have)
    appending big records at once: every line is one whole record."""
    from hookplug_plugins.sinks.jsonl import JsonlSink

    path = tmp_path / "shared.jsonl"
    sinks = [JsonlSink(str(path)) for _ in range(2)]

    def write(i, sink):
        for k in range(40):
            recs = [{"step": k, "rank": i, "module": f"w{i}." + "x" * 3000, "site": "output",
                     "hist": list(range(131)), "n": j} for j in range(50)]
            sink.hookplug_flush(session=None, records=recs)

    threads = [threading.Thread(target=write, args=(i, s)) for i, s in enumerate(sinks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sinks:
        s.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * 40 * 50
    seen = {(r["rank"], r["step"], r["n"]) for r in map(json.loads, lines)}
    assert len(seen) == len(lines)


def test_jsonl_path_forms(tmp_path):
    from hookplug_plugins.sinks.jsonl import JsonlSink

    s = hookplug.attach(MLP(), "Linear", plugins="stats")
    for given, expect in [(str(tmp_path / "d"), tmp_path / "d" / "telemetry.jsonl"),
                          (str(tmp_path / "f.jsonl"), tmp_path / "f.jsonl"),
                          (str(tmp_path / "r{rank}" / "{run_id}.ndjson"),
                           tmp_path / "r0" / f"{s.run_id}.ndjson")]:
        sink = JsonlSink(given)
        sink.hookplug_flush(session=s, records=[{"step": 0, "rank": 0}])
        sink.close()
        assert sink.path == str(expect) and expect.exists()
    s.remove()


def test_jsonl_sink_reused_across_sessions_writes_edges_in_each_file(tmp_path):
    """close() at the end of a session forgets the edges written, so the next session's
    file carries its own hist_edges instead of none."""
    from hookplug_plugins.sinks.jsonl import JsonlSink, read_jsonl

    m = torch.nn.Linear(4, 4)
    sink = JsonlSink(str(tmp_path / "{run_id}"))
    paths = []
    for _ in range(2):
        with hookplug.attach(m, "*:", plugins="stats", sink=sink) as s:
            m(torch.randn(2, 4))
            s.step()
        paths.append(sink.path)
        with open(sink.path) as f:
            raw = [json.loads(line) for line in f]
        assert len(raw) == 1 and sink.lines == 1
        assert raw[0]["hist_edges"] and len(raw[0]["hist_edges"]) == len(raw[0]["hist"]) + 1
        assert read_jsonl(sink.path)[0]["hist_edges"] == raw[0]["hist_edges"]
    assert paths[0] != paths[1]


def test_jsonl_sink_shared_by_two_live_sessions_gives_each_run_its_edges(tmp_path):
    """A model and its copy (same module names) attached at once with one sink: each run's
    records read back with their hist_edges (the edges written were remembered per module
    and site only, so the second run's first records had none)."""
    from hookplug_plugins.sinks.jsonl import JsonlSink, read_jsonl

    a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    b = copy.deepcopy(a)
    sink = JsonlSink(str(tmp_path / "shared"))
    sa = hookplug.attach(a, "Linear", plugins="stats", sink=sink, flush_every=1)
    sb = hookplug.attach(b, "Linear", plugins="stats", sink=sink, flush_every=1)
    for _ in range(2):
        for m, s in ((a, sa), (b, sb)):
            m(torch.randn(3, 4))
            s.step()
    sa.remove()
    sb.remove()
    for s in (sa, sb):
        mine = read_jsonl(str(tmp_path / "shared"), run_id=s.run_id)
        assert len(mine) == 4
        assert all(r["hist"] and len(r["hist_edges"]) == len(r["hist"]) + 1 for r in mine)


def test_jsonl_flush_interrupted_by_ctrl_c_is_rolled_back_and_written_once_when_handed_over_again(
        tmp_path, monkeypatch):
    """Ctrl-C while the sink writes (raised as os.write returns): the file goes back to where
    the flush began, with the hist_edges bookkeeping, so the session's second try (remove())
    writes the records once; a flush handed over again after the sink had written all of it
    (the Ctrl-C came as it returned) is not written twice."""
    from hookplug_plugins.sinks.jsonl import JsonlSink, read_jsonl

    truth, s, _ = run_steps(JsonlSink(str(tmp_path / "other")), steps=2)
    s.remove()
    first, second = truth[:3], truth[3:]
    sink = JsonlSink(str(tmp_path))
    sink.hookplug_flush(s, first)
    real_write, calls = os.write, []

    def write_then_interrupt(fd, data):
        n = real_write(fd, data)
        if fd == sink._fd:
            calls.append(n)
            raise KeyboardInterrupt
        return n

    monkeypatch.setattr(os, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        sink.hookplug_flush(s, second)
    monkeypatch.setattr(os, "write", real_write)
    assert calls and sink.lines == 3 and len(read_jsonl(sink.path)) == 3
    sink.hookplug_flush(s, second)  # handed over again
    sink.hookplug_flush(s, second)  # ... after a Ctrl-C that came as the sink returned
    back = read_jsonl(sink.path)
    assert [(r["step"], r["module"]) for r in back] == [(r["step"], r["module"]) for r in truth]
    assert all(r["hist_edges"] == truth[0]["hist_edges"] for r in back) and sink.lines == 6
    sink.close()


def test_jsonl_failed_write_caught_by_the_caller_keeps_hist_edges_in_later_lines(tmp_path, monkeypatch):
    """A write that fails (a full disk) under on_error="raise", the error caught and the run
    going on: the lines rolled back took their hist_edges with them, so the next lines
    carry them and read_jsonl gives every record its edges."""
    import errno

    from hookplug_plugins.sinks.jsonl import JsonlSink, read_jsonl

    sink = JsonlSink(str(tmp_path))
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins="stats", sink=sink, flush_every=1)
    real_write = os.write

    def full_disk(fd, data):
        if fd == sink._fd:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    m(torch.randn(4, 32))
    with pytest.raises(OSError, match="cannot write 3 record"):
        s.step()
    monkeypatch.setattr(os, "write", real_write)
    m(torch.randn(4, 32))
    s.step()
    s.remove()
    back = read_jsonl(str(tmp_path))
    assert len(back) == 3 and all(r["hist"] and len(r["hist_edges"]) == len(r["hist"]) + 1 for r in back)


def test_read_jsonl_of_a_file_it_cannot_read_says_what_it_expects(tmp_path):
    """A compressed (or otherwise named) file, or a path that does not exist: the error names
    the path and what read_jsonl reads, not '<path>/telemetry.jsonl: Not a directory'."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    gz = tmp_path / "telemetry.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b")
    with pytest.raises(ValueError, match=r"telemetry.jsonl.gz' is not a telemetry file: expected a folder "
                                         r"holding telemetry.jsonl or a file ending in .jsonl"):
        read_jsonl(str(gz))
    with pytest.raises(FileNotFoundError, match="expected a folder holding telemetry.jsonl") as info:
        read_jsonl(str(tmp_path / "missing.jsonl.gz"))
    assert info.value.filename == str(tmp_path / "missing.jsonl.gz")


def test_read_jsonl_refuses_files_that_are_not_telemetry(tmp_path):
    """A file that is not hookplug telemetry raises, naming the line, instead of coming back
    as no records (every line taken for a torn one) or as records without a module."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    cases = {
        "config.jsonl": (json.dumps({"lr": 0.1, "layers": [1, 2]}, indent=2), "line 2 is not a telemetry record"),
        "weights.jsonl": (b"\x08\x00\x00\x00\x00\x00\x00\x00{}binary", "line 1 is not a telemetry record"),
        "losses.jsonl": ('{"loss": 1.5}\n{"loss": 1.2}\n', "expected a JSON object with keys module, site, step"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=message):
            read_jsonl(str(path))


def test_read_jsonl_skips_a_nul_filled_tail_as_torn(tmp_path):
    """A power loss after an append the file system had not written leaves NUL bytes: a
    torn line, skipped, also once a later session appended after it."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    path = tmp_path / "t.jsonl"
    rec = json.dumps({"step": 0, "module": "m", "site": "output"})
    path.write_bytes(rec.encode() + b"\n" + b"\x00" * 64)
    with pytest.warns(RuntimeWarning, match="skipped 1 torn line"):
        assert [r["step"] for r in read_jsonl(str(path))] == [0]
    path.write_bytes(path.read_bytes() + b"\n" + rec.replace('"step": 0', '"step": 1').encode() + b"\n")
    with pytest.warns(RuntimeWarning, match="skipped 1 torn line"):
        assert [r["step"] for r in read_jsonl(str(path))] == [0, 1]


def test_a_line_another_writer_left_torn_between_flushes_loses_no_record(tmp_path):
    """Two writers of one file: one dies mid-line while the other has it open; the survivor's
    next flush starts on a line of its own (the torn line is ended first, at every flush)."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    path = tmp_path / "shared.jsonl"
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins="stats", sink=("jsonl", {"path": str(path)}), flush_every=1)
    for step in range(4):
        m(torch.randn(4, 32))
        if step == 2:
            with open(path, "ab") as other:  # the other writer, killed part way through a line
                other.write(b'{"step": 7, "module": "fc1", "si')
        with pytest.warns(RuntimeWarning, match="ended in a torn line") if step == 2 else no_warnings():
            s.step()
    s.remove()
    with pytest.warns(RuntimeWarning, match="skipped 1 torn line"):
        back = read_jsonl(str(path), run_id=s.run_id)
    assert sorted({r["step"] for r in back}) == [0, 1, 2, 3] and len(back) == 4 * 3


@pytest.mark.parametrize("sink", ["jsonl", "tensorboard"])
def test_a_sink_named_in_plugins_is_the_sink_with_flush_every(sink, tmp_path, monkeypatch):
    """plugins=["stats", "jsonl"] with flush_every: the jsonl named there is the sink (it was
    added a second time by default: "plugin name 'jsonl' is used twice"); with tensorboard
    there, no telemetry.jsonl is written beside it."""
    if sink == "tensorboard":
        pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins=["stats", (sink, {"path": str(tmp_path / "out")})], flush_every=1)
    m(torch.randn(4, 32))
    s.step()
    s.remove()
    assert not (tmp_path / "runs").exists()
    assert list((tmp_path / "out").iterdir())


def test_a_rank_from_the_environment_without_a_process_group_says_its_sinks_write_nothing(tmp_path, monkeypatch):
    """RANK=1 (torchrun, before init_process_group; or left set) and no process group: rank
    0's sinks write for every rank, so this one's without all_ranks write nothing, once
    said; with all_ranks its records are labelled rank 1."""
    from hookplug_plugins.sinks.jsonl import read_jsonl

    monkeypatch.setenv("RANK", "1")
    for all_ranks in (False, True):
        path = tmp_path / f"all{all_ranks}" / "t.jsonl"
        m = MLP()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hookplug.attach(m, "Linear", plugins="stats", flush_every=1,
                                 sink=("jsonl", {"path": str(path), "all_ranks": all_ranks})) as s:
                for _ in range(2):
                    m(torch.randn(2, 32))
                    s.step()
        told = [w for w in caught if "RANK=1 (from the environment)" in str(w.message)]
        if all_ranks:
            assert not told and {r["rank"] for r in read_jsonl(str(path))} == {1}
        else:
            assert len(told) == 1 and told[0].filename == __file__ and not path.exists()


@pytest.mark.parametrize("sink", ["jsonl", "tensorboard", "prometheus"])
def test_a_sink_given_an_empty_path_says_what_it_expects(sink):
    with pytest.raises(ValueError, match=f"{sink} sink: path= expects a file or folder name .* got ''"):
        _manager.create_plugin(sink, {"path": ""})


# -- tensorboard ------------------------------------------------------------------------------------

def assert_same_histogram(hist, counts, edges):
    """``hist`` (a HistogramProto read back) is the record's histogram with each run of
    empty buckets written as one and none at the ends: every occupied bucket keeps its
    count, right limit and left edge (the limit before it; TensorBoard takes the min for
    the first)."""
    limits, written = list(hist.bucket_limit), list(hist.bucket)
    occupied = [(i, c) for i, c in enumerate(counts) if c]
    assert [(lim, c) for lim, c in zip(limits, written) if c] == [(edges[i + 1], c) for i, c in occupied]
    for k, (lim, c) in enumerate(zip(limits, written)):
        assert lim in edges
        if c and k:
            i = edges.index(lim) - 1
            assert limits[k - 1] == edges[i]  # its own left edge
    assert written[0] and written[-1]
    assert len(written) <= 2 * len(occupied) - 1 < len(counts)


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = _manager.create_plugin("tensorboard", {"path": str(tmp_path / "tb")})
    truth, s, _ = run_steps(sink, steps=2)
    s.remove()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    # one stat across layers in one group: hookplug/<stat>/<module>/<site>; no constant numel
    assert len(tags["scalars"]) == 3 * len(TB_STATS) and len(tags["histograms"]) == 3
    assert "numel" not in TB_STATS and {"nan_count", "inf_count"} <= set(TB_STATS)
    assert not [t for t in tags["scalars"] if "/numel/" in t]
    for rec in truth:
        for stat in TB_STATS:
            tag = f"hookplug/{stat}/{rec['module']}/{rec['site']}"
            events = {e.step: e.value for e in acc.Scalars(tag)}
            want = float(rec[stat])
            assert math.isclose(events[rec["step"]], want, rel_tol=1e-6, abs_tol=1e-30), tag
        tag = f"hookplug/hist/{rec['module']}/{rec['site']}"
        hist = {e.step: e.histogram_value for e in acc.Histograms(tag)}[rec["step"]]
        assert_same_histogram(hist, rec["hist"], rec["hist_edges"])
        assert hist.num == rec["numel"] - rec["nan_count"]
        assert hist.min == rec["min"] and hist.max == rec["max"]
        n = rec["numel"] - rec["nan_count"] - rec["inf_count"]
        assert math.isclose(hist.sum, rec["mean"] * n, rel_tol=1e-9, abs_tol=1e-9)


def test_tensorboard_sink_batches_a_steps_values_and_checksums_in_c(tmp_path):
    """A flush writes the values of a step in events of up to 1000 values (it wrote one
    event per value: 6000 records held the training thread ~7 s), checksummed by
    google-crc32c (TensorBoard's pure-Python CRC held the GIL on its writing thread for
    seconds), and reads back whole."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("google_crc32c")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(120)])
    s = hookplug.attach(m, "Linear", plugins=("stats", {"sites": ("output", "grad")}),
                        sink=("tensorboard", {"path": str(tmp_path / "tb")}))
    for _ in range(2):
        m(torch.randn(2, 4)).sum().backward()
        s.step()
    s.remove()
    assert getattr(record_writer.masked_crc32c, "hookplug_fast", False)
    data = bytes(range(256)) * 5 + b"\x00\xff"
    assert record_writer.masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)
    (path,) = [p for p in (tmp_path / "tb").iterdir()]
    events = [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary")]
    values = 2 * 120 * 2 * (len(TB_STATS) + 1)  # steps x modules x sites (output, grad) x values
    assert len(events) == 2 * math.ceil(values / 2 / 1000)
    assert sum(len(e.summary.value) for e in events) == values
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()  # (checks every record's checksum)
    assert len(acc.Tags()["scalars"]) == 120 * 2 * len(TB_STATS)
    assert [e.step for e in acc.Scalars("hookplug/max/119/grad")] == [0, 1]


def test_tensorboard_sink_writes_through_a_writer_without_a_file_writer(tmp_path):
    """A writer= that is no torch/tensorboardX SummaryWriter (only add_scalar and
    add_histogram_raw) gets the same values one call at a time."""
    calls = []

    class Duck:
        def add_scalar(self, tag, value, global_step=None, walltime=None):
            calls.append(("scalar", tag, value, global_step))

        def add_histogram_raw(self, tag, **kw):
            calls.append(("hist", tag, tuple(kw["bucket_limits"]), tuple(kw["bucket_counts"]),
                          kw["num"], kw["global_step"]))

        def flush(self):
            calls.append(("flush",))

    truth, s, _ = run_steps(_manager.create_plugin("tensorboard", {"writer": Duck()}), steps=2)
    s.remove()
    for rec in truth:
        for stat in TB_STATS:
            assert ("scalar", f"hookplug/{stat}/{rec['module']}/{rec['site']}", float(rec[stat]),
                    rec["step"]) in calls
        (hist,) = [c for c in calls if c[0] == "hist" and c[-1] == rec["step"]
                   and c[1] == f"hookplug/hist/{rec['module']}/{rec['site']}"]
        assert_same_histogram(types.SimpleNamespace(bucket_limit=hist[2], bucket=hist[3]),
                              rec["hist"], rec["hist_edges"])
        assert hist[4] == sum(rec["hist"])
    assert calls.count(("flush",)) >= 2


def test_tensorboard_sink_calls_a_summary_writer_subclass_that_overrides_add_scalar(tmp_path):
    """A SummaryWriter subclass with its own add_scalar/add_histogram_raw gets the calls (the
    batched events went around them)."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    calls = []

    class Mine(SummaryWriter):
        def add_scalar(self, tag, value, *args, **kwargs):
            calls.append(tag)
            super().add_scalar(tag, value, *args, **kwargs)

    writer = Mine(log_dir=str(tmp_path / "mine"))
    truth, s, _ = run_steps(_manager.create_plugin("tensorboard", {"writer": writer}), steps=2)
    s.remove()
    writer.close()
    assert len(calls) == len(truth) * len(TB_STATS)


def test_tensorboard_sink_uses_a_given_writer_and_tags_eval(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "own"))
    sink = _manager.create_plugin("tensorboard", {"writer": writer, "stats": ("max",)})
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink) as s:
        m(torch.randn(2, 4))
        m.eval()
        m(torch.randn(2, 4))
        s.step()
    writer.add_scalar("user/after", 1.0, 0)  # the sink flushed the writer, never closed it
    writer.close()
    acc = EventAccumulator(str(tmp_path / "own"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"hookplug/max/0/output", "hookplug_eval/max/0/output", "user/after"} <= scalars
    assert {"hookplug/hist/0/output", "hookplug_eval/hist/0/output"} <= set(acc.Tags()["histograms"])
    with pytest.raises(ValueError, match="not both"):
        _manager.create_plugin("tensorboard", {"writer": writer, "path": str(tmp_path)})


# -- prometheus --------------------------------------------------------------------------------------

def scrape(url):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_endpoint_scraped_over_loopback():
    pytest.importorskip("prometheus_client")
    sink = _manager.create_plugin("prometheus", {"port": 0})
    truth, s, _ = run_steps(sink, steps=3)
    assert sink.port and sink.url == f"http://127.0.0.1:{sink.port}/metrics"
    fams = scrape(sink.url)
    last = {r["module"]: r for r in truth if r["step"] == 2}
    for stat in STATS:
        samples = {smp.labels["module"]: smp for smp in fams[f"hookplug_tensor_{stat}"].samples}
        assert set(samples) == {"fc1", "fc2", "fc3"}
        for mod, smp in samples.items():
            assert smp.labels == {"module": mod, "site": "output", "phase": "train", "rank": "0"}
            assert same(smp.value, float(last[mod][stat])), (stat, mod, smp.value, last[mod][stat])
    assert fams["hookplug_step"].samples[0].value == 2
    # the histogram sums every step's buckets; Prometheus buckets are cumulative
    hist = [smp for smp in fams["hookplug_tensor_values"].samples if smp.labels.get("module") == "fc1"]
    fc1 = [r for r in truth if r["module"] == "fc1"]
    buckets = [(float(smp.labels["le"]), smp.value) for smp in hist if smp.name.endswith("_bucket")]
    assert buckets[-1] == (math.inf, sum(sum(r["hist"]) for r in fc1))  # +Inf: every value
    want = [sum(r["hist"][i] for r in fc1) for i in range(131)]
    cum = [sum(want[: i + 1]) for i in range(131)]
    assert [v for _, v in buckets] == cum
    from hookplug._stats import hist_upper_bounds
    assert [le for le, _ in buckets[:-1]] == hist_upper_bounds(fc1[0]["hist_edges"])[:-1]
    nonfinite = {smp.labels["module"]: smp.value for smp in fams["hookplug_tensor_nonfinite"].samples
                 if smp.name.endswith("_total")}
    assert nonfinite["fc1"] == sum(r["nan_count"] + r["inf_count"] for r in fc1)
    url = sink.url
    s.remove()
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(url, timeout=2)


def test_prometheus_sink_shared_by_two_sessions_serves_until_the_last_ends():
    """A sink may serve several sessions: removing (or dropping) one stopped the endpoint the
    other still flushed to. Serving stops with the last; the sink is freed without the
    cyclic collector (its registry's collector held it)."""
    pytest.importorskip("prometheus_client")
    sink = _manager.create_plugin("prometheus", {"port": 0})
    model = MLP()
    a = hookplug.attach(MLP(), "Linear", plugins="stats", sink=sink, flush_every=1)
    b = hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1)
    url = sink.url
    a.remove()
    assert "hookplug_step" not in scrape(url)  # (nothing flushed yet) but still serving
    model(torch.randn(2, 32))
    b.step()
    assert scrape(url)["hookplug_step"].samples[0].value == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("never removed")
        c = hookplug.attach(MLP(), "Linear", plugins="stats", sink=sink)
        del c  # dropped without remove(), collected: b still served
        gc.collect()
    assert scrape(url)["hookplug_step"].samples[0].value == 0
    b.remove()
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(url, timeout=2)
    alive = weakref.ref(sink)
    del sink, a, b
    assert alive() is None


def test_prometheus_textfile_and_no_server(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    prom = tmp_path / "node" / "hookplug.prom"
    sink = _manager.create_plugin("prometheus", {"port": None, "path": str(prom)})
    truth, s, _ = run_steps(sink, steps=1)
    s.remove()
    assert sink.port is None
    fams = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    means = {smp.labels["module"]: smp.value for smp in fams["hookplug_tensor_mean"].samples}
    assert means == {r["module"]: r["mean"] for r in truth}


class _Values(torch.nn.Module):
    def forward(self, x):
        return x * 1


_EDGE_VALUES = [[0.5, 1.0, 2.0, -1.0, -0.5, 0.0, 1e-12, -1e-12, 3.0, math.inf, -math.inf, 1e10, math.nan],
                [0.25, 4.0, -2.0, 1.0, 0.75]]


@pytest.mark.parametrize("hist, values", [
    ({}, _EDGE_VALUES),
    ({"hist": "linear", "bins": 4, "range": (0.0, 1.0)},  # outside the range: below, above, both
     [[-5.0, 0.1, 0.5, 0.9, 1.0], [0.1, 0.25, 7.0], [-1.0, 0.3, 2.0], [0.0, 0.99]])])
def test_prometheus_buckets_count_the_values_at_most_le_and_count_matches_sum(hist, values):
    """``le`` is inclusive: a value on a bucket edge (1.0, 0.5: the log2 edges) counts in
    ``le="1.0"`` only if ``1.0 <= le``. It was counted one bucket late. A linear range's
    outside values went uncounted beside a ``_sum`` that held them."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    m = torch.nn.Sequential(_Values())
    s = hookplug.attach(m, "*:0", plugins=("stats", hist), sink=("prometheus", {"port": None}),
                        flush_every=1)
    for step in values:
        m(torch.tensor(step, dtype=torch.float64))
        s.step()
    fams = {f.name: f for f in text_string_to_metric_families(s["prometheus"].exposition())}
    s.remove()
    seen = [v for step in values for v in step if not math.isnan(v)]
    placed = []  # where each value counts: a step with values on both sides of a linear
    for step in values:  # range counts its outside ones in +Inf only (documented)
        both = hist and min(step) < 0.0 and max(step) > 1.0
        placed += [math.inf if both and not 0.0 <= v <= 1.0 else v for v in step if not math.isnan(v)]
    samples = fams["hookplug_tensor_values"].samples
    buckets = [(float(x.labels["le"]), x.value) for x in samples if x.name.endswith("_bucket")]
    assert buckets[-1] == (math.inf, len(seen))
    for le, got in buckets:
        assert got == sum(1 for v in placed if v <= le), le
    if hist:  # _sum and _count (left out with negative buckets, log2's) cover the same values
        by = {x.name: x.value for x in samples}
        assert by["hookplug_tensor_values_count"] == len(seen)
        assert math.isclose(by["hookplug_tensor_values_sum"], sum(seen))
        assert buckets[0][1] == 4  # -5 (below the range), 0.1 twice, 0.0


def test_tensorboard_linear_histogram_counts_values_outside_its_range(tmp_path):
    """``num`` counted the in-range buckets while ``sum`` held every finite value: TensorBoard's
    mean (sum / num) was off. The outside values get buckets of their own."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = torch.nn.Sequential(_Values())
    s = hookplug.attach(m, "*:0", plugins=("stats", {"hist": "linear", "bins": 4, "range": (0.0, 1.0)}),
                        sink=("tensorboard", {"path": str(tmp_path / "tb")}), flush_every=1)
    steps = [[-5.0, 0.1, 0.5, 0.9], [0.1, 7.0, 0.2], [0.3, 0.6]]
    for step in steps:
        m(torch.tensor(step, dtype=torch.float64))
        s.step()
    s.remove()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    hists = {e.step: e.histogram_value for e in acc.Histograms("hookplug/hist/0/output")}
    for i, step in enumerate(steps):
        h = hists[i]
        assert h.num == len(step) == sum(h.bucket)
        assert math.isclose(h.sum, sum(step)) and (h.min, h.max) == (min(step), max(step))
    assert list(hists[0].bucket_limit) == [0.0, 0.25, 0.5, 0.75, 1.0] and hists[0].bucket[0] == 1
    # (the empty buckets between 0.25 and 1.0 written as one)
    assert list(hists[1].bucket_limit) == [0.25, 1.0, 7.0] and list(hists[1].bucket) == [2, 0, 1]


def test_prometheus_keeps_eval_forwards_apart_from_training():
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    s = hookplug.attach(m, "Linear", plugins="stats", sink=("prometheus", {"port": None}))
    m(torch.ones(1, 2))
    m.eval()
    m(torch.full((3, 2), 100.0))
    m.train()
    s.step()
    truth = {r["phase"]: r for r in s.flush()}
    fams = {f.name: f for f in text_string_to_metric_families(s["prometheus"].exposition())}
    s.remove()
    got = {smp.labels["phase"]: smp.value for smp in fams["hookplug_tensor_max"].samples}
    assert got == {"train": truth["train"]["max"], "eval": truth["eval"]["max"]}
    inf_bucket = {smp.labels["phase"]: smp.value for smp in fams["hookplug_tensor_values"].samples
                  if smp.name.endswith("_bucket") and smp.labels["le"] == "+Inf"}
    assert inf_bucket == {"train": 2, "eval": 6}


def test_tensorboard_sink_writer_queues_deep_and_flushes_in_its_own_time(tmp_path):
    """The sink runs on the training thread: the writer it opens queues 10,000 events for its
    writing thread (not SummaryWriter's 10) and is flushed by that thread every flush_secs and
    at close, not at every telemetry flush (a given writer= is still flushed each time)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    opened, flushed = [], []

    class Watched(SummaryWriter):
        def __init__(self, *args, **kwargs):
            opened.append(kwargs)
            super().__init__(*args, **kwargs)

        def flush(self):
            flushed.append(1)
            super().flush()

    sink = _manager.create_plugin("tensorboard", {"path": str(tmp_path / "tb"), "stats": ("max",)})
    sink._writer_cls = Watched
    truth, s, _ = run_steps(sink, steps=3)
    assert opened == [{"log_dir": str(tmp_path / "tb"), "flush_secs": 30, "max_queue": 10000}]
    assert flushed == []
    s.remove()  # closes the writer: every event on disk
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("hookplug/max/fc1/output")] == [0, 1, 2]
    given = Watched(log_dir=str(tmp_path / "given"))
    truth, s, _ = run_steps(_manager.create_plugin("tensorboard", {"writer": given}), steps=2)
    s.remove()
    assert len(flushed) == 3  # after each of the 2 telemetry flushes, and at close
    given.close()


def _serve_prometheus():
    pytest.importorskip("prometheus_client")
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins=("stats", {"bins": 0}),
                        sink=("prometheus", {"port": 0}), flush_every=1)
    m(torch.randn(2, 32))
    s.step()
    return s, s["prometheus"]


def test_prometheus_sink_in_a_forked_child_closes_only_its_socket():
    """A child forked while the sink serves (a DataLoader worker, a checkpoint writer) has
    no serving thread: close() there only closes its copy of the socket (shutdown() would
    wait forever), and the session's remove() there leaves the parent's server alone."""
    s, sink = _serve_prometheus()

    def child():
        closed_at_fork = sink._server.socket.fileno() == -1
        sink.close()
        s.remove()
        return closed_at_fork

    assert run_forked(child) == {"result": True}
    assert scrape(sink.url)["hookplug_step"].samples[0].value == 0  # the parent still serves
    s.remove()


def test_a_forked_child_keeps_no_prometheus_port_open():
    """DataLoader workers (fork, persistent) started while the sink serves: once the session
    ends the port is free (a new session binds it) although the workers live on."""
    s, sink = _serve_prometheus()
    port = sink.port
    gate_r, gate_w = os.pipe()

    def worker():
        os.close(gate_w)
        os.read(gate_r, 1)  # lives until the parent closes the gate

    pid, fd = fork_child(worker)
    os.close(gate_r)
    try:
        s.remove()
        again = hookplug.attach(MLP(), "Linear", plugins="stats", sink=("prometheus", {"port": port}))
        assert again["prometheus"].port == port
        again.remove()
    finally:
        os.close(gate_w)
        assert join_child(pid, fd) == {"result": None}


def test_prometheus_port_taken_names_host_and_port():
    pytest.importorskip("prometheus_client")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"prometheus sink: cannot serve on 127.0.0.1:{port}: "):
            hookplug.attach(MLP(), "Linear", plugins="stats", sink=("prometheus", {"port": port}))


# -- wandb ---------------------------------------------------------------------------------------------

@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb in offline mode, writing under tmp_path; any run left active is finished."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    yield wandb
    if wandb.run is not None:
        wandb.run.finish()


def logged_rows(run):
    """Record every ``run.log`` call (the data still goes to the run)."""
    rows, log = [], run.log

    def spy(data, *args, **kwargs):
        rows.append((dict(data), args, kwargs))
        return log(data, *args, **kwargs)

    run.log = spy
    return rows


def test_wandb_logs_every_record_to_the_active_run(tmp_path, offline_wandb):
    from hookplug_plugins.sinks.tensorboard import hist_tag, scalar_tag
    from hookplug_plugins.sinks.wandb import histogram_bins

    run = offline_wandb.init(project="hookplug-test", dir=str(tmp_path))
    rows = logged_rows(run)
    truth, s, m = run_steps("wandb", steps=3, flush_every=2)
    m.eval()
    m(torch.randn(4, 32))
    s.step()
    s.remove()
    assert offline_wandb.run is run  # a run the sink found active stays open
    # one row per step, x-axis hookplug/step, never step= (the trainer's counter is left alone)
    assert [r[0]["hookplug/step"] for r in rows] == [0, 1, 2, 3]
    assert all(args == () and kwargs == {} for _, args, kwargs in rows)
    by_step = {r[0]["hookplug/step"]: r[0] for r in rows}
    evals = [k for k in by_step[3] if k.startswith("hookplug_eval/max/")]
    assert len(evals) == 3 and not [k for k in by_step[3] if k.startswith("hookplug/max/")]
    assert {r["phase"] for r in truth} == {"train", "eval"}  # truth: every record emitted
    for rec in truth:
        row = by_step[rec["step"]]
        for stat in TB_STATS:
            assert same(row[scalar_tag(stat, rec["module"], rec["site"], rec["phase"])], rec[stat])
        assert scalar_tag("numel", rec["module"], rec["site"], rec["phase"]) not in row
        hist = row[hist_tag(rec["module"], rec["site"], rec["phase"])]
        counts, edges = histogram_bins(rec["hist"], rec["hist_edges"], rec["min"], rec["max"])
        assert [int(c) for c in hist.histogram] == counts and list(hist.bins) == edges
        assert sum(counts) == rec["numel"] - rec["nan_count"]
        assert edges[0] <= rec["min"] and rec["max"] <= edges[-1]
    assert run.summary["hookplug/max/fc2/output"] == by_step[2]["hookplug/max/fc2/output"]
    run.finish()


def test_wandb_sink_starts_and_finishes_a_run_of_its_own(tmp_path, offline_wandb):
    sink = _manager.create_plugin("wandb", {"path": str(tmp_path / "wb"), "stats": ("mean",),
                                            "init": {"tags": ["t1"]}})
    truth, s, _ = run_steps(sink, steps=2)
    run = sink.run
    assert run is not None and run.name == s.run_id and list(run.tags) == ["t1"]
    last = {r["module"]: r["mean"] for r in truth if r["step"] == 1}
    assert run.summary["hookplug/mean/fc3/output"] == last["fc3"]
    s.remove()
    assert sink.run is None and offline_wandb.run is None  # finished with the session
    assert [p.name for p in (tmp_path / "wb" / "wandb").glob("offline-run-*")]


def test_wandb_run_of_a_session_dropped_without_remove_is_finished_when_collected(tmp_path, offline_wandb):
    """A model and session dropped without remove(): the sink's own run stayed active, and
    the next session's wandb sink logged into it (under the old session's name)."""
    import gc

    model = MLP()
    s = hookplug.attach(model, "Linear", plugins="stats",
                        sink=("wandb", {"path": str(tmp_path / "a"), "stats": ("mean",)}), flush_every=1)
    model(torch.randn(2, 32))
    s.step()
    old = s["wandb"].run
    assert old is not None and old.name == s.run_id
    del s, model
    gc.collect()
    with pytest.raises(Exception, match="finished"):  # finished with its sink
        old.log({"x": 1})
    model = MLP()
    with hookplug.attach(model, "Linear", plugins="stats",
                         sink=("wandb", {"path": str(tmp_path / "b"), "stats": ("mean",)}), flush_every=1) as s:
        model(torch.randn(2, 32))
        s.step()
        assert s["wandb"].run is not old and s["wandb"].run.name == s.run_id


def test_wandb_run_shared_by_two_live_sessions_is_finished_by_the_last_to_end(tmp_path, offline_wandb):
    """A second session's sink given the run the first one's sink started (``run=``), or one
    sink serving two sessions: the first session's end finished the run under the second."""
    ma, mb = MLP(), MLP()
    a = hookplug.attach(ma, "Linear", plugins="stats", flush_every=1,
                        sink=("wandb", {"path": str(tmp_path / "a"), "stats": ("mean",)}))
    ma(torch.randn(2, 32))
    a.step()
    run = a["wandb"].run
    b = hookplug.attach(mb, "Linear", plugins="stats", flush_every=1, sink=("wandb", {"run": run}))
    mb(torch.randn(2, 32))
    b.step()
    a.remove()
    mb(torch.randn(2, 32))
    b.step()  # still logs into it
    assert not b.disabled
    b.remove()
    with pytest.raises(Exception, match="finished"):  # the last to end finished it
        run.log({"x": 1})

    from hookplug import _manager

    shared = _manager.create_plugin("wandb", {"path": str(tmp_path / "s"), "stats": ("mean",)})
    a = hookplug.attach(ma, "Linear", plugins="stats", flush_every=1, sink=shared)
    b = hookplug.attach(mb, "Linear", plugins="stats", flush_every=1, sink=shared)
    ma(torch.randn(2, 32)), mb(torch.randn(2, 32))
    a.step(), b.step()
    run = shared.run
    a.remove()
    mb(torch.randn(2, 32))
    b.step()
    assert not b.disabled and shared.run is run
    b.remove()
    with pytest.raises(Exception, match="finished"):
        run.log({"x": 1})


def test_wandb_sink_never_finishes_a_run_the_user_started(tmp_path, offline_wandb):
    """wandb.init() hands back a run already active (one the user made with
    reinit="create_new", not the process's wandb.run): the sink took it for its own and
    finished it at remove(). It logs into it, as into a run found active."""
    user = offline_wandb.init(project="mine", dir=str(tmp_path), reinit="create_new")
    try:
        m = MLP()
        with hookplug.attach(m, "Linear", plugins="stats", flush_every=1,
                             sink=("wandb", {"path": str(tmp_path / "s"), "stats": ("mean",)})) as s:
            m(torch.randn(2, 32))
            s.step()
            assert s["wandb"].run is user and not s["wandb"]._own_run
        user.log({"x": 1})  # still open
    finally:
        user.finish()


def test_wandb_run_started_by_the_sink_gets_the_exit_flush_of_a_session_never_removed(fresh_python):
    """wandb tears its run down in an atexit handler registered at wandb.init, i.e. after
    hookplug's (at attach), so it ran first: the exit flush of a session never removed failed
    ('Connection lost') and its last steps were lost. A fake wandb that does the same."""
    out = fresh_python(textwrap.dedent("""
        import atexit, json, sys, types
        import torch, hookplug

        logged = []

        class Run:
            finished = False
            def log(self, row):
                if self.finished:
                    raise ConnectionResetError("Connection lost")
                logged.append(row["hookplug/step"])
            def define_metric(self, *args, **kwargs):
                pass
            def finish(self):
                self.finished = True

        def init(**kwargs):
            run = Run()
            atexit.register(run.finish)  # wandb's own teardown at exit
            return run

        atexit.register(lambda: print(json.dumps(logged)))  # runs last
        sys.modules["wandb"] = types.SimpleNamespace(run=None, init=init, Histogram=None)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        s = hookplug.attach(model, "Linear", plugins="stats", sink=("wandb", {"histogram": False}),
                            flush_every=2)
        for _ in range(3):
            model(torch.randn(2, 4))
            s.step()
    """))
    assert out == "[0, 1, 2]"


def test_wandb_histogram_bins_trim_widen_and_merge_exactly():
    from hookplug_plugins.sinks.wandb import histogram_bins

    assert histogram_bins([0, 0], [0.0, 1.0, 2.0]) is None
    assert histogram_bins([0, 3, 0, 2, 0], [0, 1, 2, 3, 4, 5], 0.5, 9.0) == ([3, 0, 2], [0.5, 2, 3, 9.0])
    # a linear range's outside values get bins of their own (the outer bins spanned them uncounted)
    assert histogram_bins([1, 0, 1, 1], [0.0, 0.25, 0.5, 0.75, 1.0], -5.0, 7.0, below=1, above=2) == \
        ([1, 1, 0, 1, 1, 2], [-5.0, 0.0, 0.25, 0.5, 0.75, 1.0, 7.0])
    assert histogram_bins([0, 0], [0.0, 0.5, 1.0], -5.0, -1.0, below=3) == ([3], [-5.0, 0.0])
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    st = hookplug.ops.tensor_stats(x, bins=2000, hist="linear", range=(-5.0, 5.0))
    counts, edges = st.hist_counts.tolist(), st.hist_edges.tolist()
    got_counts, got_edges = histogram_bins(counts, edges)
    assert len(got_counts) <= 512 and len(got_edges) == len(got_counts) + 1
    assert sum(got_counts) == 10_000 and set(got_edges) <= set(edges)
    # every merged bucket holds exactly the values between its edges
    for c, lo, hi in zip(got_counts, got_edges, got_edges[1:]):
        assert c == int(((x >= lo) & (x < hi)).sum()) or hi == got_edges[-1]


def test_wandb_sink_rejects_bad_options(offline_wandb):
    with pytest.raises(_manager.PluginError, match="wandb Run"):
        _manager.create_plugin("wandb", {"run": object()})
    with pytest.raises(_manager.PluginError, match="unknown stats"):
        _manager.create_plugin("wandb", {"stats": ("maxx",)})


# -- optional dependencies -------------------------------------------------------------------------

@pytest.mark.parametrize("name, module, extra", [("prometheus", "prometheus_client", "prometheus"),
                                                 ("tensorboard", "tensorboard", "tensorboard"),
                                                 ("wandb", "wandb", "wandb")])
def test_missing_optional_dependency_names_the_extra(monkeypatch, name, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    cls = {"prometheus": "hookplug_plugins.sinks.prometheus:PrometheusSink",
           "tensorboard": "hookplug_plugins.sinks.tensorboard:TensorBoardSink",
           "wandb": "hookplug_plugins.sinks.wandb:WandbSink"}[name]
    mod_name, attr = cls.split(":")
    factory = getattr(__import__(mod_name, fromlist=[attr]), attr)
    with pytest.raises(ImportError, match=rf"pip install '?hookplug\[{extra}\]"):
        factory()
    # through attach: raises naming the sink (on_error="raise"), or warns and goes on without it
    with pytest.raises(_manager.PluginLoadError, match=rf"{name}.*hookplug\[{extra}\]"):
        hookplug.attach(MLP(), "Linear", plugins="stats", sink=name)
    with pytest.warns(RuntimeWarning, match=rf"{name}.*hookplug\[{extra}\]"):
        s = hookplug.attach(MLP(), "Linear", plugins="stats", sink=name, on_error="warn")
    assert name not in s.sinks
    s.remove()


def test_sink_option_given_a_plugin_that_is_no_sink_says_so(tmp_path):
    """sink="flops" (or a Sink subclass whose hookplug_flush lost its @hookimpl) was taken
    silently and the records went nowhere; it raises naming it (warns under on_error="warn")."""
    class Forgot:  # a plain third-party object: no class-definition warning to catch it
        name = "forgot"

        @hookplug.hookimpl
        def hookplug_session_start(self, session):
            pass

        def hookplug_flush(self, records):
            raise AssertionError("never called")

    for sink in ("flops", Forgot()):
        model = MLP()
        with pytest.raises(hookplug.PluginError, match=r"sink= got '(flops|forgot)', which is not a sink: "
                                                       r"it implements no @hookplug.hookimpl hookplug_flush"):
            hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1)
        assert not any(vars(m).get("_forward_hooks") for m in model.modules())
        with pytest.warns(RuntimeWarning, match="which is not a sink"):
            s = hookplug.attach(model, "Linear", plugins="stats", sink=[sink, ListSink()], flush_every=1,
                                on_error="warn")
        model(torch.randn(2, 32))
        s.step()
        assert list(s.sinks) == ["records"] and len(s["records"].records) == 3
        s.remove()


def test_prometheus_sink_serving_a_second_session_shows_its_steps(tmp_path):
    """A sink instance reused by the next session (close() says it may serve another): the
    gauges kept the first session's latest (higher) steps, so the second session's records,
    at steps from 0 again, never replaced them; the step gauge and histogram sums were stale."""
    from prometheus_client.parser import text_string_to_metric_families

    from hookplug_plugins.sinks.prometheus import PrometheusSink

    sink = PrometheusSink(port=None)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    seen = []
    for steps, value in ((3, 10.0), (1, 0.001)):
        ref = ListSink()
        with hookplug.attach(m, "Linear", plugins="stats", sink=[sink, ref], flush_every=1) as s:
            for _ in range(steps):
                m(torch.full((2, 4), value))
                s.step()
        fams = {f.name: f for f in text_string_to_metric_families(sink.exposition())}  # after remove()
        (absmax,) = fams["hookplug_tensor_absmax"].samples
        (count,) = [x for x in fams["hookplug_tensor_values"].samples if x.labels.get("le") == "+Inf"]
        seen.append((absmax.value, fams["hookplug_step"].samples[0].value, count.value))
        last = ref.records[-1]
        assert absmax.value == pytest.approx(last["absmax"]) and seen[-1][1] == last["step"]
        assert count.value == sum(r["numel"] for r in ref.records)
    assert seen[1][1:] == (0, 8)


# -- third-party sinks ---------------------------------------------------------------------------------

class FakeDist:
    metadata = {"Name": "hookplug-parquet"}
    version = "0.3"


class FakeEntryPoint:
    name, value, dist = "parquet", "hookplug_parquet:Sink", FakeDist()

    def load(self):
        return ListSink


def test_third_party_sink_through_the_entry_point(monkeypatch, fresh_discovery):
    real = _manager._entry_points()
    monkeypatch.setattr(_manager, "_entry_points", lambda: real + [FakeEntryPoint()])
    assert hookplug.plugin_names()["parquet"] == "hookplug-parquet 0.3"
    m = MLP()
    with hookplug.attach(m, "Linear", plugins="stats", sink="parquet", flush_every=1) as s:
        m(torch.randn(2, 32))
        s.step()
        got = s["parquet"].records
    assert {r["module"] for r in got} == {"fc1", "fc2", "fc3"} and len(got) == 3
    assert all(set(STATS) <= set(r) for r in got)


# -- the public Sink base ------------------------------------------------------------------------------

class CsvSink(hookplug.Sink):
    name, file_name, file_suffixes = "csv", "stats.csv", (".csv",)

    def __init__(self, path=None, **kw):
        super().__init__(path, **kw)
        self.closed = 0

    @hookplug.hookimpl
    def hookplug_flush(self, session, records):
        self.path = self.resolve_path(session)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(f"{r['step']},{r['module']},{r['site']},{r['mean']!r}\n" for r in records)

    def close(self):
        self.closed += 1


def test_sink_base_paths_placeholders_and_close(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 32)
    named = CsvSink(str(tmp_path / "exp-{run_id}" / "r{rank}"))
    default = CsvSink()
    file_path = CsvSink(str(tmp_path / "one.csv"))
    named.name, default.name = "csv_named", "csv_default"  # one session: distinct names
    with hookplug.attach(m, "Linear", plugins="stats", sink=[named, default, file_path]) as s:
        m(x)
        s.step()
        run_id, run_dir = s.run_id, s.run_dir
        mean = s["stats"].results()["fc1"]["output"].mean.item()
    assert run_dir == os.path.join("runs", run_id)
    assert named.path == str(tmp_path / f"exp-{run_id}" / "r0" / "stats.csv")
    assert default.path == os.path.join(run_dir, "stats.csv") and os.path.exists(tmp_path / default.path)
    assert file_path.path == str(tmp_path / "one.csv")
    rows = [line.split(",") for line in open(file_path.path).read().splitlines()]
    assert {(r[1], r[2]) for r in rows} == {("fc1", "output"), ("fc2", "output"), ("fc3", "output")}
    assert float(next(r for r in rows if r[1] == "fc1")[3]) == mean
    assert named.closed == default.closed == file_path.closed == 1
    assert named.writes_on(0) and not named.writes_on(1) and CsvSink(all_ranks=True).writes_on(3)
    assert repr(file_path) == f"<CsvSink {file_path.path}>"


def test_sink_whose_init_skips_the_base_init_writes_to_the_run_dir(tmp_path, monkeypatch):
    """A subclass ``__init__`` not calling ``super().__init__()`` worked until ``repr()`` or
    ``resolve_path`` read the attributes the base sets (AttributeError)."""
    monkeypatch.chdir(tmp_path)

    class OwnInit(hookplug.Sink):
        name, file_name = "own", "own.txt"

        def __init__(self):
            self.seen = 0

        @hookplug.hookimpl
        def hookplug_flush(self, session, records):
            self.path = self.resolve_path(session)
            self.seen += len(records)

    sink = OwnInit()
    assert repr(sink) == f"<OwnInit {os.path.join('runs', '<run-id>')}>"
    m = MLP()
    with hookplug.attach(m, "Linear", plugins="stats", sink=sink) as s:
        m(torch.randn(2, 32))
        s.step()
    assert sink.seen == 3 and sink.path == os.path.join(s.run_dir, "own.txt")
    assert sink.writes_on(0) and not sink.writes_on(1)


def test_sink_base_rejects_unknown_placeholders():
    with pytest.raises(ValueError, match=r"csv sink: path 'runs/\{epoch\}' has the placeholder \{epoch\}"):
        CsvSink("runs/{epoch}")
    for bad in ("runs/{", "runs/{rank.x}", "runs/{rank[0]}"):
        with pytest.raises(ValueError, match="not a valid template"):
            CsvSink(bad)


def test_sink_base_rejects_positional_placeholders():
    for bad in ("out/{0}", "out/{}/x", "out/{rank}{1}"):
        with pytest.raises(ValueError, match=r"csv sink: path '.*' has a positional placeholder \(\{\} or \{0\}\), "
                                             r"which is not allowed; only \{rank\}, \{run_id\} are filled in"):
            CsvSink(bad)


def test_sink_method_without_hookimpl_warns_when_the_class_is_defined():
    with pytest.warns(RuntimeWarning, match=r"ForgotSink\.hookplug_flush is named like a hookplug hook but is not "
                                            r"marked @hookplug.hookimpl") as record:
        class ForgotSink(hookplug.Sink):
            name = "forgot"

            def hookplug_flush(self, session, records):
                pass

    assert len(record) == 1


@pytest.mark.parametrize("kind", ["jsonl", "tensorboard", "prometheus"])
def test_a_session_dropped_without_remove_releases_its_sinks_files_threads_and_port(tmp_path, kind):
    """A session and its model dropped without remove() (an exception escaping a training
    function, a notebook cell run again): the sink's file, writer thread or server goes with
    them (each run kept a file descriptor, a writer thread or the port for good)."""
    import gc
    import weakref

    if kind == "tensorboard":
        pytest.importorskip("tensorboard")
    if kind == "prometheus":
        pytest.importorskip("prometheus_client")
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    gc.collect()
    before_fds, before_threads = fds(), threading.active_count()
    port = None
    for run in range(3):
        model = MLP()
        if kind == "prometheus":
            sink = ("prometheus", {"port": port or 0})
        else:
            sink = (kind, {"path": str(tmp_path / f"run{run}")})
        s = hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1)
        if kind == "prometheus":
            port = s.sinks["prometheus"].port  # the next run asks for the same port
        model(torch.randn(2, 32)).sum().backward()
        s.step()
        gone = weakref.ref(s)
        del s, model
        gc.collect()
        assert gone() is None
    assert fds() == before_fds
    assert threading.active_count() == before_threads


def test_wandb_sink_finish_error_reaches_the_session(tmp_path, offline_wandb):
    """An error finishing its own run was swallowed (the run left active, unreported)."""
    m = MLP()
    s = hookplug.attach(m, "Linear", plugins="stats", flush_every=1,
                        sink=("wandb", {"path": str(tmp_path / "s"), "stats": ("mean",)}))
    m(torch.randn(2, 32))
    s.step()
    run = s["wandb"].run
    finish = run.finish

    def failing(*args, **kwargs):
        raise OSError("upload failed")

    run.finish = failing
    try:
        with pytest.raises(OSError, match="upload failed"):
            s.remove()
    finally:
        finish()
