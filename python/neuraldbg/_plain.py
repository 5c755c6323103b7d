"""The protocol between the extension's ``PlainStep`` (crates/neuraldbg-py/src/plain.rs) and
Python: what it calls on the collector's host reader, and the loop facts it reads and writes.
Declared here so that type checkers see both sides (``_native.pyi`` uses these)."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple


class PlainHost(Protocol):
    """What :class:`PlainStep` talks to (``neuraldbg._read_host.HostReader``): where it hands a
    step it does not finish, in order, with the values it read then, and reports one it did."""

    @property
    def step(self) -> int:
        """The number of the step under way."""

    plain_optimizer: object
    """The optimizer whose steps may be taken (another optimizer's step is handed over)."""

    def take_forward(self, module: object, args: object, kwargs: object, seen: Tuple[bool, bool, Any]) -> None:
        """The model's forward, ``seen`` = (training, grad enabled, input statistics or None)."""

    def take_loss(self, tensor: object) -> None:
        """The loss whose backward started."""

    def take_grads(self, loss: object, flags: int, clip_seen: Any, accumulated: Optional[bool]) -> None:
        """The gradients read when that backward ended (their norms in the shared buffer)."""

    def backward_returned(self, marks: Any) -> None:
        """A backward that reached none of the model's gradients returned (the marks taken
        when it started: sentinels' gradients and versions, the loop facts' probe)."""

    def backward_end(self) -> None:
        """A backward ended with gradients judged by the collector (non-finite, unreadable,
        zeros that may be leftovers)."""

    def plain_done(self, pending: Optional[bool], step: int) -> bool:
        """Step ``step`` was observed (``pending``: the engine's answer, None when observing
        failed); returns whether the coming step may be taken too."""

    def fail(self, error: BaseException) -> None:
        """Observing failed: monitoring stops, with a warning."""


class PlainFacts(Protocol):
    """The loop facts :class:`PlainStep` reads and writes (``neuraldbg._loop.LoopFacts``)."""

    probe: object
    armed: bool
    grads_kept: Optional[bool]
    after_step_grad: Optional[Tuple[int, int]]
    accumulated: Optional[bool]
