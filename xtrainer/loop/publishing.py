"""Publishing logged values: the one place they reach the host, and everything that rides along.

Values logged with ``self.log`` stay on the device; every ``log_every_n_steps`` optimizer steps
and at the end of each epoch the Trainer hands them here. ``Publisher.publish`` reads them in one
batched transfer (the interval's one host sync), together with two things that ride along:

- the replicas' agreement (``agreement.py``): whether any replica asked to stop, on which
  signal, and whether a time-based validation is due, so that all of them stop or validate at
  the same batch (where collectives run as they are called, a logging step only starts it, and
  the loop settles it a batch later);
- the global step of the first non-finite training loss (``nonfinite.py``), tracked inside each
  step's graph, so that ``detect_nonfinite`` costs no extra host sync.

Then it hands the values out: ``callback_metrics``, ``progress_bar_metrics`` and
``logged_metrics``, which the ``Publisher`` keeps (the Trainer's read-only properties of those
names read them, as Lightning's do); the ``on_metrics`` hook of every callback (the progress bar
and ``XlaHealth`` listen there; a listener may add host-side figures of its own); and last the
loggers, on rank 0.
Nothing else calls a logger's ``log_metrics``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from xtrainer.loop.agreement import STOP_KEY
from xtrainer.loop.metric_values import MetricValues, as_tensor
from xtrainer.loop.nonfinite import NonFiniteWatch
from xtrainer.loop.results import to_floats
from xtrainer.trainer_view import TrainerView


#: The loop's own entry for the step's training loss (what ``training_step`` returned): read with
#: the logged values for the progress bar, never published as a metric, so that a value the
#: module logs as ``"loss"`` is the module's, as in Lightning.
LOSS_KEY = "xtrainer/loss"
#: ``Publisher.previewing`` while a training batch's end hooks run (``fit.batch_end``).
STEP_VALUES = "train-step"
def automatic_lr_names(optimizers: list[Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The names every parameter group's learning rate is logged under without a
    ``LearningRateMonitor``: ``lr-<Optimizer>/pg<i>``, and ``lr-<Optimizer>-<n>/pg<i>`` for the
    n-th other optimizer of the same class (a GAN's two Adams), with each group."""
    seen: dict[str, int] = {}
    for optimizer in optimizers:
        kind = type(optimizer).__name__
        count = seen[kind] = seen.get(kind, -1) + 1
        prefix = f"lr-{kind}" if not count else f"lr-{kind}-{count}"
        for i, group in enumerate(optimizer.param_groups):
            yield f"{prefix}/pg{i}", group


class Publisher:
    """Reads logged values to the host and hands them out (see the module's docstring); keeps
    what it handed out: ``callback_metrics`` and ``logged_metrics`` (values: 0-dim CPU tensors,
    ``MetricValues``) and ``progress_bar_metrics`` (floats), changed in place by whoever adds to
    them and replaced only by ``reset_metrics``."""

    # The stage whose module's epoch-end hook is running (end_epoch), or STEP_VALUES while a
    # training batch's end hooks run: a read of callback_metrics there reads the values it does
    # not have yet first (preview).
    previewing: str | None = None

    def __init__(self) -> None:
        self._previewed: dict[str, Any] = {}  # per-step values callback_metrics has, in a batch's end hooks
        self.loop_loss: float | None = None  # the latest read of the step's training loss (LOSS_KEY)
        self.reset_metrics()

    def reset_metrics(self, callback_metrics: Mapping[str, Any] | None = None,
                      logged_metrics: Mapping[str, Any] | None = None,
                      progress_bar_metrics: Mapping[str, float] | None = None) -> None:
        """New dicts of what was handed out: empty as a stage starts (its metrics are its own, as
        in Lightning), or rank 0's, brought home where the replicas ran in other processes."""
        self.callback_metrics = MetricValues(callback_metrics or {})
        self.logged_metrics = MetricValues(logged_metrics or {})
        self.progress_bar_metrics: dict[str, float] = dict(progress_bar_metrics or {})

    # ---- a fit's beginning and end ---------------------------------------------------------
    def start_fit(self, trainer: "TrainerView") -> None:
        self.loop_loss = None
        if trainer.is_global_zero and trainer.module._log_hyperparams:
            for logger in trainer.loggers:
                if callable(getattr(logger, "log_run_settings", None)):
                    logger.log_run_settings(trainer.run_settings())
                logger.log_hyperparams(trainer.hyperparameters())

    def end_fit(self, trainer: "TrainerView") -> None:
        if trainer.is_global_zero and trainer.module._log_hyperparams:
            hidden = trainer.run.results.hidden_from_loggers()
            final = {k: v for k, v in trainer.callback_metrics.items() if k not in hidden}
            for logger in trainer.loggers:
                if _takes_metrics(logger.log_hyperparams):  # Lightning's own loggers, and xtrainer's
                    logger.log_hyperparams(trainer.hyperparameters(), final)

    def close(self, trainer: "TrainerView", failed: bool = False) -> None:
        """Flush what was logged; at the end of every run, also one that failed."""
        for logger in trainer.loggers:
            logger.finalize("failed" if failed else "success")

    # ---- reading and handing out -------------------------------------------------------------
    def publish(self, trainer: "TrainerView", tensors: dict[str, torch.Tensor], check_loss: bool = False,
                logging_step: bool = False, not_logged: set[str] = frozenset(), local: bool = False
                ) -> dict[str, float]:
        """Read ``tensors`` (and what rides along) in one transfer; hand the values out (those
        named in ``not_logged`` to ``callback_metrics`` and the progress bar only, not to the
        loggers). Where the training loss is checked (``check_loss``: a logging step, a training
        epoch's end), replicas whose collectives run as called only start their agreement here,
        and at a ``logging_step`` only once its time has come (see the module's docstring).
        ``local``: this replica's read alone, with no agreement (a read other replicas may not make)."""
        agreement = trainer.run.agreement
        if agreement.under_way and not local:  # any read settles the agreement under way first
            agreement.settle(trainer)
        several = trainer.world_size > 1 and not local
        shares_stop = several and trainer.state == "fit"
        nonfinite = trainer.run.nonfinite
        watched = check_loss and nonfinite.watch is not None
        if watched and not several:
            tensors = {**tensors, **nonfinite.watch.local_tensors()}
        stop: torch.Tensor | int = 0
        if several and logging_step and trainer.global_step < agreement.next_step:
            shares_stop = watched = False  # not yet: the next agreement's step was agreed on
        if shares_stop or (watched and several):  # the replicas agree on both in one reduction
            started, stop, first = agreement.agree(trainer, shares_stop,
                                                   nonfinite.watch.local_first() if watched else None, check_loss)
            if started:
                watched = False
            elif first is not None:
                tensors = {**tensors, NonFiniteWatch._FIRST: first}
        if isinstance(stop, torch.Tensor):  # rides along with the values read
            tensors = {**tensors, STOP_KEY: stop}
        values = to_floats(tensors, trainer.strategy.runtime.to_cpu) if tensors else {}  # host sync: the only place logged values reach the host
        if isinstance(stop, torch.Tensor):
            stop = values.pop(STOP_KEY)
        agreement.take(trainer, stop)
        if watched:
            nonfinite.report(trainer, nonfinite.watch.first_step(values))
        loop_loss = values.pop(LOSS_KEY, None)
        if loop_loss is not None:
            self.loop_loss = loop_loss
        prog = trainer.run.results.prog_bar_names()
        trainer.progress_bar_metrics.update({k: v for k, v in values.items() if k in prog})
        public = values
        stored = {k: as_tensor(v) for k, v in public.items()}  # one CPU tensor per value, for both dicts
        trainer.callback_metrics.update({**stored, **trainer.run.results.plain_names(stored)})
        logged = {k: v for k, v in public.items() if k not in not_logged} if not_logged else public
        trainer.logged_metrics.update({k: stored[k] for k in logged})
        if (logged or logging_step) and trainer.state != "predict" and not trainer.sanity_checking:
            self._hand_out(trainer, dict(logged))  # a logging step also where the module logged nothing
        return public

    def preview(self, trainer: "TrainerView") -> None:
        """``trainer.callback_metrics`` read in the module's own epoch-end hook, which runs before
        the epoch's values are published: they are read first, as Lightning computes them when
        read, so that the hook sees this epoch's values (not the last epoch's, or none). Once
        per hook; the loggers and callbacks get them after it, with whatever the hook logs.
        Likewise in a training batch's end hooks (``_preview_step``: a ``ModelCheckpoint`` with
        ``every_n_train_steps`` monitoring a training value); the loggers still get per-step
        values at logging steps only.

        With several replicas the read is this replica's alone: no collective, since a hook may
        read on rank 0 only (``if self.trainer.is_global_zero: print(...)``), and a reduction
        there would wait for replicas that never make it. Values logged with ``sync_dist`` are
        then this replica's own, and metric objects keep the value last published."""
        stage = self.previewing
        if stage == STEP_VALUES:
            self._preview_step(trainer)
            return
        self.previewing = None
        # metric objects are reset when published; several replicas: each one's own values
        tensors = epoch_tensors(trainer, stage, reset=False, local=trainer.world_size > 1)
        values = to_floats(tensors, trainer.strategy.runtime.to_cpu) if tensors else {}  # host sync: the hook asked for the values
        _into_callback_metrics(trainer, values)

    def open_step_preview(self, trainer: "TrainerView", read: bool) -> None:
        """Before a training batch's end hooks: what ``callback_metrics`` holds of each per-step
        value (``read``: all of them, read at this logging step; else none of this step's)."""
        self.previewing = STEP_VALUES
        self._previewed = {name: entry.last for name, entry in trainer.run.results.entries.items()
                           if entry.on_step} if read else {}

    def _preview_step(self, trainer: "TrainerView", synced: bool = False) -> None:
        """``callback_metrics`` read in a training batch's end hooks: the per-step values logged
        since ``callback_metrics`` last got them (this step's, or logged in these hooks) are read
        first, as Lightning computes them when read; nothing where there are none. Each
        replica reads its own, with no collective (a hook may read on rank 0 alone); a value
        logged with ``sync_dist`` by several replicas keeps its last value reduced across them
        (a read's), not this replica's own. ``synced``: those values alone, reduced across the
        replicas, where every replica asks at once (``preview_synced``)."""
        results, previewed = trainer.run.results, self._previewed
        several = trainer.world_size > 1
        new = [name for name, entry in results.entries.items()
               if entry.on_step and entry.last is not None and previewed.get(name) is not entry.last
               and (several and entry.sync_dist) == synced]
        if not new:
            return
        # Read leaving the device's generator as it was: a run whose callback reads these values
        # draws the numbers of one that does not.
        with trainer.strategy.runtime.rng_state_kept():
            tensors = results.step_tensors(trainer.strategy.collectives.reduce, trainer.world_size if synced else 1,
                                           only=new)
            values = to_floats(tensors, trainer.strategy.runtime.to_cpu)  # host sync: a hook asked for the values
        for name in new:
            previewed[name] = results.entries[name].last
        _into_callback_metrics(trainer, values)

    def preview_synced(self, trainer: "TrainerView") -> None:
        """In a training batch's end hooks, called by every replica at once (a ``ModelCheckpoint``
        about to save, which is collective anyway): the per-step values logged with ``sync_dist``
        that ``callback_metrics`` does not have yet, reduced across the replicas and read (one
        collective and one host sync, where there are any)."""
        if self.previewing == STEP_VALUES and trainer.world_size > 1:
            self._preview_step(trainer, synced=True)

    def _hand_out(self, trainer: "TrainerView", logged: dict[str, float]) -> None:
        """The values read to the callbacks' ``on_metrics`` (which may add their own, as
        ``LearningRateMonitor`` does), then to the loggers. Where the module logged nothing, the
        loggers get only what the callbacks added (nothing at all: no row), as in Lightning."""
        own = bool(logged)
        if own:
            logged["epoch"] = float(trainer.current_epoch)  # as Lightning adds it, in every stage
        values = set(logged)  # the module's values and the epoch: what Lightning's loggers get
        if own and trainer.state == "fit":  # every param group's learning rate rides along
            for name, group in automatic_lr_names(trainer.optimizers):
                lr = group["lr"]
                if not _on_device(lr):  # an lr kept on the device is not read here
                    logged[name] = float(lr)
        module = trainer.module
        for cb in trainer.callbacks:
            cb.on_metrics(trainer, module, logged, trainer.global_step)
        if not logged:
            return
        if trainer.is_global_zero and trainer.loggers:
            hidden = trainer.run.results.hidden_from_loggers()
            for_loggers = {k: v for k, v in logged.items() if k not in hidden} if hidden else logged
            # The run's own figures: what the callbacks added that is no metric (throughput,
            # compilations, the automatic learning rates); a LearningRateMonitor's rates are
            # metrics (in callback_metrics), as Lightning's callbacks log them.
            figures = {k for k in for_loggers if k not in values and k not in trainer.callback_metrics}
            values_only = {k: v for k, v in for_loggers.items() if k not in figures} if figures else for_loggers
            step = logged_step(trainer)
            for logger in trainer.loggers:
                logger.log_metrics(for_loggers if getattr(logger, "takes_run_figures", True) else values_only, step)

def logged_step(trainer: "TrainerView") -> int:
    """The step the loggers are given, Lightning's ``_batches_that_stepped``: in a fit, the
    batches that stepped before this one (a batch's values, a validation after it and an epoch's
    end are written at ``batches_stepped - 1``: the first batch at step 0, with
    ``log_every_n_steps=50`` steps 49, 99...; under manual optimization one per batch, however many
    optimizers stepped); in ``validate``/``test``/``predict``, the steps done."""
    if trainer.state == "fit":
        return max(trainer.loop.batches_stepped - 1, 0)
    return trainer.global_step


def _into_callback_metrics(trainer: "TrainerView", values: dict[str, float]) -> None:
    """A preview's values into ``callback_metrics`` (the loop's own loss left out), with
    Lightning's plain names for values logged both per step and per epoch."""
    values.pop(LOSS_KEY, None)
    trainer.callback_metrics.update({**values, **trainer.run.results.plain_names(values)})


def _on_device(value: Any) -> bool:
    """Whether ``value`` is a tensor on a device (reading it would sync the host)."""
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def end_epoch(trainer: "TrainerView", stage: str, hook: str) -> dict[str, float]:
    """An epoch's end: the module's hook (it may still log; if it reads ``callback_metrics``,
    the epoch's values are read first, see ``Publisher.preview``), then every epoch value read to
    the host (one host sync), then the callbacks' hook, which sees the new ``callback_metrics``."""
    publisher = trainer.run.publisher
    publisher.previewing = stage
    try:
        getattr(trainer.module, hook)()
    finally:
        publisher.previewing = None
    tensors = epoch_tensors(trainer, stage)
    # The latest per-step values ride along for callback_metrics; the loggers got them at their logging steps.
    step_names = set(trainer.run.results.step_tensors_names()) if stage == "train" else set()
    metrics = publisher.publish(trainer, tensors, check_loss=stage == "train", not_logged=step_names)
    results = trainer.run.results
    before = {name: (entry.total, entry.last, entry.metric) for name, entry in results.entries.items()}
    for cb in trainer.callbacks:
        getattr(cb, hook)(trainer, trainer.module)
    # What the callbacks logged in their epoch-end hooks (Lightning's ``pl_module.log`` there):
    # read in a second transfer, only where they logged anything.
    logged = {name for name, entry in results.entries.items()
              if name not in before or any(a is not b for a, b in zip(before[name], (entry.total, entry.last,
                                                                                    entry.metric)))}
    # Each replica's own values, with no collective: a callback may log on rank 0 alone.
    if logged and results is trainer.run.results:
        late = results.epoch_tensors(trainer.strategy.collectives.reduce, 1, only=logged,
                                     metrics=trainer.world_size == 1)
        metrics = {**metrics, **publisher.publish(trainer, late, local=True)}
    return metrics


def epoch_tensors(trainer: "TrainerView", stage: str, reset: bool = True, local: bool = False
                  ) -> dict[str, torch.Tensor]:
    """The epoch's values on the device (each replica's combined where ``sync_dist`` asks),
    with the latest per-step values at a training epoch's end; metrics logged by object are
    reset after their ``compute`` unless ``reset`` is False. ``local``: this replica's own
    values, with no collective (metric objects, which would sync, left out)."""
    collectives = trainer.strategy.collectives
    results = trainer.run.results
    world_size = 1 if local else trainer.world_size  # one replica reduces nothing
    tensors = results.epoch_tensors(collectives.reduce, world_size, collectives.all_gather_tensors, reset,
                                    metrics=not local)
    if stage == "train":  # the latest per-step values ride along in the same transfer
        tensors.update(results.step_tensors(collectives.reduce, world_size))
    return tensors


def _takes_metrics(log_hyperparams: Any) -> bool:
    """Whether a logger's ``log_hyperparams`` takes the final metrics after its params: a custom
    logger written as Lightning's docs write one, ``log_hyperparams(self, params)``, does not
    (Lightning calls it with the params alone), and then has them from the fit's start only."""
    try:
        parameters = list(inspect.signature(log_hyperparams).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) > 1 or any(p.kind == p.VAR_POSITIONAL for p in parameters)
