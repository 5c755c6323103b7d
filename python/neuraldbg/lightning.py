"""PyTorch Lightning integration: one line in the trainer's callbacks.

::

    from neuraldbg.lightning import NeuralDbgCallback

    trainer = L.Trainer(max_epochs=3, callbacks=[NeuralDbgCallback()])
    trainer.fit(model, loader)

The LightningModule is watched from the start of training to its end. Every optimizer step is a
step (``dbg.step == trainer.global_step``; ``accumulate_grad_batches`` is one step), gradients
are read as the backward pass produced them (before ``gradient_clip_val`` clips them, after
mixed-precision unscaling). At the end of training the trace (``neuraldbg.ndbg``) and the HTML
report (``neuraldbg.html``) are in the run's log directory, the verdict and each layer's latest
gradient norm go to the trainer's loggers (TensorBoard, CSV, W&B...), and the diagnosis is
printed. ``halt_on=`` sets ``trainer.should_stop`` once a failure is confirmed.

Lightning is not a dependency of neuraldbg: this module needs ``lightning`` installed.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from ._integration import CallbackCore, guarded_callback, summary, verdict_text
from .errors import NeuralDbgWarning

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef, assignment]

__all__ = ["NeuralDbgCallback"]


class NeuralDbgCallback(CallbackCore, Callback):  # type: ignore[misc]
    """Watches the LightningModule during ``trainer.fit``.

    Args:
        trace: ``True`` (default) writes ``neuraldbg.ndbg`` into the run's log directory
            (``trainer.log_dir``, else ``default_root_dir``); a path writes it there; ``False``
            records none.
        report: the same for the HTML report ``neuraldbg.html``, written at the end of training
            (also when it raised or was halted).
        halt_on: stop training once a failure is confirmed (see :class:`~neuraldbg.NeuralDbg`):
            ``trainer.should_stop`` is set, Lightning finishes the step and stops.
        on_failure: called with newly confirmed hypotheses, from the step that confirmed them.
        verbose: print the diagnosis at the end of training (rank 0).
        **options: any other :class:`~neuraldbg.NeuralDbg` option (thresholds, sampling...).

    After training, :attr:`dbg` is the :class:`~neuraldbg.NeuralDbg` of the run (its
    ``explain_failure()``, ``events``, ``history()``...).
    """

    @guarded_callback
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        directory = trainer.log_dir or trainer.default_root_dir

        def stop() -> None:
            trainer.should_stop = True

        # Manual optimization counts every optimizer step in global_step, also several in one
        # training_step: so does the debugger then (unless told otherwise).
        manual = getattr(pl_module, "automatic_optimization", True) is False
        if manual and "step_on" not in self.options:
            self.options = {**self.options, "step_on": "each_optimizer"}
        self._open(pl_module, directory, trainer.is_global_zero, stop)

    @guarded_callback
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer, None)

    @guarded_callback
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer, exception)

    def _finish(self, trainer: Any, exc: Optional[BaseException]) -> None:
        run = self._run
        if run is None:
            return
        self.close(exc)
        if not trainer.is_global_zero:
            return
        dbg = run.dbg

        def log(numbers: Any) -> None:
            for logger in trainer.loggers:
                try:
                    logger.log_metrics(numbers, step=trainer.global_step)
                    logger.log_hyperparams({"neuraldbg_verdict": verdict_text(dbg)})
                    logger.save()
                except Exception as e:  # a logger that cannot take it must not break training
                    warnings.warn(
                        f"NeuralDBG could not log to {type(logger).__name__}: {e}", NeuralDbgWarning, stacklevel=2
                    )

        self.log_metrics(log, layers=True)
        if self.verbose:
            print(summary(dbg, run.report_path or run.trace_path))
