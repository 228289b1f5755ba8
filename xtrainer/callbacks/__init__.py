"""Callbacks: hooks into the Trainer's loops (see ``Callback`` for the order they fire in)."""

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.checkpoint import MetricNotFoundError, ModelCheckpoint
from xtrainer.callbacks.early_stopping import EarlyStopping
from xtrainer.callbacks.health import RecompilationError, XlaHealth
from xtrainer.callbacks.lr_monitor import LearningRateMonitor
from xtrainer.callbacks.profiler import XlaProfiler
from xtrainer.callbacks.progress import ProgressBar
from xtrainer.loggers import TensorBoardLogger

__all__ = ["Callback", "EarlyStopping", "LearningRateMonitor", "MetricNotFoundError", "ModelCheckpoint", "ProgressBar",
           "RecompilationError", "TensorBoardLogger", "XlaHealth", "XlaProfiler"]
