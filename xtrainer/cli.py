"""The ``xtrainer`` command's public names, where Lightning has its CLI (``lightning.pytorch.cli``):
``main`` (what the ``xtrainer`` console script and ``python -m xtrainer.cli`` run) and
``run_stage`` (build a loaded configuration and run one stage from Python). The command lives in
``xtrainer/launch/cli.py``."""

from __future__ import annotations

import sys

from xtrainer.launch.cli import main, run_stage

__all__ = ["main", "run_stage"]

if __name__ == "__main__":
    sys.exit(main())
