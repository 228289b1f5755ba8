"""The configuration's schema: ``RunConfig`` (what ``xtrainer fit|validate|test|predict`` reads),
``TrainerConfig`` (the Trainer's settings as a file sets them), ``ConfigError`` and the wording
its messages share."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from omegaconf import MISSING

from xtrainer.config.settings import TrainerSettings

CONFIG_FILE = "config.yaml"
TARGET = "_target_"


class ConfigError(ValueError):
    """A configuration that cannot run: the message says which key and what to do."""


@dataclass
class TrainerConfig(TrainerSettings):
    """The ``Trainer``'s arguments as a config file sets them, laid out as ``Trainer(...)`` takes
    them (as LightningCLI does): ``TrainerSettings`` (the same dataclass ``Trainer.__init__``
    reads), plus ``strategy`` (a name, or ``{name: ..., <option>: ...}``), ``callbacks`` (a list of
    ``{_target_: ...}``) and ``logger`` (true, false, a ``{_target_: ...}`` or a list of them)."""

    strategy: Any = None
    callbacks: Optional[List[Any]] = None
    logger: Any = True


@dataclass
class RunConfig:
    """Everything ``xtrainer fit|validate|test|predict`` needs."""

    model: Dict[str, Any] = MISSING
    data: Optional[Dict[str, Any]] = None
    strategy: Any = None  # also accepted here, outside ``trainer`` (one of the two places)
    callbacks: Optional[List[Any]] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: Optional[int] = None
    ckpt_path: Optional[str] = None


def trainer_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """``Trainer(**trainer_kwargs(cfg.trainer))`` for the plain settings (no ``strategy``,
    ``callbacks`` or ``logger``: ``build`` makes those objects)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("strategy", "callbacks", "logger")}



def one_line(text: Any) -> str:
    """``text`` on one line (what every ``ConfigError`` is)."""
    return " ".join(str(text).split())


def type_name(tp: Any) -> str:
    """An annotation as a message names it: ``int``, ``float or str``, ``value`` for none."""
    if tp is None:
        return "value"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Union:
        return " or ".join(type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))
