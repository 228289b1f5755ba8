"""Lightning's collectives on the strategy: what project code calls as ``trainer.strategy.barrier()``,
``.broadcast(obj)``, ``.reduce(tensor)``, ``.all_gather(tensor)``, ``.reduce_boolean_decision(flag)``
and ``.root_device``, with Lightning's signatures and results.

Each is one call of the strategy's ``collectives`` (``strategies.collectives``), which own how the
replicas combine values; this room only speaks Lightning's names. Like every collective, each must
be entered by all replicas, or they hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from xtrainer.strategies.collectives import Collectives

#: Lightning's ``reduce_op`` names (and ``torch.distributed.ReduceOp``'s) as the collectives' ops.
_OPS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}


class LightningCollectives:
    """Lightning's ``Strategy`` collectives, for a class with ``collectives`` and ``device``."""

    collectives: "Collectives"
    device: torch.device

    @property
    def root_device(self) -> torch.device:
        """Lightning's name for the device this replica computes on (``device``)."""
        return self.device

    def barrier(self, name: str | None = None) -> None:
        """Wait on the host until every replica has arrived (a host sync)."""
        self.collectives.barrier(name or "barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Replica ``src``'s ``obj`` (any picklable object) on every replica (a host rendezvous)."""
        if src == 0:
            return self.collectives.broadcast(obj)
        return self.collectives.all_gather_object(obj)[src]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``tensor`` combined over the replicas (``"mean"``, Lightning's default, ``"sum"``,
        ``"max"``, ``"min"``, or a ``ReduceOp`` of these); anything but a tensor as it is, as in
        Lightning."""
        if group is not None:
            raise ValueError("strategy.reduce(group=...) is not supported: it reduces over every replica.")
        name = getattr(reduce_op, "name", reduce_op)
        op = _OPS.get(str(name).lower())
        if op is None:
            raise ValueError(f"strategy.reduce(reduce_op={reduce_op!r}): use 'mean', 'sum', 'max' or 'min'.")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if op != "mean":
            return self.collectives.reduce(tensor, op)
        world = self.collectives.world_size
        summed = self.collectives.reduce(tensor if tensor.is_floating_point() else tensor.float(), "sum")
        return summed / world if world > 1 else summed

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every replica's tensors in ``tensor`` (a tensor or a collection), stacked on a new first
        dimension; one replica: as they are, as in Lightning's single-device strategies."""
        if group is not None:
            raise ValueError("strategy.all_gather(group=...) is not supported: it gathers over every replica.")
        if self.collectives.world_size == 1:
            return tensor
        return self.collectives.all_gather_tensors(tensor, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Whether every replica (``all=True``) or any replica decided ``decision``. Syncs the host:
        the answer is a Python bool on every replica."""
        # a float: the all-reduce every runtime has (XLA's among them); exact for such counts
        votes = torch.tensor([float(bool(decision))]).to(self.device)
        count = round(self.collectives.reduce(votes, "sum").item())  # host sync: the decision is the host's
        return count == self.collectives.world_size if all else count > 0
