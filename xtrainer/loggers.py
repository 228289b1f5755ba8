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
"""

from __future__ import annotations

import csv
import enum
import errno
import io
import os
import socket
import uuid
import warnings
from argparse import Namespace
from collections.abc import Mapping
from typing import Any, Iterable

from xtrainer.checkpoint import fs, storage

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger", "claim_run_folder", "claim_version_dir",
           "move_run_folder", "run_folder_root"]


class Logger:
    """Base class: receives host values, never device tensors. Called on rank 0 only.

    Lightning's interface: ``log_metrics``, ``log_hyperparams``, ``log_graph``, ``save``,
    ``finalize``, ``after_save_checkpoint`` and the ``name``, ``version``, ``save_dir``,
    ``root_dir``, ``log_dir``, ``experiment`` and ``group_separator`` properties. Only
    ``log_metrics`` must be written; the properties may also be plain attributes set in a
    subclass's ``__init__`` (``self.log_dir = ...``).
    """

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


# ---- the run folder ------------------------------------------------------------------------------
_VERSION_PREFIX = "version_"
#: On an object store, the object whose exclusive creation claims ``version_N`` (``fs.claim``).
CLAIM_FILE = ".xtrainer-claim"


def _folder_error(err: OSError, folder: str, what: str) -> OSError:
    """``err`` with a message that names the folder and says what to do."""
    reason = err.strerror or str(err)
    if isinstance(err, PermissionError) or err.errno == errno.EROFS:
        hint = f"{reason}: the folder is not writable; choose another save_dir (or default_root_dir)"
    elif isinstance(err, (NotADirectoryError, FileExistsError)):
        hint = f"{reason}: a file is in the way; save_dir (or default_root_dir) and its parents must be folders"
    else:
        hint = reason
    new = type(err)(err.errno, f"Cannot {what} {folder!r}: {hint}")
    new.filename = folder
    return new


def _make_root(root: str) -> None:
    if fs.is_url(root):  # an object store has no folders to make
        fs.require(root)
        return
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(f"Cannot create run folders under {root!r}: it is a file, not a folder. "
                                 "Choose another save_dir (or default_root_dir).")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise _folder_error(err, root, "create run folders under") from err


def _existing_versions(root: str) -> list[int]:
    try:
        names = fs.listdir(root)
    except OSError:
        return []
    return [int(n[len(_VERSION_PREFIX):]) for n in names
            if n.startswith(_VERSION_PREFIX) and n[len(_VERSION_PREFIX):].isdigit()]


def _next_version(root: str) -> int:
    """Lightning's choice: one more than the highest ``version_N`` in ``root`` (0 if none)."""
    existing = _existing_versions(root)
    return max(existing) + 1 if existing else 0


def _claim_version(root: str, start: int | None = None) -> int:
    """Create ``root/version_N`` for the first free N from ``start`` (default: one more than the
    highest on disk). ``os.mkdir`` fails if the folder exists, so two runs choosing at the same
    moment get different folders."""
    _make_root(root)
    version = max(_next_version(root), start or 0)
    while fs.is_url(root):  # no mkdir on an object store: an exclusive claim object (see fs.claim)
        path = fs.join(root, f"{_VERSION_PREFIX}{version}")
        try:
            if fs.claim(fs.join(path, CLAIM_FILE), f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}"):
                return version
        except OSError as err:  # no such bucket, no permission
            raise _folder_error(err, path, "create the run folder") from err
        version += 1
    while True:
        path = os.path.join(root, f"{_VERSION_PREFIX}{version}")
        try:
            os.mkdir(path)
            return version
        except FileExistsError:
            version += 1
        except OSError as err:
            raise _folder_error(err, path, "create the run folder") from err


def claim_version_dir(root: str) -> str:
    """Create and return ``root/version_N`` for the first N not taken (race-free, ``os.mkdir``)."""
    root = os.fspath(root)
    return os.path.join(root, f"{_VERSION_PREFIX}{_claim_version(root)}")


def run_folder_root(loggers: Iterable[Logger], default_root_dir: str) -> str:
    """The folder this run's ``version_N`` will be claimed in, without creating anything: the
    first folder logger's ``<save_dir>/<name>``, else ``default_root_dir``. Folder loggers built
    without ``save_dir`` get ``default_root_dir`` here (so ``trainer.logger.save_dir`` and
    ``log_dir`` are known once the Trainer is built, as in Lightning)."""
    default_root_dir = os.fspath(default_root_dir)
    root = None
    for logger in loggers:
        if isinstance(logger, _FolderLogger):
            logger.set_default_save_dir(default_root_dir)
            root = root or logger.root_dir
    return root or default_root_dir


def claim_run_folder(loggers: Iterable[Logger], default_root_dir: str) -> str:
    """Claim every folder logger's version folder and return the run's folder: the first folder
    logger's (``<save_dir>/<name>/version_N``), else ``<default_root_dir>/version_N``.

    A folder logger without ``save_dir`` gets ``default_root_dir``. Loggers writing under the same
    ``<save_dir>/<name>`` with no version of their own share one claimed version (a
    ``TensorBoardLogger`` and a ``CSVLogger`` side by side, as in Lightning). Call it once per
    run, in the process that launches the replicas (the loggers travel to them with the claim)."""
    default_root_dir = os.fspath(default_root_dir)
    shared: dict[str, int | str] = {}
    run_folder = None
    for logger in loggers:
        if isinstance(logger, _FolderLogger):
            folder = logger.claim(default_root_dir, shared)
            run_folder = run_folder or folder
    return run_folder or claim_version_dir(default_root_dir)


def move_run_folder(loggers: Iterable[Logger], previous: str | None, folder: str) -> None:
    """Point the folder loggers that were writing into ``previous`` to ``folder`` (e.g. rank 0's
    run folder, broadcast to the other hosts). Call before anything is written."""
    for logger in loggers:
        if isinstance(logger, _FolderLogger) and (previous is None or logger.version_dir == previous):
            logger.use_run_folder(folder)


def _check_name(name: Any) -> str:
    name = os.fspath(name) if name is not None else ""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}.")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts or "\0" in name:
        raise ValueError(f"name={name!r} would put the logs outside save_dir: give a relative name without '..' "
                         "(nested names like 'group/experiment' are fine).")
    return name


def _check_version(version: Any) -> int | str | None:
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (int, str)):
        raise TypeError(f"version must be an int, a string or None, got {type(version).__name__}.")
    if isinstance(version, int):
        if version < 0:
            raise ValueError(f"version={version}: versions are numbered from 0.")
        return version
    if version in ("", ".", "..") or any(c in version for c in "/\\\0") or (os.altsep and os.altsep in version):
        raise ValueError(f"version={version!r} must name one folder (no '/', '\\' or '..'): it is the run "
                         "folder's own name, under save_dir/name. Put any grouping in name= instead.")
    return version


def _check_save_dir(save_dir: Any) -> str | None:
    if save_dir is None:
        return None
    save_dir = os.path.expanduser(os.path.expandvars(os.fspath(save_dir)))
    if not save_dir:
        raise ValueError("save_dir is empty: give a folder (or leave it out to write into the Trainer's "
                         "default_root_dir).")
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise NotADirectoryError(f"save_dir={save_dir!r} is a file, not a folder.")
    return save_dir


class _FolderLogger(Logger):
    """A logger that writes into ``<save_dir>/<name>/<version>`` (Lightning's layout), claimed
    race-free when the version is left to it."""

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, save_dir: Any, name: str | None, version: int | str | None, prefix: str) -> None:
        self._save_dir = _check_save_dir(save_dir)
        self._name = _check_name(name)
        self._version = _check_version(version)
        self._explicit_version = self._version is not None
        self._claimed = False
        self._prefix = prefix or ""
        self._experiment = None

    # -- Lightning's properties ------------------------------------------------------------------
    @property
    def save_dir(self) -> str | None:
        """Where the ``<name>/version_N`` folders go; None until a Trainer gives its
        ``default_root_dir`` to a logger built without one."""
        return self._save_dir

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str | None:
        """The version: given, claimed, or (before the claim) the number the claim will try first."""
        if self._version is None and self._save_dir is not None:
            self._version = _next_version(self.root_dir)
        return self._version

    @property
    def root_dir(self) -> str | None:
        """``<save_dir>/<name>``: the parent of the version folders."""
        if self._save_dir is None:
            return None
        return os.path.join(self._save_dir, self._name) if self._name else self._save_dir

    @property
    def version_dir(self) -> str | None:
        """``<save_dir>/<name>/version_N``: the run folder (checkpoints go there too)."""
        version = self.version
        if version is None:
            return None
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"{_VERSION_PREFIX}{version}")

    @property
    def log_dir(self) -> str | None:
        return self.version_dir

    @log_dir.setter
    def log_dir(self, folder: str) -> None:
        self.use_run_folder(folder)

    @property
    def prefix(self) -> str:
        return self._prefix

    # -- the claim ---------------------------------------------------------------------------------
    def claim(self, default_root_dir: str | None = None, shared: dict[str, int | str] | None = None) -> str:
        """Create this logger's version folder and return it. A version left to the logger is
        claimed with ``os.mkdir`` (never one another run holds); a version given is created if
        missing and used as it is. ``default_root_dir`` is the ``save_dir`` of a logger built
        without one; ``shared`` maps a ``root_dir`` to the version already claimed there in this
        run, for loggers that write side by side."""
        if self._save_dir is None and default_root_dir is None:
            raise RuntimeError(f"{type(self).__name__} has no save_dir: give one, or pass the logger to a "
                               "Trainer, which gives it its default_root_dir.")
        self.set_default_save_dir(default_root_dir)
        root = self.root_dir
        if self._claimed and fs.isdir(self.version_dir):
            pass
        elif self._explicit_version:
            _make_root(root)
            try:
                fs.makedirs(self.version_dir)
            except OSError as err:
                raise _folder_error(err, self.version_dir, "create the run folder") from err
        elif shared is not None and root in shared:
            self._version = shared[root]
        else:
            self._version = _claim_version(root, start=self._version)
        self._claimed = True
        if shared is not None:
            shared.setdefault(root, self._version)
        return self.version_dir

    def set_default_save_dir(self, default_root_dir: str | None) -> None:
        """``save_dir`` for a logger built without one (a logger with one keeps it)."""
        if self._save_dir is None and default_root_dir is not None:
            self._save_dir = _check_save_dir(default_root_dir)

    def use_run_folder(self, folder: str) -> None:
        """Write into ``folder`` (an existing version folder) from now on."""
        folder = fs.normpath(os.fspath(folder))
        if self._claimed and self.version_dir and folder == fs.normpath(self.version_dir):
            return
        if self._experiment is not None:
            raise RuntimeError(f"{type(self).__name__} has already written into {self.log_dir}; it cannot move.")
        parent, base = fs.dirname(folder), fs.basename(folder)
        if parent != fs.normpath(self.root_dir or ""):
            self._save_dir, self._name = parent, ""
        self._version = (int(base[len(_VERSION_PREFIX):])
                         if base.startswith(_VERSION_PREFIX) and base[len(_VERSION_PREFIX):].isdigit() else base)
        self._claimed = True

    def _ensure_claimed(self) -> str:
        if not self._claimed:
            self.claim()
        return self.log_dir

    def _prefixed(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        if not self._prefix:
            return dict(metrics)
        return {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}

    def __getstate__(self) -> dict[str, Any]:
        # Writers hold open files: never pickled; they open again, lazily, where the logger logs.
        return {**self.__dict__, "_experiment": None}


# ---- values ------------------------------------------------------------------------------------
def _omegaconf_plain(value: Any) -> Any:
    """An OmegaConf container as plain dicts and lists (interpolations resolved where they
    resolve); anything else unchanged."""
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if not isinstance(value, Container):
        return value
    try:
        return OmegaConf.to_container(value, resolve=True)
    except Exception:  # an interpolation that does not resolve: kept as written
        return OmegaConf.to_container(value, resolve=False)


def _params_dict(params: Any) -> dict[str, Any]:
    """Lightning's accepted forms: a dict, an ``argparse.Namespace``, an OmegaConf container, None."""
    if params is None:
        return {}
    params = _omegaconf_plain(vars(params) if isinstance(params, Namespace) else params)
    if not isinstance(params, Mapping):
        raise TypeError(f"hyperparameters must be a dict, a Namespace or a DictConfig, got {type(params).__name__}.")
    return dict(params)


def _scalar(value: Any) -> Any:
    """A tensor or NumPy scalar as its Python number; anything else unchanged."""
    module = type(value).__module__ or ""
    if (module.startswith("torch") or module.startswith("numpy")) and hasattr(value, "item"):
        try:
            if getattr(value, "ndim", 0) == 0 or value.numel() == 1:
                return value.item()  # host sync for a device tensor: hyperparameters, once per run
        except (AttributeError, TypeError, ValueError, RuntimeError):
            pass
    return value


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as YAML-safe plain data: dicts, lists, numbers, strings, None; objects as text."""
    if depth > 32:  # deeper than any configuration: a cycle, or not a hyperparameter
        return str(value)[:200]
    value = _omegaconf_plain(_scalar(value))
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value, depth + 1)
    if isinstance(value, Mapping):
        return {k if type(k) in (str, int, float, bool) else str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_plain(v, depth + 1) for v in items]
    if value is None or type(value) in (bool, int, float, str):
        return value
    for base in (bool, int, float, str):  # their subclasses, as the plain type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _flatten(params: Mapping[str, Any], separator: str = "/", prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        key = f"{prefix}{separator}{key}" if prefix else str(key)
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, separator, key))
        else:
            flat[key] = value
    return flat


def _atomic_write(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (the checkpoint package's atomic replace)."""
    storage.replace_text(path, text)


def _write_hparams_yaml(path: str, params: Mapping[str, Any]) -> None:
    import yaml

    _atomic_write(path, yaml.safe_dump(_plain(dict(params)), sort_keys=False, allow_unicode=True))


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


# ---- TensorBoard -------------------------------------------------------------------------------
class TensorBoardLogger(_FolderLogger):
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
            _warn_once("log_graph", "TensorBoardLogger(log_graph=True): model graphs are not logged on XLA "
                                    "(tracing the module would run it outside the compiled step); ignored.")
        self._kwargs = kwargs
        self.hparams: dict[str, Any] = {}
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
                raise _folder_error(err, folder, "create the log folder") from err
            self._experiment = SummaryWriter(log_dir=folder, **self._kwargs)
        return self._experiment

    writer = experiment  # the name this class used before

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        writer = None
        for name, value in self._prefixed(metrics).items():
            name, value = str(name), _scalar(value)
            writer = writer or self.experiment
            if isinstance(value, Mapping):
                writer.add_scalars(name, {str(k): float(_scalar(v)) for k, v in value.items()}, step)
            elif isinstance(value, (int, float)):  # bool included
                writer.add_scalar(name, float(value), global_step=step)
            else:
                raise ValueError(f"TensorBoardLogger: metric {name!r} is {value!r} ({type(value).__name__}); "
                                 "TensorBoard scalars are numbers (or a dict of numbers).")
            self._scalar_tags.add(name)
        if step is not None:
            self._last_step = max(self._last_step, int(step))

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | float | None = None) -> None:
        """Record ``params`` (``hparams.yaml`` at once). ``metrics``: the values the HPARAMS view
        lists; the view is written then (with every metric logged as a scalar of the same name),
        or at ``finalize``. Metrics not logged as scalars before are logged now, at the last step
        seen (step 0 at the start, as in Lightning)."""
        self.hparams.update(_params_dict(params))
        if self.hparams:
            folder = self._ensure_claimed()
            fs.makedirs(folder)
            _write_hparams_yaml(os.path.join(folder, self.NAME_HPARAMS_FILE), self.hparams)
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
        if not names and not self.hparams:
            return
        values = {}
        for key, value in _flatten(self.hparams).items():
            value = _scalar(value)
            values[key] = value if type(value) in (bool, int, float, str) else str(value)
        writer = self.experiment._get_file_writer()
        for summary in hparams(values, {name: 0.0 for name in names}):
            writer.add_summary(summary)
        self._hparams_written = True

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        del model, input_array
        _warn_once("log_graph", "TensorBoardLogger.log_graph: model graphs are not logged on XLA (tracing the "
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


# ---- CSV ---------------------------------------------------------------------------------------
class _CSVWriter:
    """``metrics.csv`` (one row per ``log_metrics`` call; columns: every name seen, sorted, with
    ``step``) and ``hparams.yaml``, in ``log_dir``. Lightning's ``ExperimentWriter`` interface:
    ``log_metrics``, ``log_hparams``, ``save``, ``metrics``, ``metrics_keys``, ``hparams``."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        if fs.is_url(log_dir):  # it appends rows and renames files: neither exists on an object store
            raise ValueError(f"CSVLogger writes local files only, not {log_dir!r}: give it a local save_dir (the "
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
            raise _folder_error(err, log_dir, "create the log folder") from err
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
        storage.remove_leftovers(self.log_dir)  # a rewrite a kill cut short
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
            row[str(key)] = _scalar(value)
        if "step" in row and row["step"] != step:
            _warn_once("csv-step", "CSVLogger: a metric named 'step' is replaced by the step column.")
        row["step"] = int(step)
        self.metrics.append(row)
        self.rows_logged += 1

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        self.hparams.update(params)
        _write_hparams_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

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
        data = buffer.getvalue().encode("utf-8")
        fd = os.open(self.metrics_file_path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # one write() in practice: a kill cannot cut it
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, size)  # no row half-written (a full disk): the file as it was
                raise
        finally:
            os.close(fd)

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
        _atomic_write(self.metrics_file_path, buffer.getvalue())
        self.metrics_keys = list(keys)


class CSVLogger(_FolderLogger):
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
    An existing file (a run resumed into the same version) is appended to.
    """

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
        params = _params_dict(params)
        if params:
            self.experiment.log_hparams(params)

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.save()

    def finalize(self, status: str = "success") -> None:
        del status
        self.save()
