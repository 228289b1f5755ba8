"""``ParallelStrategy``: Lightning's base of the strategies that run replicas in parallel.

A Lightning project asks ``isinstance(trainer.strategy, ParallelStrategy)`` and then divides its
batch size by ``trainer.strategy.num_processes`` (Lightning's ImageNet template does, in
``setup``), since each process loads its own share. Every multi-replica strategy here derives from
it: ``xla_native``, ``xla_ddp``, ``xla_fsdp``, ``native_ddp``, ``native_fsdp``, ``native_ft`` (its replica
groups), and the SPMD ones,
whose one process per host loads the host's whole batch (``num_processes`` is 1). ``native`` (one
device, as Lightning's ``SingleDeviceStrategy``) does not.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from xtrainer.strategies.base import Strategy
from xtrainer.suggest import did_you_mean


class ParallelStrategy(Strategy):
    """A strategy that runs several replicas, each process loading its own share of the data."""

    @property
    def num_processes(self) -> int:
        """The processes this host runs (Lightning's ``len(parallel_devices)``): one per device
        given (``devices``), or per local device where every one is used."""
        return self.devices or self.runtime.local_device_count() or 1

    @property
    def parallel_devices(self) -> list[torch.device]:
        """The devices of this host's processes, one per process, by local rank (the CPU's
        without an index, as Lightning lists them)."""
        kind = self.runtime.type
        return [torch.device(kind) if kind == "cpu" else torch.device(kind, i) for i in range(self.num_processes)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """What a ``DistributedSampler`` of this replica's share takes: ``num_replicas``, ``rank``."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}


def check_wrapper_kwargs(cls: type, kwargs: dict[str, Any], ours: type, theirs: str) -> None:
    """Refuse keyword arguments that the strategy ``ours`` passes on to the wrapper ``cls`` but
    ``cls`` does not take: now, not later when a replica builds the wrapper."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [*inspect.signature(ours.__init__).parameters, *params]
    known = [name for name in known if name not in ("self", "kwargs") and not name.endswith("_kwargs")]
    for key in kwargs:
        if key not in params:
            raise ValueError(f"{ours.__name__}({key}=...): neither {ours.__name__} nor {theirs} takes an argument "
                             f"{key!r}.{did_you_mean(key, known)}")
