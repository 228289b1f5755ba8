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

A sharded checkpoint (``xla_fsdp``) is a folder instead: ``trainer.pt`` holds every key above but
the module and optimizer state, and each rank's ``rank-RRRRR-of-WWWWW.pt`` holds its shard of
those with the shard metadata. Files are written atomically (a temporary file renamed into
place; a sharded folder is staged and renamed when complete), so an interrupted save never leaves
a truncated checkpoint behind. ``last.ckpt`` is a link to the newest checkpoint.
"""

from __future__ import annotations

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
        # A full disk shows as OSError, or as torch's RuntimeError "... file write failed".
        if isinstance(err, OSError) or (isinstance(err, RuntimeError) and "write" in str(err)):
            raise CheckpointError(
                f"Could not write {path!r} ({type(err).__name__}: {err}). Training stopped; the checkpoints "
                "written before are intact. Free disk space or choose a writable dirpath, then resume with "
                "fit(..., ckpt_path='last').") from err
        raise


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
    """Read a whole (single-file) checkpoint and check that it is an xtrainer checkpoint."""
    if is_sharded(path):
        trainer_state = load_file(os.path.join(path, TRAINER_FILE), "checkpoint trainer state")
        check_header(trainer_state, path)
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
                              "rank-RRRRR-of-WWWWW.pt files, as xla_fsdp writes them).")
    trainer_state = load_file(os.path.join(path, TRAINER_FILE), "checkpoint trainer state")
    check_header(trainer_state, path)
    world_size = trainer_state["world_size"]
    names = _check_shards(path, world_size)
    shards = [load_file(os.path.join(path, name), f"shard {name}") for name in names]
    return consolidate_state_dicts([shard["state_dict"] for shard in shards], shards[0]["shard_metadata"])


def load_weights(module: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """``module.load_state_dict(state_dict)``, refusing a state dict of another model with an
    error that lists the missing and unexpected keys and the shape mismatches."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    mismatched = [f"{k} {tuple(v.shape)} (module: {tuple(own[k].shape)})" for k, v in state_dict.items()
                  if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape]
    problems = [f"{label} ({len(keys)}): {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}"
                for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                    ("shape mismatches", mismatched)) if keys]
    if problems:
        raise CheckpointError("it does not fit this module, so nothing was trained: " + "; ".join(problems)
                              + ". Is it a checkpoint of another model (or of another configure_model())?")
    module.load_state_dict(state_dict)


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
