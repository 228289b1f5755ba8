"""Paths that are local or fsspec URLs (``s3://``, ``gs://``, ``memory://``, any fsspec protocol).

A ``file://`` URL (fsspec's local filesystem, also ``local://``) is a local path: ``local`` turns
it into one where a path is taken (``default_root_dir``, a logger's ``save_dir``, ``ckpt_path``,
``ModelCheckpoint(dirpath=...)``, a checkpoint's path, the compilation cache), so it gets the
local code path below.

A local path keeps the code path it has always had (``os`` calls, atomic renames, fsync): every
function here hands a local path to ``os`` / ``os.path`` unchanged. A URL goes through fsspec,
which is an optional extra: ``pip install 'xtrainer[cloud]'`` for fsspec itself, ``[s3]`` for
``s3://`` (s3fs), ``[gcs]`` for ``gs://`` (gcsfs; untested against GCS here). A missing client
is a ``MissingExtraError`` that names the extra.

What an object store gives and does not (S3, GCS): no rename and no folders, but an object
appears whole when its upload completes (a killed upload leaves no object, or the previous one).
So on an object store a checkpoint is written under its final name, and a sharded checkpoint's
``manifest.json`` is written last: a folder without a manifest that verifies is not a checkpoint.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import socket
import uuid
from typing import IO, Any

from xtrainer.checkpoint.format import CheckpointError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")  # two letters at least: never a drive (C:)
#: the extra that installs the client of a protocol
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class MissingExtraError(CheckpointError, ImportError):
    """A URL's fsspec client is not installed; the message names the extra to install (the CLI
    shows it as one line, as every ``CheckpointError``)."""


_LOCAL_URL = re.compile(r"^(?:file|local)://(?:localhost(?=/))?", re.IGNORECASE)


def local(path: Any) -> Any:
    """``path`` with a ``file://`` (or ``local://``) URL as the local path it names:
    ``file:///data/runs`` and ``file://localhost/data/runs`` are ``/data/runs``, ``file://runs``
    is ``runs`` (relative, as fsspec reads it). Any other path or URL is returned unchanged
    (a ``PathLike`` as its string)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        return path
    match = _LOCAL_URL.match(path)
    return path[match.end():] or "." if match else path


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and bool(_URL.match(path))


def local_folder(path: Any) -> str | None:
    """The local folder ``path`` names (a ``file://`` URL as its path), or None where it is a URL
    of another filesystem (an object store has no local folder: a compilation cache, say, cannot
    go there)."""
    path = local(path)
    return None if is_url(path) else path


def absolute(path: Any) -> str:
    """A folder as a run keeps it: a local one (a ``file://`` URL's too) with ``~`` expanded,
    absolute and its links resolved, as Lightning resolves a ``ModelCheckpoint``'s ``dirpath``; a
    URL as it is."""
    path = local(path)
    return path if is_url(path) else os.path.realpath(os.path.expanduser(path))


def within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it: local paths with their links resolved,
    URLs normalised (``normpath``)."""
    path, folder = ((normpath(p) if is_url(p) else os.path.realpath(p)) for p in (path, folder))
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def require_local(path: str, message: str) -> None:
    """Refuse a URL where only a local file will do (one appended to, or renamed: an object store
    has neither): ``ValueError(message)``, with ``{path}`` in it replaced by ``path`` as a repr."""
    if is_url(path):
        raise ValueError(message.replace("{path}", repr(path)))


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it."""
    scheme = protocol(url)
    extra = _EXTRAS.get(scheme, "cloud")
    try:
        import fsspec
    except ImportError:
        raise MissingExtraError(f"{url!r} is a URL, which needs fsspec: pip install 'xtrainer[{extra}]'") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        raise MissingExtraError(f"{url!r} needs the fsspec client of {scheme}:// ({err}): pip install "
                                f"'xtrainer[{extra}]'") from None
    except ValueError as err:
        if "protocol" in str(err).lower():
            raise MissingExtraError(f"{url!r}: fsspec knows no filesystem for {scheme}:// ({err}).") from None
        raise


def require(path: str) -> None:
    """Fail early, naming the extra, when ``path`` is a URL whose client is missing."""
    if is_url(path):
        filesystem(path)


def _fresh(path: str) -> tuple[Any, str]:
    """``filesystem(path)`` with what its client cached about ``path`` forgotten: another process
    (the replicas', a killed run) may have written there since."""
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    return fs, p


# ---- names -------------------------------------------------------------------------------------
def join(path: str, *parts: str) -> str:
    if is_url(path):
        return posixpath.join(path, *parts)
    return os.path.join(path, *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


def normpath(path: str) -> str:
    """``os.path.normpath`` of a local path; of the part after ``scheme://`` of a URL."""
    if not is_url(path):
        return os.path.normpath(path)
    scheme, rest = path.split("://", 1)
    rest = posixpath.normpath(rest) if rest else rest
    return f"{scheme}://{'' if rest == '.' else rest}"


def normalize(path: str) -> str:
    """``os.path.abspath`` for a local path; a URL without a trailing slash."""
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def inside(path: str, folder: str) -> bool:
    """Whether ``path`` lies inside ``folder`` (links resolved for local paths)."""
    if is_url(folder) or is_url(path):
        return is_url(path) and normpath(path).startswith(normpath(folder).rstrip("/") + "/")
    top = os.path.realpath(folder)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    return parent == top or parent.startswith(top + os.sep)


# ---- what is there -----------------------------------------------------------------------------
def lexists(path: str) -> bool:
    """Whether anything, a dangling link included, is at ``path``."""
    return exists(path) if is_url(path) else os.path.lexists(path)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fresh(path)
    return fs.exists(p)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = _fresh(path)
    return fs.isfile(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _fresh(path)
    return fs.isdir(p)


def listdir(path: str) -> list[str]:
    """The names in folder ``path`` (``[]`` for an object-store prefix with nothing under it)."""
    if not is_url(path):
        return os.listdir(path)
    fs, p = filesystem(path)
    fs.invalidate_cache(p)  # another process (a killed run) may have written here
    try:
        entries = fs.ls(p, detail=False)
    except FileNotFoundError:
        return []
    own = p.rstrip("/")
    try:  # an S3 folder marker ("prefix/") lists as the folder itself
        return [posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != own]
    except FileNotFoundError:
        return []


def getsize(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = filesystem(path)
    return int(fs.size(p))


def mtime(path: str) -> float:
    if not is_url(path):
        return os.path.getmtime(path)
    fs, p = filesystem(path)
    return fs.modified(p).timestamp()


def write_text(path: str, text: str) -> None:
    """Write a small text object whole (an object store shows it when the upload completes)."""
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))


#: On an object store, the object whose exclusive creation claims a folder (``claim_folder``).
CLAIM_FILE = ".xtrainer-claim"


class FileInTheWay(NotADirectoryError):
    """A file stands where ``make_folder`` was to make a folder."""


def make_folder(path: str) -> None:
    """Make the folder ``path`` and its parents unless they exist. An object store has no folders
    to make: a URL is only checked for its client (``require``). A file at ``path`` is a
    ``FileInTheWay``; what ``os.makedirs`` cannot do its ``OSError``."""
    if is_url(path):
        require(path)
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileInTheWay(f"{path!r} is a file, not a folder")
    os.makedirs(path, exist_ok=True)


def claim_folder(path: str) -> bool:
    """Create the folder ``path`` unless it exists; whether this call created it (two processes
    claiming one at the same moment: only one gets True). A local folder is made with
    ``os.mkdir``; on an object store, which has no folders, the claim is the exclusive creation of
    ``path/CLAIM_FILE`` (``claim``), holding this host, process and a random token. Other
    failures (no such bucket, no permission) raise their ``OSError``."""
    if is_url(path):
        return claim(join(path, CLAIM_FILE), f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}")
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    return True


def write_text_into(folder: str, name: str, text: str) -> str:
    """Write the small text file ``name`` whole into ``folder`` (made first where it is local: an
    object store has no folders); returns its path."""
    if not is_url(folder):
        os.makedirs(folder, exist_ok=True)
    path = join(folder, name)
    write_text(path, text)
    return path


def claim(path: str, token: str) -> bool:
    """Create the object ``path`` holding ``token`` unless it exists; whether this call created
    it. Exclusive create (``mode="xb"``) where the backend has it (memory; S3 through s3fs with
    a conditional put, If-None-Match); then read back, which catches a backend that ignored it
    only when the other writer's upload finished before the read."""
    fs_, p = filesystem(path)
    try:
        with fs_.open(p, "xb") as f:
            f.write(token.encode())
    except FileExistsError:
        return False
    except (ValueError, NotImplementedError):  # no exclusive create: check, write, read back
        if fs_.exists(p):
            return False
        with fs_.open(p, "wb") as f:
            f.write(token.encode())
    fs_.invalidate_cache(posixpath.dirname(p))
    with fs_.open(p, "rb") as f:
        return f.read().decode(errors="replace") == token


# ---- writing -----------------------------------------------------------------------------------
def makedirs(path: str) -> None:
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    fs, p = filesystem(path)
    fs.makedirs(p, exist_ok=True)  # object stores have no folders: usually nothing to do


def open(path: str, mode: str = "rb") -> IO[Any]:  # the fsspec name
    if not is_url(path):
        import builtins

        return builtins.open(path, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)


def abandon(stream: Any) -> None:
    """Give up an upload that failed half-way, without completing it (closing an fsspec file
    would upload what was written so far under the final name, over the previous object):
    s3fs aborts its multipart upload. ``memory://`` shows partial writes whatever is done."""
    if stream is None:
        return
    try:
        stream.discard()
    except Exception:  # noqa: BLE001 - best effort: the upload is abandoned either way
        pass
    try:
        stream.closed = True  # fsspec's buffered files: close() would flush and commit
    except AttributeError:
        pass


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def remove(path: str) -> None:
    """Remove a file or a folder (everything under a prefix); nothing if it is not there."""
    if not is_url(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        return
    fs, p = filesystem(path)
    if fs.isdir(p):
        fs.rm(p, recursive=True)
    elif fs.exists(p):
        fs.rm(p)
    fs.invalidate_cache(posixpath.dirname(p))


def copy(source: str, target: str) -> None:
    """Copy one object within a filesystem (server-side on object stores)."""
    fs, s = filesystem(source)
    _, t = filesystem(target)
    fs.copy(s, t)
