"""Lightning's type aliases (``lightning.pytorch.utilities.types``) for annotations in ported code."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch
from torch.utils.data import DataLoader

#: What ``training_step`` and the other steps may return.
STEP_OUTPUT = Union[torch.Tensor, Mapping[str, Any], None]
#: What ``train_dataloader`` may return.
TRAIN_DATALOADERS = Any
#: What ``val_dataloader``/``test_dataloader``/``predict_dataloader`` may return.
EVAL_DATALOADERS = Union[DataLoader, Sequence[DataLoader], Any]
#: What ``configure_optimizers`` may return.
OptimizerLRScheduler = Any

__all__ = ["EVAL_DATALOADERS", "OptimizerLRScheduler", "STEP_OUTPUT", "TRAIN_DATALOADERS"]
