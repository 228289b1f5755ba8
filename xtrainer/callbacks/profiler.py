"""``XlaProfiler``: a trace of chosen training steps, for TensorBoard's profile plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xtrainer._lazy_xla import xla as _xla
from xtrainer.callbacks.base import Callback
from xtrainer.strategies.launchers.processes import free_port
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class XlaProfiler(Callback):
    """Traces training steps ``start_step`` to ``start_step + num_steps - 1`` (host and device
    activity, as torch_xla's profiler sees it) into the run folder, and starts torch_xla's
    profiler server so that TensorBoard can also capture on demand.

    View it with ``tensorboard --logdir <run folder>`` and the profile plugin
    (``pip install tensorboard-plugin-profile``). Rank 0 traces (torch_xla allows one trace per
    process). Choose steps after the first epoch to see the steady state rather than compilation.

    Args:
        start_step: the global step at which the trace begins.
        num_steps: how many optimizer steps it covers.
        port: the profiler server's port (None: a free one, see ``port`` after setup).
        dirpath: where to write (default: the run folder).
    """

    def __init__(self, start_step: int = 10, num_steps: int = 5, port: int | None = None,
                 dirpath: str | None = None) -> None:
        if start_step < 0 or num_steps < 1:
            raise ValueError(f"XlaProfiler(start_step={start_step}, num_steps={num_steps}): need start_step >= 0 "
                             "and num_steps >= 1.")
        self.start_step, self.num_steps, self.port, self.dirpath = start_step, num_steps, port, dirpath
        self._server: Any = None
        self._tracing = False
        self.traced_steps: list[int] = []

    def setup(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self._server is None:
            if self.port is None:
                self.port = free_port()
            self._server = _xla.start_profiler_server(self.port)
        self.dirpath = self.dirpath or trainer.log_dir

    def on_train_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int) -> None:
        if trainer.is_global_zero and not self._tracing and trainer.global_step == self.start_step:
            _xla.start_trace(self.dirpath)
            self._tracing = True

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._tracing:
            if trainer.global_step not in self.traced_steps:
                self.traced_steps.append(trainer.global_step)
            if trainer.global_step >= self.start_step + self.num_steps:
                self._stop()

    def teardown(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        self._stop()  # a fit that ended (or failed) inside the window still leaves its trace

    def _stop(self) -> None:
        if self._tracing:
            self._tracing = False
            _xla.stop_trace()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_server": None}
