"""Trainer integrations, each imported only when asked for (``import hookplug`` never
imports a trainer):

- :mod:`hookplug.integrations.lightning`: ``HookplugCallback``, a Lightning ``Callback``
  (``pip install 'hookplug[lightning]'``);
- :mod:`hookplug.integrations.transformers`: ``HookplugTrainerCallback``, a 🤗
  ``TrainerCallback`` (``pip install 'hookplug[transformers]'``).

Both attach at the start of training, numbering the session's first step as the trainer
will log it (``attach(start_step=...)``: ``every=N`` samples a resumed run's first step only
when its number is a multiple of N), end a hookplug step on each optimizer step (gradient
accumulation aware) numbered as the trainer logs it, and remove the session at the end of
training, also when training raises. A step is ended when the next one starts (or at the
end of training), so evaluation run right after step N is recorded with step N and
``phase="eval"``, as the trainer logs its eval metrics.
"""
from __future__ import annotations

import warnings
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


def _guard_hooks_from_now() -> None:
    """Switch dynamo's module-hook guards on when a callback is made, not at the attach of
    training start: the switch drops the code compiled before it (it has no hook guards),
    and a trainer compiles before training starts (Lightning's sanity check), so each later
    hook-free pass (validation after fit, a second fit's sanity check) would compile again."""
    from hookplug._compile_guards import _guard_module_hooks

    _guard_module_hooks()


def _check_attach_kwargs(who: str, selector: Any, plugins: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The callback's ``attach()`` arguments, checked at its construction (not after the
    trainer's setup, at the first batch)."""
    if "start_step" in kwargs:
        raise TypeError(f"{who}: start_step= is not a callback option: the callback numbers "
                        "the steps as the trainer logs them, from the trainer's global step")
    from hookplug._session import check_attach_arguments

    check_attach_arguments(who, selector, plugins, kwargs)
    return dict(kwargs)


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

    def evaluation_starts(self) -> None:
        """An evaluation runs before the next step: sampled also after a step ``every=N``
        did not sample (recorded with the step it follows, ``phase="eval"``). Only right
        after a step ended: one in the middle of a step (a validation between the batches of
        an accumulation window) would make the rest of that step's training a partial
        record."""
        if self.pending is not None and self.session is not None and not self.session.removed:
            self.session._sample_until_step()

    def commit(self, next_step: Optional[int] = None) -> None:
        """End the pending step; ``next_step``: the number of the one starting now, where it
        is not the ended one's plus one."""
        if self.session is not None and self.pending is not None:
            label, self.pending = self.pending, None
            self.session.step(step=label, next_step=next_step if next_step is not None and next_step > label else None)

    def close(self, failed: bool = False) -> None:
        """Commit the ended step and remove the session (flushing it). ``failed``: training
        is ending with an exception, which must go on unchanged: an error here (e.g. the
        stats option ``nonfinite="raise"`` on the step committed) becomes a warning, and
        the session is removed in any case."""
        session = self.session
        if session is None or session.removed:
            return
        try:
            try:
                self.commit()
            finally:
                session._remove(failed=failed)  # a failing rank flushes alone (no collective)
        except Exception as exc:
            if not failed:
                raise
            warnings.warn(f"hookplug: ending the session after training failed: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
