"""What ``configure_optimizers`` may return, and stepping the learning-rate schedulers.

Accepted, as Lightning documents them:

- an optimizer;
- a list or tuple of optimizers;
- two lists, ``([optimizers], [schedulers])`` (the second may be one scheduler);
- a dict ``{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "step" |
  "epoch", "frequency": n, "monitor": "metric", "name": ..., "strict": bool}, "monitor": "metric"}``
  (``"lr_scheduler"`` and the top-level ``"monitor"``, used by a ``ReduceLROnPlateau``, optional);
- a list or tuple of such dicts;
- ``None``: the fit runs without an optimizer (steps count; nothing is updated), with a warning.

Several optimizers need manual optimization (``automatic_optimization = False``), as in Lightning 2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "name", "strict", "reduce_on_plateau"}
_CONFIG_KEYS = {"optimizer", "lr_scheduler", "monitor"}


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True  # a monitored metric that is missing: an error (True) or a warning and no step
    name: str | None = None
    #: Whether ``step`` takes the monitored metric (Lightning's name; a ``ReduceLROnPlateau`` by default).
    reduce_on_plateau: bool = field(default=False)


class NoOptimizer(torch.optim.Optimizer):
    """What a fit steps when ``configure_optimizers`` returned ``None``: no parameters, a step
    that only runs its closure (Lightning's meaning: the fit runs with no optimizer)."""

    def __init__(self) -> None:
        super().__init__([{"params": []}], {"lr": 0.0})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none


def parse_optimizers(config: Any, name: str, automatic: bool = True
                     ) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """The optimizers and the scheduler configurations in ``config``; ``name`` is the module's
    class name, for the messages; ``automatic``: automatic optimization, which takes one optimizer."""
    where = f"{name}.configure_optimizers()"
    monitor = None
    if config is None:
        rank_zero_warn(f"{where} returned None: this fit runs with no optimizer (nothing is updated).")
        return [NoOptimizer()], []
    if isinstance(config, torch.optim.Optimizer):
        optimizers, schedulers = [config], []
    elif isinstance(config, dict):
        _check_config_dict(config, where)
        optimizers, monitor = [config["optimizer"]], config.get("monitor")
        schedulers = [config["lr_scheduler"]] if config.get("lr_scheduler") is not None else []
    elif isinstance(config, (list, tuple)) and config and all(isinstance(item, dict) for item in config):
        for item in config:
            _check_config_dict(item, where)
        optimizers = [item["optimizer"] for item in config]
        schedulers = [_with_monitor(item["lr_scheduler"], item.get("monitor"))
                      for item in config if item.get("lr_scheduler") is not None]
    elif (isinstance(config, (list, tuple)) and len(config) == 2 and isinstance(config[0], (list, tuple))
          and all(isinstance(o, torch.optim.Optimizer) for o in config[0])):
        optimizers = list(config[0])
        schedulers = list(config[1]) if isinstance(config[1], (list, tuple)) else [config[1]]
    elif isinstance(config, (list, tuple)) and config and all(isinstance(o, torch.optim.Optimizer) for o in config):
        optimizers, schedulers = list(config), []
    else:
        raise ValueError(f"{where} returned {_describe(config)}, which is not a form Lightning documents: return an "
                         "optimizer, a list of optimizers, ([optimizers], [schedulers]), {'optimizer': ..., "
                         "'lr_scheduler': ..., 'monitor': ...}, a list of such dicts, or None.")
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError(f"{where} must give torch.optim.Optimizer objects "
                         f"(got {[type(o).__name__ for o in optimizers]}).")
    if automatic and len(optimizers) > 1:
        raise ValueError(
            f"{where} gave {len(optimizers)} optimizers. Several optimizers need manual "
            "optimization, as in Lightning 2: set self.automatic_optimization = False in __init__, then step them "
            "in training_step (opt_g, opt_d = self.optimizers(); self.manual_backward(loss); opt_g.step()).")
    parsed = [_scheduler_config(item, monitor, where) for item in schedulers if item is not None]
    for config_item in parsed:
        owner = getattr(config_item.scheduler, "optimizer", None)
        if owner is not None and not any(owner is o for o in optimizers):
            raise ValueError(f"{where}: a scheduler ({type(config_item.scheduler).__name__}) is attached to an "
                             "optimizer that configure_optimizers did not return; return that optimizer too.")
    return optimizers, parsed


def _check_config_dict(item: dict, where: str) -> None:
    if "optimizer" not in item:
        raise ValueError(f"{where} returned a dict without an 'optimizer' key (keys: {sorted(item)}).")
    unknown = set(item) - _CONFIG_KEYS
    if unknown:
        rank_zero_warn(f"{where}: unknown keys {sorted(unknown)} in the returned dict are ignored (known: "
                       f"{sorted(_CONFIG_KEYS)}).")


def _with_monitor(scheduler: Any, monitor: str | None) -> Any:
    """A list item's own top-level ``monitor`` belongs to its scheduler."""
    if monitor is None:
        return scheduler
    if isinstance(scheduler, dict):
        return {"monitor": monitor, **scheduler}
    return {"scheduler": scheduler, "monitor": monitor}


def _scheduler_config(item: Any, monitor: str | None, where: str) -> SchedulerConfig:
    """One scheduler, bare or as Lightning's scheduler dict; ``monitor``: the config dict's own
    top-level ``"monitor"``, for a scheduler that names none."""
    if isinstance(item, dict):
        if "scheduler" not in item:
            raise ValueError(f"{where}: a lr_scheduler dict needs a 'scheduler' key (keys: {sorted(item)}).")
        unknown = set(item) - _SCHEDULER_KEYS
        if unknown:
            rank_zero_warn(f"{where}: unknown keys {sorted(unknown)} in the lr_scheduler dict are ignored (known: "
                           f"{sorted(_SCHEDULER_KEYS)}).")
        scheduler = item["scheduler"]
        plateau = bool(item.get("reduce_on_plateau", isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)))
        config = SchedulerConfig(scheduler, item.get("interval", "epoch"), item.get("frequency", 1),
                                 item.get("monitor", monitor), bool(item.get("strict", True)), item.get("name"),
                                 plateau)
    else:
        plateau = isinstance(item, torch.optim.lr_scheduler.ReduceLROnPlateau)
        config = SchedulerConfig(item, monitor=monitor, reduce_on_plateau=plateau)
    if not (hasattr(config.scheduler, "step") and hasattr(config.scheduler, "state_dict")):
        raise ValueError(f"{where}: {_describe(config.scheduler)} is not a learning-rate scheduler (one from "
                         "torch.optim.lr_scheduler, or an object with step() and state_dict()).")
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"{where}: lr_scheduler interval={config.interval!r}; use 'step' or 'epoch'.")
    if not isinstance(config.frequency, int) or isinstance(config.frequency, bool) or config.frequency < 1:
        raise ValueError(f"{where}: lr_scheduler frequency={config.frequency!r}; give a positive int.")
    if config.reduce_on_plateau and not config.monitor:
        raise ValueError(f"{where}: ReduceLROnPlateau needs a metric to monitor: return {{'optimizer': ..., "
                         "'lr_scheduler': scheduler, 'monitor': 'val_loss'}, or {'scheduler': ..., 'monitor': ...} "
                         "as the lr_scheduler.")
    return config


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {[type(v).__name__ for v in value]}"
    return f"a {type(value).__name__}"


def step_schedulers(schedulers: list[SchedulerConfig], interval: str, count: int, metrics: Any,
                    step: Callable[[Any, Any], None] | None = None, plateau: bool | None = None) -> None:
    """Step the schedulers of ``interval`` whose frequency divides ``count`` (the global step, or
    the number of epochs done); a ``ReduceLROnPlateau`` (``reduce_on_plateau``) gets its monitored
    metric from ``metrics`` (a dict, or a callable giving one: asked only where such a scheduler
    steps). ``step(scheduler, metric)``: the module's ``lr_scheduler_step``, where it overrides
    it. ``plateau``: those that monitor a metric alone (True), the others alone (False), or all."""
    step = step or step_scheduler
    for config in schedulers:
        if config.interval != interval or count % config.frequency:
            continue
        if plateau is not None and config.reduce_on_plateau != plateau:
            continue
        if config.reduce_on_plateau and callable(metrics):
            metrics = metrics()
        if not config.reduce_on_plateau:
            step(config.scheduler, None)
            continue
        if config.monitor not in metrics:
            message = (f"The scheduler monitors {config.monitor!r}, which was not logged. "
                       f"Logged: {sorted(metrics)}.")
            if config.strict:
                raise KeyError(message + " Log it, or set 'strict': False in the lr_scheduler dict to skip the step.")
            rank_zero_warn(message + " The scheduler does not step ('strict': False).")
            continue
        step(config.scheduler, metrics[config.monitor])


def step_scheduler(scheduler: Any, metric: Any) -> None:
    """A scheduler's step, with the monitored metric where it has one (``XModule.lr_scheduler_step``'s default)."""
    if metric is None:
        scheduler.step()
    else:
        scheduler.step(metric)


class StrategyOptimizer:
    """The optimizer as the module sees it (Lightning's ``LightningOptimizer``): in an overridden
    ``optimizer_step``, and from ``self.optimizers()`` under manual optimization.

    ``step(closure)`` runs the closure, reduces gradients across replicas as the strategy does
    (``xla_native``; DDP and FSDP reduced them in backward), runs the before-step work
    (``on_before_optimizer_step``, then clipping asked for with ``clip_gradients``, on the reduced
    gradients), then steps, and calls ``after_step`` (the Trainer counts the step). Everything else
    is the wrapped optimizer's: ``StrategyOptimizer(adam, ...)`` is an instance of a subclass of
    both this class and ``type(adam)`` (``isinstance(opt, torch.optim.Adam)`` holds, as user code
    checks), whose every other method and attribute is the wrapped optimizer's own."""

    _OWN = ("_optimizer", "_strategy", "_before_step", "_after_step", "pending_clip")

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> "StrategyOptimizer":
        del args, kwargs
        if cls is StrategyOptimizer:
            cls = _wrapper_class(type(optimizer))
        return object.__new__(cls)

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

    def __getattr__(self, name: str) -> Any:  # instance attributes: param_groups, state, defaults...
        if name in StrategyOptimizer._OWN:
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in StrategyOptimizer._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._optimizer, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._optimizer!r})"


_WRAPPER_CLASSES: dict[type, type] = {}


def _wrapper_class(cls: type) -> type:
    """``StrategyOptimizer`` subclassed with ``cls``: every method ``cls`` has (its bases' too)
    forwards to the wrapped optimizer, so the wrapper never runs optimizer code on itself and
    shares no state of its own; ``step``/``zero_grad`` are the wrapper's."""
    found = _WRAPPER_CLASSES.get(cls)
    if found is not None:
        return found
    own = set(vars(StrategyOptimizer))
    namespace: dict[str, Any] = {"__module__": __name__, "__doc__": f"{cls.__name__}, stepped as the strategy does."}
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name in namespace or name in own or (name.startswith("__") and name not in ("__getstate__",
                                                                                          "__setstate__")):
                continue
            if isinstance(value, property):
                namespace[name] = property(lambda self, name=name: getattr(self._optimizer, name),
                                           lambda self, v, name=name: setattr(self._optimizer, name, v))
            elif callable(value) or isinstance(value, (staticmethod, classmethod)):
                namespace[name] = _forwarded(name)
    found = type(f"Strategy{cls.__name__}", (StrategyOptimizer, cls), namespace)
    _WRAPPER_CLASSES[cls] = found
    return found


def _forwarded(name: str) -> Callable[..., Any]:
    def method(self: StrategyOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._optimizer, name)(*args, **kwargs)

    method.__name__ = name
    return method


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
