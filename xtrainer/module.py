"""``XModule``: the user's model, steps and optimizers, with Lightning's hook names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

if TYPE_CHECKING:
    from xtrainer.trainer import Trainer



class XModule(nn.Module):
    """Subclass this instead of ``lightning.LightningModule``; the hook names are the same.

    Required: ``training_step`` and ``configure_optimizers``. Everything else is optional.
    Inside the steps, ``self.log`` records values on the device; they are read back to the host
    only every ``log_every_n_steps`` optimizer steps and at the end of an epoch.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.hparams: dict[str, Any] = {}

    # ---- what the Trainer provides -------------------------------------------------------
    @property
    def trainer(self) -> "Trainer":
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer yet.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: "Trainer | None") -> None:
        self._trainer = trainer

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        if self._trainer is not None:
            return self._trainer.strategy.device
        return torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    def save_hyperparameters(self, **hparams: Any) -> None:
        """Record hyper-parameters: written to checkpoints and to the logger."""
        self.hparams.update(hparams)

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer is not part of the module: a module pickled for a replica, or deep-copied,
        # travels without it and is attached to that replica's Trainer there.
        state = self.__dict__.copy()
        state["_trainer"] = None
        return state

    # ---- logging ---------------------------------------------------------------------------
    def log(self, name: str, value: Any, on_step: bool | None = None, on_epoch: bool | None = None,
            prog_bar: bool = False, sync_dist: bool = False, reduce_fx: str = "mean",
            batch_size: int | None = None) -> None:
        """Record a scalar. Defaults: per step in ``training_step``, per epoch elsewhere.

        ``value`` stays on the device. ``reduce_fx`` (``"mean"``, weighted by batch size, or
        ``"sum"``, ``"max"``, ``"min"``) combines the values of an epoch; ``sync_dist=True`` also
        combines them across replicas, inside the graph.
        """
        self.trainer._results.log(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar,
                                  sync_dist=sync_dist, reduce_fx=reduce_fx, batch_size=batch_size)

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    # ---- the steps ---------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not define training_step(self, batch, batch_idx); "
            "it must return the loss tensor or a dict with a 'loss' entry."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define validation_step(self, batch, batch_idx).")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define test_step(self, batch, batch_idx).")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Default: ``self(batch)`` (or ``self(inputs)`` for an ``(inputs, target)`` batch)."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            batch = batch[0]
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not define configure_optimizers(). Return an optimizer, "
            "(optimizers, schedulers), or {'optimizer': ..., 'lr_scheduler': ...}."
        )

    def configure_model(self) -> None:
        """Build (and, under ``xla_fsdp``, wrap) submodules once the strategy is set up."""

    # ---- data (optional) -----------------------------------------------------------------------
    # train_dataloader(), val_dataloader(), test_dataloader(), predict_dataloader(): define any of
    # them to have the Trainer use it when fit()/validate()/... receive no loaders.

    # ---- hooks (no-ops) -----------------------------------------------------------------------
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_exception(self, exception: BaseException) -> None: ...


#: Hooks an ``XModule`` may override, besides the ``*_step`` methods and ``configure_*``: its
#: ``on_*`` methods, each also a ``Callback`` hook of the same name (the module's runs first).
MODULE_HOOKS = frozenset(name for name in vars(XModule) if name.startswith("on_"))
