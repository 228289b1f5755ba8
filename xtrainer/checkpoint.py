"""The one place that reads and writes checkpoint files.

A checkpoint is a plain dict, saved with ``torch.save``:

=====================  ==========================================================================
key                    what it holds
=====================  ==========================================================================
``format``             ``"xtrainer"``; ``format_version`` its layout version (now 1)
``xtrainer_version``   the package version that wrote it
``strategy``           the strategy's name; ``world_size`` how many replicas trained
``state_dict``         the user module's state dict, as ``module.state_dict()`` gives it
``optimizer_states``   one ``optimizer.state_dict()`` per optimizer
``lr_schedulers``      one ``scheduler.state_dict()`` per scheduler
``loops``              ``global_step``, ``epoch``, ``batches_in_epoch``, ``epoch_finished``, ``seed``
``rng_states``         Python, NumPy, torch CPU generators; each replica's XLA generator
``callbacks``          ``{callback.state_key: callback.state_dict()}``
``hyper_parameters``   the module's ``hparams`` (a plain dict)
=====================  ==========================================================================

A sharded checkpoint is a folder instead, whose ``trainer.pt`` holds every key above but the
module and optimizer state. Those are, for ``xla_fsdp``, in each rank's ``rank-RRRRR-of-WWWWW.pt``
(its shard, with the shard metadata); for the SPMD strategies, in ``state/``, written by
``torch.distributed.checkpoint`` with torch_xla's SPMD planners (each process writes the shards
it holds; the metadata maps them into the whole tensors, so the folder loads on any mesh and
consolidates without the mesh that wrote it). Files are written atomically (a temporary file
renamed into place; a sharded folder is staged and renamed when complete), so an interrupted
save never leaves a truncated checkpoint behind. ``last.ckpt`` is a link to the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
import zipfile
from typing import Any

import torch

FORMAT = "xtrainer"
FORMAT_VERSION = 1
TRAINER_FILE = "trainer.pt"
#: The ``torch.distributed.checkpoint`` folder inside an SPMD checkpoint folder.
DISTRIBUTED_DIR = "state"
#: Where the user's module sits inside the Trainer's step dispatcher, which sharded strategies wrap.
DISPATCHER_PREFIX = "module."


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit this run."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file is truncated or corrupt, or a sharded checkpoint lacks shards."""


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def save_file(obj: Any, path: str) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (temporary file, fsync, rename): a crash or a
    full disk during the save leaves the previous file, if any, untouched."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        _raise_if_write_failure(err, path)
        raise


def _raise_if_write_failure(err: BaseException, path: str) -> None:
    """Turn a failed write (a full disk, an unwritable folder) into a ``CheckpointError`` that says
    what to do. A full disk shows as OSError, or as torch's RuntimeError "... file write failed";
    ``torch.distributed.checkpoint`` wraps either in a ``CheckpointException``."""
    causes = list(getattr(err, "failures", {}).values()) or [err]
    for cause in causes:
        if isinstance(cause, OSError) or (isinstance(cause, RuntimeError) and "write" in str(cause)):
            raise CheckpointError(
                f"Could not write {path!r} ({type(cause).__name__}: {cause}). Training stopped; the checkpoints "
                "written before are intact. Free disk space or choose a writable dirpath, then resume with "
                "fit(..., ckpt_path='last').") from err


LAST = "last.ckpt"


def default_dirpath(log_dir: str) -> str:
    """Where a run's checkpoints go unless told otherwise."""
    return os.path.join(log_dir, "checkpoints")


def link_last(dirpath: str, target: str) -> None:
    """Point ``dirpath/last.ckpt`` at ``target`` (a complete checkpoint), atomically: a new link
    under a temporary name renamed over the old one."""
    last = os.path.join(dirpath, LAST)
    tmp = os.path.join(dirpath, f".tmp-last-{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(target), tmp)  # relative: the folder can move
    os.replace(tmp, last)


def remove_checkpoint(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def staging_path(path: str) -> str:
    """Where a sharded checkpoint folder is written before it is renamed to ``path``."""
    return os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))


def publish(staging: str, path: str) -> None:
    """Rename a completely written checkpoint folder into place (replacing an older one)."""
    if os.path.isdir(path):
        old = staging + ".old"
        os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old)
    else:
        os.replace(staging, path)


def last_candidates(dirpaths: list[str]) -> list[str]:
    """Checkpoints in ``dirpaths`` to resume ``ckpt_path="last"`` from, in order of preference:
    ``last.ckpt`` (newest first), then every other checkpoint, newest first. Unfinished saves
    (temporary names) are not among them."""
    candidates = []
    for dirpath in dict.fromkeys(dirpaths):
        if os.path.isdir(dirpath):
            for name in os.listdir(dirpath):
                path = os.path.join(dirpath, name)
                if name.endswith(".ckpt") and not name.startswith(".") and os.path.exists(path):
                    candidates.append(path)
    candidates.sort(key=lambda p: (os.path.basename(p) == LAST, _mtime(p)), reverse=True)
    return list(dict.fromkeys(os.path.realpath(p) for p in candidates))


def _mtime(path: str) -> float:
    target = os.path.join(path, TRAINER_FILE) if is_sharded(path) else path
    return os.path.getmtime(target) if os.path.exists(target) else 0.0


def load_file(path: str, what: str = "checkpoint") -> Any:
    """``torch.load`` a file written by ``save_file``, with errors that say what went wrong."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"The {what} {path!r} does not exist.")
    try:
        # weights_only=False: checkpoints hold optimizer and callback state, not just tensors.
        # Only load checkpoints you trust.
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        raise UnreadableCheckpointError(
            f"The {what} {path!r} could not be read ({type(err).__name__}: {err}). The file is "
            "corrupt or truncated; resume from an earlier checkpoint instead."
        ) from err


def is_sharded(path: str) -> bool:
    return os.path.isdir(path)


def load_checkpoint(path: str, world_size: int | None = None) -> dict[str, Any]:
    """Read a whole checkpoint and check that it is an xtrainer checkpoint. A distributed (SPMD)
    folder is read whole too: its shards are assembled on the host."""
    if is_sharded(path):
        trainer_state = load_file(os.path.join(path, TRAINER_FILE), "checkpoint trainer state")
        check_header(trainer_state, path)
        if is_distributed(path):
            check_distributed(path)
            return {**trainer_state, **read_distributed(path)}
        raise CheckpointError(
            f"{path!r} is a sharded checkpoint written by {trainer_state.get('strategy')!r} with "
            f"world size {trainer_state.get('world_size')}. Resume it with strategy='xla_fsdp' at that "
            f"world size, or consolidate it first: xtrainer consolidate {path} -o full.pt"
        )
    checkpoint = load_file(path)
    check_header(checkpoint, path)
    del world_size  # a full checkpoint loads at any world size
    return checkpoint


def load_sharded_checkpoint(path: str, rank: int, world_size: int) -> dict[str, Any]:
    """The trainer state of a sharded checkpoint folder merged with ``rank``'s shard."""
    if is_distributed(path):
        raise CheckpointError(
            f"{path!r} is a distributed checkpoint of an SPMD strategy; xla_fsdp resumes from its own sharded "
            f"folders only. Resume it with strategy='xla_spmd' or 'xla_fsdpv2' (any number of devices), or "
            f"consolidate it (xtrainer consolidate {path} -o full.pt) and load that into your module before fit().")
    if not is_sharded(path):
        checkpoint = load_file(path)
        check_header(checkpoint, path)
        raise CheckpointError(
            f"{path!r} is a full checkpoint (written by {checkpoint.get('strategy')!r}); xla_fsdp resumes from "
            "its own sharded checkpoint folders only. To start from these weights, load "
            "checkpoint['state_dict'] into your module with load_state_dict() before fit().")
    trainer_state = load_file(os.path.join(path, TRAINER_FILE), "checkpoint trainer state")
    check_header(trainer_state, path)
    saved = trainer_state.get("world_size")
    if saved != world_size:
        raise CheckpointError(
            f"{path!r} was written by {saved} replicas, but this run has {world_size}. A sharded checkpoint "
            f"resumes at the world size that wrote it only. Run with {saved} replicas, or consolidate it into "
            f"one state dict (xtrainer consolidate {path} -o full.pt) and load that into your module before fit().")
    _check_shards(path, world_size)
    shard = load_file(os.path.join(path, shard_file_name(rank, world_size)), f"shard of rank {rank}")
    return {**trainer_state, "state_dict": shard["state_dict"], "optimizer_states": shard["optimizer_states"]}


def consolidate_state_dicts(state_dicts: list[dict[str, Any]], shard_metadata: dict[str, Any]) -> dict[str, Any]:
    """One plain state dict, keyed as the user's module names it, from every rank's FSDP shard
    state dict (in rank order) and the shard metadata of any rank."""
    from xtrainer import _xla

    full = _xla.fsdp_module().consolidate_sharded_state_dicts(state_dicts, shard_metadata)
    return {name.removeprefix(DISPATCHER_PREFIX): tensor for name, tensor in full.items()}


def consolidate(path: str) -> dict[str, Any]:
    """One plain state dict (as the unwrapped module names it) from a sharded checkpoint folder."""
    if not is_sharded(path) or not os.path.exists(os.path.join(path, TRAINER_FILE)):
        raise CheckpointError(f"{path!r} is not a sharded checkpoint folder (one holding {TRAINER_FILE} and "
                              "rank-RRRRR-of-WWWWW.pt files, as xla_fsdp writes them, or a state/ folder, as the "
                              "SPMD strategies write it).")
    trainer_state = load_file(os.path.join(path, TRAINER_FILE), "checkpoint trainer state")
    check_header(trainer_state, path)
    if is_distributed(path):
        check_distributed(path)
        return read_distributed(path, only="state_dict")["state_dict"]
    world_size = trainer_state["world_size"]
    names = _check_shards(path, world_size)
    shards = [load_file(os.path.join(path, name), f"shard {name}") for name in names]
    return consolidate_state_dicts([shard["state_dict"] for shard in shards], shards[0]["shard_metadata"])


def load_weights(module: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """``module.load_state_dict(state_dict)``, refusing a state dict of another model with an
    error that lists the missing and unexpected keys and the shape mismatches."""
    check_fits(module.state_dict(), shapes_of(state_dict))
    module.load_state_dict(state_dict)


def shapes_of(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``{name: shape}`` of a state dict (None for entries that are not tensors)."""
    return {k: v.shape if isinstance(v, torch.Tensor) else None for k, v in state_dict.items()}


def check_fits(own: dict[str, Any], shapes: dict[str, Any]) -> None:
    """Refuse saved module state, given as ``{name: shape or None}``, that does not fit the module
    whose state dict is ``own``, listing the missing and unexpected keys and the shape mismatches."""
    missing = [k for k in own if k not in shapes]
    unexpected = [k for k in shapes if k not in own]
    mismatched = [f"{k} {tuple(shape)} (module: {tuple(own[k].shape)})" for k, shape in shapes.items()
                  if k in own and shape is not None and tuple(shape) != tuple(own[k].shape)]
    problems = [f"{label} ({len(keys)}): {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}"
                for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                    ("shape mismatches", mismatched)) if keys]
    if problems:
        raise CheckpointError("it does not fit this module, so nothing was trained: " + "; ".join(problems)
                              + ". Is it a checkpoint of another model (or of another configure_model())?")


def _check_shards(path: str, world_size: int) -> list[str]:
    names = [shard_file_name(rank, world_size) for rank in range(world_size)]
    missing = [name for name in names if not os.path.exists(os.path.join(path, name))]
    if missing:
        raise UnreadableCheckpointError(f"{path!r} lacks {', '.join(missing)}: all {world_size} shards are needed.")
    return names


def check_header(checkpoint: Any, path: str) -> None:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise CheckpointError(
            f"{path!r} is not an xtrainer checkpoint (no 'format': 'xtrainer' entry). To start from "
            "plain weights, load them into your module with module.load_state_dict() before fit()."
        )
    if checkpoint.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has checkpoint format version {checkpoint['format_version']}, newer than this "
            f"xtrainer reads ({FORMAT_VERSION}). Upgrade xtrainer."
        )


# ---- distributed (SPMD) checkpoints: torch.distributed.checkpoint -------------------------------
@dataclasses.dataclass(frozen=True)
class DistributedPart:
    """Stands in a loaded checkpoint dict for module or optimizer state that stays on disk until
    it is read into the live, sharded module or optimizer (``load_distributed``); so
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


def is_distributed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DISTRIBUTED_DIR, ".metadata"))


def save_distributed(state: dict[str, Any], folder: str) -> None:
    """Write ``state`` (the module's and optimizers' state, tensors sharded over the SPMD mesh) to
    ``folder/state`` with ``torch.distributed.checkpoint``: every process writes the shards it
    holds, straight from the device, and nothing is gathered. With several hosts the processes
    coordinate over the default process group (untested here: no pod)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from xtrainer import _xla

    target = os.path.join(folder, DISTRIBUTED_DIR)
    planner, _ = _xla.spmd_checkpoint_planners()
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(target), planner=planner,
                 no_dist=not dist.is_initialized())
    except Exception as err:
        _raise_if_write_failure(err, target)
        raise


def check_distributed(path: str) -> dict[str, list[DistributedEntry]]:
    """Read a distributed checkpoint's metadata and check that every file it names is there and
    long enough; returns its entries by part (``"state_dict"``, ``"optimizer_states.0"``, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = os.path.join(path, DISTRIBUTED_DIR)
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, RuntimeError) as err:
        raise UnreadableCheckpointError(
            f"The metadata of {path!r} ({DISTRIBUTED_DIR}/.metadata) could not be read ({type(err).__name__}: "
            f"{err}); resume from an earlier checkpoint instead.") from err
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(folder, name)
        size = os.path.getsize(file) if os.path.exists(file) else None
        if size is None or size < end:
            state = "is missing" if size is None else f"is truncated ({size} of {end} bytes)"
            raise UnreadableCheckpointError(f"{file!r} {state}: the checkpoint {path!r} is incomplete; resume "
                                            "from an earlier checkpoint instead.")
    parts: dict[str, list[DistributedEntry]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        where = metadata.planner_data[fqn]
        part, below = (where[0], where[1:]) if where[0] != "optimizer_states" else (f"{where[0]}.{where[1]}", where[2:])
        if isinstance(meta, TensorStorageMetadata):
            parts.setdefault(part, []).append(DistributedEntry(tuple(below), tuple(meta.size), meta.properties.dtype))
        else:
            parts.setdefault(part, []).append(DistributedEntry(tuple(below), None, None))
    return parts


def load_distributed(target: dict[str, Any], path: str) -> None:
    """Read a distributed checkpoint into ``target`` in place: ``{"state_dict": ...}`` or
    ``{"optimizer_states": [...]}``, shaped as saved, tensors on the device with the sharding
    they are to have. Each process reads only the pieces of the files its shards need."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from xtrainer import _xla

    _, planner = _xla.spmd_checkpoint_planners()
    # The load planner finds each shard's place from the tensors' device data: tensors that are
    # still pending computations (new zeros) have none until they are executed.
    _xla.sync()
    _xla.wait_device_ops()  # host sync: before reading the checkpoint, not in a training step
    try:
        dcp.load(target, storage_reader=dcp.FileSystemReader(os.path.join(path, DISTRIBUTED_DIR)),
                 planner=planner, no_dist=not dist.is_initialized())
    except Exception as err:
        raise UnreadableCheckpointError(f"The distributed checkpoint {path!r} could not be read "
                                        f"({type(err).__name__}: {err}).") from err


def read_distributed(path: str, only: str | None = None) -> dict[str, Any]:
    """A distributed checkpoint's module and optimizer state, whole, on the host (every shard is
    read): ``{"state_dict": ..., "optimizer_states": [...]}`` as a single-file checkpoint holds
    them. ``only`` reads one of the two."""
    import torch.distributed.checkpoint as dcp
    # *Private API* of torch (what torch's public dcp_to_torch_save uses): reads every entry of a
    # checkpoint into an empty dict, without a process group.
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(os.path.join(path, DISTRIBUTED_DIR)),
                         planner=_EmptyStateDictLoadPlanner(keys=None if only is None else [only]), no_dist=True)
    except Exception as err:
        raise UnreadableCheckpointError(f"The distributed checkpoint {path!r} could not be read "
                                        f"({type(err).__name__}: {err}).") from err
    for optimizer_state in state.get("optimizer_states", []):
        # Saving names every entry by a path of strings: the optimizer's parameter ids are ints.
        optimizer_state["state"] = {int(k): v for k, v in optimizer_state.get("state", {}).items()}
    return state


def load_distributed_checkpoint(path: str) -> dict[str, Any]:
    """A distributed checkpoint's trainer state, with ``DistributedPart`` in place of the module
    and optimizer state, which ``load_distributed`` reads into the live, sharded objects."""
    trainer_state = load_file(os.path.join(path, TRAINER_FILE), "checkpoint trainer state")
    check_header(trainer_state, path)
    parts = check_distributed(path)
    optimizers = sorted(int(part.split(".")[1]) for part in parts if part.startswith("optimizer_states."))
    keys = ["state_dict"] + [f"optimizer_states.{i}" for i in optimizers]
    parts = {key: DistributedPart(path, key, tuple(parts.get(key, ()))) for key in keys}
    return {**trainer_state, "state_dict": parts["state_dict"],
            "optimizer_states": [parts[key] for key in keys[1:]]}
