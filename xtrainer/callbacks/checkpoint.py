"""``ModelCheckpoint``: save checkpoints during fit, keep the best ``save_top_k``."""

from __future__ import annotations

import math
import os
import shutil
from typing import TYPE_CHECKING, Any

from xtrainer.callbacks.base import Callback

if TYPE_CHECKING:
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save a checkpoint every ``every_n_epochs`` epochs (or ``every_n_train_steps`` steps).

    Args:
        dirpath: where to save; default ``<run folder>/checkpoints``.
        filename: a format string over ``epoch``, ``step`` and any logged metric,
            e.g. ``"{epoch}-{val_acc:.3f}"``; default ``"epoch={epoch}-step={step}"``.
        monitor: a logged metric to rank checkpoints by (None: the newest is the best).
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        save_top_k: how many checkpoints to keep (-1: all, 0: none but ``last``).
        save_last: also keep ``last.ckpt``, a copy of the newest.

    Every replica calls the save (writing a checkpoint is collective); rank 0 removes the files
    that fall out of the top k.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None,
                 monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = False,
                 every_n_epochs: int | None = 1, every_n_train_steps: int | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}) must be -1 or more.")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_epochs, self.every_n_train_steps = every_n_epochs, every_n_train_steps
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def state_dict(self) -> dict[str, Any]:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
                "dirpath": self.dirpath}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_k_models = dict(state_dict.get("best_k_models", {}))
        self.best_model_path = state_dict.get("best_model_path", "")
        self.best_model_score = state_dict.get("best_model_score")
        self.last_model_path = state_dict.get("last_model_path", "")

    def setup(self, trainer: "Trainer", module: "XModule", stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.log_dir, "checkpoints")

    def on_train_batch_end(self, trainer: "Trainer", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0 and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: "Trainer", module: "XModule") -> None:
        n = self.every_n_epochs
        if n and not self.every_n_train_steps and (trainer.current_epoch + 1) % n == 0:
            self._save(trainer)

    def _save(self, trainer: "Trainer") -> None:
        metrics = dict(trainer.callback_metrics)
        if self.monitor is None:
            score = float(trainer.global_step)  # unmonitored: the newest is the best
        elif self.monitor in metrics:
            score = metrics[self.monitor]
        else:
            raise KeyError(f"ModelCheckpoint(monitor={self.monitor!r}) found no such logged metric. "
                           f"Logged: {sorted(metrics)}. Log it with self.log({self.monitor!r}, ...).")
        path = os.path.join(self.dirpath, self._format(trainer, metrics) + ".ckpt")
        self._last_saved_step = trainer.global_step
        if self.save_top_k == -1 or (self.save_top_k > 0 and self._in_top_k(score)):
            trainer.save_checkpoint(path)
            self.best_k_models[path] = score
            self._drop_beyond_top_k(trainer)
        if self.save_last:
            self.last_model_path = os.path.join(self.dirpath, "last.ckpt")
            trainer.save_checkpoint(self.last_model_path)
        if self.best_k_models:
            self.best_model_path = self._ranked()[0]
            self.best_model_score = self.best_k_models[self.best_model_path] if self.monitor else None

    def _ranked(self) -> list[str]:
        """Kept checkpoints, best first (NaN scores last)."""
        higher_is_better = self.monitor is None or self.mode == "max"

        def key(path: str) -> tuple[bool, float]:
            score = self.best_k_models[path]
            return (math.isnan(score), -score if higher_is_better else score)

        return sorted(self.best_k_models, key=key)

    def _in_top_k(self, score: float) -> bool:
        if math.isnan(score):
            return False
        if len(self.best_k_models) < self.save_top_k:
            return True
        worst = self.best_k_models[self._ranked()[-1]]
        return math.isnan(worst) or (score > worst if self.monitor is None or self.mode == "max" else score < worst)

    def _drop_beyond_top_k(self, trainer: "Trainer") -> None:
        if self.save_top_k == -1:
            return
        for path in self._ranked()[self.save_top_k:]:
            del self.best_k_models[path]
            if trainer.is_global_zero:
                _remove(path)
        trainer.strategy.barrier("xtrainer_checkpoint_cleanup")

    def _format(self, trainer: "Trainer", metrics: dict[str, float]) -> str:
        values = {name.replace("/", "_"): value for name, value in metrics.items()}
        values.update(epoch=trainer.current_epoch, step=trainer.global_step)
        try:
            return self.filename.format(**values)
        except KeyError as err:
            raise KeyError(f"ModelCheckpoint(filename={self.filename!r}) names {err}, which was not logged. "
                           f"Available: {sorted(values)}.") from None


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
