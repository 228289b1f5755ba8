"""Stopping gracefully on SIGTERM and SIGINT, and never leaving replicas behind.

Preemptible machines and Kubernetes send SIGTERM and allow a grace period (30 s by default)
before SIGKILL. While a ``fit`` runs, the first SIGTERM or SIGINT only sets a request
(``requested()``): the loop finishes the step it is in, every replica agrees to stop (the way
``trainer.should_stop`` is shared), a checkpoint is written, the callbacks' ``on_exception`` hook
runs, and ``fit`` raises ``TrainingInterrupted`` (the ``xtrainer`` command exits with 128 + the
signal's number: 143 for SIGTERM, 130 for SIGINT), after one line saying where the checkpoint is
and how to resume. A second SIGINT stops at once (``KeyboardInterrupt``); one within
``SAME_CTRL_C_SECONDS`` of the first is that first Ctrl-C delivered again (a terminal sends it to
every process of its foreground group, and torchrun or the calling process forwards it to each
worker too), and changes nothing.

A signal may reach one replica of several only (one host's launcher, torchrun, is signalled): the
replicas' stop vote carries the signal's number, and each replica that learns of it there takes it
as its own request (``adopt``), so that every replica stops on the same path, writes the one
checkpoint with the others and exits with the same code.

A cluster's requeue signal (SLURM's SIGUSR1 under auto-requeue, ``clusters/slurm.py``) asks for
the same stop where the stage adds it (``graceful(also=...)``); the fit's ``TrainingInterrupted``
then carries it, and the cluster decides what follows (the requeue).

A calling process forwards the signal to the replicas' process it started; that process runs in a
process group of its own (so a terminal's Ctrl-C reaches it once, through the caller) and ends
within a second when its caller dies, SIGKILL included (Linux's parent-death signal, and a
thread that watches the parent as a fallback elsewhere).

On a TPU pod every replica process receives the platform's SIGTERM itself. The SPMD strategies
(one process per host) stop on XLA's preemption sync there (``_xla.PreemptionNotice``, the one
torch_xla's ``CheckpointManager`` uses): the hosts agree through the runtime's coordination
service on one step at which all of them stop, without waiting for the next logging step. The
mechanism runs here for one process on the CPU runtime (``XTRAINER_PREEMPTION_SYNC=1``); across
the hosts of a pod it is untested here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Iterator

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: The signals beyond SIGTERM and SIGINT that stop a run gracefully (``graceful(also=...)``), as
#: the processes a run starts inherit them: ``10`` (SIGUSR1) for SLURM's requeue signal.
STOP_SIGNALS_VAR = "XTRAINER_STOP_SIGNALS"


class StopRequest:
    """This process's stop request: ``signal``, the signal that asked (None: none yet). One
    object for the process's life, written by the handler and by ``request``/``adopt``: the fit
    loop keeps a reference and reads the attribute after every batch (no call)."""

    __slots__ = ("signal",)

    def __init__(self) -> None:
        self.signal: int | None = None


stop = StopRequest()
_adopted = False  # stop.signal came from another replica (``adopt``), not to this process
#: A SIGINT this soon after this process's first is the same Ctrl-C, delivered again: a terminal
#: sends it to the whole foreground process group, and a launcher (torchrun, the calling process
#: of devices=N) forwards it to each worker too, so a worker gets one Ctrl-C twice.
SAME_CTRL_C_SECONDS = 1.0
_first_sigint_at: float | None = None
_children: set[int] = set()
_announce = True


class TrainingInterrupted(Exception):
    """``fit`` stopped on a signal after writing a checkpoint. ``signal``: its number;
    ``checkpoint``: the checkpoint written (None if none could be); ``exit_code``: 128 + signal."""

    def __init__(self, message: str, signum: int, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.signal, self.checkpoint = signum, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signal

    def __reduce__(self):  # travels from a replica to the caller as it is
        return (TrainingInterrupted, (str(self), self.signal, self.checkpoint))


def requested() -> int | None:
    """The signal that asked this process to stop, if one did."""
    return stop.signal


def request(signum: int) -> None:
    """Record a stop request that came by other means than this process's handler (XLA's
    preemption sync, which owns SIGTERM while it is active)."""
    if stop.signal is None:
        stop.signal = signum


def adopt(signum: int) -> None:
    """Record the signal another replica received as this process's own request: the replicas'
    stop vote carries it (``loop/agreement.py``), so that every replica stops on the same path,
    writes the one checkpoint together and exits with 128 + that signal. Where this process has a
    request of its own, the larger signal number wins (SIGTERM over SIGINT), as the vote's does.
    An adopted SIGINT is no first Ctrl-C: this process's own SIGINT after it still stops
    gracefully."""
    global _adopted
    if stop.signal is not None and signum <= stop.signal:
        return
    first = stop.signal is None
    stop.signal, _adopted = signum, _adopted or first
    if first and _announce:
        name = signal.Signals(signum).name
        print(f"xtrainer: {name} reached another replica: finishing the current step, then writing a checkpoint.",
              file=sys.stderr, flush=True)


def _handle(signum: int, frame: object) -> None:
    global _adopted, _first_sigint_at
    if stop.signal is not None and not _adopted and signum == signal.SIGINT:
        if _first_sigint_at is not None and time.monotonic() - _first_sigint_at < SAME_CTRL_C_SECONDS:
            return  # the first Ctrl-C again, from the terminal and from the launcher that forwards it
        raise KeyboardInterrupt  # a second Ctrl-C: stop at once
    first = stop.signal is None or _adopted  # this process's own first signal
    if signum == signal.SIGINT and first:
        _first_sigint_at = time.monotonic()
    stop.signal, _adopted = max(signum, stop.signal or 0), False
    for pid in list(_children):
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
    if first and _announce:
        name = signal.Signals(signum).name
        print(f"xtrainer: {name} received: finishing the current step, then writing a checkpoint"
              f"{' (Ctrl-C again to stop at once)' if signum == signal.SIGINT else ''}.", file=sys.stderr, flush=True)


def _stop_with_launcher(signum: int) -> bool:
    """Under torchrun: ``signum`` to this process when its parent, torchrun's agent, ends however
    it ends (Linux's parent-death signal, which the agent's main thread, where it starts its
    workers, triggers; 0: none again). A node's torchrun killed alone (SIGKILL, the out-of-memory
    killer) would otherwise leave its worker training on without a launcher until the other
    nodes' torchrun noticed the lost peer; with SIGTERM the worker stops gracefully at once, and
    the stop vote takes every replica to one checkpoint and exit 143. Whether it was set."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signum), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def graceful(announce: bool = True, also: tuple[int, ...] = ()) -> Iterator[None]:
    """While a run lasts: SIGTERM and SIGINT request a graceful stop (main thread only; elsewhere,
    a notebook's worker thread say, signals keep their handlers). ``announce``: say so on stderr
    (a replicas' process leaves that to its caller). ``also``: more signals that request it (a
    cluster's requeue signal, ``clusters/``), handled as SIGTERM is, and forwarded as they are: the
    replicas' processes started meanwhile handle them too (they inherit ``STOP_SIGNALS_VAR``)."""
    global _adopted, _announce, _first_sigint_at
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    inherited = tuple(int(n) for n in os.environ.get(STOP_SIGNALS_VAR, "").split(",") if n.isdigit())
    handled = tuple(dict.fromkeys((*_SIGNALS, *inherited, *also)))
    previous = {signum: signal.getsignal(signum) for signum in handled}
    before = os.environ.get(STOP_SIGNALS_VAR)
    extra = [str(int(signum)) for signum in handled if signum not in _SIGNALS]
    if extra:
        os.environ[STOP_SIGNALS_VAR] = ",".join(extra)
    stop.signal, _adopted, _announce, _first_sigint_at = None, False, announce, None
    for signum in handled:
        signal.signal(signum, _handle)
    with_launcher = _stop_with_launcher(signal.SIGTERM)
    try:
        yield
    finally:
        if with_launcher:
            _stop_with_launcher(0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if extra and before is None:
            os.environ.pop(STOP_SIGNALS_VAR, None)
        elif extra:
            os.environ[STOP_SIGNALS_VAR] = before


@contextlib.contextmanager
def ending_stage_on(signals: tuple[int, ...], stage: str) -> Iterator[None]:
    """While ``validate``/``test``/``predict`` runs: each of ``signals`` (a cluster's requeue
    signal, SLURM's SIGUSR1, which would otherwise end the process unannounced) ends the stage at
    once with ``TrainingInterrupted``. An evaluation changes no weights, so nothing is saved; the
    cluster then requeues the job, which runs the stage again. SIGTERM and SIGINT keep their
    handlers (they end an evaluation as they would end any program)."""
    if not signals or threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum: int, frame: object) -> None:
        del frame
        name = signal.Signals(signum).name
        raise TrainingInterrupted(f"Stopped by {name} during {stage}: nothing to save ({stage} changes no weights); "
                                  f"run {stage} again to get its results.", signum)

    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, end)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def ending_at_once() -> Iterator[None]:
    """While a run sets up (joining its process group, nothing trained, nothing to save): SIGTERM
    ends the process at once, as it would without xtrainer. A handler in Python runs only between
    two Python instructions, so a process blocked in the group's rendezvous (a peer that never
    comes) would otherwise wait out the launcher's grace period before its SIGKILL. SIGINT keeps
    its handler (a notebook's kernel must survive an interrupt). A SIGTERM this process received
    before (while it imported or prepared its data) ends it here, as one during the wait would: the
    wait ahead may never end (a peer that never comes), and nothing is saved yet."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not _handle:
        yield
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stop.signal == signal.SIGTERM and not _adopted:
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends now
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _handle)


@contextlib.contextmanager
def forwarding_to(pid: int) -> Iterator[None]:
    """Forward the stop signals this process receives to the process ``pid`` (the replicas')."""
    _children.add(pid)
    try:
        if stop.signal is not None:  # it came while the process was starting
            with contextlib.suppress(OSError):
                os.kill(pid, stop.signal)
        yield
    finally:
        _children.discard(pid)


def become_child(parent: int) -> None:
    """In a started replicas' process, first thing: a process group of its own, and an end within
    a second of its parent's, however the parent ends."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the caller, which forwards it once
    signalled = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            signalled = libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent is gone already
        os._exit(1)
    if signalled:
        # No thread: once a process has a second thread, glibc's locks and allocator stop taking
        # their single-threaded shortcuts, and the thread's wake-ups take the GIL from the training.
        return

    def watch() -> None:  # the fallback where there is no parent-death signal
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="xtrainer-parent-watch", daemon=True).start()
