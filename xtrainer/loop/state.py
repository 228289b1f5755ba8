"""Where a fit is: the loop's position, what a checkpoint's ``"loops"`` entry records and what a
resumed fit continues from. Only the loop (``xtrainer/loop/``) writes it; everything else reads it
through the Trainer's ``global_step`` and ``current_epoch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LoopState:
    """The position of a fit.

    ``global_step``: optimizer steps taken. ``current_epoch``: the epoch running (or next).
    ``batches_in_epoch``: training batches of the current epoch done. ``epoch_finished``: every
    batch of ``current_epoch`` trained (between its last batch and the next epoch's start).
    ``validation_pending``: between a batch's end (where checkpoints are saved) and the validation
    it triggers: a run resumed there validates first, as the original went on to do.
    ``epoch_schedulers_due``: between an epoch's end and its schedulers' epoch step (where epoch-end
    checkpoints are written). ``stepped``: the last training batch ended with an optimizer step
    (a stop waits for one). ``skip_batches``: batches of the resumed epoch already trained.
    ``seed``: the run's seed (data order, each replica's device generator). ``batches_stepped``:
    training batches that ended with an optimizer step, or any batch under manual optimization,
    once each however many optimizers stepped (Lightning's ``_batches_that_stepped``, the
    loggers' step; saved). ``batches_done``:
    training batches finished by this replica's fits, counted on the host (not saved).
    ``progress``: while the hang watchdog watches the fit, a one-element view of memory shared
    with its monitor process, where the loop stores ``batches_done`` after each batch
    (``launch/watchdog.py``); else None.
    """

    global_step: int = 0
    current_epoch: int = 0
    batches_in_epoch: int = 0
    epoch_finished: bool = True
    validation_pending: bool = False
    epoch_schedulers_due: bool = False
    stepped: bool = True
    skip_batches: int = 0
    seed: int = 0
    batches_stepped: int = 0
    batches_done: int = 0
    progress: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "progress": None}  # the shared memory stays with its process

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``"loops"`` entry (names as ``xtrainer.checkpoint.format`` documents)."""
        return {"global_step": self.global_step, "epoch": self.current_epoch,
                "batches_in_epoch": self.batches_in_epoch, "epoch_finished": self.epoch_finished,
                "seed": self.seed, "validation_pending": self.validation_pending,
                "epoch_schedulers_due": self.epoch_schedulers_due, "batches_stepped": self.batches_stepped}

    def load_state_dict(self, loops: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``"loops"``: a finished epoch resumes at the next one's
        start, an unfinished one at its next unseen batch (with a validation it still owed)."""
        finished = bool(loops["epoch_finished"])
        self.global_step = int(loops["global_step"])
        # A checkpoint written before the count was saved: one optimizer step per batch
        self.batches_stepped = int(loops.get("batches_stepped", self.global_step))
        self.seed = int(loops.get("seed", self.seed))
        self.epoch_finished = finished
        self.current_epoch = int(loops["epoch"]) + (1 if finished else 0)
        self.skip_batches = 0 if finished else int(loops["batches_in_epoch"])
        self.batches_in_epoch = self.skip_batches
        self.validation_pending = bool(loops.get("validation_pending")) and not finished
        self.epoch_schedulers_due = False
        self.stepped = True

    def draw_seed(self, seed: int) -> None:
        """The run's seed, drawn where the stage starts (the calling process), so that every
        replica agrees: it seeds the samplers' shuffling (with the epoch) and each replica's
        device generator (with its rank); a resumed fit takes the checkpoint's instead."""
        self.seed = seed

    def adopt(self, other: "LoopState") -> None:
        """Where rank 0's fit stands (``other``, brought home from its process), kept in this
        object (the watchdog's view of the progress stays this process's)."""
        self.__dict__.update({**other.__dict__, "progress": self.progress})

    def report_progress(self, view: Any) -> None:
        """From now on, store ``batches_done`` in ``view`` after each batch (a one-element view of
        memory shared with the hang watchdog's monitor process; None: no longer). The watchdog
        asks for it (``launch/watchdog.py``); the loop writes it."""
        if view is not None:
            view[0] = self.batches_done
        self.progress = view

    def next_epoch(self) -> None:
        """An epoch ended with its every batch trained and its schedulers stepped."""
        self.epoch_schedulers_due = False
        self.current_epoch += 1
        self.batches_in_epoch = 0
