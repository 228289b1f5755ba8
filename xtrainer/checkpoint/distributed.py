"""``Distributed``: SPMD checkpoints through ``torch.distributed.checkpoint`` (``xla_spmd``,
``xla_fsdpv2``).

``NAME.ckpt/trainer.pt`` holds everything but the module and optimizer state; ``state/`` holds
those as ``torch.distributed.checkpoint`` writes them with torch_xla's SPMD planners (each process
writes the shards it holds, straight from the devices; ``.metadata`` maps the shards into the
whole tensors, so the folder loads on any mesh and consolidates without the mesh that wrote it);
``manifest.json`` (written last) lists every file with its size, SHA-256 and the process that
wrote it. Reading goes through ``safe``: the metadata pickle with a restricted unpickler, every
value weights-only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterator

import torch

from xtrainer.checkpoint import fs, safe, storage
from xtrainer.checkpoint.format import (OPTIMIZER_STATES, STATE_DICT, CheckpointError, UnreadableCheckpointError,
                                       check_savable)
from xtrainer.checkpoint.layout import (DISTRIBUTED, FILE, Layout, Replicas, entry, read_file, save_folder,
                                       trainer_state)

#: The ``torch.distributed.checkpoint`` folder inside an SPMD checkpoint folder.
STATE_DIR = "state"

#: UserWarnings torch.distributed.checkpoint gives on every SPMD save or load that xtrainer's own
#: calls cause and nobody can act on: ``no_dist=True`` is asked for on purpose (one host, no
#: process group); torch_xla 2.9's SPMD save planner predates ``set_up_planner(storage_meta=)``;
#: torch's own file writer calls the deprecated ``tensor.storage()``.
_DCP_NOISE = ("torch.distributed is disabled, unavailable or uninitialized",
              "The function definition for SavePlanner.set_up_planner has been updated",
              "TypedStorage is deprecated")


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Around a torch.distributed.checkpoint call: hide ``_DCP_NOISE``, nothing else."""
    with warnings.catch_warnings():
        for message in _DCP_NOISE:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


@dataclasses.dataclass(frozen=True)
class DistributedPart:
    """Stands in a loaded checkpoint dict for module or optimizer state that stays on disk until
    it is read into the live, sharded module or optimizer (``load_into``); so
    ``on_load_checkpoint`` hooks see these, not tensors. ``key`` is its place in the distributed
    checkpoint: ``"state_dict"`` or ``"optimizer_states.I"``; ``entries`` the values saved there."""

    path: str
    key: str
    entries: tuple[DistributedEntry, ...]


@dataclasses.dataclass(frozen=True)
class DistributedEntry:
    """One saved value of a distributed checkpoint: where it sits below its part (``("0.weight",)``,
    ``("state", "0", "exp_avg")``: dict keys are saved as strings), and its shape and dtype if it
    is a tensor (None otherwise)."""

    where: tuple
    shape: tuple | None
    dtype: torch.dtype | None


class Distributed(Layout):
    """Each process writes and reads only its own shards; any mesh resumes. Also reads a whole
    file (its tensors copied into the sharded ones). ``spmd``: tensors sharded over torch_xla's
    SPMD mesh (its planners); else ``torch.distributed`` tensors (DTensors of the native FSDP
    strategy) with torch's own planners."""

    kind = DISTRIBUTED
    reads = {DISTRIBUTED: "any", FILE: "any"}

    def __init__(self, spmd: bool = True) -> None:
        self.spmd = spmd

    def save(self, replicas: Replicas, checkpoint: dict[str, Any], path: str) -> None:
        checkpoint = dict(checkpoint)
        state = {STATE_DICT: checkpoint.pop(STATE_DICT), OPTIMIZER_STATES: checkpoint.pop(OPTIMIZER_STATES)}
        check_savable(checkpoint)

        def write_state(folder: str) -> dict[str, Any]:
            return _save_state(state, folder, replicas.global_rank, self.spmd)

        save_folder(replicas, path, DISTRIBUTED, checkpoint, write_state)

    def load(self, replicas: Replicas, path: str) -> dict[str, Any]:
        if fs.isdir(path):
            return read_lazily(path)
        return read_file(path, verify=False)


def _save_state(state: dict[str, Any], folder: str, rank: int, spmd: bool = True) -> dict[str, Any]:
    """Write ``state`` (the module's and optimizers' state, tensors sharded over the SPMD mesh) to
    ``folder/state``: every process writes the shards it holds, straight from the device, and
    nothing is gathered; then hashes the files it wrote (one read of its own shards). With several
    hosts the processes coordinate over the default process group (untested here: no pod)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    target = fs.join(folder, STATE_DIR)
    planner = _planners(spmd)[0]
    try:
        with _quiet_dcp():
            dcp.save(state, storage_writer=_writer(target), planner=planner,
                     no_dist=not dist.is_initialized())
    except (Exception, dcp.api.CheckpointException) as err:  # torch's is a BaseException, not an Exception
        raise storage.write_error(err, target) from err
    # torch.distributed.checkpoint names each process's files __<rank>_<n>.distcp; process 0
    # writes .metadata.
    mine = [name for name in fs.listdir(target)
            if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata")]
    return {f"{STATE_DIR}/{name}": entry(storage.Written(fs.getsize(fs.join(target, name)),
                                                          storage.sha256_of(fs.join(target, name))), rank)
            for name in mine}


def _writer(target: str) -> Any:
    """torch.distributed.checkpoint's writer of ``target``: its local one for a local path (as
    before), its fsspec one for a URL."""
    import torch.distributed.checkpoint as dcp

    if fs.is_url(target):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        fs.require(target)
        return FsspecWriter(target)
    return dcp.FileSystemWriter(target)


def entries(path: str) -> dict[str, list[DistributedEntry]]:
    """A distributed checkpoint's entries by part (``"state_dict"``, ``"optimizer_states.0"``,
    ...), from its metadata (read with the restricted unpickler)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = safe.dcp_reader(fs.join(path, STATE_DIR)).read_metadata()
    parts: dict[str, list[DistributedEntry]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        where = tuple(metadata.planner_data[fqn])
        if where == (OPTIMIZER_STATES,):  # optimizers without tensor state are saved whole, as one value
            parts.setdefault(OPTIMIZER_STATES, []).append(DistributedEntry((), None, None))
            continue
        if len(where) < 2 or (where[0] == OPTIMIZER_STATES and len(where) < 3):
            raise UnreadableCheckpointError(f"The metadata of {path!r} places {fqn!r} at {where!r}, which is not "
                                            "where xtrainer saves anything.")
        part, below = (where[0], where[1:]) if where[0] != OPTIMIZER_STATES else (f"{where[0]}.{where[1]}", where[2:])
        if isinstance(meta, TensorStorageMetadata):
            parts.setdefault(part, []).append(DistributedEntry(tuple(below), tuple(meta.size), meta.properties.dtype))
        else:
            parts.setdefault(part, []).append(DistributedEntry(tuple(below), None, None))
    return parts


def _planners(spmd: bool) -> tuple[Any, Any]:
    """(save planner, load planner): torch_xla's SPMD ones, or torch's defaults."""
    if not spmd:
        from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

        return DefaultSavePlanner(), DefaultLoadPlanner()
    from xtrainer import _xla

    return _xla.spmd_checkpoint_planners()


def load_into(target: dict[str, Any], path: str, spmd: bool = True) -> None:
    """Read a distributed checkpoint into ``target`` in place: ``{"state_dict": ...}`` or
    ``{"optimizer_states": [...]}``, shaped as saved, tensors on the device with the sharding
    they are to have. Each process reads only the pieces of the files its shards need."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = fs.join(path, STATE_DIR)
    reader = safe.dcp_reader(folder)
    reader.read_metadata()  # refused here, with its own message, if it is not plain metadata
    _, planner = _planners(spmd)
    if spmd:
        from xtrainer import _xla

        # The load planner finds each shard's place from the tensors' device data: tensors that are
        # still pending computations (new zeros) have none until they are executed.
        _xla.sync()
        _xla.wait_device_ops()  # host sync: before reading the checkpoint, not in a training step
    try:
        with _quiet_dcp():
            dcp.load(target, storage_reader=reader, planner=safe.safe_load_planner(planner),
                     no_dist=not dist.is_initialized())
    except Exception as err:
        _raise_refusal(err)
        raise UnreadableCheckpointError(f"The distributed checkpoint {path!r} could not be read "
                                        f"({type(err).__name__}: {err}).") from err


def read_optimizer_state(part: DistributedPart, params: list[torch.Tensor],
                         tensor_for: Callable[[torch.Tensor, DistributedEntry], torch.Tensor],
                         spmd: bool = True) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` read from a distributed checkpoint's ``part``
    (``"optimizer_states.I"``), its structure rebuilt from the metadata: each tensor of a
    parameter's state read into ``tensor_for(param, entry)`` (placed and sharded as the strategy
    wants it), every other value as it was saved. ``params``: the optimizer's parameters, in
    ``param_groups`` order (the saved state names them by index).

    The two planners save ``param_groups`` differently: torch_xla's SPMD one keeps a list or dict
    without tensors whole (one value at ``("param_groups",)``), torch's own goes into every list
    that holds a dict (``("param_groups", 0, "lr")``: list items by int index). Every key of the
    structure read into is a string (the planner finds its place by the path it flattens the
    structure to, which names every key as a string, and would add a second, string key beside an
    int one); the dicts that stand for lists become lists again after the read."""
    target: dict[Any, Any] = {"state": {}}  # an optimizer that has not stepped saves no state
    lists: set[tuple[str, ...]] = set()  # the places of dicts that stand for saved lists
    for entry in part.entries:
        where = tuple(str(key) for key in entry.where)
        lists.update(where[:i] for i, key in enumerate(entry.where) if isinstance(key, int))
        value = None  # read as it was saved
        if where[0] == "state" and len(where) == 3:  # ("state", parameter index, name)
            index = int(where[1])
            if index >= len(params):
                raise CheckpointError(
                    f"{part.path!r} holds optimizer state for parameter {index}, but the optimizer has "
                    f"{len(params)} parameters: is it a checkpoint of another model or optimizer?")
            value = tensor_for(params[index], entry) if entry.shape is not None else None
        _place(target, where, value)
    load_into({OPTIMIZER_STATES: {part.key.split(".")[1]: target}}, part.path, spmd=spmd)
    for where in sorted(lists, key=len, reverse=True):  # the innermost first: their parents are dicts still
        parent = target
        for key in where[:-1]:
            parent = parent[key]
        items = parent[where[-1]]
        parent[where[-1]] = [items[key] for key in sorted(items, key=int)]
    # Saving names every entry by a path of strings: the optimizer's parameter ids are ints.
    return {**target, "state": {int(index): value for index, value in target["state"].items()}}


def _place(target: dict, where: tuple, value: Any) -> None:
    """``target[where[0]][where[1]]... = value``, making the dicts on the way."""
    for key in where[:-1]:
        target = target.setdefault(key, {})
    target[where[-1]] = value


def read_state(path: str, only: str | None = None) -> dict[str, Any]:
    """A distributed checkpoint's module and optimizer state, whole, on the host (every shard is
    read): ``{"state_dict": ..., "optimizer_states": [...]}`` as a single-file checkpoint holds
    them. ``only`` reads one of the two."""
    # *Private API* of torch (what torch's public dcp_to_torch_save uses): reads every entry of a
    # checkpoint into an empty dict, without a process group.
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = safe.dcp_reader(fs.join(path, STATE_DIR))
    reader.read_metadata()  # refused here, with its own message, if it is not plain metadata
    planner = safe.safe_load_planner(_EmptyStateDictLoadPlanner(keys=None if only is None else [only]))
    try:
        with _quiet_dcp():
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except Exception as err:
        _raise_refusal(err)
        raise UnreadableCheckpointError(f"The distributed checkpoint {path!r} could not be read "
                                        f"({type(err).__name__}: {err}).") from err
    for optimizer_state in state.get(OPTIMIZER_STATES, []):
        # Saving names every entry by a path of strings: the optimizer's parameter ids are ints.
        optimizer_state["state"] = {int(k): v for k, v in optimizer_state.get("state", {}).items()}
    return state


def _raise_refusal(err: BaseException) -> None:
    """Raise the refusal of an unsafe value that ``torch.distributed.checkpoint`` wrapped (it
    collects each rank's failure into a ``CheckpointException``)."""
    for cause in (err, *storage.failures_in(err)):
        if isinstance(cause, safe.UnsafeCheckpointError):
            raise cause from None


def read_whole(path: str, verify: bool = True) -> dict[str, Any]:
    """The whole checkpoint of a distributed folder, its shards assembled on the host."""
    if verify:
        storage.verify_folder(path)
    return {**trainer_state(path), **read_state(path)}


def read_lazily(path: str) -> dict[str, Any]:
    """A distributed checkpoint's trainer state, with ``DistributedPart`` in place of the module
    and optimizer state, which ``load_into`` reads into the live, sharded objects."""
    state = trainer_state(path)
    parts = entries(path)
    if OPTIMIZER_STATES in parts:  # saved whole (no tensors in them): small, read now
        optimizer_states = read_state(path, only=OPTIMIZER_STATES)[OPTIMIZER_STATES]
        return {**state, STATE_DICT: DistributedPart(path, STATE_DICT, tuple(parts.get(STATE_DICT, ()))),
                OPTIMIZER_STATES: optimizer_states}
    optimizers = sorted(int(part.split(".")[1]) for part in parts if part.startswith(f"{OPTIMIZER_STATES}."))
    keys = [STATE_DICT] + [f"{OPTIMIZER_STATES}.{i}" for i in optimizers]
    lazy = {key: DistributedPart(path, key, tuple(parts.get(key, ()))) for key in keys}
    return {**state, STATE_DICT: lazy[STATE_DICT], OPTIMIZER_STATES: [lazy[key] for key in keys[1:]]}


def consolidate(path: str) -> dict[str, Any]:
    return read_state(path, only=STATE_DICT)[STATE_DICT]
