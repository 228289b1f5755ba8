"""What ``configure_optimizers`` may return, and stepping the learning-rate schedulers.

Accepted, as Lightning documents them: an optimizer; ``[optimizer]``; ``([optimizer],
[schedulers])``; ``{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ...,
"interval": "step" | "epoch", "frequency": n, "monitor": "metric", "name": ...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True  # a monitored metric that is missing: an error (True) or a warning and no step
    name: str | None = None


def parse_optimizers(config: Any, name: str) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    """The optimizer and the scheduler configurations in ``config``; ``name`` is the module's class
    name, for the messages."""
    optimizers, schedulers = config, []
    if isinstance(config, dict):
        if "optimizer" not in config:
            raise ValueError(f"{name}.configure_optimizers() returned a dict without an 'optimizer' key.")
        optimizers, schedulers = config["optimizer"], config.get("lr_scheduler")
    elif isinstance(config, (tuple, list)) and len(config) == 2 and isinstance(config[0], (list, tuple)):
        optimizers, schedulers = config
    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        raise ValueError(f"{name}.configure_optimizers() must give exactly one torch.optim.Optimizer "
                         f"(got {[type(o).__name__ for o in optimizers]}).")
    if schedulers is None:
        schedulers = []
    schedulers = list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
    parsed = []
    for item in schedulers:
        if isinstance(item, dict):
            unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
            if "scheduler" not in item or unknown:
                raise ValueError(f"A lr_scheduler dict needs 'scheduler' and may have 'interval', 'frequency', "
                                 f"'monitor', 'strict', 'name' (unknown keys: {sorted(unknown)}).")
            config_item = SchedulerConfig(item["scheduler"], item.get("interval", "epoch"), item.get("frequency", 1),
                                          item.get("monitor"), bool(item.get("strict", True)), item.get("name"))
        else:
            config_item = SchedulerConfig(item)
        if config_item.interval not in ("step", "epoch"):
            raise ValueError(f"lr_scheduler interval={config_item.interval!r}: use 'step' or 'epoch'.")
        if isinstance(config_item.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not config_item.monitor:
            raise ValueError("ReduceLROnPlateau needs {'scheduler': ..., 'monitor': 'metric_name'}.")
        parsed.append(config_item)
    return optimizers[0], parsed


def step_schedulers(schedulers: list[SchedulerConfig], interval: str, count: int, metrics: dict[str, float]) -> None:
    """Step the schedulers of ``interval`` whose frequency divides ``count`` (the global step, or
    the number of epochs done); a monitoring scheduler gets its metric from ``metrics``."""
    for config in schedulers:
        if config.interval != interval or count % config.frequency:
            continue
        if config.monitor is None:
            config.scheduler.step()
            continue
        if config.monitor not in metrics:
            message = (f"The scheduler monitors {config.monitor!r}, which was not logged. "
                       f"Logged: {sorted(metrics)}.")
            if config.strict:
                raise KeyError(message + " Log it, or set 'strict': False in the lr_scheduler dict to skip the step.")
            rank_zero_warn(message + " The scheduler does not step ('strict': False).")
            continue
        config.scheduler.step(metrics[config.monitor])


class StrategyOptimizer:
    """The optimizer as an overridden ``optimizer_step`` sees it (Lightning's ``LightningOptimizer``):
    ``step(closure)`` runs the closure, reduces gradients across replicas as the strategy does,
    runs the before-step work (``on_before_optimizer_step``, clipping), then steps. Everything else
    is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Any, before_step: Callable[[], None] | None) -> None:
        self._optimizer, self._strategy, self._before_step = optimizer, strategy, before_step

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        self._strategy.optimizer_step(self._optimizer, self._before_step)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
