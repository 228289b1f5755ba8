"""The one package that reads and writes checkpoints.

- ``format``: what a checkpoint dict holds, and the rule that it holds plain data only;
- ``safe``: every read, weights-only (nothing in a checkpoint runs);
- ``fs``: paths that are local or fsspec URLs (``s3://``, ``gs://``, ``memory://``), and what an
  object store guarantees;
- ``storage``: atomic writes, manifests and checksums, disk errors, removal;
- ``folders``: a folder of checkpoints: a folder renamed into place, ``last``, removal with the
  folders left empty, pinning what is read, leftovers of crashed saves;
- ``layout``: what every layout shares (the contract, the header, one-file reads, sharded folders);
- ``whole``, ``fsdp``, ``distributed``: the three layouts on disk;
- ``resume``: which checkpoint ``ckpt_path`` (``"last"``) means for a run;
- this package: what reads a checkpoint of any layout (``verify``, ``load_checkpoint``,
  ``consolidate``, ``read_module``), above the layouts, which never import each other back.
"""

from __future__ import annotations

import os
from typing import Any

from xtrainer.checkpoint import distributed, folders, fs, fsdp, layout, safe, storage, whole
from xtrainer.checkpoint.format import (STATE_DICT, CheckpointError, CheckpointNotFoundError,
                                        UnreadableCheckpointError, check_header)
from xtrainer.checkpoint.layout import TRAINER_FILE
from xtrainer.checkpoint.safe import UnsafeCheckpointError
from xtrainer.checkpoint.storage import LAST

__all__ = ["CheckpointError", "CheckpointNotFoundError", "UnreadableCheckpointError", "UnsafeCheckpointError",
           "LAST", "TRAINER_FILE",
           "load_checkpoint", "consolidate", "verify", "default_dirpath", "read_module", "read_hyperparameters",
           "read_datamodule"]


def default_dirpath(log_dir: str) -> str:
    """Where a run's checkpoints go unless told otherwise."""
    return fs.join(log_dir, "checkpoints")


def verify(path: str | os.PathLike) -> layout.Header:
    """Check the checkpoint at ``path`` completely (every byte against its checksum, the header)
    and return its header. Raises ``UnreadableCheckpointError`` for damage, ``CheckpointError`` for
    a file that is not an xtrainer checkpoint (``safe.UnsafeCheckpointError`` for one that asks
    to run code)."""
    path = fs.local(os.fspath(path))
    kind = layout.layout_of(path)
    if kind == layout.FILE:
        storage.verify_zip(path)
        checkpoint = safe.load(path, "checkpoint", mmap=not fs.is_url(path))
        check_header(checkpoint, path)
        if not isinstance(checkpoint.get(STATE_DICT), dict):
            raise UnreadableCheckpointError(f"{path!r} has no state_dict (a dict of tensors).")
        return layout.header(path, layout.FILE, checkpoint, checkpoint)
    manifest = storage.verify_folder(path)
    check_header(manifest, path)
    state = layout.trainer_state(path)
    if kind == layout.DISTRIBUTED:
        distributed.entries(path)  # its metadata reads, and is metadata
    return layout.header(path, kind, manifest, state)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint whole, on the host, after checking it against its checksums: a file, or
    a distributed (SPMD) folder with its shards assembled. An FSDP folder is refused (its shards
    need ``consolidate``). Nothing in the file runs: it is read weights-only."""
    path = fs.local(os.fspath(path))
    kind = layout.layout_of(path)
    if kind == layout.FSDP:
        state = layout.trainer_state(path)
        raise CheckpointError(
            f"{path!r} is a sharded checkpoint written by {state.get('strategy')!r} with world size "
            f"{state.get('world_size')}. Resume it with strategy='xla_fsdp' at that world size, or consolidate it "
            f"first: xtrainer consolidate {path} -o full.pt")
    return whole.read(path, verify=True)


def consolidate(path: str | os.PathLike) -> dict[str, Any]:
    """One plain state dict (as the unwrapped module names it) from a checkpoint of any layout,
    checked against its checksums first: an FSDP folder's shards stitched, an SPMD folder's
    shards assembled, a whole file's ``state_dict`` as it is."""
    path = fs.local(os.fspath(path))
    if not fs.exists(path):
        raise CheckpointError(f"{path!r} does not exist.")
    with folders.pinned(path) as pinned:  # what is verified is what is read
        return _consolidate(pinned)


def _consolidate(path: str) -> dict[str, Any]:
    if not fs.isdir(path):
        state_dict = whole.read(path, verify=True).get("state_dict")  # a whole file holds them whole already
        if not isinstance(state_dict, dict):
            raise UnreadableCheckpointError(f"{path!r} has no state_dict.")
        return state_dict
    storage.verify_folder(path)
    kind = layout.layout_of(path)
    layout.trainer_state(path)
    return fsdp.consolidate(path) if kind == layout.FSDP else distributed.consolidate(path)


def read_module(path: str | os.PathLike) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """What ``load_from_checkpoint`` needs from a checkpoint of any layout (or a file PyTorch
    Lightning wrote), checked against its checksums: the module's hyperparameters, the
    ``__init__`` argument that held them whole (or None), and the checkpoint (for
    ``on_load_checkpoint``) with the full state dict as its ``state_dict``."""
    path = fs.local(os.fspath(path))
    if not fs.exists(path):
        raise CheckpointNotFoundError(f"{path!r} does not exist.")
    with folders.pinned(path) as pinned:  # what is verified is what is read
        # A file may be PyTorch Lightning's too: its weights and hyperparameters are all this needs.
        state = layout.read_file(pinned, verify=True, lightning=True) if not fs.isdir(pinned) else None
        weights = _consolidate(pinned) if state is None else state.get("state_dict")
        if state is None:
            state = layout.trainer_state(pinned)
    if not isinstance(weights, dict):
        raise UnreadableCheckpointError(f"{path!r} has no state_dict.")
    return (*_hyperparameters(state, path), {**state, "state_dict": weights})


def read_hyperparameters(path: str | os.PathLike) -> dict[str, Any]:
    """The module's hyperparameters in a checkpoint of any layout, read weights-only: a whole
    file checked against its checksum, a sharded folder's ``trainer.pt`` without its shards."""
    path = fs.local(os.fspath(path))
    return _hyperparameters(_trainer_state(path), path)[0]


def read_datamodule(path: str | os.PathLike) -> tuple[dict[str, Any], Any]:
    """The data module's saved hyperparameters and state in a checkpoint of any layout, read
    weights-only and checked as ``read_hyperparameters`` reads (``XDataModule.load_from_checkpoint``)."""
    path = fs.local(os.fspath(path))
    state = _trainer_state(path)
    hparams = state.get("datamodule_hyper_parameters") or {}
    if not isinstance(hparams, dict):
        raise UnreadableCheckpointError(f"{path!r} has malformed datamodule_hyper_parameters.")
    return dict(hparams), state.get("datamodule")


def _trainer_state(path: str) -> dict[str, Any]:
    """A checkpoint's state without its shards, checked: a whole file against its checksum, a
    sharded folder's ``trainer.pt``."""
    if not fs.exists(path):
        raise CheckpointNotFoundError(f"{path!r} does not exist.")
    with folders.pinned(path) as pinned:
        return whole.read(pinned, verify=True) if not fs.isdir(pinned) else layout.trainer_state(pinned)


def _hyperparameters(state: dict[str, Any], path: str) -> tuple[dict[str, Any], str | None]:
    hparams = state.get("hyper_parameters") or {}
    name = state.get("hparams_name")
    if not isinstance(hparams, dict) or not (name is None or isinstance(name, str)):
        raise UnreadableCheckpointError(f"{path!r} has malformed hyper_parameters.")
    return dict(hparams), name
