"""``WholeFile``: one ``torch.save`` file per checkpoint (``xla_native``, ``xla_ddp``)."""

from __future__ import annotations

import copy
import os
from typing import Any

from xtrainer.checkpoint import background, distributed, fs, storage
from xtrainer.checkpoint.format import check_savable
from xtrainer.checkpoint.layout import DISTRIBUTED, FILE, Layout, Replicas, read_file


class WholeFile(Layout):
    """Rank 0 writes the whole checkpoint to one file; every replica reads it whole. Also reads a
    distributed (SPMD) folder whole, its shards assembled on the host."""

    kind = FILE
    reads = {FILE: "any", DISTRIBUTED: "any"}

    def save(self, replicas: Replicas, checkpoint: dict[str, Any], path: str) -> None:
        """Tensors are brought to the host on every replica (a host sync), then rank 0 writes the
        file atomically and all replicas meet at a barrier, so no one races ahead of the file."""
        check_savable(checkpoint)  # before anything walks it: it may even be circular
        checkpoint = replicas.to_cpu(checkpoint)  # host sync: checkpoints are written from the host
        if replicas.is_global_zero and background.enabled():
            # The training loop goes on at once: the write, on a snapshot of the host state (the
            # loop may change what the dict refers to), is the background thread's (background.py).
            snapshot = copy.deepcopy(checkpoint)
            background.submit(lambda: storage.write_file(snapshot, path), save=True)
        elif replicas.is_global_zero:
            storage.write_file(checkpoint, path)
        replicas.barrier("xtrainer_save_checkpoint")

    def load(self, replicas: Replicas, path: str) -> dict[str, Any]:
        return read(path, verify=False)


def read(path: str, verify: bool = True) -> dict[str, Any]:
    """A whole checkpoint, checked against its checksums first (unless the caller just did)."""
    path = os.fspath(path)
    if fs.isdir(path):
        return distributed.read_whole(path, verify=verify)
    return read_file(path, verify=verify)
