"""A run's folder: ``<save_dir>/<name>/version_N`` claimed race-free (``os.mkdir``, or an exclusive
claim object on an object store) and shared by the loggers that write under the same
``<save_dir>/<name>``; ``FolderLogger``, the base of the loggers that write into one."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any, Iterable

from xtrainer.checkpoint import fs
from xtrainer.loggers.base import Logger

_VERSION_PREFIX = "version_"
#: On an object store, the object whose exclusive creation claims ``version_N`` (``fs.claim_folder``).
CLAIM_FILE = fs.CLAIM_FILE


def folder_error(err: OSError, folder: str, what: str) -> OSError:
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
    try:
        fs.make_folder(root)  # an object store has no folders to make
    except fs.FileInTheWay:
        raise NotADirectoryError(f"Cannot create run folders under {root!r}: it is a file, not a folder. "
                                 "Choose another save_dir (or default_root_dir).") from None
    except OSError as err:
        raise folder_error(err, root, "create run folders under") from err


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
    highest on disk). The claim fails if the folder exists (``fs.claim_folder``: ``os.mkdir``, or
    an exclusive claim object on an object store), so two runs choosing at the same moment get
    different folders."""
    _make_root(root)
    version = max(_next_version(root), start or 0)
    while True:
        path = fs.join(root, f"{_VERSION_PREFIX}{version}")
        try:
            if fs.claim_folder(path):
                return version
        except OSError as err:  # not writable; on an object store, no such bucket or no permission
            raise folder_error(err, path, "create the run folder") from err
        version += 1


def claim_version_dir(root: str) -> str:
    """Create and return ``root/version_N`` for the first N not taken (race-free, ``os.mkdir``)."""
    root = fs.local(os.fspath(root))
    return os.path.join(root, f"{_VERSION_PREFIX}{_claim_version(root)}")


def run_folder_root(loggers: Iterable[Logger], default_root_dir: str) -> str:
    """The folder this run's ``version_N`` will be claimed in, without creating anything: the
    first folder logger's ``<save_dir>/<name>``, else ``default_root_dir``. Folder loggers built
    without ``save_dir`` get ``default_root_dir`` here (so ``trainer.logger.save_dir`` and
    ``log_dir`` are known once the Trainer is built, as in Lightning)."""
    default_root_dir = fs.local(os.fspath(default_root_dir))
    root = None
    for logger in loggers:
        if isinstance(logger, FolderLogger):
            logger.set_default_save_dir(default_root_dir)
            root = root or logger.root_dir
    return root or default_root_dir


def planned_run_folder(loggers: Iterable[Logger], default_root_dir: str) -> str:
    """The folder ``claim_run_folder`` would claim now, without creating anything (another run
    may claim it first)."""
    root = run_folder_root(loggers, default_root_dir)
    folder = next((logger.version_dir for logger in loggers if isinstance(logger, FolderLogger)), None)
    return folder or os.path.join(root, f"{_VERSION_PREFIX}{_next_version(root)}")


def claim_run_folder(loggers: Iterable[Logger], default_root_dir: str) -> str:
    """Claim every folder logger's version folder and return the run's folder: the first folder
    logger's (``<save_dir>/<name>/version_N``), else ``<default_root_dir>/version_N``.

    A folder logger without ``save_dir`` gets ``default_root_dir``. Loggers writing under the same
    ``<save_dir>/<name>`` with no version of their own share one claimed version (a
    ``TensorBoardLogger`` and a ``CSVLogger`` side by side, as in Lightning). Call it once per
    run, in the process that launches the replicas (the loggers travel to them with the claim)."""
    default_root_dir = fs.local(os.fspath(default_root_dir))
    shared: dict[str, int | str] = {}
    run_folder = None
    for logger in loggers:
        if isinstance(logger, FolderLogger):
            folder = logger.claim(default_root_dir, shared)
            run_folder = run_folder or folder
    return run_folder or claim_version_dir(default_root_dir)


def move_run_folder(loggers: Iterable[Logger], previous: str | None, folder: str) -> None:
    """Point the folder loggers that were writing into ``previous`` to ``folder`` (e.g. rank 0's
    run folder, broadcast to the other hosts). Call before anything is written."""
    for logger in loggers:
        if isinstance(logger, FolderLogger) and (previous is None or logger.version_dir == previous):
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
    save_dir = os.path.expanduser(os.path.expandvars(fs.local(os.fspath(save_dir))))
    if not save_dir:
        raise ValueError("save_dir is empty: give a folder (or leave it out to write into the Trainer's "
                         "default_root_dir).")
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise NotADirectoryError(f"save_dir={save_dir!r} is a file, not a folder.")
    return save_dir


class FolderLogger(Logger):
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
                raise folder_error(err, self.version_dir, "create the run folder") from err
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

