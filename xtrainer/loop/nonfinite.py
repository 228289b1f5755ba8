"""The non-finite watch: the global step of the first NaN or infinite training loss, known on the
device without a host sync (``detect_nonfinite``).

The loop hands each step's training loss to ``NonFinite.observe`` (and each optimizer step to
``stepped``); the watch (``NonFiniteWatch``) records it on the device. Its tensors ride along
with the logged values when ``Publisher.publish`` reads them (the interval's one host sync), or
with the replicas' stop vote (``agreement.py``), and ``report`` raises or warns on what they
say. ``nonfinite_step`` reads it before a checkpoint is written (which syncs anyway), so that no
checkpoint of weights trained on a bad loss replaces a good one.
"""

from __future__ import annotations

import math

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.loop.results import to_floats
from xtrainer.trainer_view import TrainerView


class NonFiniteWatch:
    """The global step of the first non-finite training loss, known on the device without a
    host sync, read with the logged values (``Publisher.publish``).

    Two forms, as the strategy runs ops: ``InGraphWatch`` where they are recorded into the step's
    lazy graph (XLA: three small ops in that graph cost nothing until it runs), ``DeferredWatch``
    where each op runs as it is called (the native strategies: a step's losses are kept and
    checked together when they are read). Both give ``local_first``, this replica's first bad step
    as a ``(1,)`` int64 device tensor (``NEVER``: none), which several replicas reduce with min.
    """

    NEVER = 2**62
    _FIRST = "xtrainer/first_nonfinite_step"

    def __init__(self, device: torch.device, global_step: int) -> None:
        self.device, self.start_step = device, global_step
        self.reported = False

    #: Whether ``stepped`` must be told of every optimizer step.
    counts_steps = True

    def observe(self, loss: torch.Tensor, step: int) -> None:
        """Watch one micro-batch's training loss (detached, 0-dim), of global step ``step``."""
        raise NotImplementedError

    def stepped(self) -> None:
        raise NotImplementedError

    def local_first(self) -> torch.Tensor:
        raise NotImplementedError

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """What one replica's read transfers (decoded by ``first_step``)."""
        return {self._FIRST: self.local_first()}

    def first_step(self, values: dict[str, float]) -> float:
        """The first bad step (``NEVER``: none) from what ``local_tensors`` read (or ``_FIRST``
        reduced over the replicas), taken out of ``values``."""
        return values.pop(self._FIRST)


class InGraphWatch(NonFiniteWatch):
    """Three small ops per step in the step's graph: each loss clears ``ok`` if it is NaN or
    infinite, and each optimizer step adds ``ok`` to ``steps_ok``, which therefore stops counting
    at the step whose loss was first bad. The state is made on the device once and updated in
    place, so the step's graph never changes. One replica reads the two numbers themselves, which
    the step left as device data (no execution of their own)."""

    _OK, _STEPS_OK = "xtrainer/nonfinite_ok", "xtrainer/nonfinite_steps_ok"

    def __init__(self, device: torch.device, global_step: int) -> None:
        super().__init__(device, global_step)
        self.ok = torch.ones((), dtype=torch.bool).to(device)
        self.steps_ok = torch.zeros((), dtype=torch.int64).to(device)
        self.start = torch.tensor([global_step], dtype=torch.int64).to(device)
        self.never = torch.tensor([self.NEVER], dtype=torch.int64).to(device)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        self.ok.logical_and_(torch.isfinite(loss))  # a bool result: nothing for autograd to record

    def stepped(self) -> None:
        self.steps_ok.add_(self.ok)

    def local_first(self) -> torch.Tensor:
        return torch.where(self.ok, self.never, self.start + self.steps_ok)

    def local_tensors(self) -> dict[str, torch.Tensor]:
        return {self._OK: self.ok, self._STEPS_OK: self.steps_ok}

    def first_step(self, values: dict[str, float]) -> float:
        if self._FIRST in values:
            return values.pop(self._FIRST)
        ok, steps_ok = values.pop(self._OK), values.pop(self._STEPS_OK)
        return self.NEVER if ok else self.start_step + steps_ok


class DeferredWatch(NonFiniteWatch):
    """For ops that run as they are called: a step keeps a reference to its (detached, 0-dim)
    loss and notes the global step on the host (no op at all); the losses kept are checked
    together when the watch is read. One replica on a device reads their sum (two ops), finite
    unless one of them is not; only when it is not are they read to the host to name the first
    bad step (as the fit stops or warns then anyway; a sum that overflowed finds none, and all
    were finite). Several replicas reduce ``local_first`` (the first bad step worked out on the
    device). A read happens every ``log_every_n_steps``; past ``FOLD_AFTER`` losses without one
    they are folded into ``first`` (a device tensor, kept by the same ops once it is set) without
    a read, so memory stays bounded.

    On the CPU a loss is host memory: each one is checked as it comes (reading it is no sync)
    and none is kept. Keeping a step's loss, with its small allocations, until the read leaves
    them scattered over the heap between the steps' own, and every step's allocations then cost
    more: 1 to 4 points of a 1 ms step's CPU time as measured, against about a tenth of a point
    for the check. What was found is reported at the read, as on a device."""

    FOLD_AFTER = 1024
    _SUM = "xtrainer/nonfinite_loss_sum"
    counts_steps = False  # each loss comes with its step

    def __init__(self, device: torch.device, global_step: int) -> None:
        super().__init__(device, global_step)
        self.losses: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.first: torch.Tensor | None = None  # made at the first fold
        self.first_bad = self.NEVER  # what the reads (on the CPU, the checks) found so far
        self.on_host = device.type == "cpu"

    def observe(self, loss: torch.Tensor, step: int) -> None:
        if self.on_host:
            if step < self.first_bad and not math.isfinite(loss.item()):  # host memory: no sync
                self.first_bad = step
            return
        self.losses.append(loss)
        self.steps.append(step)
        if len(self.losses) >= self.FOLD_AFTER:
            self.local_first()

    def local_first(self) -> torch.Tensor:
        if self.on_host:
            return torch.tensor([self.first_bad], dtype=torch.int64)
        if self.first is None:
            self.first = torch.tensor([self.NEVER], dtype=torch.int64).to(self.device)
        if self.losses:
            # The steps' numbers go to the device as data, once per read.
            steps = torch.tensor(self.steps, dtype=torch.int64).to(self.device, non_blocking=True)
            bad = torch.where(torch.isfinite(torch.stack(self.losses)), self.NEVER, steps).min().reshape(1)
            self.first = torch.minimum(self.first, bad)
            self.losses, self.steps = [], []
        return self.first

    def local_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {self._FIRST: self.first} if self.first is not None else {}
        if self.losses:
            tensors[self._SUM] = torch.stack(self.losses).sum(dtype=torch.float32)
        return tensors

    def first_step(self, values: dict[str, float]) -> float:
        first = min(self.first_bad, values.pop(self._FIRST, self.NEVER))
        total = values.pop(self._SUM, None)
        if total is not None:  # read over the losses kept
            if not math.isfinite(total):
                losses = torch.stack(self.losses).tolist()  # host sync: only because one was NaN or infinite
                first = min(first, next((step for step, loss in zip(self.steps, losses) if not math.isfinite(loss)),
                                        self.NEVER))  # none: the sum of finite losses overflowed
            self.losses, self.steps = [], []
        self.first_bad = first
        return first


class NonFinite:
    """The fit's non-finite watch and what it does on a bad loss (``detect_nonfinite``:
    ``"raise"``, ``"warn"`` or ``"off"``)."""

    def __init__(self, detect_nonfinite: str) -> None:
        self.detect_nonfinite = detect_nonfinite
        self.watch: NonFiniteWatch | None = None
        self.counts_steps = False  # the watch must be told of each optimizer step
        self._checked_step, self._first_bad = -1, NonFiniteWatch.NEVER

    def start_fit(self, trainer: "TrainerView") -> None:
        watch = InGraphWatch if trainer.strategy.runtime.lazy else DeferredWatch
        self.watch = watch(trainer.strategy.device, trainer.global_step) if self.detect_nonfinite != "off" else None
        self.counts_steps = self.watch is not None and self.watch.counts_steps
        self._checked_step = -1

    def observe(self, loss: torch.Tensor, step: int) -> None:
        """One micro-batch's training loss (detached, 0-dim), of global step ``step``."""
        if self.watch is not None:
            self.watch.observe(loss, step)

    def stepped(self) -> None:
        """An optimizer step, for a watch that ``counts_steps``."""
        if self.counts_steps:
            self.watch.stepped()

    def report(self, trainer: "TrainerView", first: float) -> None:
        """What the watch read says (``first``: the first bad step, ``NEVER``: none): raise, or
        warn once (``detect_nonfinite="warn"``)."""
        if first >= NonFiniteWatch.NEVER or self.watch.reported:
            return
        message = (f"The training loss became NaN or infinite at global step {int(first)} (epoch "
                   f"{trainer.current_epoch} is running, step {trainer.global_step} now)")
        if self.detect_nonfinite == "warn":
            self.watch.reported = True
            rank_zero_warn(message + "; training goes on (detect_nonfinite='warn').")
            return
        raise FloatingPointError(
            message + f"; training stopped. Checkpoints saved before this point are intact under {trainer.log_dir}. "
            "Lower the learning rate, set gradient_clip_val, or check the data; detect_nonfinite='warn' "
            "goes on instead.")

    def nonfinite_step(self, trainer: "TrainerView") -> int | None:
        """The global step whose training loss was first NaN or infinite, if the weights have been
        updated since (None: all good so far, or ``detect_nonfinite="off"``). Reads one number
        from every replica: a host sync, made only before a checkpoint is written (which syncs
        anyway), and once per step at most."""
        if self.watch is None:
            return None
        if self._checked_step != trainer.global_step:
            with trainer.strategy.runtime.rng_state_kept():  # whether a run checks or not, it draws the same numbers
                local = to_floats(self.watch.local_tensors(), trainer.strategy.runtime.to_cpu)  # host sync: before a save only
                first = int(self.watch.first_step(local))
                if trainer.world_size > 1:
                    first = min(trainer.strategy.collectives.all_gather_object(first))
            self._checked_step, self._first_bad = trainer.global_step, first
        return self._first_bad if self._first_bad < trainer.global_step else None
