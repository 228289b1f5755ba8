"""``Logger``: the interface the Trainer calls (Lightning's), and the loggers' one-time warnings."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


class Logger:
    """Base class: receives host values, never device tensors. Called on rank 0 only.

    Lightning's interface: ``log_metrics``, ``log_hyperparams``, ``log_graph``, ``save``,
    ``finalize``, ``after_save_checkpoint`` and the ``name``, ``version``, ``save_dir``,
    ``root_dir``, ``log_dir``, ``experiment`` and ``group_separator`` properties. Only
    ``log_metrics`` must be written; the properties may also be plain attributes set in a
    subclass's ``__init__`` (``self.log_dir = ...``).
    """

    #: Whether ``log_metrics`` also gets the run's own figures (throughput, compilations, memory,
    #: the automatic learning rates) beside the values the module logged; False: those values,
    #: ``epoch`` and what Lightning's callbacks log only (``CSVLogger``, as Lightning's CSV holds).
    takes_run_figures: bool = True

    # -- what a subclass may override or assign ------------------------------------------------
    @property
    def name(self) -> str | None:
        return self.__dict__.get("_name")

    @name.setter
    def name(self, value: str | None) -> None:
        self.__dict__["_name"] = value

    @property
    def version(self) -> int | str | None:
        return self.__dict__.get("_version")

    @version.setter
    def version(self, value: int | str | None) -> None:
        self.__dict__["_version"] = value

    @property
    def save_dir(self) -> str | None:
        return self.__dict__.get("_save_dir")

    @save_dir.setter
    def save_dir(self, value: str | None) -> None:
        self.__dict__["_save_dir"] = value

    @property
    def root_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return self.__dict__.get("_log_dir")

    @log_dir.setter
    def log_dir(self, value: str | None) -> None:
        self.__dict__["_log_dir"] = value

    @property
    def experiment(self) -> Any:
        """The object that writes (a ``SummaryWriter``, a CSV writer...); None here."""
        return None

    @property
    def group_separator(self) -> str:
        return "/"

    # -- what the Trainer calls ----------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: Any, metrics: Mapping[str, float] | None = None) -> None:
        """The run's settings; called at the start of a fit, and at its end with the final metrics."""
        del params, metrics

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        del model, input_array

    def save(self) -> None:
        """Write what is buffered."""

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Called after a checkpoint is written (a logger that uploads them would do it here)."""
        del checkpoint_callback

    def finalize(self, status: str = "success") -> None:
        """Flush and close. Called at the end of every run, also when it failed
        (``status="failed"``)."""
        del status
        self.save()


class DummyLogger(Logger):
    """What ``fast_dev_run`` puts in place of the run's loggers, as Lightning does: it writes
    nothing, and its ``experiment`` takes any call (a step's
    ``self.logger.experiment.add_histogram(...)`` still runs)."""

    name = version = ""

    @property
    def experiment(self) -> "_DummyExperiment":
        return _DummyExperiment()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        del metrics, step


class _DummyExperiment:
    """Any attribute, call or item of it is itself: nothing happens."""

    def __getattr__(self, name: str) -> "_DummyExperiment":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "_DummyExperiment":
        return self

    def __getitem__(self, key: Any) -> "_DummyExperiment":
        return self


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)

