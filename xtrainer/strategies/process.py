"""Running a launch's replicas in a new process (the CPU runtime's thread replicas, SPMD).

A new process gets a clean XLA runtime configured by environment variables, whatever the
calling process (a script, a notebook, a test session) has already done with its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import tempfile
import threading
from typing import Callable, Iterator

from xtrainer import interrupts

_environ_lock = threading.Lock()
#: Set in a started process: where to leave word that it was asked to start one of its own while
#: it imported the caller's script (the script starts training at import time).
_UNGUARDED_MARKER = "XTRAINER_UNGUARDED_MAIN_MARKER"
_UNGUARDED_MESSAGE = (
    "The script starts training when it is imported: the new process that runs the replicas imports "
    "it again (Python's 'spawn' start method), and it tried to start training there too. Put the "
    "script's work under `if __name__ == '__main__':` (define the classes and functions above it).")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while a child process starts (it copies the environment)."""
    with _environ_lock:
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def run_in_new_process(target: Callable[..., None], args: tuple, env: dict[str, str], what: str) -> int:
    """``target(*args)`` in a new (spawned) process started with ``env``; its exit code.

    ``args`` are pickled: a clear error says what to change when they cannot be. Interrupting
    the caller (Ctrl-C) ends the process too.
    """
    context = multiprocessing.get_context("spawn")
    inherited_marker = os.environ.get(_UNGUARDED_MARKER)  # set if this is a started process itself
    marker = os.path.join(tempfile.gettempdir(), f"xtrainer-unguarded-{os.getpid()}-{id(args)}")
    with _environ({**env, _UNGUARDED_MARKER: marker}):
        process = context.Process(target=_child_main, args=(target, args, os.getpid()), name="xtrainer-replicas")
        try:
            process.start()  # pickles the job: trainer, module, callbacks, dataloaders
        except RuntimeError as err:
            if "bootstrapping phase" not in str(err) or inherited_marker is None:
                raise
            # This is the started process, importing the caller's unguarded script: tell the caller.
            with open(inherited_marker, "w"):
                pass
            raise RuntimeError(_UNGUARDED_MESSAGE) from err
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(
                f"{what} sends the trainer, the module, the callbacks and the dataloaders to a new process by "
                f"pickling them, and that failed: {err}. Define classes and functions at the top level of a "
                "module (not inside a function or a notebook cell's function), and start the script's work "
                "under `if __name__ == '__main__':`.") from err
    try:
        with interrupts.forwarding_to(process.pid):  # SIGTERM/SIGINT reach the replicas through here
            process.join()
    except BaseException:  # a second Ctrl-C: do not leave the replicas running
        process.terminate()
        process.join()
        raise
    if os.path.exists(marker):
        os.remove(marker)
        raise RuntimeError(_UNGUARDED_MESSAGE)
    return process.exitcode


def _child_main(target: Callable[..., None], args: tuple, parent: int) -> None:
    """A started replicas' process: it ends with its caller, and stops gracefully on the stop
    signals its caller forwards."""
    interrupts.become_child(parent)
    with interrupts.graceful(announce=False):
        target(*args)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

