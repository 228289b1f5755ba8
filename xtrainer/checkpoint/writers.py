"""Which process wrote something, and whether it still runs: the names of temporary files and
staging folders (``storage.temp_name``) and of the launchers' private folders carry the writer's
*instance*, not its PID alone, so that what a dead writer left can be told and removed.

A PID is not a process: a container's training process is PID 1 on every restart, and PIDs are
reused after a reboot. An instance is ``<pid>.<start>x<boot>``: the PID, the process's start
time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot) and the first characters of the
boot id (``/proc/sys/kernel/random/boot_id``). A name whose PID runs but started at another time,
or in another boot, is a dead writer's. Where ``/proc`` cannot be read (not Linux) the instance is
``<pid>.r<random>``: drawn once per process, so a name of this PID with another draw is a dead
writer's, and another PID is judged by whether it runs. A bare ``<pid>`` (names of older
versions) is judged by whether that PID runs, except this process's own PID: this process names
by instance, so such a name is a dead writer's.
"""

from __future__ import annotations

import os
import re
import uuid

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_BOOT_CHARS = 8
_INSTANCE = re.compile(r"^(\d+)(?:\.(?:(\d+)x([0-9a-f]+)|r([0-9a-f]+)))?$")
_mine: tuple[int, str] | None = None  # (pid, instance): recomputed in a forked child


def _boot() -> str | None:
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip().replace("-", "").lower()
    except (OSError, UnicodeDecodeError):
        return None
    return boot[:_BOOT_CHARS] if re.fullmatch(r"[0-9a-f]+", boot) else None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        # the command name (field 2) is in parentheses and may hold spaces: count after its end
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def instance() -> str:
    """This process's instance: what names its temporary files and folders."""
    global _mine
    pid = os.getpid()
    if _mine is None or _mine[0] != pid:
        start, boot = start_time(pid), _boot()
        _mine = (pid, f"{pid}.{start}x{boot}" if start is not None and boot is not None
                 else f"{pid}.r{uuid.uuid4().hex[:12]}")
    return _mine[1]


def is_instance(text: str) -> bool:
    """Whether ``text`` names a writer: an instance, or a bare PID (older names)."""
    return _INSTANCE.match(text) is not None


def alive(text: str) -> bool:
    """Whether the writer ``text`` (an instance, or a bare PID) may still run on this host: False
    only when it is certainly gone. Text that names no writer counts as alive (it is left alone)."""
    found = _INSTANCE.match(text)
    if found is None:
        return True
    pid, start, boot = int(found.group(1)), found.group(2), found.group(3)
    if text == instance():
        return True
    if pid == os.getpid():  # this PID is this process: whoever wrote under it before is gone
        return False
    if start is not None:
        now = _boot()
        if now is not None and boot != now:  # written before the machine restarted
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's process: it runs
    if start is not None:
        started = start_time(pid)
        if started is not None:
            return started == int(start)
    return True  # that PID runs (a drawn instance, or its start time cannot be read): it may be the writer
