"""``xm.all_reduce``, ``xm.all_gather`` and ``xm.reduce_scatter`` for thread replicas: lowered with
channel ids, so that the halves of a collective meet across replicas that compiled the same graph
separately (cause 1 in the package's docstring). One channel per kind, on 1-D views: XLA gives
every collective of a channel one layout. ``replicas.py`` installs them before any FSDP module
binds ``xm.all_gather``.
"""

from __future__ import annotations

from typing import Any

import torch

from xtrainer._lazy_xla import xla as _xla

_ALL_GATHER_CHANNEL, _REDUCE_SCATTER_CHANNEL = 2, 3  # all-reduce uses channel 1


def _groups(groups: Any) -> list[list[int]]:
    return groups or [list(range(_xla.world_size()))]


def all_reduce(reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None,
               pin_layout: bool = True) -> Any:
    groups = _groups(groups)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return _xla.all_reduce_on_channel(reduce_type, t.reshape(-1), scale, groups).reshape(t.shape)

    if isinstance(inputs, torch.Tensor):
        return reduce(inputs)
    with torch.no_grad():
        for t in inputs:
            t.copy_(reduce(t))
    return inputs


def all_gather(value: Any, dim: int = 0, groups: Any = None, output: Any = None,
               pin_layout: bool = True, channel_id: Any = None, use_global_device_ids: Any = None) -> Any:
    groups = _groups(groups)
    if isinstance(value, (list, tuple)):
        return _into(output, [all_gather(v, dim, groups) for v in value])
    dim = dim % value.dim() if value.dim() else 0
    count = len(groups[0])
    moved = value.reshape(1) if value.dim() == 0 else value.movedim(dim, 0).contiguous()
    gathered = _xla.all_gather_on_channel(moved.reshape(-1), count, groups, _ALL_GATHER_CHANNEL)
    gathered = gathered.reshape((count * moved.shape[0],) + tuple(moved.shape[1:])).movedim(0, dim)
    return _into(output, gathered)


def reduce_scatter(reduce_type: str, input: Any, scale: float, scatter_dim: int,
                   shard_count: int, groups: Any = None, output: Any = None, pin_layout: bool = True,
                   channel_id: Any = None, use_global_device_ids: Any = None) -> Any:
    groups = _groups(groups)
    if isinstance(input, (list, tuple)):
        return _into(output, [reduce_scatter(reduce_type, t, scale, scatter_dim, shard_count, groups)
                              for t in input])
    # Scattering dim d is scattering contiguous chunks of the tensor with d moved to the front.
    moved = input.movedim(scatter_dim, 0).contiguous()
    flat = _xla.reduce_scatter_on_channel(reduce_type, moved.reshape(-1), scale, shard_count, groups,
                                          _REDUCE_SCATTER_CHANNEL)
    shard = flat.reshape((moved.shape[0] // shard_count,) + tuple(moved.shape[1:])).movedim(0, scatter_dim)
    return _into(output, shard)


def _into(output: Any, result: Any) -> Any:
    """Collectives' ``output=`` argument: copy the result into it and return it."""
    if output is None:
        return result
    with torch.no_grad():
        if isinstance(output, (list, tuple)):
            for o, r in zip(output, result):
                o.copy_(r)
        else:
            output.copy_(result)
    return output
