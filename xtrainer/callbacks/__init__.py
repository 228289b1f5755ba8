"""Callbacks: hooks into the Trainer's loops (see ``Callback`` for the order they fire in)."""

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.checkpoint import MetricNotFoundError, ModelCheckpoint
from xtrainer.callbacks.early_stopping import EarlyStopping
from xtrainer.callbacks.health import RecompilationError, XlaHealth
from xtrainer.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from xtrainer.callbacks.lightning_names import (MISSING, BasePredictionWriter, DeviceStatsMonitor,
                                                GradientAccumulationScheduler, LambdaCallback, ModelSummary,
                                                RichModelSummary, RichProgressBar, Timer, TQDMProgressBar)
from xtrainer.callbacks.lr_monitor import LearningRateMonitor
from xtrainer.callbacks.profiler import XlaProfiler
from xtrainer.callbacks.progress import ProgressBar
from xtrainer.callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging
from xtrainer.loggers import TensorBoardLogger

__all__ = ["BackboneFinetuning", "BaseFinetuning", "BasePredictionWriter", "Callback", "DeviceStatsMonitor",
           "EMAWeightAveraging", "EarlyStopping", "GradientAccumulationScheduler", "LambdaCallback", "LearningRateMonitor",
           "MetricNotFoundError", "ModelCheckpoint", "ModelSummary", "ProgressBar", "RecompilationError",
           "RichModelSummary", "RichProgressBar", "TQDMProgressBar", "TensorBoardLogger", "Timer", "WeightAveraging",
           "XlaHealth", "XlaProfiler"]


def __getattr__(name: str) -> object:
    if name in MISSING:
        raise ImportError(f"xtrainer.callbacks has no {name} (a Lightning callback with no counterpart here): "
                          f"{MISSING[name]}.")
    raise AttributeError(f"module 'xtrainer.callbacks' has no attribute {name!r}")
