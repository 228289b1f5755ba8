"""A folder of checkpoints, around the files ``storage`` writes: a complete folder renamed into
place (``publish``), ``last.ckpt`` pointed at the newest checkpoint (a relative link, or a copy on
an object store), a checkpoint removed with the folders it leaves empty, a checkpoint held still
while it is read (``pinned``), and what interrupted saves left behind tidied
(``remove_leftovers``). Each waits behind a background write in flight where it must
(``background``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
from typing import Iterator

from xtrainer.checkpoint import background, fs, storage, writers
from xtrainer.checkpoint.format import CheckpointError, UnreadableCheckpointError

#: A folder being removed (renamed away first, by ``storage.remove``).
_DELETED = storage.DELETED


def make_room_for_folder(path: str) -> None:
    """A checkpoint folder is renamed into place, which a link or a file at ``path`` would block:
    remove those (a folder there is replaced by the rename itself)."""
    if not fs.is_url(path) and os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        os.remove(path)


def point_last(last: str, target: str) -> None:
    """Make ``last`` stand for the complete checkpoint ``target``, atomically: a relative link
    under a temporary name renamed over it (an older checkpoint folder of that name is removed
    first; ``target`` is newer and complete). On an object store, which has no links: a copy.
    Behind a background write in flight (``background``), once ``target`` is complete."""
    if background.behind_writes(lambda: point_last(last, target)):
        return
    if fs.is_url(last):
        copy_checkpoint(target, last)
        return
    folder = os.path.dirname(last)
    tmp = os.path.join(folder, storage.temp_name(os.path.basename(last)))
    try:
        if os.path.isdir(last) and not os.path.islink(last):
            shutil.rmtree(last)
        os.makedirs(folder, exist_ok=True)
        os.symlink(os.path.relpath(target, folder), tmp)  # relative: the folder can move
        os.replace(tmp, last)
    except OSError as err:
        storage.remove_quietly(tmp)
        raise storage.write_error(err, last) from err


def remove_checkpoint(path: str, top: str) -> None:
    """Remove the checkpoint ``path`` (a file, a link or a folder), then the folders between it
    and ``top`` that this left empty (names with ``/`` make them). Behind a background write in
    flight, once the newer checkpoint is complete."""
    if background.behind_writes(lambda: remove_checkpoint(path, top)):
        return
    storage.remove(path)
    if fs.is_url(path):  # an object store has no empty folders
        return
    top, folder = os.path.realpath(top), os.path.dirname(path)
    while os.path.realpath(folder).startswith(top + os.sep):
        try:
            os.rmdir(folder)
        except OSError:
            return
        folder = os.path.dirname(folder)


def link_last(dirpath: str, target: str) -> None:
    """Point ``dirpath/last.ckpt`` at ``target`` (a complete checkpoint), atomically: a new link
    under a temporary name renamed over the old one."""
    last = os.path.join(dirpath, storage.LAST)
    tmp = os.path.join(dirpath, storage.temp_name(storage.LAST))
    try:
        os.symlink(os.path.basename(target), tmp)  # relative: the folder can move
        os.replace(tmp, last)
    except OSError as err:
        storage.remove_quietly(tmp)
        raise storage.write_error(err, last) from err


def copy_checkpoint(source: str, target: str) -> None:
    """Make ``target`` a copy of the complete checkpoint ``source`` on an object store (which has
    no links): ``last.ckpt`` there. A file is one server-side copy (whole when it completes); a
    folder is copied file by file after the old ``target``'s manifest is removed, and its
    manifest is copied last, so ``target`` is never a mix of two checkpoints that verifies."""
    if background.behind_writes(lambda: copy_checkpoint(source, target)):
        return  # ``source`` is still being written: copied once it is complete
    try:
        if fs.isdir(target):
            storage.remove(fs.join(target, storage.MANIFEST))
            storage.remove(target)
        if fs.isdir(source):
            for name in sorted(storage.read_manifest(source)["files"]):
                fs.copy(fs.join(source, name), fs.join(target, name))
            fs.copy(fs.join(source, storage.MANIFEST), fs.join(target, storage.MANIFEST))
        else:
            fs.copy(source, target)
    except OSError as err:
        raise storage.write_error(err, target) from err


@contextlib.contextmanager
def pinned(path: str) -> Iterator[str]:
    """``path`` as it is now, held still while it is read: a link (``last.ckpt``) is resolved once,
    and every file of the checkpoint is hard-linked under a temporary name beside it, so that a
    running fit that re-points the link, prunes the checkpoint or replaces it while it is read
    changes nothing of what is read (the writer never changes a file in place). Gives the pinned
    path, removed afterwards (a crash leaves it to the next writer's ``remove_leftovers``). Where
    hard links cannot be made (a read-only folder, a filesystem without them) the resolved path
    itself is read. On an object store the URL as it is (objects are replaced whole)."""
    if fs.is_url(path) or not os.path.lexists(path):
        yield path
        return
    real = os.path.realpath(path)
    pin = os.path.join(os.path.dirname(real), storage.temp_name("pin"))
    try:
        os.mkdir(pin)
    except OSError:
        yield real
        return
    target = os.path.join(pin, os.path.basename(real))
    try:
        try:
            _pin_into(real, target)
        except FileNotFoundError:
            raise UnreadableCheckpointError(
                f"{path!r} was removed while it was being read (a running fit pruned or replaced it): read it "
                "again, or read a checkpoint that no running fit replaces.") from None
        except OSError:
            storage.remove(pin)
            yield real
            return
        try:
            yield target
        except CheckpointError as err:  # name the checkpoint the caller asked for, not the pin
            err.args = tuple(arg.replace(target, real) if isinstance(arg, str) else arg for arg in err.args)
            raise
    finally:
        with contextlib.suppress(OSError):
            storage.remove(pin)


def unpin(path: str) -> None:
    """Let go early of the hold ``pinned`` has on ``path``, the pinned path it gave (any other
    path: nothing happens), once every reader of it is done: its pin removed."""
    pin = os.path.dirname(path)
    parsed = None if fs.is_url(path) else _parse_temp(os.path.basename(pin), socket.gethostname())
    if parsed is not None and parsed[1] == "pin":
        with contextlib.suppress(OSError):
            storage.remove(pin)


def _pin_into(source: str, target: str, attempts: int = 3) -> None:
    """Hard-link the checkpoint ``source`` to ``target``. A folder replaced while it is walked
    (removed and written again under its name, as a fit prunes and saves) may have been listed
    from the old folder as it was being deleted, so part of it: the walk counts only if
    ``source`` is the same folder after it as before, and is made again otherwise.
    ``FileNotFoundError`` when ``source`` is gone, or is replaced on every attempt."""
    if not os.path.isdir(source):
        os.link(source, target)  # one link: the file as it is
        return
    for _ in range(attempts):
        before = _identity(source)
        _hard_link_tree(source, target)
        if _identity(source) == before:
            return
        shutil.rmtree(target)
    raise FileNotFoundError(source)


def _identity(path: str) -> tuple[int, int, int]:
    """What tells a folder from another put in its place: its inode, and the time of its last
    rename (its ctime, which linking its files leaves alone; nothing is written into a
    checkpoint folder once it is in place)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _hard_link_tree(source: str, target: str) -> None:
    if not os.path.isdir(source):
        os.link(source, target)
        return
    os.mkdir(target)
    for name in os.listdir(source):
        _hard_link_tree(os.path.join(source, name), os.path.join(target, name))


def publish(staging: str, path: str) -> None:
    """Rename a completely written checkpoint folder into place (replacing an older one). On an
    object store the folder was written in place (``staging`` is ``path``): nothing to do."""
    if fs.is_url(path):
        return
    if os.path.isdir(path):
        old = os.path.join(os.path.dirname(path), storage.temp_name(os.path.basename(path) + ".old"))
        os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, path)
    storage.fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_leftovers(dirpath: str) -> list[str]:
    """Remove what interrupted saves left in ``dirpath``: temporary files and staging folders of
    process instances of this host that no longer run (``writers.alive``: a PID that runs again,
    started at another time, is another process). Another host's (on shared storage) are left
    alone: whether it still runs cannot be told from here. Returns the names removed. Nothing on
    an object store, where nothing is written under a temporary name."""
    if fs.is_url(dirpath) or not os.path.isdir(dirpath):
        return []
    removed, host = [], socket.gethostname()
    for name in os.listdir(dirpath):
        parsed = _parse_temp(name, host)
        if parsed is None or writers.alive(parsed[0]):
            continue
        path = os.path.join(dirpath, name)
        final = os.path.join(dirpath, parsed[1].removesuffix(".old"))
        try:
            if os.path.isfile(os.path.join(path, storage.MANIFEST)) and not os.path.lexists(final) \
                    and not name.endswith(_DELETED):
                # a complete folder, caught between the two renames of publish(): put it in place
                os.replace(path, final)
                continue
            storage.remove(path)
            removed.append(name)
        except OSError:
            pass
    return removed


# after ``.tmp-<host>-``: the writer (an instance, or a bare PID in older names), the tag, the name
_TEMP_REST = re.compile(r"^([0-9][0-9.a-fxr]*)-([0-9a-f]{8})-(.+)$")


def _parse_temp(name: str, host: str) -> tuple[str, str] | None:
    """``(writer, final name)`` of a temporary name written on ``host``, or None (another host's,
    or not a temporary name). The tag's fixed form keeps a host whose name extends this one
    (``node`` and ``node-1``) from being read as this host."""
    prefix = f"{storage.TEMP_PREFIX}{host}-"
    if not name.startswith(prefix):
        return None
    found = _TEMP_REST.match(name[len(prefix):])
    if found is None or not writers.is_instance(found.group(1)):
        return None
    return found.group(1), found.group(3)
