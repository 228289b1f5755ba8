"""Lightning's weight averaging callbacks: ``WeightAveraging`` (SWA by default, any ``avg_fn`` or
``multi_avg_fn``) and ``EMAWeightAveraging`` (an exponential moving average).

The callback keeps an averaged copy of the module (a ``torch.optim.swa_utils.AveragedModel``),
updates it after the optimizer steps (and training epochs) that ``should_update`` picks, swaps
it in for every validation during the fit, and copies it into the module when training ends.
A checkpoint holds the averaged weights as its ``state_dict`` and the module's own as
``current_model_state`` (with ``averaging_state``: the number of updates), as Lightning writes
it, so that a resumed fit continues both exactly and ``load_from_checkpoint`` gives the averaged
weights.

Unlike torch's ``AveragedModel.update_parameters``, which decides between its first copy and an
average by reading its device counter (a host sync at every update), the counter is also kept on
the host here, and the copy lives on the device the module trains on (``device=None``): an
update is a few device ops that join the next step's graph, with no host sync.
"""

from __future__ import annotations

import copy
import itertools
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn, get_swa_multi_avg_fn

from xtrainer.callbacks.base import Callback
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule

try:  # where torch's AveragedModel runs its SWA average as one foreach op (as it decides)
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices as _foreach_devices
except ImportError:  # pragma: no cover - older or newer torch
    def _foreach_devices() -> list[str]:
        return ["cuda"]


class AveragedModule(AveragedModel):
    """``AveragedModel`` over a copy of a fitted module: the same ``state_dict`` (``module.*``
    and ``n_averaged``), built without copying the Trainer the module points to, and updated
    with a host-side count of its updates (``count``) so that no update reads the device."""

    def __init__(self, module: nn.Module, trainer: Any, device: Optional[Union[torch.device, int]] = None,
                 avg_fn: Optional[Callable] = None, multi_avg_fn: Optional[Callable] = None,
                 use_buffers: bool = False) -> None:
        nn.Module.__init__(self)
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("WeightAveraging: give avg_fn or multi_avg_fn, not both.")
        memo = {id(trainer): None} if trainer is not None else {}  # the copy points to no Trainer
        self.module = copy.deepcopy(module, memo)
        target = device if device is not None else next(itertools.chain(module.parameters(), module.buffers()),
                                                         torch.empty(0)).device
        self.module = self.module.to(target)
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=target))
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers
        self.count = 0  # n_averaged, on the host

    def averaged_tensors(self) -> list[torch.Tensor]:
        return list(itertools.chain(self.module.parameters(), self.module.buffers()) if self.use_buffers
                    else self.module.parameters())

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Average ``model``'s parameters (and buffers, with ``use_buffers``) into the copy, as
        torch's ``AveragedModel`` does."""
        current = itertools.chain(model.parameters(), model.buffers()) if self.use_buffers else model.parameters()
        # .to(): nothing where the copy is on the module's device (the default); to another
        # device (device="cpu" on an accelerator) it is a transfer, a host sync, as the user asked.
        pairs = [(mine.detach(), theirs.detach().to(mine.device)) for mine, theirs in zip(self.averaged_tensors(),
                                                                                        current)]
        if self.count == 0:
            for mine, theirs in pairs:
                mine.copy_(theirs)
        elif self.avg_fn is not None and self.multi_avg_fn is None:
            for mine, theirs in pairs:
                mine.copy_(self.avg_fn(mine, theirs, self.n_averaged.to(mine.device)))
        else:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
            for mine, theirs in pairs:
                group = groups.setdefault((mine.device, mine.dtype), ([], []))
                group[0].append(mine)
                group[1].append(theirs)
            for (device, _), (mine_list, theirs_list) in groups.items():
                n = self.n_averaged.to(device)
                if self.multi_avg_fn is not None:
                    self.multi_avg_fn(mine_list, theirs_list, n)
                elif device.type in _foreach_devices():
                    get_swa_multi_avg_fn()(mine_list, theirs_list, n)
                else:
                    swa = get_swa_avg_fn()
                    for mine, theirs in zip(mine_list, theirs_list):
                        mine.copy_(swa(mine, theirs, n))
        if not self.use_buffers:  # the buffers follow the module's, unaveraged
            for mine, theirs in zip(self.module.buffers(), model.buffers()):
                mine.detach().copy_(theirs.detach().to(mine.device))
        self.n_averaged.add_(1)  # on the device: no read
        self.count += 1


class WeightAveraging(Callback):
    """Lightning's ``WeightAveraging``: an averaged copy of the module, updated after the
    optimizer steps (and epochs) ``should_update`` picks, swapped in for validation during the
    fit, and copied into the module when training ends.

    Args:
        device: where the averaged copy is kept; by default on the device the module trains on
            (Lightning's default is where the module is when the fit starts, usually the CPU).
            Another device makes every update a transfer (a host sync on an accelerator).
        use_buffers: average the buffers too (BatchNorm's statistics); ``False`` copies them.
        **kwargs: passed to ``AveragedModel``: ``avg_fn`` or ``multi_avg_fn`` (default: SWA, the
            equally weighted average).

    Override ``should_update(step_idx=None, epoch_idx=None)`` to choose when to update: it is
    called after each optimizer step with the step's zero-based index, and after each training
    epoch with the epoch's; the default updates after every step. Models whose parameters the
    strategy shards (``xla_fsdp``, ``xla_fsdpv2``, ``xla_spmd``, ``native_fsdp``) are refused:
    the copy would hold the whole model on every replica, outside the sharding.
    """

    def __init__(self, device: Optional[Union[torch.device, str, int]] = None, use_buffers: bool = True,
                 **kwargs: Any) -> None:
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        unknown = set(kwargs) - {"avg_fn", "multi_avg_fn"}
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected arguments {sorted(unknown)}: AveragedModel "
                            "takes avg_fn or multi_avg_fn besides device and use_buffers.")
        self._average_model: Optional[AveragedModule] = None
        self._fitting = False
        # The optimizer steps taken at the last update: 0 makes the first update follow the
        # first optimizer step (after N batches with accumulate_grad_batches=N), as in Lightning.
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """Whether to update the average after the optimizer step ``step_idx`` (zero-based) or
        the training epoch ``epoch_idx``; one of them is given. By default after every step."""
        return step_idx is not None

    # ---- the averaged copy -------------------------------------------------------------------
    def setup(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        self._fitting = stage == "fit"
        self._average_model = None
        if self._fitting and trainer.strategy.shards_parameters:
            raise ValueError(f"{type(self).__name__} keeps a whole copy of the module, which the {trainer.strategy.name} "
                             "strategy shards: use an unsharded strategy (native, native_ddp, xla_native, xla_ddp), "
                             "or average the weights in your module.")

    def _averaged(self, trainer: "TrainerView", module: "XModule") -> AveragedModule:
        """The averaged copy, made from the module where it trains (once the strategy placed it)."""
        if self._average_model is None:
            self._average_model = AveragedModule(module, trainer, device=self._device, use_buffers=self._use_buffers,
                                                 **self._kwargs)
        return self._average_model

    def on_fit_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._averaged(trainer, module)

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step > self._latest_update_step and self.should_update(step_idx=step - 1):
            self._averaged(trainer, module).update_parameters(module)
            self._latest_update_step = step

    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._averaged(trainer, module).update_parameters(module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._average_model is not None:
            self._copy_average_to_current(module)

    def on_validation_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._average_model is not None:
            self._swap_models(module)

    def on_validation_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._average_model is not None:
            self._swap_models(module)

    def _pairs(self, module: nn.Module) -> Any:
        average = self._average_model.module
        return zip(itertools.chain(average.parameters(), average.buffers()),
                   itertools.chain(module.parameters(), module.buffers()))

    @torch.no_grad()
    def _swap_models(self, module: nn.Module) -> None:
        """Exchange the module's values with the averaged copy's: where both are alike (the
        default) by exchanging the tensors the parameters hold, with no device work at all."""
        for average, current in self._pairs(module):
            if average.device == current.device and average.dtype == current.dtype:
                average.data, current.data = current.data, average.data
            else:
                kept = average.data.clone()
                average.data.copy_(current.data)
                current.data.copy_(kept)

    @torch.no_grad()
    def _copy_average_to_current(self, module: nn.Module) -> None:
        for average, current in self._pairs(module):
            current.data.copy_(average.data)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(self, trainer: "TrainerView", module: "XModule", checkpoint: dict[str, Any]) -> None:
        """The averaged weights as the checkpoint's ``state_dict``, the module's own as
        ``current_model_state``, the copy's other state (``n_averaged``) as ``averaging_state``."""
        if self._average_model is None:
            rank_zero_info(f"{type(self).__name__}: a checkpoint saved outside a fit holds no averaging state.")
            return
        state = self._average_model.state_dict()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {name[len("module."):]: value for name, value in state.items()
                                    if name.startswith("module.")}
        checkpoint["averaging_state"] = {name: value for name, value in state.items() if not name.startswith("module.")}

    def on_load_checkpoint(self, trainer: "TrainerView", module: "XModule", checkpoint: dict[str, Any]) -> None:
        """A fit resumed from a checkpoint: the averaged copy from its ``state_dict``, the module
        from its ``current_model_state`` (a checkpoint saved without averaging: both from
        ``state_dict``)."""
        if not self._fitting:
            rank_zero_warn(f"{type(self).__name__}: loading a checkpoint outside a fit: the module gets its averaged "
                           "weights (its state_dict), and no averaging state is restored. Remove the callback to "
                           "silence this warning.")
            return
        average = self._averaged(trainer, module)  # made from the module, which holds state_dict now
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            state = {"module." + name: value for name, value in checkpoint["state_dict"].items()}
            state.update(checkpoint["averaging_state"])
            average.load_state_dict(state)
            # host sync: none in a fit; a loaded checkpoint's counter is host memory
            average.count = int(checkpoint["averaging_state"]["n_averaged"])
            trainer.strategy.load_module_state_dict(trainer.model, {"state_dict": checkpoint["current_model_state"]})
        else:
            rank_zero_warn(f"The checkpoint was not saved with {type(self).__name__}: the module and its average "
                           "both start from its state_dict.")


class EMAAverage:
    """``torch.optim.swa_utils.get_ema_avg_fn(decay)`` as an object: the same update, and one that
    pickles, so that the callback travels to the processes ``devices=N`` starts (a closure does not)."""

    def __init__(self, decay: float = 0.999) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMAWeightAveraging(decay={decay!r}): give a value in [0, 1].")
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema_param: torch.Tensor, current_param: torch.Tensor, num_averaged: Any) -> torch.Tensor:
        return self.decay * ema_param + (1 - self.decay) * current_param


class EMAWeightAveraging(WeightAveraging):
    """Lightning's ``EMAWeightAveraging``: an exponential moving average of the weights.

    Args:
        device: where the averaged copy is kept (see ``WeightAveraging``).
        use_buffers: average the buffers too.
        decay: the weight of the average at each update (``avg = decay * avg + (1 - decay) * w``).
        update_every_n_steps: update after every n-th optimizer step (by zero-based index).
        update_starting_at_step: update only from this step index on.
        update_starting_at_epoch: also update after each epoch from this epoch index on.
        **kwargs: passed to ``AveragedModel``.
    """

    def __init__(self, device: Optional[Union[torch.device, str, int]] = None, use_buffers: bool = True,
                 decay: float = 0.999, update_every_n_steps: int = 1, update_starting_at_step: Optional[int] = None,
                 update_starting_at_epoch: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=EMAAverage(decay))
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """After step ``step_idx`` from ``update_starting_at_step`` on, every
        ``update_every_n_steps``; after epoch ``epoch_idx`` from ``update_starting_at_epoch`` on."""
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        if epoch_idx is not None:
            return self.update_starting_at_epoch is not None and epoch_idx >= self.update_starting_at_epoch
        return False
