"""Files on disk: atomic writes, manifests and checksums, disk errors, removal. What a folder of
checkpoints does with them (a folder renamed into place, ``last``, pinning what is read, tidying
leftovers) is ``folders.py``'s.

- **Atomic.** A file is written under a temporary name in its folder
  (``.tmp-<host>-<instance>-<tag>-<name>``, the writing process's instance: ``writers``) and
  renamed into place once flushed to disk; a sharded folder is staged the same way and
  renamed when complete. A crash leaves the previous file or nothing, never a partial one.
- **Verified.** A whole-file checkpoint is a zip archive (``torch.save``'s format) whose central
  directory lists every record with its size and CRC-32, written last: reading every record
  against it detects truncation and flipped bits. A sharded folder carries ``manifest.json``,
  written last, listing every file with its size, its SHA-256 and the rank that wrote it; a
  folder without one is an unfinished save. Checking costs one read of the checkpoint
  (SHA-256 at about 0.7 s per GB on one core here, the zip CRC-32 about 0.6 s per GB).
- **Clear errors.** A full disk, a quota or an unwritable folder is a ``CheckpointError`` that
  names the path (and, for a full disk, the bytes needed and free); files keep the user's umask.
- **Tidy.** Leftovers of saves interrupted by a crash (temporary files and staging folders whose
  process is gone) are removed when the next run starts saving in that folder
  (``folders.remove_leftovers``); a process that has the dead writer's PID (a restarted
  container's PID 1) is told from it by its start time.
- **Object stores** (an fsspec URL: ``s3://``, ``gs://``, ``memory://``; see ``fs``): no rename
  exists, so files are written under their final name (an object appears whole when its upload
  completes) and a folder's ``manifest.json`` is still written last: a folder whose manifest is
  missing or does not verify is an unfinished save and is skipped. Whole files are verified by
  their zip directory as on disk. No temporary names, hence no leftovers to tidy: an unfinished
  folder stays until overwritten or removed (it is never resumed from).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import uuid
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xtrainer.checkpoint import background, fs, writers
from xtrainer.checkpoint.format import CheckpointError, UnreadableCheckpointError

LAST = "last.ckpt"
MANIFEST = "manifest.json"
TEMP_PREFIX = ".tmp-"
DELETED = ".deleted"  # a folder being removed (renamed away first)
_CHUNK = 8 << 20
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def temp_name(name: str) -> str:
    """A temporary name for ``name``, unique to this host and process instance (so leftovers can
    be told from another live run's temporary files, also when a restarted process has the dead
    one's PID): ``.tmp-<host>-<instance>-<tag>-<name>`` (``writers.instance``)."""
    return f"{TEMP_PREFIX}{socket.gethostname()}-{writers.instance()}-{uuid.uuid4().hex[:8]}-{name}"


@dataclass(frozen=True)
class Written:
    """A file as written: its size in bytes and SHA-256."""

    size: int
    sha256: str


class _HashingWriter:
    """A write-only file that hashes what passes through it, so a file's checksum costs no
    second read."""

    def __init__(self, fd: int, stream: Any = None) -> None:
        self.fd, self.size, self.hash = fd, 0, hashlib.sha256()
        self.stream = stream  # an fsspec file (object stores) instead of a file descriptor

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        if self.stream is not None:
            self.stream.write(view)
            self.size += len(view)
            return len(view)
        total = 0
        while total < len(view):
            total += os.write(self.fd, view[total:])
        self.size += total
        return total

    def flush(self) -> None:
        pass


TRAINING_ADVICE = ("Training stopped; the checkpoints written before are intact. Free disk space or choose a "
                   "writable dirpath, then resume with fit(..., ckpt_path='last').")


def write_file(obj: Any, path: str, advice: str = TRAINING_ADVICE) -> Written:
    """``torch.save`` ``obj`` to ``path`` atomically: a temporary file in the same folder (created
    with the user's umask), flushed to disk, then renamed over ``path``. A failure leaves the
    previous file, if any, untouched and is raised as a ``CheckpointError`` naming ``path`` and
    ending with ``advice``."""
    return write_with(lambda writer: torch.save(obj, writer), path, needed=_nbytes(obj), advice=advice)


def write_bytes(data: bytes, path: str) -> Written:
    return write_with(lambda writer: writer.write(data), path, needed=len(data))


def write_with(produce: Callable[[_HashingWriter], Any], path: str, needed: int = 0,
               advice: str = TRAINING_ADVICE) -> Written:
    path = os.fspath(path)
    if fs.is_url(path):
        return _write_url(produce, path, needed, advice)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, temp_name(os.path.basename(path)))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 & ~umask, as open() does
        try:
            writer = _HashingWriter(fd)
            produce(writer)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        fsync_dir(directory)
        return Written(writer.size, writer.hash.hexdigest())
    except (KeyboardInterrupt, SystemExit):
        remove_quietly(tmp)
        raise
    except Exception as err:  # noqa: BLE001 - every failure to write is reported the same way
        remove_quietly(tmp)
        raise write_error(err, path, needed, advice) from err


def _write_url(produce: Callable[[_HashingWriter], Any], path: str, needed: int, advice: str) -> Written:
    """Write an object under its final name: an object store makes it visible, whole, when the
    upload completes (closing the file); a failed or killed upload leaves no new object."""
    fs.require(path)  # a missing client names its extra, not a write error
    stream = None
    try:
        stream = fs.open(path, "wb")
        writer = _HashingWriter(-1, stream)
        produce(writer)
        stream.close()  # the upload completes here
        return Written(writer.size, writer.hash.hexdigest())
    except (KeyboardInterrupt, SystemExit):
        fs.abandon(stream)
        raise
    except Exception as err:  # noqa: BLE001 - every failure to write is reported the same way
        fs.abandon(stream)
        raise write_error(err, path, needed, advice) from err


def write_error(err: BaseException, path: str, needed: int = 0, advice: str = TRAINING_ADVICE) -> CheckpointError:
    """A ``CheckpointError`` that says why ``path`` could not be written and what to do. A full
    disk shows as ENOSPC, or only as a failed write inside torch's serializer: the free space
    decides."""
    if isinstance(err, CheckpointError):
        return err
    free = _free_bytes(path)
    causes, todo = [], [err]
    while todo:  # the error, the ranks' failures torch.distributed.checkpoint collected, and their causes
        cause = todo.pop()
        if cause is not None and cause not in causes:
            causes.append(cause)
            todo += [*failures_in(cause), cause.__cause__, cause.__context__]
    os_errors = [c for c in causes if isinstance(c, OSError) and c.errno is not None]
    # A full disk shows as ENOSPC; inside torch's serializer only as a failed write, where the
    # free space decides. Any other OS error (no such folder, permission, read-only) is itself.
    full = any(c.errno in _DISK_FULL for c in os_errors) or (
        not os_errors and free is not None and needed and free < needed + (1 << 20))
    if full:
        need = f"about {_human(needed)} needed, {_human(free)} free" if needed and free is not None else \
            f"{_human(free)} free" if free is not None else "no space left"
        what = f"The disk is full: could not write {path!r} ({need})"
    else:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        what = f"Could not write {path!r} ({type(err).__name__}: {first})"
    return CheckpointError(f"{what}. {advice}")


def failures_in(err: BaseException) -> list[BaseException]:
    """The per-rank exceptions that ``torch.distributed.checkpoint`` collected in ``err`` (its
    ``CheckpointException`` holds ``{rank: (exception, stack)}``)."""
    found = []
    for failure in getattr(err, "failures", {}).values():
        failure = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(failure, BaseException):
            found.append(failure)
    return found


def _nbytes(obj: Any) -> int:
    """The bytes of tensor data in ``obj`` (nested), roughly what saving it takes."""
    total, stack = 0, [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _free_bytes(path: str) -> int | None:
    if fs.is_url(path):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fsync_dir(directory: str) -> None:
    """Flush ``directory``'s entries (a rename into it) to disk, where the system allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_quietly(path: str | None) -> None:
    """``remove(path)``, whatever fails (a temporary file given up)."""
    if path is not None:
        try:
            remove(path)
        except OSError:
            pass


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with (fs.open(path, "rb") if fs.is_url(path) else open(path, "rb", buffering=0)) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---- verifying ---------------------------------------------------------------------------------
def verify_zip(path: str) -> None:
    """Check a ``torch.save`` file against its zip directory: every record there, at its size,
    with its CRC-32. Raises ``UnreadableCheckpointError`` naming the file and the damage."""
    try:
        if fs.is_url(path):
            with fs.open(path, "rb") as stream, zipfile.ZipFile(stream) as archive:
                bad = archive.testzip()
        else:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zipfile.LargeZipFile) as err:
        raise UnreadableCheckpointError(
            f"{path!r} is truncated or corrupt ({type(err).__name__}: {err}); resume from an earlier checkpoint "
            "instead.") from err
    if bad is not None:
        raise UnreadableCheckpointError(f"{path!r} is corrupt: its record {bad!r} does not match its checksum "
                                        "(CRC-32); resume from an earlier checkpoint instead.")


def write_manifest(folder: str, files: dict[str, dict[str, Any]], header: dict[str, Any]) -> None:
    """Write ``manifest.json`` last: it marks the folder complete."""
    manifest = {**header, "files": files}
    write_bytes(json.dumps(manifest, indent=1, sort_keys=True).encode(), fs.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict[str, Any]:
    path = fs.join(folder, MANIFEST)
    if not fs.isfile(path):
        inside = sorted(name for name in fs.listdir(folder) if name.endswith(".ckpt")) if fs.isdir(folder) else []
        if inside or not fs.exists(fs.join(folder, "trainer.pt")):
            listing = f" It holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}." if inside else ""
            raise CheckpointError(f"{folder!r} is a folder, not a checkpoint (a checkpoint folder holds "
                                  f"{MANIFEST}).{listing}")
        raise UnreadableCheckpointError(
            f"{folder!r} has no {MANIFEST}: the save that wrote it did not finish (or an xtrainer older than "
            "0.2 wrote it). Resume from an earlier checkpoint instead.")
    try:
        with fs.open(path, "rb") as f:
            manifest = json.loads(f.read().decode())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not all(
                isinstance(info, dict) for info in manifest["files"].values()):
            raise ValueError("no 'files' table of {name: {size, sha256}}")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise UnreadableCheckpointError(f"The manifest {path!r} is corrupt ({err}); resume from an earlier "
                                        "checkpoint instead.") from err
    return manifest


def verify_folder(folder: str) -> dict[str, Any]:
    """Check every file the manifest lists: present, of its size, with its SHA-256. Returns the
    manifest. Raises ``UnreadableCheckpointError`` naming the first bad file."""
    manifest = read_manifest(folder)
    for name, info in sorted(manifest["files"].items()):
        file = fs.join(folder, name)
        if os.path.isabs(name) or ".." in name.split("/"):
            raise UnreadableCheckpointError(f"The manifest of {folder!r} names {name!r}, outside the folder.")
        if not fs.isfile(file):
            raise UnreadableCheckpointError(f"{file!r} is missing: the checkpoint {folder!r} is incomplete; resume "
                                            "from an earlier checkpoint instead.")
        size = fs.getsize(file)
        if size != info.get("size"):
            raise UnreadableCheckpointError(
                f"{file!r} has {size} bytes, but its manifest says {info.get('size')}: truncated or replaced. "
                "Resume from an earlier checkpoint instead.")
        if sha256_of(file) != info.get("sha256"):
            owner = f" (it belongs to rank {info['rank']})" if info.get("rank") is not None else ""
            raise UnreadableCheckpointError(
                f"{file!r}{owner} does not match its checksum in the manifest: it is corrupt, or another file was "
                "put in its place. Resume from an earlier checkpoint instead.")
    return manifest


def replace_text(path: str, text: str) -> None:
    """Write a small text file (a log's header rewrite, ``hparams.yaml``) whole or not at all: a
    temporary file beside it, synced, then renamed over ``path`` (on an object store: one object,
    which appears whole when its upload completes). An ``OSError`` is raised as it is, with
    ``path`` as it was."""
    if fs.is_url(path):
        fs.write_text(path, text)
        return
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, temp_name(os.path.basename(path)))
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)  # e.g. the disk is full: the file itself is as it was
        raise
    fsync_dir(folder)


def append(path: str, data: bytes) -> None:
    """Append ``data`` to the existing local file ``path`` in one synced ``write`` (a kill cannot
    cut it; ``fs.require_local`` refuses a URL first: an object store cannot append). If the write
    fails half-way (a full disk) the file is cut back to its size before: no part of ``data`` is
    left in it. An ``OSError`` is raised as it is."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # one write() in practice: a kill cannot cut it
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # no row half-written (a full disk): the file as it was
            raise
    finally:
        os.close(fd)


# ---- removing -----------------------------------------------------------------------------------
def remove(path: str) -> None:
    if background.behind_writes(lambda: remove(path)):
        return  # a newer checkpoint is being written in the background: removed once it is complete
    if fs.is_url(path):
        fs.remove(path)
        return
    if os.path.isdir(path) and not os.path.islink(path):
        # Renamed away first, so that a reader sees the whole folder or none of it, never a part.
        doomed = os.path.join(os.path.dirname(os.path.abspath(path)), temp_name(os.path.basename(path) + DELETED))
        try:
            os.rename(path, doomed)
        except OSError:
            doomed = path
        shutil.rmtree(doomed)
    elif os.path.lexists(path):
        os.remove(path)
