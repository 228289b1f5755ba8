"""The replicas' agreement: a stop (``should_stop``, a signal) and a time-based validation that
every replica takes at the same batch.

Each replica's vote (``Agreement.local_vote``) is one number; the largest over the replicas,
one reduction that rides along with the read of logged values (``Publisher.publish``), says
whether any replica asked to stop, on which signal, and whether a validation is due. A signal
that reached one replica only becomes every replica's own request (``interrupts.adopt``), so
that all of them take the signal's path: one checkpoint written together, and the exit with
128 + the signal.

Where collectives run as they are called (the native strategies on several processes), a
logging step only starts the agreement (``start``), and the loop settles it after the next batch
(``settle``, when ``batches_done`` reaches ``due``): the host never waits for the slowest replica.
Such an agreement is an all-reduce of its own, so logging steps start one only every
``agreement_seconds`` (the collectives' setting): each agreement also settles the global step of
the next one (``propose``), the least any replica proposes from its own clock.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from xtrainer.launch import interrupts
from xtrainer.loop.nonfinite import NonFiniteWatch
from xtrainer.loop.results import to_floats
from xtrainer.trainer_view import TrainerView

STOP_KEY = "xtrainer/should_stop"
_NEXT_KEY = "xtrainer/next_agreement_step"


class Agreement:
    """One fit's agreement among its replicas (see the module's docstring)."""

    def __init__(self) -> None:
        self.stop_agreed = False
        # The signal the replicas agreed to stop on (None: none, or a stop not asked for by one);
        # with several replicas the loop takes the signal's path on this, never on a replica's own
        # request not yet voted on, so that all of them take the same path.
        self.stop_signal: int | None = None
        self.several = False  # the fit has more than one replica (set at its start)
        # A time-based val_check_interval (fit.ValidationClock): this replica's clock, which the
        # vote carries, and whether a vote the replicas took said that one was due.
        self.validation_due: Callable[[], bool] | None = None
        self.validation_agreed = False
        # The agreement a logging step started: what finishes it, and the count of batches done
        # after which the loop settles it (-1: none under way).
        self._finish: Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None = None
        self.due = -1
        # The global step from which a logging step starts the next agreement, and the host clock
        # and global step where the last one started (None: none yet in this fit).
        self.next_step = 0
        self._started: tuple[float, int] | None = None

    def start_fit(self, trainer: "TrainerView") -> None:
        self._finish, self.due = None, -1
        self.next_step, self._started = 0, None
        self.stop_signal = None
        self.several = trainer.world_size > 1
        self.validation_due, self.validation_agreed = None, False

    @property
    def under_way(self) -> bool:
        """A logging step started an agreement that is not settled yet."""
        return self._finish is not None

    def local_vote(self, trainer: "TrainerView") -> int:
        """This replica's vote: four times the number of the signal that asked this process to
        stop (0: none), plus 2 where ``should_stop`` is set, plus 1 where its clock says a
        time-based validation is due (``validation_due``). The largest over the replicas says
        whether any replica asked to stop (2 or more), the largest signal number among those that
        asked (a quarter of it, rounded down), and, where none asked, whether any replica's
        validation is due (1). A stop outranks the validation bit without losing it: a stop that
        no signal asked for validates first anyway."""
        due = self.validation_due is not None and self.validation_due()
        return 4 * (interrupts.requested() or 0) + (2 if trainer.should_stop else 0) + (1 if due else 0)

    def agree(self, trainer: "TrainerView", shares_stop: bool, first: torch.Tensor | None, later: bool
              ) -> tuple[bool, torch.Tensor | int, torch.Tensor | None]:
        """Agree on the stop vote (``shares_stop``) and the non-finite watch's first bad step
        (``first``) in one reduction: ``(started, stop, first)``. ``later``: where the collectives
        run as called, only start it (``started``: settled after the next batch)."""
        vote = self.local_vote(trainer) if shares_stop else 0
        collectives = trainer.strategy.collectives
        finish = collectives.agree_later(vote, first, self.propose(trainer, collectives.agreement_seconds)) \
            if later else None
        if finish is not None:
            self._finish, self.due = finish, trainer.loop.batches_done + 2  # after the next batch
            return True, 0, None
        stop, first = collectives.agree(vote, first)
        return False, stop if shares_stop else 0, first

    def settle(self, trainer: "TrainerView") -> None:
        """Finish the agreement a logging step started: stop with the others if any replica
        asked to, report a non-finite loss any of them saw."""
        finish, self._finish, self.due = self._finish, None, -1
        stop, first, next_step = finish()
        tensors = {STOP_KEY: stop, _NEXT_KEY: next_step}
        if first is not None:
            tensors[NonFiniteWatch._FIRST] = first
        values = to_floats(tensors, trainer.strategy.runtime.to_cpu)  # host sync: of a reduction started a batch ago
        self.next_step = int(values.pop(_NEXT_KEY))
        vote = values.pop(STOP_KEY)
        if trainer.state == "fit":
            self.take(trainer, vote)
        if first is not None:
            trainer.run.nonfinite.report(trainer, trainer.run.nonfinite.watch.first_step(values))

    def take_validation(self) -> bool:
        """Whether a vote the replicas took since the last call said a time-based validation was
        due (then spent)."""
        agreed, self.validation_agreed = self.validation_agreed, False
        return agreed

    def take(self, trainer: "TrainerView", vote: Any) -> None:
        """The replicas' agreed vote (the largest ``local_vote``): stop, on the signal it carries,
        if any, taken as this process's own request; note a validation that is due."""
        vote = int(vote)
        if vote % 2:
            self.validation_agreed = True
        if vote < 2:
            return
        signum = vote // 4
        if signum:
            interrupts.adopt(signum)  # a no-op where this process has the signal already
            self.stop_signal = max(self.stop_signal or 0, signum)
        trainer.should_stop = self.stop_agreed = True

    def propose(self, trainer: "TrainerView", seconds: float) -> int:
        """The global step this replica proposes for the next agreement: ``seconds`` on, at the
        pace of the steps since the last one (by the host clock; its logging steps read the
        device, so that pace is the device's). Without a pace yet, the next logging step."""
        now, step = time.perf_counter(), trainer.global_step
        last, self._started = self._started, (now, step)
        if not seconds or last is None or step <= last[1] or now <= last[0]:
            return step + 1
        ahead = seconds / ((now - last[0]) / (step - last[1]))
        return step + max(1, math.ceil(ahead)) if ahead < NonFiniteWatch.NEVER else NonFiniteWatch.NEVER
