"""``CSVLogger``: ``metrics.csv`` and ``hparams.yaml`` in Lightning's layout; rows appended in one
synced write, the header rewritten through a temporary file, so a kill leaves a readable file."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from typing import Any

from xtrainer.checkpoint import folders, fs, storage
from xtrainer.loggers.base import warn_once
from xtrainer.loggers.hparams import atomic_write, params_dict, scalar, write_hparams_yaml
from xtrainer.loggers.run_folder import FolderLogger, folder_error


class _CSVWriter:
    """``metrics.csv`` (one row per ``log_metrics`` call; columns: every name seen, sorted, with
    ``step``) and ``hparams.yaml``, in ``log_dir``. Lightning's ``ExperimentWriter`` interface:
    ``log_metrics``, ``log_hparams``, ``save``, ``metrics``, ``metrics_keys``, ``hparams``."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        # it appends rows and renames files: neither exists on an object store
        fs.require_local(log_dir, "CSVLogger writes local files only, not {path}: give it a local save_dir (the "
                                  "TensorBoardLogger and checkpoints can stay on the object store).")
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []  # rows not written yet
        self.metrics_keys: list[str] = []        # the file's columns
        self.hparams: dict[str, Any] = {}
        self.rows_logged = 0
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as err:
            raise folder_error(err, log_dir, "create the log folder") from err
        self._adopt_existing_file()

    def _adopt_existing_file(self) -> None:
        """A run resumed into this folder appends: take the file's columns; drop a last row cut
        short (a machine that went down mid-write)."""
        try:
            with open(self.metrics_file_path, encoding="utf-8", newline="") as f:
                text = f.read()
            records = list(csv.reader(io.StringIO(text)))
        except FileNotFoundError:
            return
        except (UnicodeDecodeError, csv.Error) as err:
            raise ValueError(f"{self.metrics_file_path} exists and is not a CSV file this logger can append to "
                             f"({err}): move it away, or log into another version.") from err
        folders.remove_leftovers(self.log_dir)  # a rewrite a kill cut short
        if not records:
            return
        self.metrics_keys = records[0]
        if not text.endswith(("\n", "\r")) and len(records) > 1:
            self._rewrite(self.metrics_keys, [dict(zip(records[0], r)) for r in records[1:-1]])

    def log_metrics(self, metrics_dict: Mapping[str, Any], step: int | None = None) -> None:
        if step is None:
            step = self.rows_logged
        row = {}
        for key, value in metrics_dict.items():
            row[str(key)] = scalar(value)
        if "step" in row and row["step"] != step:
            warn_once("csv-step", "CSVLogger: a metric named 'step' is replaced by the step column.")
        row["step"] = int(step)
        self.metrics.append(row)
        self.rows_logged += 1

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        self.hparams.update(params)
        write_hparams_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def save(self) -> None:
        """Write the buffered rows: appended in one ``write`` when the columns are unchanged;
        otherwise the whole file is written anew beside it and swapped in (``os.replace``)."""
        if not self.metrics:
            return
        seen = dict.fromkeys(k for row in self.metrics for k in row)
        new = [k for k in seen if k not in self.metrics_keys]
        exists = os.path.exists(self.metrics_file_path)
        try:
            if new or not exists:
                keys = sorted(set(self.metrics_keys) | set(new)) if new else list(self.metrics_keys)
                old = self._read_rows() if exists else []
                self._rewrite(keys, old + self.metrics)
            else:
                self._append(self.metrics)
        except OSError as err:
            # The rows stay buffered (a later save tries again); the file holds every row before them.
            raise type(err)(err.errno, f"CSVLogger could not write {self.metrics_file_path} ({err.strerror}); "
                                       f"it holds every row written before, {len(self.metrics)} wait.") from err
        self.metrics = []

    def _append(self, rows: list[dict[str, Any]]) -> None:
        buffer = io.StringIO()
        csv.DictWriter(buffer, fieldnames=self.metrics_keys, lineterminator="\n").writerows(rows)
        storage.append(self.metrics_file_path, buffer.getvalue().encode("utf-8"))

    def _read_rows(self) -> list[dict[str, Any]]:
        with open(self.metrics_file_path, encoding="utf-8", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                return []
            return [dict(zip(header, record)) for record in reader if record]

    def _rewrite(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(self.metrics_file_path, buffer.getvalue())
        self.metrics_keys = list(keys)


class CSVLogger(FolderLogger):
    """Writes ``metrics.csv`` and ``hparams.yaml`` into ``<save_dir>/<name>/<version>``.

    Args (Lightning's):
        save_dir: the folder holding the ``<name>`` folders. Left out (None): the Trainer's
            ``default_root_dir``.
        name: the experiment's folder (``"lightning_logs"``); ``""`` or None: none.
        version: an int (folder ``version_<N>``), a string (the folder's own name), or None: the
            next free number, claimed with ``os.mkdir``.
        prefix: put before every metric name, joined with ``"-"``.
        flush_logs_every_n_steps: write the buffered rows when ``step + 1`` reaches a multiple of
            this (also when steps skip past one), when this many rows wait, and at
            ``save``/``finalize``.

    ``metrics.csv`` has one row per ``log_metrics`` call, a ``step`` column (and ``epoch`` when
    logged, as the Trainer does), and a column for every metric name seen (sorted; the header is
    rewritten when new names appear). Values are written as text (``repr`` of floats: exact).
    An existing file (a run resumed into the same version) is appended to. As Lightning's, it
    holds what the module (and Lightning's callbacks, such as ``LearningRateMonitor``) logged:
    the Trainer's own figures (throughput, compilations, memory) go to the other loggers only.
    """

    takes_run_figures = False

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(save_dir, name, version, prefix)
        if isinstance(flush_logs_every_n_steps, bool) or not isinstance(flush_logs_every_n_steps, int) \
                or flush_logs_every_n_steps < 1:
            raise ValueError(f"flush_logs_every_n_steps must be a positive int, got {flush_logs_every_n_steps!r}.")
        self._flush_logs_every_n_steps = flush_logs_every_n_steps
        self._flushed_through = 0  # (step + 1) // flush_logs_every_n_steps at the last write

    @property
    def experiment(self) -> _CSVWriter:
        """The writer (opened on first use, on the replica that logs)."""
        if self._experiment is None:
            self._experiment = _CSVWriter(self._ensure_claimed())
        return self._experiment

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        writer = self.experiment
        epoch = metrics.get("epoch")
        if isinstance(epoch, float) and epoch.is_integer():  # the Trainer's epoch, written as Lightning's: 3
            metrics = {**metrics, "epoch": int(epoch)}
        writer.log_metrics(self._prefixed(metrics), step)
        every = self._flush_logs_every_n_steps
        through = (writer.metrics[-1]["step"] + 1) // every
        # Lightning writes when (step + 1) is a multiple of n; here also when steps skip one.
        if through > self._flushed_through or len(writer.metrics) >= every:
            self._flushed_through = max(through, self._flushed_through)
            self.save()

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Merge ``params`` into ``hparams.yaml`` (written at once). ``metrics`` (the final values
        the Trainer passes at the end of a fit) are in ``metrics.csv`` already: not repeated."""
        del metrics
        self.experiment.log_hparams(params_dict(params))  # written even empty ({}), as Lightning writes it

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.save()

    def finalize(self, status: str = "success") -> None:
        del status
        self.save()
