"""``FsdpShards``: a folder per checkpoint, one shard file per rank (``xla_fsdp``).

``NAME.ckpt/trainer.pt`` holds everything but the module and optimizer state;
``rank-RRRRR-of-WWWWW.pt`` holds rank R's parameter and optimizer shards with torch_xla's shard
metadata, its rank and the world size; ``manifest.json`` (written last) lists every file with
its size, SHA-256 and rank.
"""

from __future__ import annotations

from typing import Any

from xtrainer.checkpoint import fs, safe, storage
from xtrainer.checkpoint.format import (DISPATCHER_PREFIX, OPTIMIZER_STATES, STATE_DICT, CheckpointError,
                                        UnreadableCheckpointError, check_savable)
from xtrainer.checkpoint.layout import FSDP, Layout, Replicas, entry, save_folder, trainer_state


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


class FsdpShards(Layout):
    """Every rank writes its own shard; resuming needs the world size that wrote them."""

    kind = FSDP
    reads = {FSDP: "same"}

    def __init__(self, shard_metadata: Any) -> None:
        self._shard_metadata = shard_metadata  # a callable: torch_xla's metadata of this rank's shards

    def save(self, replicas: Replicas, checkpoint: dict[str, Any], path: str) -> None:
        from xtrainer import _xla

        checkpoint = dict(checkpoint)
        shard = {STATE_DICT: checkpoint.pop(STATE_DICT), OPTIMIZER_STATES: checkpoint.pop(OPTIMIZER_STATES),
                 "shard_metadata": self._shard_metadata(), "rank": replicas.global_rank,
                 "world_size": replicas.world_size}
        check_savable(shard, "the FSDP shard")
        check_savable(checkpoint)
        shard = _xla.to_cpu(shard)  # host sync: the shards are written from the host
        name = shard_file_name(replicas.global_rank, replicas.world_size)

        def write_shard(folder: str) -> dict[str, Any]:
            return {name: entry(storage.write_file(shard, fs.join(folder, name)), replicas.global_rank)}

        save_folder(replicas, path, FSDP, checkpoint, write_shard)

    def load(self, replicas: Replicas, path: str) -> dict[str, Any]:
        return read_shard(path, replicas.global_rank, replicas.world_size)


def read_shard(path: str, rank: int, world_size: int) -> dict[str, Any]:
    """The trainer state of an FSDP folder merged with ``rank``'s shard."""
    state = trainer_state(path)
    saved = state.get("world_size")
    if saved != world_size:
        raise CheckpointError(
            f"{path!r} was written by {saved} replicas, but this run has {world_size}. A sharded checkpoint "
            f"resumes at the world size that wrote it only. Run with {saved} replicas, or consolidate it into "
            f"one state dict (xtrainer consolidate {path} -o full.pt) and load that into your module before fit().")
    shard = _read_shard_file(path, rank, world_size)
    return {**state, STATE_DICT: shard[STATE_DICT], OPTIMIZER_STATES: shard[OPTIMIZER_STATES]}


def _read_shard_file(path: str, rank: int, world_size: int) -> dict[str, Any]:
    name = shard_file_name(rank, world_size)
    file = fs.join(path, name)
    if not fs.exists(file):
        raise UnreadableCheckpointError(f"{file!r} is missing: all {world_size} shards are needed.")
    shard = safe.load(file, f"shard of rank {rank}")
    if not isinstance(shard, dict) or shard.get("rank") != rank or shard.get("world_size") != world_size:
        raise UnreadableCheckpointError(
            f"{file!r} holds the shard of rank {shard.get('rank') if isinstance(shard, dict) else '?'} of "
            f"{shard.get('world_size') if isinstance(shard, dict) else '?'}, not of rank {rank} of {world_size}: "
            "shard files were renamed or mixed up. Resume from an earlier checkpoint instead.")
    return shard


def consolidate(path: str) -> dict[str, Any]:
    """One plain state dict, keyed as the user's module names it, from an FSDP folder."""
    world_size = trainer_state(path).get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UnreadableCheckpointError(f"{path!r} has a malformed trainer state (world_size={world_size!r}).")
    shards = [_read_shard_file(path, rank, world_size) for rank in range(world_size)]
    try:
        return consolidate_state_dicts([shard[STATE_DICT] for shard in shards], shards[0]["shard_metadata"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        raise UnreadableCheckpointError(f"The shards of {path!r} do not consolidate ({type(err).__name__}: {err}); "
                                        "they were not written by xla_fsdp as they are.") from err


def consolidate_state_dicts(state_dicts: list[dict[str, Any]], shard_metadata: dict[str, Any]) -> dict[str, Any]:
    """One plain state dict, keyed as the user's module names it, from every rank's FSDP shard
    state dict (in rank order) and the shard metadata of any rank."""
    from xtrainer import _xla

    full = _xla.consolidate_shards(state_dicts, shard_metadata)
    return {name.removeprefix(DISPATCHER_PREFIX): tensor for name, tensor in full.items()}
