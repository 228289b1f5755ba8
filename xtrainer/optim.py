"""What ``configure_optimizers`` may return, and stepping the learning-rate schedulers.

Accepted, as Lightning documents them: an optimizer; ``[optimizer]``; ``([optimizer],
[schedulers])``; ``{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ...,
"interval": "step" | "epoch", "frequency": n, "monitor": "metric", "name": ...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None


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
            unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "name"}
            if "scheduler" not in item or unknown:
                raise ValueError(f"A lr_scheduler dict needs 'scheduler' and may have 'interval', 'frequency', "
                                 f"'monitor' (unknown keys: {sorted(unknown)}).")
            config_item = SchedulerConfig(item["scheduler"], item.get("interval", "epoch"), item.get("frequency", 1),
                                          item.get("monitor"))
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
            raise KeyError(f"The scheduler monitors {config.monitor!r}, which was not logged. "
                           f"Logged: {sorted(metrics)}.")
        config.scheduler.step(metrics[config.monitor])
