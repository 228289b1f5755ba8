"""Building a run from its configuration: every place checked first (``plan``: nothing built),
then the strategy, callbacks, loggers, Trainer, model and data constructed (``build``);
``check_run`` builds only xtrainer's own classes (for ``xtrainer config``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional

from xtrainer.config.loading import flatten
from xtrainer.config.redaction import REDACTED, looks_secret
from xtrainer.config.schema import TARGET, ConfigError, RunConfig, one_line, trainer_kwargs
from xtrainer.config.settings import TrainerSettings
from xtrainer.config.targets import Target, check_arguments, check_name, place, resolve_target, targets_in


def _one_place(config: "RunConfig", key: str) -> tuple[Any, str]:
    """``trainer.<key>`` or the top-level ``<key>``; both set is refused."""
    inner, outer = getattr(config.trainer, key), getattr(config, key)
    if inner is not None and outer is not None:
        raise ConfigError(f"Both {key} and trainer.{key} are set; keep trainer.{key} (it mirrors Trainer({key}=...)).")
    return (inner, f"trainer.{key}") if inner is not None else (outer, key)




_STAGE_LIMITS = {"fit": "limit_train_batches", "validate": "limit_val_batches", "test": "limit_test_batches",
                 "predict": "limit_predict_batches"}


@dataclass
class Plan:
    """A ``RunConfig`` checked whole, nothing built yet: each place's ``Target``, the strategy's
    name or ``Target``, and the logger (a bool, or ``Target``s)."""

    strategy: Any
    strategy_where: str
    callbacks: List[Target]
    logger: Any
    model: Target
    data: Optional[Target]


def plan(config: RunConfig, stage: Optional[str] = None) -> Plan:
    """Refuse ``config`` before anything is built, or return what ``build`` will construct. Every
    ``_target_``'s form is checked before any module is imported; then each place's class is
    located and checked against the type the place expects (``place``), its arguments against
    its signature, and each nested ``_target_`` against the annotation of the parameter it fills;
    a ``_target_`` anywhere else is refused, as is a secret a saved ``config.yaml`` redacted, and
    a batch limit of ``stage`` that is 0."""
    tree = dataclasses.asdict(config)
    for where, dotted in targets_in(tree, ""):
        check_name(dotted, where)
    for name in TrainerSettings.names():
        for where, dotted in targets_in(getattr(config.trainer, name, None), f"trainer.{name}"):
            raise ConfigError(f"{where}.{TARGET}={dotted!r} is refused: trainer.{name} takes a plain value; a "
                              f"{TARGET} is taken by model, data, trainer.callbacks, trainer.logger, trainer.strategy "
                              "and the arguments of the classes they name.")
    _refuse_redacted(tree, "")
    strategy, strategy_where = _one_place(config, "strategy")
    strategy = _plan_strategy(strategy, strategy_where, config.trainer.accelerator, config.trainer.devices)
    specs, where = _one_place(config, "callbacks")
    callbacks = [resolve_target(spec, f"{where}[{i}]", place("callbacks")) for i, spec in enumerate(specs or [])]
    logger = config.trainer.logger
    if isinstance(logger, list):
        logger = [resolve_target(spec, f"trainer.logger[{i}]", place("logger")) for i, spec in enumerate(logger)]
    elif isinstance(logger, dict):
        logger = resolve_target(logger, "trainer.logger", place("logger"))
    elif not isinstance(logger, bool):
        raise ConfigError(f"trainer.logger={logger!r}: give true, false, a {{{TARGET}: ...}} or a list of them.")
    model = resolve_target(config.model, "model", place("model"))
    data = resolve_target(config.data, "data", place("data")) if config.data is not None else None
    name = _STAGE_LIMITS.get(stage or "")
    value = getattr(config.trainer, name, None) if name else None
    if value is not None and not isinstance(value, bool) and value == 0:
        raise ConfigError(f"trainer.{name}={value!r} leaves no batches to {stage}: give a number of batches (>= 1) "
                          "or a fraction in (0.0, 1.0].")
    return Plan(strategy, strategy_where, callbacks, logger, model, data)


def check(config: RunConfig, stage: Optional[str] = None) -> None:
    """``plan(config, stage)``, for its refusals only."""
    plan(config, stage)


def _refuse_redacted(node: Any, where: str) -> None:
    """A secret written as ``"***"`` (a saved ``config.yaml`` holds no secrets) is refused."""
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{where}.{k}" if where else str(k)
            if v == REDACTED and looks_secret(k):
                raise ConfigError(f"{key}='{REDACTED}' is a secret the saved configuration does not hold: give it as "
                                  f"{key}=... or as ${{oc.env:NAME}} in the config file.")
            _refuse_redacted(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_redacted(v, f"{where}[{i}]")


def _plan_strategy(strategy: Any, where: str, accelerator: str = "auto", devices: Any = "auto") -> Any:
    """A strategy's name (checked) or the ``Target`` of ``{name: ..., <option>: ...}`` or of
    ``{_target_: mypackage.MyStrategy, ...}`` (Lightning's names mean a strategy of the family
    ``accelerator`` runs)."""
    from xtrainer.strategies import STRATEGIES, known_name, lightning_name, resolve_strategy

    if strategy is None:
        return "auto"
    if isinstance(strategy, dict):
        options = dict(strategy)
        glued = [k for k, v in options.items() if isinstance(k, str) and ":" in k and v is None]
        if glued:
            key, value = glued[0].split(":", 1)
            raise ConfigError(f"{where} has a key {glued[0]!r}: YAML needs a space after the colon, "
                              f"{{{key}: {value}}}.")
        if TARGET in options:
            if "name" in options:
                raise ConfigError(f"{where} has both name and {TARGET}: give one (a strategy's name, or a class).")
            return resolve_target(options, where, place("strategy"))
        name = options.pop("name", None)
        name = lightning_name(name, accelerator, devices) if isinstance(name, str) else name
        if name not in STRATEGIES:
            raise ConfigError(f"{where}.name={name!r}: use one of {', '.join(STRATEGIES)}.")
        return Target(STRATEGIES[name], check_arguments(STRATEGIES[name], options, where), where)
    if known_name(strategy):
        return strategy
    try:
        resolve_strategy(strategy)  # not a name it knows: its message says which ones it does
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {one_line(err)}") from None
    raise ConfigError(f"{where}={strategy!r}: give a strategy's name or {{name: ..., <option>: ...}}.")


@dataclass
class Run:
    """The typed objects a ``RunConfig`` describes."""

    trainer: Any
    model: Any
    data: Any
    ckpt_path: Optional[str]


def build(config: RunConfig, stage: Optional[str] = None) -> Run:
    """Seed, ``plan(config, stage)`` (every check, nothing built), then construct the strategy,
    callbacks, loggers, Trainer, model and data of ``config``."""
    from xtrainer import seed_everything

    if config.seed is not None:
        seed_everything(config.seed)
    checked = plan(config, stage)  # after seeding, as importing a target may draw numbers
    trainer = _trainer(config, checked, own_only=False)
    model = checked.model.build()
    data = checked.data.build() if checked.data is not None else None
    trainer.record_run_config(flatten(config))
    return Run(trainer, model, data, config.ckpt_path)


def check_run(config: RunConfig, stage: Optional[str] = "fit") -> None:
    """Refuse ``config`` as ``build(config, stage)`` would, building nothing a configuration names
    but xtrainer's own classes (for ``xtrainer config``): ``plan``, then the strategy, xtrainer's
    callbacks and loggers and the Trainer, whose constructors check their values and create no
    file or folder (a Trainer claims its run folder when a run starts). Classes of your own
    (model, data, callbacks, loggers, a strategy) are checked against their signatures only."""
    _trainer(config, plan(config, stage), own_only=True)


def _trainer(config: RunConfig, checked: Plan, own_only: bool) -> Any:
    """The strategy, callbacks, loggers and ``Trainer`` of ``checked``; with ``own_only``, only
    those of xtrainer's own classes (the others are left out)."""
    from xtrainer import Trainer
    from xtrainer.strategies import resolve_strategy

    def chosen(targets: list[Target]) -> list[Any]:
        return [t.build() for t in targets if not own_only or t.is_own()]

    strategy = checked.strategy
    if isinstance(strategy, Target):
        strategy = strategy.build() if not own_only or strategy.is_own() else "auto"
    try:
        strategy = resolve_strategy(strategy, config.trainer.accelerator, config.trainer.devices)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{checked.strategy_where}: {one_line(err)}") from None
    callbacks = chosen(checked.callbacks)
    logger = checked.logger
    if isinstance(logger, Target):
        logger = (chosen([logger]) or [False])[0]
    elif isinstance(logger, list):
        logger = chosen(logger)
    try:
        return Trainer(strategy=strategy, callbacks=callbacks, logger=logger, **trainer_kwargs(config.trainer))
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"trainer: {one_line(err)}") from None
