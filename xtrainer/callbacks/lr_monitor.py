"""``LearningRateMonitor``: log learning rates under Lightning's names, on Lightning's schedule."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.callbacks.base import Callback
from xtrainer.loop.publishing import automatic_lr_names
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class LearningRateMonitor(Callback):
    """Log each optimizer's learning rate (and momentum, weight decay) as Lightning's
    ``LearningRateMonitor`` does.

    Names, as Lightning's: ``lr-<Optimizer>`` (``lr-Adam``); ``lr-Adam/pg1``, ``lr-Adam/pg2``... for
    several parameter groups (or the group's ``"name"``); a scheduler's ``"name"`` in the
    ``lr_scheduler`` dict replaces ``lr-<Optimizer>``; a second optimizer of the same class is
    ``lr-Adam-1``. ``log_momentum`` adds ``<name>-momentum`` (``betas[0]`` for Adam-like
    optimizers, else the group's ``momentum``, 0 without one); ``log_weight_decay`` adds
    ``<name>-weight_decay``.

    When, as Lightning's: ``logging_interval="step"``: at every logging step
    (``log_every_n_steps``), the rate the step used; ``"epoch"``: once per epoch, the rate at the
    epoch's start, logged then (at the step the epoch starts from); ``None``: each rate at its
    scheduler's interval, and the rate of an optimizer without a scheduler at both.

    How it relates to the automatic logging: without this callback xtrainer already logs every
    parameter group's rate as ``lr-<Optimizer>/pg<i>`` (``i`` counted from 0) with every value it
    reads during fit. With it, those keys are replaced by Lightning's names on Lightning's schedule
    (the two schemes differ: ``pg1`` is the second group there, the first one here), so no curve
    mixes two groups. Either way the rates are read from the optimizer on the host, riding on the
    values the trainer already reads: no extra device sync (a rate kept on the device as a tensor
    is not logged). The values also go into ``trainer.callback_metrics``, where ``ModelCheckpoint``
    or ``EarlyStopping`` can monitor them, and into ``lrs`` (``{name: [values logged]}``).

    As in Lightning, the Trainer needs a logger: ``logger=False`` is refused when training starts.
    """

    def __init__(self, logging_interval: Literal["step", "epoch"] | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"LearningRateMonitor(logging_interval={logging_interval!r}): use 'step', 'epoch' or "
                             "None.")
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}
        self._in_batch = self._in_validation = False
        self._step_stats: dict[str, float] = {}
        self._kinds: dict[str, str] = {}  # "<name>-momentum": "momentum", ...

    # ---- hooks ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a Trainer with a logger (logger=False was given); as in "
                             "Lightning, it logs through the loggers. Drop the callback or give a logger.")
        if self.log_momentum:
            optimizers = [self._optimizer_of(config, trainer) for config in trainer.lr_scheduler_configs] \
                or list(trainer.optimizers)
            if any("momentum" not in opt.defaults and "betas" not in opt.defaults for opt in optimizers):
                rank_zero_warn("LearningRateMonitor(log_momentum=True): some optimizers have no momentum; a momentum "
                               "of 0 is logged for them.", category=RuntimeWarning)
        names = [name for _, group_names, _ in self._named(trainer) for name in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}
        self._in_batch = self._in_validation = False
        self._step_stats = {}

    def on_train_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int) -> None:
        self._in_batch = True
        if self.logging_interval != "epoch":  # the rates this step uses (host floats: no sync)
            self._step_stats = self._extract(trainer, "step" if self.logging_interval is None else "any")

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._in_batch = False

    def on_train_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None:
        """The rates the epoch starts with, logged now at the batches stepped so far (Lightning's
        ``_batches_that_stepped``), as Lightning logs them (host floats: no sync)."""
        if self.logging_interval == "step":
            return
        stats = self._extract(trainer, "epoch" if self.logging_interval is None else "any")
        if not stats:
            return
        self._record(trainer, stats)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(dict(stats), trainer.loop.batches_stepped)

    def on_validation_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._in_validation = True

    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._in_validation = False

    def on_metrics(self, trainer: "TrainerView", module: "XModule", metrics: dict[str, float], step: int) -> None:
        """Replace the automatic ``lr-<Optimizer>/pg<i>`` keys by Lightning's, when they are due:
        the step's rates at a logging step (the epoch's were logged as it started)."""
        if trainer.state != "fit":
            return
        for name, _ in automatic_lr_names(trainer.optimizers):
            metrics.pop(name, None)
        if self._in_validation or not self._in_batch:
            return
        stats, self._step_stats = self._step_stats, {}
        if not stats:
            return
        metrics.update(stats)
        self._record(trainer, stats)

    def _record(self, trainer: "TrainerView", stats: dict[str, float]) -> None:
        """``stats`` into ``trainer.callback_metrics`` (monitorable) and into ``lrs`` and the last
        momentum and weight decay values."""
        trainer.callback_metrics.update(stats)
        for name, value in stats.items():
            kind = self._kinds.get(name)
            if kind == "momentum":
                self.last_momentum_values[name] = value
            elif kind == "weight_decay":
                self.last_weight_decay_values[name] = value
            else:
                self.lrs.setdefault(name, []).append(value)

    # ---- names and values -----------------------------------------------------------------------
    def _extract(self, trainer: "TrainerView", interval: str) -> dict[str, float]:
        """The rates (and momenta, weight decays) due at ``interval`` (``"step"``, ``"epoch"`` or
        ``"any"``), by Lightning's names."""
        stats: dict[str, float] = {}
        for optimizer, names, scheduled in self._named(trainer):
            if scheduled is not None and interval not in (scheduled, "any"):
                continue
            use_betas = "betas" in optimizer.defaults
            for group, name in zip(optimizer.param_groups, names):
                lr = _host_float(group.get("lr"))
                if lr is None:
                    continue  # kept on the device: reading it would be a sync
                stats[name] = lr
                self._kinds[name] = "lr"
                if self.log_momentum:
                    momentum = group["betas"][0] if use_betas and "betas" in group else group.get("momentum", 0)
                    momentum = _host_float(momentum)
                    if momentum is not None:
                        stats[f"{name}-momentum"] = momentum
                        self._kinds[f"{name}-momentum"] = "momentum"
                if self.log_weight_decay:
                    decay = _host_float(group.get("weight_decay", 0))
                    if decay is not None:
                        stats[f"{name}-weight_decay"] = decay
                        self._kinds[f"{name}-weight_decay"] = "weight_decay"
        return stats

    @staticmethod
    def _optimizer_of(config: Any, trainer: "TrainerView") -> Any:
        return getattr(config.scheduler, "optimizer", None) or trainer.optimizers[0]

    def _named(self, trainer: "TrainerView") -> list[tuple[Any, list[str], str | None]]:
        """``(optimizer, one name per parameter group, its scheduler's interval or None)``: the
        scheduled optimizers first, then those without a scheduler, as Lightning names them."""
        seen: list[Any] = []
        seen_types: defaultdict[type, int] = defaultdict(int)
        named = []
        for config in trainer.lr_scheduler_configs:
            optimizer = self._optimizer_of(config, trainer)
            name = config.name if getattr(config, "name", None) is not None else f"lr-{type(optimizer).__name__}"
            named.append((optimizer, self._group_names(optimizer, name, seen, seen_types, config.name is None),
                          config.interval))
        for optimizer in trainer.optimizers:
            optimizer = getattr(optimizer, "optimizer", optimizer)
            if any(optimizer is other for other in seen):
                continue
            named.append((optimizer, self._group_names(optimizer, f"lr-{type(optimizer).__name__}", seen, seen_types,
                                                       True), None))
        return named

    @staticmethod
    def _group_names(optimizer: Any, name: str, seen: list[Any], seen_types: defaultdict[type, int],
                     counted: bool) -> list[str]:
        seen.append(optimizer)
        kind = type(optimizer)
        if counted:
            seen_types[kind] += 1
        groups = optimizer.param_groups
        group_names = [group.get("name", f"pg{i}") for i, group in enumerate(groups, start=1)]
        repeated = sorted({n for n in group_names if group_names.count(n) > 1})
        if repeated:
            raise ValueError(f"LearningRateMonitor: {name} has parameter groups with the same 'name' {repeated}; "
                             "give each group its own name.")
        if kind in seen_types and seen_types[kind] > 1:
            name = f"{name}-{seen_types[kind] - 1}"
        if len(groups) > 1:
            return [f"{name}/{group_name}" for group_name in group_names]
        return [f"{name}/{groups[0]['name']}" if groups[0].get("name") else name]


def _host_float(value: Any) -> float | None:
    """``value`` as a float if that needs no device sync (None for an XLA tensor)."""
    if value is None or (isinstance(value, torch.Tensor) and value.device.type != "cpu"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
