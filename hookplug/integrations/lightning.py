"""``HookplugCallback``: hookplug in a Lightning ``Trainer``.

    from hookplug.integrations.lightning import HookplugCallback
    cb = HookplugCallback("Linear", plugins=["stats"], sink="tensorboard", flush_every=10)
    trainer = lightning.Trainer(callbacks=[cb], logger=TensorBoardLogger("tb_logs"), ...)
    trainer.fit(model, ...)
    cb.session.nonfinite            # also after fit: the session is removed, its data kept

- attaches to the ``LightningModule`` when training starts (when its first batch starts,
  after the sanity check, whose forwards are not training), with ``selector``, ``plugins`` and any
  :func:`hookplug.attach` keyword (``config=``, ``every=``, ``sink=``, ``flush_every=``...);
- ends a hookplug step on every batch with an optimizer step (``trainer.global_step``
  advanced; with ``accumulate_grad_batches=k`` once per k batches), numbered as Lightning
  logs it (the step of ``self.log`` in that batch): under automatic optimization the step
  ending with global step ``g`` is ``g - 1``; under manual optimization, where
  ``global_step`` counts every ``optimizer.step()`` (two per batch for a GAN's two
  optimizers), the number is Lightning's logging step of the step's first batch, one per
  batch (``fit_loop.epoch_loop._batches_that_stepped``; stepping every k batches, the steps
  are numbered 0, k, 2k...). The session's first step is numbered
  before it runs (``attach(start_step=...)``, the step its first batch logs at), so
  ``every=N`` samples steps ``0, N, 2N...`` from the first one on, also when resuming from a
  checkpoint (saved after a batch, or at the end of a mid-epoch validation). The step is ended when the
  next batch starts or training ends, so validation run right after it is recorded with the
  same step and ``phase="eval"`` (Lightning puts the module in eval mode; the core tags it),
  also when ``every=N`` did not sample that step (an evaluation is always recorded);
- a ``"tensorboard"`` sink given no ``path``/``writer`` (in ``sink=`` or the ``config=``
  file) writes through the trainer's
  TensorBoard ``SummaryWriter`` (``trainer.logger.experiment`` of a ``TensorBoardLogger``),
  so hookplug's ``hookplug/<stat>/<module>/<site>`` scalars sit beside the run's own;
- removes the session when fitting ends (or on an exception); ``callback.session`` stays
  readable (results, ``nonfinite``).

Needs ``lightning`` (or ``pytorch_lightning``): ``pip install 'hookplug[lightning]'``.
"""
from __future__ import annotations

from typing import Any, Optional

from hookplug._optional import optional_import

from . import _attach_kwargs_with_writer, _check_attach_kwargs, _guard_hooks_from_now, _PendingStep

try:  # the unified package first, then the standalone one
    import lightning.pytorch as _pl
except ImportError:
    try:
        import pytorch_lightning as _pl
    except ImportError:
        (_pl,) = optional_import("lightning.pytorch", feature="hookplug.integrations.lightning",
                                 extra="lightning", package="lightning")

__all__ = ["HookplugCallback"]


def _batch_step(trainer, pl_module) -> int:
    """The step Lightning's loggers give what the batch in progress logs (its ``self.log``
    step): ``global_step`` under automatic optimization (one optimizer step per logged step),
    else the epoch loop's count of batches that stepped, which Lightning logs with and which
    advances once per batch however many optimizers step in it."""
    if getattr(pl_module, "automatic_optimization", True):
        return trainer.global_step
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return step if isinstance(step, int) else trainer.global_step


def _tensorboard_writer(trainer) -> Optional[Any]:
    loggers = list(getattr(trainer, "loggers", None) or [])
    for logger in loggers:  # (Lightning's, pytorch_lightning's, or a subclass of either)
        if any(c.__name__ == "TensorBoardLogger" for c in type(logger).__mro__):
            return logger.experiment
    return None


class HookplugCallback(_pl.Callback):
    """Attach hookplug for the length of ``trainer.fit`` (see the module docstring)."""

    def __init__(self, selector: Any = None, plugins: Any = None, **attach_kwargs: Any):
        # None: attach()'s default ("*"), or the config file's when config= is given
        super().__init__()
        self.selector = selector
        self.plugins = plugins
        self.attach_kwargs = _check_attach_kwargs(type(self).__name__, selector, plugins, attach_kwargs)
        _guard_hooks_from_now()
        self.session = None
        self._steps = _PendingStep()
        self._attach_pending = False
        self._seen_global_step = 0
        self._first_batch_step: Optional[int] = None  # manual optimization: the open step's first batch

    # -- lifecycle -----------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        # attached when the first batch starts (see _attach)
        self._attach_pending = self.session is None or self.session.removed

    def _attach(self, trainer, pl_module) -> None:
        """Attach, the first step numbered with the step the batch starting now logs at. Not
        at ``on_train_start``: a resumed run's count is settled after it, by the epoch loop,
        one more or not depending on where the checkpoint was saved (after a batch, at the end
        of a mid-epoch validation, ...)."""
        import hookplug

        self._attach_pending = False
        kwargs = _attach_kwargs_with_writer(self.attach_kwargs, _tensorboard_writer(trainer))
        self.session = hookplug.attach(pl_module, self.selector, self.plugins,
                                       start_step=_batch_step(trainer, pl_module), **kwargs)
        self._steps = _PendingStep()
        self._steps.session = self.session
        self._seen_global_step = trainer.global_step
        self._first_batch_step = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._attach_pending:
            self._attach(trainer, pl_module)
        if self._first_batch_step is None:  # a step starts with this batch
            self._first_batch_step = _batch_step(trainer, pl_module)
            manual = not getattr(pl_module, "automatic_optimization", True)
            self._steps.commit(next_step=self._first_batch_step if manual else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        g = trainer.global_step
        if g != self._seen_global_step:  # an optimizer step happened in this batch
            self._seen_global_step = g
            # manual optimization: numbered by its first batch's logging step, the number it
            # was sampled by (stepping every k batches, that count advances k per step)
            self._steps.end(g - 1 if pl_module.automatic_optimization else self._first_batch_step)
            self._first_batch_step = None

    def on_validation_start(self, trainer, pl_module) -> None:
        if getattr(trainer, "training", False) or getattr(trainer.state, "fn", None) == "fit":
            self._steps.evaluation_starts()

    def on_train_end(self, trainer, pl_module) -> None:
        self._steps.commit()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._remove()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._attach_pending = False
        self._steps.close(failed=True)  # the exception goes on unchanged

    def teardown(self, trainer, pl_module, stage) -> None:
        self._remove()

    def _remove(self) -> None:
        self._attach_pending = False
        self._steps.close()
