"""``Run``: what one replica's run owns, so that the ``Trainer`` is a façade over it.

The wrapped module, the optimizers, the logged results and their publisher, the hook table, the
run's data module and data (as the strategy delivers it) with the state a resumed epoch restores,
the batch transfer, and the configuration the run was built from. The loop (``xtrainer/loop/``)
reads and writes these as ``trainer.run``; hooks and callbacks see the Trainer, whose Lightning
properties (``model``, ``optimizers``, ``train_dataloader``, ``datamodule``,
``num_training_batches``...) read them. Where a fit is, is ``LoopState``
(``state.py``), beside it as ``trainer.loop``.

Each replica works on its own copy (the launcher pickles or copies the Trainer with its Run);
what cannot travel (the module, the wrapped module, the optimizers, the hook table) is left
behind and set again by the replica (``loop/stages.py``: ``run_stage``).
"""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Any, Callable

from torch import nn

from xtrainer.launch.interrupts import TrainingInterrupted
from xtrainer.loop.agreement import Agreement
from xtrainer.loop.hooks import HookTable
from xtrainer.loop.loaders import num_batches
from xtrainer.loop.nonfinite import NonFinite
from xtrainer.loop.optimization import Optimization
from xtrainer.loop.publishing import Publisher
from xtrainer.loop.results import Results
from xtrainer.module import XModule
from xtrainer.states import TrainerState
from xtrainer.strategies.data import CombinedData
from xtrainer.trainer_view import TrainerView
from xtrainer.utilities.combined_loader import CombinedLoader


class Run:
    """One replica's run of a stage, for the Trainer ``trainer`` (its façade).

    ``module``: the stage's module (None outside a stage), ``last_module``: the last stage's.
    ``wrapped``: the module as the strategy wrapped it. ``transfer``: the batch-transfer hooks
    (``loop.steps.batch_transfer``), where the module or data module overrides them.
    ``optim``: the optimizers and how they step. ``results``: where ``self.log`` puts values now
    (``train_results`` during training, an evaluation's during it). ``publisher``: reads them to
    the host, hands them out and keeps what it handed out (``callback_metrics``,
    ``logged_metrics``, ``progress_bar_metrics``). ``nonfinite``: the watch for a NaN or infinite training loss
    (``detect_nonfinite``). ``agreement``: the replicas' agreement on a stop and a time-based
    validation. ``hooks``: who overrides which hook (``call``). ``datamodule``: the data module
    of the stage running or the last one (None: none; set by ``loaders.prepare``, read as
    ``trainer.datamodule``). ``stage_data``: the stage's loaders, as the strategy delivers them;
    ``train_data``: the fit's training data;
    ``restored_data_state``: the data order a resumed epoch continues (set by ``restore``, taken
    by the loop at the epoch's start). ``num_training_batches``: the batches of a training epoch
    (one owner: ``count_training_batches``). ``loader_hooks``: which ``*_dataloader`` hook made a
    stage's loaders (for reloading). ``predict_batch_indices``: per loader, the sample indices of
    each predicted batch. ``started_at``: the fit's start (monotonic clock, for ``max_time``).
    ``state``, ``interrupted``, ``is_last_batch``, ``sanity_checking``: Lightning's (the Trainer's
    read-only properties of those names; ``state`` a ``TrainerState``, whose status also reads
    ``ended_by_exception``). ``checkpoint_compilations``: graphs compiled while
    writing checkpoints, so far in this process.
    ``replica_ready``: the strategy has set up a replica's environment. ``resumed_by_path``: the
    checkpoint was named by path, not ``"last"`` (``ModelCheckpoint`` keeps it). ``config``: the
    resolved configuration of ``xtrainer fit`` (flat keys; empty for a Trainer built in code),
    read as ``trainer.run_config`` and logged beside the hyperparameters.
    """

    def __init__(self, trainer: TrainerView, detect_nonfinite: str) -> None:
        self.trainer = trainer
        self.publisher = Publisher()
        self.nonfinite = NonFinite(detect_nonfinite)
        self.agreement = Agreement()
        self.hooks = HookTable()
        self.module: XModule | None = None
        self.last_module: XModule | None = None
        self.wrapped: nn.Module | None = None
        self.transfer: Any = None
        self.datamodule: Any = None
        self.optim = Optimization()
        self.train_results = self.results = Results("train", default_on_step=True)
        self.stage_data: dict[str, list[Any]] = {}
        self.train_data: Any = None
        self.restored_data_state: Any = None
        self.num_training_batches: float = 0
        self.num_val_batches: list[float] = []
        self.loader_hooks: dict[str, Any] = {}
        self.predict_batch_indices: list[list[list[int]]] = []
        self.state = TrainerState("idle", None, self)
        self.interrupted = self.ended_by_exception = False
        self.checkpoint_compilations = 0
        self.is_last_batch = False
        self.sanity_checking = False
        self.started_at = 0.0
        self.replica_ready = False
        self.resumed_by_path = False
        self.resolved_ckpt: tuple[Any, str | None] | None = None  # Trainer.resolve_ckpt_path's answer, kept once
        self.config: dict[str, Any] = {}

    def call(self, hook: str, *args: Any) -> Any:
        """Call ``hook`` on every callback, in order, then on the module, as Lightning does; the
        module's answer. Only those that override the no-op are called (``xtrainer/loop/hooks.py``)."""
        trainer = self.trainer
        module = self.module if self.module is not None else trainer.module  # (the property says what is wrong)
        own, callbacks = self.hooks.entry(hook, module, trainer.callbacks)
        for fn in callbacks:
            fn(trainer, module, *args)
        return own(*args) if own is not None else None

    def call_on_exception(self, err: BaseException) -> None:
        """Every ``on_exception`` hook, each given its chance: one that fails does not hide ``err``.
        A stop on a signal or Ctrl-C is ``interrupted`` by then, as in Lightning."""
        trainer = self.trainer
        self.interrupted = isinstance(err, (TrainingInterrupted, KeyboardInterrupt))
        self.ended_by_exception = True
        module = self.module
        if module is None:
            return
        hooks = [(f"{type(cb).__name__}.on_exception", functools.partial(cb.on_exception, trainer, module, err))
                 for cb in trainer.callbacks] + [(f"{type(module).__name__}.on_exception",
                                                  lambda: module.on_exception(err))]
        run_cleanup(hooks, err)  # one that fails is a note on err, which goes on

    def num_batches(self, data: Any, stage: str) -> float:
        """The batches of ``data`` that ``stage`` runs (``limit_*_batches`` applied)."""
        return num_batches(data, self.trainer.limits["train" if stage == "fit" else stage], stage)

    def count_training_batches(self) -> float:
        """``num_training_batches``: set here only, from the training data the fit runs now."""
        self.num_training_batches = self.num_batches(self.train_data, "train") if self.train_data is not None else 0
        return self.num_training_batches

    def device_data(self, loader: Any) -> Any:
        """``loader`` as the strategy delivers it to this replica (training loaders read together
        as a ``CombinedLoader``: each one as a loader is)."""
        trainer = self.trainer
        if isinstance(loader, CombinedLoader):
            return CombinedData(loader, [self.device_data(inner) for inner in loader.flattened],
                                trainer.strategy.runtime.rng_state_kept)
        return trainer.strategy.process_dataloader(loader, distribute=trainer.use_distributed_sampler)

    def train_data_state(self) -> Any:
        """What a checkpoint keeps of the training data's order in this epoch (None: nothing)."""
        return self.train_data.state_dict() if self.train_data is not None else None

    def end_stage(self) -> None:
        """The stage is over (in the replica): no module or wrapped module any more."""
        self.wrapped = self.module = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(module=None, last_module=None, wrapped=None, optim=Optimization(), hooks=HookTable())
        return state


def run_cleanup(steps: list[tuple[str, Callable[[], Any]]], error: BaseException | None) -> None:
    """Run every ``(name, step)`` of a clean-up, each also when one before it failed. When the
    run failed with ``error``, that error stays the one raised: a step that fails too is told as
    a note on it (and its traceback printed), as Lightning keeps the original error. Otherwise
    the first step to fail is raised once every step ran (later failures as notes on it)."""
    first: BaseException | None = None
    for name, step in steps:
        try:
            step()
        except Exception as step_err:  # noqa: BLE001 - reported below; the clean-up goes on
            note = f"({name} failed too: {type(step_err).__name__}: {step_err})"
            if error is not None:
                error.add_note(note)
                print(f"xtrainer: while the run was ending with {type(error).__name__}, {name} failed:\n"
                      + "".join(traceback.format_exception(step_err)), file=sys.stderr, flush=True)
            elif first is None:
                first = step_err
            else:
                first.add_note(note)
    if first is not None:
        raise first
