"""Asynchronous checkpoint writes (``Trainer(async_checkpointing=True)``; off by default).

With it on, a save of the whole-file layout (``xla_native``, ``xla_ddp``) costs the training loop
the copy of the state off the device (``_xla.to_cpu``, a host sync) and a copy of that host state;
serialising, writing, flushing and renaming the file into place (atomic as always) happen in this
process's one background thread. Later storage work of the same run (removing checkpoints that
top-k no longer keeps, copying ``last`` on object stores) queues behind the write, in order, so a
checkpoint is never removed before its successor is complete.

At most one save is in flight: a newer save waits for the older one to be written. The end of
every fit, validate, test or predict (also a stop by SIGTERM, after its checkpoint) waits for the
queue to empty; a failed background write is raised there, or at the next save.

A kill during a background write leaves the temporary file (removed at the next start) and the
previous checkpoints as they were, ``last.ckpt`` included: re-pointing it is queued behind the
write too. Sharded layouts (``xla_fsdp``, ``xla_spmd``, ``xla_fsdpv2``) still
write synchronously.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

_enabled = False
_lock = threading.Condition()
_jobs: "queue.Queue[tuple[Callable[[], Any], bool]]" = queue.Queue()
_saves_pending = 0
_error: BaseException | None = None
_worker: threading.Thread | None = None


def use(enabled: bool) -> None:
    """Switch background writes on or off for this process (each replica calls it at its start)."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def submit(job: Callable[[], Any], save: bool = False) -> None:
    """Run ``job`` in the background thread, after every job queued before it. ``save``: a
    checkpoint write; it first waits until no other save is in flight."""
    global _saves_pending, _worker
    with _lock:
        if save:
            _lock.wait_for(lambda: _saves_pending == 0 or _error is not None)
        _raise_error()
        if save:
            _saves_pending += 1
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="xtrainer-checkpoint-writer", daemon=True)
            _worker.start()
    _jobs.put((job, save))


def run_or_submit(job: Callable[[], Any], save: bool = False) -> None:
    """``job()`` now, or in the background when background writes are on."""
    if _enabled:
        submit(job, save)
    else:
        job()


def behind_writes(job: Callable[[], Any]) -> bool:
    """Queue ``job`` behind the writes in flight, if any (True); False: nothing in flight (or this
    is the background thread itself), so the caller does it now."""
    if not _enabled or threading.current_thread() is _worker or _jobs.unfinished_tasks == 0:
        return False
    submit(job)
    return True


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
