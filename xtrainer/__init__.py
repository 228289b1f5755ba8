"""xtrainer: a Lightning-style Trainer for PyTorch on XLA devices, down to a laptop's CPU."""

__version__ = "0.1.0"

from xtrainer.interrupts import TrainingInterrupted  # noqa: E402
from xtrainer.datamodule import XDataModule  # noqa: E402
from xtrainer.module import XModule  # noqa: E402
from xtrainer.trainer import Trainer, seed_everything  # noqa: E402

__all__ = ["Trainer", "TrainingInterrupted", "XDataModule", "XModule", "__version__", "seed_everything"]
