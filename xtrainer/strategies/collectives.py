"""How the replicas of a run combine values and agree: one object per backend.

A strategy exposes one as ``strategy.collectives``: ``Collectives`` until ``setup_environment()``
(this process counts as the only replica), then ``XlaReplicas`` (MPMD replicas, over XLA's
collectives and rendezvous) or ``SpmdHosts`` (one SPMD process per host, agreeing over a CPU
process group). Each also says who this replica is (``world_size``, ``global_rank``...), which
makes it the ``Replicas`` a checkpoint layout saves and loads with (``xtrainer.checkpoint.layout``).

Every member is a collective: all replicas must enter it, or they hang.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from xtrainer._lazy_xla import xla as _xla


class Collectives:
    """This process alone, before ``setup_environment()``: values pass through unchanged. Also
    the interface of the other backends."""

    @property
    def world_size(self) -> int:
        """How many replicas the run has."""
        return 1

    @property
    def global_rank(self) -> int:
        """This replica's index among all of them."""
        return 0

    @property
    def local_rank(self) -> int:
        """This replica's index on its host."""
        return 0

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0."""
        return self.global_rank == 0

    @property
    def node_rank(self) -> int:
        """This replica's host among all of them."""
        return 0

    def to_cpu(self, data: Any) -> Any:
        """Every device tensor in ``data`` (nested) on the host, in one batched transfer. Syncs
        the host (callers say so)."""
        return _xla.to_cpu(data)

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce recorded in the graph (``sum``, ``max``, ``min``); identity for one replica."""
        del op
        return tensor

    def any_replica(self, vote: int) -> torch.Tensor | int:
        """The largest replica's ``vote`` (a small number, 0 or more: the stop vote of
        ``loop/agreement.py``, which carries a signal's number): a device value recorded in the
        graph (read with the values it rides along with), or an int where the replicas agree on
        the host."""
        raise RuntimeError("The strategy has no device before setup_environment().")

    def agree(self, vote: int, first: torch.Tensor | None) -> tuple[torch.Tensor | int, torch.Tensor | None]:
        """``any_replica(vote)``, and the minimum of ``first`` (a ``(1,)`` int64 tensor, or None)
        over the replicas: what a logging step's read agrees on (where each collective runs as it
        is called, one reduction for both)."""
        return self.any_replica(vote), None if first is None else self.reduce(first, "min")

    #: Where agreements cost a collective of their own (``agree_later``): the least time, in
    #: seconds, between two that logging steps start (0: at every logging step).
    agreement_seconds = 0.0

    def agree_later(self, vote: int, first: torch.Tensor | None, next_step: int
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None:
        """``agree`` started now and finished by calling what this returns, for collectives that
        run as they are called: the host does not wait for the other replicas where it starts.
        The replicas also agree on the global step from which a logging step starts the next
        agreement: the least ``next_step`` any of them proposes, the third tensor returned.
        None where collectives are recorded in the graph (``agree`` rides along with the read)."""
        del vote, first, next_step
        return None

    def all_gather_tensors(self, data: Any, sync_grads: bool = False) -> Any:
        """Every replica's tensors in ``data``, stacked on a new first dimension, in the graph;
        ``sync_grads``: differentiable, each replica's gradient flowing back to its own part."""
        del sync_grads  # one replica: its own tensor, gradient and all
        return apply_to_collection(data, torch.Tensor, lambda tensor: tensor.unsqueeze(0))

    def barrier(self, name: str = "barrier") -> None:
        """Wait on the host until every replica has arrived."""
        del name

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every replica's ``obj``, in rank order (a host rendezvous)."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every replica (a host rendezvous)."""
        return obj


class XlaReplicas(Collectives):
    """MPMD replicas (``xla_native``, ``xla_ddp``, ``xla_fsdp``): XLA collectives recorded in the
    graph, and torch_xla's host rendezvous."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def world_size(self) -> int:
        return _xla.world_size()

    @property
    def global_rank(self) -> int:
        return _xla.global_rank()

    @property
    def local_rank(self) -> int:
        return _xla.local_rank()

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        if tensor.device.type == "cpu":  # a number logged with sync_dist: to the device first (a copy, no sync)
            tensor = tensor.to(self.device)
        return _xla.all_reduce(tensor, op)

    def any_replica(self, vote: int) -> torch.Tensor | int:
        # a float: XLA's all-reduce of floats is the one every runtime has; exact for such numbers
        return self.reduce(torch.tensor([float(vote)]).to(self.device), "max")

    def all_gather_tensors(self, data: Any, sync_grads: bool = False) -> Any:
        if sync_grads and self.world_size > 1:
            raise ValueError("self.all_gather(sync_grads=True) is not supported on XLA's replicas; gather outside "
                             "autograd, or use a native strategy (native_ddp), where the gradient flows back.")

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            stacked = tensor.unsqueeze(0)
            return stacked if self.world_size == 1 else _xla.all_gather(stacked, dim=0)

        return apply_to_collection(data, torch.Tensor, gather)

    def barrier(self, name: str = "barrier") -> None:
        if self.world_size > 1:
            _xla.rendezvous(name)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        return _xla.all_gather_object(obj)

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        return _xla.broadcast_object(obj)


class HostObjects:
    """Host rendezvous over ``torch.distributed``'s default process group (none with one
    process), for collectives whose replicas are processes: ``SpmdHosts`` and the native
    strategies' ``ProcessGroup``. Put it before the ``Collectives`` base it overrides."""

    world_size: int

    def barrier(self, name: str = "barrier") -> None:
        del name
        if self.world_size > 1:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class SpmdHosts(HostObjects, XlaReplicas):
    """One SPMD program, one process per host (``xla_spmd``, ``xla_fsdpv2``): the replicas are the
    hosts. Host-side agreement goes over the CPU process group: torch_xla's rendezvous is a
    collective of the MPMD replicas, which an SPMD program does not have (untested: no pod)."""

    @property
    def world_size(self) -> int:
        return _xla.process_count()

    @property
    def global_rank(self) -> int:
        return _xla.process_index()

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return self.global_rank  # one process per host

    def any_replica(self, vote: int) -> torch.Tensor | int:
        """On the host, over the CPU process group: a host's own vote is not a global value of the
        program, so it cannot ride in the graph (untested here: no pod)."""
        if self.world_size == 1:
            return vote
        votes = torch.tensor([vote])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return int(votes.item())  # a CPU tensor: no device sync

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The step's values are computed over the whole mesh already: nothing to combine."""
        if self.world_size > 1 and op == "sum":
            # Every host holds the same global value; sync_dist's mean divides by the world size.
            return tensor * self.world_size
        return tensor
