"""``XlaNative``: one XLA device, or torch_xla's native data parallel across replicas."""

from __future__ import annotations

from typing import Callable

import torch

from xtrainer._lazy_xla import xla as _xla
from xtrainer.strategies.parallel import ParallelStrategy


class XlaNative(ParallelStrategy):
    """The module is not wrapped; ``xm.optimizer_step`` all-reduces the gradients and steps.

    With ``Trainer(devices=N)``, N > 1, the replicas are started by ``torch_xla.launch`` (one
    process per device on TPU) and each trains on its share of every batch. When gradients must
    be clipped (or a hook inspects them) between the reduction and the step, the two halves of
    ``xm.optimizer_step`` (``xm.reduce_gradients``, then ``optimizer.step()``) run with the
    clipping in between, so clipping always sees the reduced gradients.
    """

    name = "xla_native"

    def _reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        _xla.reduce_gradients(optimizer)  # a no-op with one replica

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        if before_step is None:
            _xla.optimizer_step(optimizer)
        else:
            super().optimizer_step(optimizer, before_step)
