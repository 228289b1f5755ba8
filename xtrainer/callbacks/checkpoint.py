"""``ModelCheckpoint``: save checkpoints during fit, keep the best ``save_top_k``."""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import TYPE_CHECKING, Any

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.monitor import Monitor
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.checkpoint import default_dirpath, storage

if TYPE_CHECKING:
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save a checkpoint every ``every_n_epochs`` epochs, ``every_n_train_steps`` steps, or
    ``train_time_interval`` of training time.

    Args:
        dirpath: where to save; default ``<run folder>/checkpoints``.
        filename: a format string over ``epoch``, ``step`` and any logged metric,
            e.g. ``"{epoch}-{val_acc:.3f}"``; default ``"epoch={epoch}-step={step}"``.
        monitor: a logged metric to rank checkpoints by (None: the newest is the best).
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        save_top_k: how many checkpoints to keep (-1: all, 0: none but the newest for ``last``).
        save_last: keep ``last.ckpt``, a link to the newest checkpoint (which is kept even when it
            is not among the top k). ``fit(ckpt_path="last")`` resumes from it.
        every_n_epochs, every_n_train_steps: how often to save (steps take precedence).
        train_time_interval: save when this much training time has passed since the last save
            (a ``datetime.timedelta`` or seconds), checked after every step.

    Crash safety: each checkpoint is written under a temporary name and renamed into place when
    complete; then ``last.ckpt`` is switched to it (an atomic rename of a new link); only then are
    checkpoints that fell out of the top k removed. At any moment ``last.ckpt`` names a complete
    checkpoint. Every replica calls the save (writing a checkpoint is collective); rank 0 removes
    files, and at the start of a fit the leftovers of saves that a crash interrupted.

    No checkpoint is written once the training loss has been NaN or infinite (with the Trainer's
    ``detect_nonfinite`` on): the good ones written before stay, ``last.ckpt`` among them.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None,
                 monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_epochs: int | None = 1, every_n_train_steps: int | None = None,
                 train_time_interval: datetime.timedelta | float | None = None) -> None:
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}) must be -1 or more.")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self._given_dirpath = dirpath is not None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor = monitor
        self._ranking = Monitor(monitor, mode) if monitor is not None else Monitor("step", "max")
        self.mode, self.save_top_k, self.save_last = mode, save_top_k, save_last
        self.every_n_epochs, self.every_n_train_steps = every_n_epochs, every_n_train_steps
        if isinstance(train_time_interval, datetime.timedelta):
            train_time_interval = train_time_interval.total_seconds()
        self.train_time_interval = train_time_interval
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._last_save_time = time.monotonic()

    @property
    def state_key(self) -> str:
        """Unique per configuration, as Lightning's: two checkpoint callbacks that differ in what or
        when they save keep their bookkeeping apart."""
        return (f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}, every_n_train_steps="
                f"{self.every_n_train_steps!r}, every_n_epochs={self.every_n_epochs!r}, train_time_interval="
                f"{self.train_time_interval!r}, filename={self.filename!r}}}")

    def state_dict(self) -> dict[str, Any]:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
                "dirpath": self.dirpath}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_dir = state_dict.get("dirpath")
        moved = self.dirpath is not None and (not isinstance(saved_dir, str)
                                              or os.path.abspath(saved_dir) != os.path.abspath(self.dirpath))
        if moved:
            # Resumed into another folder: the files listed belong to the earlier run, which this
            # run must not prune. Only what they were is kept.
            self.best_model_path = state_dict.get("best_model_path", "")
            self.best_model_score = state_dict.get("best_model_score")
            return
        self.best_k_models = {path: float(score) for path, score in dict(state_dict.get("best_k_models", {})).items()
                              if self._owns(path)}
        self.best_model_path = state_dict.get("best_model_path", "")
        self.best_model_score = state_dict.get("best_model_score")
        self.last_model_path = state_dict.get("last_model_path", "")
        self.dirpath = self.dirpath or saved_dir  # as the replicas chose it

    def setup(self, trainer: "Trainer", module: "XModule", stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = default_dirpath(trainer.log_dir)
        self._last_save_time = time.monotonic()
        if stage == "fit" and trainer.is_global_zero:
            storage.remove_leftovers(self.dirpath)  # of saves that a crash interrupted
            if self._given_dirpath and trainer.ckpt_path is None and self._foreign_checkpoints():
                rank_zero_warn(f"ModelCheckpoint: {self.dirpath} already holds checkpoints of another run; a "
                               "checkpoint of this run with the same name replaces it. Give each run its own "
                               "dirpath (the default, <run folder>/checkpoints, is).")

    def on_train_batch_end(self, trainer: "Trainer", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_saved_step:
            return
        n, interval = self.every_n_train_steps, self.train_time_interval
        if n and trainer.global_step % n == 0:
            self._save(trainer)
        elif interval is not None and self._time_is_up(trainer, interval):
            self._save(trainer)

    def _time_is_up(self, trainer: "Trainer", interval: float) -> bool:
        # Replicas must agree (a save is collective): rank 0's clock decides for all of them.
        due = time.monotonic() - self._last_save_time >= interval
        return bool(trainer.strategy.broadcast(due)) if trainer.world_size > 1 else due

    def on_train_epoch_end(self, trainer: "Trainer", module: "XModule") -> None:
        n = self.every_n_epochs
        if (n and not self.every_n_train_steps and self.train_time_interval is None
                and (trainer.current_epoch + 1) % n == 0 and trainer.global_step != self._last_saved_step):
            self._save(trainer)

    def save_now(self, trainer: "Trainer") -> str | None:
        """Write a checkpoint now, whatever the schedule (a graceful stop on a signal does); the
        path of the newest checkpoint, or None if none could be written (non-finite loss)."""
        if trainer.global_step == self._last_saved_step:
            return self.last_model_path or None
        return self._save(trainer, force=True)

    def _save(self, trainer: "Trainer", force: bool = False) -> str | None:
        bad = trainer.nonfinite_step()
        if bad is not None:
            self._last_saved_step = trainer.global_step
            rank_zero_warn(f"ModelCheckpoint: no checkpoint at step {trainer.global_step}: the training loss became "
                           f"NaN or infinite at step {bad}. The newest good checkpoint stays "
                           f"{self.last_model_path or 'none (none was written before)'}.")
            return None
        metrics = dict(trainer.callback_metrics)
        if self.monitor is None:
            score = float(trainer.global_step)  # unmonitored: the newest is the best
        elif force and self.monitor not in metrics:
            score = math.nan  # written all the same, never counted among the best
        else:
            score = self._ranking.read(metrics, "ModelCheckpoint")
        path = os.path.join(self.dirpath, self._format(trainer, metrics) + ".ckpt")
        self._last_saved_step, self._last_save_time = trainer.global_step, time.monotonic()
        keep = self.save_top_k == -1 or (self.save_top_k > 0 and self._in_top_k(score))
        if not keep and not self.save_last and not force:
            return None
        # The bookkeeping is updated before the write, so that the checkpoint carries it.
        previous_last = self.last_model_path
        if keep:
            self.best_k_models[path] = score
        if self.save_last:
            self.last_model_path = path
        stale = self._beyond_top_k()
        if previous_last and previous_last != path and previous_last not in self.best_k_models:
            stale.append(previous_last)  # the old newest, kept only for last.ckpt until now
        if self.best_k_models:
            self.best_model_path = self._ranked()[0]
            self.best_model_score = self.best_k_models[self.best_model_path] if self.monitor else None
        trainer.save_checkpoint(path)
        if self.save_last and trainer.is_global_zero:
            storage.link_last(self.dirpath, path)
        self._remove(trainer, stale)
        return path

    def _foreign_checkpoints(self) -> bool:
        known = set(self.best_k_models) | {self.last_model_path}
        return os.path.isdir(self.dirpath) and any(
            name.endswith(".ckpt") and name != storage.LAST and os.path.join(self.dirpath, name) not in known
            for name in os.listdir(self.dirpath))

    def _ranked(self) -> list[str]:
        """Kept checkpoints, best first (NaN scores last)."""
        return sorted(self.best_k_models, key=lambda path: self._ranking.sort_key(self.best_k_models[path]))

    def _in_top_k(self, score: float) -> bool:
        if math.isnan(score):
            return False
        if len(self.best_k_models) < self.save_top_k:
            return True
        return self._ranking.better(score, self.best_k_models[self._ranked()[-1]])

    def _beyond_top_k(self) -> list[str]:
        if self.save_top_k == -1:
            return []
        stale = self._ranked()[self.save_top_k:]
        for path in stale:
            del self.best_k_models[path]
        return [path for path in stale if path != self.last_model_path]

    def _owns(self, path: Any) -> bool:
        """Whether ``path`` is a checkpoint of this callback's folder: only those are ever removed
        (the bookkeeping comes from checkpoint files, which are data, not orders)."""
        return (isinstance(path, str) and self.dirpath is not None and path.endswith(".ckpt")
                and not os.path.basename(path).startswith(".") and os.path.basename(path) != storage.LAST
                and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.dirpath))

    def _remove(self, trainer: "Trainer", paths: list[str]) -> None:
        if trainer.is_global_zero:
            for path in paths:
                if self._owns(path):
                    storage.remove(path)
        trainer.strategy.barrier("xtrainer_checkpoint_cleanup")

    def _format(self, trainer: "Trainer", metrics: dict[str, float]) -> str:
        values = {name.replace("/", "_"): value for name, value in metrics.items()}
        values.update(epoch=trainer.current_epoch, step=trainer.global_step)
        try:
            return self.filename.format(**values)
        except KeyError as err:
            raise KeyError(f"ModelCheckpoint(filename={self.filename!r}) names {err}, which was not logged. "
                           f"Available: {sorted(values)}.") from None
