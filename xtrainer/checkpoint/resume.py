"""Which checkpoint a run resumes from, and saying so.

``ckpt_path="last"`` looks in the run's own lineage only: the checkpoint folders of the sibling
``version_N`` runs under the same root and logger name, plus any ``ModelCheckpoint`` ``dirpath``
the run was given. Candidates are tried newest first (``last.ckpt`` links first); each is checked
completely (every byte against its checksum) and against the strategy and world size of this
run (``Layout.refuses``). The first that passes is used; the others are reported with the
reason. With no checkpoint at all, a warning and a fresh start, as Lightning does. What crashed
saves left in those folders (temporary files of processes that are gone) is removed on the way.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from typing import Iterable

from xtrainer.checkpoint import folders, fs, storage, verify
from xtrainer.checkpoint.format import CheckpointError, UnreadableCheckpointError
from xtrainer.checkpoint.layout import Header, Layout


def lineage_dirs(log_dir: str, extra: Iterable[str] = ()) -> list[str]:
    """The checkpoint folders of every run in ``log_dir``'s lineage (its parent's ``version_*``)."""
    dirs = list(extra)
    if fs.is_url(log_dir):  # an object store: the version_* prefixes under the parent
        parent = fs.dirname(log_dir)
        dirs += sorted(fs.join(parent, name, "checkpoints") for name in fs.listdir(parent)
                       if name.startswith("version_"))
    else:
        dirs += sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(log_dir)), "version_*", "checkpoints")))
    return list(dict.fromkeys(fs.normalize(d) for d in dirs))


def candidates(dirpaths: Iterable[str]) -> list[str]:
    """Checkpoints in ``dirpaths``, in order of preference: ``last.ckpt`` links (newest first),
    then every other checkpoint, newest first. Unfinished saves (temporary names) are not
    among them."""
    found = []
    for dirpath in dict.fromkeys(dirpaths):
        if fs.isdir(dirpath):
            for name in fs.listdir(dirpath):
                path = fs.join(dirpath, name)
                if name.endswith(".ckpt") and not name.startswith(".") and fs.exists(path):
                    found.append(path)
    # An object store dates objects to the second: ties are broken by the name, numbers compared
    # as numbers (epoch=1-step=12 after epoch=0-step=8), which the default file names order right.
    found.sort(key=lambda p: (fs.basename(p) == storage.LAST, _mtime(p)) + ((_natural(p),) if fs.is_url(p) else ()),
               reverse=True)
    return list(dict.fromkeys(p if fs.is_url(p) else os.path.realpath(p) for p in found))


def _natural(path: str) -> list:
    return [(1, int(part), "") if part.isdigit() else (0, 0, part) for part in re.split(r"(\d+)", fs.basename(path))]


def _mtime(path: str) -> float:
    target = fs.join(path, storage.MANIFEST) if fs.isdir(path) else path
    try:
        return fs.mtime(target)
    except (OSError, NotImplementedError):
        return 0.0


def resolve(ckpt_path: str, search: list[str], layout: Layout, strategy: str,
            world_size: int | None, root: str = "") -> Header | None:
    """The checkpoint to resume from: ``ckpt_path`` itself, verified and checked against this run,
    or for ``"last"`` the newest in ``search`` that passes (None, with a warning, when there is
    none at all). Raises ``CheckpointError`` saying what is wrong with each one refused."""
    if ckpt_path != "last":
        header = verify(ckpt_path)
        reason = layout.refuses(header, world_size, strategy)
        if reason:
            raise CheckpointError(f"Cannot resume from {ckpt_path!r}: {reason}.")
        return header
    for dirpath in search:  # the next start in these folders: clear what crashed saves left
        folders.remove_leftovers(dirpath)
    if root and not fs.is_url(root):  # and the lineage's run folders' own files (goodput.json, config.yaml),
        for run_folder in glob.glob(os.path.join(glob.escape(root), "version_*")):  # with checkpoints or not
            folders.remove_leftovers(run_folder)
    found = candidates(search)
    if not found:
        where = ", ".join([fs.join(root, "version_*", "checkpoints")] * bool(root) + search)
        warnings.warn(f"ckpt_path='last' found no checkpoint in {where}: training starts from scratch.",
                      UserWarning, stacklevel=3)
        return None
    skipped = []
    for path in found:
        try:
            header = verify(path)
        except CheckpointError as err:
            skipped.append(f"{path}: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - a malformed file must not stop the search for a good one
            skipped.append(f"{path}: unreadable ({type(err).__name__}: {err})")
            continue
        reason = layout.refuses(header, world_size, strategy)
        if reason:
            skipped.append(f"{path}: {reason}")
            continue
        if skipped:
            warnings.warn(f"ckpt_path='last': resuming from {path}, the newest checkpoint that verifies and fits "
                          "this run; skipped:\n  " + "\n  ".join(skipped), UserWarning, stacklevel=3)
        return header
    raise UnreadableCheckpointError("ckpt_path='last': no checkpoint in the run's lineage can be resumed:\n  "
                                    + "\n  ".join(skipped))
