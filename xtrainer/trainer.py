"""The ``Trainer``: owns the loops, leaves the device and the distribution to a strategy."""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import os
import signal
from typing import Any, Sequence

import torch
from torch import nn

from xtrainer import goodput
from xtrainer.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from xtrainer.callbacks.base import Callback
from xtrainer.checkpoint import fs
from xtrainer.config import arguments
from xtrainer.config.redaction import redact
from xtrainer.config.settings import TrainerSettings
from xtrainer.datamodule import XDataModule
from xtrainer.launch import interrupts, stages
from xtrainer.loggers import Logger, TensorBoardLogger, claim_run_folder, move_run_folder, run_folder_root
from xtrainer.loggers.run_folder import planned_run_folder
from xtrainer.loop import checkpoints, loaders, replica
from xtrainer.loop.checkpoints import seed_everything
from xtrainer.loop.hooks import HookTable
from xtrainer.loop.metric_values import MetricValues
from xtrainer.loop.optimization import Optimization
from xtrainer.loop.optimizers import SchedulerConfig
from xtrainer.loop.publishing import Publisher
from xtrainer.loop.results import Results
from xtrainer.loop.state import LoopState
from xtrainer.module import XModule
from xtrainer.strategies import Strategy, resolve_strategy
from xtrainer.strategies.data import CombinedData
from xtrainer.strategies.precision import Precision
from xtrainer.suggest import did_you_mean
from xtrainer.utilities.combined_loader import CombinedLoader

__all__ = ["Trainer", "seed_everything"]


def _check_weights_only(weights_only: bool | None) -> None:
    """Lightning's ``weights_only=`` of the entry points: None or True, as every checkpoint is
    read (tensors and plain values; nothing in the file runs); False is refused."""
    if weights_only is False:
        raise ValueError("weights_only=False: xtrainer reads every checkpoint with weights_only=True (tensors and "
                         "plain values only; nothing in the file runs); pass weights_only=True or leave it out.")
    if weights_only not in (None, True):
        raise TypeError(f"weights_only must be None, True or False, got {weights_only!r}.")


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
        val_check_interval: validate every this fraction of an epoch (float) or this many training
            batches (int).
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
        val_check_interval: int | float = 1.0,
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
        settings, callbacks, logger = arguments.resolve(
            {name: value for name, value in locals().items() if name in TrainerSettings.names()},
            callbacks, logger, plugins, model_registry)
        self.fast_dev_run, self.overfit_batches = settings.fast_dev_run, settings.overfit_batches
        self.num_sanity_val_steps = settings.num_sanity_val_steps
        self.min_epochs, self.min_steps = settings.min_epochs, settings.min_steps
        self.max_time = arguments.seconds(settings.max_time)
        self.enable_model_summary = settings.enable_model_summary
        self.reload_dataloaders_every_n_epochs = settings.reload_dataloaders_every_n_epochs
        self.use_distributed_sampler = settings.use_distributed_sampler
        self.num_nodes = settings.num_nodes
        self.strategy = resolve_strategy(strategy, settings.accelerator, settings.devices)
        self.precision = Precision(settings.precision)
        self.strategy.configure(settings.accelerator, settings.devices, settings.num_nodes, self.precision)
        self.settings = settings
        self.max_epochs, self.max_steps = settings.max_epochs, settings.max_steps
        self.limits = {"train": settings.limit_train_batches, "validate": settings.limit_val_batches,
                       "test": settings.limit_test_batches, "predict": settings.limit_predict_batches}
        self.val_check_interval = settings.val_check_interval
        self.check_val_every_n_epoch = settings.check_val_every_n_epoch
        # A fast_dev_run writes the values of every step, as in Lightning.
        self.log_every_n_steps = 1 if settings.fast_dev_run else settings.log_every_n_steps
        self.accumulate_grad_batches = settings.accumulate_grad_batches
        self.gradient_clip_val = settings.gradient_clip_val
        self.gradient_clip_algorithm = settings.gradient_clip_algorithm
        self.detect_nonfinite = settings.detect_nonfinite
        self._publisher = Publisher(settings.detect_nonfinite)
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
        self._hooks = HookTable()  # who overrides which hook (Trainer._call)
        if logger is True:
            # <default_root_dir>/version_N (Lightning's logger=True adds a lightning_logs/ level)
            logger = TensorBoardLogger(name="")
        self.loggers = [] if logger in (None, False) else arguments.as_list(logger)
        self.datamodule: XDataModule | None = None
        self.sanity_checking = False
        self._fitted_model: XModule | None = None  # for validate()/test()/predict() without a model
        self._started_at = 0.0
        self._loader_hooks: dict[str, Any] = {}
        self._replica_ready = False  # this object's strategy has set up a replica's environment
        self._num_val_batches: list[float] = []

        #: Where the fit is: what a checkpoint saves and ``fit`` continues from (written by the loop only).
        self.loop = LoopState()
        self.should_stop = False
        #: Graphs compiled while writing checkpoints, so far in this process.
        self.checkpoint_compilations = 0
        #: The checkpoint the last fit/validate/test/predict started from (None: none).
        self.ckpt_path: str | None = None
        self._resumed_by_path = False  # ckpt_path named a checkpoint, not "last" (ModelCheckpoint keeps it)
        self._resolved_ckpt: tuple[Any, str | None] | None = None
        #: The resolved configuration of ``xtrainer fit`` (flat keys), logged with the module's
        #: hyperparameters.
        self.run_config: dict[str, Any] = {}
        self.callback_metrics = {}  # values: 0-dim CPU tensors, as in Lightning (MetricValues)
        self.progress_bar_metrics: dict[str, float] = {}  # floats, as in Lightning
        self.logged_metrics = {}
        self.state = "idle"  # "fit", "validate", "test" or "predict" while one runs
        self.num_training_batches: float = 0
        #: The training batch running is the epoch's last (as Lightning's; False for a loader without a length).
        self.is_last_batch = False
        #: The last run stopped on a signal (``TrainingInterrupted``) or Ctrl-C.
        self.interrupted = False
        self._stage_data: dict[str, list[Any]] = {}  # a run's loaders, as the strategy delivers them
        # predict: per loader, the sample indices of each batch so far (empty where the loader has no batch sampler)
        self._predict_batch_indices: list[list[list[int]]] = []
        # Set inside a run (per replica).
        self._module: XModule | None = None
        self._last_module: XModule | None = None  # the last stage's module (lightning_module after it)
        self._wrapped: nn.Module | None = None
        self._transfer: Any = None  # the batch-transfer hooks (loop.steps.BatchTransfer), where overridden
        self._optim = Optimization()
        self._train_results = self._results = Results("train", default_on_step=True)
        self._train_data: Any = None  # the fit's training data, as the strategy delivers it
        self._restored_data_state: Any = None  # the data order a resumed epoch continues

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
            self._log_dir = claim_run_folder(self.loggers, self.default_root_dir)
        return self._log_dir

    @log_dir.setter
    def log_dir(self, value: str) -> None:
        previous, self._log_dir = self._log_dir, value
        if value != previous:  # e.g. rank 0's folder, broadcast: the loggers follow
            move_run_folder(self.loggers, previous, value)

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
        if self._replica_ready:
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

    @property
    def callback_metrics(self) -> MetricValues:
        """The latest logged values, each a 0-dim CPU tensor (``.item()``, ``float()``), as in Lightning.
        Read in the module's own epoch-end hook, they include that epoch's values (one host sync)."""
        if self._publisher.previewing is not None:
            self._publisher.preview(self)
        return self._callback_metrics

    @callback_metrics.setter
    def callback_metrics(self, values: Any) -> None:
        self._callback_metrics = MetricValues(values)

    @property
    def logged_metrics(self) -> MetricValues:
        """What was sent to the loggers (values: 0-dim CPU tensors)."""
        return self._logged_metrics

    @logged_metrics.setter
    def logged_metrics(self, values: Any) -> None:
        self._logged_metrics = MetricValues(values)

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
        if self._module is None and self._last_module is not None:
            return self._last_module
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
        return list(self._num_val_batches)

    @property
    def num_sanity_val_batches(self) -> list[float]:
        steps = self.num_sanity_val_steps
        return [n if steps == -1 else min(steps, n) for n in self._num_val_batches]

    @property
    def num_test_batches(self) -> list[float]:
        return [self._num_batches(data, "test") for data in self._stage_data.get("test", [])]

    @property
    def num_predict_batches(self) -> list[float]:
        return [self._num_batches(data, "predict") for data in self._stage_data.get("predict", [])]

    # ---- Lightning's names for where a run is and what it reads ------------------------------
    @property
    def training(self) -> bool:
        """Fit's training batches are running (not its validation or sanity check)."""
        return self.state == "fit" and self._results is self._train_results

    @property
    def validating(self) -> bool:
        """``validate()`` runs, or fit's validation (not the sanity check: ``sanity_checking``)."""
        return not self.sanity_checking and (
            self.state == "validate" or (self.state == "fit" and self._results.stage == "validate"))

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
        return bool(self._stage_data.get("validate")) and self.limits["validate"] != 0

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
        return self._train_data.loader if self._train_data is not None else None

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
        found = [getattr(data, "loader", data) for data in self._stage_data.get(stage, [])]
        return None if not found else found[0] if len(found) == 1 else found

    @property
    def module(self) -> XModule:
        if self._module is None:
            raise RuntimeError("The Trainer has no module outside fit/validate/test/predict.")
        return self._module

    @property
    def model(self) -> nn.Module:
        """The module as the strategy wrapped it (DistributedDataParallel, FSDP...), inside a run.
        ``trainer.strategy.full_module_state_dict(trainer.model)`` gives its whole weights."""
        if self._wrapped is None:
            raise RuntimeError("The Trainer has no model outside fit/validate/test/predict.")
        return self._wrapped

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._optim.optimizers)

    @property
    def lr_schedulers(self) -> list[Any]:
        return [s.scheduler for s in self._optim.schedulers]

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        return list(self._optim.schedulers)

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
        resolved = self._resolve_ckpt_path(ckpt_path)
        self._resolved_ckpt = (ckpt_path, resolved)
        return resolved

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike | None, stage: str = "fit") -> str | None:
        if ckpt_path is None:
            return None
        if self._resolved_ckpt is not None and self._resolved_ckpt[0] == ckpt_path:
            resolved, self._resolved_ckpt = self._resolved_ckpt[1], None
            return resolved
        return checkpoints.resolve_ckpt_path(self, fs.local(os.fspath(ckpt_path)), stage)

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

    def _train_data_state(self) -> Any:
        """What a checkpoint keeps of the training data's order in this epoch (None: nothing)."""
        return self._train_data.state_dict() if self._train_data is not None else None

    def _device_data(self, loader: Any) -> Any:
        if isinstance(loader, CombinedLoader):  # training loaders read together: each one as a loader is
            return CombinedData(loader, [self._device_data(inner) for inner in loader.flattened],
                                self.strategy.runtime.rng_state_kept)
        return self.strategy.process_dataloader(loader, distribute=self.use_distributed_sampler)

    def _call_on_exception(self, err: BaseException) -> None:
        """Every ``on_exception`` hook, each given its chance: one that fails does not hide ``err``.
        A stop on a signal or Ctrl-C is ``interrupted`` by then, as in Lightning."""
        self.interrupted = isinstance(err, (interrupts.TrainingInterrupted, KeyboardInterrupt))
        if self._module is None:
            return
        module = self._module
        hooks = [(f"{type(cb).__name__}.on_exception", functools.partial(cb.on_exception, self, module, err))
                 for cb in self.callbacks] + [(f"{type(module).__name__}.on_exception", lambda: module.on_exception(err))]
        replica.run_cleanup(hooks, err)  # one that fails is a note on err, which goes on

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
        self._optim.manual_backward(self, loss, *args, **kwargs)

    def clip_gradients_of(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """``XModule.clip_gradients``."""
        self._optim.clip_gradients_of(self, optimizer, value, algorithm)

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
        if self._wrapped is not None:
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
        return self._publisher.nonfinite_step(self)

    # ---- helpers -------------------------------------------------------------------------------
    def _call(self, hook: str, *args: Any) -> Any:
        """Call ``hook`` on every callback, in order, then on the module, as Lightning does; the
        module's answer. Only those that override the no-op are called (``xtrainer/loop/hooks.py``)."""
        module = self._module if self._module is not None else self.module  # (the property says what is wrong)
        own, callbacks = self._hooks.entry(hook, module, self.callbacks)
        for fn in callbacks:
            fn(self, module, *args)
        return own(*args) if own is not None else None

    def _start_stage(self, model: XModule) -> None:
        """As a stage starts (in the calling process): its metrics are its own (Lightning resets
        them too), and ``model`` is ``lightning_module`` once it is over."""
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = {}, {}, {}
        self._last_module = model

    def _num_batches(self, data: Any, stage: str) -> float:
        return loaders.num_batches(data, self.limits["train" if stage == "fit" else stage], stage)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_module=None, _last_module=None, _wrapped=None, _optim=Optimization(), _hooks=HookTable())
        return state

