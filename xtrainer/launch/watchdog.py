"""The hang watchdog: a run that stops making progress says where it is stuck, and can end.

A TPU pod that hangs (a replica waiting in a collective for a peer that died, a data loader
stuck on a remote file, a deadlock in user code) burns its reservation without a word. Here,
when no training step finishes within a limit, every thread's Python stack goes to the log
(stderr) and to ``hang-<time>-pid<pid>.txt`` in the run folder; with ``exit_on_hang=True`` the
process then ends, with exit code ``EXIT_CODE`` (75) where it can still run Python and by SIGKILL
where it cannot, so the restart loop (``until xtrainer fit ... ckpt_path=last; do :; done``)
starts the run again from its last checkpoint instead of waiting for hours.

The limit (``Trainer(hang_timeout=...)``): seconds, or ``"auto"`` (default): until a few steps
have finished (the first ones compile), ``STARTUP_LIMIT``; then ``STEP_MULTIPLE`` times the
median time between finished steps, never less than ``FLOOR``. ``None`` switches it off.

The watching is done by a small monitor process beside the training process
(``launch/hang_monitor.py``, standard library only), not by a thread inside it: a thread would
keep watching only while the stuck call lets go of the GIL, and any second thread makes every
allocation and GIL hand-over of the training process take glibc's thread-safe paths (about 1% of
a small model's step on the CPU). The training process shares one slot of counters per replica
with it: the fit loop stores its count of finished training batches after each batch (one store
in shared memory, ``LoopState.progress``); validation batches and checkpoint saves count as
progress too. Stacks are written by ``faulthandler`` on the monitor's signal, so a process stuck
in C, holding the GIL or not, still says where. Nothing syncs the device.

The monitor starts with the first replica's fit in the process and ends when the last one
leaves; it also ends when the training process does, however that ends. Where it cannot start
(no subprocess allowed, no ``faulthandler.register``: Windows), the run goes on without a
watchdog after a warning.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import TYPE_CHECKING, Any

from xtrainer.callbacks.base import Callback
from xtrainer.launch import hang_monitor
from xtrainer.launch.hang_monitor import EXIT_CODE, FLOOR, STARTUP_LIMIT, STEP_MULTIPLE, WARM_STEPS  # noqa: F401
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule

#: The signals the monitor sends: every thread's stacks (``faulthandler``), and the end of the
#: process (``exit_on_hang``). Real-time signals nothing else uses; SIGUSR2 where there are none.
_RTMIN = getattr(signal, "SIGRTMIN", None)
STACKS_SIGNAL = _RTMIN + 6 if _RTMIN is not None else signal.SIGUSR2
EXIT_SIGNAL = _RTMIN + 7 if _RTMIN is not None else None


class HangWatchdog(Callback):
    """Watches that training steps keep finishing (added by the Trainer: ``hang_timeout``,
    ``exit_on_hang``)."""

    def __init__(self, timeout: float | str = "auto", exit_on_hang: bool = False) -> None:
        if not (timeout == "auto" or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                      and timeout > 0)):
            raise ValueError(f"HangWatchdog(timeout={timeout!r}): give seconds or 'auto'.")
        self.timeout, self.exit_on_hang = timeout, exit_on_hang

    # ---- the replica's side: host clock readings only ---------------------------------------
    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self._folder = trainer.log_dir
        _monitor.join(self, trainer.loop)

    def on_validation_batch_end(self, trainer: "TrainerView", module: "XModule", *args: Any) -> None:
        _monitor.beat(self)

    def on_save_checkpoint(self, trainer: "TrainerView", module: "XModule", checkpoint: dict[str, Any]) -> None:
        _monitor.beat(self)

    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        _monitor.beat(self)

    def teardown(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        _monitor.leave(self)

    # ---- the limit --------------------------------------------------------------------------
    def limit(self, intervals: list[float], steps: int) -> float:
        """Seconds without a finished step after which the watchdog fires (``hang_monitor.limit``)."""
        return hang_monitor.limit(self.timeout, intervals, steps)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_folder"}


class _Monitor:
    """The training process's side of its monitor process: the shared counters, the control pipe,
    the stacks file and the signal handlers, for every replica the process runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, tuple[int, Any]] = {}  # id(owner) -> (slot, the replica's LoopState)
        self._process: subprocess.Popen | None = None
        self._pid = 0  # the process that started the monitor (a forked child has none of its own)
        self._words: memoryview | None = None
        self._control = -1
        self._stacks: Any = None
        self._exit_handler: tuple[Any] | None = None  # EXIT_SIGNAL's handler before, where this installed one

    def join(self, owner: HangWatchdog, loop: Any) -> None:
        with self._lock:
            if self._process is None or self._pid != os.getpid():
                self._forget()
                try:
                    self._start()
                except (OSError, ValueError, AttributeError, RuntimeError) as err:
                    self._stop()
                    warnings.warn(f"xtrainer: the hang watchdog could not start its monitor process ({err}); "
                                  "the run goes on without it (hang_timeout=None silences this).", stacklevel=2)
                    return
            taken = {slot for slot, _ in self._slots.values()}
            slot = next(i for i in range(hang_monitor.SLOTS) if i not in taken)
            counters = self._words[slot * hang_monitor.SLOT_WORDS:(slot + 1) * hang_monitor.SLOT_WORDS]
            counters[1] = 0
            self._slots[id(owner)] = (slot, loop)
            loop.report_progress(counters[0:1])  # the loop stores its batches there from now on
            self._send({"op": "join", "slot": slot, "timeout": owner.timeout, "exit_on_hang": owner.exit_on_hang,
                        "folder": getattr(owner, "_folder", None) or os.getcwd()})

    def leave(self, owner: HangWatchdog) -> None:
        with self._lock:
            entry = self._slots.pop(id(owner), None)
            if entry is None:
                return
            slot, loop = entry
            loop.report_progress(None)
            if self._pid == os.getpid():
                self._send({"op": "leave", "slot": slot})
                if not self._slots:
                    self._stop()

    def beat(self, owner: HangWatchdog) -> None:
        """Progress that is not a training step (a validation batch, a save)."""
        entry = self._slots.get(id(owner))
        if entry is not None and self._words is not None:
            self._words[entry[0] * hang_monitor.SLOT_WORDS + 1] += 1

    # ---- the monitor process ----------------------------------------------------------------
    def _start(self) -> None:
        if not hasattr(faulthandler, "register"):
            raise RuntimeError("this platform has no faulthandler.register")
        if not sys.executable:
            raise RuntimeError("no Python executable to start it with (sys.executable is empty)")
        memory, read = _anonymous_file("xtrainer-hang-counters"), -1
        try:
            os.write(memory, bytes(hang_monitor.MEMORY_BYTES))  # allocated now: no fault on a full disk later
            self._words = memoryview(mmap.mmap(memory, hang_monitor.MEMORY_BYTES)).cast("q")
            self._stacks = open(_anonymous_file("xtrainer-hang-stacks"), "wb", buffering=0)
            stacks = self._stacks.fileno()
            faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)
            exit_signal = 0
            if EXIT_SIGNAL is not None and threading.current_thread() is threading.main_thread():
                self._exit_handler = (signal.signal(EXIT_SIGNAL, _exit_on_hang),)
                exit_signal = EXIT_SIGNAL
            elif EXIT_SIGNAL is not None and signal.getsignal(EXIT_SIGNAL) is _exit_on_hang:
                exit_signal = EXIT_SIGNAL  # this process's main thread takes it (``end_here_on_hang``)
            read, self._control = os.pipe()
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", hang_monitor.__file__, str(os.getpid()), str(read), str(memory),
                 str(stacks), str(STACKS_SIGNAL), str(exit_signal)],
                pass_fds=(read, memory, stacks), stdin=subprocess.DEVNULL, close_fds=True)
        finally:  # mapped, and the monitor has descriptors of its own
            os.close(memory)
            if read >= 0:
                os.close(read)
        self._pid = os.getpid()

    def _send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a monitor that ended: the run goes on without it
            os.write(self._control, (json.dumps(message) + "\n").encode())

    def _stop(self) -> None:
        """Close the pipe (the monitor ends at once), reap it, and put the signals back."""
        if self._control >= 0:
            os.close(self._control)
            self._control = -1
        if self._process is not None:
            try:
                self._process.wait(timeout=hang_monitor.DUMP_WAIT + hang_monitor.GRACE + 5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        with contextlib.suppress(Exception):
            faulthandler.unregister(STACKS_SIGNAL)  # after the monitor's end: no signal comes late
        if self._exit_handler is not None:
            previous = self._exit_handler[0]
            signal.signal(EXIT_SIGNAL, signal.SIG_DFL if previous is None else previous)
            self._exit_handler = None
        if self._stacks is not None:
            self._stacks.close()
            self._stacks = None
        self._words = None  # the mapping goes with the last view (LoopState.progress is reset)

    def _forget(self) -> None:
        """In a forked child of the process that started a monitor: that monitor is not its own."""
        if self._process is not None and self._pid != os.getpid():
            self._process, self._control, self._stacks, self._words, self._exit_handler = None, -1, None, None, None
            self._slots.clear()


def _anonymous_file(name: str) -> int:
    """A file with no name (in memory where the system has ``memfd_create``), as a descriptor."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name)
    fd, path = tempfile.mkstemp(prefix=name)
    os.unlink(path)
    return fd


def end_here_on_hang() -> None:
    """In a process whose fits run on other threads (the CPU runtime's thread replicas), from its
    main thread before they start: the monitor's signal ends the process with ``EXIT_CODE``
    (``exit_on_hang``), handled in the main thread as where the fit runs on it, instead of the
    SIGKILL a process without the handler gets (which its caller could not tell from any kill)."""
    if EXIT_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(EXIT_SIGNAL, _exit_on_hang)


def _exit_on_hang(signum: int, frame: Any) -> None:
    """The monitor's end of a hung process (``exit_on_hang``), where Python still runs here (the
    calling process too, where it runs a replica: ``native``, rank 0 of the native strategies)."""
    with contextlib.suppress(Exception):
        print(f"xtrainer: process {os.getpid()} was ended by the hang watchdog (exit_on_hang=True): no training step "
              "finished within hang_timeout. Checkpoints written before are intact: resume with "
              "fit(..., ckpt_path='last').", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_CODE)


_monitor = _Monitor()
