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
  Trainer puts the model in eval mode; the core tags it), also when ``every=N`` did not
  sample step N (an evaluation is always recorded). The session's first step is
  numbered before it runs (``attach(start_step=...)``), so ``every=N`` samples steps
  ``N, 2N, ...`` from the first one on (a resumed run too); ``eval_on_start=True``: the
  evaluation before training is recorded with the global step it ran at (0, or the resumed
  one), as the Trainer logs it;
- removes the session at ``on_train_end``, and also when ``train()`` raises (an error in the
  model, the data, another callback, ``KeyboardInterrupt``, the stats option
  ``nonfinite="raise"``): the hooks come off, the telemetry so far is flushed (the step that
  was running included, with the number it had) and the exception goes on unchanged;
  ``callback.session`` stays readable.

How a raise is seen: the Trainer has no callback event for it, so the first
``HookplugTrainerCallback`` created wraps ``transformers.Trainer.train`` (once, for the
class; subclasses calling ``super().train()`` included) in a ``try``/``except`` that, when
``train()`` raises, ends the sessions of the ``HookplugTrainerCallback`` instances among
that trainer's callbacks and re-raises. A trainer whose ``train`` never reaches
``Trainer.train`` is not covered: its session is removed at the next ``on_train_begin``,
or use the callback as a context manager, ``with cb: trainer.train()``.

TensorBoard: the Trainer's own ``SummaryWriter`` lives inside its ``TensorBoardCallback``
and is created in that callback's ``on_train_begin``; it is not handed to other callbacks,
so hookplug does not write through it. Point a ``tensorboard`` sink at the folder that
writer uses (its own event file in the same folder: TensorBoard shows both as one run):
with transformers 5, set ``TENSORBOARD_LOGGING_DIR`` and give the sink the same ``path``
(unset, the Trainer picks ``output_dir/runs/<time>_<host>`` at train start); with
transformers 4, ``args.logging_dir``. Or pass ``writer=`` a ``SummaryWriter`` you own.

Needs ``transformers``: ``pip install 'hookplug[transformers]'``.
"""
from __future__ import annotations

import functools
from typing import Any

from hookplug._optional import optional_import

from . import _check_attach_kwargs, _guard_hooks_from_now, _PendingStep

(_trainer_callback,) = optional_import("transformers.trainer_callback",
                                       feature="hookplug.integrations.transformers",
                                       extra="transformers", package="transformers")

__all__ = ["HookplugTrainerCallback"]


def _end_sessions_of(trainer) -> None:
    """``trainer.train()`` raised: end the sessions of its hookplug callbacks."""
    handler = getattr(trainer, "callback_handler", None)
    for cb in list(getattr(handler, "callbacks", None) or ()):
        if isinstance(cb, HookplugTrainerCallback):
            cb._steps.close(failed=True)


def _guard_trainer_train() -> None:
    """Wrap ``transformers.Trainer.train`` (once) so that a raise ends the hookplug sessions
    of that trainer's callbacks before it propagates (see the module docstring)."""
    try:
        from transformers import trainer as trainer_module
    except Exception:  # no usable Trainer (a missing dependency of its own): nothing to guard
        return
    cls = getattr(trainer_module, "Trainer", None)
    train = getattr(cls, "train", None)
    if train is None or getattr(train, "_hookplug_guard", False):
        return

    @functools.wraps(train)
    def guarded_train(self, *args, **kwargs):
        try:
            return train(self, *args, **kwargs)
        except BaseException:
            _end_sessions_of(self)
            raise

    guarded_train._hookplug_guard = True
    cls.train = guarded_train


class HookplugTrainerCallback(_trainer_callback.TrainerCallback):
    """Attach hookplug for the length of ``Trainer.train`` (see the module docstring)."""

    def __init__(self, selector: Any = None, plugins: Any = None, **attach_kwargs: Any):
        # None: attach()'s default ("*"), or the config file's when config= is given
        self.selector = selector
        self.plugins = plugins
        self.attach_kwargs = _check_attach_kwargs(type(self).__name__, selector, plugins, attach_kwargs)
        _guard_hooks_from_now()
        self.session = None
        self._steps = _PendingStep()
        _guard_trainer_train()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import hookplug

        if model is None:
            raise ValueError("HookplugTrainerCallback: the Trainer passed no model to on_train_begin")
        # a session an earlier train() left (one that never reached Trainer.train)
        self._steps.close(failed=True)
        g = getattr(state, "global_step", 0) or 0
        # the first step in progress: the evaluation of eval_on_start, logged at step g, else
        # the optimizer step that ends with global step g + 1
        start = g if getattr(args, "eval_on_start", False) else g + 1
        self.session = hookplug.attach(model, self.selector, self.plugins, start_step=start,
                                       **self.attach_kwargs)
        self._steps = _PendingStep()
        self._steps.session = self.session
        if getattr(args, "eval_on_start", False):  # the step in progress holds only that
            self.session._sample_until_step()      # evaluation: recorded whatever every=N says,
            self.session._evaluation_only = True   # with no parameter records (params)

    def on_step_begin(self, args, state, control, **kwargs):
        self._commit()

    def on_optimizer_step(self, args, state, control, **kwargs):
        # the Trainer zeroes the gradients before on_step_end: a parameter the optimizer
        # step left out (a step GradScaler skipped for inf/NaN gradients) is measured now
        s = self.session
        if s is not None and not s.removed:
            for plugin in s.plugins.values():
                measure = getattr(plugin, "measure_unstepped", None)
                if callable(measure):
                    measure()

    def on_step_end(self, args, state, control, **kwargs):
        self._steps.end(state.global_step)
        self._evaluation_next(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._evaluation_next(control)

    def _evaluation_next(self, control) -> None:
        """The Trainer's flow callback (first in its list) has decided whether an evaluation
        follows: it is recorded also after a step ``every=N`` did not sample."""
        if getattr(control, "should_evaluate", False):
            self._steps.evaluation_starts()

    def on_evaluate(self, args, state, control, **kwargs):
        # eval_on_start: an evaluation in the step numbered with the current global step,
        # before any optimizer step, ends that step (after an optimizer step, the step it
        # follows is already pending)
        s = self.session
        if (self._steps.pending is None and s is not None and not s.removed
                and s.step_index == state.global_step):
            self._steps.end(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._steps.close()

    def _commit(self) -> None:
        try:
            self._steps.commit()
        except BaseException:  # e.g. nonfinite="raise": the hooks come off, the error goes on
            self._steps.close(failed=True)
            raise

    # -- with cb: trainer.train() ------------------------------------------------------------------
    def __enter__(self) -> "HookplugTrainerCallback":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._steps.close(failed=exc_type is not None)
