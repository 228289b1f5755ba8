"""The command line's public names, where Lightning has its CLI (``lightning.pytorch.cli``):
``LightningCLI``, ``LightningArgumentParser`` and ``SaveConfigCallback`` for scripts written
with Lightning's CLI (``xtrainer/launch/lightning_cli.py``, imported when first named); ``main``
(what the ``xtrainer`` console script and ``python -m xtrainer.cli`` run) and ``run_stage`` (build
a loaded configuration and run one stage from Python), from ``xtrainer/launch/cli.py``."""

from __future__ import annotations

import sys
from typing import Any

from xtrainer.launch.cli import main, run_stage

_LIGHTNING_CLI = ("LightningCLI", "LightningArgumentParser", "SaveConfigCallback", "ReduceLROnPlateau",
                  "instantiate_class", "OptimizerCallable", "LRSchedulerCallable", "LRSchedulerTypeUnion",
                  "LRSchedulerTypeTuple", "ArgsType", "LR_SCHEDULERS")
__all__ = [*_LIGHTNING_CLI, "main", "run_stage"]


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_CLI:  # torch and jsonargparse only when asked for: `xtrainer --help` stays quick
        from xtrainer.launch import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

if __name__ == "__main__":
    sys.exit(main())
