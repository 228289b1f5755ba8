"""``EarlyStopping``: stop fitting when a monitored metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.monitor import Monitor

if TYPE_CHECKING:
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved for ``patience`` checks.

    A check happens at the end of every validation run during fit, or, when the fit has no
    validation, at the end of every training epoch. It stops through ``trainer.should_stop``;
    with several replicas the trainer makes every replica stop together.

    Args:
        monitor: a logged metric, e.g. ``"val_loss"``.
        mode: ``"min"`` or ``"max"``: which direction is better.
        patience: checks without improvement before stopping.
        min_delta: an improvement must be larger than this.
        stopping_threshold: stop as soon as the metric is at least this good.
        check_finite: stop at once if the metric is NaN or infinite.
        verbose: say why training stopped (rank 0).

    Its counters are saved in checkpoints and restored on resume.
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 stopping_threshold: float | None = None, check_finite: bool = True, verbose: bool = True) -> None:
        if patience < 0 or min_delta < 0:
            raise ValueError(f"EarlyStopping(patience={patience}, min_delta={min_delta}): both must be >= 0.")
        self.monitor = Monitor(monitor, mode)
        self.patience, self.min_delta = patience, min_delta
        self.stopping_threshold, self.check_finite, self.verbose = stopping_threshold, check_finite, verbose
        self.wait_count = 0
        self.best_score = self.monitor.worst
        self.stopped_epoch: int | None = None
        self.stop_reason = ""
        self._has_validation = False

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor.name!r}, mode={self.monitor.mode!r}}}"

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch,
                "patience": self.patience, "stop_reason": self.stop_reason}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict.get("wait_count", 0)
        self.best_score = state_dict.get("best_score", self.monitor.worst)
        self.stopped_epoch = state_dict.get("stopped_epoch")
        self.stop_reason = state_dict.get("stop_reason", "")

    def on_validation_end(self, trainer: "Trainer", module: "XModule") -> None:
        if trainer.state == "fit":
            self._has_validation = True
            self._check(trainer)

    def on_train_epoch_end(self, trainer: "Trainer", module: "XModule") -> None:
        if not self._has_validation:
            self._check(trainer)

    def _check(self, trainer: "Trainer") -> None:
        score = self.monitor.read(trainer.callback_metrics, "EarlyStopping")
        reason = self._reason_to_stop(score)
        if reason:
            trainer.should_stop = True
            self.stopped_epoch, self.stop_reason = trainer.current_epoch, reason
            if self.verbose and trainer.is_global_zero:
                print(f"EarlyStopping at epoch {trainer.current_epoch}, step {trainer.global_step}: {reason}",
                      flush=True)

    def _reason_to_stop(self, score: float) -> str:
        name = self.monitor.name
        if self.check_finite and not math.isfinite(score):
            return f"{name} = {score} is not finite."
        if self.stopping_threshold is not None and not self.monitor.better(self.stopping_threshold, score):
            return f"{name} = {score:.6g} reached the stopping threshold {self.stopping_threshold}."
        if self.monitor.better(score, self.best_score, self.min_delta):
            self.best_score, self.wait_count = score, 0
            return ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (f"{name} did not improve on {self.best_score:.6g} by more than {self.min_delta} "
                    f"in {self.wait_count} checks.")
        return ""
