"""Callbacks: hooks into the Trainer's loops (see ``Callback`` for the order they fire in)."""

from xtrainer.callbacks.base import Callback
from xtrainer.callbacks.checkpoint import ModelCheckpoint
from xtrainer.callbacks.early_stopping import EarlyStopping
from xtrainer.callbacks.progress import ProgressBar

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "ProgressBar"]
