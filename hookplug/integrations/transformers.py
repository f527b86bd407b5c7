"""``HookplugTrainerCallback``: hookplug in a 🤗 ``transformers.Trainer``.

    from hookplug.integrations.transformers import HookplugTrainerCallback
    cb = HookplugTrainerCallback("Linear", plugins=["stats"], flush_every=10,
                                 sink=("tensorboard", {"path": "runs/exp1/hookplug"}))
    trainer = Trainer(model=model, args=args, callbacks=[cb], ...)
    trainer.train()

- attaches to the trainer's ``model`` at ``on_train_begin`` with ``selector``, ``plugins``
  and any :func:`hookplug.attach` keyword (``config=``, ``every=``, ``sink=``...);
- ends a hookplug step on every optimizer step (``on_step_end``, once per
  ``gradient_accumulation_steps`` micro-batches), numbered ``state.global_step`` (1..N, as
  the Trainer logs). The step is ended when the next one begins or training ends, so an
  evaluation run right after step N is recorded with step N and ``phase="eval"`` (the
  Trainer puts the model in eval mode; the core tags it);
- removes the session at ``on_train_end``; ``callback.session`` stays readable.

TensorBoard: the Trainer's own ``SummaryWriter`` lives inside its ``TensorBoardCallback``
and is created in that callback's ``on_train_begin``; it is not handed to other callbacks,
so hookplug does not write through it. Point a ``tensorboard`` sink at
``args.logging_dir`` (its own event file in the same folder: TensorBoard shows both as one
run) or pass ``writer=`` a ``SummaryWriter`` you own.

Needs ``transformers``: ``pip install 'hookplug[transformers]'``.
"""
from __future__ import annotations

from typing import Any

from hookplug._optional import optional_import

from . import _PendingStep

(_trainer_callback,) = optional_import("transformers.trainer_callback",
                                       feature="hookplug.integrations.transformers",
                                       extra="transformers", package="transformers")

__all__ = ["HookplugTrainerCallback"]


class HookplugTrainerCallback(_trainer_callback.TrainerCallback):
    """Attach hookplug for the length of ``Trainer.train`` (see the module docstring)."""

    def __init__(self, selector: Any = None, plugins: Any = None, **attach_kwargs: Any):
        # None: attach()'s default ("*"), or the config file's when config= is given
        self.selector = selector
        self.plugins = plugins
        self.attach_kwargs = dict(attach_kwargs)
        self.session = None
        self._steps = _PendingStep()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import hookplug

        if model is None:
            raise ValueError("HookplugTrainerCallback: the Trainer passed no model to on_train_begin")
        if self.session is not None and not self.session.removed:
            self.session.remove()
        self.session = hookplug.attach(model, self.selector, self.plugins, **self.attach_kwargs)
        self._steps = _PendingStep()
        self._steps.session = self.session

    def on_step_begin(self, args, state, control, **kwargs):
        self._steps.commit()

    def on_step_end(self, args, state, control, **kwargs):
        self._steps.end(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None and not self.session.removed:
            self._steps.commit()
            self.session.remove()
