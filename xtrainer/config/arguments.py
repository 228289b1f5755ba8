"""The ``Trainer``'s arguments turned into what it runs with: Lightning's modes applied
(``barebones``, ``fast_dev_run``, ``overfit_batches``), the default callbacks added, the
settings XLA changes noted once, devices and ``max_time`` resolved. Values themselves are checked
by ``TrainerSettings.check`` (``settings.py``)."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn

from xtrainer.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, XlaHealth
from xtrainer.callbacks.base import CALLBACK_HOOKS, Callback, check_hook_names
from xtrainer.config.settings import TrainerSettings, seconds  # noqa: F401  (the Trainer reads arguments.seconds)
from xtrainer.goodput import Goodput
from xtrainer.launch.watchdog import HangWatchdog
from xtrainer.loggers.base import DummyLogger


def resolve(values: dict[str, Any], callbacks: Any, logger: Any, plugins: Any, model_registry: Any
            ) -> tuple[TrainerSettings, list[Callback], Any]:
    """Checked settings with Lightning's modes applied, the callbacks as a list, and the logger
    (``False`` where a mode turns logging off)."""
    if model_registry is not None:
        raise ValueError("model_registry=...: Lightning's model registry upload has no counterpart here; "
                         "checkpoints are written under the run folder (or a ModelCheckpoint's dirpath).")
    if plugins is not None:
        raise ValueError("plugins=...: Lightning's plugins (precision, checkpoint IO) have no counterpart here, but "
                         "its cluster environment (xtrainer.plugins.environments.SLURMEnvironment); precision= and the "
                         "strategy's arguments cover the rest.")
    settings = TrainerSettings(**values).check()  # the strategy checks the accelerator (Strategy.configure)
    callbacks = as_list(callbacks)
    if settings.barebones:  # Lightning's meaning: nothing that costs time beyond the loop itself
        settings.enable_progress_bar = settings.enable_model_summary = settings.enable_checkpointing = False
        settings.enable_xla_health, settings.num_sanity_val_steps, logger = False, 0, False
        settings.enable_goodput, settings.hang_timeout = False, None
    if settings.fast_dev_run:  # Lightning's meaning: n batches of every loop, nothing written
        n = 1 if settings.fast_dev_run is True else settings.fast_dev_run
        settings.limit_train_batches = settings.limit_val_batches = n
        settings.limit_test_batches = settings.limit_predict_batches = n
        settings.max_steps, settings.max_epochs, settings.num_sanity_val_steps = n, 1, 0
        settings.val_check_interval, settings.check_val_every_n_epoch = 1.0, 1
        settings.enable_goodput, settings.hang_timeout = False, None  # no goodput.json, no hang reports
        # Lightning's: where the run has loggers (None and False mean none here), one that writes nothing
        logger = DummyLogger() if logger not in (None, False) and as_list(logger) else False
        # As in Lightning, the checkpoint callbacks stay (trainer.checkpoint_callback is the
        # user's, best_model_path ""); they save nothing under fast_dev_run.
        rank_zero_info(f"xtrainer: fast_dev_run: {n} batch(es) of each loop, 1 epoch; no logs, no checkpoints.")
    if settings.overfit_batches:
        # The same first batches every epoch (no shuffling), for training and validation.
        settings.limit_train_batches = settings.limit_val_batches = settings.overfit_batches
    note_lightning_only(settings)
    return settings, callbacks, logger


def with_defaults(settings: TrainerSettings, given: list[Any]) -> list[Callback]:
    """The callbacks given, checked, with the defaults the settings ask for added."""
    found = list(given)
    for cb in found:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks must be Callback instances, got {type(cb).__name__}.")
        check_hook_names(cb, CALLBACK_HOOKS, Callback)
    has = lambda kind: any(isinstance(cb, kind) for cb in found)  # noqa: E731
    if settings.enable_model_summary and not has(ModelSummary):
        found.append(ModelSummary())  # printed on rank 0 as the fit starts, as Lightning's default one
    if settings.enable_checkpointing and not has(ModelCheckpoint):
        found.append(ModelCheckpoint())
    if not settings.enable_checkpointing and has(ModelCheckpoint):
        raise ValueError("enable_checkpointing=False, but a ModelCheckpoint is among the callbacks.")
    if settings.enable_xla_health and not has(XlaHealth):
        found.append(XlaHealth())
    if settings.enable_goodput and not has(Goodput):
        found.append(Goodput(summary=settings.enable_xla_health))  # printed with the health summary
    if settings.hang_timeout is not None and not has(HangWatchdog):
        found.append(HangWatchdog(settings.hang_timeout, settings.exit_on_hang))
    if settings.enable_progress_bar and not has(ProgressBar):
        found.append(ProgressBar())
    if settings.profiler is not None:
        found.append(profiler_callback(settings.profiler))
    return checkpoints_last(found)


def checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with the checkpoint callbacks moved to the end, each group in its order, as
    Lightning orders them: a checkpoint then holds what the other callbacks did in the same hook."""
    return ([cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
            + [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)])


def with_module_callbacks(callbacks: list[Callback], model: Any) -> list[Callback]:
    """``callbacks`` with the module's ``configure_callbacks()`` added: one of the same type as a
    given one replaces it, and checkpoint callbacks go last, as in Lightning (they see what the
    others did)."""
    extra = as_list(model.configure_callbacks())
    if not extra:
        return callbacks
    for cb in extra:
        if not isinstance(cb, Callback):
            raise TypeError(f"{type(model).__name__}.configure_callbacks() returned a {type(cb).__name__}, "
                            "not a Callback.")
        check_hook_names(cb, CALLBACK_HOOKS, Callback)
    types_ = {type(cb) for cb in extra}
    return checkpoints_last([cb for cb in callbacks if type(cb) not in types_] + extra)


def as_list(items: Any) -> list:
    if items is None:
        return []
    if isinstance(items, (list, tuple)):
        return list(items)
    return [items]


def note_lightning_only(settings: TrainerSettings) -> None:
    """One line for each Lightning setting that XLA changes or makes meaningless."""
    if settings.benchmark is not None:
        rank_zero_info("xtrainer: benchmark= chooses cuDNN algorithms; XLA has no cuDNN, so it is ignored.")
    if settings.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=settings.deterministic == "warn")
        rank_zero_warn("deterministic=True: torch's deterministic algorithms are on for the host's ops; XLA's "
                       "compiled graphs do not read that switch (on one device kind, the same program and seed "
                       "give the same results; xtrainer's resume tests check this bitwise).")
    if settings.sync_batchnorm:
        rank_zero_warn("sync_batchnorm=True: BatchNorm statistics are not synchronised across replicas on XLA here; "
                       "each replica normalises with the statistics of its own share of the batch.")
    if settings.detect_anomaly:
        rank_zero_warn("detect_anomaly=True: autograd's anomaly mode would read every intermediate result back "
                       "from the device; it is not switched on. detect_nonfinite='raise' (the default) stops at a "
                       "NaN or infinite loss without host syncs.")
    if not settings.inference_mode:
        rank_zero_info("xtrainer: inference_mode=False: evaluation runs under torch.no_grad() as always.")


def profiler_callback(profiler: str) -> Callback:
    from xtrainer.callbacks import XlaProfiler

    if profiler not in ("xla", "simple", "advanced", "pytorch"):
        raise ValueError(f"profiler={profiler!r}: use 'xla' (an XLA trace for TensorBoard's profile plugin), or "
                         "pass an XlaProfiler callback.")
    if profiler != "xla":
        rank_zero_warn(f"profiler={profiler!r}: host-side timings mean little on XLA, where the device works "
                       "asynchronously; an XLA trace (XlaProfiler) is taken instead.")
    return XlaProfiler()
