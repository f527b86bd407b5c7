"""Trainer integrations, each imported only when asked for (``import hookplug`` never
imports a trainer):

- :mod:`hookplug.integrations.lightning`: ``HookplugCallback``, a Lightning ``Callback``
  (``pip install 'hookplug[lightning]'``);
- :mod:`hookplug.integrations.transformers`: ``HookplugTrainerCallback``, a 🤗
  ``TrainerCallback`` (``pip install 'hookplug[transformers]'``).

Both attach at the start of training, end a hookplug step on each optimizer step
(gradient accumulation aware) numbered as the trainer logs it, and remove the session at
the end of training. A step is ended when the next one starts (or at the end of
training), so evaluation run right after step N is recorded with step N and
``phase="eval"``, as the trainer logs its eval metrics.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

__all__ = ["lightning", "transformers"]


def __getattr__(name):
    if name in __all__:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sink_with_writer(sink: Any, writer: Any) -> Tuple[Any, bool]:
    """``sink`` with every ``"tensorboard"`` entry given no ``path``/``writer`` pointed at
    ``writer`` (the trainer's SummaryWriter); returns ``(sink, whether one was)``."""
    if writer is None or sink is None:
        return sink, False
    used = False

    def fix(item):
        nonlocal used
        if item == "tensorboard":
            used = True
            return ("tensorboard", {"writer": writer})
        if (isinstance(item, tuple) and len(item) == 2 and item[0] == "tensorboard"
                and isinstance(item[1], dict) and not {"path", "writer"} & item[1].keys()):
            used = True
            return ("tensorboard", {**item[1], "writer": writer})
        return item

    if isinstance(sink, dict):
        out: Dict[str, Any] = {}
        for name, opts in sink.items():
            if name == "tensorboard" and not {"path", "writer"} & (opts or {}).keys():
                used = True
                opts = {**(opts or {}), "writer": writer}
            out[name] = opts
        return out, used
    if isinstance(sink, list):
        items: List[Any] = [fix(i) for i in sink]
        return items, used
    return fix(sink), used


def _attach_kwargs_with_writer(kwargs: Dict[str, Any], writer: Any) -> Dict[str, Any]:
    """``attach()`` keywords whose ``"tensorboard"`` sink given no path/writer (by ``sink=``,
    or by the ``config=`` file when ``sink`` is unset) writes through ``writer``."""
    kwargs = dict(kwargs)
    if writer is None:
        return kwargs
    sink = kwargs.get("sink")
    if sink is None and kwargs.get("config") is not None:
        from hookplug._config import load_config, parse_config

        config = kwargs["config"]
        sink = (parse_config(config) if isinstance(config, dict) else load_config(config)).get("sink")
    if sink is not None:
        sink, used = _sink_with_writer(sink, writer)
        if used:
            kwargs["sink"] = sink  # given: it wins over the file's, which it repeats
    return kwargs


class _PendingStep:
    """The step bookkeeping both callbacks share: an ended optimizer step is handed to
    ``session.step(step=...)`` when the next one begins or training ends, so what ran
    between (evaluation) is recorded with the step it followed."""

    def __init__(self):
        self.session = None
        self.pending: Optional[int] = None

    def end(self, label: int) -> None:
        self.pending = label

    def commit(self) -> None:
        if self.session is not None and self.pending is not None:
            label, self.pending = self.pending, None
            self.session.step(step=label)
