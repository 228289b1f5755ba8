"""Lightning's names for where a Trainer is (``lightning.pytorch.trainer.states``): ``TrainerFn``,
``RunningStage``, ``TrainerStatus`` and ``trainer.state``'s ``TrainerState``.

``trainer.state`` is also the name of what runs, as a string: ``"fit"``, ``"validate"``,
``"test"``, ``"predict"``, or ``"idle"`` between runs, so that ``trainer.state == "fit"`` reads
as it always did, and Lightning's ``trainer.state.fn``, ``.stage``, ``.status``, ``.finished``
and ``.stopped`` read as in Lightning. The Run (``loop/run.py``) holds it, and only the loop
replaces it (``loop/stages.py``), at a stage's start and end; its stage and status are read
from the Run when asked, nothing per batch.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class TrainerFn(str, Enum):
    """What the user called: ``fit``, ``validate``, ``test`` or ``predict``."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    def __str__(self) -> str:
        return self.value


class RunningStage(str, Enum):
    """Which loop runs: fit's training batches, its sanity check or validation, or a stage."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str | None:
        """The ``*_dataloader`` hook's prefix: ``val`` for validation and the sanity check."""
        if self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
            return "val"
        return self.value

    def __str__(self) -> str:
        return self.value


class TrainerStatus(str, Enum):
    """``initializing`` before the first run, ``running``, then ``finished`` or ``interrupted``
    (a signal, Ctrl-C or an error ended it)."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"

    @property
    def stopped(self) -> bool:
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)

    def __str__(self) -> str:
        return self.value


class TrainerState(str):
    """``trainer.state``: the name of what runs (``"idle"`` between runs), with Lightning's
    ``fn`` (what ran last, kept after it ends), ``stage``, ``status``, ``finished`` and
    ``stopped``. ``run``: what reports whether fit's sanity check or validation runs
    (``sanity_checking``, ``results.stage``) and whether the last run ended by an exception
    (``ended_by_exception``)."""

    fn: TrainerFn | None

    def __new__(cls, name: str, fn: str | None, run: Any) -> "TrainerState":
        state = super().__new__(cls, name)
        state.fn = TrainerFn(fn) if fn is not None else None
        state._run = run
        return state

    @property
    def stage(self) -> RunningStage | None:
        if self == "idle":
            return None
        if self == "fit":
            if self._run.sanity_checking:
                return RunningStage.SANITY_CHECKING
            return RunningStage.VALIDATING if self._run.results.stage == "validate" else RunningStage.TRAINING
        return RunningStage(str(self))

    @property
    def status(self) -> TrainerStatus:
        if self != "idle":
            return TrainerStatus.RUNNING
        if self.fn is None:
            return TrainerStatus.INITIALIZING
        return TrainerStatus.INTERRUPTED if self._run.ended_by_exception else TrainerStatus.FINISHED

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status.stopped

    def __reduce__(self) -> tuple:  # pickled with its Run (a Trainer sent to a spawned replica)
        return (TrainerState, (str(self), None if self.fn is None else self.fn.value, self._run))
