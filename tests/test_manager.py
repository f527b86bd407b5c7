import importlib
import json
import sys
import textwrap
import warnings
from typing import Sequence, Tuple

import pytest
import torch

import hookplug
from hookplug import PluginError
from hookplug import _manager
from hookplug.models import MLP


class FakeDist:
    def __init__(self, name, version="1.0"):
        self.metadata = {"Name": name}
        self.version = version


class FakeEntryPoint:
    def __init__(self, name, value, dist, loader):
        self.name, self.value, self.dist, self._loader = name, value, FakeDist(dist), loader
        self.loads = 0

    def load(self):
        self.loads += 1
        return self._loader()


class Quiet(hookplug.Plugin):
    def __init__(self, *, level: int = 1):
        if not isinstance(level, int):
            raise TypeError(f"level must be an int, got {type(level).__name__}")
        self.level = level
        self.seen = 0

    @hookplug.hookimpl
    def hookplug_forward_output(self, ctx):
        self.seen += 1


class Needs(hookplug.Plugin):
    name = "needs"

    def __init__(self, *, level: float, tag: str = "t"):
        self.level, self.tag = level, tag


class BuggyInit(hookplug.Plugin):
    def __init__(self, *, n: int = 1):
        self.size = len(None)  # a bug in the constructor, nothing to do with its options


class TypoHook(hookplug.Plugin):
    @hookplug.hookimpl
    def hookplug_forward_outptu(self, ctx, output):
        pass


def broken_import():
    raise ImportError("No module named 'missing_dependency'")


class ExplodingPlugin(hookplug.Plugin):
    def __init__(self):
        raise RuntimeError("cannot reach license server")


def exiting_import():
    sys.exit(3)  # a plugin module that calls sys.exit() at import


def returns_none(**options):
    return None


@pytest.fixture
def fake_eps(monkeypatch, fresh_discovery):
    eps = [
        FakeEntryPoint("quiet", "thirdparty_quiet:Quiet", "thirdparty-quiet", lambda: Quiet),
        FakeEntryPoint("broken", "thirdparty_broken:Plugin", "thirdparty-broken", broken_import),
        FakeEntryPoint("exploding", "thirdparty_x:Plugin", "thirdparty-x", lambda: ExplodingPlugin),
        FakeEntryPoint("firstparty_fake", "hookplug_plugins.fake:P", "hookplug", lambda: Quiet),
        FakeEntryPoint("exiting", "thirdparty_exit:Plugin", "thirdparty-exit", exiting_import),
        FakeEntryPoint("none", "thirdparty_none:make", "thirdparty-none", lambda: returns_none),
    ]
    monkeypatch.setattr(_manager, "_entry_points", lambda: eps)
    return {ep.name: ep for ep in eps}


@pytest.fixture
def eps_of(monkeypatch, fresh_discovery):
    """``eps_of(name=factory, ...)``: the installed entry points plus third-party ones."""
    real = _manager._entry_points()

    def use(**factories):
        eps = [FakeEntryPoint(n, f"thirdparty_{n}:P", f"thirdparty-{n}", lambda f=f: f) for n, f in factories.items()]
        monkeypatch.setattr(_manager, "_entry_points", lambda: [*eps, *real])
        _manager._reset_discovery()

    return use


def test_discovery_is_lazy_and_names_origin(fake_eps):
    names = hookplug.plugin_names()
    assert names["quiet"] == "thirdparty-quiet 1.0"
    assert names["firstparty_fake"] == "first-party"
    assert all(ep.loads == 0 for ep in fake_eps.values()), "listing must not import plugins"
    with hookplug.attach(MLP(), "Linear", plugins="quiet") as s:
        MLP()  # nothing
    assert fake_eps["quiet"].loads == 1
    assert fake_eps["broken"].loads == 0 and fake_eps["exploding"].loads == 0
    assert isinstance(s["quiet"], Quiet)


def test_broken_plugin_under_warn_warns_naming_distribution_and_others_work(fake_eps):
    model = MLP()
    with pytest.warns(RuntimeWarning, match="thirdparty-broken.*missing_dependency"):
        s = hookplug.attach(model, "Linear", plugins=["broken", "quiet"], on_error="warn")
    model(torch.randn(2, 32))
    s.remove()
    assert list(s.plugins) == ["quiet"] and s["quiet"].seen == 4
    info = {p.name: p for p in hookplug.plugin_info()}
    assert "missing_dependency" in info["broken"].error


def test_plugin_failing_to_construct_warns_under_warn(fake_eps):
    with pytest.warns(RuntimeWarning, match="thirdparty-x.*license server"):
        s = hookplug.attach(MLP(), "Linear", plugins=["exploding", "quiet"], on_error="warn")
    assert list(s.plugins) == ["quiet"]
    s.remove()


@pytest.mark.parametrize("name, message", [
    ("broken", r"'broken' from distribution 'thirdparty-broken' failed to import "
               r"\(thirdparty_broken:Plugin\): ImportError: No module named 'missing_dependency'"),
    ("exploding", "'exploding' from distribution 'thirdparty-x' failed to construct: "
                  "RuntimeError: cannot reach license server"),
    ("exiting", r"'exiting' from distribution 'thirdparty-exit' failed to import "
                r"\(thirdparty_exit:Plugin\): SystemExit: 3"),
    ("none", "'none' from distribution 'thirdparty-none': its factory 'thirdparty_none:make' "
             "returned None; expected a plugin object"),
])
def test_requested_plugin_that_cannot_be_had_raises_under_raise(fake_eps, name, message):
    model = MLP()
    for attempt in range(2):  # the second attach fails the same way (the failure is remembered)
        with pytest.raises(_manager.PluginLoadError, match=message):
            hookplug.attach(model, "Linear", plugins=[name, "quiet"])
    assert not any(vars(m).get("_forward_hooks") for m in model.modules())
    with pytest.warns(RuntimeWarning, match=message):
        s = hookplug.attach(model, "Linear", plugins=[name, "quiet"], on_error="warn")
    assert list(s.plugins) == ["quiet"]
    s.remove()
    assert {p.name: p for p in hookplug.plugin_info()}[name].error


def test_cli_lists_a_plugin_that_exits_at_import(fake_eps, capsys):
    from hookplug.__main__ import main

    capsys.readouterr()
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["exiting"]["status"] == "failed: SystemExit: 3"
    assert rows["quiet"]["status"] == "ok"


def test_third_party_claiming_a_first_party_name_is_reported(monkeypatch, fresh_discovery):
    real = _manager._entry_points()
    impostor = FakeEntryPoint("stats", "evil_stats:Stats", "evil-stats", lambda: Quiet)
    monkeypatch.setattr(_manager, "_entry_points", lambda: [impostor, *real])
    with pytest.warns(RuntimeWarning, match="'stats' is provided by both 'evil-stats' and 'hookplug'; "
                                            "using the one from 'hookplug'"):
        names = hookplug.plugin_names()
    assert names["stats"] == "first-party"
    assert type(_manager.create_plugin("stats")).__module__ == "hookplug_plugins.stats"


def test_shadowing_hookplug_distribution_is_reported_and_ignored(tmp_path, monkeypatch, fresh_discovery):
    """A distribution named hookplug earlier on sys.path cannot replace the first-party plugins."""
    info = tmp_path / "hookplug-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hookplug\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [hookplug.plugins]
        stats = shadow_stats:Stats
        shadowonly = shadow_stats:Other
    """))
    (tmp_path / "shadow_stats.py").write_text("import hookplug\nclass Stats(hookplug.Plugin):\n    pass\n"
                                              "Other = Stats\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"distribution hookplug at .*"
                                            + str(tmp_path.name) + r".* is not the hookplug being run.*"
                                            r"\(stats, shadowonly\) are ignored"):
        names = hookplug.plugin_names()
    assert names["stats"] == "first-party" and "shadowonly" not in names
    assert type(_manager.create_plugin("stats")).__module__ == "hookplug_plugins.stats"
    assert "shadow_stats" not in sys.modules


def test_options_are_validated(fake_eps):
    with pytest.raises(PluginError, match=r"unknown option 'levl' \(did you mean 'level'\?\); it accepts: level"):
        hookplug.attach(MLP(), "Linear", plugins=("quiet", {"levl": 2}))
    with pytest.raises(PluginError, match="plugin 'quiet' option 'level': expected an int, got 'x'"):
        hookplug.attach(MLP(), "Linear", plugins={"quiet": {"level": "x"}})
    with hookplug.attach(MLP(), "Linear", plugins={"quiet": {"level": 3}}) as s:
        assert s["quiet"].level == 3


def test_unknown_name_lists_available(fake_eps):
    with pytest.raises(PluginError, match="Did you mean 'quiet'.*Available: broken, exiting, exploding, "
                                          "firstparty_fake, none, quiet"):
        hookplug.attach(MLP(), "Linear", plugins="quite")


def test_disable_autoload_keeps_first_party_only(fake_eps, monkeypatch):
    monkeypatch.setenv("HOOKPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    _manager._reset_discovery()
    assert list(hookplug.plugin_names()) == ["firstparty_fake"]
    with pytest.raises(PluginError, match="unknown hookplug plugin 'quiet'"):
        hookplug.attach(MLP(), "Linear", plugins="quiet")


def test_entry_points_read_once(fake_eps, monkeypatch):
    calls = []
    real = _manager._entry_points
    monkeypatch.setattr(_manager, "_entry_points", lambda: calls.append(1) or real())
    _manager._reset_discovery()
    hookplug.plugin_names()
    hookplug.plugin_names()
    hookplug.attach(MLP(), "Linear", plugins="quiet").remove()
    assert len(calls) == 1


def test_first_party_plugins_come_through_entry_points(fresh_discovery):
    names = hookplug.plugin_names()
    for name in ("stats", "capture", "gradclamp", "flops"):
        assert names.get(name) == "first-party", names
    for core in map(importlib.import_module, ("hookplug._session", "hookplug._binding")):
        assert "hookplug_plugins" not in "".join(
            line for line in open(core.__file__).read().splitlines() if "import" in line
        ), "the core must never import first-party plugins by name"


def test_installed_third_party_example(fresh_discovery):
    """examples/thirdparty_plugin is installed by the test command and found by name."""
    names = hookplug.plugin_names()
    assert names.get("nanguard") == "hookplug-nanguard 0.1.0", names
    model = MLP()
    with hookplug.attach(model, "Linear", plugins="nanguard") as s:
        model(torch.randn(2, 32))
        assert s["nanguard"].results() == {"checked": 4}
        model.fc2.weight.data[0, 0] = float("nan")
        err = sys.modules["hookplug_nanguard"].NonFiniteError
        with pytest.raises(err, match=r"module 'fc2' \(call 2\): output has 2 NaN"):
            model(torch.randn(2, 32))


def test_hookspecs_are_documented():
    specs = [n for n in dir(hookplug.hookspecs) if n.startswith("hookplug_")]
    assert len(specs) >= 9
    for n in specs:
        assert getattr(hookplug.hookspecs, n).__doc__, n


def test_plugins_built_directly_check_their_options():
    from hookplug_plugins.gradclamp import GradClampPlugin
    from hookplug_plugins.sinks.jsonl import JsonlSink
    from hookplug_plugins.stats import StatsPlugin

    cases = [(lambda: StatsPlugin(nonfinite="raize"), "option 'nonfinite': expected one of 'record', 'raise'"),
             (lambda: StatsPlugin(bins="32"), "option 'bins': expected an int, got '32'"),
             (lambda: GradClampPlugin(nan="zer0"), "option 'nan'"),
             (lambda: JsonlSink(path=3), "option 'path'")]
    for build, message in cases:
        with pytest.raises(PluginError, match=message):
            build()
    assert StatsPlugin(sites={"output", "grad"}).sites  # any finite iterable of names


def test_one_shot_iterables_given_for_sequence_options_reach_the_plugin():
    class Tags(hookplug.Plugin):
        name = "tags"

        def __init__(self, *, tags: Sequence[str] = (), pair: Tuple[int, int] = (0, 0)):
            self.tags, self.pair = tags, pair

    p = Tags(tags=(t for t in "xy"), pair=iter([1, 2]))  # built directly: checked, then passed on
    assert p.tags == ["x", "y"] and p.pair == (1, 2)
    with pytest.raises(PluginError, match="option 'tags': expected a string or a sequence of strings, got \\[1\\]"):
        Tags(tags=iter([1]))
    m = MLP()
    with hookplug.attach(m, "Linear", [("stats", {"sites": (x for x in ("output", "grad"))}),
                                       ("gradclamp", {"min": 0, "max": 0, "params": map(str, ["*.bias"])})]) as s:
        assert s["stats"].sites == ("output", "grad")
        m(torch.randn(2, 32)).sum().backward()
    assert (m.fc1.bias.grad == 0).all() and (m.fc1.weight.grad != 0).any()


def test_dataclass_plugins_and_sinks_check_their_fields():
    """``@dataclass`` makes ``__init__`` after the base class could wrap it: the fields are
    checked in the bases' ``__post_init__`` (frozen, with an InitVar, a sink) as a hand-written
    constructor's options are, and what a check materialises is set back."""
    import dataclasses

    @dataclasses.dataclass
    class Threshold(hookplug.Plugin):
        name = "threshold"
        level: float = 1.0
        tags: Sequence[str] = ()

        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx, output):
            pass

    with pytest.raises(PluginError, match="plugin 'threshold' option 'level': expected a number, got 'high'"):
        Threshold(level="high")
    assert Threshold(tags=(t for t in "ab")).tags == ["a", "b"]

    @dataclasses.dataclass(frozen=True)
    class Frozen(hookplug.Plugin):
        name = "frozen"
        pair: Tuple[int, int] = (0, 0)
        scale: dataclasses.InitVar[int] = 1

    assert Frozen(pair=iter([1, 2]), scale=3).pair == (1, 2)
    with pytest.raises(PluginError, match="option 'pair'"):
        Frozen(pair=("a", "b"))

    @dataclasses.dataclass
    class Lines(hookplug.Sink):
        name = "lines"
        every: int = 1

        @hookplug.hookimpl
        def hookplug_flush(self, session, records):
            pass

    with pytest.raises(PluginError, match="plugin 'lines' option 'every': expected an int, got 2.5"):
        Lines(every=2.5)
    with pytest.raises(PluginError, match="option 'level'"):
        hookplug.attach(MLP(), "Linear", plugins=[Threshold(level=None)])  # not Optional: None refused
    with hookplug.attach(MLP(), "Linear", plugins=[Threshold(level=2)], sink=[Lines()]) as s:
        assert s["threshold"].level == 2

    # only the values are checked: a subclass with an __init__ of its own, a required
    # InitVar, and a dataclass mixin's own __post_init__ (run after the base's) still work
    class Scaled(Threshold):
        def __init__(self, scale):
            super().__init__(level=scale * 2)

    assert Scaled(3).level == 6

    @dataclasses.dataclass
    class Seeded(hookplug.Plugin):
        name = "seeded"
        seed: dataclasses.InitVar[int]
        rng: float = 0.0

        def __post_init__(self, seed):
            super().__post_init__(seed)
            self.rng = float(seed)

    assert Seeded(seed=3).rng == 3.0

    @dataclasses.dataclass
    class Config:
        width: int = 1

        def __post_init__(self):
            self.width *= 10

    @dataclasses.dataclass
    class Mixed(hookplug.Plugin, Config):
        name = "mixed"

    assert Mixed(width=2).width == 20
    with pytest.raises(PluginError, match="option 'width': expected an int"):
        Mixed(width="2")


def test_plugin_built_directly_with_a_bad_call_names_the_class_and_plugin():
    with pytest.raises(TypeError, match=r"^Needs\(\): plugin 'needs' is missing its required option 'level' "
                                        r"\(a number\)$"):
        Needs()
    with pytest.raises(TypeError, match=r"^Needs\(\): plugin 'needs' got unknown option 'tga' "
                                        r"\(did you mean 'tag'\?\); it accepts: level, tag$"):
        Needs(level=1, tga="x")
    with pytest.raises(TypeError, match=r"^Needs\(\): too many positional arguments \(plugin 'needs'\)$"):
        Needs(1)
    assert Needs(level=2).level == 2


def test_missing_required_option_and_constructor_bug_through_attach(eps_of):
    eps_of(needs=Needs, buggy=BuggyInit, quiet=Quiet)
    # a missing option is the caller's to fix: raised under "warn" too, never "rejected its options {}"
    with pytest.raises(PluginError, match=r"plugin 'needs' is missing its required option 'level' \(a number\)"):
        hookplug.attach(MLP(), "Linear", plugins=["needs", "quiet"], on_error="warn")
    # a bug in a constructor given no options is a failure to construct, which "warn" skips
    with pytest.raises(_manager.PluginLoadError,
                       match="'buggy' from distribution 'thirdparty-buggy' failed to construct: TypeError: object"):
        hookplug.attach(MLP(), "Linear", plugins=["buggy", "quiet"])
    with pytest.warns(RuntimeWarning, match="'buggy'.*failed to construct.*attached without it"):
        s = hookplug.attach(MLP(), "Linear", plugins=["buggy", "quiet"], on_error="warn")
    assert list(s.plugins) == ["quiet"]
    s.remove()
    # with options given, a TypeError/ValueError is the plugin's verdict on them
    with pytest.raises(PluginError, match=r"plugin 'buggy' rejected its options \{'n': 2\}"):
        hookplug.attach(MLP(), "Linear", plugins=("buggy", {"n": 2}), on_error="warn")


def test_plugin_not_fitting_the_specs_raises_or_is_left_out_and_the_cli_says_so_in_one_line(eps_of, capsys):
    from hookplug.__main__ import main

    eps_of(typo=TypoHook)
    capsys.readouterr()
    # a plugin the command names that cannot be attached is its error (status 2), in one line
    assert main(["profile", "mlp", "--plugins", "stats,typo", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""
    assert "error: hookplug plugin 'typo': unknown hook 'hookplug_forward_outptu'" in err


def test_unmarked_hook_method_warns_when_the_class_is_defined():
    with pytest.warns(RuntimeWarning, match=r"Forgot\.hookplug_forward_output is named like a hookplug hook but is not "
                                            r"marked @hookplug.hookimpl, so hookplug never calls it: add "
                                            r"@hookplug.hookimpl above it") as record:
        class Forgot(hookplug.Plugin):
            def hookplug_forward_output(self, ctx, output):
                pass
    assert len(record) == 1 and record[0].filename == __file__  # points at the class statement
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Marked(hookplug.Plugin):
            hookplug_note = "not a method"

            @hookplug.hookimpl
            def hookplug_forward_output(self, ctx, output):
                pass

            def helper(self):
                pass


def test_a_hook_written_without_self_is_refused_naming_the_fix():
    """Without ``self`` pluggy takes the first parameter for it: ``ctx`` would be the plugin
    and the hook would silently get fewer arguments. A staticmethod is fine."""
    with pytest.raises(TypeError, match=r"NoSelf\.hookplug_forward_output\(ctx, output\) has no self: as a method it "
                                        r"would get the plugin as 'ctx'; write def hookplug_forward_output\(self, ctx"):
        class NoSelf(hookplug.Plugin):
            @hookplug.hookimpl
            def hookplug_forward_output(ctx, output):
                pass

    class Plain:  # a plain object: checked at attach, inherited hooks too
        @hookplug.hookimpl
        def hookplug_step(session, step):
            pass

    class Child(Plain):
        pass

    with pytest.raises(TypeError, match=r"Plain\.hookplug_step\(session, step\) has no self"):
        hookplug.attach(MLP(), "Linear", plugins=[Child()])

    seen = []

    class Static(hookplug.Plugin):
        name = "static"

        @staticmethod
        @hookplug.hookimpl
        def hookplug_step(session, step):
            seen.append(step)

    model = MLP()
    with hookplug.attach(model, "Linear", plugins=[Static()]) as s:
        model(torch.randn(2, 32))
        s.step()
    assert seen == [0]


def test_an_inherited_unmarked_hook_of_a_plain_object_is_warned_about():
    class Base:
        def hookplug_step(self, session, step):  # (no mark: never called)
            pass

    class Child(Base):
        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx, output):
            pass

    with pytest.warns(RuntimeWarning, match=r"Base.hookplug_step is named like a hookplug hook but is not marked"):
        hookplug.attach(MLP(), "Linear", plugins=[Child()]).remove()

    class Marked:
        @hookplug.hookimpl
        def hookplug_step(self, session, step):
            pass

        @hookplug.hookimpl
        def hookplug_session_start(self, session):
            pass

    class Override(Marked):  # the unmarked override switches the base's hook off: it is named
        def hookplug_step(self, session, step):
            pass

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hookplug.attach(MLP(), "Linear", plugins=[Override()]).remove()

        class Star(hookplug.Plugin):  # (*args takes no plugin for a hook argument)
            @hookplug.hookimpl
            def hookplug_step(*args):
                pass
    assert [str(w.message).split(" is named")[0].rsplit(".", 2)[-2:] for w in seen] == [["Override", "hookplug_step"]]


@pytest.mark.parametrize("made, got", [
    (lambda **options: Quiet, "the class Quiet, not an instance of it"),
    (lambda **options: {"level": 1}, "a dict with no @hookplug.hookimpl method"),
])
def test_entry_point_factory_returning_no_plugin_object_fails_at_attach_naming_it(eps_of, made, got):
    """A factory returning the plugin class instead of an instance was attached and failed at
    the first forward ('missing 1 required positional argument'); one returning an object with
    no hooks was attached and did nothing. Both fail to load, as a factory returning None does."""
    eps_of(odd=made)
    model = MLP()
    message = (r"hookplug plugin 'odd' from distribution 'thirdparty-odd': its factory 'thirdparty_odd:P' "
               rf"returned {got}; expected a plugin object")
    with pytest.raises(_manager.PluginLoadError, match=message):
        hookplug.attach(model, "Linear", plugins=["odd", "stats"])
    with pytest.warns(RuntimeWarning, match=message):
        s = hookplug.attach(model, "Linear", plugins=["odd", "stats"], on_error="warn")
    model(torch.randn(2, 32))
    s.remove()
    assert list(s.plugins) == ["stats"] and not s.disabled


def test_entry_point_naming_a_module_fails_to_import_saying_how_to_write_it(eps_of):
    """An entry point value with no ':attr' loads the module: it failed at attach with
    "TypeError: 'module' object is not callable", and `hookplug plugins` listed it as ok."""
    eps_of(modonly=textwrap)
    message = (r"hookplug plugin 'modonly' from distribution 'thirdparty-modonly' failed to import "
               r"\(thirdparty_modonly:P\): it names a module, not a plugin class or factory; write "
               r"the entry point as 'package.module:PluginClass'")
    with pytest.raises(_manager.PluginLoadError, match=message):
        hookplug.attach(MLP(), "Linear", plugins=["modonly"])
    info = {p.name: p for p in hookplug.plugin_info()}
    assert "names a module" in info["modonly"].error


def test_entry_point_with_a_malformed_value_fails_to_load_saying_so(monkeypatch, fresh_discovery):
    """``mod:W:X`` (two colons): importlib's ``load()`` raised "AttributeError: 'NoneType'
    object has no attribute 'group'", which said nothing of the value."""
    from importlib.metadata import EntryPoint

    class Bad(FakeEntryPoint):
        pattern = EntryPoint.pattern

        def load(self):  # what importlib does with it
            return EntryPoint(self.name, self.value, "hookplug").load()

    bad = Bad("bad", "thirdparty_bad:W:X", "thirdparty-bad", None)
    monkeypatch.setattr(_manager, "_entry_points", lambda: [bad])
    with pytest.raises(_manager.PluginLoadError, match=r"failed to import \(thirdparty_bad:W:X\): the entry "
                       r"point's value 'thirdparty_bad:W:X' is malformed; write it as 'package\.module:PluginClass'"):
        hookplug.attach(MLP(), "Linear", plugins=["bad"])


def test_config_sinks_given_by_a_factory_or_a_specname_flush_are_sinks(eps_of):
    """``[sinks.NAME]`` refuses a plugin that is no sink: but a sink whose entry point is a
    factory function, or whose flush is ``@hookimpl(specname="hookplug_flush")``, is one
    (as ``attach(sink=...)`` takes it), and was refused."""
    from hookplug._config import ConfigError, parse_config

    class SpecSink(hookplug.Sink):
        @hookplug.hookimpl(specname="hookplug_flush")
        def write(self, records):
            pass

    def made(**options):
        return SpecSink()

    eps_of(spec=SpecSink, made=made, quiet=Quiet)
    cfg = parse_config({"plugins": ["stats"], "sinks": {"spec": {}, "made": {}}})
    assert set(cfg["sink"]) == {"spec", "made"}
    with hookplug.attach(MLP(), **cfg) as s:
        s.step()
    with pytest.raises(ConfigError, match=r"\[sinks\.quiet\]: expected a sink"):
        parse_config({"plugins": ["stats"], "sinks": {"quiet": {}}})


def test_session_hook_written_as_a_wrapper_raises_instead_of_never_running():
    """A session-level hook marked hookwrapper=True / wrapper=True (pluggy's wrappers): the
    session calls each hook itself, so its body never ran and nothing said so; now it is
    refused at attach as a per-call hook's wrapper is (left out under on_error="warn")."""
    calls = []

    class StepWrapper(hookplug.Plugin):
        name = "stepwrap"

        @hookplug.hookimpl(hookwrapper=True)
        def hookplug_step(self, session, step):
            calls.append(step)
            yield

    class FlushWrapper(hookplug.Sink):
        name = "flushwrap"

        @hookplug.hookimpl(wrapper=True)
        def hookplug_flush(self, records):
            calls.append(len(records))
            return (yield)

    model = MLP()
    with pytest.raises(PluginError, match="plugin 'stepwrap': hookplug_step cannot be a hookwrapper/wrapper"):
        hookplug.attach(model, "Linear", plugins=["stats", StepWrapper()])
    with pytest.raises(PluginError, match="plugin 'flushwrap': hookplug_flush cannot be a hookwrapper/wrapper"):
        hookplug.attach(model, "Linear", plugins="stats", sink=FlushWrapper(), flush_every=1)
    assert not any(vars(m).get("_forward_hooks") for m in model.modules())
    with pytest.warns(RuntimeWarning, match="'stepwrap'.*implement it as a plain hook"):
        s = hookplug.attach(model, "Linear", plugins=["stats", StepWrapper()], on_error="warn")
    assert list(s.plugins) == ["stats"]
    s.remove()
    assert calls == []


def test_ctx_step_in_compiled_code_is_documented():
    """Reading ctx.step in a traceable hook recompiles every step: the ctx docs and the
    README's "Writing a plugin" say so and name the ways out."""
    import os

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    plugin_section = readme[readme.index("## Writing a plugin"):readme.index("## Layout")]
    for text in (hookplug.hookspecs.__doc__, plugin_section, hookplug.HookContext.__doc__):
        flat = " ".join(text.split())
        assert "ctx.step" in flat or "``step`` is a Python int" in flat, text
        assert "recompile" in flat
    for text in (hookplug.hookspecs.__doc__, plugin_section):
        flat = " ".join(text.split())
        assert "traceable = False" in flat and "hookplug_step" in flat


def _dist(where, version, target):
    info = where / f"tp_plugins-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tp-plugins\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[hookplug.plugins]\ntpgood = {target}\n")


def test_a_stale_copy_of_a_distribution_later_on_sys_path_is_not_used(tmp_path, monkeypatch, fresh_discovery):
    """Two copies of one third-party distribution (``pip install --user`` beside a system
    one): the first on sys.path, the one Python imports, provides the plugin (the last
    one did: a stale entry point, and a class that no longer exists)."""
    _dist(tmp_path / "new", "1.2.3", "tp_plugins_mod:Good")
    _dist(tmp_path / "old", "0.9", "tp_plugins_mod:OldGood")
    (tmp_path / "new" / "tp_plugins_mod.py").write_text(
        "import hookplug\nclass Good(hookplug.Plugin):\n    name = 'tpgood'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "old"))
    monkeypatch.syspath_prepend(str(tmp_path / "new"))
    assert hookplug.plugin_names()["tpgood"] == "tp-plugins 1.2.3"
    assert type(_manager.create_plugin("tpgood")).__name__ == "Good"


def test_sinks_built_directly_check_their_options_through_the_base_init():
    """A Sink subclass without an __init__ of its own (the README's CsvSink) is built by
    Sink.__init__, which checks its options too, naming the subclass's plugin."""
    class CsvSink(hookplug.Sink):
        name = "csv"

        @hookplug.hookimpl
        def hookplug_flush(self, records):
            pass

    class Forwards(hookplug.Sink):
        name = "fwd"

        def __init__(self, **kw):
            super().__init__(**kw)

    with pytest.raises(PluginError, match="plugin 'csv' option 'all_ranks': expected a boolean, got 'yes'"):
        CsvSink(all_ranks="yes")
    with pytest.raises(PluginError, match="plugin 'csv' option 'path': expected a string or a PathLike, got 3"):
        CsvSink(path=3)
    with pytest.raises(TypeError, match=r"CsvSink\(\): plugin 'csv' got unknown option 'paht' \(did you mean 'path'"):
        CsvSink(paht="x")
    with pytest.raises(TypeError, match=r"Forwards\(\): plugin 'fwd' got unknown option 'pth'"):
        Forwards(pth="x")
    assert CsvSink(path="x.csv").path_option == "x.csv"


@pytest.mark.parametrize("signature", ["*args", "*, ctx, output", "ctx, output, **rest", "ctx, *, extra=1"])
def test_a_hook_taking_arguments_it_is_never_given_is_refused_or_warned_at_attach(signature):
    """A keyword-only argument without a default would fail at the first call: refused;
    ``*args``/``**kwargs`` receive nothing: a warning; one with a default: fine."""
    namespace = {}
    exec(textwrap.dedent(f"""
        import hookplug
        class P(hookplug.Plugin):
            name = "p"
            @hookplug.hookimpl
            def hookplug_forward_output(self, {signature}):
                pass
    """), namespace)
    plugin = namespace["P"]()
    if signature.startswith("*,"):
        with pytest.raises(PluginError, match=r"plugin 'p': hookplug_forward_output takes the keyword-only "
                                              r"argument\(s\) ctx, output, which hooks are never given"):
            hookplug.attach(MLP(), "Linear", plugins=plugin)
    elif "*" in signature.replace("*,", ""):
        with pytest.warns(RuntimeWarning, match=r"hookplug_forward_output's \*\*?(args|rest) receive nothing"):
            hookplug.attach(MLP(), "Linear", plugins=plugin).remove()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hookplug.attach(MLP(), "Linear", plugins=plugin).remove()


def test_a_sink_implementing_flush_under_another_method_name_is_a_sink(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class S(hookplug.Sink):
        name = "s"

        def __init__(self):
            super().__init__()
            self.records = []

        @hookplug.hookimpl(specname="hookplug_flush")
        def write(self, records):
            self.records += records

    for how in ("sink", "plugins"):
        sink, model = S(), MLP()
        kw = {"sink": sink, "plugins": "stats"} if how == "sink" else {"plugins": ["stats", sink]}
        with hookplug.attach(model, "Linear", flush_every=1, **kw) as s:
            model(torch.randn(2, 32))
            s.step()
        assert len(sink.records) == 3 and not (tmp_path / "runs").exists()


def test_plugin_specs_that_cannot_be_what_they_look_like_say_so():
    with pytest.raises(PluginError, match=r"plugins=\[\.\.\.\]: \{'bins': 0\} after 'stats' holds options, not "
                                          r"plugins; write the pair as a tuple"):
        hookplug.attach(MLP(), "Linear", plugins=["stats", {"bins": 0}])

    class Numbered(hookplug.Plugin):
        name = 123

    with pytest.raises(PluginError, match="a plugin's name must be a non-empty str .* Numbered has name 123"):
        hookplug.attach(MLP(), "Linear", plugins=Numbered())
    with hookplug.attach(MLP(), "Linear", plugins=["capture", {"stats": None}]) as s:  # two plugins
        assert set(s.plugins) == {"capture", "stats"}


def test_check_attach_arguments_agrees_with_attach(fake_eps, eps_of):
    """What the trainer callbacks check when made is what attach() would do: None is "not
    set", a plugin that fails to load is left out under on_error="warn", a one-shot iterator
    option is not consumed by the check, and what attach() refuses is refused."""
    from hookplug._session import check_attach_arguments

    check_attach_arguments("CB", None, ["quiet"], {"every": None, "on_error": None, "strict": None,
                                                  "distributed": None, "flush_every": None})
    check_attach_arguments("CB", None, ["broken", "quiet"], {"on_error": "warn"})
    with pytest.raises(_manager.PluginLoadError, match="^CB: .*thirdparty-broken"):
        check_attach_arguments("CB", None, ["broken", "quiet"], {})
    with pytest.raises(hookplug.PluginError, match=r"^CB: with a \{selector: plugins\} dict"):
        check_attach_arguments("CB", {"Linear": "quiet"}, "quiet", {})
    with pytest.raises(hookplug.PluginError, match="^CB: no plugins given for selector"):
        check_attach_arguments("CB", "Linear", [], {})
    with pytest.raises(TypeError, match="^CB: attach\\(\\): strict must be") as info:
        check_attach_arguments("CB", None, "quiet", {"strict": 1})
    assert str(info.value).count("CB") == 1
    eps_of(needs=Needs)
    sites = (s for s in ["a", "b"])
    check_attach_arguments("CB", None, [("needs", {"level": 1.0, "tag": sites})], {})
    assert list(sites) == ["a", "b"], "the check consumed the user's iterator"
    with pytest.raises(hookplug.PluginError, match="option 'level'"):
        check_attach_arguments("CB", None, [("needs", {"level": "high"})], {})


def test_a_dataclass_sinks_path_and_all_ranks_fields(tmp_path):
    """A ``@dataclass`` sink declaring ``path``/``all_ranks`` gets them as ``Sink.__init__``
    gives them (its path was ignored: records went to runs/<run-id>; a bad placeholder was
    not refused)."""
    import dataclasses
    import os
    from typing import Optional

    @dataclasses.dataclass
    class Lines(hookplug.Sink):
        name = "lines"
        file_name = "out.txt"
        path: Optional[str] = None
        all_ranks: bool = False

        @hookplug.hookimpl
        def hookplug_flush(self, session, records):
            self.wrote = self.resolve_path(session)

    sink = Lines(path=str(tmp_path / "here"), all_ranks=True)
    assert sink.path == str(tmp_path / "here") and sink.path_option == sink.path and sink.all_ranks
    assert dataclasses.replace(sink, all_ranks=False).path_option == sink.path  # (the field kept)
    assert sink != Lines(path=str(tmp_path / "there"))
    model = MLP()
    with hookplug.attach(model, "Linear", plugins="stats", sink=sink, flush_every=1) as s:
        model(torch.randn(2, 32))
        s.step()
    assert sink.wrote == os.path.join(str(tmp_path / "here"), "out.txt")
    with pytest.raises(ValueError, match=r"lines sink: path 'runs/\{step\}' has the placeholder \{step\}"):
        Lines(path="runs/{step}")


def test_plugin_author_mistakes_get_errors_that_say_what_to_do():
    """A plain object's unmarked hook is warned about as a Plugin subclass's is; a plain
    object with hooks but no mark, and ``(instance, {options})``, get errors saying what to
    do; a report section that is not a dict names its plugin."""
    class Half:
        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx, output):
            pass

        def hookplug_step(self, session, step):  # (no mark: never called)
            pass

    class Unmarked:
        def hookplug_forward_output(self, ctx, output):
            pass

    model = MLP()
    with pytest.warns(RuntimeWarning, match=r"Half.hookplug_step is named like a hookplug hook but is not marked"):
        hookplug.attach(model, "Linear", plugins=[Half()]).remove()
    with pytest.raises(PluginError, match=r"it has hookplug_forward_output but no method marked @hookplug.hookimpl"):
        hookplug.attach(model, "Linear", plugins=[Unmarked()])
    with pytest.raises(PluginError, match=r"is an instance, built with its options already: give them to its "
                                          r"constructor \(Half\(...\)\)"):
        hookplug.attach(model, "Linear", plugins=(Half(), {"k": 2}))

    class Texty(hookplug.Plugin):
        name = "texty"

        @hookplug.hookimpl
        def hookplug_report_section(self, session):
            return ["a", "list"]

    with hookplug.attach(model, "Linear", plugins=[Texty()]) as s:
        with pytest.raises(TypeError, match="hookplug plugin 'texty': hookplug_report_section must return"):
            s.report_sections()


@pytest.mark.parametrize("signature", ["(self, ctx, output=None)", "(self, ctx, *, output=None)"])
def test_a_spec_argument_given_a_default_is_refused_as_it_would_never_be_passed(signature):
    """pluggy passes only parameters without a default: ``output=None`` got None on every
    call, silently."""
    ns: dict = {}
    exec(f"def hookplug_forward_output{signature}:\n    return None", ns)

    class Defaulted(hookplug.Plugin):
        name = "defaulted"
        hookplug_forward_output = hookplug.hookimpl(ns["hookplug_forward_output"])

    with pytest.raises(PluginError, match=r"plugin 'defaulted': hookplug_forward_output gives the spec "
                                          r"argument\(s\) output a default, so they would never be passed"):
        hookplug.attach(MLP(), "Linear", plugins=[Defaulted()])
    with pytest.warns(RuntimeWarning, match="defaulted"):
        with hookplug.attach(MLP(), "Linear", plugins=[Defaulted(), "stats"], on_error="warn") as s:
            assert list(s.plugins) == ["stats"]


@pytest.mark.parametrize("kind", ["generator", "async"])
def test_a_hook_written_as_a_generator_or_coroutine_is_refused(kind):
    """Its body never ran (a call only makes the generator/coroutine), silently."""
    body = "    yield" if kind == "generator" else "    pass"
    ns: dict = {}
    exec(f"{'async ' if kind == 'async' else ''}def hookplug_step(self, step):\n{body}", ns)

    class Gen(hookplug.Plugin):
        name = "gen"
        hookplug_step = hookplug.hookimpl(ns["hookplug_step"])

    with pytest.raises(PluginError, match=r"plugin 'gen': hookplug_step is a generator or async function"):
        hookplug.attach(MLP(), "Linear", plugins=[Gen()])


def test_a_failing_report_section_leaves_its_plugin_collecting():
    """Under on_error="warn" a report section that raised disabled its plugin (its forward
    hooks stopped), where a failing report() or results() only leaves it out."""

    class Counting(hookplug.Plugin):
        name = "counting"

        def __init__(self):
            self.calls = 0

        @hookplug.hookimpl
        def hookplug_forward_output(self, ctx):
            self.calls += 1

        @hookplug.hookimpl
        def hookplug_report_section(self, session):
            raise KeyError("oops")

    model, plugin = MLP(), Counting()
    with hookplug.attach(model, "Linear", plugins=[plugin, "stats"], on_error="warn") as s:
        model(torch.randn(2, 32))
        with pytest.warns(RuntimeWarning, match=r"plugin 'counting': hookplug_report_section failed "
                                                r"\(KeyError: 'oops'\); left out of the report"):
            sections = s.report_sections()
        assert "counting" not in sections and "stats" in sections
        before = plugin.calls
        model(torch.randn(2, 32))
        assert plugin.calls > before and not s.disabled
    with hookplug.attach(model, "Linear", plugins=[Counting()]) as s:
        with pytest.raises(KeyError, match="oops") as info:
            s.report_sections()
        assert any("'counting' in hookplug_report_section" in n for n in getattr(info.value, "__notes__", []))


def test_the_cli_option_form_given_to_attach_says_how_to_write_it_in_python():
    with pytest.raises(PluginError, match=r"unknown hookplug plugin 'stats\(bins=0\)': the 'name\(option=value\)' "
                                          r"form is the command line's \(--plugins\); in Python give \('stats', "):
        hookplug.attach(MLP(), "Linear", plugins="stats(bins=0)")


def test_a_forward_output_hook_failing_on_a_raised_forward_says_output_was_none():
    class Clamp(hookplug.Plugin):
        name = "clamp"

        @hookplug.hookimpl
        def hookplug_forward_output(self, output):
            return output.clamp(-1, 1)

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("out of memory (simulated)")

    model = torch.nn.Sequential(Boom())
    with hookplug.attach(model, "Boom", plugins=[Clamp()], on_error="warn") as s:
        with pytest.warns(RuntimeWarning, match=r"hookplug_forward_output \(given output=None: the forward "
                                                r"raised, or returned None\)"):
            with pytest.raises(RuntimeError, match="simulated"):
                model(torch.randn(2))
        assert "output=None" in s.disabled["clamp"]


def test_cli_plugins_lists_a_class_with_no_hooks_as_failed_and_keeps_its_json_clean(eps_of, capsys):
    """An entry point naming a class that is no plugin (``collections:OrderedDict``) was
    listed "ok", with that class's docstring; a plugin module printing as it imports broke
    ``--json``; a plugin class without a docstring had no description (its module's now)."""
    import collections
    import types

    from hookplug.__main__ import main

    noisy = types.ModuleType("thirdparty_noisy", "Noisy: says hello as it imports.")

    def load_noisy():
        print("hello from a plugin module")

        class Noisy(hookplug.Plugin):
            @hookplug.hookimpl
            def hookplug_step(self, step):
                pass

        Noisy.__module__ = noisy.__name__
        return Noisy

    class Lazy:  # a factory the loader calls: prints as an import would
        def __call__(self):
            return load_noisy()

    sys.modules[noisy.__name__] = noisy
    try:
        eps_of(odict=collections.OrderedDict)
        real = _manager._entry_points()
        ep = FakeEntryPoint("noisy", "thirdparty_noisy:Noisy", "thirdparty-noisy", Lazy())
        _manager._entry_points, old = (lambda: [ep, *real]), _manager._entry_points
        _manager._reset_discovery()
        try:
            capsys.readouterr()
            assert main(["plugins", "--json"]) == 0
            out, err = capsys.readouterr()
        finally:
            _manager._entry_points = old
    finally:
        del sys.modules[noisy.__name__]
    rows = {r["name"]: r for r in json.loads(out)}
    assert "hello from a plugin module" in err
    assert rows["odict"]["status"] == ("failed: it names the class OrderedDict, which has no "
                                       "@hookplug.hookimpl method (not a plugin)")
    assert rows["noisy"]["status"] == "ok"
    assert rows["noisy"]["description"] == "Noisy: says hello as it imports."


def test_a_report_section_holding_a_tensor_is_a_plugin_error():
    """"Plain data" was not checked: a device tensor in a section meant a sync per report and
    a list in the JSON."""

    class Tensory(hookplug.Plugin):
        name = "tensory"

        @hookplug.hookimpl
        def hookplug_report_section(self, session):
            return {"summary": "ok", "stats": {"fc1": {"mean": torch.tensor(0.5)}}}

    with hookplug.attach(MLP(), "Linear", plugins=[Tensory()]) as s:
        with pytest.raises(TypeError, match=r"plugin 'tensory': hookplug_report_section must return plain "
                                            r"data \(host numbers\), got a tensor at section\.stats\.fc1\.mean"):
            s.report_sections()


def test_a_forward_output_hook_given_a_filled_in_output_is_not_said_to_get_none():
    """The "given output=None" note read the module's output, not what the failing plugin
    got: after a plugin before it replaced a None output, it said None wrongly."""

    class NoneOut(torch.nn.Module):
        def forward(self, x):
            return None

    class Fill(hookplug.Plugin):
        name = "fill"

        @hookplug.hookimpl
        def hookplug_forward_output(self, output):
            return torch.zeros(1) if output is None else None

    class Picky(hookplug.Plugin):
        name = "picky"

        @hookplug.hookimpl
        def hookplug_forward_output(self, output):
            raise ValueError(f"bad {type(output).__name__}")

    model = torch.nn.Sequential(NoneOut())
    with pytest.warns(RuntimeWarning, match="picky"):
        with hookplug.attach(model, "NoneOut", plugins=[Fill(), Picky()], on_error="warn") as s:
            assert torch.equal(model(torch.randn(2)), torch.zeros(1))
    assert s.disabled["picky"] == "ValueError in hookplug_forward_output: bad Tensor"
