"""``EarlyStopping``: stop fitting when a monitored metric stops improving, as Lightning's does."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.checkpoint import MetricNotFoundError, score_tensor
from xtrainer.callbacks.monitor import Monitor
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved for ``patience`` checks: Lightning's ``EarlyStopping``,
    with its arguments (in its order) and attributes.

    A check happens at the end of every training epoch (after that epoch's validation), or, when
    the fit validates several times per epoch or only every ``check_val_every_n_epoch != 1``
    epochs, after every validation (``check_on_train_epoch_end`` chooses). Nothing is checked in
    the sanity check, in ``validate``/``test``, or with ``fast_dev_run``. It stops through
    ``trainer.should_stop``; with several replicas the trainer makes every replica stop together
    at the same step (one replica asking is enough).

    Args:
        monitor: a logged metric, e.g. ``"val_loss"``.
        min_delta: an improvement must be larger than this (a negative one lets a slightly worse
            value count as an improvement, as in Lightning).
        patience: checks without improvement before stopping.
        verbose: one line for each improvement and for the stop (see ``log_rank_zero_only``).
        mode: ``"min"`` or ``"max"``: which direction is better.
        strict: a missing ``monitor`` is an error (``MetricNotFoundError``, a ``RuntimeError`` as
            Lightning's); with ``strict=False`` a warning, and no check that time.
        check_finite: stop at once if the metric is NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of the training epoch (True) or after each
            validation (False); default as described above.
        log_rank_zero_only: with ``verbose``, say it on rank 0 only (else every replica says
            it, its rank in front).

    ``wait_count``, ``stopped_epoch`` (0 until it stops), ``best_score`` (a 0-d tensor) and
    ``stop_reason`` (the message) are saved in checkpoints and restored on resume; ``patience`` is
    saved too, but the value given to this callback wins on a resume (Lightning restores it).
    """

    mode_dict = {"min": torch.lt, "max": torch.gt}
    order_dict = {"min": "<", "max": ">"}

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping(monitor={monitor!r}) must name a logged metric.")
        self._monitor = Monitor(monitor, mode)  # refuses a mode other than min/max
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): patience must be an int >= 0.")
        for name, value in (("stopping_threshold", stopping_threshold), ("divergence_threshold", divergence_threshold)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"EarlyStopping({name}={value!r}) must be a number or None.")
        self.monitor, self.mode = monitor, mode
        self.min_delta, self.patience, self.verbose, self.strict = float(min_delta), patience, verbose, strict
        self.check_finite = check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = score_tensor(self._monitor.worst)
        self.stop_reason = ""
        self._at_epoch_end = True

    @property
    def monitor_op(self) -> Any:
        return self.mode_dict[self.mode]

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch, "best_score": self.best_score,
                "patience": self.patience, "stop_reason": self.stop_reason}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = int(state_dict.get("wait_count", 0) or 0)
        self.stopped_epoch = int(state_dict.get("stopped_epoch") or 0)
        best = state_dict.get("best_score")
        try:
            self.best_score = score_tensor(best) if best is not None else score_tensor(self._monitor.worst)
        except (TypeError, ValueError, RuntimeError):
            self.best_score = score_tensor(self._monitor.worst)
        self.stop_reason = str(state_dict.get("stop_reason", "") or "")

    # ---- when to check ---------------------------------------------------------------------------
    def setup(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        if self.check_on_train_epoch_end is not None:
            self._at_epoch_end = self.check_on_train_epoch_end
        else:  # as Lightning: once per epoch, after its validation, unless validation comes at other times
            interval = trainer.val_check_interval
            self._at_epoch_end = (isinstance(interval, float) and interval == 1.0
                                  and trainer.check_val_every_n_epoch in (1, None))

    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._at_epoch_end and not self._skip(trainer):
            self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if not self._at_epoch_end and not self._skip(trainer):
            self._run_early_stopping_check(trainer)

    @staticmethod
    def _skip(trainer: "TrainerView") -> bool:
        return (trainer.state != "fit" or bool(getattr(trainer, "sanity_checking", False))
                or bool(getattr(trainer, "fast_dev_run", False)))

    # ---- the check ------------------------------------------------------------------------------
    def _run_early_stopping_check(self, trainer: "TrainerView") -> None:
        """One check (Lightning's name: a subclass may call it from another hook, as its docs show)."""
        metrics = trainer.callback_metrics
        if metrics.get(self.monitor) is None:
            message = (f"EarlyStopping(monitor={self.monitor!r}) conditions on a metric that is not available. "
                       f"Logged: {sorted(metrics)}. Log it with self.log({self.monitor!r}, ...), or monitor one of "
                       "these")
            if self.strict:
                raise MetricNotFoundError(message + " (strict=False skips the check when it is missing).")
            rank_zero_warn(message + "; the check is skipped (strict=False).", category=RuntimeWarning)
            return
        current = float(metrics[self.monitor])
        should_stop, reason = self._evaluate_stopping_criteria(current)
        if should_stop:
            trainer.should_stop = True  # shared with every replica by the trainer
            self.stopped_epoch, self.stop_reason = trainer.current_epoch, reason
        if reason and self.verbose:
            self._say(trainer, reason)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _evaluate_stopping_criteria(self, current: Any) -> tuple[bool, str]:
        current = float(current)
        name, order, best = self.monitor, self.order_dict[self.mode], float(self.best_score)
        if self.check_finite and not math.isfinite(current):
            return True, (f"Monitored metric {name} = {current} is not finite. Previous best value was {best:.3f}. "
                          "Signaling Trainer to stop.")
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return True, (f"Stopping threshold reached: {name} = {current} {order} {self.stopping_threshold}. "
                          "Signaling Trainer to stop.")
        if self.divergence_threshold is not None and self._better(-current, -self.divergence_threshold):
            worse = self.order_dict["max" if self.mode == "min" else "min"]  # Lightning prints `order` here
            return True, (f"Divergence threshold reached: {name} = {current} {worse} {self.divergence_threshold}. "
                          "Signaling Trainer to stop.")
        delta = self.min_delta if self.mode == "min" else -self.min_delta
        if self._better(current + delta, best):
            message = (f"Metric {name} improved by {abs(best - current):.3f} >= min_delta = {self.min_delta}. New best "
                       f"score: {current:.3f}" if math.isfinite(best) else
                       f"Metric {name} improved. New best score: {current:.3f}")
            self.best_score, self.wait_count = score_tensor(current), 0
            return False, message
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"Monitored metric {name} did not improve in the last {self.wait_count} records. Best "
                          f"score: {best:.3f}. Signaling Trainer to stop.")
        return False, ""

    def _say(self, trainer: "TrainerView", message: str) -> None:
        if trainer.world_size > 1:
            if self.log_rank_zero_only and not trainer.is_global_zero:
                return
            message = f"[rank: {trainer.global_rank}] {message}"
        print(message, flush=True)
