"""Loggers: where the values read back from the device go (rank 0 only).

``TensorBoardLogger`` and ``CSVLogger`` take Lightning 2.x's arguments and write Lightning's
layout, ``<save_dir>/<name>/version_<N>``, so that Lightning code only changes its import::

    from xtrainer.loggers import CSVLogger, TensorBoardLogger

    trainer = Trainer(logger=[TensorBoardLogger("logs"), CSVLogger("logs")])

Where they differ from Lightning:

* ``save_dir`` may be left out: the Trainer then gives its ``default_root_dir``.
  (``Trainer(logger=True)`` makes ``TensorBoardLogger(name="")``: its run folders are
  ``<default_root_dir>/version_<N>``, without Lightning's ``lightning_logs`` level.)
* A version left to the logger is *claimed*: the folder is created with ``os.mkdir``, which fails
  when it exists, so two runs starting at the same moment never share one (Lightning only lists
  the folders and may give both runs the same number). A version given (``version=3`` or
  ``version="baseline"``) is used as is, and shared on purpose: a run resumed into it appends.
* ``CSVLogger`` appends to an existing ``metrics.csv`` (Lightning deletes it), and its writes
  survive a kill: a header rewrite goes through a temporary file and ``os.replace``; rows are
  appended in one ``write`` and synced.
* ``TensorBoardLogger`` writes TensorBoard's HPARAMS view once, when the final metrics are known
  (the Trainer calls ``log_hyperparams(params, metrics)`` at the end of a fit), or at
  ``finalize``: TensorBoard shows only the first such record of a run, so one written at the
  start (as Lightning does) would hide the final metrics. ``hp_metric=-1`` is still logged at
  step 0 when ``default_hp_metric`` is set, and ``hparams.yaml`` is written at once.
* ``log_graph`` is accepted and ignored, with one warning: tracing a module for TensorBoard's
  graph runs it outside the XLA step.

The package: ``base.py`` (``Logger``, the interface), ``run_folder.py`` (claiming a run's
``version_N`` folder, and the loggers that write into one), ``tensorboard.py``
(``TensorBoardLogger``), ``csv_logs.py`` (``CSVLogger``) and ``hparams.py`` (hyperparameters as
plain values, ``hparams.yaml``).
"""

from __future__ import annotations

from xtrainer.loggers.base import Logger
from xtrainer.loggers.csv_logs import CSVLogger
from xtrainer.loggers.run_folder import claim_run_folder, claim_version_dir, move_run_folder, run_folder_root
from xtrainer.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger", "claim_run_folder", "claim_version_dir",
           "move_run_folder", "run_folder_root"]

#: Lightning's loggers with no counterpart here.
MISSING = ("WandbLogger", "MLFlowLogger", "CometLogger", "NeptuneLogger")


def __getattr__(name: str) -> object:
    if name in MISSING:
        raise ImportError(
            f"xtrainer.loggers has no {name} (a Lightning logger with no counterpart here): use TensorBoardLogger or "
            f"CSVLogger, or subclass xtrainer.loggers.Logger (log_metrics and log_hyperparams, called on rank 0 "
            f"with values already on the host) to write to that service.")
    raise AttributeError(f"module 'xtrainer.loggers' has no attribute {name!r}")
