"""Reports in this process: the run collector, stats merging, the terminal table (rich and
plain text with the same content), JSON, the self-contained HTML, TensorBoard, plot_features."""
from __future__ import annotations

import io
import json
import re
import sys
from html.parser import HTMLParser

import pytest
import torch

import hookplug
from hookplug import _report
from hookplug._cli import ShapeRecorder
from hookplug.models import MLP, tiny_cnn


def _run(model, x, selector="*", plugins=("stats", "flops"), steps=2, backward=False):
    """What `hookplug profile` does, in this process: the document of a run."""
    recorder = ShapeRecorder()
    session = hookplug.attach(model, selector, plugins=[*plugins, recorder])
    collector = _report.Collector(session, skip=(recorder.name,))
    try:
        for step in range(steps):
            out = model(x[step] if isinstance(x, list) else x)
            if backward:
                out.float().mean().backward()
            collector.after_step(step)
            session.step()
        return _report.build_document(
            session=session, collector=collector, recorder=recorder,
            meta={"model": {"spec": "mlp", "label": "mlp", "class": type(model).__name__,
                            "params": sum(p.numel() for p in model.parameters()),
                            "modules": sum(1 for _ in model.modules())},
                  "input": {"description": "16x32 float32", "shape": [16, 32], "dtype": "float32",
                            "source": "random"},
                  "selector": selector, "plugins": list(plugins), "device": "cpu", "seed": 0,
                  "steps": steps, "backward": backward, "step_seconds": [0.01] * steps},
            param_count=lambda m: sum(p.numel() for p in m.parameters()))
    finally:
        session.remove()


@pytest.fixture(scope="module")
def mlp_doc():
    torch.manual_seed(0)
    model = MLP()
    xs = [torch.randn(16, 32), torch.randn(16, 32) * 3]
    return model, xs, _run(model, xs)


# -- collecting a run ------------------------------------------------------------------------

def test_steps_merged_on_the_host_equal_the_plugins_own_merge(mlp_doc):
    model, xs, doc = mlp_doc
    with hookplug.attach(model, "*", plugins="stats") as s:  # no reset: the plugin merges itself
        for x in xs:
            model(x)
            s.step()
        own = {m: {p: ts.to_dict() for p, ts in paths.items()} for m, paths in s["stats"].results().items()}
    assert list(doc["modules"]) == ["fc1", "fc2", "fc3"]
    for name, paths in own.items():
        mine = doc["modules"][name]["stats"]
        assert set(mine) == set(paths)
        for path, d in paths.items():
            for k in ("numel", "nan_count", "inf_count", "zero_count", "hist_counts", "hist_edges"):
                assert mine[path][k] == d[k], (name, path, k)
            for k in ("min", "max", "mean", "std", "absmax"):
                assert mine[path][k] == pytest.approx(d[k], rel=1e-9, abs=1e-12), (name, path, k)


def test_flops_are_per_step_and_calls_per_first_step(mlp_doc):
    _, _, doc = mlp_doc
    fc2 = doc["modules"]["fc2"]
    assert fc2["calls"] == 2  # fc2 runs twice per forward
    assert fc2["flops"]["flops"] == 2 * (2 * 16 * 64 * 64)  # both calls, one step (not two)
    assert doc["totals"]["flops"] == sum(m["flops"]["flops"] for m in doc["modules"].values())
    assert doc["totals"]["model_flops"]["flops"] == doc["totals"]["flops"]
    assert fc2["output_shape"] == [16, 64]


def test_merge_stats_matches_stats_of_the_concatenation():
    a = torch.randn(1000, dtype=torch.float64)
    b = torch.randn(300, dtype=torch.float64) * 5 + 2
    b[:3] = float("nan")
    b[3] = float("inf")
    a[:10] = 0
    from hookplug.ops import reference_tensor_stats as ts

    merged = _report.merge_stats(ts(a).to_dict(), ts(b).to_dict())
    whole = ts(torch.cat([a, b])).to_dict()
    for k in ("numel", "nan_count", "inf_count", "zero_count", "hist_counts", "hist_edges"):
        assert merged[k] == whole[k], k
    for k in ("min", "max", "mean", "std", "absmax"):
        assert merged[k] == pytest.approx(whole[k], rel=1e-12), k
    assert _report.merge_stats(None, whole) == whole
    assert _report.merge_stats(whole, {}) == whole


def test_top_level_modules_do_not_count_children_twice():
    assert _report._top_level(["a", "a.b", "a.b.c", "d", "ab"]) == ["a", "d", "ab"]
    assert _report._top_level(["", "a"]) == [""]


def test_nested_selection_totals_count_each_parameter_once():
    model = tiny_cnn().eval()
    doc = _run(model, torch.randn(1, 3, 32, 32), selector="*:layer1, Conv2d:layer1.*", steps=1)
    assert doc["totals"]["params"] == sum(p.numel() for p in model.layer1.parameters())
    assert doc["totals"]["flops"] == doc["modules"]["layer1"]["flops"]["flops"]


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


def test_formatting():
    assert _report.fmt_si(101_470_208) == "101M"
    assert _report.fmt_si(38_535_168) == "38.5M"
    assert _report.fmt_si(999) == "999"
    assert _report.fmt_si(999_999) == "1M"
    assert _report.fmt_float(None) == "-" and _report.fmt_float(float("nan")) == "-"
    assert _report.fmt_float(0.00035208) == "3.52e-4"
    assert _report.fmt_float(-2.339359) == "-2.339"
    assert _report.fmt_float(123456.0) == "1.23e+5"
    assert _report.fmt_shape([8, 16, 32, 32]) == "8x16x32x32"


def test_table_leaves_out_columns_of_plugins_not_run(mlp_doc):
    _, _, doc = mlp_doc
    bare = dict(doc, plugins_active=[])
    cols, rows, total, _ = _report.profile_table(bare)
    assert [c for c, _ in cols] == ["module", "class", "output", "params"]
    assert all(len(r) == 4 for r in rows)


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
    page = _report.render_html(evil)
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
    assert "no values recorded" in _report._hist_svg("m", None)
    assert "bins=0" in _report._hist_svg("m", {"numel": 4, "hist_counts": [], "hist_edges": []})
    edges = [-4.0, -2.0, -1.0, 1.0, 2.0, 4.0]
    svg = _report._hist_svg("m", {"hist_counts": [0, 1, 3, 0, 2], "hist_edges": edges})
    assert svg.count("<rect") == 4  # trimmed to the first and last non-empty bucket
    assert 'class="zero"' in svg and 'class="neg"' in svg and 'class="pos"' in svg


def test_log2_histogram_collapses_long_empty_runs():
    from hookplug.ops import reference_tensor_stats

    x = torch.cat([torch.full((10,), 1e-9), torch.full((10,), 100.0)])
    d = reference_tensor_stats(x).to_dict()
    svg = _report._hist_svg("m", d)
    assert 'class="gap"' in svg  # the ~35 empty buckets between 2^-30 and 2^6 become one break
    assert svg.count('class="pos"') == 2


# -- TensorBoard -----------------------------------------------------------------------------

def test_tensorboard_writer(tmp_path, mlp_doc):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, xs, _ = mlp_doc
    recorder = ShapeRecorder()
    writer = _report.TensorBoardWriter(str(tmp_path))
    with hookplug.attach(model, "Linear", plugins=["stats", "flops", recorder]) as s:
        collector = _report.Collector(s, skip=(recorder.name,))
        for step, x in enumerate(xs):
            model(x)
            writer.write_step(step, collector.after_step(step))
            s.step()
    writer.close()
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    # the tensorboard sink's layout (hookplug._tb): one stat across layers in one group
    assert [e.step for e in ea.Scalars("hookplug/max/fc1/output")] == [0, 1]
    assert "hookplug/flops/fc2" in ea.Tags()["scalars"]
    assert not [t for t in ea.Tags()["scalars"] if t.endswith("/numel")]
    h = ea.Histograms("hookplug/hist/fc1/output")[0].histogram_value
    assert h.num == 16 * 64 and sum(h.bucket) == 16 * 64


def test_tensorboard_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _report.TensorBoardWriter("unused")


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


def test_plot_features_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"hookplug\[plot\]"):
        hookplug.plot_features(torch.randn(3, 4, 4), tmp_path / "x.png")
