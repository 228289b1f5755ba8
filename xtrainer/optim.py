"""What ``configure_optimizers`` may return, and stepping the learning-rate schedulers.

Accepted, as Lightning documents them: an optimizer; a list or tuple of optimizers;
``([optimizers], [schedulers])``; ``{"optimizer": ..., "lr_scheduler": scheduler or
{"scheduler": ..., "interval": "step" | "epoch", "frequency": n, "monitor": "metric", "name":
..., "strict": bool}}``; a list or tuple of such dicts. Several optimizers need manual
optimization (``automatic_optimization = False``), as in Lightning 2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

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


def parse_optimizers(config: Any, name: str, automatic: bool = True
                     ) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """The optimizers and the scheduler configurations in ``config``; ``name`` is the module's
    class name, for the messages; ``automatic``: automatic optimization, which takes one optimizer."""
    optimizers, schedulers = config, []
    if isinstance(config, dict):
        config = [config]
    if isinstance(config, (tuple, list)) and config and all(isinstance(item, dict) for item in config):
        optimizers, schedulers = [], []
        for item in config:
            if "optimizer" not in item:
                raise ValueError(f"{name}.configure_optimizers() returned a dict without an 'optimizer' key.")
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                schedulers.append(item["lr_scheduler"])
    elif isinstance(config, (tuple, list)) and len(config) == 2 and isinstance(config[0], (list, tuple)):
        optimizers, schedulers = config
    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError(f"{name}.configure_optimizers() must give torch.optim.Optimizer objects "
                         f"(got {[type(o).__name__ for o in optimizers]}).")
    if automatic and len(optimizers) > 1:
        raise ValueError(
            f"{name}.configure_optimizers() gave {len(optimizers)} optimizers. Several optimizers need manual "
            "optimization, as in Lightning 2: set self.automatic_optimization = False in __init__, then step them "
            "in training_step (opt_g, opt_d = self.optimizers(); self.manual_backward(loss); opt_g.step()).")
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
    return optimizers, parsed


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
    """The optimizer as the module sees it (Lightning's ``LightningOptimizer``): in an overridden
    ``optimizer_step``, and from ``self.optimizers()`` under manual optimization.

    ``step(closure)`` runs the closure, reduces gradients across replicas as the strategy does
    (``xla_native``; DDP and FSDP reduced them in backward), runs the before-step work
    (``on_before_optimizer_step``, then clipping asked for with ``clip_gradients``, on the reduced
    gradients), then steps, and calls ``after_step`` (the Trainer counts the step). Everything else
    is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Any, before_step: Callable[[], None] | None,
                 after_step: Callable[[], None] | None = None) -> None:
        self._optimizer, self._strategy = optimizer, strategy
        self._before_step, self._after_step = before_step, after_step
        self.pending_clip: Callable[[], None] | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        clip, self.pending_clip = self.pending_clip, None
        before = self._before_step
        if clip is not None:
            def before() -> None:
                if self._before_step is not None:
                    self._before_step()
                clip()
        self._strategy.optimizer_step(self._optimizer, before)
        if self._after_step is not None:
            self._after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def prefer_foreach(optimizer: torch.optim.Optimizer) -> int:
    """Turn on torch's ``foreach`` (multi-tensor) implementation in each parameter group of
    ``optimizer`` that left ``foreach`` unset (``None``), whose parameters are all XLA tensors,
    and where the optimizer offers it. Returns how many groups were changed.

    torch picks its per-tensor implementation for tensors that are not CUDA tensors, XLA ones
    included, unless ``foreach=True`` is given: on XLA that traces one small graph fragment per
    parameter per update, where ``foreach`` traces the update of all of them in a few list ops
    (the same arithmetic and the same compiled program size; measured: 10-15% less host CPU per
    step of a small MLP with AdamW, see ``benchmarks/RESULTS.md``). A group where the user chose
    (``foreach=False`` or ``True``), asked for ``fused=True`` or ``differentiable=True`` (neither
    combines with ``foreach``), or whose optimizer has no ``foreach`` option (a third-party one)
    is left alone: ``foreach=False`` is the way to opt out. The Trainer calls it on every optimizer
    ``configure_optimizers`` returns, before the first step, and keeps the choice across a resume
    (``keeping_foreach``)."""
    if "foreach" not in getattr(optimizer, "defaults", {}):
        return 0
    changed = 0
    for group in optimizer.param_groups:
        if group.get("foreach", False) is not None or group.get("fused") or group.get("differentiable"):
            continue
        params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
        if params and all(p.device.type == "xla" for p in params):
            group["foreach"] = True
            changed += 1
    return changed


@contextlib.contextmanager
def keeping_foreach(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Keep each group's ``foreach`` across a ``load_state_dict``, which would otherwise put back
    the saved run's: which implementation computes a step is this run's setting (``prefer_foreach``
    or the user's own), not state to resume."""
    chosen = [group.get("foreach") for group in optimizer.param_groups]
    yield
    for group, foreach in zip(optimizer.param_groups, chosen):
        if "foreach" in group:
            group["foreach"] = foreach
