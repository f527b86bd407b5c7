"""The ``hookplug`` command, run as a user runs it: a subprocess on the installed console
script (or ``python -m hookplug`` when the script is not installed)."""
from __future__ import annotations

import errno
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest

import hookplug
from hookplug.models import DEMO_MODELS

_SCRIPT = shutil.which("hookplug", path=str(Path(sys.executable).parent)) or shutil.which("hookplug")
COMMAND = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "hookplug"]
ENV = {**os.environ, "HOOKPLUG_PLAIN": "", "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}
ENV.pop("HOOKPLUG_DEBUG", None)


def run(*args, cwd=None, env=None, timeout=120):
    return subprocess.run([*COMMAND, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**ENV, **(env or {})}, timeout=timeout)


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def call(capsys, monkeypatch):
    """``main(argv)`` in this process (same code path, no interpreter start-up): for the
    cases beyond the one subprocess run per subcommand and per kind of user error."""
    from hookplug.__main__ import main

    def _call(*args, cwd=None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return _Result(rc, out, err)

    return _call


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _expected_modules(model_name, selector):
    factory = DEMO_MODELS[model_name][0]
    return [n for n, _ in hookplug.select(factory(), selector)]


# -- the entry points ---------------------------------------------------------------------

def test_python_m_and_version(call):
    proc = subprocess.run([sys.executable, "-m", "hookplug", "--help"], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0 and "profile" in proc.stdout and "select" in proc.stdout
    assert call("--version").returncode == 0


# -- plugins --------------------------------------------------------------------------------

def test_plugins_lists_first_party_with_status(call):
    proc = ok(run("plugins", "--plain"))
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.strip()}
    for name in ("stats", "flops", "capture", "gradclamp"):
        assert name in lines, proc.stdout
        assert "first-party" in lines[name] and " ok " in lines[name] + " "
    rows = json.loads(ok(call("plugins", "--json")).stdout)
    by_name = {r["name"]: r for r in rows}
    assert {"name", "origin", "status", "entry_point", "description"} <= set(rows[0])
    assert by_name["stats"]["origin"] == "first-party" and by_name["stats"]["status"] == "ok"
    # a docstring's first paragraph as plain text: no Sphinx roles or literal marks, no
    # sentence cut where the docstring's line ended, no pointer to the module docstring
    assert by_name["stats"]["description"].startswith("Per module and site, a hookplug.TensorStats of every")
    assert by_name["capture"]["description"].endswith("inputs and output gradients).")
    for row in rows:
        assert not re.search(r":\w+:`|``|module docstring", row["description"]), row


def test_plugin_descriptions_unmark_sphinx_roles():
    from hookplug.cli._commands import _doc_summary

    doc = """A :class:`~torch.nn.Module` wrapper, :func:`x.f <x.f>` and ``opts``
        over two lines (see the module docstring).

        Details not shown."""
    assert _doc_summary(doc) == "A Module wrapper, x.f and opts over two lines."
    assert _doc_summary(None) == ""


# -- select ---------------------------------------------------------------------------------

def test_select_prints_a_tree_with_classes_and_params(call):
    proc = ok(run("select", "cnn", "Conv2d:layer1.*, Linear", "--plain"))
    out = proc.stdout
    assert out.splitlines()[0].startswith("ResNetLike (cnn)")
    # ancestors are shown for context, matched modules with their class and parameter count
    assert re.search(r"layer1\s+\(Sequential\)", out), out
    assert re.search(r"conv1\s+Conv2d\s+2,304", out), out
    assert re.search(r"fc\s+Linear\s+1,290", out), out
    assert "3 of 44 modules match 'Conv2d:layer1.*, Linear'" in out
    names = ok(call("select", "cnn", "Conv2d:layer1.*, Linear", "--names")).stdout.split()
    assert names == _expected_modules("cnn", "Conv2d:layer1.*, Linear")


def test_select_a_factory_from_a_file_and_from_a_module(tmp_path, call):
    (tmp_path / "mymodel.py").write_text(
        "import torch.nn as nn\n"
        "def make(hidden=8):\n"
        "    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))\n"
    )
    out = ok(run("select", "mymodel.py:make(hidden=16)", "Linear", "--plain", cwd=tmp_path)).stdout
    assert re.search(r"0\s+Linear\s+80\b", out) and re.search(r"2\s+Linear\s+51\b", out), out
    names = ok(call("select", "hookplug.models:tiny_cnn", "Linear", "--names")).stdout.split()
    assert names == ["fc"]


def test_select_counts_a_tied_parameter_once_and_hints_at_the_root(tmp_path, call):
    (tmp_path / "tied.py").write_text(
        "import torch.nn as nn\n"
        "def make():\n"
        "    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))\n"
        "    m[1].weight = m[0].weight\n"
        "    return m\n"
        "def single():\n"
        "    return nn.Linear(2, 3)\n"
    )
    out = ok(run("select", "tied.py:make", "Embedding, Linear", "--plain", cwd=tmp_path)).stdout
    assert "40 of 40 parameters" in out, out  # (was 80 of 40: the tied weight twice)
    doc = json.loads(ok(run("profile", "tied.py:make", "--select", "Embedding|Linear", "--input", "2x3",
                            "--json", "-", "--plain", cwd=tmp_path)).stdout)
    assert doc["totals"]["params"] == doc["model"]["params"] == 40, doc["totals"]
    err = run("select", "tied.py:single", "Linear", "--plain", cwd=tmp_path).stderr
    assert "`hookplug select tied.py:single \"*, *:\"`" in err and "is the root" in err, err


def test_select_shows_the_selectors_warnings_before_the_list(tmp_path, call):
    """A term that matches nothing, or only containers no forward calls: `select` is where a
    user checks a selector, so the warnings attach() would give are printed (they were hidden)."""
    proc = ok(call("select", "cnn", "Conv2d:layer1.*, Linear:fcc", "--names"))
    assert proc.stdout.split() == _expected_modules("cnn", "Conv2d:layer1.*")
    assert "warning:" in proc.stderr and "'Linear:fcc'" in proc.stderr and "'fc'" in proc.stderr, proc.stderr
    (tmp_path / "stack.py").write_text(
        "import torch.nn as nn\n"
        "class Stack(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])\n"
        "    def forward(self, x):\n"
        "        for b in self.blocks:\n"
        "            x = b(x)\n"
        "        return x\n")
    proc = ok(call("select", "stack.py:Stack", "ModuleList", "--names", cwd=tmp_path))
    assert proc.stdout.split() == ["blocks"]
    assert "containers with no forward" in proc.stderr and "'*:blocks.*'" in proc.stderr, proc.stderr
    quiet = ok(call("select", "cnn", "Conv2d:layer1.*, Linear", "--names"))
    assert quiet.stderr == "", quiet.stderr


def test_select_names_a_submodule_compiled_in_place_as_the_plain_model(tmp_path, call):
    """``self.net = torch.compile(self.net)``: the tree and names have no ``_orig_mod``
    segment (they are select()'s names; the tree used to look them up in the raw
    ``named_modules()`` and raised KeyError)."""
    (tmp_path / "compiledmod.py").write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n")
    out = ok(run("select", "compiledmod.py:M", "Linear", "--plain", cwd=tmp_path)).stdout
    assert re.search(r"0\s+Linear\s+40\b", out) and re.search(r"2\s+Linear\s+27\b", out), out
    assert "_orig_mod" not in out and "2 of 5 modules match 'Linear'" in out, out
    names = ok(run("select", "compiledmod.py:M", "Linear", "--names", cwd=tmp_path)).stdout.split()
    assert names == ["net.0", "net.2"]


# -- profile ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    """The README's demo, `hookplug profile cnn`, writing the JSON and HTML reports too."""
    d = tmp_path_factory.mktemp("reports")
    proc = ok(run("profile", "cnn", "--plain", "--json", d / "out" / "r.json", "--html", d / "r.html"))
    assert f"wrote {d / 'out' / 'r.json'}" in proc.stderr and f"wrote {d / 'r.html'}" in proc.stderr
    return {"stdout": proc.stdout, "json": json.loads((d / "out" / "r.json").read_text()),
            "html": (d / "r.html").read_text(), "names": _expected_modules("cnn", "Conv2d|Linear")}


def test_profile_demo_prints_the_per_module_table(cnn_run):
    out = cnn_run["stdout"].splitlines()
    assert out[0].startswith("hookplug profile: ResNetLike (cnn) · input 8x3x64x64 float32 · cpu")
    header = next(line for line in out if line.startswith("module"))
    assert header.split() == ["module", "class", "output", "params", "FLOPs", "min", "max", "mean", "std",
                              "NaN", "Inf"]
    names = cnn_run["names"]
    rows = [line for line in out if line.split() and line.split()[0] in names]
    assert [r.split()[0] for r in rows] == names
    conv1 = rows[0].split()
    assert conv1[1:5] == ["Conv2d", "8x16x32x32", "2,352", "38.5M"]
    assert conv1[-2:] == ["0", "0"]
    total = next(line for line in out if line.startswith("total (13 modules)"))
    assert "309,306" in total and "101M" in total
    assert any(line.startswith("model: 310,746 parameters") for line in out)


def _no_nan(const):
    raise AssertionError(f"non-standard JSON constant {const}")


STAT_KEYS = {"numel", "nan_count", "inf_count", "zero_count", "min", "max", "mean", "std", "absmax",
             "hist_counts", "hist_edges"}


def test_profile_json_schema(cnn_run):
    doc, names = cnn_run["json"], cnn_run["names"]
    assert {"hookplug_version", "model", "input", "selector", "plugins", "plugins_active", "device", "seed",
            "steps", "backward", "step_seconds", "modules", "totals", "disabled", "extra"} <= set(doc)
    assert doc["model"]["class"] == "ResNetLike" and doc["model"]["params"] == 310746
    assert doc["input"]["shape"] == [8, 3, 64, 64] and doc["input"]["dtype"] == "float32"
    assert doc["steps"] == 1 and doc["backward"] is False and len(doc["step_seconds"]) == 1
    assert doc["selector"] == "Conv2d|Linear" and doc["plugins_active"] == ["stats", "flops"]
    assert list(doc["modules"]) == names
    for name, m in doc["modules"].items():
        assert {"class", "params", "calls", "output_shape", "outputs", "flops", "stats"} <= set(m), name
        assert set(m["flops"]) >= {"flops", "macs", "params", "backward_flops"}
        assert m["flops"]["flops"] > 0 and m["flops"]["backward_flops"] == 0, name
        assert m["calls"] == 1
        assert list(m["stats"]) == ["output"]
        out = m["stats"]["output"]
        assert STAT_KEYS <= set(out)
        assert sum(out["hist_counts"]) == out["numel"] - out["nan_count"]
        assert out["min"] <= out["mean"] <= out["max"]
    conv1 = doc["modules"]["conv1"]
    assert conv1["class"] == "Conv2d" and conv1["params"] == 2352
    assert conv1["output_shape"] == [8, 16, 32, 32] and conv1["stats"]["output"]["numel"] == 8 * 16 * 32 * 32
    t = doc["totals"]
    assert {"modules", "params", "flops", "macs", "backward_flops", "numel", "nan_count",
            "inf_count"} <= set(t)
    assert t["modules"] == len(names)
    assert t["params"] == sum(m["params"] for m in doc["modules"].values())
    assert t["flops"] == sum(m["flops"]["flops"] for m in doc["modules"].values())
    assert t["nan_count"] == 0 and t["inf_count"] == 0


def test_profile_backward_steps_and_a_module_called_twice_in_rich(tmp_path):
    pytest.importorskip("rich")
    proc = ok(run("profile", "mlp", "--select", "*", "--steps", "3", "--backward", "--json", tmp_path / "m.json"))
    assert "fc2 (x2)" in proc.stdout
    assert "statistics over all 3 steps" in proc.stdout
    assert "forward+backward · 3 steps" in proc.stdout
    doc = json.loads((tmp_path / "m.json").read_text(), parse_constant=_no_nan)
    assert doc["steps"] == 3 and doc["backward"] is True and len(doc["step_seconds"]) == 3
    fc2 = doc["modules"]["fc2"]
    assert fc2["calls"] == 2
    assert fc2["flops"]["flops"] == 2 * (2 * 16 * 64 * 64)  # per step: two calls of a 64x64 Linear
    assert fc2["flops"]["backward_flops"] > 0
    assert set(fc2["stats"]) == {"output", "grad"}  # with --backward the gradients are measured too
    assert fc2["stats"]["output"]["numel"] == 3 * 2 * 16 * 64  # three steps, two calls each
    assert STAT_KEYS <= set(fc2["stats"]["grad"])
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("module"))
    assert "grad std" in header and "grad NaN" in header  # gradient stats in the table too
    assert {r["site"] for r in doc["telemetry"]} == {"output", "grad"}
    assert sorted({r["step"] for r in doc["telemetry"]}) == [0, 1, 2]
    fc2_out = [r for r in doc["telemetry"] if r["module"] == "fc2" and r["site"] == "output"]
    assert [r["calls"] for r in fc2_out] == [2, 2, 2] and {r["numel"] for r in fc2_out} == {2 * 16 * 64}
    assert {"zero_count", "l2", "rms", "zero_fraction"} <= set(fc2_out[0])


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.rows, self.hists, self.charts, self.urls, self.scripts = [], [], [], 0, [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("src", "href", "xlink:href", "action", "data"):
            if a.get(key):
                self.urls.append(a[key])
        if tag == "script":
            self.scripts.append(a)
        if tag == "tr" and "tbody" in self.stack and "data-module" in a:
            self.rows.append(a["data-module"])
        if tag == "svg" and "hist" in (a.get("class") or "").split():
            self.hists.append(a.get("data-module"))
        if tag == "svg" and "flops-chart" in (a.get("class") or "").split():
            self.charts += 1
        self.stack.append(tag)

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop() == tag:
                break


def test_profile_html_is_self_contained_with_a_row_and_a_histogram_per_module(cnn_run):
    page = _Page()
    page.feed(cnn_run["html"])
    names = cnn_run["names"]
    assert page.rows == names
    assert page.hists == names
    assert page.charts == 1
    assert not [u for u in page.urls if re.match(r"\s*(https?:)?//", u)], page.urls
    assert all("src" not in s for s in page.scripts)
    assert "<link" not in cnn_run["html"] and "@import" not in cnn_run["html"]


def test_profile_transformer_takes_int64_tokens_and_json_to_stdout(call):
    proc = ok(call("profile", "transformer", "--select", "Linear:head", "--json", "-"))
    doc = json.loads(proc.stdout, parse_constant=_no_nan)
    assert doc["input"]["dtype"] == "int64" and doc["input"]["shape"] == list(DEMO_MODELS["transformer"][1])
    assert list(doc["modules"]) == ["head"]


def test_profile_plugin_options(call):
    doc = json.loads(ok(call("profile", "mlp", "--plugins", "stats(bins=0), flops", "--json", "-")).stdout)
    assert doc["plugins_active"] == ["stats", "flops"]
    assert doc["modules"]["fc1"]["stats"]["output"]["hist_counts"] == []


def test_profile_degrades_without_stats_and_flops(tmp_path, call):
    (tmp_path / "m.py").write_text("import torch.nn as nn\nmodel = nn.Sequential(nn.Linear(4, 3), nn.Tanh())\n")
    proc = ok(call("profile", "m.py:model", "--input", "2x4", "--plugins", "capture", "--select", "*",
                  "--plain", cwd=tmp_path))
    header = next(line for line in proc.stdout.splitlines() if line.startswith("module"))
    assert header.split() == ["module", "class", "output", "params"]
    assert re.search(r"^0\s+Linear\s+2x3\s+15$", proc.stdout, re.M), proc.stdout


def test_profile_input_file(tmp_path, call):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    st.save_file({"x": torch.randn(3, 32)}, str(tmp_path / "x.safetensors"))
    proc = ok(call("profile", "mlp", "--input-file", tmp_path / "x.safetensors", "--json", "-"))
    doc = json.loads(proc.stdout)
    assert doc["input"]["source"].endswith("x.safetensors")
    assert doc["modules"]["fc1"]["output_shape"] == [3, 64]


def test_profile_tensorboard(tmp_path, call):
    proc = call("profile", "mlp", "--steps", "2", "--tensorboard", tmp_path / "tb", "--plain")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert proc.returncode == 2 and "pip install tensorboard" in proc.stderr
        return
    ok(proc)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    ea.Reload()  # the tensorboard sink's layout (hookplug_plugins.sinks.tensorboard); forward-only runs in eval mode
    assert [e.step for e in ea.Scalars("hookplug_eval/max/fc1/output")] == [0, 1]
    assert "hookplug_eval/hist/fc3/output" in ea.Tags()["histograms"]


# -- user errors: one line on stderr, exit status 2, no traceback ---------------------------------

# one subprocess per kind of user error the issue names: model spec, selector, shape,
# plugin name, missing file; the variations of each run in this process through main()
ERRORS = {
    "unknown demo": (["profile", "cnnn"], "Did you mean 'cnn'"),
    "no such module": (["profile", "no_such_pkg_hp.models:make"], "cannot import module"),
    "no such model file": (["profile", "missing_file.py:make"], "no such file"),
    "bad shape": (["profile", "cnn", "--input", "8xfoo"], "expected a shape"),
    "shape the model rejects": (["profile", "mlp", "--input", "4x7"], "failed on input 4x7"),
    "selector syntax": (["profile", "cnn", "--select", "Conv2d|"], "bad selector"),
    "selector matches nothing": (["select", "cnn", "Conv2x"], "Conv2d"),
    "unknown plugin": (["profile", "mlp", "--plugins", "stats,nope"], "unknown hookplug plugin 'nope'"),
    "missing input file": (["profile", "mlp", "--input-file", "nowhere.safetensors"], "no such file"),
}

MORE_ERRORS = {
    "no such factory": (["profile", "hookplug.models:no_such_factory"], "has no attribute"),
    "factory is not a model": (["select", "os:getcwd", "Linear"], "not a torch.nn.Module"),
    "factory arguments": (["select", "cnn(width=)", "Linear"], "cannot read the arguments"),
    "factory raises": (["select", "cnn(depth=3)", "Linear"], "calling the factory failed"),
    "input required": (["profile", "hookplug.models:tiny_cnn"], "--input SHAPE is required"),
    "zero in shape": (["profile", "mlp", "--input", "0x32"], "expected a shape"),
    "profile matches nothing": (["profile", "cnn", "--select", "Conv2d:nothing.*"], "matched no module"),
    "select selector syntax": (["select", "cnn", "Conv2d:re:("], "bad selector"),
    "empty plugin list": (["profile", "mlp", "--plugins", ","], "--plugins"),
    "unknown plugin option": (["profile", "mlp", "--plugins", "stats(bins_=0)"], "unknown option 'bins_'"),
    "bad plugin option": (["profile", "mlp", "--plugins", "stats(bins=-1)"], "rejected its options"),
    "bad device": (["profile", "mlp", "--device", "tpu"], "--device"),
    "bad dtype": (["profile", "mlp", "--dtype", "int8"], "--dtype"),
    "bad steps": (["profile", "mlp", "--steps", "0"], "--steps"),
    "bad input file": (["profile", "mlp", "--input-file", "x.txt"], "--input-file"),
    "missing argument": (["select", "cnn"], "required"),
    "unknown command": (["frobnicate"], "invalid choice"),
    "shape past int64": (["profile", "cnn", "--input", "99999999999999999999x3"], "the shape is too large"),
    "numel past int64": (["profile", "mlp", "--input", "4611686018427387904x4"], "the shape is too large"),
    "tensorboard is a file": (["profile", "mlp", "--tensorboard", "x.txt"], "is a file, expected a folder"),
    "tensorboard empty": (["profile", "mlp", "--tensorboard", ""], "expected a folder name, got ''"),
    "json empty": (["profile", "mlp", "--json", " "], "expected a file name or '-', got ' '"),
    "plugin given twice": (["profile", "mlp", "--plugins", "stats,stats(bins=0)"], "plugin 'stats' is given twice"),
    "seed past 64 bits": (["profile", "mlp", "--seed", "99999999999999999999999"], "--seed"),
}


@pytest.fixture(scope="module")
def error_runs():
    """Run every error case at once (each is a fresh interpreter: mostly torch's import time)."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {key: pool.submit(run, *args) for key, (args, _) in ERRORS.items()}
        return {key: f.result() for key, f in futures.items()}


def _check_error(proc, expected):
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hookplug: error: ") and expected in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_error_is_one_line_and_exit_status_2(case, error_runs):
    _check_error(error_runs[case], ERRORS[case][1])


@pytest.mark.parametrize("case", list(MORE_ERRORS))
def test_more_user_errors_in_process(case, call, tmp_path):
    (tmp_path / "x.txt").write_text("not tensors")
    args, expected = MORE_ERRORS[case]
    _check_error(call(*args, cwd=tmp_path), expected)


@pytest.mark.parametrize("where", ["x.txt/sub", "/proc/hookplug-no-such-dir"])
def test_tensorboard_folder_that_cannot_be_created(where, call, tmp_path):
    pytest.importorskip("tensorboard")
    if where.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc, where no folder can be created")
    (tmp_path / "x.txt").write_text("a file")
    _check_error(call("profile", "mlp", "--tensorboard", where, cwd=tmp_path),
                 "cannot create or write the folder")


@pytest.mark.parametrize("option", ["--json", "--html"])
def test_report_file_that_cannot_be_written_fails_before_the_run(option, call, tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc, where no file can be created")
    _check_error(call("profile", "mlp", option, "/proc/hookplug-report.out", cwd=tmp_path),
                 "cannot write the file")  # one line: no table printed before it
    ok = tmp_path / "sub" / "r.out"
    assert call("profile", "mlp", option, str(ok), cwd=tmp_path).returncode == 0 and ok.stat().st_size


def test_parse_plugins_keeps_distinct_plugins_in_order():
    from hookplug.cli._commands import UsageError, _parse_plugins

    assert _parse_plugins("stats(bins=0),flops") == [("stats", {"bins": 0}), ("flops", {})]
    with pytest.raises(UsageError, match="given twice"):
        _parse_plugins("stats,flops,stats")


@pytest.mark.parametrize("plain", ["", "1"])
def test_stdout_closed_early_still_writes_the_reports_and_exits_0(plain, tmp_path):
    """``hookplug profile ... --html r.html | head -1``: the table hits a closed pipe; the
    reports asked for are written all the same, and the status is 0 with rich as without."""
    r, w = os.pipe()
    os.close(r)  # a reader that is gone before the first line
    try:
        proc = subprocess.run([*COMMAND, "profile", "mlp", "--html", "r.html", "--json", "r.json"], cwd=tmp_path,
                              stdout=w, stderr=subprocess.PIPE, text=True, env={**ENV, "HOOKPLUG_PLAIN": plain},
                              timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "r.html").stat().st_size and json.loads((tmp_path / "r.json").read_text())["modules"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_stdout_on_a_full_device_still_writes_the_reports_and_fails_in_one_line(tmp_path):
    """stdout on /dev/full (ENOSPC, not a closed pipe): the table's write failed with a
    traceback and the reports were never written; now they are, and one error line says
    what failed (exit status 2)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*COMMAND, "profile", "mlp", "--plain", "--html", "r.html", "--json", "r.json"],
                              cwd=tmp_path, stdout=full, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["hookplug: error: cannot write to stdout: No space left on device"], proc.stderr
    assert (tmp_path / "r.html").stat().st_size and json.loads((tmp_path / "r.json").read_text())["modules"]


class _FullStdout(io.StringIO):
    """A stdout on a full disk: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("args", [["profile", "mlp", "--json", "-", "--html", "r.html"],
                                  ["profile", "mlp", "--plain", "--html", "r.html"],
                                  ["select", "mlp", "Linear"], ["select", "mlp", "Linear", "--names"],
                                  ["plugins", "--json"], ["plugins", "--plain"]])
def test_a_stdout_that_cannot_be_written_is_one_error_line(args, call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdout", _FullStdout())
    proc = call(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    wrote = ["hookplug: wrote r.html"] if "--html" in args else []
    assert proc.stderr.splitlines() == [*wrote, f"hookplug: error: cannot write to stdout: {os.strerror(errno.ENOSPC)}"]
    if wrote:  # written all the same
        assert "<svg" in (tmp_path / "r.html").read_text()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_report_that_cannot_be_written_does_not_keep_the_others_from_being_written(call, tmp_path):
    proc = call("profile", "mlp", "--plain", "--json", "/dev/full", "--html", "ok.html", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["hookplug: error: cannot write JSON report '/dev/full': No space left on device"], proc.stderr
    assert "<svg" in (tmp_path / "ok.html").read_text()


def test_profile_ignores_a_rank_left_in_the_environment(call, tmp_path, monkeypatch):
    """``RANK=1`` left over from torchrun: the one-process CLI took itself for a rank other
    than 0, whose sinks write nothing (an empty ``telemetry``, no TensorBoard scalars), and
    still reported success. It attaches with ``distributed=False``."""
    monkeypatch.setenv("RANK", "1")
    tb = importlib.util.find_spec("tensorboard") is not None
    args = ["profile", "mlp", "--plain", "--steps", "2", "--json", "r.json"] + (["--tensorboard", "tb"] if tb else [])
    ok(call(*args, cwd=tmp_path))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["telemetry"]) == 6 and {r["step"] for r in doc["telemetry"]} == {0, 1}
    if tb:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(str(tmp_path / "tb"))
        ea.Reload()
        assert "hookplug_eval/max/fc1/output" in ea.Tags()["scalars"]


@pytest.mark.parametrize("args", [["profile", "nosuch"],                               # fails loading the model
                                  ["profile", "mlp", "--select", "Linear:nothing.*"],  # fails at attach
                                  ["profile", "mlp", "--input", "4x7"]])               # fails running it
def test_a_failed_profile_leaves_nothing_behind(args, call, tmp_path):
    """The report folders and the TensorBoard folder (with an empty events file) were made
    before the run and left behind when it failed; now only what was there before stays."""
    pytest.importorskip("tensorboard")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("mine")
    proc = call(*args, "--tensorboard", "tb", "--json", "a/b/r.json", "--html", "old/sub/r.html", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["old", "old/keep.txt"]
    # an existing TensorBoard folder keeps what it held; only the run's events file goes
    proc = call(*args, "--tensorboard", "old", cwd=tmp_path)
    assert proc.returncode == 2
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["old", "old/keep.txt"]


def test_a_model_file_that_exits_or_parses_its_own_arguments(tmp_path, call):
    """A script's unguarded ``sys.exit(main())`` ran as a success with no table (rc 0); a
    factory calling ``sys.exit("...")`` gave rc 1 and no message; a top-level argparse read
    hookplug's own arguments. Now: one error line and status 2, and the file sees
    ``sys.argv == [file]`` as under ``python file.py``."""
    (tmp_path / "script.py").write_text(textwrap.dedent("""
        import sys, torch.nn as nn
        def make():
            return nn.Sequential(nn.Linear(4, 2))
        sys.exit(0)
        """))
    (tmp_path / "fexit.py").write_text(textwrap.dedent("""
        import sys
        def make():
            sys.exit("cannot build: missing weights")
        """))
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import argparse, sys, torch.nn as nn
        ARGV = list(sys.argv)
        args = argparse.ArgumentParser().parse_args()
        def make():
            assert len(ARGV) == 1 and ARGV[0].endswith("train.py"), ARGV
            return nn.Sequential(nn.Linear(4, 2))
        """))
    got = call("profile", "script.py:make", "--input", "2x4", "--plain", cwd=tmp_path)
    assert got.returncode == 2 and "called sys.exit(0)" in got.stderr and got.stdout == "", got.stderr
    got = call("select", "fexit.py:make", "*", cwd=tmp_path)
    assert got.returncode == 2 and "cannot build: missing weights" in got.stderr, got.stderr
    got = call("profile", "train.py:make", "--input", "2x4", "--plain", cwd=tmp_path)
    assert got.returncode == 0 and "0" in got.stdout, got.stderr


def test_a_plugin_that_cannot_attach_is_an_error_and_one_failing_in_the_run_exits_1(tmp_path, call):
    """gradclamp with nothing to do, or a sink whose folder is a file, was dropped with a
    warning and the run exited 0: now status 2 before the run; a sink failing during the
    run (its warnings as before) makes the exit status 1 once the reports are written."""
    (tmp_path / "afile").write_text("x")
    got = call("profile", "mlp", "--plain", "--backward", "--plugins", "gradclamp", cwd=tmp_path)
    assert got.returncode == 2 and "nothing to do" in got.stderr and "attached without it" not in got.stderr, got.stderr
    got = call("profile", "mlp", "--plain", "--plugins", 'stats,jsonl(path="afile")', cwd=tmp_path)
    assert got.returncode == 2 and "a file is where a folder must be" in got.stderr, got.stderr
    target = tmp_path / "gone"
    target.mkdir()

    def vanish(*args, **kwargs):
        raise OSError(28, "No space left on device")

    import hookplug_plugins.sinks.jsonl as jsonl

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jsonl.JsonlSink, "_open", vanish)  # (the hook itself, as the disk fills)
        got = call("profile", "mlp", "--plain", "--json", "run.json", "--plugins",
                   f'stats,jsonl(path="{target}")', cwd=tmp_path)
    assert got.returncode == 1 and "failed during the run" in got.stderr, got.stderr
    assert "'jsonl' failed and is disabled" in got.stderr, got.stderr
    assert (tmp_path / "run.json").exists()  # the reports are written first
    # a report section that fails leaves its plugin collecting, but the report is not whole
    import hookplug_plugins.flops as flops

    def broken(self, session):
        raise RuntimeError("section broke")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flops.FlopsPlugin.hookplug_report_section, "__code__", broken.__code__)
        got = call("profile", "mlp", "--plain", "--json", "sec.json", cwd=tmp_path)
    assert got.returncode == 1 and "'flops' failed during the run" in got.stderr, got.stderr
    doc = json.loads((tmp_path / "sec.json").read_text())
    assert doc["failed_sections"] == {"flops": "RuntimeError in hookplug_report_section: section broke"}
    assert "plugin 'flops' left out of the report" in got.stdout


def test_json_and_html_on_one_file_is_refused(tmp_path, call):
    got = call("profile", "mlp", "--json", "same.out", "--html", "same.out", cwd=tmp_path)
    assert got.returncode == 2 and "the same file" in got.stderr and not (tmp_path / "same.out").exists()


def test_attach_warnings_follow_the_warning_filters(tmp_path):
    """Warnings raised while the CLI attaches are recorded and shown after its checks: under
    ``PYTHONWARNINGS=ignore`` they stay silent (recording them with "always" and replaying
    them went around the filters)."""
    args = ("profile", "cnn", "--plain", "--backward", "--plugins",
            "stats,gradclamp(max=1.0,params='nomatch*')")
    loud = run(*args, cwd=tmp_path, env={"PYTHONWARNINGS": "default"})
    quiet = run(*args, cwd=tmp_path, env={"PYTHONWARNINGS": "ignore"})  # (the tests' ENV's)
    assert loud.returncode == quiet.returncode == 0, (loud.stderr, quiet.stderr)
    assert "nomatch" in loud.stderr and "nomatch" not in quiet.stderr, (loud.stderr, quiet.stderr)
