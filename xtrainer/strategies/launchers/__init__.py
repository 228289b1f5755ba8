"""How ``fit`` reaches its replicas: one small class per way of starting them.

A strategy picks one as its ``launcher``:

- ``InCaller``: one device; ``fit`` runs in the calling process.
- ``XlaLaunch``: ``torch_xla.launch``, one process per device (TPU and other PJRT devices).
- ``CpuThreadReplicas``: several replicas on the CPU runtime, as threads of one new process
  (the ``cpu_threads`` package; this is the one module that imports it).
- ``SpmdProcess``: one SPMD program in one new process (``process``), for ``XlaSPMD``.

Each has ``launch(fn, *args)``, ``planned_world_size()`` and ``runs_in_caller``. Started replicas
run a ``_ReplicaJob``: it reports rank 0's result, or the first failed replica's error, through
files of a private folder, and the caller raises that error with the replica's traceback as its
``ReplicaFailure`` cause.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import threading
import traceback
import warnings
from typing import Any, Callable, ClassVar, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: a launch folder's caller is judged by its name alone
    fcntl = None  # type: ignore[assignment]

import torch

from xtrainer._lazy_xla import xla as _xla
from xtrainer.checkpoint import writers
from xtrainer.launch import interrupts
from xtrainer.launch.hang_monitor import EXIT_CODE as HANG_EXIT_CODE, RunHung
from xtrainer.launch.interrupts import TrainingInterrupted
from xtrainer.strategies import shared_process
from xtrainer.strategies.launchers import cpu_threads
from xtrainer.strategies.launchers.processes import end_now, run_in_new_process


class Launcher(abc.ABC):
    """One way of running ``fit`` in every replica, for ``devices`` devices (None: every local one)."""

    #: Whether ``fit`` runs in the calling process rather than in started replicas (rank 0's, at least).
    runs_in_caller: ClassVar[bool] = False
    #: Whether the calling process's process group ends with the stage (``trainer.world_size``
    #: then says what the launch plans again).
    group_ends_with_stage: ClassVar[bool] = False

    def __init__(self, devices: int | None) -> None:
        self.devices = devices

    @abc.abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in every replica and return the result of this host's first replica
        (rank 0 on a single host) in the calling process.

        ``fn`` begins by calling the strategy's ``setup_environment()``. In started replicas rank
        0's return value comes back through a file (so it must pickle), and the calling process
        never touches the XLA runtime itself, which ``torch_xla.launch`` requires. If a replica
        fails, the others are stopped and its error is raised here.
        """

    def planned_world_size(self) -> int | None:
        """The world size a launch will have, as the calling process can tell before it: the
        replica count on the CPU runtime; None elsewhere (a TPU pod's size is known to the runtime
        only)."""
        if _xla.requested_device_type() == "CPU" and not _xla.launched_externally():
            return self.devices
        return None


class InCaller(Launcher):
    """One device: ``fn`` runs here, in the calling process."""

    runs_in_caller = True

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        _refuse_cpu_processes_of_torchrun()
        return fn(*args)


def xla_ranks() -> tuple[int, int, int]:
    """This replica's (global rank, world size, local rank) in XLA's runtime."""
    return _xla.global_rank(), _xla.world_size(), _xla.local_rank()


class _StartedReplicas(Launcher):
    """Replicas started elsewhere: ``start`` runs a ``_ReplicaJob`` in each."""

    #: Where a replica learns its (global rank, world size, local rank): a module-level function
    #: (the job that holds it is pickled to the replicas).
    ranks: ClassVar[Callable[[], tuple[int, int, int]]] = staticmethod(xla_ranks)

    def check(self) -> None:
        """Refuse a launch that cannot work, in the calling process, before anything starts."""
        _refuse_cpu_processes_of_torchrun()

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.check()
        rng_state = torch.get_rng_state()
        with launch_folder() as tmp:
            job = _ReplicaJob(fn, args, tmp, rng_state, type(self).ranks)
            try:
                exitcode = self.start(job)
            except BaseException as err:
                job.raise_failure(cause=err)
                raise
            self.raise_outcome(job, exitcode, finished=os.path.exists(job.result_path))
            return job.result()

    def raise_outcome(self, job: "_ReplicaJob", exitcode: int, finished: bool) -> None:
        """Raise what ended a launch whose replicas' processes ended with ``exitcode``, if anything
        did: a replica that a signal ended or the hang watchdog, else the first failed replica's
        error, else a stop signal or a crash; ``finished``: rank 0 had returned its result."""
        killed = self.killed_replica()
        error = (_killed_error(*killed, finished=finished) if killed is not None
                 else RunHung(HANG_ENDED) if exitcode == HANG_EXIT_CODE else None)
        if error is not None:  # the others' errors (a lost connection) followed from it
            try:
                job.raise_failure()
            except BaseException as consequence:
                raise error from consequence
            raise error
        job.raise_failure()
        signum = interrupts.requested()
        if exitcode != 0 and signum is not None:  # stopped before it could stop gracefully
            raise TrainingInterrupted(
                f"Stopped by {signal.Signals(signum).name}: the replicas' process ended before it could stop "
                "gracefully (while starting or finishing); any checkpoint written before is intact. Resume "
                "with fit(..., ckpt_path='last').", signum)
        if exitcode != 0:
            how = f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
            when = "after rank 0 had finished" if finished else "before rank 0 finished"
            raise RuntimeError(f"The replicas' process ended with {how} {when}, without reporting an error; "
                               "its output above (Python stacks of every thread on a crash) may say why."
                               + self.explain_crash(exitcode))

    def explain_crash(self, exitcode: int) -> str:
        """What a crash of the replicas' process with ``exitcode`` most likely means ("" if nothing)."""
        del exitcode
        return ""

    def killed_replica(self) -> tuple[int, int] | None:
        """(rank, signal) of a replica whose own process a signal ended from outside or a crash,
        where replicas have processes of their own (else None)."""
        return None

    @abc.abstractmethod
    def start(self, job: Callable[[], None]) -> int:
        """Run ``job()`` in every replica; returns the exit code of the replicas' process (0 when
        the replicas return normally)."""


#: A replicas' process that the hang watchdog ended where it could still run Python (exit_on_hang).
HANG_ENDED = ("The replicas' process was ended by the hang watchdog (exit_on_hang=True): no training step finished "
              "within hang_timeout. Every thread's stack is above and in hang-*.txt in the run folder. Checkpoints "
              "written before are intact: resume with fit(..., ckpt_path='last').")


def _killed_error(rank: int, signum: int, finished: bool) -> RuntimeError:
    """The error of a replica process that a signal ended (``finished``: after rank 0 had
    returned its result)."""
    name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
    crashes = {int(getattr(signal, name)) for name in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")
               if hasattr(signal, name)}
    why = ("SIGKILL comes from outside the process: most often the kernel's out-of-memory killer (`dmesg` says so), "
           "a scheduler or a person ending it, or the hang watchdog (exit_on_hang=True; it says so above and leaves "
           "hang-*.txt in the run folder)" if signum == signal.SIGKILL else
           "a crash in native code; its output above (Python stacks of every thread) may say where" if signum in crashes
           else f"{name} came from outside the process, and nothing in it handles {name} (its default action ends "
                "a process): a scheduler's notice or a person's kill sent to that process alone")
    return RuntimeError(f"Rank {rank}'s process was ended by {name} (signal {signum})"
                        f"{' after rank 0 had finished' if finished else ''}: {why}. Checkpoints written before are "
                        "intact: resume with fit(..., ckpt_path='last').")


class XlaLaunch(_StartedReplicas):
    """``torch_xla.launch``: one process per local device (TPU), or this process as one of several
    that torchrun started."""

    def start(self, job: Callable[[], None]) -> int:
        if not _xla.launched_externally():
            _check_launch_devices(self.devices)
        _xla.launch(_replica_main, args=(job,))
        return 0


class CpuThreadReplicas(_StartedReplicas):
    """Several replicas on the CPU runtime: threads of one new process (``cpu_threads``)."""

    def start(self, job: Callable[[], None]) -> int:
        return cpu_threads.launch(job, self.devices)

    def explain_crash(self, exitcode: int) -> str:
        if exitcode not in (-signal.SIGABRT, -signal.SIGSEGV):
            return ""
        return (f" Most likely: on the CPU runtime XLA aborts the process when a replica waits more than "
                f"{cpu_threads.XLA_COLLECTIVE_WAIT_SECONDS} s at a collective for another one, e.g. one replica doing "
                "long host work alone in a hook (a plot, a sample, a breakpoint) or only some replicas reaching a "
                "collective. Do such work on every replica or keep it short, or run it with devices=1.")


class SpmdProcess(_StartedReplicas):
    """One SPMD program over every device, in one new process with SPMD switched on from the
    runtime's start (it must be before any XLA tensor exists, which the calling process may
    already have made). ``what`` names the strategy in messages."""

    def __init__(self, devices: int | None, what: str) -> None:
        super().__init__(devices)
        self.what = what

    def start(self, job: Callable[[], None]) -> int:
        # SPMD from the runtime's start, by the (deprecated, still read) variable: the new process
        # may touch XLA while it imports the caller's modules, before any code of ours runs.
        env = {"XLA_USE_SPMD": "1"}
        if _xla.requested_device_type() == "CPU":
            env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(self.devices or 1))
        return run_in_new_process(_spmd_main, (job,), env, self.what)

    def planned_world_size(self) -> int | None:
        """One process per host: 1 on the CPU runtime."""
        return 1 if _xla.requested_device_type() == "CPU" else None


def for_replicas(devices: int | None) -> Launcher:
    """The launcher of MPMD replicas: in the calling process for one device; else thread replicas
    on the CPU runtime, ``torch_xla.launch`` elsewhere."""
    if devices == 1:
        return InCaller(devices)
    if cpu_threads.applies(devices):
        return CpuThreadReplicas(devices)
    return XlaLaunch(devices)


#: The launch this thread's replica belongs to, while its ``_ReplicaJob`` runs (one per thread:
#: on the CPU runtime the replicas are threads of one process).
_current = threading.local()


def launch_rng_state() -> torch.Tensor | None:
    """In a started replica: torch's CPU random state as the calling process had it at launch
    (None where ``fit`` runs in the calling process)."""
    return getattr(_current, "rng_state", None)


def _refuse_cpu_processes_of_torchrun() -> None:
    if _xla.launched_externally() and _xla.requested_device_type() == "CPU" \
            and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "This process is one of several started by torchrun (or a similar launcher), but torch_xla's "
            "CPU runtime cannot run collectives across processes. Start one process instead (python "
            "script.py or xtrainer fit) with Trainer(devices=N): xtrainer runs the N replicas itself.")


def _check_launch_devices(devices: int | None) -> None:
    kind = _xla.requested_device_type()
    local = _xla.local_device_count_without_runtime()
    # torch_xla.launch runs one replica per local device and takes no count: another number of
    # devices cannot be honoured. (Checked against torch_xla's documentation; no TPU here.)
    if devices is not None and local is not None and devices != local:
        raise ValueError(
            f"devices={devices}, but torch_xla.launch runs one replica on each of the {local} local "
            f"{kind} devices. Use devices='auto' (or {local}), or make fewer devices visible to the runtime.")


class ReplicaFailure(Exception):
    """The traceback of a replica's error, as the ``__cause__`` of the error raised in the caller."""


_LAUNCH_PREFIX = "xtrainer-launch-"


_OWNER_LOCK = "owner.lock"


@contextlib.contextmanager
def launch_folder() -> Iterator[str]:
    """A launch's private folder (the job, the results, the first error), removed when the
    launch ends. Its calling process holds an exclusive ``flock`` on ``owner.lock`` in it while
    it runs, which the kernel releases however that process ends: what tells another process,
    in this PID namespace or another one sharing the temporary folder (a container's PID 1, a
    PID that runs again), that the folder's caller is alive. Stale folders are removed first."""
    _remove_stale_launch_folders()
    with tempfile.TemporaryDirectory(prefix=f"{_LAUNCH_PREFIX}{writers.instance()}-") as tmp:
        with open(os.path.join(tmp, _OWNER_LOCK), "wb") as lock:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield tmp


def _owner_alive(folder: str, writer: str) -> bool:
    """Whether the caller of launch folder ``folder`` may still run: its name's instance may
    (``writers.alive``, right within this PID namespace), or its lock is held (or cannot be
    tried): a folder of another namespace whose PID means something else here is judged by its
    lock. A folder without a lock file (an older version's) is judged by its name alone."""
    if not writers.is_instance(writer) or writers.alive(writer):
        return True
    path = os.path.join(folder, _OWNER_LOCK)
    if fcntl is None or not os.path.exists(path):
        return False
    try:
        with open(path, "rb") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: nobody holds it
    except OSError:  # BlockingIOError: held, its caller runs; anything else: cannot tell
        return True
    return False


def _remove_stale_launch_folders() -> None:
    """Remove the private folders of launches whose calling process is gone (killed before it
    could clean up): they hold a copy of the fitted weights each (``launch_folder``)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_LAUNCH_PREFIX):
            continue
        folder = os.path.join(root, name)
        if not _owner_alive(folder, name[len(_LAUNCH_PREFIX):].split("-", 1)[0]):
            shutil.rmtree(folder, ignore_errors=True)


class _ReplicaJob:
    """What a launcher sends to every replica (pickled into the replicas' processes).

    The first replica of each host writes its result to ``result.pt``; the first replica to fail
    writes its error to ``error.pkl`` (created exclusively, so later failures, often caused by
    the first, do not replace it). ``rng_state`` is torch's CPU random state of the calling
    process at launch; ``launch_rng_state()`` returns it while the job runs.
    """

    _copy_lock = threading.Lock()

    def __init__(self, fn: Callable[..., Any], args: tuple, folder: str, rng_state: torch.Tensor,
                 ranks: Callable[[], tuple[int, int, int]] = xla_ranks) -> None:
        self.fn, self.args, self.rng_state, self.ranks = fn, args, rng_state, ranks
        self.result_path = os.path.join(folder, "result.pt")
        self.error_path = os.path.join(folder, "error.pkl")

    def __call__(self) -> None:
        fn, args = self.fn, self.args
        _current.rng_state = self.rng_state
        try:
            if shared_process.current().replicas() > 1:
                # Replicas share this process (threads): each needs its own trainer, module and
                # strategy, as separate processes would have.
                with self._copy_lock:
                    fn, args = copy.deepcopy((fn, args))
            result = fn(*args)
            # The first replica of each host reports to that host's calling process (on a
            # multi-host pod every host runs its own; untested here). Weights are the same on
            # every replica.
            if self.ranks()[2] == 0:
                # Private to this launch (a folder only this user can read, made by the calling
                # process): the result may hold any object the user's hooks return.
                torch.save({"result": result}, self.result_path)
        except BaseException as err:
            self._record_failure(err)
            raise
        finally:
            _current.rng_state = None

    def _record_failure(self, err: BaseException, ranks: tuple[int, int] | None = None) -> bool:
        """Write ``err`` as the launch's failure unless a replica's is there already; whether it
        was the first. ``ranks``: (rank, world size) where ``self.ranks`` does not know them (rank
        0 in the calling process)."""
        rank, world_size = ranks or self.ranks()[:2]
        record = {"rank": rank, "world_size": world_size, "type": type(err).__name__,
                  "message": str(err), "traceback": "".join(traceback.format_exception(err))}
        try:
            payload = pickle.dumps({**record, "exception": err})
            pickle.loads(payload)
        except Exception:  # noqa: BLE001 - an exception that does not travel: send its text
            payload = pickle.dumps({**record, "exception": None})
        try:
            fd = os.open(self.error_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False  # another replica failed first
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        return True

    def raise_failure(self, cause: BaseException | None = None) -> None:
        """Raise the first failed replica's error here, if one failed."""
        if not os.path.exists(self.error_path):
            return
        with open(self.error_path, "rb") as f:  # the launch's own private folder, not a user's file
            record = pickle.load(f)
        where = f"replica {record['rank']} of {record['world_size']}"
        err = record["exception"] or RuntimeError(f"{record['type']}: {record['message']}")
        others = "; the other replicas were stopped" if record["world_size"] > 1 else ""
        if not isinstance(err, TrainingInterrupted):
            err.add_note(f"(raised in {where}{others})")
        remote = ReplicaFailure(f"{where} failed:\n\n{record['traceback']}")
        remote.__cause__ = cause
        raise err from remote

    def result(self) -> Any:
        if not os.path.exists(self.result_path):
            raise RuntimeError("The replicas finished without rank 0 returning a result.")
        # The launch's own private folder (see __call__), not a checkpoint: read in full.
        return torch.load(self.result_path, map_location="cpu", weights_only=False)["result"]


def _replica_main(index: int, job: _ReplicaJob) -> None:
    """A replica process started by ``torch_xla.launch``. On failure the process ends at once:
    its peers may be waiting for it inside a collective, and only ending the process pool stops
    them (torch_xla's launcher then terminates the remaining replica processes)."""
    try:
        # Each replica process gets the platform's SIGTERM itself (untested here: no TPU); the first
        # of each host says so. (The rank comes from the runtime; ``index`` is the local one.)
        with interrupts.graceful(announce=index == 0):
            job()
    except BaseException:
        end_now(1)


def _spmd_main(job: Callable[[], None]) -> None:
    faulthandler.enable()  # a crash in native code still shows the Python stack
    # This process is the SPMD run's own. FSDPv2 hooks an optimization barrier into backward on
    # every unit, the root included; the root is xtrainer's step dispatcher, whose output is a
    # loss or nothing, and torch warns about such hooks on every call. The barrier works all the
    # same.
    for message in ("Full backward hook is firing", "For backward hooks to be called"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    if not _xla.is_spmd():
        _xla.use_spmd()
    try:
        job()
    except BaseException:
        end_now(1)  # the error is in the job's error file; the caller raises it
