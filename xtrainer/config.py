"""Configuration: a dataclass schema, filled from YAML and ``key=value`` command-line overrides.

The entry point of a program turns the command line into a typed dataclass once::

    cfg = load_config(MyConfig, sys.argv[1:])      # --config run.yaml trainer.max_epochs=5
    trainer = Trainer(**trainer_kwargs(cfg.trainer))
    save_config(cfg, trainer.log_dir)              # the resolved config beside the run's logs

Nothing below the entry point sees an OmegaConf object. A key that is not in the schema, or a
value of the wrong type, fails here with the list of valid keys.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, TypeVar, Union

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")
CONFIG_FILE = "config.yaml"


@dataclass
class TrainerConfig:
    """The ``Trainer``'s constructor arguments that a config file can set."""

    strategy: str = "xla_native"
    devices: Any = "auto"
    max_epochs: Optional[int] = None
    max_steps: int = -1
    limit_train_batches: Union[int, float] = 1.0
    limit_val_batches: Union[int, float] = 1.0
    limit_test_batches: Union[int, float] = 1.0
    limit_predict_batches: Union[int, float] = 1.0
    val_check_interval: Union[int, float] = 1.0
    check_val_every_n_epoch: Optional[int] = 1
    log_every_n_steps: int = 50
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    precision: str = "32"
    default_root_dir: Optional[str] = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    detect_nonfinite: str = "raise"


def trainer_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """``Trainer(**trainer_kwargs(cfg.trainer))``."""
    return dataclasses.asdict(config)


def load_config(schema: type[T], argv: Sequence[str] = ()) -> T:
    """An instance of ``schema`` from ``--config FILE.yaml`` (optional) and ``a.b=value`` items.

    Later sources override earlier ones: the schema's defaults, then the YAML file, then the
    command-line items, in order.
    """
    argv = list(argv)
    yaml_paths, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML file after it.")
            yaml_paths.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            yaml_paths.append(arg.split("=", 1)[1])
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ValueError(f"Unexpected argument {arg!r}: give --config FILE.yaml and key=value overrides "
                             f"(valid keys: {', '.join(_keys(schema))}).")
        i += 1
    config = OmegaConf.structured(schema)
    try:
        for path in yaml_paths:
            if not os.path.exists(path):
                raise FileNotFoundError(f"Config file {path!r} does not exist.")
            config = OmegaConf.merge(config, OmegaConf.load(path))
        config = OmegaConf.merge(config, OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(config)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise ValueError(f"Invalid configuration: {err.msg if hasattr(err, 'msg') else err}. "
                         f"Valid keys: {', '.join(_keys(schema))}.") from None


def save_config(config: Any, directory: str | os.PathLike) -> str:
    """Write the resolved ``config`` as ``config.yaml`` in ``directory``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.fspath(directory), CONFIG_FILE)
    OmegaConf.save(OmegaConf.structured(config), path, resolve=True)
    return path


def _keys(schema: Any, prefix: str = "") -> list[str]:
    keys = []
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(field.type) or (isinstance(field.default_factory, type)
                                                    and dataclasses.is_dataclass(field.default_factory)):
            keys += _keys(field.default_factory, prefix + field.name + ".")
        else:
            keys.append(prefix + field.name)
    return keys
