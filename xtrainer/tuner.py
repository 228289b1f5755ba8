"""Lightning's ``Tuner``: the learning-rate finder (``Tuner(trainer).lr_find(model)``).

The finder is a short real fit: a Trainer with the given Trainer's strategy, devices, precision,
gradient accumulation and clipping, but ``max_steps=num_training``, no validation, no
checkpoints, no logger and no progress bar, writing under a temporary folder. A callback sets
every parameter group's learning rate before each optimizer step, from ``min_lr`` up to
``max_lr``, and records the smoothed training loss after it. Afterwards the module's weights, its
train/eval modes and the host's random generators are as they were, so the next ``fit`` starts
where it would have without the search.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn

from xtrainer.callbacks.base import Callback
from xtrainer.flops import host_random_state_kept

if TYPE_CHECKING:
    from xtrainer.datamodule import XDataModule
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer

__all__ = ["Tuner"]

#: The smoothing of the recorded loss (an exponential moving average, bias-corrected), as Lightning's.
_BETA = 0.98


class Tuner:
    """Tunes a module's hyperparameters with the settings of ``trainer`` (Lightning's ``Tuner``).

    ``lr_find`` runs the learning-rate range test; ``scale_batch_size`` is not supported (on XLA
    each batch size compiles its own graphs): set the batch size yourself.
    """

    def __init__(self, trainer: "Trainer") -> None:
        from xtrainer.trainer import Trainer

        if not isinstance(trainer, Trainer):
            raise TypeError(f"Tuner(trainer) takes an xtrainer Trainer, got {type(trainer).__name__}.")
        self._trainer = trainer

    def lr_find(self, model: "XModule", train_dataloaders: Any = None, val_dataloaders: Any = None,
                dataloaders: Any = None, datamodule: "XDataModule | None" = None, method: str = "fit",
                min_lr: float = 1e-8, max_lr: float = 1.0, num_training: int = 100, mode: str = "exponential",
                early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                attr_name: str = "") -> "_LRFinder | None":
        """Train ``model`` for up to ``num_training`` optimizer steps with a learning rate rising
        from ``min_lr`` to ``max_lr`` (``mode``: ``"exponential"`` or ``"linear"``) and record the
        smoothed loss of each step; the results and a suggestion are in the ``_LRFinder`` returned.

        The search stops early once the smoothed loss exceeds ``early_stop_threshold`` times the
        best so far (None: never). The module's weights are restored afterwards. With
        ``update_attr`` the suggested learning rate is written to the module's ``lr`` or
        ``learning_rate`` attribute (or ``attr_name``), or the ``hparams`` entry of that name;
        ``configure_optimizers`` must read it from there. The data are given as to ``fit``
        (``train_dataloaders``, ``val_dataloaders``, ``datamodule``, or the module's own hooks);
        validation does not run. Under ``fast_dev_run`` nothing runs and None is returned.
        """
        trainer = self._trainer
        if method != "fit":
            raise ValueError(f"lr_find(method={method!r}): only method='fit' is supported, as in Lightning.")
        if dataloaders is not None:
            raise ValueError("lr_find(dataloaders=...) is for method='validate'/'test'/'predict'; the search fits, so "
                             "pass train_dataloaders= (and val_dataloaders=) or datamodule= instead.")
        _check_arguments(min_lr, max_lr, num_training, mode, early_stop_threshold)
        lr_attr = _lr_attribute(model, attr_name) if update_attr else None  # fail before training, not after
        if trainer.fast_dev_run:
            rank_zero_warn("Skipping the learning rate finder: fast_dev_run is set.")
            return None

        sweep = _LRSweep(_planned_lrs(min_lr, max_lr, num_training, mode), early_stop_threshold)
        saved = _ModuleState(model)
        strategy = trainer.strategy
        strategy_devices, strategy_precision = strategy.devices, strategy.precision
        root = tempfile.mkdtemp(prefix="xtrainer_lr_find_")
        try:
            tuning = _tuning_trainer(trainer, sweep, root, num_training)
            with host_random_state_kept():
                tuning.fit(model, train_dataloaders, val_dataloaders, datamodule=datamodule)
        finally:
            saved.restore(model)
            strategy.devices, strategy.precision = strategy_devices, strategy_precision  # the user's Trainer's again
            shutil.rmtree(root, ignore_errors=True)

        finder = _LRFinder(mode, min_lr, max_lr, num_training)
        finder.results = {"lr": list(sweep.lrs), "loss": list(sweep.losses)}
        if sweep.stopped_early:
            rank_zero_info(f"The learning rate finder stopped early after {len(sweep.losses)} steps: the loss "
                           "diverged.")
        if lr_attr is not None:
            lr = finder.suggestion()
            if lr is not None:
                _set_lr(model, lr_attr, lr)
                rank_zero_info(f"The learning rate finder set {type(model).__name__}.{lr_attr} to {lr:g}.")
        return finder

    def scale_batch_size(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: choose the batch size yourself."""
        del args, kwargs
        raise NotImplementedError(
            "Tuner.scale_batch_size is not supported: on XLA every batch size it tried would compile new graphs. "
            "Set the batch size by hand (in your DataLoader or data module): e.g. the largest with which a short "
            "fit (max_steps=...) runs.")


class _LRFinder:
    """What ``Tuner.lr_find`` found: ``results`` (``{"lr": [...], "loss": [...]}``, one entry per
    optimizer step, the loss smoothed), ``suggestion()`` and ``plot()``."""

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the smoothed loss falls fastest (its most negative gradient
        with respect to the learning rate), leaving out the first ``skip_begin`` and the last
        ``skip_end`` points and any that are not finite. None, with a warning, when fewer than
        two points remain: run more steps (``num_training``) or give more data."""
        lrs, losses = self.results["lr"], self.results["loss"]
        end = len(losses) - skip_end if skip_end > 0 else len(losses)
        picked = [i for i in range(max(skip_begin, 0), end) if math.isfinite(losses[i])]
        if len(picked) < 2:
            rank_zero_warn(f"The learning rate finder cannot suggest a learning rate: {len(picked)} usable point(s) "
                           f"of {len(losses)} after skipping {skip_begin} at the start and {skip_end} at the end. "
                           "Raise num_training, give more training data, or lower skip_begin.")
            self._optimal_idx = None
            return None
        x = torch.tensor([lrs[i] for i in picked], dtype=torch.float64)
        y = torch.tensor([losses[i] for i in picked], dtype=torch.float64)
        gradient = torch.gradient(y, spacing=(x,))[0]
        self._optimal_idx = picked[int(torch.argmin(gradient))]
        return lrs[self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss against the learning rate (a log scale in ``"exponential"`` mode), with the
        suggestion marked when ``suggest``; drawn on ``ax`` if given. Returns the figure; needs
        matplotlib."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("_LRFinder.plot() needs matplotlib, which is not installed: pip install matplotlib "
                              "(or read the points from .results).") from None
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest:
            self.suggestion()
            if self._optimal_idx is not None:
                ax.plot(lrs[self._optimal_idx], losses[self._optimal_idx], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


class _LRSweep(Callback):
    """Sets the learning rate of each optimizer step from ``lrs`` and records the smoothed loss
    after it (in every replica, over the loss averaged across replicas, so that all decide alike
    when to stop). What it recorded is its ``state_dict``: with several processes, rank 0's comes
    back to the calling process."""

    def __init__(self, lrs: list[float], early_stop_threshold: float | None) -> None:
        self.planned = lrs
        self.early_stop_threshold = early_stop_threshold
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.stopped_early = False
        self._average = 0.0
        self._best = math.inf
        self._window: torch.Tensor | None = None  # the losses of this step's micro-batches, summed
        self._micro_batches = 0

    def state_dict(self) -> dict[str, Any]:
        return {"lrs": list(self.lrs), "losses": list(self.losses), "stopped_early": self.stopped_early}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lrs = list(state_dict.get("lrs", []))
        self.losses = list(state_dict.get("losses", []))
        self.stopped_early = bool(state_dict.get("stopped_early", False))

    def on_train_start(self, trainer: "Trainer", module: "XModule") -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"The learning rate finder works with one optimizer; "
                             f"{type(module).__name__}.configure_optimizers() returned {len(optimizers)}. Find each "
                             "learning rate with a module that trains under that optimizer alone.")
        # The search sets the learning rate itself: the module's schedulers do not step during it
        # (Lightning's finder replaces them too; a monitored one would find no validation metric).
        trainer.run.optim.schedulers = []

    def on_train_batch_start(self, trainer: "Trainer", module: "XModule", batch: Any, batch_idx: int) -> None:
        lr = self._lr_of_step(trainer.global_step)
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr

    def on_train_batch_end(self, trainer: "Trainer", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(-1)[0]
            if module.automatic_optimization:  # the loop divided it by the window's length
                loss = loss * trainer.accumulate_grad_batches
            self._window = loss if self._window is None else self._window + loss
            self._micro_batches += 1
        if not trainer.loop.stepped:  # inside an accumulation window: the step comes later
            return
        window, count = self._window, self._micro_batches
        self._window, self._micro_batches = None, 0
        if self.stopped_early:
            return  # the replicas are still agreeing to stop: these steps are past the search
        step = len(self.losses)
        self.lrs.append(self._lr_of_step(step))
        if window is None:  # training_step returned no loss (a skipped batch): not a point to use
            self.losses.append(math.nan)
            return
        mean = window / count
        if trainer.world_size > 1:
            mean = trainer.strategy.collectives.reduce(mean, "sum") / trainer.world_size
        # A host sync on purpose, once per step: the search decides after each step whether to stop.
        # Through the strategy's read (one batched transfer; on the CPU runtime's replica threads,
        # through their serialised graph cut: an .item() ran the all-reduce from C++ in two threads
        # at once and crashed the process).
        value = float(trainer.strategy.collectives.to_cpu(mean))
        self._average = _BETA * self._average + (1 - _BETA) * value
        smoothed = self._average / (1 - _BETA ** (step + 1))
        self.losses.append(smoothed)
        threshold = self.early_stop_threshold
        if threshold is not None and step > 0 and (not math.isfinite(smoothed) or smoothed > threshold * self._best):
            self.stopped_early = True
            trainer.should_stop = True
        if smoothed < self._best:
            self._best = smoothed

    def _lr_of_step(self, step: int) -> float:
        return self.planned[min(step, len(self.planned) - 1)]


def _planned_lrs(min_lr: float, max_lr: float, num_training: int, mode: str) -> list[float]:
    """The learning rate of each step: ``min_lr`` to ``max_lr``, geometric or evenly spaced."""
    last = num_training - 1
    if mode == "exponential":
        return [min_lr * (max_lr / min_lr) ** (i / last) for i in range(num_training)]
    return [min_lr + (max_lr - min_lr) * i / last for i in range(num_training)]


def _check_arguments(min_lr: float, max_lr: float, num_training: int, mode: str,
                     early_stop_threshold: float | None) -> None:
    if mode not in ("exponential", "linear"):
        raise ValueError(f"lr_find(mode={mode!r}): use 'exponential' or 'linear'.")
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 2:
        raise ValueError(f"lr_find(num_training={num_training!r}): give the number of steps to try, at least 2.")
    if not (isinstance(min_lr, (int, float)) and isinstance(max_lr, (int, float)) and 0 < min_lr < max_lr):
        raise ValueError(f"lr_find(min_lr={min_lr!r}, max_lr={max_lr!r}): give 0 < min_lr < max_lr.")
    if early_stop_threshold is not None and not early_stop_threshold > 0:
        raise ValueError(f"lr_find(early_stop_threshold={early_stop_threshold!r}): give a positive factor, or None "
                         "to never stop early.")


def _tuning_trainer(trainer: "Trainer", sweep: _LRSweep, root: str, num_training: int) -> "Trainer":
    """A Trainer for the search: ``trainer``'s strategy (the same object), devices, precision,
    accumulation, clipping and training batches; nothing written, no validation."""
    from xtrainer.trainer import Trainer

    settings = trainer.settings
    return Trainer(
        strategy=trainer.strategy, devices=settings.devices, accelerator=settings.accelerator,
        num_nodes=settings.num_nodes, precision=settings.precision,
        accumulate_grad_batches=settings.accumulate_grad_batches, gradient_clip_val=settings.gradient_clip_val,
        gradient_clip_algorithm=settings.gradient_clip_algorithm, limit_train_batches=settings.limit_train_batches,
        overfit_batches=settings.overfit_batches, use_distributed_sampler=settings.use_distributed_sampler,
        reload_dataloaders_every_n_epochs=settings.reload_dataloaders_every_n_epochs,
        compilation_cache=settings.compilation_cache,
        max_steps=num_training, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=1,  # several replicas agree on a stop at a logging step: at the next one
        callbacks=[sweep], logger=False, default_root_dir=root, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, enable_xla_health=False, enable_goodput=False,
        hang_timeout=None, detect_nonfinite="off")  # a diverging loss is what the search looks for


class _ModuleState:
    """What a fit changes on a module, kept on the host: its weights and buffers (a copy), each
    submodule's train/eval mode, the Trainer it is attached to."""

    def __init__(self, model: "XModule") -> None:
        self.weights = {name: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor)
                        else copy.deepcopy(value) for name, value in model.state_dict().items()}
        self.modes = [(module, module.training) for module in model.modules()]
        self.trainer = model.__dict__.get("_trainer")

    def restore(self, model: "XModule") -> None:
        model.load_state_dict(self.weights)
        for module, training in self.modes:
            module.training = training  # each its own: train() would set the children's too
        model.trainer = self.trainer


def _has_attr(model: "XModule", name: str) -> bool:
    return hasattr(model, name) or name in model.hparams


def _lr_attribute(model: "XModule", attr_name: str) -> str:
    """Where the suggestion goes: ``attr_name``, else ``lr`` or ``learning_rate``, on the module or in
    its ``hparams``."""
    if attr_name:
        if not _has_attr(model, attr_name):
            raise AttributeError(f"lr_find(attr_name={attr_name!r}): {type(model).__name__} has no attribute "
                                 f"{attr_name!r} and no hparams entry of that name. Give the name of the attribute "
                                 "configure_optimizers reads the learning rate from, or update_attr=False.")
        return attr_name
    for name in ("lr", "learning_rate"):
        if _has_attr(model, name):
            return name
    raise AttributeError(f"lr_find(update_attr=True) writes the learning rate it finds to the module, but "
                         f"{type(model).__name__} has no attribute 'lr' or 'learning_rate' (nor an hparams entry of "
                         "either name). Store the learning rate in self.lr (or self.hparams.lr) and read it in "
                         "configure_optimizers, pass attr_name= to name another attribute, or pass "
                         "update_attr=False and read the suggestion from the result.")


def _set_lr(model: "XModule", name: str, lr: float) -> None:
    """Write ``lr`` wherever the module holds ``name``: its attribute and its ``hparams`` entry."""
    if name in model.hparams:
        model.hparams[name] = lr
    if hasattr(model, name):
        setattr(model, name, lr)
