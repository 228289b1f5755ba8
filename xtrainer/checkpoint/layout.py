"""The layout contract: how one kind of checkpoint is written and read.

A strategy names its layout (``Strategy.checkpoint_layout``); the Trainer builds the checkpoint
dict (``format.py``) and hands it to the layout, which writes it, and reads it back for the
strategy to load. Three layouts exist:

=================  ====================  ================================================  ===========================
layout             written by            on disk                                           resumed by
=================  ====================  ================================================  ===========================
``WholeFile``      xla_native, xla_ddp   one file, ``NAME.ckpt``                           xla_native, xla_ddp, SPMD:
                                                                                           any world size
``FsdpShards``     xla_fsdp              a folder: ``trainer.pt``, ``rank-R-of-W.pt``,     xla_fsdp at the same world
                                         ``manifest.json``                                 size
``Distributed``    xla_spmd, xla_fsdpv2  a folder: ``trainer.pt``, ``state/`` (torch.     xla_spmd, xla_fsdpv2,
                                         distributed.checkpoint), ``manifest.json``        xla_native, xla_ddp: any
=================  ====================  ================================================  ===========================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from xtrainer.checkpoint import folders, fs, safe, storage
from xtrainer.checkpoint.format import (FORMAT, FORMAT_VERSION, LOOPS, STRATEGY, WORLD_SIZE,
                                        CheckpointError, UnreadableCheckpointError, check_header,
                                        lightning_checkpoint)

TRAINER_FILE = "trainer.pt"
FILE, FSDP, DISTRIBUTED = "file", "fsdp", "distributed"


class Replicas(Protocol):
    """What a layout needs of the replicas: who this one is and how they agree (a strategy's
    ``collectives``)."""

    global_rank: int
    world_size: int
    is_global_zero: bool

    def barrier(self, name: str = ...) -> None: ...
    def to_cpu(self, data: Any) -> Any: ...
    def broadcast(self, obj: Any) -> Any: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True)
class Header:
    """What a checkpoint says about itself, read without loading its tensors."""

    path: str
    layout: str
    strategy: str
    world_size: int
    global_step: int
    epoch: int
    epoch_finished: bool

    def describe(self) -> str:
        return (f"{self.path} (strategy {self.strategy}, world size {self.world_size}, epoch {self.epoch}, "
                f"step {self.global_step})")


class Layout:
    """One way of writing checkpoints. ``reads`` maps each layout this one resumes from to
    ``"any"`` (any world size) or ``"same"`` (only the world size that wrote it)."""

    kind: ClassVar[str]
    reads: ClassVar[dict[str, str]]

    def save(self, replicas: Replicas, checkpoint: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def load(self, replicas: Replicas, path: str) -> dict[str, Any]:
        """The checkpoint at ``path`` (of a layout in ``reads``), for this replica."""
        raise NotImplementedError

    def refuses(self, header: Header, world_size: int | None, strategy: str) -> str | None:
        """Why a run of ``strategy`` at ``world_size`` cannot resume from ``header`` (None: it can).
        ``world_size`` None: not known before the replicas start (the replicas check it then)."""
        rule = self.reads.get(header.layout)
        if rule is None or rule == "same" and world_size is not None and header.world_size != world_size:
            advice = ("xtrainer consolidate turns it into one state dict to load into the module before fit()"
                      if header.layout != FILE else "load checkpoint['state_dict'] into the module before fit()")
            size = f" at world size {header.world_size}" if rule == "same" else ""
            at = f" at world size {world_size}" if world_size is not None else ""
            return (f"it was written by {header.strategy} with {header.world_size} replica(s); {strategy}{at} cannot "
                    f"resume it (resume with {header.strategy}{size}, or start from its weights: {advice})")
        return None


def layout_of(path: str) -> str:
    """The layout of the checkpoint at ``path``, from what is on disk."""
    if fs.isfile(path):
        return FILE
    if not fs.isdir(path):
        raise CheckpointError(f"The checkpoint {path!r} does not exist.")
    manifest = storage.read_manifest(path)
    layout = manifest.get("layout")
    if layout not in (FSDP, DISTRIBUTED):
        raise UnreadableCheckpointError(f"The manifest of {path!r} names an unknown layout {layout!r}.")
    return layout


def read_file(path: str, verify: bool = True, lightning: bool = False) -> dict[str, Any]:
    """A checkpoint written as one file (``FILE``), checked against its checksum first (unless the
    caller just did) and checked to be xtrainer's (or, with ``lightning``, PyTorch Lightning's);
    read weights-only."""
    if not fs.exists(path):
        raise CheckpointError(f"The checkpoint {path!r} does not exist.")
    if verify:
        storage.verify_zip(path)
    checkpoint = safe.load(path, "checkpoint")
    if not (lightning and lightning_checkpoint(checkpoint)):
        check_header(checkpoint, path)
    return checkpoint


def trainer_state(path: str) -> dict[str, Any]:
    """The ``trainer.pt`` of a sharded checkpoint folder (everything but module and optimizer
    state), read weights-only and checked to be xtrainer's."""
    state = safe.load(fs.join(path, TRAINER_FILE), "checkpoint trainer state")
    check_header(state, path)
    return state


def header(path: str, layout: str, who: dict[str, Any], state: dict[str, Any]) -> Header:
    """The header of a checkpoint whose writer is described by ``who`` and whose loop state is in
    ``state``; a malformed one is refused as unreadable."""
    loops = state.get(LOOPS)
    world_size = who.get(WORLD_SIZE)
    ints = [world_size] + [loops.get(k) for k in ("global_step", "epoch")] if isinstance(loops, dict) else []
    if not ints or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints) or world_size < 1:
        raise UnreadableCheckpointError(f"{path!r} has a malformed header (world_size={world_size!r}, "
                                        f"loops={loops!r:.200}); it was not written by xtrainer as it is.")
    return Header(path, layout, str(who.get(STRATEGY, "?")), world_size, loops["global_step"], loops["epoch"],
                  bool(loops.get("epoch_finished")))


def manifest_header(layout: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "layout": layout,
            STRATEGY: checkpoint.get(STRATEGY), WORLD_SIZE: checkpoint.get(WORLD_SIZE)}


def save_folder(replicas: Replicas, path: str, layout: str, trainer_state: dict[str, Any],
                write_shards: Any) -> None:
    """Write a sharded checkpoint folder. Every replica calls ``write_shards(folder)`` into one
    staging folder (named by rank 0) and returns ``{file name: {"size", "sha256"}}`` for the files
    it wrote; then rank 0 writes ``trainer.pt`` and, last, ``manifest.json``, and renames the
    folder into place: a folder under the final name is always complete.

    On an object store (no rename) the folder is written in place, an older one of the same name
    removed first (its manifest before anything else); the manifest, written last, is what marks
    the new one complete."""
    in_place = fs.is_url(path)
    staging = path if in_place else os.path.join(os.path.dirname(path), storage.temp_name(os.path.basename(path)))
    staging = replicas.broadcast(staging) if replicas.world_size > 1 else staging
    if replicas.is_global_zero:
        try:
            if in_place:
                fs.require(path)
                storage.remove(fs.join(path, storage.MANIFEST))  # first: the old folder is no checkpoint now
                storage.remove(path)
                fs.makedirs(path)
            else:
                os.makedirs(staging)
        except OSError as err:
            raise storage.write_error(err, staging) from err
    replicas.barrier("xtrainer_sharded_checkpoint_staged")
    files = write_shards(staging)
    gathered = replicas.all_gather_object(files) if replicas.world_size > 1 else [files]
    if replicas.is_global_zero:
        listing: dict[str, Any] = {}
        for rank, written in enumerate(gathered):
            for name, info in written.items():
                listing[name] = {**info, "rank": info.get("rank", rank)}
        trainer_state = replicas.to_cpu(trainer_state)  # host sync: written from the host
        written = storage.write_file(trainer_state, fs.join(staging, TRAINER_FILE))
        listing[TRAINER_FILE] = {"size": written.size, "sha256": written.sha256, "rank": None}
        storage.write_manifest(staging, listing, manifest_header(layout, trainer_state))
        folders.publish(staging, path)
    replicas.barrier("xtrainer_save_sharded_checkpoint")


def entry(written: storage.Written, rank: int | None) -> dict[str, Any]:
    return {"size": written.size, "sha256": written.sha256, "rank": rank}
