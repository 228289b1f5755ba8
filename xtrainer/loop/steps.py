"""What the Trainer asks of the user's module: the checks a module passes before a run, the
batch-transfer hooks, and the loss a ``training_step`` must return. How a step is called (the
``StepDispatcher`` a strategy wraps) is the strategy's: ``strategies/base.py``."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.callbacks.base import check_hook_names
from xtrainer.module import MODEL_MODE_HOOKS, MODULE_HOOKS, BatchTransferHooks, XModule
from xtrainer.strategies.base import STEP_METHODS

#: Lightning's batch-transfer hooks, in the order a batch goes through them.
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class BatchTransfer:
    """A drawn batch through the batch-transfer hooks (``BatchTransferHooks``): ``(batch,
    dataloader_idx) -> batch``."""

    def __init__(self, hooks: list[Callable[..., Any]], device: torch.device) -> None:
        self.before, self.move, self.after = hooks
        self.device = device

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        batch = self.before(batch, dataloader_idx)
        return self.after(self.move(batch, self.device, dataloader_idx), dataloader_idx)


def batch_transfer(module: XModule, datamodule: Any, device: torch.device) -> BatchTransfer | None:
    """The batch-transfer hooks of a run, where the module or its data module overrides any
    (the data module's where both do, as in Lightning); None where neither does."""
    hooks, overridden = [], False
    for name in TRANSFER_HOOKS:
        default = getattr(BatchTransferHooks, name)
        of_module = getattr(type(module), name, default) is not default
        of_data = datamodule is not None and getattr(type(datamodule), name, default) is not default
        if of_module and of_data:
            rank_zero_warn(f"{name} is overridden in both {type(module).__name__} and {type(datamodule).__name__}: "
                           f"the data module's is used, as in Lightning.")
        overridden = overridden or of_module or of_data
        hooks.append(getattr(datamodule if of_data else module, name))
    return BatchTransfer(hooks, device) if overridden else None


def check_module(model: Any, stage: str) -> None:
    """Refuse, before anything starts, a module that cannot run ``stage``."""
    if not isinstance(model, XModule):
        raise TypeError(f"{stage}() takes an xtrainer.XModule, got {type(model).__name__}.")
    check_hook_names(model, MODULE_HOOKS | MODEL_MODE_HOOKS | set(TRANSFER_HOOKS), XModule)
    if stage == "fit":
        if type(model).training_step is XModule.training_step:
            raise NotImplementedError(f"{type(model).__name__} has no training_step(self, batch, batch_idx).")
        if type(model).configure_optimizers is XModule.configure_optimizers \
                and "configure_optimizers" not in vars(model):  # LightningCLI's --optimizer sets one
            raise NotImplementedError(
                f"{type(model).__name__} has no configure_optimizers(). Return an optimizer, "
                "(optimizers, schedulers), or {'optimizer': ..., 'lr_scheduler': ...}.")


def check_eval_step(model: XModule, stage: str) -> None:
    """Refuse to validate or test a module without the step for it."""
    step = STEP_METHODS[stage]
    if stage != "predict" and getattr(type(model), step) is getattr(XModule, step):
        raise ValueError(f"{type(model).__name__} has no {step}(self, batch, batch_idx) to {stage} with.")


def training_loss(outputs: Any) -> torch.Tensor:
    """The scalar loss in what ``training_step`` returned (a tensor, or a dict with ``loss``)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None:
        raise ValueError(
            "training_step returned a dict without a 'loss' tensor. Return the loss tensor or a dict with a 'loss' "
            "entry (or None itself to skip the batch).")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step must return a tensor or a dict with 'loss', got {type(outputs).__name__}.")
    if loss.numel() != 1:
        raise ValueError(f"training_step returned a loss of shape {tuple(loss.shape)}; it must be a scalar "
                         "(reduce it with .mean() or .sum()).")
    if not loss.requires_grad:
        raise ValueError("training_step returned a loss that does not require grad: it is detached from the "
                         "model's parameters (was it computed under torch.no_grad(), or with .detach()?).")
    return loss if loss.dim() == 0 else loss.reshape(())
