"""``BaseFinetuning`` and ``BackboneFinetuning``: Lightning's fine-tuning callbacks.

Freeze part of the module before training (``freeze_before_training``), then unfreeze it during
the fit and hand its parameters to the running optimizer as a new parameter group
(``finetune_function``, called at each training epoch's start with every optimizer). The
callback's state records every group added (its parameters by name, its settings) and which
parameters were trainable, so that a resumed fit rebuilds the same groups *before* the optimizer
state is loaded into them, and continues bitwise as the uninterrupted fit would.

Under a strategy that takes the parameters out of their layers (``xla_fsdp``: each becomes a
shard the wrapper holds) the callback runs its hooks and its state inside the strategy's
``parameters_in_layers``: there the layers hold their full parameters and the optimizers' groups
hold them too, as in Lightning; the strategy then maps new groups to the shards and copies each
layer's ``requires_grad`` to its shards. ``xla_fsdp`` refuses it with ``flatten_parameters=True``
(a unit's parameters are one flat shard there), when the fit starts.

Where it cannot work, it refuses when the fit starts: ``xla_ddp`` with several replicas (DDP
reduces only the parameters that needed gradients when it wrapped the module; layers unfrozen
later would train apart on each replica). ``xla_native`` (the same data parallelism, gradients
reduced at the optimizer step) works.

On XLA each new group (and each new learning rate) compiles the step once more.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from xtrainer.callbacks.base import Callback
from xtrainer.loop.optimizers import prefer_foreach
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


def multiplicative(epoch: int) -> float:
    """``BackboneFinetuning``'s default: the backbone's learning rate doubles every epoch."""
    del epoch
    return 2.0


class BaseFinetuning(Callback):
    """Subclass it and define ``freeze_before_training(module)`` and
    ``finetune_function(module, epoch, optimizer)``, as in Lightning::

        class Unfreeze(BaseFinetuning):
            def freeze_before_training(self, module):
                self.freeze(module.backbone)

            def finetune_function(self, module, epoch, optimizer):
                if epoch == 2:
                    self.unfreeze_and_add_param_group(module.backbone, optimizer, lr=1e-4)
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._trainable: list[str] | None = None  # parameter names, as saved
        self._untracked_bn: list[str] | None = None  # BatchNorm modules whose running stats were frozen
        self._pending = False  # state loaded, groups not rebuilt yet
        self._module: Any = None
        self._trainer: TrainerView | None = None  # during a fit: its strategy hands out the layers' parameters

    # ---- what a subclass defines -----------------------------------------------------------------
    def freeze_before_training(self, pl_module: "XModule") -> None:
        raise NotImplementedError(f"{type(self).__name__}: define freeze_before_training(module).")

    def finetune_function(self, pl_module: "XModule", epoch: int, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError(f"{type(self).__name__}: define finetune_function(module, epoch, optimizer).")

    # ---- Lightning's helpers ------------------------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: nn.Module | Iterable[nn.Module | Iterable]) -> list[nn.Module]:
        """The leaf modules (and those with parameters of their own) in ``modules``."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, nn.Module):
            found: Iterable[nn.Module] = modules.modules()
        else:
            found = [m for item in modules for m in BaseFinetuning.flatten_modules(item)]
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Any, train_bn: bool = True, requires_grad: bool = True
                      ) -> Generator[nn.Parameter, None, None]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm
        layers' only with ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Any) -> None:
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Any, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without those the optimizer has already (by identity: comparing values, as
        Lightning does, would read every parameter back from the device)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        kept, removed = [], []
        for param in params:
            (removed if id(param) in held else kept).append(param)
        if removed:
            rank_zero_warn(f"{len(removed)} of the parameters to add are in the optimizer already; they are skipped "
                           "(a parameter can be in one group only).")
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(modules: Any, optimizer: torch.optim.Optimizer, lr: float | None = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new group, at
        ``lr`` (default: the first group's learning rate / ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom})

    # ---- the hooks ---------------------------------------------------------------------------------
    def setup(self, trainer: "TrainerView", pl_module: "XModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if strategy.reduces_wrapped_trainable_only and trainer.world_size > 1:
            raise ValueError(f"{type(self).__name__} cannot run under {strategy.name} with several replicas: DDP "
                             "reduces only the parameters that needed gradients when it wrapped the module, so "
                             "unfrozen layers would train apart; use strategy='xla_native' (gradients reduced at the "
                             "optimizer step), or 'native_fsdp'.")
        self._module, self._trainer = pl_module, trainer
        if trainer.ckpt_path is None:  # a fresh fit: nothing to rebuild from an earlier one
            self._internal_optimizer_metadata, self._pending = {}, False
            self._trainable = self._untracked_bn = None
        self.freeze_before_training(pl_module)

    def on_fit_start(self, trainer: "TrainerView", pl_module: "XModule") -> None:
        with self._in_layers(trainer):  # a strategy that cannot hand out the layers' parameters refuses here
            if self._pending:  # state loaded by a path that did not rebuild the groups first
                self._rebuild_param_groups(trainer, pl_module)

    def on_train_epoch_start(self, trainer: "TrainerView", pl_module: "XModule") -> None:
        with self._in_layers(trainer):
            for index, optimizer in enumerate(trainer.optimizers):
                before = len(optimizer.param_groups)
                self.finetune_function(pl_module, trainer.current_epoch, optimizer)
                if len(optimizer.param_groups) != before:
                    prefer_foreach(optimizer)  # the new groups take torch's multi-tensor update too
                self._store(pl_module, index, before, optimizer.param_groups)

    def teardown(self, trainer: "TrainerView", pl_module: "XModule", stage: str) -> None:
        if stage == "fit":
            self._trainer = None  # the module is given back unwrapped: its layers hold their parameters

    @staticmethod
    def _in_layers(trainer: "TrainerView | None") -> contextlib.AbstractContextManager:
        """The strategy's ``parameters_in_layers`` during a fit: the module's layers and the
        optimizers' groups hold the parameters as built, even where the strategy shards them."""
        if trainer is None:
            return contextlib.nullcontext()
        return trainer.strategy.parameters_in_layers(trainer.model, trainer.optimizers)

    # ---- state: the groups added, rebuilt on resume before the optimizer state is loaded -----------
    def state_dict(self) -> dict[str, Any]:
        module = self._module
        state: dict[str, Any] = {"internal_optimizer_metadata": self._internal_optimizer_metadata}
        if module is not None:
            with self._in_layers(self._trainer):
                state["trainable"] = [n for n, p in module.named_parameters() if p.requires_grad]
                state["untracked_bn"] = [n for n, m in module.named_modules()
                                         if isinstance(m, _BatchNorm) and not m.track_running_stats]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._internal_optimizer_metadata = {int(k): v for k, v in
                                             state_dict.get("internal_optimizer_metadata", {}).items()}
        self._trainable, self._untracked_bn = state_dict.get("trainable"), state_dict.get("untracked_bn")
        self._pending = bool(self._internal_optimizer_metadata)

    def restore_param_groups(self, trainer: "TrainerView", pl_module: "XModule") -> None:
        """Rebuild each optimizer's groups as saved (those added during the fit included) and the
        saved trainable parameters; the Trainer calls it on resume before loading the optimizer
        states, which need the saved number of groups."""
        with self._in_layers(trainer):
            self._rebuild_param_groups(trainer, pl_module)

    def _rebuild_param_groups(self, trainer: "TrainerView", pl_module: "XModule") -> None:
        self._pending = False
        named = dict(pl_module.named_parameters())
        if self._trainable is not None:
            trainable = set(self._trainable)
            for name, param in named.items():
                param.requires_grad = name in trainable
        if self._untracked_bn is not None:
            untracked = set(self._untracked_bn)
            for name, module in pl_module.named_modules():
                if isinstance(module, _BatchNorm):
                    module.track_running_stats = name not in untracked
        for index, optimizer in enumerate(trainer.optimizers):
            saved = self._internal_optimizer_metadata.get(index)
            if saved is None or len(saved) == len(optimizer.param_groups):
                continue
            missing = [n for group in saved for n in group["params"] if n not in named]
            if missing:
                raise ValueError(f"{type(self).__name__}: the checkpoint's optimizer groups name parameters this "
                                 f"module does not have ({missing[:3]}); resume with the module that wrote it.")
            optimizer.param_groups = [{**{k: v for k, v in group.items() if k != "params"},
                                       "params": [named[n] for n in group["params"]]} for group in saved]

    def _store(self, pl_module: "XModule", index: int, before: int, groups: list[dict[str, Any]]) -> None:
        self._module = pl_module  # names the trainable parameters in state_dict
        names = {id(p): n for n, p in pl_module.named_parameters()}

        def by_name(selected: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{**{k: v for k, v in group.items() if k != "params"},
                     "params": [names[id(p)] for p in group["params"]]} for group in selected]

        if index not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[index] = by_name(groups)
        elif before != len(groups):
            self._internal_optimizer_metadata[index].extend(by_name(groups[before:]))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_module": None, "_trainer": None}


class BackboneFinetuning(BaseFinetuning):
    """Lightning's ``BackboneFinetuning``: the module's ``backbone`` is frozen until epoch
    ``unfreeze_backbone_at_epoch``, then trained in a group of its own, starting at
    ``backbone_initial_lr`` (default: the current learning rate x ``backbone_initial_ratio_lr``)
    and multiplied by ``lambda_func(epoch + 1)`` each later epoch, never above the first group's
    rate with ``should_align``."""

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 1e-1, backbone_initial_lr: float | None = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.previous_backbone_lr = state_dict.get("previous_backbone_lr")

    def setup(self, trainer: "TrainerView", pl_module: "XModule", stage: str) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), nn.Module):
            raise ValueError(f"BackboneFinetuning needs the module to have an nn.Module attribute 'backbone'; "
                             f"{type(pl_module).__name__} has none.")
        super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: "XModule") -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: "XModule", epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current = optimizer.param_groups[0]["lr"]
            initial = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                       else current * self.backbone_initial_ratio_lr)
            self.previous_backbone_lr = initial
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, initial, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
            if self.verbose:
                rank_zero_info(f"Current lr: {round(current, self.rounding)}, "
                               f"Backbone lr: {round(initial, self.rounding)}")
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            current = optimizer.param_groups[0]["lr"]
            following = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            following = current if (self.should_align and following > current) else following
            optimizer.param_groups[-1]["lr"] = following
            self.previous_backbone_lr = following
            if self.verbose:
                rank_zero_info(f"Current lr: {round(current, self.rounding)}, "
                               f"Backbone lr: {round(following, self.rounding)}")
