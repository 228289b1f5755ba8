"""A fit's optimizers and schedulers, and how they step: what ``configure_optimizers`` returned
(parsed by ``loop/optimizers.py``), the optimizer step of automatic optimization with its hooks and
gradient clipping, the learning-rate schedulers, and manual optimization's ``manual_backward``,
``clip_gradients`` and step counting. One per replica's run, owned by the Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from xtrainer.callbacks.base import Callback
from xtrainer.loop.optimizers import (SchedulerConfig, StrategyOptimizer, parse_optimizers, prefer_foreach,
                                     step_schedulers)
from xtrainer.module import XModule
from xtrainer.strategies.base import clear_gradients
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.loop.hooks import BatchHooks


class Optimization:
    """The optimizers of one run and everything that steps them."""

    def __init__(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[SchedulerConfig] = []
        self.manual_optimizers: list[StrategyOptimizer] = []  # what self.optimizers() gives the module
        self.automatic = True
        self._needs_before_step = False
        self._clips_itself = False  # the module overrides configure_gradient_clipping
        self._custom_step = False
        self.skipped = 0  # batches whose training_step returned None (Lightning's skip)
        self.plateau_per_step = False

    def setup(self, trainer: "TrainerView") -> None:
        """``configure_optimizers()`` against the wrapped parameters, parsed and checked."""
        module, strategy = trainer.module, trainer.strategy
        self.automatic = module.automatic_optimization
        name = type(module).__name__
        try:
            config = strategy.setup_optimizers(trainer.model, module.configure_optimizers, manual=not self.automatic)
        except ValueError as err:
            if not strategy.flattens_parameters or "self.parameters()" not in str(err):
                raise
            raise ValueError(
                f"{name}.configure_optimizers() builds an optimizer over parameters {strategy.name} does not train: its FSDP "
                "flattens the module's parameters, so only self.parameters() (all of them, sharded) can be optimized. "
                "For an optimizer over part of the model (self.layer.parameters()) use strategy='xla_fsdpv2', which "
                "shards each parameter in place; else build it from self.parameters().") from err
        self.optimizers, self.schedulers = parse_optimizers(config, name, self.automatic)
        # a scheduler stepped per step that monitors a metric (a ReduceLROnPlateau): stepped by the loop
        # once the step's values can be read (fit.batch_end), under automatic optimization
        self.plateau_per_step = self.automatic and any(c.reduce_on_plateau and c.interval == "step"
                                                       for c in self.schedulers)
        for optimizer in self.optimizers:  # torch's multi-tensor path on XLA tensors, unless the user chose
            prefer_foreach(optimizer)
        if not self.automatic:
            if trainer.gradient_clip_val is not None:
                raise ValueError(f"gradient_clip_val with manual optimization ({name}.automatic_optimization is "
                                 "False): clip in training_step with self.clip_gradients(opt, gradient_clip_val=...) "
                                 "before opt.step(), as in Lightning.")
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(f"accumulate_grad_batches with manual optimization ({name}.automatic_optimization "
                                 "is False): step the optimizers every N batches in training_step instead.")
        self.manual_optimizers = [
            StrategyOptimizer(opt, strategy, lambda opt=opt: trainer.run.call("on_before_optimizer_step", opt),
                              lambda: self._manual_stepped(trainer))
            for opt in self.optimizers]
        self._clips_itself = type(module).configure_gradient_clipping is not XModule.configure_gradient_clipping
        self._needs_before_step = trainer.gradient_clip_val is not None or self._clips_itself or _overrides(
            module, trainer.callbacks, "on_before_optimizer_step")
        self._custom_step = (type(module).optimizer_step is not XModule.optimizer_step
                             or type(module).optimizer_zero_grad is not XModule.optimizer_zero_grad)

    def prepare_resume(self, trainer: "TrainerView", checkpoint: dict[str, Any]) -> None:
        """Before the optimizer states of ``checkpoint`` are loaded: a callback that added
        parameter groups during the saved fit (``BaseFinetuning``) rebuilds them from its saved
        state, so that each optimizer has the saved number of groups again."""
        states = checkpoint.get("callbacks", {})
        for cb in trainer.callbacks:
            rebuild = getattr(cb, "restore_param_groups", None)
            if callable(rebuild) and cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])
                rebuild(trainer, trainer.module)

    # ---- automatic optimization --------------------------------------------------------------
    def zero_grad(self, trainer: "TrainerView", batch_idx: int, hooks: "BatchHooks") -> None:
        """``on_before_zero_grad`` and zero_grad (the module's ``optimizer_zero_grad`` if it
        overrides it), where Lightning runs them: after ``training_step`` and before backward, on
        the first micro-batch of each accumulation window. The gradients of a step stay until
        then (``on_train_batch_end`` and a validation in between see them; the fit drops the
        last step's after ``on_fit_end``),
        and the new ones take the memory of the old: the allocator neither returns it nor asks
        for it again every step."""
        optimizer = self.optimizers[0]
        if hooks.on_before_zero_grad is not None:
            hooks.on_before_zero_grad(optimizer)
        if self._custom_step:  # the module overrides optimizer_step or optimizer_zero_grad
            trainer.module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        else:
            clear_gradients(optimizer)

    def drop_gradients(self) -> None:
        """At the fit's end, under automatic optimization: the last step's gradients go."""
        if self.automatic:
            for optimizer in self.optimizers:
                clear_gradients(optimizer)

    def step(self, trainer: "TrainerView", batch_idx: int, loss: torch.Tensor) -> None:
        """The optimizer step (reduce, clip, step: the strategy's), the step count and the
        schedulers stepped per step; the module's ``optimizer_step`` if it overrides it."""
        optimizer = self.optimizers[0]
        before_step = (lambda: self._before_step(trainer)) if self._needs_before_step else None
        if self._custom_step:  # the module overrides optimizer_step or optimizer_zero_grad
            wrapper = StrategyOptimizer(optimizer, trainer.strategy, before_step)
            trainer.module.optimizer_step(trainer.current_epoch, batch_idx, wrapper, lambda: loss)
        else:
            trainer.strategy.optimizer_step(optimizer, before_step)
        trainer.loop.global_step += 1
        if trainer.run.nonfinite.counts_steps:
            trainer.run.nonfinite.stepped()
        if self.schedulers:  # those that monitor a metric step once the step's values can be read (fit.batch_end)
            self.step_schedulers(trainer, "step", batch_idx, plateau=False)

    def _before_step(self, trainer: "TrainerView") -> None:
        trainer.run.call("on_before_optimizer_step", self.optimizers[0])
        if self._clips_itself:  # Lightning's hook, with the Trainer's settings
            trainer.module.configure_gradient_clipping(self.optimizers[0], trainer.gradient_clip_val,
                                                       trainer.gradient_clip_algorithm)
        elif trainer.gradient_clip_val is not None:
            trainer.strategy.clip_gradients(trainer.model, self.optimizers[0], trainer.gradient_clip_val,
                                            trainer.gradient_clip_algorithm)

    def step_schedulers(self, trainer: "TrainerView", interval: str, batch_idx: int = 0,
                        plateau: bool | None = None) -> None:
        """The schedulers of ``interval`` whose ``frequency`` divides the count, as Lightning
        counts: per step, the batches of this epoch so far (``batch_idx + 1``, not
        ``global_step``); per epoch, the epochs so far. ``plateau``: as ``step_schedulers``."""
        count = batch_idx + 1 if interval == "step" else trainer.current_epoch + 1
        module = trainer.module
        own = type(module).lr_scheduler_step is not XModule.lr_scheduler_step

        def metrics() -> Any:  # asked for only where a scheduler that monitors a metric steps
            if plateau:  # in a batch's end, where every replica steps it: sync_dist values reduced first
                trainer.run.publisher.preview_synced(trainer)
            return trainer.callback_metrics

        step_schedulers(self.schedulers, interval, count, metrics, module.lr_scheduler_step if own else None, plateau)

    # ---- manual optimization -----------------------------------------------------------------
    def _manual_stepped(self, trainer: "TrainerView") -> None:
        """A manual ``opt.step()``: Lightning counts every optimizer step in ``global_step``."""
        trainer.loop.global_step += 1
        trainer.run.nonfinite.stepped()

    def forget_pending_clips(self) -> None:
        """After a manual ``training_step``: a clip asked for an optimizer that did not step lapses."""
        for wrapper in self.manual_optimizers:
            wrapper.pending_clip = None

    def manual_backward(self, trainer: "TrainerView", loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``XModule.manual_backward``: the backward hooks around the strategy's backward."""
        if self.automatic:
            raise RuntimeError("manual_backward() is for manual optimization: set self.automatic_optimization = "
                               "False in the module's __init__ (with automatic optimization, return the loss).")
        trainer.run.call("on_before_backward", loss)
        trainer.strategy.manual_backward(trainer.model, loss, *args, **kwargs)
        trainer.run.call("on_after_backward")

    def clip_gradients_of(self, trainer: "TrainerView", optimizer: Any, value: float | None,
                          algorithm: str | None) -> None:
        """``XModule.clip_gradients``: clip ``optimizer``'s gradients once they are reduced, just
        before it steps (right away where the strategy reduced them in backward already, and under
        automatic optimization, where ``configure_gradient_clipping`` runs just before the step)."""
        if value is None:
            return
        algorithm = algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}: use 'norm' or 'value'.")
        raw = getattr(optimizer, "optimizer", optimizer)
        wrapper = next((w for w in self.manual_optimizers if w.optimizer is raw), None)
        clip = lambda: trainer.strategy.clip_gradients(trainer.model, raw, value, algorithm)  # noqa: E731
        if wrapper is None or self.automatic:  # automatic: called from configure_gradient_clipping, before the step
            clip()
        else:
            wrapper.pending_clip = clip


def _overrides(module: XModule, callbacks: list[Callback], hook: str) -> bool:
    return (getattr(type(module), hook) is not getattr(XModule, hook)
            or any(getattr(type(cb), hook) is not getattr(Callback, hook) or hook in vars(cb) for cb in callbacks))
