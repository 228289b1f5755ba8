"""``TensorBoardLogger``: TensorBoard event files in Lightning's layout, the HPARAMS view written
once the final metrics are known."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from xtrainer.checkpoint import fs
from xtrainer.loggers.base import warn_once
from xtrainer.loggers.hparams import flatten, params_dict, scalar, write_hparams_yaml
from xtrainer.loggers.run_folder import FolderLogger, folder_error


class TensorBoardLogger(FolderLogger):
    """Writes TensorBoard event files into ``<save_dir>/<name>/<version>[/<sub_dir>]``.

    Args (Lightning's):
        save_dir: the folder holding the ``<name>`` folders. Left out (None): the Trainer's
            ``default_root_dir``.
        name: the experiment's folder (``"lightning_logs"``); ``""`` or None: none.
        version: an int (folder ``version_<N>``), a string (the folder's own name), or None: the
            next free number, claimed with ``os.mkdir`` (see the module's docstring).
        log_graph: accepted and ignored, with a warning (not supported on XLA).
        default_hp_metric: log ``hp_metric=-1`` at step 0 with the hyperparameters, and list
            ``hp_metric`` among the HPARAMS view's metrics.
        prefix: put before every metric name, joined with ``"-"``.
        sub_dir: a folder inside the version folder for the event files (e.g. ``"train"``).
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter`` (``max_queue``,
            ``flush_secs``, ``filename_suffix``...).

    The writer opens on first use, in the replica that logs (rank 0): a Trainer holding this
    logger still pickles for a multi-process launch.
    """

    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, log_graph: bool = False, default_hp_metric: bool = True,
                 prefix: str = "", sub_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        if "log_dir" in kwargs:
            raise TypeError("TensorBoardLogger takes Lightning's save_dir/name/version, not log_dir: to write into "
                            "exactly one folder, give TensorBoardLogger(save_dir=<its parent>, name='', "
                            "version=<its name>).")
        super().__init__(save_dir, name, version, prefix)
        if sub_dir is not None:
            sub_dir = os.fspath(sub_dir)
            if os.path.isabs(sub_dir) or ".." in sub_dir.replace("\\", "/").split("/"):
                raise ValueError(f"sub_dir={sub_dir!r} must be a folder inside the version folder.")
        self._sub_dir = sub_dir
        self._default_hp_metric = default_hp_metric
        self._log_graph = False  # graphs are not logged (below)
        if log_graph:
            warn_once("log_graph", "TensorBoardLogger(log_graph=True): model graphs are not logged on XLA "
                                    "(tracing the module would run it outside the compiled step); ignored.")
        self._kwargs = kwargs
        self.hparams: dict[str, Any] = {}
        self.run_settings: dict[str, Any] = {}  # shown beside the hyperparameters, not in hparams.yaml
        self._hparams_pending = False     # params logged, HPARAMS view not written yet
        self._hparams_written = False
        self._scalar_tags: set[str] = set()
        self._last_step = 0

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    def log_dir(self) -> str | None:
        folder = self.version_dir
        if folder is not None and self._sub_dir:
            folder = os.path.join(folder, self._sub_dir)
        return folder

    @log_dir.setter
    def log_dir(self, folder: str) -> None:  # the version folder (sub_dir stays inside it)
        self.use_run_folder(folder)

    @property
    def experiment(self):
        """The ``SummaryWriter`` (opened on first use, on the replica that logs)."""
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter

            folder = self._ensure_claimed()
            try:
                fs.makedirs(folder)
            except OSError as err:
                raise folder_error(err, folder, "create the log folder") from err
            self._experiment = SummaryWriter(log_dir=folder, **self._kwargs)
        return self._experiment

    writer = experiment  # the name this class used before

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        writer = None
        for name, value in self._prefixed(metrics).items():
            name, value = str(name), scalar(value)
            writer = writer or self.experiment
            if isinstance(value, Mapping):
                writer.add_scalars(name, {str(k): float(scalar(v)) for k, v in value.items()}, step)
            elif isinstance(value, (int, float)):  # bool included
                writer.add_scalar(name, float(value), global_step=step)
            else:
                raise ValueError(f"TensorBoardLogger: metric {name!r} is {value!r} ({type(value).__name__}); "
                                 "TensorBoard scalars are numbers (or a dict of numbers).")
            self._scalar_tags.add(name)
        if step is not None:
            self._last_step = max(self._last_step, int(step))

    def log_run_settings(self, settings: Mapping[str, Any]) -> None:
        """The run's settings (the Trainer's, ``trainer/...``, and the configuration it was built
        from), shown in the HPARAMS view beside the hyperparameters but kept out of
        ``hparams.yaml``, which holds the module's hyperparameters alone, as in Lightning (a
        script may rebuild the module from it: ``Model(**yaml.safe_load(f))``)."""
        self.run_settings.update(settings)

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | float | None = None) -> None:
        """Record ``params`` (``hparams.yaml`` at once). ``metrics``: the values the HPARAMS view
        lists; the view is written then (with every metric logged as a scalar of the same name),
        or at ``finalize``. Metrics not logged as scalars before are logged now, at the last step
        seen (step 0 at the start, as in Lightning)."""
        self.hparams.update(params_dict(params))
        folder = self._ensure_claimed()  # written even empty ({}), as Lightning writes it
        fs.makedirs(folder)
        write_hparams_yaml(os.path.join(folder, self.NAME_HPARAMS_FILE), self.hparams)
        if metrics is not None and not isinstance(metrics, Mapping):
            metrics = {"hp_metric": metrics}
        if metrics is None:
            if self._default_hp_metric:
                self.log_metrics({"hp_metric": -1}, 0)
            self._hparams_pending = True
            return
        metrics = self._prefixed(metrics)
        fresh = {k: v for k, v in metrics.items() if k not in self._scalar_tags}
        if fresh:
            prefix, self._prefix = self._prefix, ""  # already prefixed
            try:
                self.log_metrics(fresh, self._last_step)
            finally:
                self._prefix = prefix
        self._write_hparams_view(metrics)

    def _write_hparams_view(self, metrics: Mapping[str, Any]) -> None:
        self._hparams_pending = False
        if self._hparams_written:  # TensorBoard would show only the first one anyway
            return
        from torch.utils.tensorboard.summary import hparams

        names = dict.fromkeys(metrics)
        if self._default_hp_metric:
            names.setdefault(f"{self._prefix}{self.LOGGER_JOIN_CHAR}hp_metric" if self._prefix else "hp_metric")
        if not names and not self.hparams and not self.run_settings:
            return
        values = {}
        for key, value in flatten({**self.run_settings, **self.hparams}).items():
            value = scalar(value)
            values[key] = value if type(value) in (bool, int, float, str) else str(value)
        writer = self.experiment._get_file_writer()
        for summary in hparams(values, {name: 0.0 for name in names}):
            writer.add_summary(summary)
        self._hparams_written = True

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        del model, input_array
        warn_once("log_graph", "TensorBoardLogger.log_graph: model graphs are not logged on XLA (tracing the "
                                "module would run it outside the compiled step); ignored.")

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.flush()

    def finalize(self, status: str = "success") -> None:
        del status
        if self._hparams_pending:
            self._write_hparams_view({})
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
            self._experiment = None


