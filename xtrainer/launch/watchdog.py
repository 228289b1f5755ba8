"""The hang watchdog: a run that stops making progress says where it is stuck, and can end.

A TPU pod that hangs (a replica waiting in a collective for a peer that died, a data loader
stuck on a remote file, a deadlock in user code) burns its reservation without a word. Here,
when no training step finishes within a limit, every thread's Python stack (every replica's,
where replicas are threads of one process; each process writes its own where they are
processes) goes to the log (stderr) and to ``hang-<time>-pid<pid>.txt`` in the run folder; with
``exit_on_hang=True`` the process then ends with exit code ``EXIT_CODE`` (75), so the restart
loop (``until xtrainer fit ... ckpt_path=last; do :; done``) starts the run again from its last
checkpoint instead of waiting for hours.

The limit (``Trainer(hang_timeout=...)``): seconds, or ``"auto"`` (default): until a few steps
have finished (the first ones compile), ``STARTUP_LIMIT``; then ``STEP_MULTIPLE`` times the
median time between finished steps, never less than ``FLOOR``. ``None`` switches it off.

A training batch "finishes" for the watchdog when the loop counts it done on the host
(``LoopState.batches_done``), which the watchdog's thread reads each time it wakes (every
``limit / 8`` seconds, 5 at most): nothing is added to a step, and the watchdog adds no host
sync. Validation batches and checkpoint saves count as progress too. The median time between
finished batches is estimated from those readings. A device that stops answering shows as a
host thread stuck in the next read of logged values, which is where the stacks will point.
"""

from __future__ import annotations

import collections
import datetime
import os
import statistics
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from xtrainer.callbacks.base import Callback

if TYPE_CHECKING:
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer

#: Exit code of a process the watchdog ends (``exit_on_hang=True``): EX_TEMPFAIL, "try again".
EXIT_CODE = 75
#: ``"auto"``: the limit before ``WARM_STEPS`` steps have finished (they compile; big models on
#: TPU pods take tens of minutes), then a multiple of the median step time with a floor.
STARTUP_LIMIT, WARM_STEPS, STEP_MULTIPLE, FLOOR = 3600.0, 3, 20.0, 300.0


class HangWatchdog(Callback):
    """Watches that training steps keep finishing (added by the Trainer: ``hang_timeout``,
    ``exit_on_hang``). ``fired`` lists the files written in this replica's process."""

    def __init__(self, timeout: float | str = "auto", exit_on_hang: bool = False) -> None:
        if not (timeout == "auto" or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                      and timeout > 0)):
            raise ValueError(f"HangWatchdog(timeout={timeout!r}): give seconds or 'auto'.")
        self.timeout, self.exit_on_hang = timeout, exit_on_hang
        self.fired: list[str] = []

    # ---- the replica's side: host clock readings only ---------------------------------------
    def on_train_start(self, trainer: "Trainer", module: "XModule") -> None:
        self._folder = trainer.log_dir
        _monitor.join(self, trainer.loop)

    def on_validation_batch_end(self, trainer: "Trainer", module: "XModule", *args: Any) -> None:
        _monitor.beat(self)

    def on_save_checkpoint(self, trainer: "Trainer", module: "XModule", checkpoint: dict[str, Any]) -> None:
        _monitor.beat(self)

    def on_validation_end(self, trainer: "Trainer", module: "XModule") -> None:
        _monitor.beat(self)

    def teardown(self, trainer: "Trainer", module: "XModule", stage: str) -> None:
        _monitor.leave(self)

    # ---- the limit --------------------------------------------------------------------------
    def limit(self, intervals: list[float], steps: int) -> float:
        """Seconds without a finished step after which the watchdog fires."""
        if self.timeout != "auto":
            return float(self.timeout)
        if steps < WARM_STEPS or not intervals:
            return STARTUP_LIMIT
        return max(FLOOR, STEP_MULTIPLE * statistics.median(intervals))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_folder"}


class _Watch:
    """One replica's record, kept by the process's monitor: ``loop`` is the replica's
    ``LoopState``, whose ``batches_done`` the monitor reads."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.last = time.monotonic()  # the last progress seen
        self.done, self.seen_at = loop.batches_done, self.last  # batches finished, when last read
        self.steps = 0  # batches finished since the watch began
        self.intervals: collections.deque[float] = collections.deque(maxlen=200)
        self.fired = False

    def read(self, now: float) -> None:
        """The batches finished since the last reading: progress, and one estimate of the time
        between two of them (the mean over the readings' interval)."""
        done = self.loop.batches_done
        if done != self.done:
            if done > self.done:
                self.intervals.append((now - self.seen_at) / (done - self.done))
                self.steps += done - self.done
            self.done, self.seen_at = done, now
            self.last, self.fired = now, False


class _Monitor:
    """The process's one watchdog thread, for every replica the process runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[int, tuple[HangWatchdog, _Watch]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def join(self, owner: HangWatchdog, loop: Any) -> None:
        with self._lock:
            self._watches[id(owner)] = (owner, _Watch(loop))
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="xtrainer-hang-watchdog", daemon=True)
                self._thread.start()

    def leave(self, owner: HangWatchdog) -> None:
        with self._lock:
            self._watches.pop(id(owner), None)
            if not self._watches and self._thread is not None:
                self._stop.set()
                self._thread = None

    def beat(self, owner: HangWatchdog) -> None:
        """Progress that is not a training step (a validation batch, a save)."""
        entry = self._watches.get(id(owner))
        if entry is not None:
            entry[1].last, entry[1].fired = time.monotonic(), False

    def _run(self) -> None:
        stop = self._stop
        while not stop.is_set():
            with self._lock:
                entries = list(self._watches.values())
            period = 5.0
            for owner, watch in entries:
                watch.read(time.monotonic())
                limit = owner.limit(list(watch.intervals), watch.steps)
                period = min(period, max(limit / 8, 0.05))
                idle = time.monotonic() - watch.last
                if idle >= limit and not watch.fired:
                    watch.fired = True
                    self._fire(owner, idle, limit)
            stop.wait(period)

    def _fire(self, owner: HangWatchdog, idle: float, limit: float) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        folder = getattr(owner, "_folder", None) or os.getcwd()
        path = os.path.join(folder, f"hang-{stamp}-pid{os.getpid()}.txt")
        report = (f"xtrainer: no training step finished for {idle:.0f} s (limit {limit:.0f} s, "
                  f"hang_timeout={owner.timeout!r}). Python stacks of every thread of process {os.getpid()}:\n\n"
                  + python_stacks())
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as f:
                f.write(report)
            owner.fired.append(path)
            where = f"written to {path}"
        except OSError as err:
            where = f"not written to {path} ({err})"
        print(report + f"\n(stacks {where})", file=sys.stderr, flush=True)
        if owner.exit_on_hang:
            print(f"xtrainer: the run looks hung; ending the process with exit code {EXIT_CODE} (exit_on_hang=True) "
                  "so that a restart loop resumes it from its last checkpoint.", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_CODE)


def python_stacks() -> str:
    """Every thread's Python stack, named, innermost call last (host-side only)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "xtrainer-hang-watchdog":
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)


_monitor = _Monitor()
