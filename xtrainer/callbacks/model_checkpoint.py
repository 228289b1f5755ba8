"""``lightning.pytorch.callbacks.model_checkpoint``, where a Lightning project imports
``ModelCheckpoint`` from: the callback is ``xtrainer.callbacks.checkpoint``'s."""

from xtrainer.callbacks.checkpoint import ModelCheckpoint

__all__ = ["ModelCheckpoint"]
