"""How the native strategies' replicas start: in place (one device, or a process that torchrun, or
a launcher like it, started as one of a group: ``InPlace``), or, for ``devices=N``, rank 0 in the
calling process and ranks 1 to N-1 in new processes on this host (``NativeProcesses``), which meet
in a store the caller serves (``strategies/process_group.py`` joins them to it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from xtrainer.launch import interrupts
from xtrainer.launch.hang_monitor import EXIT_CODE as HANG_EXIT_CODE, RunHung
from xtrainer.strategies import process_group
from xtrainer.strategies.launchers import (HANG_ENDED, Launcher, _killed_error, _ReplicaJob, _StartedReplicas,
                                           launch_folder)
from xtrainer.strategies.launchers.processes import NewProcesses, end_now, free_port, killed_by_signal, new_processes


class InPlace(Launcher):
    """``fit`` runs in this process: one device, or one process of a group that torchrun (or a
    launcher like it) started, each running its replica."""

    runs_in_caller = True

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def planned_world_size(self) -> int | None:
        return int(os.environ["WORLD_SIZE"]) if process_group.under_torchrun() else 1


class NativeProcesses(_StartedReplicas):
    """``devices=N``: rank 0 runs in the calling process, as Lightning's ``ddp`` runs it, and
    ranks 1 to N-1 in new processes on this host, with torch's variables (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The caller's module is the
    trained one, with whatever the hooks added to it; nothing comes back from the other ranks
    but their errors. The group meets in a store that the caller serves on a free port, one per
    launch; the caller's place in it is given to its strategy through
    ``process_group.set_caller_rank``, not in ``os.environ``, which stays as it was (a later
    Trainer would take torch's variables there for torchrun's). The started processes end with the calling process, which forwards
    SIGTERM/SIGINT to each; the caller's process group is gone when the stage ends.

    ``timeout_seconds``: how long rank 0 waits for the other ranks to join (one that ends before
    it does ends the wait at once)."""

    runs_in_caller = True
    group_ends_with_stage = True
    ranks = staticmethod(process_group.env_ranks)

    def __init__(self, devices: int | None, timeout_seconds: float = 1800.0) -> None:
        super().__init__(devices)
        self.timeout_seconds = timeout_seconds
        self._codes: list[int | None] = []  # each started process's exit code, after a launch

    def check(self) -> None:
        pass

    def planned_world_size(self) -> int | None:
        return self.devices

    def start(self, job: Callable[[], None]) -> int:
        raise NotImplementedError("NativeProcesses runs rank 0 in the calling process: see launch()")

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        n = int(self.devices or 1)
        what = f"Trainer(devices={n})"
        with launch_folder() as tmp, _intra_op_threads_here(n):
            # Pickled before rank 0 runs here: the other ranks start from the module as it is now.
            job = _ReplicaJob(fn, args, tmp, torch.get_rng_state(), process_group.env_ranks)
            store, port = _serve_store(self.timeout_seconds)
            envs = [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                     "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     process_group.REPLICA_OF_CALLER: "1",
                     **_intra_op_threads(n)}
                    for rank in range(1, n)]
            own: BaseException | None = None
            first = False
            with new_processes(_process_main, (job,), envs, what, hookless_tensors=True) as started:
                caller = process_group.CallerRank(store, n, lambda: self._wait_for_peers(store, started, n))
                process_group.set_caller_rank(caller)
                try:
                    result = fn(*args)
                    process_group.leave(barrier=True)  # every rank past its last collective first
                except BaseException as err:
                    own = err
                    first = not isinstance(err, _PeerEnded) and job._record_failure(err, (0, n))
                    # Those that failed too end by themselves; the others may wait for rank 0 in a collective.
                    started.end(grace=30.0 if isinstance(err, interrupts.TrainingInterrupted) else 5.0, patience=2.0)
                    process_group.leave(barrier=False)
                finally:
                    process_group.set_caller_rank(None)
                try:
                    exitcode = started.join(self._codes)
                except BaseException as err:
                    job.raise_failure(cause=err)
                    raise
            del store
            if own is None or isinstance(own, _PeerEnded):
                self.raise_outcome(job, exitcode, finished=own is None)
                if own is not None:
                    raise RuntimeError(f"{what}: {own}")
                return result
            if isinstance(own, interrupts.TrainingInterrupted) or first:
                # rank 0's error is the first (the others' followed from it, or from the same stop),
                # unless a signal or the hang watchdog ended another rank's process
                killed = self.killed_replica()
                if killed is not None:
                    raise _killed_error(*killed, finished=False) from own
                if HANG_EXIT_CODE in self._codes:
                    raise RunHung(HANG_ENDED) from own
                if not isinstance(own, interrupts.TrainingInterrupted):
                    own.add_note(f"(raised in replica 0 of {n}, in this process; the other replicas were stopped)")
                raise own
            try:  # another rank failed first: rank 0's error (a lost connection, say) followed from it
                self.raise_outcome(job, exitcode, finished=False)
            except BaseException as theirs:
                raise theirs from own
            raise own

    def _wait_for_peers(self, store: dist.Store, started: NewProcesses, n: int) -> None:
        """Until every started rank has joined the store (it counts in after its rendezvous), while
        watching that none ended and that no stop signal came. Polled: a wait in the store alone
        would outlast a rank that died while it imported the script."""
        deadline = time.monotonic() + self.timeout_seconds
        while (joined := store.add(process_group.JOINED_KEY, 0)) < n - 1:
            ended = started.ended()
            if ended:
                raise _PeerEnded(f"rank {ended[0] + 1} ended before it joined the process group")
            signum = interrupts.requested()
            if signum is not None:
                raise interrupts.TrainingInterrupted(
                    f"Stopped by {signal.Signals(signum).name} while the replicas' processes were starting; nothing "
                    "was trained in this run yet.", signum)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Trainer(devices={n}): {n - 1 - joined} of the {n - 1} started processes "
                    f"did not join the process group within timeout_seconds={self.timeout_seconds:g} s (importing the script or "
                    "rebuilding the job took longer, or hung there; their output above may say where). Give the "
                    "strategy a larger timeout_seconds if they are only slow.")
            time.sleep(0.05)

    def killed_replica(self) -> tuple[int, int] | None:
        killed = killed_by_signal(self._codes)
        return None if killed is None else (killed[0] + 1, killed[1])  # the started processes are ranks 1..N-1


class _PeerEnded(RuntimeError):
    """A started rank ended before it joined the process group (its own error, if any, is the one to tell)."""


def _serve_store(timeout_seconds: float) -> tuple[dist.TCPStore, int]:
    """The store of a launch's group, served by the calling process on a free port (bound before
    any other rank starts: no one else can take the port after it was drawn)."""
    import datetime

    for attempt in range(20):
        port = free_port()
        try:
            return dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_seconds),
                                 wait_for_workers=False, multi_tenant=True), port
        except (RuntimeError, OSError):  # taken between the draw and the bind
            if attempt == 19:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _intra_op_threads_here(processes: int) -> Iterator[None]:
    """torch's intra-op threads of the calling process while it runs rank 0 beside ``processes``
    - 1 others: its share of the cores (``_intra_op_threads``), its own count again afterwards."""
    share = _intra_op_threads(processes)
    before = torch.get_num_threads()
    if share:
        torch.set_num_threads(int(share["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        if share:
            torch.set_num_threads(before)


def _intra_op_threads(processes: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``processes`` processes on this host, unless it is set: the
    cores this process may use, shared out, at least one each. torch's default is a thread per
    core in every process, so N processes would run N threads per core and slow each other down
    (torchrun sets 1 for the same reason)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // processes))}


def _process_main(job: Callable[[], None]) -> None:
    """A replica process of ``NativeProcesses``. On failure it ends at once: its error is in the
    job's error file, and the caller ends the other processes (which may wait in a collective)."""
    try:
        job()
    except BaseException:
        end_now(1)
    if dist.is_initialized():
        # Every process past its last collective before any closes its connections: a process
        # that closes them while a peer still reads its last message aborts that peer (gloo).
        dist.barrier()
        dist.destroy_process_group()
    # Everything the job leaves is written (its result, checkpoints, logs): end here, without the
    # interpreter's teardown of torch's C++ objects, where a process whose peers had already ended
    # aborted now and then ("terminate called without an active exception", exit -6) after a fit
    # that had gone well (torch 2.13, 4 processes, under load).
    end_now(0)
