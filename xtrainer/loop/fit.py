"""The fit loop and the training step, in the order they run.

``run_epochs`` is the epoch loop: epochs, the batches of each, validation where it is due, stops (a
signal, ``should_stop``, ``max_time``, the platform's preemption notice) and the epoch ends.
``training_step`` is one batch: forward, backward, the optimizer step with clipping, the periodic
read of logged values and the graph cut. Everything device or distribution specific is the
strategy's (``trainer.strategy``); the position of the fit is ``trainer.loop``
(``xtrainer/loop/state.py``). The loop reads logged values to the host once per
``log_every_n_steps`` and at each epoch's end (``publishing.py``); no other host sync.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.launch import interrupts
from xtrainer.loop import loaders
from xtrainer.config.settings import is_time, seconds
from xtrainer.loop import checkpoints, evaluation
from xtrainer.loop.hooks import BatchHooks
from xtrainer.loop.publishing import LOSS_KEY, end_epoch
from xtrainer.loop.steps import training_loss
from xtrainer.trainer_view import TrainerView


def run_epochs(trainer: "TrainerView", train: Any, val: list) -> None:
    """Fit: the epochs from where ``trainer.loop`` stands to ``max_epochs``/``max_steps`` or a stop."""
    loop, run = trainer.loop, trainer.run
    run.train_data = train
    run.count_training_batches()
    if trainer.num_training_batches == 0:
        if len(train) == 0:
            raise ValueError("The training dataloader is empty: it yields no batches (an empty dataset, or "
                             "drop_last=True with fewer samples than one batch per replica).")
        raise ValueError("limit_train_batches leaves no training batches to run.")
    if val:
        check_validation_interval(trainer)
    if trainer.loggers and trainer.num_training_batches < trainer.log_every_n_steps and trainer.loop.global_step == 0:
        rank_zero_warn(f"An epoch has {trainer.num_training_batches} training batches, fewer than "
                       f"log_every_n_steps={trainer.log_every_n_steps}: the loggers get the per-step values only every "
                       f"{trainer.log_every_n_steps} steps (and the epoch values at each epoch's end), as in Lightning. "
                       "Set a lower log_every_n_steps to see them within each epoch.")
    run.nonfinite.start_fit(trainer)
    run.agreement.start_fit(trainer)
    run.publisher.start_fit(trainer)
    run.started_at = time.monotonic()
    run.call("on_fit_start")
    if val and trainer.num_sanity_val_steps and trainer.limits["validate"] != 0:
        evaluation.sanity_check(trainer, val)
    if not loop.skip_batches:  # the first epoch starts here: what on_train_start logs is one of its values
        run.results.reset_epoch()
    run.call("on_train_start")
    clock = ValidationClock.of(trainer) if val else None  # a time-based val_check_interval, from here on
    run.agreement.validation_due = clock.due if clock is not None else None
    first_epoch, started = loop.current_epoch, False
    while not (stopping(trainer) or limits_reached(trainer)):
        skip, loop.skip_batches = loop.skip_batches, 0
        if not skip and started:  # a resumed epoch keeps the values it had accumulated
            run.results.reset_epoch()
        started = True
        train = run.train_data = loaders.reloaded(trainer, train, first_epoch)
        train.set_epoch(loop.current_epoch, loop.seed)
        if skip and run.restored_data_state is not None:
            train.load_state_dict(run.restored_data_state)  # the epoch's order, as it was drawn
        run.restored_data_state = None
        run.call("on_train_epoch_start")
        loop.epoch_finished = False
        finished = True
        if loop.validation_pending:  # resumed between a batch and the validation it triggered
            validate(trainer, val, clock)
        # Resuming inside an epoch starts at the next unseen batch (skipped by index, not loaded).
        # An epoch whose every batch was trained (saved on its last batch) is not iterated at all:
        # the original run never drained its loader either, and draining torch_xla's device loader
        # cuts the graph, which advances the XLA generator.
        batches = train.resume_at(skip) if skip < trainer.num_training_batches else ()
        validate_every = validation_every(trainer) if val else None
        timed = clock is not None and validation_epoch(trainer)  # validated when the time has come
        # check_val_every_n_epoch=None: every validate_every batches counted across epochs, as Lightning
        # counts them (the epochs before this one, when an epoch's length is known)
        counted = loop.current_epoch * trainer.num_training_batches \
            if validate_every is not None and trainer.check_val_every_n_epoch is None \
            and not math.isinf(trainer.num_training_batches) else 0
        last, max_steps, agreement = trainer.num_training_batches, trainer.max_steps, run.agreement
        # What can ask to stop after a batch besides a signal: the platform's notice, max_time.
        watch_stops = trainer.strategy.preempted is not None or trainer.max_time is not None
        step = manual_training_step if not run.optim.automatic else training_step
        table = run.hooks
        progress = loop.progress
        transfer = run.transfer
        step_starts = trainer.strategy.step_starts
        stop_request = interrupts.stop  # this process's signal, read after each batch
        for batch_idx, batch in batches:
            if step_starts is not None:
                step_starts()  # a fault-tolerant strategy's quorum of this step
            if transfer is not None:
                batch = transfer(batch, 0)
            is_last = run.is_last_batch = batch_idx + 1 >= last
            hooks = table.batch(trainer, run.module, trainer.callbacks)
            results = run.results
            results.begin_batch(batch)  # values logged from here to the batch's end hooks are the step's
            start = hooks.on_train_batch_start
            if start is not None and start(batch, batch_idx) == -1:
                results.in_step = False
                break  # Lightning's meaning: the rest of this epoch is skipped
            loop.validation_pending = validate_every is not None and (counted + batch_idx + 1) % validate_every == 0
            step(trainer, batch, batch_idx, hooks)
            results.in_step = False
            loop.batches_done += 1
            if progress is not None:
                progress[0] = loop.batches_done  # what the hang watchdog's monitor process reads
            if loop.batches_done == agreement.due:  # the replicas' agreement started a batch ago
                agreement.settle(trainer)
            if timed and not loop.validation_pending:
                loop.validation_pending = clock.come(agreement)
            validated = loop.validation_pending
            if validated:
                validate(trainer, val, clock)
            if watch_stops or stop_request.signal is not None:
                note_stop_requests(trainer)
            if is_last:
                break
            # A stop waits for the optimizer step: between micro-batches the accumulated gradients
            # would be lost, and the resumed run would differ.
            asked = trainer.should_stop or agreement.stop_agreed  # stopping() can say yes only then
            stops = asked and stopping(trainer) and loop.stepped
            if stops or (max_steps != -1 and loop.global_step >= max_steps):
                if stops and (validate_every is not None or timed) and not validated and stop_signal(trainer) is None:
                    # Asked to stop (not by a signal): validate at this batch first, as Lightning does,
                    # so that the stop's monitored checkpoint and final metrics see this step.
                    validate(trainer, val, clock)
                finished = False
                break
        signum = stop_signal(trainer)
        if signum is not None and not finished and stopping(trainer) and not limits_reached(trainer):
            checkpoints.stop_on_signal(trainer, signum)  # the epoch is cut short: no epoch-end hooks
        if val and finished and math.isinf(trainer.num_training_batches) and validation_epoch(trainer) \
                and validate_every is None:  # a loader without a length, validated per epoch: when it runs out
            validate(trainer, val, clock)
        loop.epoch_finished = finished
        # A checkpoint written in the epoch-end hooks precedes the epoch's scheduler step: a run
        # resumed from it takes that step first, as this one does next.
        loop.epoch_schedulers_due = finished
        end_epoch(trainer, "train", "on_train_epoch_end")
        if trainer.world_size > 1:
            # A stop asked for at the epoch's end reaches every replica. The exchange may cut a
            # graph, which advances the XLA generator: kept as it was, since a run resumed from a
            # checkpoint written in the epoch-end hooks above does not make this exchange.
            with trainer.strategy.runtime.rng_state_kept():
                run.publisher.publish(trainer, {})
        if loop.epoch_finished:
            if run.optim.automatic:  # under manual optimization the module steps its schedulers
                run.optim.step_schedulers(trainer, "epoch")
            loop.next_epoch()
    signum = stop_signal(trainer)
    if signum is not None and not limits_reached(trainer):
        # Stopped by a signal at an epoch's end (on its last batch, in its validation, or where the
        # replicas agreed): an interruption like any other, saved as the start of the next epoch
        # with none of its batches trained, unless the fit really reached its end.
        loop.epoch_finished = False
        checkpoints.stop_on_signal(trainer, signum)
    run.call("on_train_end")
    run.call("on_fit_end")
    run.optim.drop_gradients()  # the last step's, not moved to the host with the weights
    run.publisher.end_fit(trainer)


def training_step(trainer: "TrainerView", batch: Any, batch_idx: int, hooks: BatchHooks) -> None:
    """One training batch under automatic optimization: forward, backward, every
    ``accumulate_grad_batches``-th batch the optimizer step (the strategy reduces and clips the
    gradients), the periodic read of logged values, and the graph cut."""
    loop, strategy = trainer.loop, trainer.strategy
    accumulate = trainer.settings.accumulate_grad_batches  # trainer.accumulate_grad_batches, without the descriptor
    steps = accumulate == 1 or (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == trainer.num_training_batches
    if steps:  # gradients are reduced as usual: no context to enter
        outputs, loss = forward_backward(trainer, batch, batch_idx, accumulate, hooks)
    else:
        with strategy.no_backward_sync(trainer.run.wrapped, enabled=True):
            outputs, loss = forward_backward(trainer, batch, batch_idx, accumulate, hooks)
    loop.stepped = steps
    read = False
    if steps:
        loop.batches_stepped += 1
        trainer.run.optim.step(trainer, batch_idx, loss)  # clip, step, global_step, schedulers
        if loop.global_step % trainer.log_every_n_steps == 0:
            # Read once the step's graph is launched, as torch_xla's step closures run: the values
            # are this step's outputs, and reading them is the interval's one host sync.
            strategy.runtime.add_step_closure(lambda: publish_step_values(trainer))
            read = True
    strategy.runtime.sync()  # the graph cut: this micro-batch's work runs as one execution
    loop.batches_in_epoch = batch_idx + 1
    plateau = steps and trainer.run.optim.plateau_per_step
    if hooks.on_train_batch_end is not None or plateau:
        batch_end(trainer, hooks.on_train_batch_end, read, outputs, batch, batch_idx, plateau)


def forward_backward(trainer: "TrainerView", batch: Any, batch_idx: int, accumulate: int, hooks: BatchHooks
                     ) -> tuple[Any, torch.Tensor | None]:
    """The module's ``training_step`` (through the strategy's wrapper), the loss kept for the
    non-finite watch and the log, zero_grad where a window starts, and backward: the outputs for
    ``on_train_batch_end`` (Lightning's ``{"loss": ..., **other keys}``), and the loss (None for
    a batch it skipped)."""
    outputs = trainer.run.wrapped("train", batch, batch_idx)  # forward: the module's training_step
    if outputs is None:
        return skipped_batch(trainer, batch_idx, accumulate, hooks)
    loss = outputs if type(outputs) is torch.Tensor and outputs.dim() == 0 and outputs.requires_grad \
        else training_loss(outputs)  # the checks and the message for anything else
    value = loss.detach()
    watch = trainer.run.nonfinite.watch
    if watch is not None:
        watch.observe(value, trainer.loop.global_step)  # the non-finite check, on the device
    results = trainer.run.results
    results.log_loss(LOSS_KEY, value)
    if accumulate > 1:
        loss = loss / accumulate
    if accumulate == 1 and type(outputs) is torch.Tensor:  # batch_end_outputs' answer, without the call
        outputs = {"loss": value}
    else:
        outputs = batch_end_outputs(outputs, value if accumulate == 1 else loss.detach())
    if accumulate == 1 or batch_idx % accumulate == 0:  # an accumulation window starts: Lightning's place
        trainer.run.optim.zero_grad(trainer, batch_idx, hooks)
    if hooks.on_before_backward is not None:
        hooks.on_before_backward(loss)
    trainer.strategy.backward(loss)
    if hooks.on_after_backward is not None:
        hooks.on_after_backward()
    return outputs, loss


def skipped_batch(trainer: "TrainerView", batch_idx: int, accumulate: int, hooks: BatchHooks) -> tuple[dict, None]:
    """``training_step`` returned None: Lightning's skip. zero_grad still runs where a window
    starts; backward does not. The optimizer still steps (over no new gradients: plain SGD leaves
    the weights, optimizers with momentum or weight decay move them, as in Lightning), the step
    is counted and ``on_train_batch_end`` receives ``{}``. One replica only: with several, the
    others would wait for this one in backward's all-reduce. A fit whose every batch of a first
    epoch (or 1000) was skipped stops with an error: its step forgot to return the loss."""
    if trainer.world_size > 1:
        raise ValueError(
            f"training_step returned None at batch {batch_idx} to skip it, but {trainer.world_size} replicas train "
            "together: the others would wait for this one's gradients (Lightning does not skip with several "
            "devices either). Return a loss that changes nothing instead, e.g. `loss * 0`, or drop the batch in "
            "the dataset or its collate_fn.")
    optim = trainer.run.optim
    if not optim.skipped:  # once per fit, not a warnings call on every skipped batch
        rank_zero_warn("training_step returned None: the batch is skipped (no backward), as in Lightning; the "
                       "optimizer still steps. If this was on purpose, ignore this warning (shown once).")
    optim.skipped += 1
    if optim.skipped == trainer.loop.batches_done + 1 and optim.skipped >= min(trainer.num_training_batches, 1000):
        # Every batch of this fit so far, a whole epoch's worth: a step that forgot to return its loss.
        raise ValueError(f"training_step returned None for each of the fit's first {optim.skipped} batches: "
                         "nothing was trained. Return the loss (does training_step end without `return loss`?); "
                         "None skips a batch on purpose, not all of them.")
    if accumulate == 1 or batch_idx % accumulate == 0:
        optim.zero_grad(trainer, batch_idx, hooks)
    return {}, None


def manual_training_step(trainer: "TrainerView", batch: Any, batch_idx: int, hooks: BatchHooks) -> None:
    """Manual optimization: ``training_step`` runs backward and steps the optimizers itself
    (``self.manual_backward``, ``self.optimizers()``); the graph is still cut once per call."""
    loop = trainer.loop
    results = trainer.run.results
    outputs = trainer.model("train", batch, batch_idx)
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.detach().reshape(())
        trainer.run.nonfinite.observe(loss, loop.global_step)
        results.log(LOSS_KEY, loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=False,
                    reduce_fx="mean", batch_size=None)
    loop.stepped = True  # the module stepped (or not) itself: any batch is a boundary
    loop.batches_stepped += 1  # once per batch, however many optimizers stepped (as Lightning counts)
    trainer.run.optim.forget_pending_clips()
    read = loop.batches_stepped % trainer.log_every_n_steps == 0
    if read:  # a logging batch: read as in training_step
        trainer.strategy.runtime.add_step_closure(lambda: publish_step_values(trainer))
    trainer.strategy.runtime.sync()  # the graph cut: one execution per training_step call
    loop.batches_in_epoch = batch_idx + 1
    if hooks.on_train_batch_end is not None:
        batch_end(trainer, hooks.on_train_batch_end, read, manual_batch_end_outputs(outputs), batch, batch_idx)


def batch_end(trainer: "TrainerView", hook: Any, read: bool, outputs: Any, batch: Any, batch_idx: int,
              plateau: bool = False) -> None:
    """``on_train_batch_end``, after the schedulers stepped per step that monitor a metric
    (``plateau``: a ``ReduceLROnPlateau``, which Lightning steps once the step's values are
    logged). A read of ``trainer.callback_metrics`` here reads the per-step values it does not
    have yet first (``Publisher.preview``): this step's where ``read`` did not (not a logging
    step), and those the hooks logged. The hooks and schedulers see this step's values, as in
    Lightning, and nothing is read where none of them asks."""
    publisher = trainer.run.publisher
    publisher.open_step_preview(trainer, read)
    try:
        if plateau:
            trainer.run.optim.step_schedulers(trainer, "step", batch_idx, plateau=True)
        if hook is not None:
            hook(outputs, batch, batch_idx)
    finally:
        publisher.previewing = None


def batch_end_outputs(outputs: Any, loss: torch.Tensor) -> dict[str, Any]:
    """What ``on_train_batch_end`` receives under automatic optimization, as in Lightning: the
    loss, detached and divided by ``accumulate_grad_batches`` (``loss``), with the other entries
    of a dict ``training_step`` returned, as they are."""
    if isinstance(outputs, Mapping):
        return {"loss": loss, **{key: value for key, value in outputs.items() if key != "loss"}}
    return {"loss": loss}


def manual_batch_end_outputs(outputs: Any) -> dict[str, Any]:
    """Under manual optimization, as in Lightning: what ``training_step`` returned as a dict (a
    tensor as ``{"loss": ...}``, nothing as ``{}``), its ``loss`` detached."""
    if outputs is None:
        return {}
    outputs = dict(outputs) if isinstance(outputs, Mapping) else {"loss": outputs}
    if isinstance(outputs.get("loss"), torch.Tensor):
        outputs["loss"] = outputs["loss"].detach()
    return outputs


def publish_step_values(trainer: "TrainerView") -> None:
    """The logging step's read of the per-step values (a host sync, once per interval)."""
    strategy = trainer.strategy
    trainer.run.publisher.publish(trainer, trainer.run.results.step_tensors(strategy.collectives.reduce, trainer.world_size),
                               check_loss=True, logging_step=True)


# ---- when to stop, when to validate ----------------------------------------------------------
def note_stop_requests(trainer: "TrainerView") -> None:
    """After a batch (where one of them can ask): a signal, the platform's preemption notice or
    ``max_time`` asks to stop, as ``should_stop`` does (every replica stops at one step)."""
    asked = interrupts.requested() is not None
    preempted = trainer.strategy.preempted
    if not asked and preempted is not None and preempted(trainer.loop.global_step):
        interrupts.request(signal.SIGTERM)  # the preemption notice: every process stops at this step
        trainer.run.agreement.stop_agreed = asked = True
        trainer.run.agreement.stop_signal = signal.SIGTERM
    if asked:
        trainer.should_stop = True
    elif trainer.max_time is not None and time.monotonic() - trainer.run.started_at >= trainer.max_time:
        trainer.should_stop = True  # host clock, no device sync; replicas agree as for any stop


def stopping(trainer: "TrainerView") -> bool:
    """Whether ``should_stop`` ends the fit. With several replicas, one replica's request is shared
    at the next logging step that agrees (``Publisher``) or epoch end, and all stop
    together; stopping on one alone would leave the others waiting in a collective. Before
    ``min_epochs``/``min_steps`` only a signal stops the fit."""
    agreement = trainer.run.agreement
    asked = agreement.stop_agreed if agreement.several else trainer.should_stop
    if asked and stop_signal(trainer) is None and not minimum_done(trainer):
        return False
    return asked


def stop_signal(trainer: "TrainerView") -> int | None:
    """The signal the fit stops on, if one asked: with several replicas, the one their stop vote
    agreed on (a signal to one replica becomes every replica's, ``interrupts.adopt``), never this
    replica's own request before the vote has carried it, so that every replica takes the same
    path (the signal's checkpoint, or the epoch's end and its collectives); alone, this process's."""
    agreement = trainer.run.agreement
    return agreement.stop_signal if agreement.several else interrupts.requested()


def minimum_done(trainer: "TrainerView") -> bool:
    loop = trainer.loop
    return ((trainer.min_epochs is None or loop.current_epoch >= trainer.min_epochs)
            and (trainer.min_steps is None or loop.global_step >= trainer.min_steps))


def limits_reached(trainer: "TrainerView") -> bool:
    """Whether the fit has run as far as ``max_steps``/``max_epochs`` let it."""
    loop = trainer.loop
    return ((trainer.max_steps != -1 and loop.global_step >= trainer.max_steps)
            or (trainer.max_epochs != -1 and loop.current_epoch >= trainer.max_epochs))


def validation_epoch(trainer: "TrainerView") -> bool:
    every = trainer.check_val_every_n_epoch
    return every is None or (trainer.loop.current_epoch + 1) % every == 0


def validation_every(trainer: "TrainerView") -> int | None:
    """Every how many batches of this epoch validation runs (None: not inside this epoch, or
    when its time has come: a time-based ``val_check_interval``, ``ValidationClock``)."""
    if not validation_epoch(trainer):
        return None
    n = trainer.num_training_batches
    interval = trainer.val_check_interval
    if is_time(interval):
        return None
    if isinstance(interval, float):
        if math.isinf(n):
            if interval != 1.0:
                raise ValueError("val_check_interval as a fraction needs a training loader with a length; "
                                 "give an int (a number of batches) instead.")
            return None  # validated when the epoch ends
        return max(1, int(n * interval))
    return interval


def validate(trainer: "TrainerView", val: list, clock: "ValidationClock | None") -> None:
    """A validation inside the fit; a time-based interval counts from its end, as in Lightning."""
    evaluation.validate_during_fit(trainer, val)
    if clock is not None:
        clock.validated(trainer.run.agreement)


class ValidationClock:
    """A time-based ``val_check_interval`` (``"DD:HH:MM:SS"``, a ``timedelta``, a dict), as in
    Lightning 2.6: validation runs after the first batch that ends once ``seconds`` of the host's
    clock have passed since the fit's training began or the last validation ended (in an epoch
    that validates, ``check_val_every_n_epoch``), not at every epoch's end.

    One replica reads its clock after every batch (no device sync). Several replicas must agree,
    or they would part ways at a batch where one clock says yes and another no: each one's clock
    rides in the vote the replicas exchange anyway (``agreement.py``: at logging steps, their
    agreements, and epoch ends; no extra host sync), and validation runs, on every replica, after
    the batch where the vote that carried a yes is taken (``Agreement.take_validation``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.since = time.monotonic()

    @classmethod
    def of(cls, trainer: "TrainerView") -> "ValidationClock | None":
        interval = trainer.val_check_interval
        return cls(seconds(interval, "val_check_interval")) if is_time(interval) else None

    def due(self) -> bool:
        """This replica's clock: the interval has passed (host clock only)."""
        return time.monotonic() - self.since >= self.seconds

    def come(self, agreement: Any) -> bool:
        """Whether to validate after this batch: the agreed vote with several replicas (taken at
        the same batch by all), else this replica's clock."""
        return agreement.take_validation() if agreement.several else self.due()

    def validated(self, agreement: Any) -> None:
        """A validation ended: the interval counts again from now, and a yes voted before or
        during it is spent."""
        self.since = time.monotonic()
        agreement.take_validation()


def check_validation_interval(trainer: "TrainerView") -> None:
    """A number of batches between validations that no epoch reaches is refused, as in Lightning."""
    interval, n = trainer.val_check_interval, trainer.num_training_batches
    if not isinstance(interval, float) and not is_time(interval) and trainer.check_val_every_n_epoch is not None and interval > n:
        raise ValueError(f"val_check_interval={interval} is more than the {n} training batches of an epoch, so "
                         "validation would never run. Give at most that many, set check_val_every_n_epoch=None to "
                         "count the batches across epochs, or limit_val_batches=0 to turn validation off.")
