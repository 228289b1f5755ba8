"""Reading checkpoint files without running code from them.

Every checkpoint xtrainer reads goes through here: ``torch.load(weights_only=True)`` for the
files xtrainer writes with ``torch.save`` (no globals beyond torch's own tensor and dtype
rebuilders are allowed), and a restricted unpickler for the one pickle that
``torch.distributed.checkpoint`` writes itself (``.metadata``), which admits only that module's
metadata classes. A file that needs anything else is refused with a ``CheckpointError`` that
names the file and the type; nothing in it runs.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from typing import IO, Any

import torch

from xtrainer.checkpoint import fs
from xtrainer.checkpoint.format import CheckpointError, UnreadableCheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code (it names a function or class outside the allowlist)."""


def load(source: str | IO[bytes], what: str, mmap: bool = False) -> Any:
    """``torch.load`` a file xtrainer wrote, with ``weights_only=True`` and errors that name it."""
    name = source if isinstance(source, str) else getattr(source, "name", what)
    try:
        if isinstance(source, str) and fs.is_url(source):  # read whole, then loaded from memory
            source, mmap = io.BytesIO(fs.read_bytes(source)), False
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "unsupported global" in str(err).lower() or "weights only load failed" in str(err).lower():
            raise UnsafeCheckpointError(
                f"The {what} {name!r} was refused: it names {_global_in(str(err))}, which loading would run or "
                "build. xtrainer checkpoints hold plain data only; this file was not written by xtrainer, or "
                "was tampered with. Nothing in it was executed.") from None
        raise _unreadable(what, name, err) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError, IndexError) as err:
        raise _unreadable(what, name, err) from err


def _unreadable(what: str, name: str, err: BaseException) -> UnreadableCheckpointError:
    return UnreadableCheckpointError(f"The {what} {name!r} could not be read ({type(err).__name__}: "
                                     f"{_first_line(err)}). It is corrupt or truncated; resume from an earlier "
                                     "checkpoint instead.")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""


def _global_in(message: str) -> str:
    """The global a weights-only load refused, from torch's message."""
    for marker in ("Unsupported global: GLOBAL ", "unsupported GLOBAL ", "Unsupported global "):
        if marker in message:
            return message.split(marker, 1)[1].split()[0].rstrip(".,")
    return "a type outside the allowlist"


# ---- torch.distributed.checkpoint's own pickles ------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_NAMES = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("torch.serialization", "_get_layout")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``torch.distributed.checkpoint`` metadata: its own dataclasses and enums, torch's
    dtypes, layouts and memory formats, sizes and paths; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and not name.startswith("__"):
            value = super().find_class(module, name)
            # its own dataclasses and enums only (not what it imports, such as torch.Tensor)
            if isinstance(value, type) and value.__module__ == module:
                return value
        elif (module, name) in _DCP_NAMES:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{module}.{name}")


def load_dcp_metadata(stream: IO[bytes], path: str) -> Any:
    """Read a ``torch.distributed.checkpoint`` ``.metadata`` pickle with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise ValueError(f"it holds a {type(metadata).__name__}, not torch.distributed.checkpoint metadata")
        return metadata
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(
            f"The checkpoint metadata {path!r} was refused: it names {err}, which loading would run or build. "
            "Nothing in it was executed.") from None
    except Exception as err:  # noqa: BLE001 - whatever a malformed pickle raises, it is unreadable
        raise UnreadableCheckpointError(f"The checkpoint metadata {path!r} could not be read ({type(err).__name__}: "
                                        f"{_first_line(err)}); resume from an earlier checkpoint instead.") from err


def load_bytes(value: io.BytesIO) -> Any:
    """A non-tensor value of a distributed checkpoint (``torch.save``'d by its writer)."""
    return load(value, "distributed checkpoint entry")


def dcp_reader(folder: str) -> Any:
    """A ``torch.distributed.checkpoint`` reader of ``folder`` whose metadata is read with the
    restricted unpickler (torch's own reader unpickles it with plain ``pickle``); its fsspec
    reader for a URL."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    base = dcp.FileSystemReader
    if fs.is_url(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as base

        fs.require(folder)

    class _SafeReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_dcp_metadata(stream, os.fspath(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(folder)


def safe_load_planner(planner: Any) -> Any:
    """``planner`` with its non-tensor values read weights-only (torch's default load planner reads
    them with ``weights_only=False``)."""
    base = type(planner)

    class _SafeLoadPlanner(base):  # type: ignore[misc, valid-type]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            loaded, fqn = load_bytes(value), read_item.dest_index.fqn
            mappings = getattr(self, "mappings", None)
            if mappings and fqn in mappings and getattr(self, "flatten_state_dict", True):
                set_element(self.original_state_dict, mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    planner.__class__ = _SafeLoadPlanner
    return planner
