"""Issue 13: hostile input and faults — selectors, config files, the jsonl sink, capture and
its files, the CLI. Each test names the item it covers."""
import contextlib
import errno
import json
import os
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.nn as nn

import hookplug
from hookplug import SelectorError, select
from hookplug._selectors import parse_selector
from hookplug._config import ConfigError, load_config, parse_config
from hookplug.models import MLP, resnet34_like


def _names(model, sel):
    return [n for n, _ in select(model, sel)]


def _long_named(n_chars):
    """A model whose one Linear has a name of ``n_chars`` word characters."""
    return nn.ModuleDict({"a" * n_chars: nn.Linear(1, 1)})


# -- 8. a dotted class name never imports a module ------------------------------------------------

@pytest.fixture
def canary_module(tmp_path, monkeypatch):
    """An importable module that, when imported, leaves a marker file (and defines Block)."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "hp_canary_mod.py").write_text(textwrap.dedent(f"""
        import pathlib
        import torch.nn as nn
        pathlib.Path({str(marker)!r}).write_text("imported")

        class Block(nn.Linear):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hp_canary_mod", raising=False)
    return marker


def test_item8_dotted_selector_does_not_import_a_module(canary_module):
    model = nn.Sequential(nn.Linear(1, 1))
    with pytest.raises(SelectorError, match="'hp_canary_mod' is not imported") as info:
        select(model, "hp_canary_mod.Block")
    assert "import it before selecting" in str(info.value)
    assert not canary_module.exists(), "the selector imported the module"
    assert "hp_canary_mod" not in sys.modules


def test_item8_this_zen_prints_nothing(capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "this", raising=False)
    with pytest.raises(SelectorError, match="not imported"):
        select(nn.Sequential(nn.Linear(1, 1)), "this.Zen")
    assert capsys.readouterr().out == ""
    assert "this" not in sys.modules


def test_item8_selector_from_a_config_file_does_not_import(tmp_path, canary_module):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[plugins.stats]\nselect = "hp_canary_mod.Block"\n')
    with pytest.raises(SelectorError, match="not imported"):
        hookplug.attach(MLP(), config=str(cfg))
    assert not canary_module.exists()


def test_item8_imported_modules_and_torch_paths_still_resolve(canary_module):
    import importlib

    mod = importlib.import_module("hp_canary_mod")  # the user imports it: now it may be named
    model = nn.Sequential(mod.Block(1, 1), nn.Linear(1, 1))
    assert _names(model, "hp_canary_mod.Block") == ["0"]
    assert _names(model, "torch.nn.Linear") == ["0", "1"]
    assert _names(model, "torch.nn.modules.linear.Linear") == ["0", "1"]
    with pytest.raises(SelectorError, match="has no class 'NoSuchThing'"):
        select(model, "torch.nn.NoSuchThing")


# -- 9. regexes and nesting: bounded time, named errors -------------------------------------------

def test_item9_catastrophic_regex_is_refused_fast():
    sel = r"*:re:(\w+_?)+!"
    with pytest.raises(SelectorError, match="exponentially"):
        parse_selector(sel)
    model = _long_named(5000)
    t0 = time.perf_counter()
    with pytest.raises(SelectorError) as info:
        select(model, sel)
    assert time.perf_counter() - t0 < 1.0
    assert info.value.column == sel.index("(")


@pytest.mark.parametrize("pattern", [r"(a*)*b", r"(a|a)*b", r"(ab|\wc)+!", r"(a|ab)+c", r"(a?a?)+b",
                                     r"(?:x+y?)+z", r"(?:(a+))+"])
def test_item9_nested_or_ambiguous_repeats_are_refused(pattern):
    with pytest.raises(SelectorError, match="regular expression refused"):
        parse_selector(f"*:re:{pattern}")


def test_item9_chains_of_optional_parts_are_refused():
    with pytest.raises(SelectorError, match="too many ways"):
        parse_selector("*:re:" + "a?" * 40 + "a" * 40)


def test_item9_ordinary_regexes_still_work():
    enc = nn.Module()
    enc.encoder = nn.Module()
    enc.encoder.layer = nn.ModuleList(
        nn.ModuleDict({"query": nn.Linear(1, 1), "key": nn.Linear(1, 1), "norm": nn.LayerNorm(1)})
        for _ in range(3))
    got = _names(enc, r"Linear:re:encoder\.layer\.\d+\..*")
    assert got == [f"encoder.layer.{i}.{k}" for i in range(3) for k in ("query", "key")]
    assert _names(enc, r"*:re:encoder\.layer\.\d+\.(query|key)") == got
    assert _names(enc, r"*:re:(encoder|decoder)\.layer\.[0-9]{1,2}\.norm") == [
        f"encoder.layer.{i}.norm" for i in range(3)]
    resnet = resnet34_like()
    assert _names(resnet, r"*:re:layer[0-9]+\.0\.conv.*")[:2] == ["layer1.0.conv1", "layer1.0.conv2"]
    assert len(_names(resnet, r"Conv2d:re:layer[0-9]+\.\d+\.conv[12]")) == 32


def test_item9_polynomial_regex_on_a_hostile_name_is_bounded():
    sel = r"*:re:.*a.*a.*a.*a.*!"
    assert _names(nn.ModuleDict({"ab": nn.Linear(1, 1), "aaaa": nn.Linear(1, 1)}),
                  r"*:re:.*a.*a.*a.*a.*") == ["aaaa"]
    model = _long_named(2000)  # matching would take hours on a 2,000-character name
    t0 = time.perf_counter()
    with pytest.raises(SelectorError, match="has 2000 characters; this regular expression may be"):
        select(model, sel)
    assert time.perf_counter() - t0 < 2.0


def test_item9_deep_regex_groups_raise_selector_error():
    sel = "*:re:" + "(" * 2000 + "a" + ")" * 2000
    with pytest.raises(SelectorError, match="nests groups 2000 deep"):
        select(nn.Sequential(nn.Linear(1, 1)), sel)
    assert _names(nn.ModuleDict({"a": nn.Linear(1, 1)}), "*:re:" + "(" * 50 + "a" + ")" * 50) == ["a"]


@pytest.mark.parametrize("text", [
    "every = " + "[" * 2000 + "]" * 2000,
    "every = " + "{a = " * 2000 + "1" + "}" * 2000,
])
def test_item9_deep_toml_raises_config_error(tmp_path, text):
    path = tmp_path / "deep.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="deep.toml: tables/arrays nested 2000 deep"):
        load_config(path)


def test_item9_deep_option_values_raise_config_error():
    value: list = []
    inner = value
    for _ in range(2000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(ConfigError, match=r"plugins\.stats\.sites.*nested more than 32"):
        parse_config({"plugins": {"stats": {"sites": value}}}, "x.toml")


def test_item9_brackets_inside_strings_do_not_count(tmp_path):
    path = tmp_path / "ok.toml"
    # (a valid selector: a name regex of 100 "[[]" classes, each matching a "[")
    path.write_text("select = '*:re:" + "[[]" * 100 + "'  # " + "{" * 100 + "\n"
                    "every = 2\n")
    assert load_config(path)["every"] == 2


# -- 14. jsonl paths that cannot work fail at attach ----------------------------------------------

def _attach_jsonl(path, model=None, **kw):
    return hookplug.attach(model if model is not None else MLP(), "Linear", plugins="stats", sink=("jsonl", {"path": str(path)}),
                           flush_every=1, **kw)


def test_item14_unknown_placeholder_fails_at_attach(tmp_path):
    with pytest.raises(ValueError, match=r"placeholder \{exp\}; only \{rank\}, \{run_id\}"):
        _attach_jsonl(tmp_path / "{exp}" / "t.jsonl")


def test_item14_file_in_the_way_fails_at_attach(tmp_path):
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(NotADirectoryError, match="a file is where a folder must be") as info:
        _attach_jsonl(tmp_path / "blocker" / "exp1")
    assert str(tmp_path / "blocker") in str(info.value)


def test_item14_folder_where_the_file_must_be(tmp_path):
    (tmp_path / "t.jsonl").mkdir()
    with pytest.raises(IsADirectoryError, match="a folder is where the file must be"):
        _attach_jsonl(tmp_path / "t.jsonl")


@pytest.mark.parametrize("blocked", ["under-a-file", "is-a-file"])
def test_item14_tensorboard_folder_that_cannot_be_made_fails_at_attach(tmp_path, blocked):
    """The tensorboard sink made its folder at the first flush (NotADirectoryError from
    inside TensorBoard's writer: the run's telemetry lost, or an error mid-training with
    ``flush_every``); refused at attach now, as jsonl's path is, nothing created."""
    pytest.importorskip("tensorboard")
    (tmp_path / "blocker").write_text("x")
    path = tmp_path / "blocker" / "tb" if blocked == "under-a-file" else tmp_path / "blocker"
    m = MLP()
    with pytest.raises(NotADirectoryError, match=r"^.*tensorboard sink: a file is where (a|the) folder must be") as info:
        hookplug.attach(m, "Linear", plugins="stats", sink=("tensorboard", {"path": str(path)}), flush_every=1)
    assert str(tmp_path / "blocker") in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"] and (tmp_path / "blocker").is_file()
    assert all(not x._forward_hooks for x in m.modules())


@pytest.mark.parametrize("option", [{"flush_secs": 0}, {"flush_secs": -1}, {"flush_secs": 10**12}, {"max_queue": 0}])
def test_item14_tensorboard_queue_options_out_of_range_are_refused(tmp_path, option):
    """``flush_secs=0`` kept TensorBoard's writer thread spinning a core, a huge one stopped it
    at its first wait (OverflowError: the run's telemetry lost); ``max_queue=0`` or less was
    taken as given. All refused when the sink is built, naming the option."""
    pytest.importorskip("tensorboard")
    with pytest.raises(hookplug.PluginError, match=f"tensorboard sink: {next(iter(option))} must be"):
        hookplug.attach(MLP(), "Linear", plugins="stats", sink=("tensorboard", {"path": str(tmp_path), **option}))


@pytest.mark.parametrize("sink, where", [("jsonl", "link/x.jsonl"), ("jsonl", "link"), ("tensorboard", "link"),
                                         ("tensorboard", "link/tb")])
def test_item14_a_symbolic_link_to_nothing_in_the_path_fails_at_attach(tmp_path, sink, where):
    """A dangling link where the file or a folder goes passed the check (``exists()`` is
    False for it: taken for a folder still to make) and the first flush failed."""
    pytest.importorskip("tensorboard")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match=f"{sink} sink: a symbolic link to nothing is in the way"):
        hookplug.attach(MLP(), "Linear", plugins="stats", sink=(sink, {"path": str(tmp_path / where)}))


def test_item14_unwritable_folder_fails_at_attach(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(ro)
                        else real_access(p, mode, **kw))
    with pytest.raises(PermissionError, match="folder is not writable") as info:
        _attach_jsonl(ro / "exp1")
    assert str(ro) in str(info.value)


def test_item14_warn_mode_disables_the_sink_at_attach_and_creates_nothing(tmp_path):
    (tmp_path / "blocker").write_text("x")
    with pytest.warns(RuntimeWarning, match="'jsonl' failed and is disabled"):
        s = _attach_jsonl(tmp_path / "blocker" / "exp1", on_error="warn")
    s.remove()
    good = tmp_path / "new" / "exp"
    s = _attach_jsonl(good)
    assert not (tmp_path / "new").exists()  # the check creates nothing
    s.remove()


# -- 15. a full disk never leaves a torn line -----------------------------------------------------

def _flush_some(session, model, steps=1):
    for _ in range(steps):
        model(torch.randn(4, 32))
        session.step()


def _full_disk_after(monkeypatch, sink, good_bytes_budget):
    """``os.write`` on the sink's file writes at most ``good_bytes_budget`` bytes in total, then
    a short write cut mid-line, then ENOSPC — a disk filling up."""
    real_write = os.write
    state = {"left": good_bytes_budget, "short": False}

    def write(fd, data):
        if fd != sink._fd:
            return real_write(fd, data)
        if state["short"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if len(data) <= state["left"]:
            state["left"] -= len(data)
            return real_write(fd, data)
        state["short"] = True
        return real_write(fd, bytes(data)[: max(1, len(data) // 2)])

    monkeypatch.setattr(os, "write", write)


def test_item15_disk_full_rolls_back_to_the_last_whole_line(tmp_path, monkeypatch):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    path = tmp_path / "t.jsonl"
    model = MLP()
    s = _attach_jsonl(path, model)
    _flush_some(s, model)  # one good flush
    good = path.read_bytes()
    assert good.endswith(b"\n")
    _full_disk_after(monkeypatch, s["jsonl"], 0)
    model(torch.randn(4, 32))
    with pytest.raises(OSError, match="No space left on device") as info:
        s.step()
    assert str(path) in str(info.value)
    monkeypatch.undo()
    assert path.read_bytes() == good  # the partial write was truncated away
    assert len(read_jsonl(str(path))) == 3
    s.remove()


def test_item15_disk_full_under_warn_keeps_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    model = MLP()
    s = _attach_jsonl(path, model, on_error="warn")
    _flush_some(s, model)
    _full_disk_after(monkeypatch, s["jsonl"], 0)
    model(torch.randn(4, 32))
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        s.step()
    monkeypatch.undo()
    s.remove()
    data = path.read_bytes()
    assert data.endswith(b"\n") and all(json.loads(line) for line in data.splitlines())


def test_item15_reader_skips_a_torn_tail_with_one_warning(tmp_path):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    path = tmp_path / "t.jsonl"
    whole = [json.dumps({"step": i, "module": "m", "site": "output", "min": 0.0}) for i in range(3)]
    path.write_text("\n".join(whole) + "\n" + whole[0][:17])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = read_jsonl(str(path))
    assert [r["step"] for r in back] == [0, 1, 2]
    torn = [w for w in caught if "torn" in str(w.message)]
    assert len(torn) == 1 and "skipped 1 torn line(s)" in str(torn[0].message)
    assert "line 4" in str(torn[0].message) and "t.jsonl" in str(torn[0].message)
    path.write_text(whole[0] + "\n[1, 2]\n" + whole[1] + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl: line 2 is not a telemetry record: expected a JSON object with keys module, site, step, got list"):
        read_jsonl(str(path))


def test_item15_sink_ends_a_torn_tail_before_appending(tmp_path):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0, "module": "m", "site": "output"}\n{"step": 1, "mod')
    model = MLP()
    with pytest.warns(RuntimeWarning, match="ended in a torn line"):
        with _attach_jsonl(path, model) as s:
            _flush_some(s, model)
    lines = path.read_text().splitlines()
    assert lines[1] == '{"step": 1, "mod'  # the torn line kept whole on its own line
    assert all(json.loads(line) for i, line in enumerate(lines) if i != 1)
    with pytest.warns(RuntimeWarning, match="skipped 1 torn line"):
        back = read_jsonl(str(path))
    assert [r["step"] for r in back] == [0, 0, 0, 0]  # the old whole line, then 3 records


# -- 16. two runs on one path are told apart ------------------------------------------------------

def test_item16_records_carry_the_run_id(tmp_path, monkeypatch):
    from hookplug_plugins.sinks.jsonl import read_jsonl

    monkeypatch.delenv("HOOKPLUG_RUN_ID", raising=False)
    path = tmp_path / "shared.jsonl"
    ids = []
    for _ in range(2):
        model = MLP()
        with _attach_jsonl(path, model) as s:
            _flush_some(s, model, steps=2)
        ids.append(s.run_id)
    assert ids[0] != ids[1]
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["run_id"] for r in raw] == [ids[0]] * 6 + [ids[1]] * 6
    assert {"step", "time", "rank", "module", "site", "numel", "min", "max", "hist"} <= set(raw[0])
    second = read_jsonl(str(path), run_id=ids[1])
    assert len(second) == 6 and {r["step"] for r in second} == {0, 1}
    assert all(r["hist_edges"] for r in second)  # edges carried within the run


# -- 18. capture keeps HF-cache-like objects as snapshots ---------------------------------------------

class TinyCache:
    """Like ``transformers.DynamicCache``: lists of per-layer key/value tensors grown in place."""

    def __init__(self):
        self.key_cache, self.value_cache = [], []
        self.seen_tokens = 0

    def update(self, k, v):
        if not self.key_cache:
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[0] = torch.cat([self.key_cache[0], k])
            self.value_cache[0] = torch.cat([self.value_cache[0], v])
        self.seen_tokens += k.shape[0]


class CachingLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x, cache):
        y = self.proj(x)
        cache.update(y, -y)
        return {"hidden": y, "past_key_values": cache}


def test_item18_capture_snapshots_cache_objects(tmp_path):
    layer = CachingLayer()
    cache = TinyCache()
    with pytest.warns(RuntimeWarning, match="holds TinyCache object"):
        with hookplug.attach(layer, "*:", plugins=("capture", {"keep": "all"})) as s:
            for _ in range(3):
                layer(torch.randn(1, 2), cache)
    calls = s["capture"].features[""]
    assert len(calls) == 3
    first = calls[0]["past_key_values"]
    assert not isinstance(first, TinyCache)  # not the live object
    assert first["key_cache"][0].shape == (1, 2)  # as it was at call 0, not grown since
    assert first["seen_tokens"] == 1 and calls[2]["past_key_values"]["seen_tokens"] == 3
    assert not first["key_cache"][0].requires_grad
    assert torch.equal(calls[2]["past_key_values"]["value_cache"][0], cache.value_cache[0])
    assert s["capture"].nbytes == sum(4 * 2 * (n + n + 1) for n in (1, 2, 3))  # hidden + k + v
    p = tmp_path / "c.safetensors"
    s["capture"].save(p)
    back = hookplug.load_capture(p)
    assert torch.equal(back[""][2]["past_key_values"]["key_cache"][0], cache.key_cache[0])


@contextlib.contextmanager
def _quiet_capture(model, selector, config):
    """A capture session with its warnings (objects kept as snapshots) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hookplug.attach(model, selector, plugins=("capture", config)) as session:
            yield session


def test_item18_real_dynamic_cache():
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()

    class Layer(nn.Module):
        def forward(self, k):
            cache.update(k, k, 0)
            return (k, cache)

    layer = Layer()
    with _quiet_capture(layer, "*:", {"keep": "all"}) as s:
        layer(torch.ones(1, 1, 2, 4))
        layer(torch.ones(1, 1, 1, 4))
    snap = s["capture"].features[""][0][1]
    tensors = [t for _, t in hookplug.structures.iter_tensors(snap)]
    assert tensors and all(t.shape[2] == 2 for t in tensors)


class SlottedOut:
    __slots__ = ("hidden", "n")

    def __init__(self, hidden):
        self.hidden, self.n = hidden, 3


def test_item18_objects_empty_when_captured_and_slotted_objects_are_not_kept_live():
    """An empty cache (HF's for the first layer) filled after the call was kept live: it held
    the later layers' tensors, attached to the graph, outside ``nbytes``/``max_bytes``. An
    object with ``__slots__`` and a tensor was kept as the live object too."""

    class Fills(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

        def forward(self, x, cache):
            y = self.proj(x)
            cache.update(y, -y)
            return SlottedOut(y)

    layer, cache = Fills(), TinyCache()
    x = torch.randn(1, 2, requires_grad=True)
    with _quiet_capture(layer, "*:", {"inputs": True}) as s:
        out = layer(x, cache)
    kept_cache = s["capture"].inputs[""][1]
    assert kept_cache is not cache and isinstance(kept_cache, TinyCache)
    assert kept_cache.key_cache == [] and kept_cache.seen_tokens == 0  # as it was at the call
    feat = s["capture"].features[""]
    assert feat == {"hidden": feat["hidden"], "n": 3}
    assert torch.equal(feat["hidden"], out.hidden) and feat["hidden"].grad_fn is None
    assert s["capture"].nbytes == 2 * 4 + 2 * 4  # the input x and the output's tensor


def test_item18_real_dynamic_cache_passed_to_blocks_is_not_kept_live():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2Model(cfg).eval()
    with _quiet_capture(m, "*:h.*", {"inputs": True}) as s:
        out = m(torch.randint(0, 50, (1, 5)), use_cache=True)
    live = out.past_key_values
    for block in ("h.0", "h.1"):
        for a in [*s["capture"].inputs[block], *s["capture"].input_kwargs[block].values()]:
            for obj in [a] + ([] if not isinstance(a, dict) else list(a.get("layers", []))):
                assert obj is not live and all(obj is not layer for layer in live.layers)
    assert s["capture"].nbytes == sum(t.numel() * t.element_size()
                                      for kind in ("features", "inputs", "input_kwargs")
                                      for v in getattr(s["capture"], kind).values()
                                      for _, t in hookplug.structures.iter_tensors(v))


def test_item18_save_of_an_unknown_object_warns(tmp_path):
    from hookplug._capture_io import save_capture

    with pytest.warns(RuntimeWarning, match=r"written as None: m/output\[1\] \(object\)"):
        save_capture(tmp_path / "c.safetensors", {"features": {"m": (torch.zeros(1), object())}})


# -- 19. crafted capture metadata: one ValueError naming the file -----------------------------------

def _crafted(tmp_path, meta):
    from safetensors.torch import save_file

    path = tmp_path / "crafted.safetensors"
    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file({"m/output": torch.zeros(2)}, str(path), metadata={"hookplug.capture": text})
    return path


def _deep(n):
    desc: dict = {"t": "m/output"}
    for _ in range(n):
        desc = {"list": [desc]}
    return desc


@pytest.mark.parametrize("meta, what", [
    ("{not json", "not JSON"),
    ([1, 2], "must be a JSON object"),
    ({"version": "one", "layout": {}}, "version must be an integer"),
    ({"version": 9, "layout": {}}, "format version 9"),
    ({"version": 1, "layout": []}, "layout must be an object"),
    ({"version": 1, "layout": {"features": []}}, "layout.features must be an object"),
    ({"version": 1, "layout": {"features": {"m": "x"}}}, "layout.features.m: expected"),
    ({"version": 1, "layout": {"features": {"m": {"one": 5}}}}, "expected an entry"),
    ({"version": 1, "layout": {"features": {"m": {"one": {"t": "missing"}}}}}, "does not hold"),
    ({"version": 1, "layout": {"features": {"m": {"one": {"t": ["m/output"]}}}}}, "does not hold"),
    ({"version": 1, "layout": {"features": {"m": {"one": {"dict": [[{"a": 1}, None]]}}}}},
     "a key must be a string"),
    ({"version": 1, "layout": {"features": {"m": {"one": {"dict": [[1]]}}}}}, "a [key, value] pair"),
    ({"version": 1, "layout": {"features": {"m": {"one": {"dict": 3}}}}}, "list of [key, value]"),
    ({"version": 1, "layout": {"features": {"m": {"list": {"a": 1}}}}}, '"list" must be a list'),
    ({"version": 1, "layout": {"features": {"m": {"one": {"value": [1]}}}}}, '"value" must be'),
    ({"version": 1, "layout": {"features": {"m": {"one": {"frob": 1}}}}}, "unknown structure"),
    ({"version": 2, "layout": {"features": {"m": {"one": {"t": "m/output", "complex": True}}}}},
     "float16/float64 tensor whose last dimension is 2"),
    ({"version": 2, "layout": {"features": {"m": {"one": {"t": "m/output", "frob": True}}}}},
     '{"t": key, "complex": true}'),
    ({"version": 1, "layout": {"features": {"m": {"one": _deep(300)}}}}, "nested more than 200"),
    ('{"version": 1, "layout": ' + "[" * 100000 + "]" * 100000 + "}", "not JSON"),
])
def test_item19_crafted_metadata_gives_one_value_error(tmp_path, meta, what):
    path = _crafted(tmp_path, meta)
    with pytest.raises(ValueError) as info:
        hookplug.load_capture(path, what="all")
    assert type(info.value) is ValueError
    assert "crafted.safetensors" in str(info.value) and what in str(info.value)


def test_item19_not_a_safetensors_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="junk.safetensors.*not a readable safetensors file"):
        hookplug.load_capture(path)


# -- 20. the CLI says that file.py:factory runs code; select with no match is an error --------------

def test_item20_help_says_a_file_factory_runs_code(capsys):
    from hookplug.cli import main

    for command in ("profile", "select"):
        assert main([command, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "RUNS THAT FILE'S CODE" in out, command
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    assert "runs that file's code" in " ".join(readme.split())


def test_item20_select_with_no_match_is_a_usage_error(capsys):
    from hookplug.cli import main

    rc = main(["select", "cnn", "Conv2d:nothing.*"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("hookplug: error: ") and "matched no module" in err[0]


# -- small bad inputs: one clear error each ----------------------------------------------------------

def test_bad_input_config_module_and_capture_path(tmp_path):
    with pytest.raises(TypeError, match=r"attach\(\): config= expects a path to a TOML file \(str or os.PathLike\) "
                                        r"or a dict, got int"):
        hookplug.attach(MLP(), "Linear", "stats", config=3)
    for module in (3, [1]):  # checked before anything is drawn (or matplotlib looked for)
        with pytest.raises(TypeError, match=r"plot_features: module must be a module name or a list of names, got "):
            hookplug.plot_features(torch.randn(1, 2, 4, 4), tmp_path / "x.png", module=module)
    with pytest.raises(IsADirectoryError, match=r"load_capture: '.*' is a directory, not a capture file"):
        hookplug.load_capture(tmp_path)


class _Holder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Private:
    __slots__ = ("__cache", "n")

    def __init__(self, t):
        self.__cache, self.n = t, 1


def test_item18_objects_a_deepcopy_would_break_or_bloat_stay_live(tmp_path):
    """Tensor-less objects are deep-copied only where that is small and safe: one reaching a
    Python module, a file, a bound method (the whole model it is bound to) or a C type's
    hidden state (``functools.partial`` of a non-leaf tensor) made the forward raise, or
    copied a model per call; a name-mangled slot holding a tensor was not seen."""
    import functools
    import math as math_module

    big = nn.Linear(64, 64)
    x = torch.randn(1, 2, requires_grad=True)
    nonleaf = x * 2
    with open(tmp_path / "f.txt", "w") as f:
        live = [_Holder(lib=math_module), functools.partial(torch.add, nonleaf), _Holder(f=f), f,
                _Holder(fn=big.forward), functools.partial(big.forward), _Holder(p=functools.partial(big))]

        class Takes(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(2, 2)

            def forward(self, x, obj):
                return self.lin(x)

        layer = Takes()
        for obj in live:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with hookplug.attach(layer, "*:", plugins=("capture", {"inputs": True})) as s:
                    layer(x, obj)
            assert s["capture"].inputs[""][1] is obj, type(obj)
            assert s["capture"].nbytes == 2 * 4 + 2 * 4
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with hookplug.attach(layer, "*:", plugins=("capture", {"inputs": True})) as s:
                layer(x, _Private(nonleaf))
        kept = s["capture"].inputs[""][1]
        assert set(kept) == {"_Private__cache", "n"} and kept["_Private__cache"].grad_fn is None
        assert torch.equal(kept["_Private__cache"], nonleaf)
