"""``ProgressBar``: a line of progress on rank 0, refreshed when logged values arrive."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from xtrainer.callbacks.base import Callback

if TYPE_CHECKING:
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer


class ProgressBar(Callback):
    """Prints epoch, step, throughput and the ``prog_bar`` values.

    It only shows values the Trainer has already read back to the host, so it never adds a
    host sync (a progress bar that reads device values every step stalls XLA training).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._start = 0.0
        self._start_step = 0
        self._shown_step = -1

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def on_train_epoch_start(self, trainer: "Trainer", module: "XModule") -> None:
        self._start, self._start_step = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer: "Trainer", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step % trainer.log_every_n_steps or step == self._shown_step or not trainer.is_global_zero:
            return
        self._shown_step = step
        self._print(trainer, f"batch {batch_idx + 1}/{_fmt_total(trainer.num_training_batches)}")

    def on_train_epoch_end(self, trainer: "Trainer", module: "XModule") -> None:
        if trainer.is_global_zero:
            self._print(trainer, "done")

    def on_validation_end(self, trainer: "Trainer", module: "XModule") -> None:
        if trainer.is_global_zero and trainer.state != "fit":
            values = " ".join(f"{k}={v:.4g}" for k, v in sorted(trainer.callback_metrics.items()))
            print(f"{trainer.state}: {values}", file=self._out(), flush=True)

    def _print(self, trainer: "Trainer", where: str) -> None:
        elapsed = time.perf_counter() - self._start
        rate = (trainer.global_step - self._start_step) / elapsed if elapsed > 0 else 0.0
        values = " ".join(f"{k}={v:.4g}" for k, v in sorted(trainer.progress_bar_metrics.items()))
        print(f"epoch {trainer.current_epoch} {where} step {trainer.global_step} "
              f"({rate:.1f} it/s) {values}", file=self._out(), flush=True)


def _fmt_total(total: float) -> str:
    return "?" if total == float("inf") else str(int(total))
