"""The persistent compilation cache: compiled graphs kept on disk, so that a restarted run (the
restart loop ``until xtrainer fit ... ckpt_path=last``) loads them instead of compiling again.

``Trainer(compilation_cache=...)`` (also ``trainer.compilation_cache`` in a configuration):

- ``None`` (default): on, under ``<runs root>/xla_cache/``, wherever the runtime can load what it
  wrote; off on the XLA CPU runtime, which cannot (below). Where the environment already names a
  cache (``XLA_PERSISTENT_CACHE_PATH``, as torch_xla's documentation suggests), under that folder,
  on every runtime.
- ``True``: on, under ``<runs root>/xla_cache/`` (the folder that holds the run's ``version_N``
  folders, so every restart of the run finds it), also on the CPU runtime.
- a path: on, under that folder (shared by several runs, or on a faster disk).
- ``False``: off.

Every folder is made absolute (a ``file://`` URL as its local path) when it is set, against the
working directory of the moment the run starts: Inductor compiles in a folder of its own, where a
relative folder names another place. A runs root on an object store (``s3://...``) holds no
cache: the default is off there (give ``compilation_cache`` a local folder to keep one).

Every process gets a folder of its own, ``rank_<k>`` for a process that runs one replica (its
global rank) or ``process_<i>`` for one that runs several (thread replicas on the CPU runtime, an
SPMD program: its process index), so that processes never write the same files at once. torch_xla
reads the setting at a process's first compilation; ``activate`` runs at the start of every
replica, before anything is compiled. A process that compiled before its run started (a test
session, a notebook's second fit with another folder) cannot switch to another cache: the health
summary says so.

The native strategies (``compile=True``) compile with torch.compile, whose Inductor keeps its own
on-disk caches: ``_activate_inductor`` points them at ``<runs root>/inductor_cache/rank_<k>``
(or the folder given) the same way, and the summary counts Inductor's cache hits.

**The XLA CPU runtime writes the cache but cannot load it.** torch_xla 2.9's
``PjRtComputationClient::DeserializeComputation`` asks the PJRT client for
``DeserializeExecutable``; the CPU client of the XLA it ships (``xla::PjRtCpuClient``) implements
only the newer ``LoadSerializedExecutable``, so ``DeserializeExecutable`` is ``PjRtClient``'s
default, ``UNIMPLEMENTED: Deserializing serialized executable not supported.``. torch_xla logs
``Failed to deserialize executable``, counts ``PersistentCacheDeserializeFailure`` and compiles
the graph again. Every lookup of a second process finds its file and fails to load it
(``tests/stories/performance/test_goodput.py`` checks exactly that), so the default leaves the cache off there. TPU
runtimes (the PJRT C API client) load serialized executables; not tried here (no TPU).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from typing import Any

from xtrainer._lazy_xla import xla as _xla
from xtrainer.checkpoint import fs
from xtrainer.strategies import shared_process
from xtrainer.trainer_view import TrainerView


_lock = threading.Lock()
#: Set with ``XLA_PERSISTENT_CACHE_PATH`` when xtrainer chose it, so that a process started from
#: this one (which inherits both) tells xtrainer's choice from the user's.
_MARK = "XTRAINER_COMPILATION_CACHE"
#: What ``activate`` did in this process: ``{"path": ..., "note": ...}``.
_state: dict[str, Any] = {}
#: The Inductor cache folders this process holds (their lock file's descriptor, ``flock``ed for the
#: process's life): a folder another live process holds is never cleaned under it.
_held: dict[str, int] = {}
#: torch.compile's (Inductor's) cache folder, for the native strategies; set with ``_INDUCTOR_MARK``
#: when xtrainer chose it, as above.
_INDUCTOR, _INDUCTOR_MARK = "TORCHINDUCTOR_CACHE_DIR", "XTRAINER_INDUCTOR_CACHE"


def absolute(path: Any) -> str:
    """``path`` as an absolute local folder (a ``file://`` URL as the path it names), against the
    working directory of now."""
    return os.path.abspath(os.path.expanduser(fs.local(os.fspath(path))))


def _default_root(runs_root: str, name: str) -> str | None:
    """``<runs root>/<name>``, absolute; None where the runs root is not a local folder."""
    root = fs.local_folder(runs_root)
    return None if root is None else absolute(os.path.join(root, name))


def _no_local_root(runs_root: str) -> str:
    return (f"off (the runs root {runs_root} is not a local folder; set compilation_cache to a local folder "
            "to keep one)")


def folder_for(setting: Any, runs_root: str) -> str | None:
    """The cache's root folder for ``setting`` (``Trainer(compilation_cache=...)``), absolute;
    None: off."""
    if setting is False:
        return None
    given = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if setting is None and given and os.environ.get(_MARK) != given:
        return absolute(given)  # the user's own, from the environment
    if setting is None and _xla.requested_device_type() == "CPU":
        return None  # the CPU runtime cannot load what it writes (module docstring)
    if setting in (None, True):
        return _default_root(runs_root, "xla_cache")
    return absolute(setting)


def process_folder(root: str, replicas_in_process: int, global_rank: int, process_index: int) -> str:
    """This process's own folder under ``root``: ranks never share one."""
    name = f"rank_{global_rank}" if replicas_in_process == 1 else f"process_{process_index}"
    return os.path.join(root, name)


def activate(trainer: "TrainerView") -> None:
    """At the start of each replica, before its first compilation: give this process its cache
    folder (or make sure it has none when the run asks for none). Host-side only."""
    _state.pop("dropped", None)
    if not trainer.strategy.runtime.compiles_with_xla:
        _activate_inductor(trainer)
        return
    root = folder_for(trainer.settings.compilation_cache, trainer.runs_root)
    with _lock:
        if root is None:
            if not _xla.compilation_cache_started():
                os.environ.pop("XLA_PERSISTENT_CACHE_PATH", None)  # inherited from a caller that had one
            setting = trainer.settings.compilation_cache
            if setting is not False and fs.local_folder(trainer.runs_root) is None and \
                    (setting is True or _xla.requested_device_type() != "CPU"):
                _state.update(path=None, note=_no_local_root(trainer.runs_root))
                return
            default_cpu = setting is None
            _state.update(path=None, note="off" + (" (the default on the CPU runtime, which cannot load cached "
                                                   "executables)" if default_cpu else ""))
            return
        # One process for the host's devices: an SPMD program, or replicas that share the process.
        shared = _xla.is_spmd() or shared_process.current().replicas() > 1
        path = process_folder(root, 2 if shared else 1, 0 if shared else _xla.global_rank(), _xla.process_index())
        current = _xla.compilation_cache_path()
        if _xla.compilation_cache_started():
            if current == path:
                _state.update(path=path, note="")
            else:
                had = f"its cache at {current}" if current else "no persistent cache"
                _state.update(path=None, note=f"not used: this process compiled graphs before the run started, "
                                              f"with {had}; start the run in a fresh process to use {path}")
            return
        _xla.initialize_compilation_cache(path)
        os.environ[_MARK] = path
        _state.update(path=path, note="")


def _activate_inductor(trainer: "TrainerView") -> None:
    """The native strategies: torch.compile's own on-disk caches (Inductor's compiled graphs,
    AOTAutograd's and the kernels) go to ``<runs root>/inductor_cache/rank_<k>`` (or the folder
    given), so that a restart on a machine with a fresh temporary folder (a preemptible VM) finds
    them. Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` at every lookup; one the user set is kept
    (made absolute: Inductor compiles in a folder of its own). ``compilation_cache=False``, or a
    runs root on an object store, leaves Inductor its default folder under the temporary folder."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a private module of torch's: where it moved, any folder set is taken as the user's
        def default_cache_dir() -> str:
            return ""

    setting = trainer.settings.compilation_cache
    given = os.environ.get(_INDUCTOR)
    with _lock:
        if given and given != os.environ.get(_INDUCTOR_MARK) and given != default_cache_dir():
            os.environ[_INDUCTOR] = given = absolute(given)  # the user's own, from the environment
            _state.update(path=given, note="", dropped=drop_incomplete_builds(given))
            return
        root = _default_root(trainer.runs_root, "inductor_cache") if setting in (None, True) else \
            None if setting is False else absolute(setting)
        if root is None:
            if given and given == os.environ.get(_INDUCTOR_MARK):  # ours, from an earlier run in this process
                os.environ.pop(_INDUCTOR, None)
            note = "off" if setting is False else _no_local_root(trainer.runs_root)
            _state.update(path=None, note=note + " (torch.compile keeps its own cache in the temporary folder)")
            return
        path = process_folder(root, 1, trainer.strategy.global_rank, 0)
        os.environ[_INDUCTOR] = os.environ[_INDUCTOR_MARK] = path
        _state.update(path=path, note="", dropped=drop_incomplete_builds(path))


def _hold(folder: str) -> bool:
    """Takes ``folder``'s lock for the life of this process (released when it ends, however it
    ends); False where another live process holds it (two runs at once into one root)."""
    if folder in _held:
        return True
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, ".xtrainer-lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held[folder] = fd
    return True


def _complete_elf(path: str) -> bool:
    """Whether the object file or shared library at ``path`` holds every byte its ELF header
    promises (its program and section header tables: a linker writes the section table last). A
    file of another kind is taken as complete."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return True  # gone meanwhile, or unreadable: Inductor's own error names it
    if len(head) < 64 or head[:4] != b"\x7fELF":
        return False  # a compiler killed before it wrote the header
    if head[4] != 2:
        return True  # not ELF64: not checked
    order = "<" if head[5] == 1 else ">"
    (phoff, shoff), (phentsize, phnum, shentsize, shnum) = (struct.unpack_from(order + "QQ", head, 32),
                                                            struct.unpack_from(order + "HHHH", head, 54))
    return phoff + phentsize * phnum <= size and shoff + shentsize * shnum <= size


def drop_incomplete_builds(folder: str) -> int:
    """Removes the compiled kernels (``.o``, ``.so``) in Inductor's cache ``folder`` that a
    process killed while its C++ compiler wrote them left incomplete, so that Inductor builds them
    again (it takes any such file that exists for a finished build and fails to load a truncated
    one; its sources, graphs and wrapper modules it writes whole, by rename). Skipped where another
    live process holds the folder. Host-side, before this process compiles; returns the count."""
    if not os.path.isdir(folder) or not _hold(folder):
        return 0
    dropped = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith((".o", ".so")) and not _complete_elf(path):
                try:
                    os.remove(path)
                    dropped += 1
                except OSError:
                    pass
    return dropped


def inductor_counts() -> dict[str, int]:
    """Inductor's cache lookups in this process so far: graphs loaded from its cache (``hits``)
    and compiled (``misses``); nothing found unloadable is counted apart (``unloadable``: 0)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"]),
            "unloadable": 0}


def describe(before: dict[str, int], after: dict[str, int]) -> tuple[dict[str, Any], str]:
    """The cache's figures between two ``_xla.persistent_cache_counts()`` and one sentence for
    the summary, which says plainly when nothing was loaded from it."""
    counts = {k: after[k] - before.get(k, 0) for k in after}
    path = _state.get("path")
    figures = {"compilation_cache": path, **{f"cache_{k}": v for k, v in counts.items()}}
    if path is None:
        note = _state.get("note", "off")
        return figures, f"compilation cache {note}"
    hits, misses, unloadable = counts["hits"], counts["misses"], counts["unloadable"]
    lookups = hits + misses + unloadable
    dropped = _state.get("dropped") or 0
    left = (f"; {dropped} incomplete compiled files (a process killed while compiling) removed and built again"
            if dropped else "")
    if not lookups:
        return figures, f"compilation cache {path}: nothing was compiled in this fit{left}"
    text = f"compilation cache {path}: {hits} of {lookups} graphs loaded{left}"
    if unloadable:
        text += (f"; {unloadable} found but NOT loadable (compiled again: "
                 + ("the XLA CPU runtime cannot load cached executables)" if _xla.requested_device_type() == "CPU"
                    else "written by another torch_xla, libtpu or chip?)"))
    if lookups and not hits:
        text += "; the cache did NOT hit" + ("" if unloadable else " (a first run fills it; a restart should hit)")
    return figures, text
