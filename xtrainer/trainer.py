"""The ``Trainer``: owns the loops, leaves the device and the distribution to a strategy."""

from __future__ import annotations

import datetime
import inspect
import math
import os
import signal
import time
from typing import Any, Sequence

import torch
from torch import nn

from xtrainer import _xla, arguments, interrupts
from xtrainer import checkpoint as ckpt_io
from xtrainer import state as run_state
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.callbacks.base import CALLBACK_HOOKS, Callback, check_hook_names
from xtrainer.checkpoint import resume
from xtrainer.datamodule import LOADER_HOOKS, XDataModule
from xtrainer.loggers import Logger, TensorBoardLogger, claim_run_folder, move_run_folder, run_folder_root
from xtrainer.module import MODULE_HOOKS, XModule
from xtrainer.optim import SchedulerConfig, StrategyOptimizer, parse_optimizers, prefer_foreach, step_schedulers
from xtrainer.precision import Precision
from xtrainer.publishing import LOSS_KEY, Publisher
from xtrainer.results import Results, batch_size
from xtrainer.settings import TrainerSettings
from xtrainer.state import seed_everything
from xtrainer.strategies import Strategy, resolve_strategy
from xtrainer.suggest import did_you_mean
from xtrainer.strategies.base import sequential_dataloader

__all__ = ["Trainer", "seed_everything"]

_STEP_METHODS = {"train": "training_step", "validate": "validation_step", "test": "test_step",
                 "predict": "predict_step"}
_HOOK_STAGE = {"validate": "validation", "test": "test", "predict": "predict"}


class _StepDispatcher(nn.Module):
    """Calls the user's ``*_step`` from ``forward``, so wrappers' forward hooks (DDP, FSDP)
    run around every step. Floating-point inputs are cast to the run's precision here."""

    def __init__(self, module: XModule, precision: Precision) -> None:
        super().__init__()
        self.module = module
        self.precision = precision
        # How many of (batch_idx, dataloader_idx) each step method takes: Lightning lets
        # training_step(self, batch) leave batch_idx out.
        self._arity = {stage: _positional_count(getattr(module, name)) for stage, name in _STEP_METHODS.items()}

    def forward(self, stage: str, batch: Any, *args: Any) -> Any:
        args = args[:max(0, self._arity[stage] - 1)]
        with self.precision.step_context():
            return getattr(self.module, _STEP_METHODS[stage])(self.precision.convert_input(batch), *args)


class Trainer:
    """Trains an ``XModule`` on XLA devices.

    Args:
        strategy: ``"xla_native"``, ``"xla_ddp"``, ``"xla_fsdp"``, ``"xla_spmd"``, ``"xla_fsdpv2"``
            (``xtrainer.strategies.STRATEGIES``) or a ``Strategy`` instance.
        devices: replicas to run: an int, or ``"auto"`` (every local device; 1 on the CPU runtime,
            where ``devices=N`` runs N replicas on N virtual devices).
        max_epochs: stop after this many epochs (default 1000 when ``max_steps`` is not set).
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
        callbacks: ``Callback`` instances, called after the module's hook of the same name.
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

    Lightning's other arguments keep Lightning's meaning (the README's "Coming from Lightning"
    table says where XLA makes a difference): ``accelerator``, ``num_nodes``, ``fast_dev_run``,
    ``num_sanity_val_steps``, ``overfit_batches``, ``deterministic``, ``min_epochs``,
    ``min_steps``, ``max_time``, ``enable_model_summary``, ``benchmark``, ``sync_batchnorm``,
    ``reload_dataloaders_every_n_epochs``, ``profiler``, ``use_distributed_sampler``,
    ``inference_mode``.
    """

    def __init__(
        self,
        strategy: str | Strategy = "xla_native",
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
        logger: bool | Logger | None = True,
        default_root_dir: str | os.PathLike | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_xla_health: bool = True,
        detect_nonfinite: str = "raise",
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
                            "The README's 'Coming from Lightning' table lists every argument.")
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
        self.strategy = resolve_strategy(strategy)
        self.precision = Precision(settings.precision)
        self.strategy.connect(arguments.resolve_devices(settings.devices), self.precision)
        self.settings = settings
        self.max_epochs, self.max_steps = settings.max_epochs, settings.max_steps
        self.limits = {"train": settings.limit_train_batches, "validate": settings.limit_val_batches,
                       "test": settings.limit_test_batches, "predict": settings.limit_predict_batches}
        self.val_check_interval = settings.val_check_interval
        self.check_val_every_n_epoch = settings.check_val_every_n_epoch
        self.log_every_n_steps = settings.log_every_n_steps
        self.accumulate_grad_batches = settings.accumulate_grad_batches
        self.gradient_clip_val = settings.gradient_clip_val
        self.gradient_clip_algorithm = settings.gradient_clip_algorithm
        self.detect_nonfinite = settings.detect_nonfinite
        self._publisher = Publisher(settings.detect_nonfinite)
        self.default_root_dir = os.fspath(settings.default_root_dir or os.path.join(os.getcwd(), "xtrainer_logs"))
        self._log_dir: str | None = None  # claimed on first use (log_dir)

        self.callbacks: list[Callback] = arguments.with_defaults(settings, callbacks)
        if logger is True:
            # <default_root_dir>/version_N (Lightning's logger=True adds a lightning_logs/ level)
            logger = TensorBoardLogger(name="")
        self.loggers = [] if logger in (None, False) else arguments.as_list(logger)
        self.datamodule: XDataModule | None = None
        self.sanity_checking = False
        self._fitted_model: XModule | None = None  # for validate()/test()/predict() without a model
        self._started_at = 0.0
        self._loader_hooks: dict[str, Any] = {}
        self._num_val_batches: list[float] = []

        # Loop state: what a checkpoint saves and `fit` continues from.
        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False
        self._seed = 0
        #: Graphs compiled while writing checkpoints, so far in this process.
        self.checkpoint_compilations = 0
        #: The checkpoint the last fit/validate/test/predict started from (None: none).
        self.ckpt_path: str | None = None
        self._resolved_ckpt: tuple[Any, str | None] | None = None
        #: The resolved configuration of ``xtrainer fit`` (flat keys), logged with the module's
        #: hyperparameters.
        self.run_config: dict[str, Any] = {}
        self.callback_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.state = "idle"  # "fit", "validate", "test" or "predict" while one runs
        self.num_training_batches: float = 0
        self._batches_in_epoch = 0
        self._skip_batches = 0
        self._epoch_finished = True
        # Between a batch's end (where checkpoints are saved) and the validation it triggers: a
        # run resumed from such a checkpoint validates first, as the original run went on to do.
        self._validation_pending = False
        # Set inside a run (per replica).
        self._module: XModule | None = None
        self._wrapped: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._manual_optimizers: list[StrategyOptimizer] = []  # what self.optimizers() gives the module
        self._automatic = True
        self._schedulers: list[SchedulerConfig] = []
        self._results = Results("train", default_on_step=True)

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
            self._log_dir = claim_run_folder(self.loggers, self.default_root_dir)
        return self._log_dir

    @log_dir.setter
    def log_dir(self, value: str) -> None:
        previous, self._log_dir = self._log_dir, value
        if value != previous:  # e.g. rank 0's folder, broadcast: the loggers follow
            move_run_folder(self.loggers, previous, value)

    # ---- where we are (valid inside a run) -------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.strategy.world_size

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
        return _xla.process_index() if self.state != "idle" and _xla.is_spmd() else 0

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
        from xtrainer.callbacks import EarlyStopping

        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def lightning_module(self) -> XModule:
        return self.module

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps this fit will take (``max_steps``, or epochs x steps per epoch):
        what a one-cycle scheduler needs in ``configure_optimizers``."""
        per_epoch = math.ceil(self.num_training_batches / self.accumulate_grad_batches) \
            if self.num_training_batches else math.inf
        by_epochs = per_epoch * self.max_epochs if self.max_epochs is not None else math.inf
        return min(by_epochs, self.max_steps) if self.max_steps != -1 else by_epochs

    @property
    def num_val_batches(self) -> list[float]:
        return list(self._num_val_batches)

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
        return list(self._optimizers)

    @property
    def lr_schedulers(self) -> list[Any]:
        return [s.scheduler for s in self._schedulers]

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        return list(self._schedulers)

    # ---- entry points (calling process) ------------------------------------------------------
    def fit(self, model: XModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: XDataModule | None = None, ckpt_path: str | os.PathLike | None = None) -> None:
        """Train ``model`` on loaders given here, or a ``datamodule``'s, or the module's own
        ``*_dataloader()`` hooks. Afterwards ``model`` holds the trained weights (on the CPU)."""
        _check_module(model, "fit")
        if isinstance(train_dataloaders, XDataModule):  # Lightning accepts it in this place too
            train_dataloaders, datamodule = None, train_dataloaders
        self._prepare("fit", model, datamodule, given=train_dataloaders is not None or val_dataloaders is not None)
        try:
            train = arguments.as_list(train_dataloaders) or self._hook_loaders(model, "train")
            if not train:
                raise ValueError(f"fit() got no training data: pass train_dataloaders=..., a datamodule, or define "
                                 f"{type(model).__name__}.train_dataloader().")
            if len(train) > 1:
                raise ValueError("fit() takes one training dataloader.")
            if self.overfit_batches:
                train = [sequential_dataloader(train[0])]
            val = arguments.as_list(val_dataloaders) or (self._hook_loaders(model, "validate")
                                                if type(model).validation_step is not XModule.validation_step else [])
            if val and type(model).validation_step is XModule.validation_step:
                raise ValueError(f"Validation data was given but {type(model).__name__} has no validation_step.")
            with interrupts.graceful():  # SIGTERM/SIGINT: finish the step, write a checkpoint, raise
                self._launch("fit", model, {"train": train, "validate": val}, ckpt_path)
            self._fitted_model = model
        finally:
            self._teardown_data("fit")

    def _prepare(self, stage: str, model: XModule, datamodule: XDataModule | None, given: bool) -> None:
        """In the calling process, before any replica starts: the module's extra callbacks, then
        ``prepare_data`` (module, then data module) and the data module's ``setup(stage)``."""
        if datamodule is not None and not isinstance(datamodule, XDataModule):
            raise TypeError(f"datamodule must be an xtrainer.XDataModule, got {type(datamodule).__name__}.")
        if datamodule is not None and given:
            raise ValueError(f"{stage}() got both dataloaders and a datamodule; give one of them.")
        self._add_module_callbacks(model)
        self.datamodule = datamodule
        model.prepare_data()
        if datamodule is not None:
            datamodule.trainer = self
            datamodule.prepare_data()
            datamodule.setup(stage)

    def _teardown_data(self, stage: str) -> None:
        if self.datamodule is not None:
            self.datamodule.teardown(stage)

    def _hook_loaders(self, model: XModule, stage: str) -> list:
        """The loaders the data module's hook for ``stage`` returns, else the module's own."""
        hook = LOADER_HOOKS[stage]
        owner = self.datamodule if self.datamodule is not None and callable(getattr(self.datamodule, hook, None)) \
            else model
        self._loader_hooks[stage] = owner
        return arguments.as_list(_module_loader(owner, hook))

    def _add_module_callbacks(self, model: XModule) -> None:
        """``configure_callbacks()``: they join the Trainer's; one of the same type replaces it."""
        extra = arguments.as_list(model.configure_callbacks())
        if not extra:
            return
        for cb in extra:
            if not isinstance(cb, Callback):
                raise TypeError(f"{type(model).__name__}.configure_callbacks() returned a {type(cb).__name__}, "
                                "not a Callback.")
            check_hook_names(cb, CALLBACK_HOOKS, Callback)
        types_ = {type(cb) for cb in extra}
        kept = [cb for cb in self.callbacks if type(cb) not in types_]
        # Checkpoint callbacks go last, as in Lightning: they see what the others did.
        rest = [cb for cb in kept + extra if not isinstance(cb, ModelCheckpoint)]
        self.callbacks = rest + [cb for cb in kept + extra if isinstance(cb, ModelCheckpoint)]

    def resolve_ckpt_path(self, ckpt_path: str | os.PathLike | None) -> str | None:
        """The checkpoint ``ckpt_path`` means for this run, checked completely (every byte against
        its checksum, its strategy and world size against this run's) and announced in one line;
        None for a fresh start. ``"last"`` looks in this run's lineage only (``resume.py``). The
        next ``fit``/``validate``/``test``/``predict`` given the same ``ckpt_path`` uses this answer."""
        resolved = self._resolve_ckpt_path(ckpt_path)
        self._resolved_ckpt = (ckpt_path, resolved)
        return resolved

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike | None) -> str | None:
        if ckpt_path is None:
            return None
        if self._resolved_ckpt is not None and self._resolved_ckpt[0] == ckpt_path:
            resolved, self._resolved_ckpt = self._resolved_ckpt[1], None
            return resolved
        ckpt_path = os.fspath(ckpt_path)
        if ckpt_path == "best":
            best = getattr(self.checkpoint_callback, "best_model_path", "")
            if not best:
                raise ckpt_io.CheckpointNotFoundError(
                    "ckpt_path='best': no best checkpoint is known. It needs a fit with a ModelCheckpoint(monitor=...) "
                    "in this Trainer; pass a path instead.")
            ckpt_path = best
        if ckpt_path != "last" and not ckpt_io.fs.exists(ckpt_path):
            raise ckpt_io.CheckpointNotFoundError(f"ckpt_path={ckpt_path!r} does not exist (or pass ckpt_path='last').")
        extra = [cb.dirpath for cb in self.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        planned = next((lg.version_dir for lg in self.loggers if getattr(lg, "version_dir", None)), None)
        if planned:  # a version given by name (version="baseline") is not among the version_* siblings
            extra.append(ckpt_io.default_dirpath(planned))
        search = resume.lineage_dirs(os.path.join(self._runs_root, "version_0"), extra)
        header = resume.resolve(ckpt_path, search, self.strategy.checkpoint_layout, self.strategy.name,
                                self.strategy.planned_world_size(), root=self._runs_root)
        if header is None:
            return None
        print(f"xtrainer: resuming from {header.describe()}", flush=True)
        return header.path

    def validate(self, model: XModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
                 verbose: bool = True, datamodule: XDataModule | None = None) -> list[dict[str, float]]:
        """Run the validation loop once; one dict of metrics per dataloader.

        Without ``model``, the module of the last ``fit``, from the best checkpoint when a
        ``ModelCheckpoint`` monitored one (else as the fit left it). With several replicas,
        values logged with ``sync_dist=True`` are combined across replicas; others are rank 0's.
        """
        return self._evaluate("validate", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(self, model: XModule | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
             verbose: bool = True, datamodule: XDataModule | None = None) -> list[dict[str, float]]:
        """Run the test loop once; one dict of metrics per dataloader (``model`` as in ``validate``)."""
        return self._evaluate("test", model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(self, model: XModule | None = None, dataloaders: Any = None, datamodule: XDataModule | None = None,
                return_predictions: bool | None = None, ckpt_path: str | None = None) -> list[Any] | None:
        """``predict_step`` outputs on the CPU: one list per dataloader (just the list if one).

        With several replicas each predicts its share of the data; the outputs returned are rank
        0's share. Write every replica's predictions from ``on_predict_batch_end`` to collect all.
        """
        outputs = self._evaluate("predict", model, dataloaders, ckpt_path, False, datamodule)
        return None if return_predictions is False else outputs

    def _evaluate(self, stage: str, model: XModule | None, dataloaders: Any, ckpt_path: str | None,
                  verbose: bool, datamodule: XDataModule | None) -> Any:
        if isinstance(dataloaders, XDataModule):
            dataloaders, datamodule = None, dataloaders
        if model is None:
            model = self._fitted_model
            if model is None:
                raise ValueError(f"{stage}() got no model, and this Trainer has not fitted one: pass the model.")
            if ckpt_path is None and getattr(self.checkpoint_callback, "best_model_path", ""):
                ckpt_path = "best"
        _check_module(model, stage)
        if datamodule is None and dataloaders is None:
            datamodule = self.datamodule  # the fit's, if it had one
        self._prepare(stage, model, datamodule, given=dataloaders is not None)
        try:
            hook = LOADER_HOOKS[stage]
            loaders = arguments.as_list(dataloaders) or self._hook_loaders(model, stage)
            if not loaders:
                raise ValueError(f"{stage}() got no data: pass dataloaders=..., a datamodule, or define "
                                 f"{type(model).__name__}.{hook}().")
            step = _STEP_METHODS[stage]
            if stage != "predict" and getattr(type(model), step) is getattr(XModule, step):
                raise ValueError(f"{type(model).__name__} has no {step}(self, batch, batch_idx) to {stage} with.")
            results = self._launch(stage, model, {stage: loaders}, ckpt_path)
        finally:
            self._teardown_data(stage)
        if verbose and stage != "predict":
            _print_results(stage, results)
        return results

    def _launch(self, stage: str, model: XModule, loaders: dict[str, list], ckpt_path: Any) -> Any:
        resolved = self._resolve_ckpt_path(ckpt_path)
        self.ckpt_path = resolved
        self.log_dir  # claimed here, in the calling process, so that every replica shares one run folder
        # Decided here, so that every replica agrees: it seeds the samplers' shuffling (with the
        # epoch) and each replica's XLA random generator (with its rank).
        self._seed = torch.initial_seed() % 2**31
        try:
            result = self.strategy.launch(self._run, stage, model, loaders, resolved)
        except BaseException:
            _remove_if_empty(self.log_dir)  # a run that failed before writing anything leaves no folder
            raise
        if "state_dict" in result:  # replicas ran elsewhere: bring rank 0's results home
            model.load_state_dict(result["state_dict"])
            self.global_step, self.current_epoch = result["global_step"], result["current_epoch"]
            self._epoch_finished, self.should_stop = result["epoch_finished"], result["should_stop"]
            self.callback_metrics = result["callback_metrics"]
            for cb in self.callbacks:
                cb.load_state_dict(result["callbacks"].get(cb.state_key, {}))
        return result["outputs"]

    # ---- one replica -------------------------------------------------------------------------
    def _run(self, stage: str, module: XModule, loaders: dict[str, list], ckpt_path: str | None
             ) -> dict[str, Any]:
        self.strategy.setup_environment()
        if self.world_size > 1:
            # On several hosts each calling process claimed a folder of its own; rank 0's is the
            # run's (untested here: no pod), and a folder claimed for nothing is given back.
            own, self.log_dir = self.log_dir, self.strategy.broadcast(self.log_dir)
            if own != self.log_dir:
                _remove_if_empty(own)
        _xla.set_rng_state(self._seed + self.global_rank)
        self.state, self.should_stop, self._publisher.stop_agreed = stage, False, False
        module.trainer = self
        self._module = module
        in_process, failed = self.strategy.runs_in_caller, False
        try:
            for cb in self.callbacks:
                cb.setup(self, module, stage)
            module.setup(stage)
            self._wrapped = self.strategy.setup_module(_StepDispatcher(module, self.precision))
            data = {name: [self._device_data(dl) for dl in dls] for name, dls in loaders.items()}
            if stage == "fit":
                self.num_training_batches = self._num_batches(data["train"][0], "train")
                self._num_val_batches = [self._num_batches(d, "validate") for d in data["validate"]]
                self._setup_optimizers()
            if ckpt_path is not None:
                self._restore(ckpt_path, stage)
            if stage == "fit":
                self._fit_loop(data["train"][0], data["validate"])
                outputs = None
            else:
                outputs = self._eval_loop(stage, data[stage])
            result: dict[str, Any] = {"outputs": outputs}
            if not in_process:
                result.update(
                    state_dict=_xla.to_cpu(self.strategy.full_module_state_dict(self._wrapped)),  # host sync
                    global_step=self.global_step, current_epoch=self.current_epoch,
                    epoch_finished=self._epoch_finished, should_stop=self.should_stop,
                    callback_metrics=dict(self.callback_metrics),
                    callbacks={cb.state_key: cb.state_dict() for cb in self.callbacks})
            return result
        except BaseException as err:
            failed = True
            if not isinstance(err, interrupts.TrainingInterrupted):  # that one called the hook already
                self._call_on_exception(err)
            raise
        finally:
            self._publisher.close(self, failed)  # flush what was logged, also when training failed
            if self._wrapped is not None:
                self.strategy.teardown(self._wrapped, failed)
            for cb in self.callbacks:
                cb.teardown(self, module, stage)
            module.teardown(stage)
            self.state = "idle"
            self._wrapped = self._module = None

    def _device_data(self, loader: Any) -> Any:
        return self.strategy.process_dataloader(loader, distribute=self.use_distributed_sampler)

    def _setup_optimizers(self) -> None:
        module = self.module
        self._automatic = module.automatic_optimization
        if not self._automatic:
            self.strategy.check_manual_optimization()
        config = self.strategy.setup_optimizers(self._wrapped, module.configure_optimizers)
        name = type(module).__name__
        self._optimizers, self._schedulers = parse_optimizers(config, name, self._automatic)
        for optimizer in self._optimizers:  # torch's multi-tensor path on XLA tensors, unless the user chose
            prefer_foreach(optimizer)
        if not self._automatic:
            if self.gradient_clip_val is not None:
                raise ValueError(f"gradient_clip_val with manual optimization ({name}.automatic_optimization is "
                                 "False): clip in training_step with self.clip_gradients(opt, gradient_clip_val=...) "
                                 "before opt.step(), as in Lightning.")
            if self.accumulate_grad_batches != 1:
                raise ValueError(f"accumulate_grad_batches with manual optimization ({name}.automatic_optimization "
                                 "is False): step the optimizers every N batches in training_step instead.")
        self._manual_optimizers = [
            StrategyOptimizer(opt, self.strategy, lambda opt=opt: self._call("on_before_optimizer_step", opt),
                              self._manual_stepped)
            for opt in self._optimizers]
        self._needs_before_step = self.gradient_clip_val is not None or _overrides(
            module, self.callbacks, "on_before_optimizer_step")
        self._custom_step = (type(module).optimizer_step is not XModule.optimizer_step
                             or type(module).optimizer_zero_grad is not XModule.optimizer_zero_grad)

    # ---- fit ---------------------------------------------------------------------------------
    def _fit_loop(self, train: Any, val: list) -> None:
        self.num_training_batches = self._num_batches(train, "train")
        if self.num_training_batches == 0:
            if len(train) == 0:
                raise ValueError("The training dataloader is empty: it yields no batches (an empty dataset, or "
                                 "drop_last=True with fewer samples than one batch per replica).")
            raise ValueError("limit_train_batches leaves no training batches to run.")
        self._results = Results("train", default_on_step=True)
        self._publisher.start_fit(self)
        self._started_at = time.monotonic()
        if self.enable_model_summary and self.is_global_zero:
            self._print_summary()
        self._call("on_fit_start")
        if val and self.num_sanity_val_steps and self._validation_epoch_any():
            self._sanity_check(val)
        self._call("on_train_start")
        first_epoch = self.current_epoch
        while not self._fit_done():
            self._results.reset_epoch()
            train = self._reloaded(train, first_epoch)
            train.set_epoch(self.current_epoch, self._seed)
            self._call("on_train_epoch_start")
            skip, self._skip_batches = self._skip_batches, 0
            self._epoch_finished = False
            finished = True
            if self._validation_pending:  # resumed between a batch and the validation it triggered
                self._run_validation(val)
            # Resuming inside an epoch starts at the next unseen batch (skipped by index, not
            # loaded). An epoch whose every batch was trained (saved on its last batch) is not
            # iterated at all: the original run never drained its loader either, and draining
            # torch_xla's device loader cuts the graph, which advances the XLA generator.
            batches = train.resume_at(skip) if skip < self.num_training_batches else ()
            for batch_idx, batch in batches:
                if self._call("on_train_batch_start", batch, batch_idx) == -1:
                    break  # Lightning's meaning: the rest of this epoch is skipped
                self._validation_pending = bool(val) and self._validation_due(batch_idx)
                self._train_batch(batch, batch_idx)
                if self._validation_pending:
                    self._run_validation(val)
                if interrupts.requested() is None and self.strategy.preempted(self.global_step):
                    interrupts.request(signal.SIGTERM)  # the preemption notice: every process stops at this step
                    self._publisher.stop_agreed = True
                if interrupts.requested() is not None:
                    self.should_stop = True  # a signal: stop as should_stop does (all replicas at one step)
                elif self.max_time is not None and time.monotonic() - self._started_at >= self.max_time:
                    self.should_stop = True  # host clock, no device sync; replicas agree as for any stop
                if batch_idx + 1 >= self.num_training_batches:
                    break
                if self._stopping() or (self.max_steps != -1 and self.global_step >= self.max_steps):
                    finished = False
                    break
            signum = interrupts.requested()
            if signum is not None and not finished and self._stopping():
                self._stop_on_signal(signum)  # the epoch is cut short: no epoch-end hooks
            if val and finished and math.isinf(self.num_training_batches) and self._validation_epoch():
                self._run_validation(val)  # a loader without a length: validate when it runs out
            self._epoch_finished = finished
            self._end_epoch("train", "on_train_epoch_end")
            if self.world_size > 1:
                self._publisher.publish(self, {})  # a stop asked for at the epoch's end reaches every replica
            if self._epoch_finished:
                if self._automatic:  # under manual optimization the module steps its schedulers
                    self._step_schedulers("epoch")
                self.current_epoch += 1
                self._batches_in_epoch = 0
        self._call("on_train_end")
        self._call("on_fit_end")
        self._publisher.end_fit(self)

    def _stop_on_signal(self, signum: int) -> None:
        """Stopped by a signal: ``on_exception``, a checkpoint (every replica), then raise."""
        name = signal.Signals(signum).name
        self._call_on_exception(interrupts.TrainingInterrupted(f"Stopped by {name}.", signum))
        saver = next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)
        if saver is not None:
            path = saver.save_now(self)
        elif self.nonfinite_step() is None:
            path = os.path.join(ckpt_io.default_dirpath(self.log_dir),
                                f"interrupted-epoch={self.current_epoch}-step={self.global_step}.ckpt")
            self.save_checkpoint(path)
        else:
            path = None
        where = f"step {self.global_step}, epoch {self.current_epoch}"
        if path is None:
            message = (f"Stopped by {name} at {where}; the training loss had become non-finite, so no checkpoint "
                       "was written (the good ones written before are intact).")
        else:
            message = (f"Stopped by {name} at {where}; checkpoint: {path}. Resume with fit(..., ckpt_path='last') "
                       "(xtrainer fit --config <run folder>/config.yaml ckpt_path=last).")
        raise interrupts.TrainingInterrupted(message, signum, path)

    def _call_on_exception(self, err: BaseException) -> None:
        """Every ``on_exception`` hook, each given its chance: one that fails does not hide ``err``."""
        if self._module is None:
            return
        hooks = [lambda: self._module.on_exception(err)] + [
            (lambda cb=cb: cb.on_exception(self, self._module, err)) for cb in self.callbacks]
        for hook in hooks:
            try:
                hook()
            except Exception as hook_err:  # noqa: BLE001 - reported, and the original error goes on
                err.add_note(f"(an on_exception hook failed too: {type(hook_err).__name__}: {hook_err})")

    def hyperparameters(self) -> dict[str, Any]:
        """The module's saved hyperparameters, the run's configuration and the Trainer's settings."""
        settings = {"strategy": self.strategy.name, "world_size": self.world_size, "precision": self.precision.name,
                    "max_epochs": self.max_epochs, "max_steps": self.max_steps,
                    "accumulate_grad_batches": self.accumulate_grad_batches,
                    "gradient_clip_val": self.gradient_clip_val, "log_every_n_steps": self.log_every_n_steps}
        return {**{f"trainer/{k}": v for k, v in settings.items()}, **self.run_config, **self.module.hparams}

    def _stopping(self) -> bool:
        """Whether ``should_stop`` ends the fit. With several replicas, one replica's request is
        shared at the next logging step or epoch end (riding on the values read there), and all
        stop together; stopping on one alone would leave the others waiting in a collective.
        Before ``min_epochs``/``min_steps`` only a signal stops the fit."""
        asked = self._publisher.stop_agreed if self.world_size > 1 else self.should_stop
        if asked and interrupts.requested() is None and not self._minimum_done():
            return False
        return asked

    def _minimum_done(self) -> bool:
        return ((self.min_epochs is None or self.current_epoch >= self.min_epochs)
                and (self.min_steps is None or self.global_step >= self.min_steps))

    def _fit_done(self) -> bool:
        return (self._stopping() or (self.max_steps != -1 and self.global_step >= self.max_steps)
                or (self.max_epochs is not None and self.current_epoch >= self.max_epochs))

    def _train_batch(self, batch: Any, batch_idx: int) -> None:
        if not self._automatic:
            self._manual_train_batch(batch, batch_idx)
            return
        steps = ((batch_idx + 1) % self.accumulate_grad_batches == 0
                 or batch_idx + 1 == self.num_training_batches)
        results = self._results
        results.batch_size, results.in_step = batch_size(batch), True
        with self.strategy.no_backward_sync(self._wrapped, enabled=not steps):
            outputs = self._wrapped("train", batch, batch_idx)
            loss = _training_loss(outputs)
            self._publisher.observe_loss(loss)
            results.log(LOSS_KEY, loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=False,
                        reduce_fx="mean", batch_size=None)
            if self.accumulate_grad_batches > 1:
                loss = loss / self.accumulate_grad_batches
            self._call("on_before_backward", loss)
            self.strategy.backward(loss)
            self._call("on_after_backward")
        results.in_step = False
        if steps:
            self._optimizer_step(batch_idx, loss)
        if steps and self.global_step % self.log_every_n_steps == 0:
            # Read once the step's graph is launched, as torch_xla's step closures run: the
            # values are this step's outputs, and reading them is the interval's one host sync.
            _xla.add_step_closure(self._publish_step_values)
        self.strategy.sync()  # the graph cut: this micro-batch's work runs as one execution
        self._batches_in_epoch = batch_idx + 1
        self._call("on_train_batch_end", outputs, batch, batch_idx)

    def _manual_train_batch(self, batch: Any, batch_idx: int) -> None:
        """Manual optimization: ``training_step`` runs backward and steps the optimizers itself
        (``self.manual_backward``, ``self.optimizers()``); the graph is still cut once per call."""
        results = self._results
        results.batch_size, results.in_step = batch_size(batch), True
        before = self.global_step
        outputs = self._wrapped("train", batch, batch_idx)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(())
            self._publisher.observe_loss(loss)
            results.log(LOSS_KEY, loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=False,
                        reduce_fx="mean", batch_size=None)
        results.in_step = False
        for wrapper in self._manual_optimizers:
            wrapper.pending_clip = None  # asked for, but that optimizer did not step
        if self.global_step // self.log_every_n_steps > before // self.log_every_n_steps:
            _xla.add_step_closure(self._publish_step_values)  # a logging step was crossed: as in _train_batch
        self.strategy.sync()  # the graph cut: one execution per training_step call
        self._batches_in_epoch = batch_idx + 1
        self._call("on_train_batch_end", outputs, batch, batch_idx)

    def _manual_stepped(self) -> None:
        """A manual ``opt.step()``: Lightning counts every optimizer step in ``global_step``."""
        self.global_step += 1
        self._publisher.stepped()

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``XModule.manual_backward``: the backward hooks around the strategy's backward."""
        if self._automatic:
            raise RuntimeError("manual_backward() is for manual optimization: set self.automatic_optimization = "
                               "False in the module's __init__ (with automatic optimization, return the loss).")
        self._call("on_before_backward", loss)
        self.strategy.manual_backward(self._wrapped, loss, *args, **kwargs)
        self._call("on_after_backward")

    def clip_gradients_of(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """``XModule.clip_gradients``: clip ``optimizer``'s gradients once they are reduced, just
        before it steps (right away where the strategy reduced them in backward already)."""
        if value is None:
            return
        algorithm = algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}: use 'norm' or 'value'.")
        raw = getattr(optimizer, "optimizer", optimizer)
        wrapper = next((w for w in self._manual_optimizers if w.optimizer is raw), None)
        clip = lambda: self.strategy.clip_gradients(self._wrapped, raw, value, algorithm)  # noqa: E731
        if wrapper is None:
            clip()
        else:
            wrapper.pending_clip = clip

    def _publish_step_values(self) -> None:
        self._publisher.publish(self, self._results.step_tensors(self.strategy.reduce, self.world_size),
                                check_loss=True)

    def _optimizer_step(self, batch_idx: int, loss: torch.Tensor) -> None:
        optimizer = self._optimizers[0]
        before_step = self._before_optimizer_step if self._needs_before_step else None
        if self._custom_step:  # the module overrides optimizer_step or optimizer_zero_grad
            wrapper = StrategyOptimizer(optimizer, self.strategy, before_step)
            self.module.optimizer_step(self.current_epoch, batch_idx, wrapper, lambda: loss)
            self._call("on_before_zero_grad", optimizer)
            self.module.optimizer_zero_grad(self.current_epoch, batch_idx, optimizer)
        else:
            self.strategy.optimizer_step(optimizer, before_step)
            self._call("on_before_zero_grad", optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self._publisher.stepped()
        self._step_schedulers("step")

    def _before_optimizer_step(self) -> None:
        self._call("on_before_optimizer_step", self._optimizers[0])
        if self.gradient_clip_val is not None:
            self.strategy.clip_gradients(self._wrapped, self._optimizers[0], self.gradient_clip_val,
                                         self.gradient_clip_algorithm)

    def _step_schedulers(self, interval: str) -> None:
        count = self.global_step if interval == "step" else self.current_epoch + 1
        step_schedulers(self._schedulers, interval, count, self.callback_metrics)

    def _validation_epoch_any(self) -> bool:
        """Whether validation runs in any epoch of this fit (not when limit_val_batches is 0)."""
        return self.limits["validate"] != 0

    def _sanity_check(self, val: list) -> None:
        """Lightning's sanity check: the first ``num_sanity_val_steps`` batches of each validation
        loader, before training, to fail early on a broken ``validation_step``. Nothing it logs is
        kept, callbacks see ``trainer.sanity_checking``, and the random generators are left as
        they were, so a run with the check trains exactly as one without."""
        train_results = self._results
        self.sanity_checking = True
        try:
            with _xla.rng_state_kept(), torch.random.fork_rng(devices=[]):
                for cb in self.callbacks:
                    cb.on_sanity_check_start(self, self.module)
                self._eval_loop("validate", val, cap=self.num_sanity_val_steps if self.num_sanity_val_steps > 0 else None)
                for cb in self.callbacks:
                    cb.on_sanity_check_end(self, self.module)
        finally:
            self.sanity_checking = False
            self._results = train_results
        self.callback_metrics.clear()
        self.logged_metrics.clear()
        self.progress_bar_metrics.clear()

    def _reloaded(self, train: Any, first_epoch: int) -> Any:
        """``reload_dataloaders_every_n_epochs``: the training loader from its hook again."""
        every, owner = self.reload_dataloaders_every_n_epochs, self._loader_hooks.get("train")
        if not every or owner is None or self.current_epoch == first_epoch or self.current_epoch % every:
            return train
        loader = arguments.as_list(_module_loader(owner, LOADER_HOOKS["train"]))
        if len(loader) != 1:
            raise ValueError(f"{type(owner).__name__}.train_dataloader() returned {len(loader)} loaders on reload.")
        data = self._device_data(sequential_dataloader(loader[0]) if self.overfit_batches else loader[0])
        self.num_training_batches = self._num_batches(data, "train")
        return data

    def _print_summary(self) -> None:
        try:
            from xtrainer.summary import summarize
        except ImportError:
            return

        print(summarize(self.module, world_size=self.world_size,
                        sharded=self.strategy.name in ("xla_fsdp", "xla_fsdpv2")), flush=True)

    def _validation_epoch(self) -> bool:
        every = self.check_val_every_n_epoch
        return every is None or (self.current_epoch + 1) % every == 0

    def _validation_due(self, batch_idx: int) -> bool:
        if not self._validation_epoch():
            return False
        n = self.num_training_batches
        interval = self.val_check_interval
        if isinstance(interval, float):
            if math.isinf(n):
                if interval != 1.0:
                    raise ValueError("val_check_interval as a fraction needs a training loader with a length; "
                                     "give an int (a number of batches) instead.")
                return False  # validated when the epoch ends
            every = max(1, int(n * interval))
        else:
            every = interval
        return (batch_idx + 1) % every == 0

    def _run_validation(self, val: list) -> None:
        train_results = self._results
        self._eval_loop("validate", val)
        self._results = train_results
        self._validation_pending = False

    # ---- evaluation ----------------------------------------------------------------------------
    def _eval_loop(self, stage: str, datas: list, cap: int | None = None) -> Any:
        hook = _HOOK_STAGE[stage]
        wrapped = self._wrapped
        was_training = wrapped.training
        wrapped.eval()
        results = self._results = Results(stage, default_on_step=False)
        predictions: list[list[Any]] = []
        self._call(f"on_{hook}_start")
        self._call(f"on_{hook}_epoch_start")
        with torch.no_grad():
            for dl_idx, data in enumerate(datas):
                data.set_epoch(self.current_epoch, self._seed)
                extra = (dl_idx,) if len(datas) > 1 else ()
                results.suffix = f"/dataloader_idx_{dl_idx}" if len(datas) > 1 else ""
                limit = self._num_batches(data, stage) if cap is None else min(cap, self._num_batches(data, stage))
                outputs_of_loader: list[Any] = []
                for batch_idx, batch in enumerate(data):
                    if batch_idx >= limit:
                        break
                    self._call(f"on_{hook}_batch_start", batch, batch_idx, *extra)
                    results.batch_size, results.in_step = batch_size(batch), True
                    outputs = wrapped(stage, batch, batch_idx, *extra)
                    results.in_step = False
                    if stage == "predict":
                        # host sync: predictions are returned on the host, batch by batch
                        outputs = _xla.to_cpu(outputs)
                        outputs_of_loader.append(outputs)
                    self.strategy.sync()  # the graph cut: one execution per evaluation batch
                    self._call(f"on_{hook}_batch_end", outputs, batch, batch_idx, *extra)
                predictions.append(outputs_of_loader)
        results.suffix = ""
        metrics = self._end_epoch(stage, f"on_{hook}_epoch_end")
        self._call(f"on_{hook}_end")
        if was_training:
            wrapped.train()
        if stage == "predict":
            return predictions[0] if len(predictions) == 1 else predictions
        if len(datas) == 1:
            return [metrics]
        return [{k: v for k, v in metrics.items() if "/dataloader_idx_" not in k or k.endswith(f"_{i}")}
                for i in range(len(datas))]

    def _end_epoch(self, stage: str, hook: str) -> dict[str, float]:
        """The module's epoch-end hook (it may still log), then read every epoch value to the host
        (one host sync), then the callbacks' hook, which sees the new ``callback_metrics``."""
        getattr(self.module, hook)()
        tensors = self._results.epoch_tensors(self.strategy.reduce, self.world_size, self.strategy.all_gather_tensors)
        if stage == "train":  # the latest per-step values ride along in the same transfer
            tensors.update(self._results.step_tensors(self.strategy.reduce, self.world_size))
        metrics = self._publisher.publish(self, tensors, check_loss=stage == "train")
        for cb in self.callbacks:
            getattr(cb, hook)(self, self.module)
        return metrics

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
        if self._wrapped is None:
            self._save_fitted(os.fspath(path))
            return
        bad = self.nonfinite_step()
        if bad is not None:
            raise ckpt_io.CheckpointError(
                f"Not writing {os.fspath(path)!r}: the training loss became NaN or infinite at global step {bad}, so "
                "the weights are not good any more. The checkpoints written before are intact.")
        module = self.module
        with _xla.rng_state_kept():  # the run goes on from the state the checkpoint records, as a resumed one does
            checkpoint = run_state.build_checkpoint(self)
            module.on_save_checkpoint(checkpoint)
            for cb in self.callbacks:
                cb.on_save_checkpoint(self, module, checkpoint)
            if weights_only:
                run_state.keep_weights_only(checkpoint)
            compiles = _xla.compile_count()
            self.strategy.checkpoint_layout.save(self.strategy, checkpoint, os.fspath(path))
            # A save that computes anything on the device (gathering shards, say) compiles graphs
            # of its own; those are not the training step's, and XlaHealth does not count them as
            # recompilations.
            self.checkpoint_compilations += _xla.compile_count() - compiles

    def _save_fitted(self, path: str) -> None:
        model = self._fitted_model
        if model is None:
            raise RuntimeError("save_checkpoint() needs a running fit (call it from a callback or hook) or a finished "
                               "one (after trainer.fit); this Trainer has neither.")
        checkpoint = run_state.fitted_checkpoint(self, model)
        ckpt_io.whole.WholeFile().save(self.strategy if self.strategy.runs_in_caller else _Alone(), checkpoint, path)

    def nonfinite_step(self) -> int | None:
        """The global step whose training loss was first NaN or infinite, if the weights have been
        updated since (None: all good so far, or ``detect_nonfinite="off"``). A host sync: for
        deciding whether a checkpoint may be written, which syncs anyway."""
        return self._publisher.nonfinite_step(self)

    def _restore(self, path: str, stage: str) -> None:
        """Load the checkpoint at ``path`` (checked in the calling process) into this replica."""
        run_state.restore(self, self.strategy.checkpoint_layout.load(self.strategy, path), path, stage)

    # ---- helpers -------------------------------------------------------------------------------
    def _call(self, hook: str, *args: Any) -> Any:
        """Call ``hook`` on the module, then on every callback, in order; the module's answer."""
        module = self.module
        answer = getattr(module, hook)(*args)
        for cb in self.callbacks:
            getattr(cb, hook)(self, module, *args)
        return answer

    def _num_batches(self, data: Any, stage: str) -> float:
        try:
            length: float = len(data)
        except TypeError:
            length = math.inf
        limit = self.limits["train" if stage == "fit" else stage]
        if isinstance(limit, float):
            if math.isinf(length):
                if limit != 1.0:
                    raise ValueError(f"limit_{stage}_batches={limit} is a fraction, but the loader has no "
                                     "length; give a number of batches instead.")
                return length
            return int(length * limit) if limit < 1.0 else length
        return min(length, limit)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_module=None, _wrapped=None, _optimizers=[], _manual_optimizers=[], _schedulers=[])
        return state


class _Alone:
    """The calling process as the only replica: who writes a checkpoint after the replicas are gone."""

    world_size, global_rank, is_global_zero = 1, 0, True

    def barrier(self, name: str = "") -> None:
        del name


#: Lightning hooks that cannot run here: batches move to the device inside torch_xla's loader.
_TRANSFER_HOOKS = ("on_before_batch_transfer", "on_after_batch_transfer", "transfer_batch_to_device")


def _check_module(model: Any, stage: str) -> None:
    if not isinstance(model, XModule):
        raise TypeError(f"{stage}() takes an xtrainer.XModule, got {type(model).__name__}.")
    for hook in _TRANSFER_HOOKS:
        if callable(getattr(model, hook, None)):
            raise NotImplementedError(
                f"{type(model).__name__}.{hook} would not be called: batches move to the XLA device inside "
                "torch_xla's loader, ahead of the step. Do that work in the DataLoader's collate_fn (on the host) "
                "or at the start of training_step (on the device), and remove the method.")
    check_hook_names(model, MODULE_HOOKS, XModule)
    if stage == "fit":
        if type(model).training_step is XModule.training_step:
            raise NotImplementedError(f"{type(model).__name__} has no training_step(self, batch, batch_idx).")
        if type(model).configure_optimizers is XModule.configure_optimizers:
            raise NotImplementedError(
                f"{type(model).__name__} has no configure_optimizers(). Return an optimizer, "
                "(optimizers, schedulers), or {'optimizer': ..., 'lr_scheduler': ...}.")


def _module_loader(model: XModule, hook: str) -> Any:
    fn = getattr(model, hook, None)
    return fn() if callable(fn) else None


def _overrides(module: XModule, callbacks: list[Callback], hook: str) -> bool:
    return (getattr(type(module), hook) is not getattr(XModule, hook)
            or any(getattr(type(cb), hook) is not getattr(Callback, hook) for cb in callbacks))


def _positional_count(method: Any) -> int:
    """Positional arguments a bound step method takes (many for ``*args``)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return 3
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    """Lightning's table of ``validate``/``test`` results, printed by the calling process."""
    rows = [(name, value) for metrics in results for name, value in sorted(metrics.items())]
    if not rows:
        return
    width = max(len(name) for name, _ in rows)
    title = f"{'Validate' if stage == 'validate' else 'Test'} metric"
    print(f"{title:<{width}}  DataLoader 0")
    for name, value in rows:
        print(f"{name:<{width}}  {value:.6g}")


def _training_loss(outputs: Any) -> torch.Tensor:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None:
        raise ValueError(
            "training_step returned None. Return the loss tensor or a dict with a 'loss' entry; skipping a "
            "batch by returning None is not supported (deciding it would force a host sync every step).")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step must return a tensor or a dict with 'loss', got {type(outputs).__name__}.")
    if loss.numel() != 1:
        raise ValueError(f"training_step returned a loss of shape {tuple(loss.shape)}; it must be a scalar "
                         "(reduce it with .mean() or .sum()).")
    if not loss.requires_grad:
        raise ValueError("training_step returned a loss that does not require grad: it is detached from the "
                         "model's parameters (was it computed under torch.no_grad(), or with .detach()?).")
    return loss.reshape(())


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)  # only an empty folder: anything written stays
    except OSError:
        pass
