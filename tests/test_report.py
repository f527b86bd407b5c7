"""Reports in this process: the run document built from the plugins' report sections and
the telemetry records (checked against a float64 reference), the terminal table (rich and
plain text with the same content), JSON, the self-contained HTML, TensorBoard through the
sink, plot_features."""
from __future__ import annotations

import io
import json
import re
import sys
from html.parser import HTMLParser

import pytest
import torch

import hookplug
from hookplug.cli import _commands, _html, _report
from hookplug.cli._commands import RunRecords, ShapeRecorder
from hookplug.models import MLP, tiny_cnn


def _run(model, x, selector="*", plugins=("stats", "flops"), steps=2, backward=False):
    """What `hookplug profile` does, in this process: the document of a run."""
    recorder, records = ShapeRecorder(), RunRecords()
    if backward:
        plugins = [("stats", {"sites": ("output", "grad")}) if p == "stats" else p for p in plugins]
    session = hookplug.attach(model, selector, plugins=[*plugins, recorder], sink=records, flush_every=1)
    try:
        for step in range(steps):
            out = model(x[step] if isinstance(x, list) else x)
            if backward:
                out.float().mean().backward()
            session.step()
        session.flush()
        return _report.build_document(session, records.records, hidden=(recorder.name,), meta={
            "model": {"spec": "mlp", "label": "mlp", "class": type(model).__name__,
                      "params": sum(p.numel() for p in model.parameters()),
                      "modules": sum(1 for _ in model.modules())},
            "input": {"description": "16x32 float32", "shape": [16, 32], "dtype": "float32", "source": "random"},
            "selector": selector, "plugins": [p if isinstance(p, str) else getattr(p, "name", None) or p[0] for p in plugins],
            "device": "cpu", "seed": 0, "steps": steps, "backward": backward, "step_seconds": [0.01] * steps})
    finally:
        session.remove()


def _reference(tensors):
    """float64 stats of the concatenation of ``tensors`` (plain torch)."""
    x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return {"numel": x.numel(), "nan_count": int(x.isnan().sum()), "min": x.min().item(),
            "max": x.max().item(), "mean": x.mean().item(), "std": x.std(correction=0).item()}


@pytest.fixture(scope="module")
def mlp_doc():
    torch.manual_seed(0)
    model = MLP()
    xs = [torch.randn(16, 32), torch.randn(16, 32) * 3]
    return model, xs, _run(model, xs)


@pytest.fixture(scope="module")
def backward_run():
    """A 2-step forward+backward run, with every Linear output and output grad kept by plain
    torch hooks: the float64 reference for the document's stats."""
    torch.manual_seed(0)
    model = MLP()
    xs = [torch.randn(16, 32), torch.randn(16, 32) * 3]
    seen = {}

    def keep(name):
        def hook(mod, args, out):
            seen.setdefault((name, "output"), []).append(out.detach().clone())
            out.register_hook(lambda g: seen.setdefault((name, "grad"), []).append(g.clone()))
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        doc = _run(model, xs, selector="Linear", backward=True)
    finally:
        for h in handles:
            h.remove()
    return doc, seen


# -- the run document --------------------------------------------------------------------------

def test_document_stats_equal_a_float64_reference_of_outputs_and_grads(backward_run):
    doc, seen = backward_run
    assert list(doc["modules"]) == ["fc1", "fc2", "fc3"]
    for name, m in doc["modules"].items():
        assert set(m["stats"]) == {"output", "grad"}
        for site in ("output", "grad"):
            want, got = _reference(seen[(name, site)]), m["stats"][site]
            for k in ("numel", "nan_count", "min", "max"):
                assert got[k] == want[k], (name, site, k)
            for k in ("mean", "std"):  # the op sums float32 values in float32 lanes before float64
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6 * want["std"]), (name, site, k)
            assert sum(got["hist_counts"]) == got["numel"]


def test_profile_json_equals_a_float64_reference_of_the_same_run(tmp_path, capsys):
    """`hookplug profile mlp --backward --steps 2 --json`: rebuild the model and inputs as the
    command does (seed 0) and compare its JSON with plain torch hooks' float64 numbers."""
    assert _commands.main(["profile", "mlp", "--backward", "--steps", "2", "--plain", "--json",
                           str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    torch.manual_seed(0)
    model, gen, seen = MLP(), torch.Generator().manual_seed(0), {}
    for name in ("fc1", "fc3"):  # fc2 runs twice per step; the selector's Linear layers
        def hook(mod, args, out, name=name):
            seen.setdefault((name, "output"), []).append(out.detach().clone())
            out.register_hook(lambda g: seen.setdefault((name, "grad"), []).append(g.clone()))
        getattr(model, name).register_forward_hook(hook)
    for _ in range(2):
        model(torch.randn(16, 32, generator=gen)).float().mean().backward()
    assert len(seen) == 4
    for (name, site), tensors in seen.items():
        want, got = _reference(tensors), doc["modules"][name]["stats"][site]
        assert (got["numel"], got["min"], got["max"]) == (want["numel"], want["min"], want["max"])
        for k in ("mean", "std"):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6 * want["std"]), (name, site, k)


def test_document_stats_are_the_stats_plugins_own_results(mlp_doc):
    model, xs, doc = mlp_doc
    with hookplug.attach(model, "*", plugins="stats") as s:
        for x in xs:
            model(x)
            s.step()
        own = {m: {p: ts.to_dict() for p, ts in paths.items()} for m, paths in s["stats"].results().items()}
    assert {m: doc["modules"][m]["stats"] for m in own} == _report._clean_floats(own)


def test_telemetry_records_are_in_the_document_per_step(mlp_doc):
    _, _, doc = mlp_doc
    recs = doc["telemetry"]
    assert sorted({(r["step"], r["module"], r["site"]) for r in recs}) == [
        (s, m, "output") for s in (0, 1) for m in ("fc1", "fc2", "fc3")]
    fc1 = {r["step"]: r for r in recs if r["module"] == "fc1"}
    assert fc1[0]["numel"] + fc1[1]["numel"] == doc["modules"]["fc1"]["stats"]["output"]["numel"]
    assert max(fc1[0]["max"], fc1[1]["max"]) == doc["modules"]["fc1"]["stats"]["output"]["max"]


def test_flops_are_per_step_and_calls_per_first_step(mlp_doc):
    _, _, doc = mlp_doc
    fc2 = doc["modules"]["fc2"]
    assert fc2["calls"] == 2  # fc2 runs twice per forward
    assert fc2["flops"]["flops"] == 2 * (2 * 16 * 64 * 64)  # both calls, one step (not two)
    assert doc["totals"]["flops"] == sum(m["flops"]["flops"] for m in doc["modules"].values())
    assert fc2["output_shape"] == [16, 64]
    assert doc["kinds"] == ["stats", "flops"]


class Noted(hookplug.Plugin):
    name = "noted"

    @hookplug.hookimpl
    def hookplug_report_section(self, session):
        return {"summary": [f"noted saw {len(session.modules)} modules"], "count": 3}


def test_a_plugins_report_section_reaches_the_document():
    model = MLP()
    doc = _run(model, torch.randn(16, 32), selector="Linear", plugins=("flops", Noted()), steps=1)
    assert "noted saw 3 modules" in doc["notes"]
    assert doc["extra"]["noted"] == {"count": 3}
    assert "uncounted" in doc["extra"]["flops"]
    assert doc["kinds"] == ["flops"] and all(m["stats"] is None for m in doc["modules"].values())
    plain = io.StringIO()
    _report.print_profile(doc, use_rich=False, file=plain)
    assert "noted saw 3 modules" in plain.getvalue()


def test_a_report_section_that_is_no_dict_is_a_plugin_error():
    """A section returned as a string was kept by ``report_sections()`` and silently dropped
    from the report."""

    class Texty(hookplug.Plugin):
        name = "texty"

        @hookplug.hookimpl
        def hookplug_report_section(self, session):
            return "a line of text"

    model = MLP()
    with hookplug.attach(model, "Linear", plugins=[Noted(), Texty()]) as s:
        with pytest.raises(TypeError, match="hookplug_report_section must return a dict or None, got str"):
            s.report_sections()
    with pytest.warns(RuntimeWarning, match="texty"):
        with hookplug.attach(model, "Linear", plugins=[Noted(), Texty()], on_error="warn") as s:
            assert list(s.report_sections()) == ["noted"]


def test_top_level_modules_do_not_count_children_twice():
    assert _report._top_level(["a", "a.b", "a.b.c", "d", "ab"]) == ["a", "d", "ab"]
    assert _report._top_level(["", "a"]) == [""]


def test_nested_selection_totals_count_each_parameter_once():
    model = tiny_cnn().eval()
    doc = _run(model, torch.randn(1, 3, 32, 32), selector="*:layer1, Conv2d:layer1.*", steps=1)
    assert doc["totals"]["params"] == sum(p.numel() for p in model.layer1.parameters())
    assert doc["totals"]["flops"] == doc["modules"]["layer1"]["flops"]["flops"]


def test_flops_total_counts_the_children_of_a_container_that_never_runs():
    from hookplug.models import tiny_transformer

    model = tiny_transformer().eval()
    doc = _run(model, torch.randint(0, 100, (2, 8)), selector="*", steps=2)
    mods = doc["modules"]
    assert mods["layers"]["calls"] == 0 and mods["layers"]["flops"]["flops"] == 0  # a ModuleList
    want = mods["layers.0"]["flops"]["flops"] + mods["layers.1"]["flops"]["flops"] + mods["head"]["flops"]["flops"]
    assert want > 0 and doc["totals"]["flops"] == want


# -- terminal ----------------------------------------------------------------------------------

def _cells(text):
    return set(re.findall(r"[^\s│─┃━]+", text))


def test_plain_and_rich_tables_have_the_same_content(mlp_doc):
    _, _, doc = mlp_doc
    cols, rows, total, _ = _report.profile_table(doc)
    plain = io.StringIO()
    _report.print_profile(doc, use_rich=False, file=plain)
    text = plain.getvalue()
    for row in rows + [total]:
        for cell in row:
            assert cell in text
    assert "fc2 (x2)" in text
    pytest.importorskip("rich")
    rich_out = io.StringIO()
    _report.print_profile(doc, use_rich=True, file=rich_out)
    assert _cells(rich_out.getvalue()) >= _cells(text) - {"-" * n for n in range(1, 40)}


def test_rich_table_on_a_narrow_terminal_cuts_no_cell(mlp_doc, monkeypatch):
    pytest.importorskip("rich")
    _, _, doc = mlp_doc
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, 50 columns
    monkeypatch.setenv("COLUMNS", "50")
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = io.StringIO()
    _report.print_profile(doc, use_rich=True, file=out)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    cols, rows, total, _ = _report.profile_table(doc)
    assert "…" not in text
    for row in [[t for t, _ in cols]] + rows:
        for cell in row:
            assert cell in text, (cell, text)


def test_formatting():
    assert _report.fmt_si(101_470_208) == "101M"
    assert _report.fmt_si(38_535_168) == "38.5M"
    assert _report.fmt_si(999) == "999"
    assert _report.fmt_si(999_999) == "1M"
    assert _report.fmt_float(None) == "-" and _report.fmt_float(float("nan")) == "-"
    assert _report.fmt_float(0.00035208) == "3.52e-4"
    assert _report.fmt_float(-2.339359) == "-2.339"
    assert _report.fmt_float(123456.0) == "1.23e+5"
    # one form from 1e4 on (.4g gave 1.235e+04 and 1e+04 beside 1.00e+5)
    assert [_report.fmt_float(v) for v in (12345.6, 9999.5, 99999.9, 1e5, 1234.5)] == \
        ["1.23e+4", "1.00e+4", "1.00e+5", "1.00e+5", "1234"]
    assert _report.fmt_si(1.5e21, "F") == "1.5e+21F"  # past the E prefix (was 1.5e+03E)
    assert _report.fmt_shape([8, 16, 32, 32]) == "8x16x32x32"


@pytest.mark.parametrize("sites", [("input",), ("grad",)])
def test_input_or_grad_stats_are_not_shown_as_the_output_columns(sites):
    """With only input (or grad) sites, their stats filled the min/max/mean/std/NaN columns
    under the output heading; then the columns stayed, every cell "-", beside a totals row and
    an HTML card of "0" NaN in outputs no one measured (the input held one)."""
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    x[0, 0] = float("nan")
    doc = _run(MLP(), [x, x], plugins=[("stats", {"sites": sites})], steps=2, backward="grad" in sites)
    assert all(m["primary"] is None for m in doc["modules"].values())
    cols, rows, total, _ = _report.profile_table(doc)
    titles = [c for c, _ in cols]
    assert not {"min", "max", "mean", "std", "NaN", "Inf"} & set(titles)
    assert ("grad NaN" in titles) == ("grad" in sites)
    page = _html.render_html(doc)
    assert "NaN values" not in page and "Output distributions" not in page
    assert ("Gradient distributions" in page) == ("grad" in sites)
    assert "statistics over all 2 steps" in _report._summary_lines(doc)  # no FLOPs were counted


def test_table_leaves_out_columns_of_plugins_not_run(mlp_doc):
    _, _, doc = mlp_doc
    bare = dict(doc, kinds=[])
    cols, rows, total, _ = _report.profile_table(bare)
    assert [c for c, _ in cols] == ["module", "class", "output", "params"]
    assert all(len(r) == 4 for r in rows)


def test_grad_stats_are_in_the_table_and_the_html(backward_run):
    doc, _ = backward_run
    cols, rows, total, _ = _report.profile_table(doc)
    titles = [c for c, _ in cols]
    assert titles[-4:] == ["grad absmax", "grad std", "grad NaN", "grad Inf"]
    fc3 = rows[list(doc["modules"]).index("fc3")]
    assert fc3[titles.index("grad std")] == _report.fmt_float(doc["modules"]["fc3"]["stats"]["grad"]["std"])
    assert total[-2:] == ["0", "0"]
    page = _html.render_html(doc)
    assert page.count('<svg class="hist grad"') == len(doc["modules"]) == 3
    assert "Gradient distributions" in page and "grad std</th>" in page


def test_select_tree():
    model = tiny_cnn()
    lines = _report.selection_lines(model, ["layer1.0.conv1", "fc"], file=io.StringIO())
    labels = [(text.split()[-1], cls, params, matched) for text, cls, params, matched in lines]
    assert labels == [("ResNetLike", "", "", False), ("layer1", "Sequential", "", False),
                      ("0", "BasicBlock", "", False), ("conv1", "Conv2d", "2,304", True),
                      ("fc", "Linear", "1,290", True)]


# -- JSON ------------------------------------------------------------------------------------

def test_json_is_strict_and_compact(mlp_doc):
    _, _, doc = mlp_doc
    bad = dict(doc, extra={"x": float("nan"), "y": [float("inf"), 1.0], "t": torch.tensor([1.0, float("nan")])})
    text = _report.to_json(_report._clean_floats(_report._jsonable(bad)))

    def reject(const):
        raise AssertionError(const)

    back = json.loads(text, parse_constant=reject)
    assert back["extra"] == {"x": None, "y": [None, 1.0], "t": [1.0, None]}
    assert re.search(r'"hist_counts": \[\d+, \d+', text)  # number lists on one line
    assert back["modules"]["fc1"]["stats"]["output"]["numel"] == 16 * 64 * 2


# -- HTML ------------------------------------------------------------------------------------

def test_html_escapes_names_and_has_no_urls(mlp_doc):
    _, _, doc = mlp_doc
    evil = dict(doc)
    evil["modules"] = {f"<img src=http://x/{k}>": v for k, v in doc["modules"].items()}
    evil["selector"] = "<script src='https://e.vil/x.js'></script>"
    page = _html.render_html(evil)
    assert "<img" not in page and "<script src" not in page

    class Attrs(HTMLParser):
        found = []

        def handle_starttag(self, tag, attrs):
            self.found += [(tag, k, v) for k, v in attrs if k in ("src", "href") or tag == "img"]

    parser = Attrs()
    parser.feed(page)
    assert parser.found == []
    assert page.count('<svg class="hist"') == len(doc["modules"])
    assert page.count("<tr data-module=") == len(doc["modules"])


def test_histogram_svg_handles_empty_and_missing_stats():
    assert "no values recorded" in _html._hist_svg("m", None)
    assert "bins=0" in _html._hist_svg("m", {"numel": 4, "hist_counts": [], "hist_edges": []})
    edges = [-4.0, -2.0, -1.0, 1.0, 2.0, 4.0]
    svg = _html._hist_svg("m", {"hist_counts": [0, 1, 3, 0, 2], "hist_edges": edges})
    assert svg.count("<rect") == 4  # trimmed to the first and last non-empty bucket
    assert 'class="zero"' in svg and 'class="neg"' in svg and 'class="pos"' in svg


def test_linear_histogram_with_every_value_outside_its_range_says_so():
    """A linear histogram counts only the values inside its range: one whose finite values
    all fall outside it has no bar, and said "no finite values", which the numbers beside it
    contradict."""
    from hookplug.ops import reference_tensor_stats

    x = torch.tensor([1.0, -2.0, 3.0, float("nan")])
    svg = _html._hist_svg("m", reference_tensor_stats(x, bins=3, hist="linear", range=(100, 200)).to_dict())
    assert "no finite values" not in svg and "3 finite values, all outside [100, 200]" in svg, svg
    nonfinite = torch.tensor([float("nan"), float("inf")])  # nothing finite: as before
    svg = _html._hist_svg("m", reference_tensor_stats(nonfinite, bins=3, hist="linear", range=(100, 200)).to_dict())
    assert "no finite values" in svg


def test_log2_histogram_collapses_long_empty_runs():
    from hookplug.ops import reference_tensor_stats

    x = torch.cat([torch.full((10,), 1e-9), torch.full((10,), 100.0)])
    d = reference_tensor_stats(x).to_dict()
    svg = _html._hist_svg("m", d)
    assert 'class="gap"' in svg  # the ~35 empty buckets between 2^-30 and 2^6 become one break
    assert svg.count('class="pos"') == 2


def _svg_titles(svg):
    import html as _h

    return [_h.unescape(t) for t in re.findall(r"<title>(.*?)</title>", svg)]


def test_log2_histogram_labels_its_open_ended_buckets_truthfully():
    from hookplug.ops import reference_tensor_stats

    x = torch.tensor([3e38, float("inf"), -1e30, 1e-30, 1e-40])  # past 2^33 and below 2^-32
    svg = _html._hist_svg("m", reference_tensor_stats(x).to_dict())
    titles = _svg_titles(svg)
    assert "2³² to ∞: 2" in titles and "−∞ to −2³²: 1" in titles and "0 to 2⁻³¹: 2" in titles, titles
    assert not any("2³³" in t or "2⁻³²" in t for t in titles)


def test_linear_histogram_edges_are_labelled_apart():
    from hookplug.ops import reference_tensor_stats

    x = torch.tensor([1.0, 1.00004, 1.00006])
    d = reference_tensor_stats(x, bins=10, hist="linear", range=(1.0, 1.0001)).to_dict()
    titles = _svg_titles(_html._hist_svg("m", d))
    assert titles[0] == "1 to 1.00001: 1" and "1.00004 to 1.00005: 1" in titles, titles
    doc = {**_lin_doc(d)}
    page = _html.render_html(doc)
    assert "log2 histogram" not in page and "equal buckets" in page


def _lin_doc(stats):
    return {"model": {"class": "M", "label": "m", "spec": "m", "params": 0, "modules": 1},
            "input": {"description": "3 float32", "source": "random"}, "device": "cpu", "selector": "*",
            "kinds": ["stats"], "plugins_active": ["stats"], "totals": {"modules": 1, "params": 0},
            "modules": {"a": {"class": "C", "params": 0, "calls": 1, "outputs": {}, "output_shape": [3],
                              "flops": None, "stats": {"output": stats}, "primary": "output"}}}


# -- TensorBoard -----------------------------------------------------------------------------

def _tb_tags(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    return ea


@pytest.mark.parametrize("backward", [False, True])
def test_profile_tensorboard_writes_the_sinks_tags(tmp_path, capsys, backward):
    pytest.importorskip("tensorboard")
    from hookplug_plugins.sinks.tensorboard import DEFAULT_SCALARS, hist_tag, scalar_tag

    args = ["profile", "mlp", "--steps", "2", "--tensorboard", tmp_path, "--plain"] + ["--backward"] * backward
    assert _commands.main([str(a) for a in args]) == 0
    ea = _tb_tags(tmp_path)
    phase = "train" if backward else "eval"  # forward-only profiling runs the model in eval mode
    sites = ("output", "grad") if backward else ("output",)
    want = {scalar_tag(k, m, site, phase) for k in DEFAULT_SCALARS for m in ("fc1", "fc2", "fc3") for site in sites}
    assert set(ea.Tags()["scalars"]) == want
    assert set(ea.Histograms(hist_tag("fc1", "output", phase))[i].step for i in range(2)) == {0, 1}
    assert [e.step for e in ea.Scalars(scalar_tag("max", "fc1", "output", phase))] == [0, 1]
    h = ea.Histograms(hist_tag("fc2", "output", phase))[0].histogram_value
    assert h.num == 2 * 16 * 64 and sum(h.bucket) == 2 * 16 * 64  # fc2 runs twice per step


def test_tensorboard_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(_commands.UsageError, match="pip install tensorboard"):
        _commands._tensorboard_writer("unused", _commands._Created())


# -- plot_features ---------------------------------------------------------------------------

def test_plot_features_from_a_tensor_and_a_capture(tmp_path):
    pytest.importorskip("matplotlib")
    path = hookplug.plot_features(torch.randn(2, 6, 8, 8), tmp_path / "t.png", max_channels=4)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = tiny_cnn().eval()
    with hookplug.attach(model, "Conv2d:layer1.*", plugins="capture") as s:
        model(torch.randn(1, 3, 32, 32))
        first = hookplug.plot_features(s["capture"], tmp_path / "c.png", max_channels=4)
        many = hookplug.plot_features(s, tmp_path / "f_{module}.png", max_channels=2)
    assert first.stat().st_size > 0
    assert [p.name for p in many] == ["f_layer1.0.conv1.png", "f_layer1.0.conv2.png"]
    with pytest.raises(KeyError, match="captured"):
        hookplug.plot_features({"a": torch.randn(3, 4, 4)}, tmp_path / "x.png", module="b")
    with pytest.raises(TypeError, match="capture"):
        hookplug.plot_features(object(), tmp_path / "x.png")
    for bad in (dict(ncols=-2), dict(ncols=0), dict(dpi=0), dict(max_channels=True), dict(ncols=2.5)):
        (what,) = bad
        with pytest.raises(ValueError, match=rf"plot_features: {what} must be an int >= 1"):
            hookplug.plot_features(torch.randn(6, 8, 8), tmp_path / "x.png", **bad)
    assert hookplug.plot_features(torch.randn(6, 8, 8), tmp_path / "n.png", ncols=3).exists()


def test_plot_features_says_what_it_cannot_draw_and_skips_modules_without_a_tensor(tmp_path):
    """Empty, nested, sparse and meta tensors (capture keeps them all) raised ZeroDivisionError
    or torch internals; a module captured as None stopped a ``{module}`` run part way."""
    pytest.importorskip("matplotlib")
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    for t, match in ((torch.zeros(0, 8, 8), "is empty"), (torch.zeros(1, 0, 4, 4), "is empty"),
                     (nested, "a nested tensor"), (torch.randn(4, 4).to_sparse(), "sparse"),
                     (torch.empty(2, 3, 4, device="meta"), "a meta tensor")):
        with pytest.raises(ValueError, match=match):
            hookplug.plot_features(t, tmp_path / "x.png")
    with pytest.warns(RuntimeWarning, match=r"no file for 'b' \('b' holds no tensor\); 'd' \(.*is empty"):
        paths = hookplug.plot_features({"a": torch.randn(3, 4, 4), "b": None, "c": torch.randn(2, 4, 4),
                                        "d": torch.zeros(0, 4, 4)}, tmp_path / "{module}.png")
    assert [p.name for p in paths] == ["a.png", "c.png"]
    with pytest.raises(ValueError, match="virdis"):  # a bad option is the caller's, not a module's
        hookplug.plot_features({"a": torch.randn(3, 4, 4)}, tmp_path / "{module}.png", cmap="virdis")
    q = torch.quantize_per_tensor(torch.randn(2, 4, 4), 0.1, 0, torch.quint8)
    assert hookplug.plot_features(q, tmp_path / "q.png").exists()


def test_plot_features_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"hookplug\[plot\]"):
        hookplug.plot_features(torch.randn(3, 4, 4), tmp_path / "x.png")


def test_plugin_listing_shows_brackets_of_a_description_as_text():
    pytest.importorskip("rich")
    rows = [{"name": "clip", "origin": "hookplug-clip 0.1 [dev]", "status": "ok", "entry_point": "clip:Clip",
             "description": "Clamp outputs to [lo, hi] per module [/b]"}]
    out = io.StringIO()
    _report.print_plugins(rows, use_rich=True, file=out)  # was MarkupError, or "[lo, hi]" dropped
    text = " ".join(out.getvalue().split())
    assert "Clamp outputs to [lo, hi] per module [/b]" in text and "[dev]" in text
