"""``ProgressBar``: epoch, step, ETA, throughput and ``prog_bar`` values on rank 0 (``rich``)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from xtrainer.callbacks.base import Callback
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class ProgressBar(Callback):
    """A ``rich`` progress bar per training epoch on a terminal; plain lines otherwise.

    It is redrawn only when the Trainer has read logged values back anyway (every
    ``log_every_n_steps`` and at epoch ends) and shows only host values, so it never adds a
    host sync or changes a graph (a bar that reads device values every step stalls XLA
    training). Rank 0 only; ``Trainer(enable_progress_bar=False)`` turns it off.

    It shows the ``prog_bar=True`` values under the names they were logged with; the step's
    ``loss`` only when nothing else is on the bar (it is the value ``training_step`` returned,
    usually also logged by name). Within an epoch, values read at the previous epoch's end (a
    ``train_loss_epoch``) are left out until they are new: they describe the last epoch, not
    this one. Validation values stay, as the latest validation's.

    Args:
        stream: where to write (default: standard output).
        rich: ``None`` (a bar if ``stream`` is a terminal), ``True`` or ``False``.
    """

    def __init__(self, stream: TextIO | None = None, rich: bool | None = None) -> None:
        self.stream, self.rich = stream, rich
        self._progress: Any = None
        self._task: Any = None
        self._start, self._start_step, self._due = 0.0, 0, False
        self._last: set[str] = set()  # the names of the latest read of logged values
        self._stale: set[str] = set()  # read at the last epoch's end and not since

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def _use_rich(self) -> bool:
        if self.rich is not None:
            return self.rich
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty and isatty())

    # ---- training ----------------------------------------------------------------------------
    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if trainer.is_global_zero and self._use_rich():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._progress = Progress(
                TextColumn("epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[values]}"),
                console=Console(file=self._out(), force_terminal=self.rich or None), auto_refresh=False)
            self._progress.start()

    def on_train_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._start, self._start_step = time.perf_counter(), trainer.global_step
        if self._progress is not None:
            total = trainer.num_training_batches
            self._task = self._progress.add_task("train", total=None if total == float("inf") else int(total),
                                                 epoch=trainer.current_epoch, rate="", values="")

    def on_metrics(self, trainer: "TrainerView", module: "XModule", metrics: dict[str, float], step: int) -> None:
        if trainer.state == "fit":
            self._due = True  # fresh values: shown once the batch ends (no read of our own)
            self._last = set(metrics)
            self._stale -= self._last

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._due or not trainer.is_global_zero:
            return
        self._due = False
        self._show(trainer, batch_idx + 1, f"batch {batch_idx + 1}/{_fmt_total(trainer.num_training_batches)}")

    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        # The epoch's last read (its epoch values) came just before this hook; from the next
        # epoch's first batch on they belong to the past.
        self._stale, self._last, self._due = set(self._last), set(), False  # shown here, not again at batch 1
        if trainer.is_global_zero:
            self._show(trainer, None, "done", mid_epoch=False)

    def on_train_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = self._task = None

    def teardown(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        self.on_train_end(trainer, module)  # also when training failed: give the terminal back

    # ---- evaluation ----------------------------------------------------------------------------
    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._last = set()  # validation values are not the training epoch's
        if trainer.is_global_zero and trainer.state != "fit":
            values = " ".join(f"{k}={v:.4g}" for k, v in sorted(trainer.callback_metrics.items()))
            print(f"{trainer.state}: {values}", file=self._out(), flush=True)

    def _values(self, trainer: "TrainerView", mid_epoch: bool) -> str:
        shown = {k: v for k, v in trainer.progress_bar_metrics.items() if not (mid_epoch and k in self._stale)}
        loss = trainer.run.publisher.loop_loss
        if loss is not None and not shown.keys() - THROUGHPUT_KEYS:  # nothing of the module's on the bar
            shown["loss"] = loss
        return " ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items()))

    def _show(self, trainer: "TrainerView", completed: int | None, where: str, mid_epoch: bool = True) -> None:
        elapsed = time.perf_counter() - self._start
        rate = (trainer.global_step - self._start_step) / elapsed if elapsed > 0 else 0.0
        values = self._values(trainer, mid_epoch)
        if self._progress is not None and self._task is not None:
            task = self._progress.tasks[-1]
            done = completed if completed is not None else (task.total or task.completed)
            self._progress.update(self._task, completed=done, rate=f"{rate:.1f} it/s", values=values)
            self._progress.refresh()
            return
        print(f"epoch {trainer.current_epoch} {where} step {trainer.global_step} ({rate:.1f} it/s) {values}",
              file=self._out(), flush=True)


#: What ``XlaHealth`` adds to the line (MFU, else the achieved model FLOP/s).
THROUGHPUT_KEYS = frozenset({"mfu", "flop/s"})


def _fmt_total(total: float) -> str:
    return "?" if total == float("inf") else str(int(total))
