"""torchmetrics ``Metric`` objects of a module, synced across replicas in the graph when the
user calls ``compute()`` (or ``sync()``) explicitly, as in ``on_validation_epoch_end``.

torchmetrics syncs a metric's states through ``torch.distributed`` when a process group exists:
under ``xla_ddp`` that is the XLA process group, whose gather reads sizes back to the host
between collectives (several graph cuts per ``compute()``); under ``xla_native`` and ``xla_fsdp``
there is no group, so an explicit ``compute()`` silently gave this replica's value only. For the
length of a run, every metric of the module syncs through the strategy's all-gather instead (the
one xtrainer uses for metrics logged by object): one collective per state, recorded in the
graph, on every replica alike. States must have the same shape on every replica (the sum/mean
states of most metrics; list states of equal length)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn


def _is_metric(module: nn.Module) -> bool:
    return all(callable(getattr(module, name, None)) for name in ("update", "compute", "reset", "sync")) \
        and hasattr(module, "dist_sync_fn")


@contextlib.contextmanager
def synced_through(module: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor], world_size: int
                   ) -> Iterator[None]:
    """While the block runs, the module's metrics sync with ``gather`` (stacks every replica's
    tensor on a new first dimension) when there are several replicas."""
    metrics = [m for m in module.modules() if _is_metric(m)] if world_size > 1 else []
    saved: list[tuple[Any, Any, Any]] = []
    for metric in metrics:
        saved.append((metric, metric.dist_sync_fn, metric.distributed_available_fn))
        metric.dist_sync_fn = lambda tensor, group=None: list(gather(tensor).unbind(0))
        metric.distributed_available_fn = lambda: True
    try:
        yield
    finally:
        for metric, sync_fn, available_fn in saved:
            metric.dist_sync_fn, metric.distributed_available_fn = sync_fn, available_fn
