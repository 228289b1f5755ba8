"""Lightning's other callback names, with their constructor arguments, so that a Lightning
script or a LightningCLI configuration that lists them runs unchanged: each is a working callback
here, or a thin alias of xtrainer's own (the docstring says which arguments change nothing)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from lightning_utilities.core.rank_zero import rank_zero_info

from xtrainer.callbacks.base import CALLBACK_HOOKS, Callback
from xtrainer.callbacks.health import XlaHealth
from xtrainer.callbacks.progress import ProgressBar
from xtrainer.config.settings import seconds
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class ModelSummary(Callback):
    """Prints the module's summary (Lightning's table) on rank 0 when a fit starts, to
    ``max_depth`` levels of submodules. The Trainer adds one (``max_depth=1``) where
    ``enable_model_summary`` is set and none is given, as Lightning does."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        self.max_depth, self.summarize_kwargs = max_depth, summarize_kwargs

    def on_fit_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if self.max_depth == 0 or not trainer.is_global_zero:
            return
        from xtrainer.summary import summarize

        print(summarize(module, max_depth=self.max_depth, world_size=trainer.world_size,
                        sharded=trainer.strategy.shards_parameters), flush=True)


class RichModelSummary(ModelSummary):
    """``ModelSummary`` (Lightning's rich-formatted one; ``summarize_kwargs`` such as a theme
    change nothing: the table is plain text)."""


class TQDMProgressBar(ProgressBar):
    """xtrainer's ``ProgressBar`` (plain lines, rich bar on a terminal). ``refresh_rate``,
    ``process_position`` and ``leave`` change nothing: the bar is redrawn when the Trainer reads
    logged values (every ``log_every_n_steps``), which costs no host sync."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__()
        self.refresh_rate, self.process_position, self.leave = refresh_rate, process_position, leave


class RichProgressBar(ProgressBar):
    """xtrainer's ``ProgressBar`` with ``rich`` (on a terminal). ``refresh_rate``, ``leave``,
    ``theme`` and ``console_kwargs`` change nothing (see ``TQDMProgressBar``)."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme: Any = None,
                 console_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.refresh_rate, self.leave, self.theme, self.console_kwargs = refresh_rate, leave, theme, console_kwargs


class DeviceStatsMonitor(XlaHealth):
    """``XlaHealth``: compilations, executions, transfers and device memory, logged per
    interval. ``cpu_stats`` changes nothing."""

    def __init__(self, cpu_stats: bool | None = None) -> None:
        super().__init__()
        self.cpu_stats = cpu_stats


class Timer(Callback):
    """Stops the fit once ``duration`` has passed (``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of
    its fields), checked with the host clock after each training batch (``interval="step"``) or
    each training epoch (``"epoch"``); replicas stop together at the next logging step, as for any
    ``should_stop``. ``time_elapsed(stage)``, ``time_remaining(stage)``, ``start_time(stage)`` and
    ``end_time(stage)`` are Lightning's (seconds; stage ``"train"``, ``"validate"``, ``"test"``,
    ``"predict"``)."""

    def __init__(self, duration: str | timedelta | dict[str, int] | None = None, interval: str = "step",
                 verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer(interval={interval!r}): use 'step' or 'epoch'.")
        self._duration = seconds(duration)
        self._interval, self._verbose = interval, verbose
        self._start: dict[str, float | None] = {}
        self._end: dict[str, float | None] = {}
        self._offset = 0.0  # training time of the run this one resumed

    def start_time(self, stage: str = "train") -> float | None:
        return self._start.get(stage)

    def end_time(self, stage: str = "train") -> float | None:
        return self._end.get(stage)

    def time_elapsed(self, stage: str = "train") -> float:
        start, end = self._start.get(stage), self._end.get(stage)
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + ((end if end is not None else time.monotonic()) - start)

    def time_remaining(self, stage: str = "train") -> float | None:
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    def _begin(self, stage: str) -> None:
        self._start[stage], self._end[stage] = time.monotonic(), None

    def _finish(self, stage: str) -> None:
        self._end[stage] = time.monotonic()

    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._begin("train")

    def on_train_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._finish("train")

    def on_validation_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._begin("validate")

    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._finish("validate")

    def on_test_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._begin("test")

    def on_test_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._finish("test")

    def on_predict_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._begin("predict")

    def on_predict_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._finish("predict")

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._interval == "step":
            self._check(trainer)

    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._interval == "epoch":
            self._check(trainer)

    def _check(self, trainer: "TrainerView") -> None:
        if self._duration is None or trainer.should_stop or self.time_elapsed("train") < self._duration:
            return
        trainer.should_stop = True  # host clock only; the replicas agree at the next logging step
        if self._verbose:
            rank_zero_info(f"Timer: {timedelta(seconds=round(self._duration))} of training have passed; stopping.")

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {"train": self.time_elapsed("train")}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = float(state_dict.get("time_elapsed", {}).get("train", 0.0))
        self._start.pop("train", None)


class LambdaCallback(Callback):
    """A callback from functions: ``LambdaCallback(on_train_epoch_end=fn)``; each hook gets the
    arguments of the ``Callback`` method of its name."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        unknown = sorted(set(hooks) - CALLBACK_HOOKS)
        if unknown:
            raise TypeError(f"LambdaCallback got unknown hooks {unknown}; hook names are Callback's "
                            f"(e.g. on_train_epoch_end).")
        for name, fn in hooks.items():
            setattr(self, name, fn)


class GradientAccumulationScheduler(Callback):
    """Lightning's schedule of ``accumulate_grad_batches`` by epoch: ``{0: 8, 4: 4, 8: 1}``
    accumulates 8 batches from epoch 0, 4 from epoch 4, 1 from epoch 8. (A new value compiles
    the step once more.)"""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling or any(not isinstance(k, int) or k < 0 or not isinstance(v, int) or v < 1
                                 for k, v in scheduling.items()):
            raise ValueError(f"GradientAccumulationScheduler(scheduling={scheduling!r}): give {{epoch: batches}} with "
                             "epochs >= 0 and batches >= 1.")
        self.scheduling = dict(sorted(scheduling.items()))
        if 0 not in self.scheduling:
            self.scheduling = {0: 1, **self.scheduling}

    def going_to_accumulate_grad_batches(self, epoch: int) -> int:
        return next(v for k, v in reversed(self.scheduling.items()) if k <= epoch)

    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if not module.automatic_optimization:
            raise RuntimeError("GradientAccumulationScheduler needs automatic optimization; under manual optimization "
                               "step the optimizers every N batches in training_step instead.")

    def on_train_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None:
        trainer.accumulate_grad_batches = self.going_to_accumulate_grad_batches(trainer.current_epoch)


class BasePredictionWriter(Callback):
    """Lightning's prediction writer: override ``write_on_batch_end`` (``write_interval="batch"``),
    ``write_on_epoch_end`` (``"epoch"``) or both (``"batch_and_epoch"``). Every replica writes its
    own share. ``write_on_epoch_end`` gets the predictions as ``trainer.predict`` returns them:
    a list of the batches' predictions, or one such list per dataloader when there are several.
    ``batch_indices`` are the dataset indices of the batch's samples, as its sampler drew them
    (with several replicas, this replica's share); ``write_on_epoch_end`` gets one list of them
    per batch, in one list per dataloader even when there is one, as in Lightning. They are
    empty (``[]``) for a loader with no batch sampler to draw them: an iterable dataset, a
    ``DataLoader`` subclass, or another iterable."""

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in ("batch", "epoch", "batch_and_epoch"):
            raise ValueError(f"write_interval={write_interval!r}: use 'batch', 'epoch' or 'batch_and_epoch'.")
        self.interval = write_interval
        self._predictions: list[list[Any]] = []  # per dataloader

    def write_on_batch_end(self, trainer: "TrainerView", pl_module: "XModule", prediction: Any, batch_indices: Any,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} asks to write each batch: define write_on_batch_end.")

    def write_on_epoch_end(self, trainer: "TrainerView", pl_module: "XModule", predictions: list[Any],
                           batch_indices: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} asks to write each epoch: define write_on_epoch_end.")

    def on_predict_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._predictions = []

    def on_predict_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.interval in ("batch", "batch_and_epoch"):
            noted = trainer.run.predict_batch_indices
            indices = noted[dataloader_idx][batch_idx] if dataloader_idx < len(noted) and noted[dataloader_idx] else []
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)
        if self.interval in ("epoch", "batch_and_epoch"):
            while len(self._predictions) <= dataloader_idx:
                self._predictions.append([])
            self._predictions[dataloader_idx].append(outputs)

    def on_predict_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self.interval in ("epoch", "batch_and_epoch"):
            loaders = max(len(trainer.num_predict_batches), len(self._predictions), 1)
            predictions = self._predictions + [[] for _ in range(loaders - len(self._predictions))]
            noted = trainer.run.predict_batch_indices
            indices = [list(noted[i]) if i < len(noted) else [] for i in range(loaders)]
            self.write_on_epoch_end(trainer, module, predictions[0] if loaders == 1 else predictions, indices)
            self._predictions = []


#: Lightning callbacks with no counterpart here, and what to do instead.
MISSING = {
    "StochasticWeightAveraging": ("use WeightAveraging (Lightning 2.6's successor; its default average is SWA's), or keep "
                                  "an averaged copy with torch.optim.swa_utils.AveragedModel in your module"),
    "ModelPruning": "prune with torch.nn.utils.prune in configure_model or a callback of your own",
    "BatchSizeFinder": "choose the batch size yourself: every new batch size compiles new graphs on XLA",
    "LearningRateFinder": "run xtrainer.tuner.Tuner(trainer).lr_find(model) before fit",
    "OnExceptionCheckpoint": "a signal (SIGTERM/SIGINT) already writes a checkpoint before the fit stops",
    "ThroughputMonitor": "XlaHealth logs throughput/steps_per_second and throughput/samples_per_second",
    "SpikeDetection": "detect_nonfinite='raise' stops at a NaN or infinite loss",
}
