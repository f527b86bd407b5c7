"""Telemetry config files: ``hookplug.load_config`` and ``attach(model, config=...)``."""
import textwrap

import pytest
import torch

import hookplug
from hookplug._config import ConfigError, _toml
from hookplug.models import MLP


def write(tmp_path, text, name="telemetry.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


FULL = """
    select = "Linear"
    every = 2
    flush_every = 3
    on_error = "warn"
    strict = true

    [plugins.stats]
    bins = 0
    sites = ["output", "grad"]

    [plugins.capture]
    select = "*:fc3"

    [sinks.jsonl]
    path = "{out}"
"""


def test_load_config_maps_onto_attach(tmp_path):
    cfg = hookplug.load_config(write(tmp_path, FULL.format(out=tmp_path / "exp1")))
    assert cfg == {
        "every": 2, "flush_every": 3, "on_error": "warn", "strict": True,
        "selector": {"Linear": {"stats": {"bins": 0, "sites": ["output", "grad"]}},
                     "*:fc3": {"capture": {}}},
        "sink": {"jsonl": {"path": str(tmp_path / "exp1")}},
    }


def test_attach_with_config_runs_the_described_session(tmp_path):
    path = write(tmp_path, FULL.format(out=tmp_path / "exp1"))
    m = MLP()
    with hookplug.attach(m, config=path) as s:
        assert (s.every, s.flush_every, s.on_error) == (2, 3, "warn")
        assert list(s.plugins) == ["stats", "capture"] and list(s.sinks) == ["jsonl"]
        assert list(s.modules_of("stats")) == ["fc1", "fc2", "fc3"] and list(s.modules_of("capture")) == ["fc3"]
        assert s["stats"].bins == 0 and s["stats"].sites == ("output", "grad")
        for _ in range(6):
            m(torch.randn(4, 32)).sum().backward()
            s.step()
    lines = (tmp_path / "exp1" / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2 * 3  # steps 0, 2, 4 (every=2) x fc1..fc3 x output and grad


def test_attach_arguments_win_over_the_file(tmp_path):
    path = write(tmp_path, FULL.format(out=tmp_path / "exp1"))
    sink = []

    class Keep:
        name = "keep"

        @hookplug.hookimpl
        def hookplug_flush(self, records):
            sink.extend(records)

    m = MLP()
    with hookplug.attach(m, config=path, every=1, flush_every=1, sink=Keep()) as s:
        assert (s.every, s.flush_every, list(s.sinks)) == (1, 1, ["keep"])
        m(torch.randn(4, 32))
        s.step()
    assert len(sink) == 3
    with pytest.raises(ConfigError, match="plugins come from config="):
        hookplug.attach(m, "Linear", plugins="stats", config=path)


def test_flush_every_without_sinks_uses_the_jsonl_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, """
        flush_every = 1
        plugins = ["stats"]
    """)
    m = MLP()
    with hookplug.attach(m, config=path) as s:
        assert list(s.sinks) == ["jsonl"]
        m(torch.randn(1, 32))
        s.step()
    assert len((tmp_path / "runs" / s.run_id / "telemetry.jsonl").read_text().splitlines()) == 3


def test_a_dict_config_works_like_a_file():
    m = MLP()
    with hookplug.attach(m, config={"plugins": {"stats": {"bins": 0}}, "every": 4}) as s:
        assert s.every == 4 and s["stats"].bins == 0 and list(s.modules) == ["fc1", "fc2", "fc3"]


@pytest.mark.parametrize("text, where", [
    ('[plugins.stats]\nsites = ["outptu"]\n', r"telemetry\.toml: \[plugins\.stats\]: plugin 'stats' rejected its "
                                              r"options \{'sites': \['outptu'\]\}: .*got \('outptu',\)"),
    ('[plugins.capture]\nmax_bytes = -3\n', r"telemetry\.toml: \[plugins\.capture\]: plugin 'capture' rejected"),
    ('[plugins.stats]\n[sinks.jsonl]\npath = "runs/{nope}.jsonl"\n', r"telemetry\.toml: \[sinks\.jsonl\]: .*nope"),
])
def test_values_a_plugin_refuses_at_attach_name_the_file_and_table(tmp_path, text, where):
    """Values the file's schema cannot check (a plugin's own range checks) are refused when
    attach() builds the plugin: the error names the file and table, as the schema's do."""
    path = write(tmp_path, text)
    with pytest.raises(hookplug.PluginError, match=where):
        hookplug.attach(MLP(), config=path)
    with pytest.raises(hookplug.PluginError, match=where.replace(r"telemetry\.toml", "config=")):
        hookplug.attach(MLP(), config=_toml().loads(textwrap.dedent(text)))
    with pytest.raises(hookplug.PluginError, match=r"^plugin 'stats' rejected"):  # (not from the file)
        hookplug.attach(MLP(), "Linear", plugins=[("stats", {"bins": -3})], config={"every": 2})
    with pytest.raises(hookplug.PluginError, match=r"^plugin 'jsonl' rejected"):  # a sink's name in plugins=
        hookplug.attach(MLP(), "Linear", plugins=["stats", ("jsonl", {"path": str(tmp_path / "{nope}")})],
                        config={"sinks": {"jsonl": {"path": str(tmp_path / "ok.jsonl")}}})


@pytest.mark.parametrize("text, message", [
    ('[plugins.stats]\nbins = "x"\n', 'telemetry.toml: [plugins.stats] bins: expected an int, got "x"'),
    ('[plugins.stats]\nbinz = 3\n', "telemetry.toml: [plugins.stats] binz: unknown option (did you mean 'bins'?)"),
    ('[plugins.stats]\nsites = "output"\nhist = 2\n', 'telemetry.toml: [plugins.stats] hist: expected one of "log2", "linear", got 2'),
    ('[plugins.statz]\n', "telemetry.toml: [plugins.statz]: unknown plugin 'statz'. Did you mean 'stats'?"),
    ('[sinks.jsonl]\nall_ranks = 1\n', "telemetry.toml: [sinks.jsonl] all_ranks: expected a boolean, got 1"),
    ('[sinks.prometheus]\nport = "http"\n', 'telemetry.toml: [sinks.prometheus] port: expected an int, got "http"'),
    ('flush_every = 0\n', "telemetry.toml: flush_every: expected an int >= 1, got 0"),
    ('every = 1.5\n', "telemetry.toml: every: expected an int, got 1.5"),
    ('on_error = "ignore"\n', 'telemetry.toml: on_error: expected "raise" or "warn", got "ignore"'),
    ('flush_evry = 2\n', "telemetry.toml: flush_evry: unknown key (did you mean 'flush_every'?)"),
    ('select = 3\n', "telemetry.toml: select: expected a string, got 3"),
    ('[plugins.stats]\nselect = ["Linear"]\n', "telemetry.toml: [plugins.stats] select: expected a string, got an array [\"Linear\"]"),
    ('[plugins.stats]\nsites = ["output", 3]\n', 'telemetry.toml: [plugins.stats] sites: expected a string or a '
     'sequence of strings, got an array [\"output\", 3]'),
    ('plugins = [1]\n', "telemetry.toml: plugins[0]: expected a string, got 1"),
    ('plugins = 3\n', "telemetry.toml: plugins: expected a table [plugins.NAME] or an array of names, got 3"),
    ('sinks = "jsonl"\n', 'telemetry.toml: sinks: expected a table [sinks.NAME], got "jsonl"'),
    ('[plugins]\nstats = 3\n', "telemetry.toml: [plugins.stats]: expected a table of options, got 3"),
    ('every = \n', "telemetry.toml: invalid TOML: "),
    ('[sinks.jsonl]\npath = ""\n', 'telemetry.toml: [sinks.jsonl] path: expected a file or folder name, got ""'),
    ('[sinks.jsonl]\npath = " "\n', 'telemetry.toml: [sinks.jsonl] path: expected a file or folder name, got " "'),
])
def test_errors_name_the_file_the_key_and_what_was_expected(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        hookplug.load_config(path)
    assert str(info.value).startswith(message), str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read the config file"):
        hookplug.load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        hookplug.attach(MLP(), config=tmp_path / "nope.toml")


def test_explicit_on_error_and_strict_win_over_the_file_even_at_their_defaults():
    """attach()'s own on_error="raise"/strict=False used to lose to the file because they
    could not be told from the defaults."""
    m = MLP()
    cfg = {"on_error": "warn", "strict": True, "plugins": ["stats"]}
    with hookplug.attach(m, config=cfg, on_error="raise") as s:
        assert s.on_error == "raise"
    with hookplug.attach(m, config=cfg) as s:  # not passed: the file's
        assert s.on_error == "warn"
    with pytest.warns(UserWarning, match="matched no module"):
        s = hookplug.attach(m, config={"strict": True, "select": "Conv2d"}, plugins="stats",
                            strict=False)
    s.remove()
    with pytest.raises(hookplug.SelectorError, match="matched no module"):
        hookplug.attach(m, config={"strict": True, "select": "Conv2d"}, plugins="stats")
    with hookplug.attach(m, "Linear", plugins="stats") as s:  # no config: the defaults
        assert s.on_error == "raise"


def test_top_level_select_applies_to_attach_plugins(tmp_path):
    """A file's top-level select used to be ignored when plugins= came from attach()."""
    m = MLP()
    with hookplug.attach(m, plugins="stats", config={"select": "Linear:fc1"}) as s:
        assert list(s.modules) == ["fc1"]
    path = write(tmp_path, 'select = "Linear:fc[12]"\nevery = 2\n')
    assert hookplug.load_config(path) == {"selector": "Linear:fc[12]", "every": 2}
    with hookplug.attach(m, plugins="stats", config=path) as s:
        assert list(s.modules) == ["fc1", "fc2"] and s.every == 2
    with hookplug.attach(m, **hookplug.load_config(path), plugins="stats") as s:
        assert list(s.modules) == ["fc1", "fc2"]
    # a selector given to attach wins over the file, like every other argument
    with hookplug.attach(m, "Linear:fc3", plugins="stats", config=path) as s:
        assert list(s.modules) == ["fc3"]
    # with [plugins.*] tables the select is their default selector, as before
    cfg = hookplug.load_config(write(tmp_path, 'select = "Linear:fc2"\nplugins = ["stats"]\n', "b.toml"))
    assert cfg == {"selector": {"Linear:fc2": {"stats": {}}}}


def test_attach_signature_shows_real_defaults_and_explicit_defaults_beat_the_file():
    import inspect

    params = inspect.signature(hookplug.attach).parameters
    assert {k: params[k].default for k in ("selector", "every", "on_error", "strict")} == \
        {"selector": "*", "every": 1, "on_error": "raise", "strict": False}
    assert "_given" not in params
    m = MLP()
    cfg = {"every": 3, "on_error": "warn", "select": "Linear:fc1"}
    with hookplug.attach(m, plugins="stats", config=cfg) as s:  # not passed: the file's
        assert (s.every, s.on_error, list(s.modules)) == (3, "warn", ["fc1"])
    with hookplug.attach(m, "*", plugins="stats", config=cfg, every=1, on_error="raise") as s:
        assert (s.every, s.on_error) == (1, "raise")
        assert list(s.modules) == [n for n, _ in hookplug.select(m, "*")] != ["fc1"]
    with pytest.raises(ConfigError, match="plugins come from config="):
        hookplug.attach(m, "*", config={"plugins": ["stats"]})


def test_none_means_not_given_and_callbacks_take_config_files(tmp_path):
    """Wrappers forward None for "not set": attach's default, or the config file, applies."""
    transformers = pytest.importorskip("transformers")  # noqa: F841 - the callback needs it
    from hookplug.integrations.transformers import HookplugTrainerCallback

    full, select_only = tmp_path / "full.toml", tmp_path / "select.toml"
    full.write_text('select = "Linear"\n[plugins.stats]\nbins = 0\n')
    select_only.write_text('select = "Linear"\n')
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    with hookplug.attach(m, "Linear", "stats", every=None, on_error=None) as s:
        assert (s.every, s.on_error) == (1, "raise")
    for cb in (HookplugTrainerCallback(config=str(full)),
               HookplugTrainerCallback(plugins=["stats"], config=str(select_only))):
        cb.on_train_begin(None, None, None, model=m)
        assert list(cb.session.modules) == ["0"] and "stats" in cb.session
        cb.session.remove()


def _one_step(m, s):
    m(torch.randn(2, 32))
    s.step()


def _jsonl_config(folder, sink_path):
    """A ``telemetry.toml`` in ``folder``: stats, a flush every step, a jsonl sink at ``sink_path``."""
    return write(folder, f"""
        flush_every = 1
        plugins = ["stats"]
        [sinks.jsonl]
        path = "{sink_path}"
    """)


def test_a_relative_sink_path_in_a_file_is_relative_to_the_file(tmp_path, monkeypatch):
    """``path = "runs/x"`` written in ``cfg/telemetry.toml`` is ``cfg/runs/x`` whatever the
    working directory (as ruff and pytest read paths in their config files); it used to
    land under the process's working directory."""
    cfg_dir, elsewhere = tmp_path / "cfg", tmp_path / "elsewhere"
    cfg_dir.mkdir()
    elsewhere.mkdir()
    path = _jsonl_config(cfg_dir, "runs/x")
    monkeypatch.chdir(elsewhere)
    assert hookplug.load_config(path)["sink"] == {"jsonl": {"path": str(cfg_dir / "runs" / "x")}}
    m = MLP()
    for given in (path, "../cfg/telemetry.toml"):  # the file named by a relative path too
        with hookplug.attach(m, config=given) as s:
            _one_step(m, s)
    assert len((cfg_dir / "runs" / "x" / "telemetry.jsonl").read_text().splitlines()) == 6
    assert not (elsewhere / "runs").exists()
    # the file's folder is fixed when it is read: a later chdir does not move the output
    with hookplug.attach(m, config=path) as s:
        monkeypatch.chdir(tmp_path)
        _one_step(m, s)
    assert len((cfg_dir / "runs" / "x" / "telemetry.jsonl").read_text().splitlines()) == 9
    assert not (tmp_path / "runs").exists()


def test_a_sink_in_a_plugins_table_takes_its_path_from_the_files_folder_too(tmp_path, monkeypatch):
    """``[plugins.jsonl] path = "out"`` (a sink named among the plugins serves as the sink)
    wrote under the working directory; a plugin's own options are left as they are."""
    cfg_dir, elsewhere = tmp_path / "cfg", tmp_path / "elsewhere"
    cfg_dir.mkdir()
    elsewhere.mkdir()
    path = cfg_dir / "t.toml"
    path.write_text('select = "Linear"\nflush_every = 1\n[plugins.stats]\nbins = 0\n'
                    '[plugins.jsonl]\npath = "out"\n')
    monkeypatch.chdir(elsewhere)
    groups = hookplug.load_config(str(path))["selector"]
    assert groups == {"Linear": {"stats": {"bins": 0}, "jsonl": {"path": str(cfg_dir / "out")}}}
    m = MLP()
    with hookplug.attach(m, config=str(path)) as s:
        _one_step(m, s)
    assert (cfg_dir / "out" / "telemetry.jsonl").is_file() and not (elsewhere / "out").exists()


def test_a_relative_sink_path_keeps_its_placeholders_and_the_folder_its_braces(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "exp{1}"  # a folder name with braces is not a placeholder
    cfg_dir.mkdir()
    path = _jsonl_config(cfg_dir, "out/r{rank}")
    monkeypatch.chdir(tmp_path)
    m = MLP()
    with hookplug.attach(m, config=path) as s:
        _one_step(m, s)
    assert (cfg_dir / "out" / "r0" / "telemetry.jsonl").is_file()


def test_a_url_sink_path_in_a_config_file_is_left_as_written(tmp_path):
    """Only file paths are made relative to the config file: a URL (a third-party sink's
    ``s3://...``) is kept as written, not joined to the file's folder."""
    path = _jsonl_config(tmp_path, "s3://bucket/run{rank}")
    assert hookplug.load_config(path)["sink"]["jsonl"]["path"] == "s3://bucket/run{rank}"


def test_an_empty_sink_path_is_refused_from_a_file_as_from_a_dict(tmp_path):
    """``path = ""`` in a file was joined to the file's folder and taken silently as that
    folder, where the same in a dict config (or ``sink=``) is refused: both are a
    ConfigError now, before anything is attached, and nothing is written."""
    path = _jsonl_config(tmp_path, "")
    m = MLP()
    for config in (path, {"plugins": ["stats"], "sinks": {"jsonl": {"path": ""}}}):
        with pytest.raises(ConfigError, match=r"\[sinks.jsonl\] path: expected a file or folder name"):
            hookplug.attach(m, config=config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["telemetry.toml"]


def test_relative_sink_paths_given_in_python_stay_relative_to_the_working_directory(tmp_path, monkeypatch):
    """A dict config and ``sink=`` hold paths as Python code gives them: relative to the
    working directory, as ``open()`` takes them; the dict is left as it was."""
    monkeypatch.chdir(tmp_path)
    config = {"flush_every": 1, "plugins": ["stats"], "sinks": {"jsonl": {"path": "runs/d"}}}
    m = MLP()
    with hookplug.attach(m, config=config) as s:
        _one_step(m, s)
    with hookplug.attach(m, plugins="stats", flush_every=1, sink=("jsonl", {"path": "runs/p"})) as s:
        _one_step(m, s)
    assert (tmp_path / "runs" / "d" / "telemetry.jsonl").is_file()
    assert (tmp_path / "runs" / "p" / "telemetry.jsonl").is_file()
    assert config["sinks"] == {"jsonl": {"path": "runs/d"}}


@pytest.mark.parametrize("text,where", [('select = "Linear,"\n', "select"),
                                        ('[plugins.stats]\nselect = "Conv2d|"\n', r"\[plugins.stats\] select")])
def test_a_selector_that_cannot_parse_is_an_error_of_the_file(tmp_path, text, where):
    path = tmp_path / "telemetry.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"telemetry.toml: {where}: "):
        hookplug.load_config(path)


def test_a_config_file_with_a_byte_order_mark_and_a_home_path(tmp_path, monkeypatch):
    """A UTF-8 byte-order mark (Windows editors) was "invalid TOML at line 1, column 1"; a
    sink path "~/x" became a folder named "~" beside the file."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"\xef\xbb\xbf" + b'plugins = ["stats"]\n[sinks.jsonl]\npath = "~/runs/x"\n')
    got = hookplug.load_config(cfg)
    assert got["sink"] == {"jsonl": {"path": str(tmp_path / "home" / "runs" / "x")}}, got
    assert got["selector"] == {"*": {"stats": {}}}


def test_a_plugin_under_sinks_is_refused_naming_the_file_and_table(tmp_path):
    """``[sinks.stats]`` (a plugin, not a sink) passed the file's checks and failed at
    attach with a PluginError that named neither the file nor the table: a ConfigError
    now, at load, naming both and where the table belongs. Nothing is attached."""
    path = tmp_path / "telemetry.toml"
    path.write_text('[plugins]\nstats = {}\n[sinks.stats]\n')
    m = MLP()
    with pytest.raises(ConfigError, match=r"^telemetry\.toml: \[sinks\.stats\]: expected a sink .* "
                                          r"put it under \[plugins\.stats\]"):
        hookplug.attach(m, config=path)
    assert not m._forward_hooks and all(not x._forward_hooks for x in m.modules())
    assert hookplug.load_config(_jsonl_config(tmp_path, "x"))["sink"]  # a real sink still passes


def test_a_config_file_that_names_no_plugins_says_so(tmp_path):
    """A config file with no plugin tables and no ``plugins=``: the error names the file,
    not only the missing argument."""
    path = tmp_path / "telemetry.toml"
    path.write_text("every = 2\n")
    with pytest.raises(hookplug.PluginError, match=r"plugins= is required .*telemetry\.toml.* names none"):
        hookplug.attach(MLP(), config=path)


def test_a_plugin_name_in_other_case_gets_a_suggestion(tmp_path):
    """``"FLOPS"`` (difflib is case-sensitive: no suggestion for all-caps names, where
    ``"Flops"`` got one), in attach, a config file, and a plugin option's name."""
    with pytest.raises(hookplug.PluginError, match=r"unknown hookplug plugin 'FLOPS'\. Did you mean 'flops'\?"):
        hookplug.attach(MLP(), "Linear", plugins="FLOPS")
    path = tmp_path / "telemetry.toml"
    path.write_text("[plugins]\nstats = {}\n[sinks.JSONL]\n")
    with pytest.raises(ConfigError, match=r"\[sinks\.JSONL\]: unknown plugin 'JSONL'\. Did you mean 'jsonl'\?"):
        hookplug.load_config(path)
    with pytest.raises(hookplug.PluginError, match=r"unknown option 'BINS' \(did you mean 'bins'\?\)"):
        hookplug.attach(MLP(), "Linear", plugins=("stats", {"BINS": 8}))


def test_a_plugin_listed_twice_in_a_file_is_refused_as_in_python(tmp_path):
    """``plugins = ["stats", "stats"]`` was taken as one stats plugin, where
    ``attach(plugins=["stats", "stats"])`` refuses the name used twice."""
    path = tmp_path / "telemetry.toml"
    path.write_text('plugins = ["stats", "capture", "stats"]\n')
    with pytest.raises(ConfigError, match=r"telemetry\.toml: plugins\[2\]: 'stats' is listed twice"):
        hookplug.load_config(path)
    with pytest.raises(hookplug.PluginError, match="used twice"):
        hookplug.attach(MLP(), "Linear", plugins=["stats", "stats"])
