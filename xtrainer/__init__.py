"""xtrainer: a Lightning-style Trainer for PyTorch on XLA devices, down to a laptop's CPU.

``from xtrainer import Trainer`` works as usual; the package itself imports nothing heavy, and
torch and torch_xla are imported when one of the names below is first used (PEP 562), so that
``xtrainer --help`` and ``xtrainer --version`` answer at once.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public name and the module that defines it, imported on first use.
_LAZY = {
    "Trainer": "xtrainer.trainer",
    "seed_everything": "xtrainer.trainer",
    "XModule": "xtrainer.module",
    "XDataModule": "xtrainer.datamodule",
    "TrainingInterrupted": "xtrainer.launch.interrupts",
}

__all__ = ["Trainer", "TrainingInterrupted", "XDataModule", "XModule", "__version__", "seed_everything"]



def _set_rank_zero_rank() -> None:
    """lightning-utilities' ``rank_zero_only`` (and ``rank_zero_warn``/``rank_zero_info``, which
    Lightning code and xtrainer use) refuse to run until ``rank_zero_only.rank`` is set. Lightning
    sets it when imported, from the launcher's environment; so does xtrainer, and every replica
    sets its own when it starts (``_xla.device``)."""
    import os

    from lightning_utilities.core.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", None) is None:
        for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
            value = os.environ.get(name, "")
            if value.isdigit():
                rank_zero_only.rank = int(value)
                return
        rank_zero_only.rank = 0


_set_rank_zero_rank()

if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from xtrainer.datamodule import XDataModule
    from xtrainer.launch.interrupts import TrainingInterrupted
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer, seed_everything


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # A subpackage (xtrainer.callbacks, ...), as ``import xtrainer`` used to make them reachable.
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'xtrainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
