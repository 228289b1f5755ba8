"""``ModelCheckpoint``: save checkpoints during fit, keep the best ``save_top_k``, as Lightning's does."""

from __future__ import annotations

import datetime
import math
import os
import string
import time
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.monitor import Monitor
from xtrainer.checkpoint import default_dirpath, folders, fs, storage
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class MetricNotFoundError(KeyError, RuntimeError):
    """A monitored metric was never logged. A ``KeyError`` (a metric looked up by name) and a
    ``RuntimeError`` (what Lightning's ``EarlyStopping`` raises), so either ``except`` catches it."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def score_tensor(value: Any) -> torch.Tensor:
    """A score as Lightning keeps it: a 0-d CPU tensor (float64: a logged float stays exact)."""
    return torch.tensor(float(value), dtype=torch.float64)


class ModelCheckpoint(Callback):
    """Save checkpoints during fit and keep the best ``save_top_k`` by ``monitor``: Lightning's
    ``ModelCheckpoint``, with its arguments, file names and attributes.

    Args:
        dirpath: where to save; default ``<run folder>/checkpoints``.
        filename: a format string over ``epoch``, ``step`` and any logged metric. With
            ``auto_insert_metric_name`` (default) each field gets its name in front:
            ``"{epoch}-{val_loss:.2f}"`` gives ``epoch=1-val_loss=0.08.ckpt``. Default
            ``"{epoch}-{step}"`` (``epoch=1-step=16.ckpt``). A field that was not logged reads 0
            (as in Lightning; a warning says so once). A metric named with ``/`` (``val/loss``)
            makes a subfolder, as in Lightning; write ``"val_loss={val/loss:.2f}"`` with
            ``auto_insert_metric_name=False`` to avoid it (``{val_loss}`` also finds ``val/loss``
            when no metric is named ``val_loss``).
        monitor: a logged metric to rank checkpoints by (None: the newest is the best).
        verbose: one line on rank 0 for every checkpoint written (and, with ``monitor``, for
            every one that was not good enough to be kept).
        save_last: ``True`` (xtrainer's default; Lightning's is ``None``): ``last.ckpt`` always holds
            the newest state, so ``fit(ckpt_path="last")`` resumes from it: a link to the newest
            checkpoint when that one is kept among the top k, else the checkpoint itself written
            under that name (one write per save either way). ``"link"``: ``last.ckpt`` is always a
            link; a newest checkpoint that is not among the top k is kept under its own name until a
            newer one replaces it. ``False``/``None``: no ``last.ckpt``. The name is
            ``CHECKPOINT_NAME_LAST`` (it may hold fields, e.g. ``"{epoch}-last"``) and is never
            given a version suffix, so that ``ckpt_path="last"`` finds this run's.
        save_top_k: keep the best k checkpoints (-1: all, 0: none; without ``monitor``: the k
            newest, where Lightning allows only -1, 0 and 1).
        save_weights_only: write the module's weights only (with the loop counters and
            hyperparameters): such a file loads into a module (``load_from_checkpoint``, or
            ``validate``/``test``/``predict`` with ``ckpt_path``) but cannot resume a fit. The
            checkpoint written on SIGTERM/SIGINT is always complete, to resume from.
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        auto_insert_metric_name: put ``name=`` before each field of ``filename`` (see above).
        every_n_train_steps: save every n optimizer steps (0/None: not by steps).
        train_time_interval: save when this much training time has passed since the last save
            (a ``datetime.timedelta``, or seconds), checked after every step.
        every_n_epochs: save every n epochs (0: never by epochs). When none of the three is
            given, every epoch; when another is given, 0. At most one of them may be set.
        save_on_train_epoch_end: save at the end of the training epoch (True) or after
            validation (False). Default, as Lightning: at the training epoch's end, unless the fit
            validates every ``check_val_every_n_epoch != 1`` epochs or several times per epoch
            (then after each validation, where the validation metrics are new).
        enable_version_counter: a file name that exists already (another run's, or a repeated
            name) gets ``-v1``, ``-v2``... instead of replacing it.
        save_on_exception: when a fit fails with an exception, save a checkpoint first (named as
            the others, with ``last.ckpt``), as Lightning does; unless this step was saved
            already. One replica only: with several, a save is collective and the replicas are
            stopping, so nothing is saved (a warning). A stop on a signal saves its own.

    A monitored metric that is missing when a checkpoint is due (e.g. ``val_loss`` before the
    first validation, with ``every_n_train_steps``): a warning, and no top-k checkpoint this time
    (``last.ckpt`` is written all the same); once a validation has run and the metric is still
    missing, ``MetricNotFoundError`` names the logged metrics, as Lightning does. A NaN score is
    ranked as the worst possible (``inf`` for ``"min"``), also as in Lightning.

    Attributes, as Lightning's: ``best_model_path``, ``best_model_score`` (a 0-d tensor, None
    without ``monitor``), ``best_k_models`` (``{path: score tensor}``; empty without ``monitor``),
    ``kth_best_model_path``, ``kth_value``, ``last_model_path`` (the ``last.ckpt`` path),
    ``current_score``, ``dirpath``. They are saved in every checkpoint and restored on resume
    into the same ``dirpath`` (in another folder only ``best_model_path`` comes back, and nothing
    of the earlier folder is ever removed).

    Crash safety: each checkpoint is written under a temporary name and renamed into place when
    complete; then ``last.ckpt`` is switched to it; only then are checkpoints that fell out of
    the top k removed. Every replica calls the save (writing a checkpoint is collective); rank 0
    decides what to keep and tells the others, rank 0 removes files, and at the start of a fit the
    leftovers of saves that a crash interrupted. Only files inside ``dirpath`` that this callback's
    own bookkeeping lists are ever removed.

    No checkpoint is written once the training loss has been NaN or infinite (with the Trainer's
    ``detect_nonfinite`` on): the good ones written before stay, ``last.ckpt`` among them.
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None,
                 monitor: str | None = None, verbose: bool = False,
                 save_last: bool | Literal["link"] | None = True, save_top_k: int = 1,
                 save_weights_only: bool = False, mode: str = "min", auto_insert_metric_name: bool = True,
                 every_n_train_steps: int | None = None,
                 train_time_interval: datetime.timedelta | float | None = None,
                 every_n_epochs: int | None = None, save_on_train_epoch_end: bool | None = None,
                 enable_version_counter: bool = True, save_on_exception: bool = False) -> None:
        self._ranking = Monitor(monitor or "", mode)  # refuses a mode other than min/max
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}) must be an int >= -1.")
        if save_last not in (True, False, None, "link"):
            raise ValueError(f"ModelCheckpoint(save_last={save_last!r}): use True, False, None or 'link'.")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"ModelCheckpoint(monitor={monitor!r}) must name a logged metric.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"ModelCheckpoint({name}={value!r}) must be an int >= 0 (or None).")
        if isinstance(train_time_interval, datetime.timedelta):
            train_time_interval = train_time_interval.total_seconds()
        if train_time_interval is not None and (not isinstance(train_time_interval, (int, float))
                                                or train_time_interval < 0):
            raise ValueError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}) must be a "
                             "datetime.timedelta or seconds >= 0.")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs, every_n_train_steps = 1, 0  # Lightning's default: every epoch
        every_n_epochs, every_n_train_steps = every_n_epochs or 0, every_n_train_steps or 0
        given = [f"{name}={value!r}" for name, value, on in (
            ("every_n_train_steps", every_n_train_steps, every_n_train_steps >= 1),
            ("every_n_epochs", every_n_epochs, every_n_epochs >= 1),
            ("train_time_interval", train_time_interval, train_time_interval is not None)) if on]
        if len(given) > 1:
            raise ValueError(f"ModelCheckpoint({', '.join(given)}): give only one of them (as Lightning); use "
                             "several ModelCheckpoint callbacks to save on several schedules.")
        self.monitor, self.verbose, self.mode = monitor, verbose, mode
        self.save_last, self.save_top_k, self.save_weights_only = save_last, save_top_k, save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.every_n_epochs, self.every_n_train_steps = every_n_epochs, every_n_train_steps
        self.train_time_interval = None if train_time_interval is None else float(train_time_interval)
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.enable_version_counter = enable_version_counter
        self.save_on_exception = bool(save_on_exception)
        self.filename = filename
        self._check_filename(filename)
        self._given_dirpath = dirpath is not None
        self.dirpath = fs.absolute(os.fspath(dirpath)) if dirpath is not None else None  # as Lightning resolves it

        # What Lightning users read; saved in checkpoints.
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = score_tensor(self._ranking.worst)
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self.last_model_path = ""
        # Bookkeeping of xtrainer's own: the k newest without a monitor, and (save_last="link")
        # the newest checkpoint kept only because last.ckpt links to it.
        self._kept: list[str] = []
        self._last_target = ""
        self._interrupted = ""  # written on a signal outside the schedule: the next save removes it
        self._adopted: set[str] = set()  # checkpoint folders of the earlier runs of this lineage
        self._resumed_from: str | None = None  # the checkpoint the fit resumed from, never removed
        self._newest = ""  # the file that holds the newest state written
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._validated = False  # the latest validation of this fit ran batches (Lightning's val_loop._has_run)
        self._validation_ran = False
        self._saves = 0
        self._warned: set[str] = set()

    # ---- configuration --------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        """Unique per configuration, as Lightning's: two checkpoint callbacks that differ in what or
        when they save keep their bookkeeping apart."""
        filename = self.filename if self.filename is not None else "epoch={epoch}-step={step}"
        return (f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}, every_n_train_steps="
                f"{self.every_n_train_steps or None!r}, every_n_epochs={self.every_n_epochs!r}, train_time_interval="
                f"{self.train_time_interval!r}, filename={filename!r}}}")

    def _check_filename(self, filename: str | None) -> None:
        """Refuse, at once, a ``filename`` that could not make a checkpoint name inside ``dirpath``."""
        if filename is None:
            return
        if not isinstance(filename, str) or not filename.strip():
            raise ValueError(f"ModelCheckpoint(filename={filename!r}) must be a non-empty string.")
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(filename) if field is not None]
            sample = self._format_name(filename, {field: 0 for field in fields}, warn=False)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise ValueError(f"ModelCheckpoint(filename={filename!r}) is not a format string it can fill: {err}. "
                             "Use fields such as '{epoch}-{val_loss:.2f}'.") from None
        if "" in fields:
            raise ValueError(f"ModelCheckpoint(filename={filename!r}) has an empty field '{{}}': name a metric in "
                             "it, e.g. '{epoch}'.")
        parts = sample.replace("\\", "/").split("/")
        if os.path.isabs(filename) or ".." in parts:
            raise ValueError(f"ModelCheckpoint(filename={filename!r}) would write outside dirpath; give the folder "
                             "as dirpath= and a name as filename=.")
        if not parts[-1] or parts[-1].startswith("."):
            raise ValueError(f"ModelCheckpoint(filename={filename!r}) makes names like {sample!r}: a checkpoint name "
                             "must not be empty or start with '.' (xtrainer's temporary files do).")
        if sample == self.CHECKPOINT_NAME_LAST:
            raise ValueError(f"ModelCheckpoint(filename={filename!r}) is the name of the last checkpoint "
                             f"({self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}); choose another.")

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "best_model_score": self.best_model_score,
                "best_model_path": self.best_model_path, "current_score": self.current_score,
                "dirpath": self.dirpath, "best_k_models": dict(self.best_k_models),
                "kth_best_model_path": self.kth_best_model_path, "kth_value": self.kth_value,
                "last_model_path": self.last_model_path, "kept_newest": list(self._kept),
                "last_target": self._last_target, "interrupted": self._interrupted}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_dir = state_dict.get("dirpath")
        best = state_dict.get("best_model_path", "")
        self.best_model_path = best if isinstance(best, str) else ""
        moved = self.dirpath is not None and (not isinstance(saved_dir, str)
                                              or os.path.realpath(saved_dir) != os.path.realpath(self.dirpath))
        if moved and self._same_lineage(saved_dir):
            # The same run, restarted into the next version folder (a restart after a preemption):
            # its files stay this callback's to prune, so save_top_k bounds the lineage's disk use.
            self._adopted.add(fs.normalize(saved_dir))
            moved = False
        if moved:
            # Resumed into another folder: the files listed belong to the earlier run, which this
            # run must not prune. Only where its best checkpoint was comes back, as in Lightning.
            if isinstance(saved_dir, str):
                rank_zero_warn(f"ModelCheckpoint: the dirpath has changed from {saved_dir!r} to {self.dirpath!r}, so "
                               "only best_model_path is restored; the earlier folder's files are left alone.")
            return
        self.dirpath = self.dirpath or saved_dir  # as the replicas chose it
        self.best_k_models = {path: score_tensor(_as_float(score))
                              for path, score in _items(state_dict.get("best_k_models"))
                              if self._owns(path) and _as_float(score) is not None}
        self._kept = [path for path in state_dict.get("kept_newest") or [] if self._owns(path)]
        if self.monitor is None:  # no ranking: the newest are kept (older checkpoints listed them by step)
            if "kept_newest" not in state_dict:
                self._kept = sorted(self.best_k_models, key=lambda path: float(self.best_k_models[path]))
            self.best_k_models = {}
        target = state_dict.get("last_target", "")
        self._last_target = target if self._owns(target) else ""
        interrupted = state_dict.get("interrupted", "")
        self._interrupted = interrupted if self._owns(interrupted) else ""
        last = state_dict.get("last_model_path", "")
        self.last_model_path = last if self._owns(last) else ""
        score = _as_float(state_dict.get("best_model_score"))
        self.best_model_score = score_tensor(score) if score is not None and self.monitor is not None else None
        current = _as_float(state_dict.get("current_score"))
        self.current_score = score_tensor(current) if current is not None else None
        self._update_kth()

    def on_load_checkpoint(self, trainer: "TrainerView", module: "XModule", checkpoint: dict[str, Any]) -> None:
        """Say so when the checkpoint holds the bookkeeping of a checkpoint callback configured
        otherwise (another monitor, say) for this folder: this one starts afresh and leaves those
        files alone."""
        states = checkpoint.get("callbacks") or {}
        if not isinstance(states, dict) or self.state_key in states:
            return
        others = [key for key, state in states.items()
                  if isinstance(key, str) and key.startswith("ModelCheckpoint{") and isinstance(state, dict)
                  and isinstance(state.get("dirpath"), str) and self.dirpath is not None
                  and os.path.realpath(state["dirpath"]) == os.path.realpath(self.dirpath)]
        if others:
            rank_zero_warn(f"ModelCheckpoint: the checkpoint holds the bookkeeping of {others[0]} for {self.dirpath}, "
                           f"not of this one ({self.state_key}), so this one starts with no best checkpoints; the "
                           "files the other one kept are left alone.")

    # ---- hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = default_dirpath(trainer.log_dir)
        self._last_save_time = time.monotonic()
        if stage != "fit":
            return
        self._validated = self._validation_ran = False
        self._saves = 0
        self._warned = set()
        if trainer.is_global_zero:
            folders.remove_leftovers(self.dirpath)  # of saves that a crash interrupted
            if self._given_dirpath and trainer.ckpt_path is None and self._foreign_checkpoints():
                also = (" gets a -v1 suffix instead of replacing it" if self.enable_version_counter
                        else " replaces it (enable_version_counter=False)")
                rank_zero_warn(f"ModelCheckpoint: {self.dirpath} already holds checkpoints of another run; a "
                               f"checkpoint of this run with the same name{also}, and last.ckpt is replaced. Give each "
                               "run its own dirpath (the default, <run folder>/checkpoints, is).")

    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None:
        # The checkpoint the fit resumed from is never removed, as in Lightning; one reached
        # through ckpt_path="last" (last.ckpt: a link to it here, a file of its own in Lightning)
        # is pruned as before, so that a restart loop's disk use stays bounded by save_top_k.
        named = trainer.ckpt_path if trainer.state == "fit" and trainer.run.resumed_by_path else None
        self._resumed_from = fs.normalize(named) if named else None
        self._last_save_time = time.monotonic()

    def on_validation_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if trainer.state == "fit" and not _sanity_checking(trainer):
            self._validated = False

    def on_validation_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.state == "fit" and not _sanity_checking(trainer):
            self._validated = self._validation_ran = True

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._should_skip(trainer):
            return
        n, interval = self.every_n_train_steps, self.train_time_interval
        if (n >= 1 and trainer.global_step % n == 0) or (interval is not None and self._time_is_up(trainer, interval)):
            if self.monitor is not None:  # every replica saves here: a value logged with sync_dist, reduced
                trainer.run.publisher.preview_synced(trainer)
            self._save(trainer, topk=True)

    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if not self._should_skip(trainer) and self._on_train_epoch_end(trainer):
            self._save(trainer, topk=self._epoch_due(trainer))

    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if not self._should_skip(trainer) and not self._on_train_epoch_end(trainer):
            self._save(trainer, topk=self._epoch_due(trainer))

    def on_train_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if (self._saves == 0 and trainer.global_step > 0 and not _sanity_checking(trainer)
                and not getattr(trainer, "fast_dev_run", False)
                and not self._on_train_epoch_end(trainer) and not self._validation_ran
                and (self.every_n_epochs or self.save_last)):
            rank_zero_warn("ModelCheckpoint saved nothing: it saves after validation here (check_val_every_n_epoch="
                           f"{trainer.check_val_every_n_epoch}, val_check_interval={trainer.val_check_interval}), and "
                           "no validation ran. Pass save_on_train_epoch_end=True to save at the end of training "
                           "epochs.")

    def on_exception(self, trainer: "TrainerView", module: "XModule", exception: BaseException) -> None:
        """``save_on_exception``: a checkpoint of the fit as it stands when ``exception`` ended it."""
        if not self.save_on_exception or trainer.interrupted or trainer.state != "fit" \
                or _sanity_checking(trainer) or getattr(trainer, "fast_dev_run", False):
            return  # a signal's stop writes its own checkpoint
        if trainer.world_size > 1:
            rank_zero_warn(f"ModelCheckpoint(save_on_exception=True) saved nothing after the {type(exception).__name__}: "
                           "with several replicas a save is collective, and the replicas are stopping.")
            return
        path = self.save_now(trainer)
        if path:
            rank_zero_info(f"An {type(exception).__name__} was raised with message: {exception}; saved checkpoint to "
                           f"{path}")

    def _should_skip(self, trainer: "TrainerView") -> bool:
        return (trainer.state != "fit" or _sanity_checking(trainer) or bool(getattr(trainer, "fast_dev_run", False))
                or trainer.global_step == (self._last_saved_step if self._last_saved_step is not None else 0))

    def _epoch_due(self, trainer: "TrainerView") -> bool:
        return self.every_n_epochs >= 1 and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _on_train_epoch_end(self, trainer: "TrainerView") -> bool:
        """Whether this fit saves at the end of training epochs (else after validation), as
        Lightning decides it."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch not in (1, None):
            return False  # validation comes only every few epochs: save when it has run
        batches = getattr(trainer, "num_val_batches", None)
        has_validation = sum(batches) > 0 if isinstance(batches, (list, tuple)) else self._validation_ran
        if not has_validation:
            return True
        interval = trainer.val_check_interval
        return isinstance(interval, float) and interval == 1.0

    def _time_is_up(self, trainer: "TrainerView", interval: float) -> bool:
        # Replicas must agree (a save is collective): rank 0's clock decides for all of them.
        due = time.monotonic() - self._last_save_time >= interval
        return bool(trainer.strategy.collectives.broadcast(due)) if trainer.world_size > 1 else due

    def save_now(self, trainer: "TrainerView") -> str | None:
        """Write a complete checkpoint now, whatever the schedule (a graceful stop on a signal does);
        the path of the newest checkpoint, or None if none could be written (non-finite loss)."""
        if trainer.global_step == self._last_saved_step:
            return self._newest or None
        # Never ranked by a monitored value: that was measured on other weights than these. (Without
        # a monitor the newest are kept, and this one is the newest.)
        return self._save(trainer, topk=self.monitor is None, force=True)

    # ---- saving ---------------------------------------------------------------------------------
    def _save(self, trainer: "TrainerView", topk: bool, force: bool = False) -> str | None:
        plan = self._plan(trainer, topk, force)
        if trainer.world_size > 1:
            plan = trainer.strategy.collectives.broadcast(plan)  # rank 0 decides: a save is collective
        return self._apply(trainer, plan, force)

    def _plan(self, trainer: "TrainerView", topk: bool, force: bool) -> dict[str, Any]:
        """What this save does, decided without changing anything (rank 0's plan is the one
        applied on every replica): the file to write, the new bookkeeping, the files to remove."""
        metrics = self._monitor_candidates(trainer)
        best_k = {path: float(score) for path, score in self.best_k_models.items()}
        kept = list(self._kept)
        best_path = self.best_model_path
        best_score = float(self.best_model_score) if self.best_model_score is not None else None
        current = float(self.current_score) if self.current_score is not None else None
        plan: dict[str, Any] = {"error": None, "warn": [], "info": [], "write": None, "link": None, "remove": []}
        epoch, step, k = metrics["epoch"], metrics["step"], self.save_top_k
        written = None
        try:
            if topk and k != 0:
                if self.monitor is None:
                    evict = [] if k == -1 else kept[:max(0, len(kept) - k + 1)]
                    written = self._unique_path(trainer, metrics, best_path if k == -1 else (evict or [None])[0])
                    kept = [] if k == -1 else [p for p in kept if p not in evict and p != written] + [written]
                    best_path = written
                    plan["remove"] += evict
                    plan["info"].append(f"Epoch {epoch}, global step {step}: saving model to {written!r}")
                elif self.monitor not in metrics:
                    message = (f"ModelCheckpoint(monitor={self.monitor!r}) found no such logged metric. Logged: "
                               f"{sorted(metrics)}. Log it with self.log({self.monitor!r}, ...), or monitor one of "
                               "these.")
                    if self._validated and not force:
                        plan["error"] = ("metric", message + " (A validation has run and did not log it.)")
                        return plan
                    if not force:
                        plan["warn"].append(message + " No top-k checkpoint is saved until it is logged (a "
                                            "validation metric appears after the first validation).")
                else:
                    value = metrics[self.monitor]
                    if self._qualifies(value, best_k):
                        size = len(best_k) + 1 if k == -1 else k
                        evicted = []
                        while len(best_k) >= size:  # more than one if save_top_k was lowered on a resume
                            evicted.append(self._kth(best_k))
                            best_k.pop(evicted[-1])
                        score = self._ranking.worst if math.isnan(value) else value  # NaN: the worst, as Lightning
                        written = self._unique_path(trainer, metrics, evicted[0] if evicted else None)
                        best_k[written] = score
                        current = score
                        best_path = self._best(best_k)
                        best_score = best_k[best_path]
                        plan["remove"] += evicted
                        plan["info"].append(f"Epoch {epoch}, global step {step}: {self.monitor!r} reached {value:0.5f} "
                                            f"(best {best_score:0.5f}), saving model to {written!r} as top {size}")
                    else:
                        plan["info"].append(f"Epoch {epoch}, global step {step}: {self.monitor!r} was not in top {k}")
            last_path, last_target, link = self.last_model_path, self._last_target, None
            write = written
            if self.save_last:
                last_path = self._path(self._format_name(self.CHECKPOINT_NAME_LAST, metrics))
                if written is not None:
                    link, last_target = written, ""
                elif self.save_last == "link" and k != 0:
                    write = last_target = self._unique_path(trainer, metrics, self._last_target or None)
                    link = write
                else:
                    write, last_target = last_path, ""
                if written is None:
                    plan["info"].append(f"Epoch {epoch}, global step {step}: saving the last checkpoint to "
                                        f"{write!r}")
                plan["remove"] += [self.last_model_path, self._last_target]
            interrupted = ""
            if write is None and force:  # a stop on a signal: a checkpoint to resume from, whatever else
                write = interrupted = self._unique_path(trainer, metrics, None)
            plan["remove"].append(self._interrupted)  # the previous one: this save supersedes it
        except ValueError as err:
            plan["error"] = ("value", str(err))
            return plan
        keep = set(best_k) | set(kept) | {write, last_path, last_target, best_path}
        resumed = self._resumed_from  # stays, even once out of the top k (on_train_start)
        plan["remove"] = list(dict.fromkeys(p for p in plan["remove"] if p and p not in keep
                                            and (resumed is None or fs.normalize(p) != resumed)))
        plan.update(write=write, link=link, last=last_path if self.save_last else self.last_model_path,
                    state={"best_k_models": best_k, "kept": kept, "best_model_path": best_path,
                           "best_model_score": best_score if self.monitor is not None else None,
                           "current_score": current, "last_target": last_target, "interrupted": interrupted})
        return plan

    def _apply(self, trainer: "TrainerView", plan: dict[str, Any], force: bool) -> str | None:
        if plan["error"]:
            kind, message = plan["error"]
            raise (MetricNotFoundError if kind == "metric" else ValueError)(message)
        for message in plan["warn"]:
            if message not in self._warned:
                self._warned.add(message)
                rank_zero_warn(message)
        write = plan["write"]
        if write is None:
            self._say(trainer, plan["info"])
            return None
        bad = trainer.nonfinite_step()
        if bad is not None:
            self._last_saved_step = trainer.global_step
            newest = self._newest
            if newest and os.path.islink(newest):
                newest = f"{os.path.realpath(newest)} ({os.path.basename(newest)} links to it)"
            kept = f"The newest good checkpoint stays {newest}." if newest else "No checkpoint was written before it."
            rank_zero_warn(f"ModelCheckpoint: no checkpoint at step {trainer.global_step}: the training loss became "
                           f"NaN or infinite at step {bad}. {kept}")
            return None
        # The bookkeeping is updated before the write, so that the checkpoint carries it.
        state = plan["state"]
        self.best_k_models = {path: score_tensor(score) for path, score in state["best_k_models"].items()}
        self._kept, self._last_target = list(state["kept"]), state["last_target"]
        self._interrupted = state["interrupted"]
        self.best_model_path = state["best_model_path"]
        score = state["best_model_score"]
        self.best_model_score = score_tensor(score) if score is not None else None
        self.current_score = score_tensor(state["current_score"]) if state["current_score"] is not None else None
        self.last_model_path = plan["last"] or ""
        self._update_kth()
        self._write(trainer, write, weights_only=self.save_weights_only and not force)
        if plan["link"] is not None:
            self._link(trainer, plan["last"], plan["link"])
        self._remove(trainer, plan["remove"])
        self._last_saved_step, self._last_save_time = trainer.global_step, time.monotonic()
        self._newest = plan["last"] if plan["link"] is not None or write == plan["last"] else write
        self._saves += 1
        self._say(trainer, plan["info"])
        return self._newest

    def _say(self, trainer: "TrainerView", lines: list[str]) -> None:
        if self.verbose and trainer.is_global_zero:
            for line in lines:
                print(line, flush=True)

    def _write(self, trainer: "TrainerView", path: str, weights_only: bool) -> None:
        if trainer.is_global_zero and getattr(trainer.strategy.checkpoint_layout, "kind", "file") != "file":
            folders.make_room_for_folder(path)
        trainer.save_checkpoint(path, weights_only=weights_only)

    def _link(self, trainer: "TrainerView", last: str, target: str) -> None:
        """Point ``last`` at ``target`` (a complete checkpoint); every replica waits for it."""
        if trainer.is_global_zero:
            folders.point_last(last, target)
        trainer.strategy.collectives.barrier("xtrainer_checkpoint_link")

    def _remove(self, trainer: "TrainerView", paths: list[str]) -> None:
        if trainer.is_global_zero:
            for path in paths:
                if self._owns(path):
                    folders.remove_checkpoint(path, top=self.dirpath)
        trainer.strategy.collectives.barrier("xtrainer_checkpoint_cleanup")

    # ---- ranking ------------------------------------------------------------------------------
    def check_monitor_top_k(self, trainer: "TrainerView", current: Any = None) -> bool:
        """Whether a checkpoint scoring ``current`` would be kept among the top k now."""
        del trainer
        if current is None:
            return False
        return self._qualifies(float(current), {p: float(s) for p, s in self.best_k_models.items()})

    def _qualifies(self, value: float, best_k: dict[str, float]) -> bool:
        if self.save_top_k == -1 or len(best_k) < self.save_top_k:
            return True
        kth = best_k[self._kth(best_k)]
        return value < kth if self.mode == "min" else value > kth  # a tie or a NaN does not enter

    def _kth(self, best_k: dict[str, float]) -> str:
        """The worst kept (the first of equals), as Lightning's ``max``/``min`` over the dict picks it."""
        return (max if self.mode == "min" else min)(best_k, key=best_k.__getitem__)

    def _best(self, best_k: dict[str, float]) -> str:
        return (min if self.mode == "min" else max)(best_k, key=best_k.__getitem__)

    def _update_kth(self) -> None:
        scores = {p: float(s) for p, s in self.best_k_models.items()}
        # save_top_k=-1 keeps every checkpoint: the kth is the worst of them, as in Lightning
        if scores and (self.save_top_k == -1 or 0 < self.save_top_k <= len(scores)):
            self.kth_best_model_path = self._kth(scores)
            self.kth_value = score_tensor(scores[self.kth_best_model_path])
        else:
            self.kth_best_model_path, self.kth_value = "", score_tensor(self._ranking.worst)

    # ---- names --------------------------------------------------------------------------------
    def _monitor_candidates(self, trainer: "TrainerView") -> dict[str, Any]:
        """The logged metrics (floats), with ``epoch`` and ``step`` as ints."""
        metrics: dict[str, Any] = {}
        for name, value in trainer.callback_metrics.items():
            try:
                metrics[name] = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue  # not a number: it cannot rank or name a checkpoint
        for name, fallback in (("epoch", trainer.current_epoch), ("step", trainer.global_step)):
            value = metrics.get(name)
            metrics[name] = int(value) if value is not None and math.isfinite(value) else fallback
        return metrics

    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None,
                               ver: int | None = None) -> str:
        """The checkpoint path ``filename`` (default: this callback's) gives for ``metrics``, as
        Lightning's: ``format_checkpoint_name({"epoch": 2, "val_loss": 0.1234})`` with
        ``filename="{epoch}-{val_loss:.2f}"`` is ``<dirpath>/epoch=2-val_loss=0.12.ckpt``."""
        metrics = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        name = self._format_name(filename or self.filename, metrics, warn=False)
        if ver is not None:
            name = f"{name}{self.CHECKPOINT_JOIN_CHAR}v{ver}"
        return self._path(name, check=False)

    def _format_name(self, template: str | None, metrics: dict[str, Any], warn: bool = True) -> str:
        if not template:
            template = "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"
        out = []
        for literal, field, spec, conversion in string.Formatter().parse(template):
            out.append(literal)
            if field is None:
                continue
            value = self._lookup(template, field, metrics, warn)
            if conversion:
                value = {"r": repr, "s": str, "a": ascii}[conversion](value)
            try:
                text = format(value, spec or "")
            except (ValueError, TypeError) as err:
                raise ValueError(f"ModelCheckpoint(filename={template!r}): {{{field}:{spec}}} cannot format "
                                 f"{value!r} ({err}).") from None
            out.append(f"{field}{self.CHECKPOINT_EQUALS_CHAR}{text}" if self.auto_insert_metric_name else text)
        return "".join(out)

    def _lookup(self, template: str, field: str, metrics: dict[str, Any], warn: bool) -> Any:
        if field in metrics:
            return metrics[field]
        slashed = [name for name in metrics if name.replace("/", "_") == field]
        if slashed:
            return metrics[slashed[0]]
        message = (f"ModelCheckpoint: the name {template!r} has a field {field!r}, which was not logged: it reads 0, "
                   f"as in Lightning. Logged: {sorted(metrics)}.")
        if warn and message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message)
        return 0

    def _path(self, name: str, check: bool = True) -> str:
        path = name + self.FILE_EXTENSION
        if not self.dirpath:
            return path
        path = fs.normpath(fs.join(self.dirpath, path))
        if check and not self._inside(path):
            raise ValueError(f"ModelCheckpoint: the checkpoint name {name!r} leads outside {self.dirpath}; a logged "
                             "metric in filename= must not make '..' or an absolute path.")
        return path

    def _unique_path(self, trainer: "TrainerView", metrics: dict[str, Any], replaceable: str | None) -> str:
        """The formatted path, with ``-vN`` while a file of that name exists (other than
        ``replaceable``, which this save may overwrite), as Lightning's version counter."""
        name = self._format_name(self.filename, metrics)
        path = self._path(name)
        if not self.enable_version_counter:
            return path
        version = self.STARTING_VERSION
        while path != replaceable and self.file_exists(path, trainer, broadcast=False):
            path = self._path(f"{name}{self.CHECKPOINT_JOIN_CHAR}v{version}")
            version += 1
        return path

    def file_exists(self, filepath: str | os.PathLike, trainer: "TrainerView", broadcast: bool = True) -> bool:
        """Whether ``filepath`` exists on rank 0 (told to every replica)."""
        exists = fs.lexists(os.fspath(filepath))
        return bool(trainer.strategy.collectives.broadcast(exists)) if broadcast and trainer.world_size > 1 else exists

    def _inside(self, path: str, folder: str | None = None) -> bool:
        return fs.inside(path, folder or self.dirpath)

    def _owns(self, path: Any) -> bool:
        """Whether ``path`` is a checkpoint inside this callback's folder (or an earlier run's of
        its lineage that it took over): only those are ever removed (the bookkeeping comes from
        checkpoint files, which are data, not orders)."""
        return (isinstance(path, str) and bool(path) and self.dirpath is not None
                and path.endswith(self.FILE_EXTENSION) and not os.path.basename(path).startswith(".")
                and any(self._inside(path, folder) for folder in (self.dirpath, *self._adopted)))

    def _same_lineage(self, saved_dir: Any) -> bool:
        """Whether ``saved_dir`` is the default checkpoint folder of another ``version_*`` run
        beside this one's (``<root>/version_N/checkpoints``): the run this one restarted."""
        if not isinstance(saved_dir, str) or self._given_dirpath or self.dirpath is None:
            return False
        mine, saved = fs.normalize(self.dirpath), fs.normalize(saved_dir)
        return (fs.basename(saved) == fs.basename(mine) == "checkpoints"
                and fs.basename(fs.dirname(saved)).startswith("version_")
                and fs.dirname(fs.dirname(saved)) == fs.dirname(fs.dirname(mine)))

    def _foreign_checkpoints(self) -> bool:
        known = set(self.best_k_models) | set(self._kept) | {self.last_model_path, self._last_target,
                                                              self.best_model_path, self._interrupted}
        known |= {fs.join(self.dirpath, storage.LAST)}
        return fs.isdir(self.dirpath) and any(
            name.endswith(self.FILE_EXTENSION) and not name.startswith(".")
            and fs.join(self.dirpath, name) not in known
            for name in fs.listdir(self.dirpath))

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write ``best_k_models`` as ``{path: score}`` to a YAML file (default
        ``<dirpath>/best_k_models.yaml``), as Lightning's."""
        import yaml

        filepath = os.fspath(filepath) if filepath is not None else os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as f:
            yaml.dump({path: float(score) for path, score in self.best_k_models.items()}, f)


def _sanity_checking(trainer: "TrainerView") -> bool:
    return bool(getattr(trainer, "sanity_checking", False))


def _as_float(value: Any) -> float | None:
    """A saved score as a float (a tensor, a number), or None for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, dict) else []
