"""The ``Trainer``: owns the loops, leaves the device and the distribution to a strategy."""

from __future__ import annotations

import datetime
import inspect
import math
import os
import signal
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from xtrainer import clusters, goodput
from xtrainer.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from xtrainer.callbacks.base import Callback
from xtrainer.checkpoint import fs
from xtrainer.config import arguments
from xtrainer.config.redaction import redact
from xtrainer.config.settings import TrainerSettings
from xtrainer.datamodule import XDataModule
from xtrainer.launch import interrupts
from xtrainer.loggers import Logger, TensorBoardLogger, claim_run_folder, move_run_folder, run_folder_root
from xtrainer.loggers.run_folder import planned_run_folder
from xtrainer.loop import checkpoints, stages
from xtrainer.loop.checkpoints import seed_everything
from xtrainer.loop.metric_values import MetricValues
from xtrainer.loop.optimizers import SchedulerConfig
from xtrainer.loop.run import Run
from xtrainer.loop.state import LoopState
from xtrainer.module import XModule
from xtrainer.strategies import Strategy, resolve_strategy
from xtrainer.states import TrainerState
from xtrainer.strategies.precision import Precision
from xtrainer.suggest import did_you_mean

__all__ = ["Trainer", "seed_everything"]


def _check_weights_only(weights_only: bool | None) -> None:
    """Lightning's ``weights_only=`` of the entry points: None or True, as every checkpoint is
    read (tensors and plain values; nothing in the file runs); False is refused."""
    if weights_only is False:
        raise ValueError("weights_only=False: xtrainer reads every checkpoint with weights_only=True (tensors and "
                         "plain values only; nothing in the file runs); pass weights_only=True or leave it out.")
    if weights_only not in (None, True):
        raise TypeError(f"weights_only must be None, True or False, got {weights_only!r}.")


def _read_only(name: str, instead: str, lightning: bool = True) -> Callable[[Any, Any], None]:
    """The setter of a read-only Trainer property (``lightning``: one Lightning has read-only): a
    one-line AttributeError saying what to do ``instead``."""

    def refuse(trainer: Any, value: Any) -> None:
        raise AttributeError(f"trainer.{name} is read-only{', as in Lightning' if lightning else ''}: {instead}.")

    return refuse


class _Setting:
    """A Trainer attribute that is its setting of the same name (``trainer.settings``): read from
    it, and a write (a callback's, as Lightning's ``GradientAccumulationScheduler`` does) changes it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return getattr(trainer.settings, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.settings, self.name, value)


class Trainer:
    """Trains an ``XModule`` on a native PyTorch device (CPU, CUDA, TorchTPU, TorchNeuron) or an
    XLA device.

    Args:
        strategy: ``"auto"`` (Lightning's: the accelerator's family, one device or data
            parallel), Lightning's ``"ddp"``/``"fsdp"`` (the accelerator's family's), or one of
            ``xtrainer.strategies.STRATEGIES``: ``"native"``, ``"native_ddp"``, ``"native_fsdp"``,
            ``"xla_native"``, ``"xla_ddp"``, ``"xla_fsdp"``, ``"xla_spmd"``, ``"xla_fsdpv2"``; or a
            ``Strategy`` instance.
        devices: replicas to run: an int, or ``"auto"`` (every local device; 1 on the CPU, and on
            torch_xla's CPU runtime, where ``devices=N`` runs N replicas on N virtual devices).
        max_epochs: stop after this many epochs; -1: no limit. Not given: 1000, or no limit where
            ``max_steps`` or ``max_time`` is set (``trainer.max_epochs`` then reads -1), as in Lightning.
        max_steps: stop after this many optimizer steps (-1: no limit).
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches: batches
            per epoch: a fraction of the loader (float) or a count (int).
        val_check_interval: validate every this fraction of an epoch (float), this many training
            batches (int), or, as in Lightning 2.6, once this much training time has passed since
            the last validation (``"DD:HH:MM:SS"``, a ``datetime.timedelta`` or a dict of its
            fields, such as ``{"minutes": 5}``); with several replicas, after the first logging
            step at which they agree that it has.
        check_val_every_n_epoch: validate in every n-th epoch only (None: in every epoch).
        log_every_n_steps: read logged values back to the host every n optimizer steps.
        accumulate_grad_batches: micro-batches per optimizer step.
        gradient_clip_val, gradient_clip_algorithm: clip the reduced gradients by ``"norm"``
            (global L2 norm) or ``"value"`` before each optimizer step.
        precision: ``"32"`` or ``"bf16"`` (parameters, optimizer state and inputs in bfloat16).
        callbacks: ``Callback`` instances, called before the module's hook of the same name,
            in their order, the checkpoint callbacks last (as in Lightning).
        logger: ``True`` (TensorBoard in the run folder), ``False``, or a ``Logger``.
        default_root_dir: where run folders (``version_N``, or ``<name>/version_N`` for a
            ``TensorBoardLogger(name=...)``) are made; default ``./xtrainer_logs``.
        enable_progress_bar: print progress and ``prog_bar`` values on rank 0.
        enable_checkpointing: add a ``ModelCheckpoint`` (last epoch) if none is given.
        enable_xla_health: add an ``XlaHealth`` callback (compilations, transfers, throughput,
            recompilation warnings) if none is given.
        detect_nonfinite: what to do when the training loss is NaN or infinite: ``"raise"``
            (stop with the global step where it first happened), ``"warn"`` (say so once, go on),
            or ``"off"``. The check runs on the device inside each step and is read with the
            logged values (every ``log_every_n_steps`` and at epoch ends): no extra host sync,
            so training may run up to that many steps past the first bad loss before stopping.
        compilation_cache: keep compiled graphs on disk for restarts (``xtrainer/compile_cache.py``):
            None (on where the runtime can load them: not the XLA CPU runtime; torch.compile's
            cache under the native strategies is on everywhere), True, False or a folder.
        hang_timeout, exit_on_hang: when no training step finishes for ``hang_timeout`` seconds
            (``"auto"``: a multiple of the median step, at least minutes; None: never), write every
            thread's Python stack to the log and the run folder, and with ``exit_on_hang`` end the
            process (exit code 75, or SIGKILL where it cannot run Python) so that a restart loop
            goes on (``xtrainer/launch/watchdog.py``).
        enable_goodput: account wall time (compiling, data, checkpoints, restarts, steps lost to
            preemption) per run and across restarts, in ``goodput.json`` (``xtrainer/goodput.py``).
        async_checkpointing: write whole-file checkpoints in a background thread; the loop pays only
            the copy off the device (``xtrainer/checkpoint/background.py``).

    Lightning's other arguments keep Lightning's meaning (the table in "Coming from Lightning",
    docs/lightning.md, says where XLA makes a difference): ``accelerator``, ``num_nodes``, ``fast_dev_run``,
    ``num_sanity_val_steps``, ``overfit_batches``, ``deterministic``, ``min_epochs``,
    ``min_steps``, ``max_time``, ``enable_model_summary``, ``benchmark``, ``sync_batchnorm``,
    ``reload_dataloaders_every_n_epochs``, ``profiler``, ``use_distributed_sampler``,
    ``inference_mode``.
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        devices: int | str = "auto",
        max_epochs: int | None = None,
        max_steps: int = -1,
        limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0,
        limit_test_batches: int | float = 1.0,
        limit_predict_batches: int | float = 1.0,
        val_check_interval: int | float | str | datetime.timedelta | dict[str, int] = 1.0,
        check_val_every_n_epoch: int | None = 1,
        log_every_n_steps: int = 50,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        precision: str | int = "32",
        callbacks: Sequence[Callback] | Callback | None = None,
        logger: bool | Logger | Sequence[Logger] | None = True,
        default_root_dir: str | os.PathLike | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_xla_health: bool = True,
        detect_nonfinite: str = "raise",
        compilation_cache: bool | str | os.PathLike | None = None,  # goodput: compile_cache.py
        hang_timeout: float | str | None = "auto",  # goodput: launch/watchdog.py
        exit_on_hang: bool = False,
        enable_goodput: bool = True,  # goodput: goodput.py
        async_checkpointing: bool = False,  # goodput: checkpoint/background.py
        accelerator: str = "auto",
        num_nodes: int = 1,
        fast_dev_run: int | bool = False,
        num_sanity_val_steps: int = 2,
        overfit_batches: int | float = 0.0,
        deterministic: bool | None = None,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: str | datetime.timedelta | dict[str, int] | None = None,
        enable_model_summary: bool = True,
        benchmark: bool | None = None,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        profiler: str | None = None,
        use_distributed_sampler: bool = True,
        inference_mode: bool = True,
        detect_anomaly: bool = False,
        barebones: bool = False,
        plugins: Any = None,
        model_registry: str | None = None,
        **unexpected: Any,
    ) -> None:
        if unexpected:
            name = sorted(unexpected)[0]
            known = [p for p in inspect.signature(Trainer.__init__).parameters if p not in ("self", "unexpected")]
            raise TypeError(f"Trainer() got an unexpected argument {name!r}.{did_you_mean(name, known)} "
                            "docs/lightning.md ('Coming from Lightning') lists every argument.")
        environment, plugins = clusters.from_plugins(plugins)
        settings, callbacks, logger = arguments.resolve(
            {name: value for name, value in locals().items() if name in TrainerSettings.names()},
            callbacks, logger, plugins or None, model_registry)
        #: The scheduler's environment this process runs in (``SLURMEnvironment`` under ``srun``),
        #: or None: its ranks are torch's variables before the strategy is configured.
        self.cluster_environment = clusters.prepare(environment, settings.devices, settings.num_nodes)
        self.strategy = resolve_strategy(strategy, settings.accelerator, settings.devices)
        self.precision = Precision(settings.precision)
        self.strategy.configure(settings.accelerator, settings.devices, settings.num_nodes, self.precision)
        #: The arguments, checked (``config/settings.py``); most read through the attributes of their names.
        self.settings = settings
        self.max_time = arguments.seconds(settings.max_time)
        self.limits = {"train": settings.limit_train_batches, "validate": settings.limit_val_batches,
                       "test": settings.limit_test_batches, "predict": settings.limit_predict_batches}
        # A fast_dev_run writes the values of every step, as in Lightning.
        self.log_every_n_steps = 1 if settings.fast_dev_run else settings.log_every_n_steps
        root = settings.default_root_dir or os.path.join(os.getcwd(), "xtrainer_logs")
        self.default_root_dir = fs.local(os.fspath(root))  # a file:// URL is the local folder it names
        self._log_dir: str | None = None  # claimed on first use (log_dir)

        self.callbacks: list[Callback] = arguments.with_defaults(settings, callbacks)
        if settings.accumulate_grad_batches != 1 and any(isinstance(cb, GradientAccumulationScheduler)
                                                         for cb in self.callbacks):
            raise ValueError(f"accumulate_grad_batches={settings.accumulate_grad_batches} and a "
                             "GradientAccumulationScheduler both set how many batches to accumulate (Lightning refuses "
                             "both too): leave accumulate_grad_batches out, or put its value in the scheduler's "
                             "scheduling ({0: n, ...}).")
        if logger is True:
            # <default_root_dir>/version_N (Lightning's logger=True adds a lightning_logs/ level)
            logger = TensorBoardLogger(name="")
        self.loggers = [] if logger in (None, False) else arguments.as_list(logger)
        self._fitted_model: XModule | None = None  # for validate()/test()/predict() without a model

        #: Where the fit is: what a checkpoint saves and ``fit`` continues from (written by the loop only).
        self.loop = LoopState()
        #: What the replica's run owns: the wrapped module, the optimizers, the logged results, the
        #: data (``xtrainer/loop/run.py``); the loop's, read here through Lightning's properties.
        self.run = Run(self, settings.detect_nonfinite)
        self.should_stop = False
        #: The checkpoint the last fit/validate/test/predict started from (None: none).
        self.ckpt_path: str | None = None

    # ---- the settings, read from ``settings`` (Lightning's names; a write changes the setting) ---
    fast_dev_run = _Setting()
    overfit_batches = _Setting()
    num_sanity_val_steps = _Setting()
    min_epochs = _Setting()
    min_steps = _Setting()
    max_epochs = _Setting()
    max_steps = _Setting()
    enable_model_summary = _Setting()
    reload_dataloaders_every_n_epochs = _Setting()
    use_distributed_sampler = _Setting()
    num_nodes = _Setting()
    val_check_interval = _Setting()
    check_val_every_n_epoch = _Setting()
    accumulate_grad_batches = _Setting()
    gradient_clip_val = _Setting()
    gradient_clip_algorithm = _Setting()
    detect_nonfinite = _Setting()

    @property
    def num_training_batches(self) -> float:
        """Batches of a training epoch (``limit_train_batches`` applied; inf without a length; 0 before a fit)."""
        return self.run.num_training_batches

    @property
    def state(self) -> TrainerState:
        """``"fit"``, ``"validate"``, ``"test"`` or ``"predict"`` while one runs, else ``"idle"``; with
        Lightning's ``fn``, ``stage``, ``status``, ``finished`` and ``stopped`` (``xtrainer.states``)."""
        return self.run.state

    @property
    def interrupted(self) -> bool:
        """The last run stopped on a signal (``TrainingInterrupted``) or Ctrl-C."""
        return self.run.interrupted

    @property
    def checkpoint_compilations(self) -> int:
        """Graphs compiled while writing checkpoints, so far in this process."""
        return self.run.checkpoint_compilations

    @property
    def is_last_batch(self) -> bool:
        """The training batch running is the epoch's last (as Lightning's; False for a loader without a length)."""
        return self.run.is_last_batch

    @property
    def sanity_checking(self) -> bool:
        """The sanity check's validation batches are running."""
        return self.run.sanity_checking

    @property
    def runs_root(self) -> str:
        """Where run folders are made: the first folder logger's ``<save_dir>/<name>``, else ``default_root_dir``."""
        return self._runs_root

    # ---- the run folder ------------------------------------------------------------------------
    @property
    def loggers(self) -> list[Logger]:
        return self._loggers

    @loggers.setter
    def loggers(self, loggers: list[Logger]) -> None:
        for one in loggers:
            if not isinstance(one, Logger):
                raise TypeError(f"logger must be True, False, a Logger or a list of them, got {type(one).__name__} "
                                "(loggers come from xtrainer.loggers).")
        self._loggers = list(loggers)
        # The run folder: the first folder logger's <save_dir>/<name>/version_N (save_dir defaults
        # to default_root_dir), else <default_root_dir>/version_N; shared by logs, checkpoints and
        # the saved configuration.
        self._runs_root = run_folder_root(self._loggers, self.default_root_dir)

    @property
    def log_dir(self) -> str:
        """This run's folder, ``<default_root_dir>[/<logger name>]/version_N``: logs, checkpoints
        and the saved configuration. Claimed on first use with ``os.mkdir``, which fails when the
        folder exists, so runs started at the same moment never share one."""
        if self._log_dir is None:
            if not stages.claims_run_folder():  # rank 0's, once the replica starts; until then the likely one
                return planned_run_folder(self.loggers, self.default_root_dir)
        return self.claim_log_dir()

    log_dir = log_dir.setter(_read_only("log_dir", "choose the folder with default_root_dir, or a logger's "
                                                  "save_dir, name and version"))

    @property
    def log_dir_claimed(self) -> str | None:
        """The run folder this process claimed or was given (None: none yet; ``log_dir`` claims one)."""
        return self._log_dir

    def claim_log_dir(self) -> str:
        """Claim this Trainer's run folder now, if it has none yet, and return it (``log_dir``
        does so on first use): the calling process claims it before the replicas start, so that
        they all write into one."""
        if self._log_dir is None:
            self._log_dir = claim_run_folder(self.loggers, self.default_root_dir)
        return self._log_dir

    def adopt_log_dir(self, folder: str) -> None:
        """Write into ``folder`` from now on (rank 0's run folder, broadcast to the other hosts'
        replicas): the folder loggers follow. Before anything is written there."""
        previous, self._log_dir = self._log_dir, folder
        if folder != previous:
            move_run_folder(self.loggers, previous, folder)

    # ---- where we are -----------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken in this fit (and the fits it resumed)."""
        return self.loop.global_step

    @property
    def current_epoch(self) -> int:
        return self.loop.current_epoch

    # Inside a replica these are the replica's; in the calling process (a data module's
    # prepare_data/setup, a module's prepare_data, the caller after fit) they are what the launch
    # will have, as in Lightning: rank 0 of ``world_size`` planned replicas.
    @property
    def world_size(self) -> int:
        if self.run.replica_ready:
            return self.strategy.world_size
        return stages.planned_world_size(self)

    @property
    def num_devices(self) -> int:
        """Devices per host the run uses (``devices``, or every local one for ``"auto"``)."""
        return self.strategy.devices or self.strategy.runtime.local_device_count() or 1

    @property
    def device_ids(self) -> list[int]:
        return list(range(self.num_devices))

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self.strategy.node_rank if self.state != "idle" else 0

    # ---- what was logged (the Run's publisher keeps it; the dicts change in place) -------------
    @property
    def callback_metrics(self) -> MetricValues:
        """The latest logged values, each a 0-dim CPU tensor (``.item()``, ``float()``), as in Lightning.
        Read in the module's own epoch-end hook, they include that epoch's values (one host sync)."""
        publisher = self.run.publisher
        if publisher.previewing is not None:
            publisher.preview(self)
        return publisher.callback_metrics

    callback_metrics = callback_metrics.setter(_read_only(
        "callback_metrics", "change its entries in place (trainer.callback_metrics.update(...), del ...[name])"))

    @property
    def logged_metrics(self) -> MetricValues:
        """What was sent to the loggers (values: 0-dim CPU tensors)."""
        return self.run.publisher.logged_metrics

    logged_metrics = logged_metrics.setter(_read_only(
        "logged_metrics", "change its entries in place (trainer.logged_metrics.update(...), del ...[name])"))

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The values logged with ``prog_bar=True``, as floats (what the progress bar shows)."""
        return self.run.publisher.progress_bar_metrics

    progress_bar_metrics = progress_bar_metrics.setter(_read_only(
        "progress_bar_metrics", "change its entries in place (trainer.progress_bar_metrics.update(...))"))

    @property
    def datamodule(self) -> XDataModule | None:
        """The data module of the stage running, or of the last one (None: none)."""
        return self.run.datamodule

    datamodule = datamodule.setter(_read_only(
        "datamodule", "pass the data module to fit, validate, test or predict (datamodule=...)"))

    @property
    def run_config(self) -> dict[str, Any]:
        """The resolved configuration of ``xtrainer fit`` (flat keys; empty for a Trainer built in
        code), logged with the module's hyperparameters (``run_settings``)."""
        return self.run.config

    run_config = run_config.setter(_read_only("run_config", "call trainer.record_run_config(config)", lightning=False))

    def record_run_config(self, config: Mapping[str, Any]) -> None:
        """Record ``config`` (flat keys) as the configuration this Trainer's runs were built from:
        ``run_config``, shown beside the hyperparameters (``xtrainer fit`` records its own)."""
        self.run.config = dict(config)

    @property
    def logger(self) -> Logger | None:
        """The first logger (None without one)."""
        return self.loggers[0] if self.loggers else None

    @logger.setter
    def logger(self, logger: Logger | None) -> None:
        self.loggers = [] if logger is None else [logger]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def early_stopping_callback(self) -> Any:
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def early_stopping_callbacks(self) -> list[Any]:
        from xtrainer.callbacks import EarlyStopping

        return [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]

    @property
    def progress_bar_callback(self) -> Any:
        from xtrainer.callbacks import ProgressBar

        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    @property
    def prediction_writer_callbacks(self) -> list[Any]:
        from xtrainer.callbacks import BasePredictionWriter

        return [cb for cb in self.callbacks if isinstance(cb, BasePredictionWriter)]

    @property
    def lightning_module(self) -> XModule:
        """The module of the stage running, or of the last one (as in Lightning)."""
        run = self.run
        if run.module is None and run.last_module is not None:
            return run.last_module
        return self.module

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps this fit will take (``max_steps``, or epochs x steps per epoch):
        what a one-cycle scheduler needs in ``configure_optimizers``."""
        batches = self.num_training_batches
        per_epoch = math.ceil(batches / self.accumulate_grad_batches) if batches and not math.isinf(batches) \
            else math.inf  # before a fit, or a loader without a length
        by_epochs = per_epoch * self.max_epochs if self.max_epochs != -1 else math.inf
        return min(by_epochs, self.max_steps) if self.max_steps != -1 else by_epochs

    @property
    def num_val_batches(self) -> list[float]:
        return list(self.run.num_val_batches)

    @property
    def num_sanity_val_batches(self) -> list[float]:
        steps = self.num_sanity_val_steps
        return [n if steps == -1 else min(steps, n) for n in self.run.num_val_batches]

    @property
    def num_test_batches(self) -> list[float]:
        return [self.run.num_batches(data, "test") for data in self.run.stage_data.get("test", [])]

    @property
    def num_predict_batches(self) -> list[float]:
        return [self.run.num_batches(data, "predict") for data in self.run.stage_data.get("predict", [])]

    # ---- Lightning's names for where a run is and what it reads ------------------------------
    @property
    def training(self) -> bool:
        """Fit's training batches are running (not its validation or sanity check)."""
        return self.state == "fit" and self.run.results is self.run.train_results

    @property
    def validating(self) -> bool:
        """``validate()`` runs, or fit's validation (not the sanity check: ``sanity_checking``)."""
        return not self.sanity_checking and (
            self.state == "validate" or (self.state == "fit" and self.run.results.stage == "validate"))

    @property
    def testing(self) -> bool:
        return self.state == "test"

    @property
    def predicting(self) -> bool:
        return self.state == "predict"

    @property
    def received_sigterm(self) -> bool:
        """SIGTERM asked this run to stop (it stops gracefully after the step)."""
        return interrupts.requested() == signal.SIGTERM

    @property
    def enable_validation(self) -> bool:
        """The fit validates: it has validation data (a fit has some only where the module has a
        ``validation_step``: ``loop/loaders.py``), and ``limit_val_batches`` leaves batches."""
        return bool(self.run.stage_data.get("validate")) and self.limits["validate"] != 0

    @property
    def limit_train_batches(self) -> int | float:
        return self.limits["train"]

    @property
    def limit_val_batches(self) -> int | float:
        return self.limits["validate"]

    @property
    def limit_test_batches(self) -> int | float:
        return self.limits["test"]

    @property
    def limit_predict_batches(self) -> int | float:
        return self.limits["predict"]

    @property
    def train_dataloader(self) -> Any:
        """The fit's training loader, as the strategy feeds it (with the sampler it put in)."""
        return self.run.train_data.loader if self.run.train_data is not None else None

    @property
    def val_dataloaders(self) -> Any:
        """The validation loader (a list where there are several; None: none)."""
        return self._loaders_of("validate")

    @property
    def test_dataloaders(self) -> Any:
        return self._loaders_of("test")

    @property
    def predict_dataloaders(self) -> Any:
        return self._loaders_of("predict")

    def _loaders_of(self, stage: str) -> Any:
        found = [getattr(data, "loader", data) for data in self.run.stage_data.get(stage, [])]
        return None if not found else found[0] if len(found) == 1 else found

    @property
    def module(self) -> XModule:
        module = self.run.module
        if module is None:
            raise RuntimeError("The Trainer has no module outside fit/validate/test/predict.")
        return module

    @property
    def model(self) -> nn.Module | None:
        """The module as the strategy wrapped it (DistributedDataParallel, FSDP...), inside a run
        (``trainer.strategy.full_module_state_dict(trainer.model)`` gives its whole weights); after
        one, the user's module as it is given back, unwrapped; None before any, as in Lightning."""
        wrapped = self.run.wrapped
        return wrapped if wrapped is not None else self.run.last_module

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.run.optim.optimizers)

    @property
    def lr_schedulers(self) -> list[Any]:
        return [s.scheduler for s in self.run.optim.schedulers]

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        return list(self.run.optim.schedulers)

    def init_module(self, empty_init: bool | None = None) -> Any:
        """A context to build the module in, as Lightning's: the strategy's
        (``Strategy.tensor_init_context``). Under ``model_parallel``, ``empty_init=True`` builds
        the layers on the meta device, given memory and ``reset_parameters()`` once
        ``configure_model()`` has parallelized them; elsewhere the module is built on the host as
        usual (the strategy moves it to the device when a stage starts)."""
        return self.strategy.tensor_init_context(empty_init)

    # ---- entry points (calling process) ------------------------------------------------------
    def fit(self, model: XModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: XDataModule | None = None, ckpt_path: str | os.PathLike | None = None,
            weights_only: bool | None = None) -> None:
        """Train ``model`` on loaders given here, or a ``datamodule``'s, or the module's own
        ``*_dataloader()`` hooks. Afterwards ``model`` holds the trained weights (on the CPU).
        ``weights_only``: Lightning's; a checkpoint is always read with ``weights_only=True``."""
        _check_weights_only(weights_only)
        stages.fit(self, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        self._fitted_model = model

    def resolve_ckpt_path(self, ckpt_path: str | os.PathLike | None) -> str | None:
        """The checkpoint ``ckpt_path`` means for this run, checked completely (every byte against
        its checksum, its strategy and world size against this run's) and announced in one line;
        None for a fresh start. ``"last"`` looks in this run's lineage only (``resume.py``). The
        next ``fit``/``validate``/``test``/``predict`` given the same ``ckpt_path`` uses this answer."""
        resolved = checkpoints.resolve_once(self, ckpt_path)
        self.run.resolved_ckpt = (ckpt_path, resolved)
        return resolved

    def validate(self, model: XModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
                 verbose: bool = True, datamodule: XDataModule | None = None,
                 weights_only: bool | None = None) -> list[dict[str, float]]:
        """Run the validation loop once; one dict of metrics per dataloader.

        Without ``model``, the module of the last ``fit``, from the best checkpoint when a
        ``ModelCheckpoint`` monitored one (else as the fit left it). With several replicas,
        values logged with ``sync_dist=True`` are combined across replicas; others are rank 0's.
        """
        _check_weights_only(weights_only)
        return self._evaluate("validate", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(self, model: XModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
             verbose: bool = True, datamodule: XDataModule | None = None,
             weights_only: bool | None = None) -> list[dict[str, float]]:
        """Run the test loop once; one dict of metrics per dataloader (``model`` as in ``validate``)."""
        _check_weights_only(weights_only)
        return self._evaluate("test", model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(self, model: XModule | None = None, dataloaders: Any = None, datamodule: XDataModule | None = None,
                return_predictions: bool | None = None, ckpt_path: str | None = None,
                weights_only: bool | None = None) -> list[Any] | None:
        """``predict_step`` outputs on the CPU: one list per dataloader (just the list if one).

        With several replicas each predicts its share of the data; the outputs returned are rank
        0's share. Write every replica's predictions from ``on_predict_batch_end`` to collect all.
        """
        _check_weights_only(weights_only)
        outputs = self._evaluate("predict", model, dataloaders, ckpt_path, False, datamodule)
        return None if return_predictions is False else outputs

    def _evaluate(self, stage: str, model: XModule | None, dataloaders: Any, ckpt_path: str | None,
                  verbose: bool, datamodule: XDataModule | None) -> Any:
        if model is None:
            model = self._fitted_model
            if model is None:
                raise ValueError(f"{stage}() got no model, and this Trainer has not fitted one: pass the model.")
            if ckpt_path is None and getattr(self.checkpoint_callback, "best_model_path", ""):
                ckpt_path = "best"
        return stages.evaluate(self, stage, model, dataloaders, ckpt_path, verbose, datamodule)

    def hyperparameters(self) -> dict[str, Any]:
        """What the loggers' ``log_hyperparams`` receive, as in Lightning: the data module's saved
        hyperparameters and the module's (the module's where both name one); secrets written as
        "***" (``xtrainer/config/redaction.py``)."""
        datamodule = dict(getattr(self.datamodule, "hparams", None) or {}) if self.datamodule is not None else {}
        return redact({**datamodule, **self.module.hparams})

    def run_settings(self) -> dict[str, Any]:
        """The Trainer's settings (``trainer/...``) and the configuration the run was built from,
        for the loggers that show them beside the hyperparameters (TensorBoard's HPARAMS view);
        secrets written as "***"."""
        settings = {"strategy": self.strategy.name, "world_size": self.world_size, "precision": self.precision.name,
                    "max_epochs": self.max_epochs, "max_steps": self.max_steps,
                    "accumulate_grad_batches": self.accumulate_grad_batches,
                    "gradient_clip_val": self.gradient_clip_val, "log_every_n_steps": self.log_every_n_steps}
        return redact({**{f"trainer/{k}": v for k, v in settings.items()}, **self.run_config})

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``XModule.manual_backward``."""
        self.run.optim.manual_backward(self, loss, *args, **kwargs)

    def clip_gradients_of(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """``XModule.clip_gradients``."""
        self.run.optim.clip_gradients_of(self, optimizer, value, algorithm)

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, weights_only: bool = False,
                        storage_options: Any = None) -> None:
        """Write a checkpoint to ``path``.

        During a fit (from a callback or hook; every replica must call it): the whole training
        state, in the strategy's layout, or with ``weights_only=True`` the module's weights and
        the loop counters only (nothing to resume a fit from). Refused (``CheckpointError``) once
        the training loss has been NaN or infinite: those weights are no longer good, and a
        checkpoint of them must never replace a good one.

        After a fit, as in Lightning: the fitted module's weights (on the host) with its
        hyperparameters and the loop counters, as one file; the optimizer state stayed with the
        replicas, so this is a weights-only checkpoint (``load_from_checkpoint``, ``validate``).
        """
        if storage_options is not None:
            raise ValueError("save_checkpoint(storage_options=...) is not supported: give a local path.")
        if self.run.wrapped is not None:
            with goodput.timing(self, "checkpointing"):  # goodput: time spent saving
                checkpoints.save(self, fs.local(os.fspath(path)), weights_only)
        elif self._fitted_model is not None:
            checkpoints.save_fitted(self, self._fitted_model, fs.local(os.fspath(path)))
        else:
            raise RuntimeError("save_checkpoint() needs a running fit (call it from a callback or hook) or a finished "
                               "one (after trainer.fit); this Trainer has neither.")

    def nonfinite_step(self) -> int | None:
        """The global step whose training loss was first NaN or infinite, if the weights have been
        updated since (None: all good so far, or ``detect_nonfinite="off"``). A host sync: for
        deciding whether a checkpoint may be written, which syncs anyway."""
        return self.run.nonfinite.nonfinite_step(self)
