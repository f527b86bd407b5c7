"""hookplug: attach plugins to any PyTorch model through a declarative selector.

    with hookplug.attach(model, "Conv2d:*", plugins=["stats", "capture"]) as session:
        model(x).sum().backward()
    print(session.report())
"""
from importlib import import_module as _import_module

from . import structures
from ._manager import PluginError, plugin_info, plugin_names
from ._plugin import Plugin
from ._selectors import SelectorError, select
from ._session import HookContext, Session, attach
from ._sink import Sink
from .hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = [
    "attach",
    "select",
    "Session",
    "HookContext",
    "Plugin",
    "Sink",
    "STAT_FIELDS",
    "SelectorError",
    "PluginError",
    "hookspec",
    "hookimpl",
    "plugin_names",
    "plugin_info",
    "TensorStats",
    "StatsBlock",
    "ops",
    "load_capture",
    "load_config",
    "plot_features",
    "structures",
]

# Imported on first use so that `import hookplug` stays light.
_LAZY = {
    "ops": ("hookplug.ops", None),
    "TensorStats": ("hookplug._stats", "TensorStats"),
    "StatsBlock": ("hookplug._stats", "StatsBlock"),
    "STAT_FIELDS": ("hookplug._telemetry", "STAT_FIELDS"),
    "load_capture": ("hookplug._capture_io", "load_capture"),
    "load_config": ("hookplug._config", "load_config"),
    "plot_features": ("hookplug.cli._plot", "plot_features"),
}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = _import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hookplug' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
