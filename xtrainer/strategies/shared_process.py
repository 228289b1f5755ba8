"""What the replicas of one process share, asked without knowing which runtime runs them.

Most runtimes run one replica per process (``torch_xla.launch`` on a TPU host, torchrun, the SPMD
process, a single device in the caller): the defaults here. A runtime that runs several replicas
as threads of one process (the CPU runtime's, ``strategies/launchers/cpu_threads/``) installs its own
``SharedProcess`` in that process when it starts, before any replica exists. Strategies, the
launcher's replica job, the compilation cache and callbacks ask ``current()`` (or the strategy's
``replicas_in_this_process()``), and never import or name that runtime.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class SharedProcess:
    """The process as its replicas see it. These defaults hold for one replica per process."""

    def replicas(self) -> int:
        """How many replicas this process runs (torch_xla's counters, caches and torch's CPU random
        generator are the process's, shared by all of them)."""
        return 1

    def construction_lock(self) -> contextlib.AbstractContextManager:
        """Held while a replica builds its modules from torch's CPU random generator, which is
        process-wide: replicas of one process take turns."""
        return contextlib.nullcontext()

    def computing_alone(self) -> contextlib.AbstractContextManager:
        """Held while a replica runs device work that torch's C++ may run and read outside the
        graph cut (a boolean-mask index, ``nonzero``: a torchmetrics ``compute()``). Nothing
        collective may be pending or run inside it."""
        return contextlib.nullcontext()

    def wrap_ddp(self, module: nn.Module, kwargs: dict[str, Any]) -> DistributedDataParallel:
        """``DistributedDataParallel(module, **kwargs)``, started (shapes checked, rank 0's values
        given to every replica) as this process's replicas can do it."""
        return DistributedDataParallel(module, **kwargs)


_current: SharedProcess = SharedProcess()


def current() -> SharedProcess:
    """This process's ``SharedProcess``: the defaults unless a runtime installed its own."""
    return _current


def install(process: SharedProcess) -> None:
    """Make ``process`` this process's ``SharedProcess`` (a runtime does it once, at its start,
    before any replica exists)."""
    global _current
    _current = process
