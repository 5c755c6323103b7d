"""Hugging Face ``Trainer`` integration: one line in the trainer's callbacks.

::

    from neuraldbg.transformers import NeuralDbgCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NeuralDbgCallback()])
    trainer.train()

The model is watched from ``on_train_begin`` to ``on_train_end``. Every optimizer step is a step
(``dbg.step == state.global_step``; ``gradient_accumulation_steps`` is one step), gradients are
read as the backward pass produced them (before ``max_grad_norm`` clips them, after
mixed-precision unscaling). The trace (``neuraldbg.ndbg``) and the HTML report
(``neuraldbg.html``) go to ``args.output_dir``; the verdict (``neuraldbg/failures``,
``neuraldbg/confidence`` at each log, and each layer's latest gradient norm with the final
training metrics) goes through the trainer's own logging to every ``report_to`` integration;
the diagnosis is printed at the end. ``halt_on=`` sets ``control.should_training_stop``.

transformers is not a dependency of neuraldbg: this module needs it installed. If
``trainer.train()`` raises, call :meth:`NeuralDbgCallback.close` (the Trainer has no exception
event) to remove the hooks and write the trace and report.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional

from transformers import TrainerCallback

from ._integration import CallbackCore, guarded_callback, summary

__all__ = ["NeuralDbgCallback"]


class NeuralDbgCallback(CallbackCore, TrainerCallback):  # type: ignore[misc]
    """Watches the model during ``trainer.train()``.

    Args:
        trace: ``True`` (default) writes ``neuraldbg.ndbg`` into ``args.output_dir``; a path
            writes it there; ``False`` records none.
        report: the same for the HTML report ``neuraldbg.html``.
        halt_on: stop training once a failure is confirmed (see :class:`~neuraldbg.NeuralDbg`):
            ``control.should_training_stop`` is set at the end of that step.
        on_failure: called with newly confirmed hypotheses, from the step that confirmed them.
        verbose: print the diagnosis at the end of training (main process).
        **options: any other :class:`~neuraldbg.NeuralDbg` option.

    After training, :attr:`dbg` is the run's :class:`~neuraldbg.NeuralDbg`.
    """

    @guarded_callback
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._go_first()
        if model is not None:
            self._open(model, args.output_dir, state.is_world_process_zero, lambda: None)

    @guarded_callback
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.dbg is not None and self.dbg.halted is not None:
            control.should_training_stop = True

    @guarded_callback
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        """Adds the verdict to the trainer's log record, which every ``report_to`` integration
        receives after this callback (see :meth:`_go_first`)."""
        run = self._run
        if run is None or logs is None or not run.open:
            return
        self.log_metrics(logs.update, layers="train_runtime" in logs)

    @guarded_callback
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self._run
        self.close()
        if run is not None and self.verbose and state.is_world_process_zero:
            print(summary(run.dbg, run.report_path or run.trace_path))

    def _go_first(self) -> None:
        """Moves this callback to the front of the trainer's callback list, so that the verdict
        it adds to a log record reaches the reporting integrations (TensorBoard, W&B...) that
        the Trainer placed before the user's callbacks. The handler is the caller of this
        event; when it cannot be found, logging simply goes without the verdict."""
        try:
            frame: Optional[FrameType] = sys._getframe(2)
            for _ in range(4):  # (the guard's frame lies between)
                if frame is None:
                    return
                handler = frame.f_locals.get("self")
                callbacks = getattr(handler, "callbacks", None)
                if isinstance(callbacks, list) and self in callbacks:
                    if callbacks[0] is not self:
                        callbacks.remove(self)
                        callbacks.insert(0, self)
                    return
                frame = frame.f_back
        except Exception:  # pragma: no cover - best effort
            pass
