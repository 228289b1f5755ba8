"""Loggers: where the values read back from the device go (rank 0 only)."""

from __future__ import annotations

import os
from typing import Any


class Logger:
    """Base class: receives host floats, never device tensors. Called on rank 0 only."""

    log_dir: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """The run's settings; called at the start of a fit, and at its end with the final metrics."""
        del params, metrics

    def finalize(self) -> None:
        """Flush and close. Called at the end of every run, also when it failed."""


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files, with the ``tensorboard`` package's writer.

    By default into the run folder, ``<default_root_dir>/version_N``; with ``name``, into
    ``<default_root_dir>/<name>/version_N`` (checkpoints and the configuration go there too);
    with ``log_dir``, exactly there. The writer is opened on first use, inside the replica that
    logs (rank 0), so a Trainer that holds this logger still pickles for a multi-process launch.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, name: str = "") -> None:
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self.name = name
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """As text at the start; at the end, in TensorBoard's HPARAMS view, with the final metrics
        (which link to the scalars of the same names)."""
        if metrics is None:
            if params:
                self.writer.add_text("hparams", "\n".join(f"- {k}: {v}" for k, v in sorted(params.items())))
            return
        from torch.utils.tensorboard.summary import hparams

        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()}
        for summary in hparams(plain, dict(metrics)):
            self.writer.file_writer.add_summary(summary)

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}
