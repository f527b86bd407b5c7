import sys

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


def broken_import():
    raise ImportError("No module named 'missing_dependency'")


class ExplodingPlugin(hookplug.Plugin):
    def __init__(self):
        raise RuntimeError("cannot reach license server")


@pytest.fixture
def fake_eps(monkeypatch, fresh_discovery):
    eps = [
        FakeEntryPoint("quiet", "thirdparty_quiet:Quiet", "thirdparty-quiet", lambda: Quiet),
        FakeEntryPoint("broken", "thirdparty_broken:Plugin", "thirdparty-broken", broken_import),
        FakeEntryPoint("exploding", "thirdparty_x:Plugin", "thirdparty-x", lambda: ExplodingPlugin),
        FakeEntryPoint("firstparty_fake", "hookplug_plugins.fake:P", "hookplug", lambda: Quiet),
    ]
    monkeypatch.setattr(_manager, "_entry_points", lambda: eps)
    return {ep.name: ep for ep in eps}


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


def test_broken_plugin_warns_naming_distribution_and_others_work(fake_eps):
    model = MLP()
    with pytest.warns(RuntimeWarning, match="thirdparty-broken.*missing_dependency"):
        s = hookplug.attach(model, "Linear", plugins=["broken", "quiet"])
    model(torch.randn(2, 32))
    s.remove()
    assert list(s.plugins) == ["quiet"] and s["quiet"].seen == 4
    info = {p.name: p for p in hookplug.plugin_info()}
    assert "missing_dependency" in info["broken"].error


def test_plugin_failing_to_construct_warns(fake_eps):
    with pytest.warns(RuntimeWarning, match="thirdparty-x.*license server"):
        s = hookplug.attach(MLP(), "Linear", plugins=["exploding", "quiet"])
    assert list(s.plugins) == ["quiet"]
    s.remove()


def test_options_are_validated(fake_eps):
    with pytest.raises(PluginError, match=r"unknown option 'levl' \(did you mean 'level'\?\); it accepts: level"):
        hookplug.attach(MLP(), "Linear", plugins=("quiet", {"levl": 2}))
    with pytest.raises(PluginError, match="level must be an int, got str"):
        hookplug.attach(MLP(), "Linear", plugins={"quiet": {"level": "x"}})
    with hookplug.attach(MLP(), "Linear", plugins={"quiet": {"level": 3}}) as s:
        assert s["quiet"].level == 3


def test_unknown_name_lists_available(fake_eps):
    with pytest.raises(PluginError, match="Did you mean 'quiet'.*Available: broken, exploding, firstparty_fake, quiet"):
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
    assert "hookplug_plugins" not in "".join(
        line for line in open(hookplug._session.__file__).read().splitlines() if "import" in line
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
