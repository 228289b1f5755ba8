"""Asynchronous checkpoint writes (``Trainer(async_checkpointing=True)``; off by default).

With it on, a save of the whole-file layout (``xla_native``, ``xla_ddp``) costs the training loop
the copy of the state off the device (``_xla.to_cpu``, a host sync) and a copy of that host state;
serialising, writing, flushing and renaming the file into place (atomic as always) happen in this
process's one background thread. Later storage work of the same run (removing checkpoints that
top-k no longer keeps, copying ``last`` on object stores) queues behind the write, in order, so a
checkpoint is never removed before its successor is complete.

Background writes are on only while a stage runs (``stage_starts``, ``stage_ends``): a save
outside one (say, ``trainer.save_checkpoint`` after ``fit``) is complete when it returns. At most
one save is in flight: a newer save waits for the older one to be written. The end of every fit,
validate, test or predict (also a stop by SIGTERM, after its checkpoint) waits for the queue to
empty; a failed background write is raised there, at the next save, or at the storage work that
would follow it (``behind_writes``: ``last`` is never pointed at a checkpoint that failed, nor its
predecessor removed). The writer is a daemon
thread, so that a hung disk cannot keep a finished process alive: at interpreter exit whatever
is still queued is waited for, and said on stderr (with a failure of it), never dropped in
silence.

A kill during a background write leaves the temporary file (removed at the next start) and the
previous checkpoints as they were, ``last.ckpt`` included: re-pointing it is queued behind the
write too. Sharded layouts (``xla_fsdp``, ``xla_spmd``, ``xla_fsdpv2``) still
write synchronously.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from typing import Any, Callable

_stages_on = 0  # stages running in this process with background writes on (replicas may be threads)
_lock = threading.Condition()
_jobs: "queue.Queue[tuple[Callable[[], Any], bool]]" = queue.Queue()
_saves_pending = 0
_error: BaseException | None = None
_worker: threading.Thread | None = None
_worker_pid = 0  # the process that started it (a forked child has no writer thread of its own)


def stage_starts(enabled: bool) -> None:
    """A replica's run of a stage starts: background writes on while it runs (``enabled``). Every
    ``stage_starts`` is paired with a ``stage_ends`` (in a ``finally``); replicas that are threads
    of one process each count, so the writes stay on until the last of them ends."""
    global _stages_on
    if enabled:
        with _lock:
            _stages_on += 1


def stage_ends(enabled: bool) -> None:
    """The run ``stage_starts(enabled)`` began has ended (after draining the queue): background
    writes as they were before it."""
    global _stages_on
    if enabled:
        with _lock:
            _stages_on -= 1


def enabled() -> bool:
    """Whether saves are written in the background now: only while a stage runs that asked for it."""
    return _stages_on > 0


def submit(job: Callable[[], Any], save: bool = False) -> None:
    """Run ``job`` in the background thread, after every job queued before it. ``save``: a
    checkpoint write; it first waits until no other save is in flight."""
    global _saves_pending, _worker, _worker_pid
    with _lock:
        if save:
            _lock.wait_for(lambda: _saves_pending == 0 or _error is not None)
        _raise_error()
        if save:
            _saves_pending += 1
        if _worker is None or not _worker.is_alive() or _worker_pid != os.getpid():
            _worker = threading.Thread(target=_work, name="xtrainer-checkpoint-writer", daemon=True)
            _worker.start()
            _worker_pid = os.getpid()
        _jobs.put((job, save))


def run_or_submit(job: Callable[[], Any], save: bool = False) -> None:
    """``job()`` now, or in the background when background writes are on."""
    if enabled():
        submit(job, save)
    else:
        job()


def behind_writes(job: Callable[[], Any]) -> bool:
    """Queue ``job`` behind the writes in flight, if any (True); False: nothing in flight (or this
    is the background thread itself), so the caller does it now. Writes in flight are waited for
    whether background writes are on now or not. A write that failed already is raised here, and
    ``job`` is not done: what follows a save (``last`` pointed at it, its predecessor removed)
    must not happen to a checkpoint that was never written."""
    if threading.current_thread() is _worker:
        return False
    with _lock:
        _raise_error()
        if pending() == 0:
            return False
    submit(job)
    return True


def pending() -> int:
    """Jobs queued or running in the background thread."""
    return _jobs.unfinished_tasks


def drain(raise_errors: bool = True) -> None:
    """Wait until every queued job is done; raise a background failure (``raise_errors``)."""
    global _error
    if _worker is None:
        return
    _jobs.join()
    with _lock:
        if raise_errors:
            _raise_error()
        elif _error is not None:  # the run is failing already: say so, do not hide its own error
            import warnings

            error = _error
            _error = None
            warnings.warn(f"A background checkpoint write failed as well: {error}", RuntimeWarning, stacklevel=2)


@atexit.register
def _drain_at_exit() -> None:
    """At interpreter exit: finish what is still queued (the writer is a daemon thread, which
    the interpreter would stop in the middle of a write) and say so on stderr, with a failure
    that no stage's end raised."""
    global _error
    if _worker is None or _worker_pid != os.getpid():
        return
    queued = pending()
    if queued:
        print(f"xtrainer: waiting for {queued} background checkpoint write(s) still queued at exit",
              file=sys.stderr, flush=True)
        while pending() and _worker.is_alive():
            time.sleep(0.01)
    with _lock:
        error, _error = _error, None
    if error is not None:
        print(f"xtrainer: a background checkpoint write failed and was not reported before exit: {error}",
              file=sys.stderr, flush=True)


def _raise_error() -> None:
    global _error
    if _error is not None:
        error, _error = _error, None
        raise error


def _work() -> None:
    global _saves_pending, _error
    while True:
        job, save = _jobs.get()
        try:
            if _error is None:  # after a failure, later jobs (a removal of the previous checkpoint) are dropped
                job()
        except BaseException as err:  # noqa: BLE001 - raised in the training thread at the next save or the end
            with _lock:
                _error = err
        finally:
            with _lock:
                if save:
                    _saves_pending -= 1
                _lock.notify_all()
            _jobs.task_done()
