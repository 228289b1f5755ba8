"""The hang watchdog's monitor: a small process of its own beside each training process.

Started by ``launch/watchdog.py`` with ``python -I -S hang_monitor.py ...``, it imports the
standard library only (no xtrainer, no torch). It watches every replica of its training process
through shared memory: per replica, a slot of two counters the training process keeps current,
training batches finished (the fit loop stores its count after each batch) and other progress
(validation batches, checkpoint saves). Nothing else crosses: the training process is never
asked anything while it makes progress, and it runs no thread for the watchdog.

When a replica has not finished a training batch for its limit (``limit``), the monitor asks the
training process for every thread's Python stack: a signal (``faulthandler``'s, registered by the
training process) makes the process write them into a file shared with the monitor, in C, so this
works wherever the process is stuck, inside a C call holding the GIL included. The report goes to
stderr and to ``hang-<time>-pid<pid>.txt`` in the replica's run folder. With ``exit_on_hang`` the
monitor then ends the process: a second signal whose handler calls ``os._exit(EXIT_CODE)``, where
the process can still run Python (its main thread installed the handler); where it cannot within
``GRACE`` seconds, or installed none, SIGKILL.

The control channel is a pipe from the training process: one JSON line per replica joining or
leaving. Its end (the training process gone, however it ended) or a new parent ends the monitor.
SIGINT and SIGTERM are ignored: a terminal's Ctrl-C and a group's SIGTERM are the training
process's to handle, and the monitor keeps watching while it saves.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import mmap
import os
import select
import signal
import statistics
import sys
import time
from typing import Any

#: Exit code of a process ended by the watchdog (``exit_on_hang=True``) where it could still run
#: Python: EX_TEMPFAIL, "try again".
EXIT_CODE = 75
#: ``"auto"``: the limit before ``WARM_STEPS`` steps have finished (they compile; big models on
#: TPU pods take tens of minutes), then a multiple of the median step time with a floor.
STARTUP_LIMIT, WARM_STEPS, STEP_MULTIPLE, FLOOR = 3600.0, 3, 20.0, 300.0
#: Replicas one training process can hold at once, and the counters of each (int64).
SLOTS, SLOT_WORDS = 256, 2
MEMORY_BYTES = SLOTS * SLOT_WORDS * 8
#: Seconds given to the stack dump, and to a process asked to exit before it is killed.
DUMP_WAIT, GRACE = 5.0, 5.0
#: The longest sleep between two looks (the parent's end is also seen at once, by the pipe's end).
MAX_PERIOD = 1.0


class RunHung(RuntimeError):
    """Raised where a replicas' process that the watchdog ended (``exit_on_hang``) is waited for;
    the ``xtrainer`` command exits with ``EXIT_CODE`` for it, as the ended process did."""

    exit_code = EXIT_CODE


def limit(timeout: float | str, intervals: list[float], steps: int) -> float:
    """Seconds without a finished step after which the watchdog fires: ``timeout`` seconds, or
    for ``"auto"`` ``STARTUP_LIMIT`` until ``WARM_STEPS`` steps have finished, then
    ``STEP_MULTIPLE`` times the median time between finished steps, never less than ``FLOOR``."""
    if timeout != "auto":
        return float(timeout)
    if steps < WARM_STEPS or not intervals:
        return STARTUP_LIMIT
    return max(FLOOR, STEP_MULTIPLE * statistics.median(intervals))


class Watch:
    """One replica's record: ``counters`` is its slot (training batches finished, other progress)."""

    def __init__(self, counters: Any, timeout: float | str = "auto", exit_on_hang: bool = False,
                 folder: str | None = None, now: float | None = None) -> None:
        self.counters, self.timeout, self.exit_on_hang, self.folder = counters, timeout, exit_on_hang, folder
        self.last = time.monotonic() if now is None else now  # the last progress seen
        self.done, self.other, self.seen_at = counters[0], counters[1], self.last  # as last read, and when
        self.steps = 0  # batches finished since the watch began
        self.intervals: collections.deque[float] = collections.deque(maxlen=200)
        self.fired = False

    def read(self, now: float) -> None:
        """The progress since the last reading: finished batches give one estimate of the time
        between two of them (the mean over the readings' interval); other progress only counts."""
        done, other = self.counters[0], self.counters[1]
        if done != self.done:
            if done > self.done:
                self.intervals.append((now - self.seen_at) / (done - self.done))
                self.steps += done - self.done
            self.done, self.seen_at = done, now
            self.last, self.fired = now, False
        if other != self.other:
            self.other, self.last, self.fired = other, now, False

    def limit(self) -> float:
        return limit(self.timeout, list(self.intervals), self.steps)


class Monitor:
    """The monitor of the training process ``pid``."""

    def __init__(self, pid: int, control: int, memory: int, stacks: int, stacks_signal: int,
                 exit_signal: int) -> None:
        self.pid, self.control, self.stacks = pid, control, stacks
        self.stacks_signal, self.exit_signal = stacks_signal, exit_signal
        self.words = memoryview(mmap.mmap(memory, MEMORY_BYTES)).cast("q")
        self.watches: dict[int, Watch] = {}
        self.pending = b""

    def run(self) -> None:
        period = MAX_PERIOD
        while True:
            ready, _, _ = select.select([self.control], [], [], period)
            if ready and not self.receive():
                return  # the training process closed its end, or is gone
            if os.getppid() != self.pid:
                return
            period = MAX_PERIOD
            now = time.monotonic()
            due = []
            for watch in self.watches.values():
                watch.read(now)
                lim = watch.limit()
                period = min(period, max(lim / 8, 0.05))
                idle = now - watch.last
                if idle >= lim and not watch.fired:
                    watch.fired = True
                    due.append((watch, idle, lim))
            if due:
                self.fire(due)

    def receive(self) -> bool:
        """Join and leave messages; False at the pipe's end."""
        data = os.read(self.control, 65536)
        if not data:
            return False
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            message = json.loads(line)
            slot = message["slot"]
            if message["op"] == "join":
                counters = self.words[slot * SLOT_WORDS:(slot + 1) * SLOT_WORDS]
                self.watches[slot] = Watch(counters, message["timeout"], message["exit_on_hang"], message["folder"])
            else:
                self.watches.pop(slot, None)
        return True

    def fire(self, due: list[tuple[Watch, float, float]]) -> None:
        """Replicas past their limit: the process's stacks, one report per replica (one file per
        run folder), then the end of the process if any of them asked for it."""
        stacks = self.dump_stacks()
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for watch, idle, lim in due:
            report = (f"xtrainer: no training step finished for {idle:.0f} s (limit {lim:.0f} s, "
                      f"hang_timeout={watch.timeout!r}). Python stacks of every thread of process {self.pid} "
                      f"(innermost call first):\n\n{stacks}")
            folder = watch.folder or os.getcwd()
            path = os.path.join(folder, f"hang-{stamp}-pid{self.pid}.txt")
            try:
                os.makedirs(folder, exist_ok=True)
                with open(path, "w") as f:
                    f.write(report)
                where = f"written to {path}"
            except OSError as err:
                where = f"not written to {path} ({err})"
            say(report + f"\n(stacks {where})")
        if any(watch.exit_on_hang for watch, _, _ in due):
            self.end_process()

    def dump_stacks(self) -> str:
        """Every thread's Python stack, as the training process's ``faulthandler`` writes them
        into the shared file on the signal (in C: it answers wherever the process is stuck)."""
        os.ftruncate(self.stacks, 0)
        os.lseek(self.stacks, 0, os.SEEK_SET)  # the offset is shared with the training process
        try:
            os.kill(self.pid, self.stacks_signal)
        except OSError as err:
            return f"(the stacks could not be asked for: {err})\n"
        deadline, size, steady = time.monotonic() + DUMP_WAIT, -1, 0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = os.fstat(self.stacks).st_size
            steady = steady + 1 if now == size and now > 0 else 0
            size = now
            if steady >= 2:
                break
        text = os.pread(self.stacks, max(size, 0), 0).decode("utf-8", "replace")
        return text or f"(process {self.pid} wrote no stacks within {DUMP_WAIT:.0f} s of the signal)\n"

    def end_process(self) -> None:
        """``exit_on_hang``: ``os._exit(EXIT_CODE)`` in the process where it can run Python, else
        SIGKILL."""
        if self.exit_signal and self.signal(self.exit_signal):
            say(f"xtrainer: the run looks hung; ending process {self.pid} with exit code {EXIT_CODE} "
                "(exit_on_hang=True) so that a restart loop resumes it from its last checkpoint.")
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline:
                if os.getppid() != self.pid:
                    return  # it ended
                time.sleep(0.05)
            how = f"it did not end within {GRACE:.0f} s (stuck where Python cannot run)"
        else:
            how = "it has no handler to end it from inside (its fit did not start on its main thread)"
        say(f"xtrainer: the run looks hung and {how}; killing process {self.pid} (SIGKILL, exit_on_hang=True) "
            "so that a restart loop resumes it from its last checkpoint.")
        self.signal(signal.SIGKILL)

    def signal(self, signum: int) -> bool:
        try:
            os.kill(self.pid, signum)
            return True
        except OSError:
            return False


def say(text: str) -> None:
    """To the stderr the monitor shares with its training process (a closed one loses only this)."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid, control, memory, stacks, stacks_signal, exit_signal = map(int, argv)
    if os.getppid() != pid:
        return  # the training process ended before its monitor started
    Monitor(pid, control, memory, stacks, stacks_signal, exit_signal).run()


if __name__ == "__main__":
    main(sys.argv[1:])
