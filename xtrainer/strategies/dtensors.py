"""DTensors (the sharded tensors of FSDP2, ``torch.distributed.tensor``) as the native strategies
handle plain tensors and shards alike: a tensor's local part, its whole, a whole value sharded as a
live one is, and the norm of a gradient whose parts are sharded over the processes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds (a DTensor's local shard; else itself)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def squares(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s squared elements, in at least float32."""
    flat = tensor.reshape(-1).to(torch.promote_types(tensor.dtype, torch.float32))
    return torch.dot(flat, flat)


def gradient_norm(grads: list[torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the whole gradient, on the device: ``grads`` as the parameters hold them,
    ``shards`` their local parts. A sharded gradient's squares are summed over its shards (one
    all-reduce for all of those sharded over one process group: ``fully_shard``'s, or a tensor-
    parallel layer's); a replicated one's (a whole tensor, or a DTensor with a ``Replicate``
    placement) count once."""
    sharded: dict[Any, list[torch.Tensor]] = {}  # by the group their shards are split over
    whole = []
    for grad, shard in zip(grads, shards):
        if not is_dtensor(grad):
            whole.append(squares(grad))
        elif grad.device_mesh.ndim == 1 and grad.placements[0].is_shard():  # over one mesh dimension
            sharded.setdefault(grad.device_mesh.get_group(), []).append(squares(shard))
        else:  # over several mesh dimensions, or replicated: gathered whole (every process calls this)
            whole.append(squares(grad.full_tensor()))
    dtype = torch.promote_types(torch.float32, shards[0].dtype)
    for part in [p for parts in sharded.values() for p in parts] + whole:
        dtype = torch.promote_types(dtype, part.dtype)
    total = torch.zeros((), dtype=dtype, device=shards[0].device)
    for i, (group, parts) in enumerate(sharded.items()):  # in the order of the parameters: alike on every process
        part = torch.stack([p.to(dtype) for p in parts]).sum()
        dist.all_reduce(part, group=group)  # a collective on the device, no host sync
        total = part if i == 0 else total + part
    if whole:
        total = total + torch.stack([part.to(dtype) for part in whole]).sum()
    return total.sqrt()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor`` (a DTensor gathered: a collective of every process; else itself)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def shard_like(live: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A whole ``value`` as ``live`` holds it: sharded over the same mesh if ``live`` is."""
    if not is_dtensor(live) or is_dtensor(value) or value.shape != live.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(device=live.device_mesh.device_type, dtype=live.dtype), live.device_mesh,
                             live.placements)
