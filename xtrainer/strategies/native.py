"""Strategies on standard PyTorch (``torch.distributed``): the same ``XModule`` without torch_xla.

- ``NativeSingle`` (``"native"``): one device, the module as it is.
- ``NativeDDP`` (``"native_ddp"``): ``DistributedDataParallel``, one process per device.
- ``NativeFSDP`` (``"native_fsdp"``): FSDP2 (``torch.distributed.fsdp.fully_shard``), layers
  wrapped by class as the XLA FSDP strategies do, optional activation checkpointing, and sharded
  checkpoints through ``torch.distributed.checkpoint`` that resume at any world size.

Each takes ``compile=True`` (the module's ``forward`` runs through ``torch.compile``). The device
comes from the Trainer's ``accelerator``: the strategy holds an ``EagerRuntime``
(``xtrainer/runtimes/eager.py`` holds every device specific: only ``cpu`` is tested here). Processes: ``devices=N`` runs rank 0 in the calling process
and starts N-1 processes on this host for the others (``NativeProcesses``); under ``torchrun`` (its ``RANK``/``WORLD_SIZE``... in the environment) each
process runs its replica in place (``TorchrunInPlace``), on any number of nodes.

Gradient clipping by norm is by the norm of the whole gradient in all three (``native_fsdp``'s
shards summed with one all-reduce); manual optimization arms DDP's reducer, or FSDP2's gradient
reduce-scatter, for each backward pass of a ``training_step``.

There is no lazy graph: a step runs eagerly. Logged values stay on the device and are read once
per ``log_every_n_steps`` (``add_step_closure`` runs the read at that step's ``sync()``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import tempfile
import time
import warnings
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from xtrainer.checkpoint import writers
from xtrainer.checkpoint.distributed import Distributed, DistributedEntry, DistributedPart, load_into
from xtrainer.checkpoint.format import CheckpointError, check_fits, shapes_of
from xtrainer.launch import interrupts
from xtrainer.launch.hang_monitor import EXIT_CODE as HANG_EXIT_CODE, RunHung
from xtrainer.runtimes import EagerRuntime
from xtrainer.runtimes.eager import to_host
from xtrainer.strategies import launchers
from xtrainer.strategies.base import Strategy, check_wrapper_kwargs
from xtrainer.strategies.collectives import Collectives
from xtrainer.strategies.parallel import ParallelStrategy
from xtrainer.strategies.launchers.processes import NewProcesses, end_now, free_port, killed_by_signal, new_processes

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}
#: The default ``agreement_seconds``: an agreement costs a gloo all-reduce of about 0.1-0.3 ms of
#: CPU time per process here, under 0.1% of the time between two, and a stop or a NaN report
#: waits half a second at most (a preemption notice gives 30 s).
AGREEMENT_SECONDS = 0.5


#: Set in the processes ``NativeProcesses`` starts (they have torch's variables too, but report
#: to the calling process rather than running in place).
_REPLICA_OF_CALLER = "XTRAINER_NATIVE_REPLICA"


def in_process_group_env() -> bool:
    """Whether this process was started as one of a group, with torch's variables."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher like it) started this process as one of a group."""
    return in_process_group_env() and _REPLICA_OF_CALLER not in os.environ


def _store_of_this_attempt(store: dist.Store) -> dist.Store:
    """The key-value store the process group meets in, with a prefix of its own for each of
    torchrun's restarts where every process can agree on one.

    torchrun keeps its store (and the keys in it) across ``--max-restarts``: a restarted process
    could read the address a killed process of the previous attempt published and fail to connect
    ("Gloo connectFullMesh failed ... Connection refused"), depending on which process writes
    first. On one host every process has the same ``TORCHELASTIC_RESTART_COUNT``, so the restart
    count makes a fresh prefix. Across hosts the counts can differ (an agent that restarts because
    another host's worker failed does not count it), so there the keys stay as torch sets them;
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (c10d rendezvous) gives each attempt a new store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.PrefixStore("default_pg", store)  # a store of this attempt's own (as torch names it)
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return dist.PrefixStore("default_pg", store)  # several hosts: see above
    return dist.PrefixStore(f"default_pg/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# ---------------------------------------------------------------------------------------------
# Collectives over the default process group.
# ---------------------------------------------------------------------------------------------
class ProcessGroup(Collectives):
    """The replicas of a native run: one process each, agreeing over ``torch.distributed``'s
    default process group (none with one process). Tensor collectives run when called (there is
    no graph to record them in): the loop calls them only where it reads values anyway."""

    def __init__(self, device: torch.device, agreement_seconds: float = 0.0) -> None:
        self.device, self.agreement_seconds = device, agreement_seconds

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0")) if dist.is_initialized() else 0

    @property
    def node_rank(self) -> int:
        if not dist.is_initialized():
            return 0
        if "GROUP_RANK" in os.environ:  # torchrun's node index
            return int(os.environ["GROUP_RANK"])
        return self.global_rank // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def to_cpu(self, data: Any) -> Any:
        return to_host(data)

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        # a clone, on the group's device: a number logged with sync_dist is a CPU tensor, which
        # nccl (and a native device's own backend) cannot reduce (untested here: gloo takes both)
        reduced = tensor.to(self.device, copy=True)
        dist.all_reduce(reduced, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
        return reduced

    def any_replica(self, vote: int) -> torch.Tensor | int:
        return self.reduce(torch.tensor([vote], dtype=torch.int64, device=self.device), "max")

    def agree(self, vote: int, first: torch.Tensor | None) -> tuple[torch.Tensor | int, torch.Tensor | None]:
        """``agree_later`` waited for at once: the stop vote and the first bad step in one
        all-reduce (its proposal for the next agreement unused)."""
        finish = self.agree_later(vote, first, 0)
        return (vote, first) if finish is None else finish()[:2]

    def agree_later(self, vote: int, first: torch.Tensor | None, next_step: int
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None:
        """The all-reduce (min) of ``[-vote, next_step, first]`` (so the largest vote), started
        without waiting (``async_op``); what this returns waits for it. A blocking one waits for the slowest
        replica: on gloo, once every 10 steps of about 1 ms, it cost 50-75 us of CPU per step here,
        started early and waited later 10-30; ``agreement_seconds`` spaces them out further."""
        if self.world_size == 1:
            return None
        head = torch.tensor([-vote, next_step], dtype=torch.int64, device=self.device)
        both = head if first is None else torch.cat([head, first.to(torch.int64)])
        work = dist.all_reduce(both, op=dist.ReduceOp.MIN, async_op=True)

        def finish() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            work.wait()
            return -both[:1], None if first is None else both[2:], both[1:2]

        return finish

    def all_gather_tensors(self, data: Any) -> Any:
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if self.world_size == 1:
                return tensor.unsqueeze(0)
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous())
            return torch.stack(parts)

        return apply_to_collection(data, torch.Tensor, gather)

    def barrier(self, name: str = "barrier") -> None:
        del name
        if self.world_size > 1:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# ---------------------------------------------------------------------------------------------
# Launching.
# ---------------------------------------------------------------------------------------------
def _env_ranks() -> tuple[int, int, int]:
    """(global rank, world size, local rank) of a process started with torch's variables."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


class InPlace(launchers.Launcher):
    """``fit`` runs in this process: one device, or one process of a group that torchrun (or a
    launcher like it) started, each running its replica."""

    runs_in_caller = True

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def planned_world_size(self) -> int | None:
        return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1


class NativeProcesses(launchers._StartedReplicas):
    """``devices=N``: rank 0 runs in the calling process, as Lightning's ``ddp`` runs it, and
    ranks 1 to N-1 in new processes on this host, with torch's variables (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The caller's module is the
    trained one, with whatever the hooks added to it; nothing comes back from the other ranks
    but their errors. The group meets in a store that the caller serves on a free port, one per
    launch; the caller's place in it is given to its strategy here (``_caller_rank``), not in
    ``os.environ``, which stays as it was (a later Trainer would take torch's variables there for
    torchrun's). The started processes end with the calling process, which forwards
    SIGTERM/SIGINT to each; the caller's process group is gone when the stage ends.

    ``timeout_seconds``: how long rank 0 waits for the other ranks to join (one that ends before
    it does ends the wait at once)."""

    runs_in_caller = True
    group_ends_with_stage = True
    ranks = staticmethod(_env_ranks)

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
        global _caller_rank
        n = int(self.devices or 1)
        what = f"Trainer(devices={n})"
        launchers._remove_stale_launch_folders()
        with tempfile.TemporaryDirectory(prefix=f"{launchers._LAUNCH_PREFIX}{writers.instance()}-") as tmp, \
                _intra_op_threads_here(n):
            # Pickled before rank 0 runs here: the other ranks start from the module as it is now.
            job = launchers._ReplicaJob(fn, args, tmp, torch.get_rng_state(), _env_ranks)
            store, port = _serve_store(self.timeout_seconds)
            envs = [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                     "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), _REPLICA_OF_CALLER: "1",
                     **_intra_op_threads(n)}
                    for rank in range(1, n)]
            own: BaseException | None = None
            first = False
            with new_processes(_process_main, (job,), envs, what, hookless_tensors=True) as started:
                _caller_rank = _CallerRank(store, n, lambda: self._wait_for_peers(store, started, n))
                try:
                    result = fn(*args)
                    _leave_group(barrier=True)  # every rank past its last collective first
                except BaseException as err:
                    own = err
                    first = not isinstance(err, _PeerEnded) and job._record_failure(err, (0, n))
                    # Those that failed too end by themselves; the others may wait for rank 0 in a collective.
                    started.end(grace=30.0 if isinstance(err, interrupts.TrainingInterrupted) else 5.0, patience=2.0)
                    _leave_group(barrier=False)
                finally:
                    _caller_rank = None
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
                    raise launchers._killed_error(*killed, finished=False) from own
                if HANG_EXIT_CODE in self._codes:
                    raise RunHung(launchers.HANG_ENDED) from own
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
        while (joined := store.add(_JOINED_KEY, 0)) < n - 1:
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


#: A key of the store the group meets in: each started rank adds 1 once its rendezvous is done.
_JOINED_KEY = "xtrainer/joined"


class _CallerRank:
    """Rank 0 of ``NativeProcesses``, in the calling process: the store its group meets in, the
    world size, and the wait for the other ranks (raises when one cannot come)."""

    def __init__(self, store: dist.Store, world_size: int, wait_for_peers: Callable[[], None]) -> None:
        self.store, self.world_size, self.wait_for_peers = store, world_size, wait_for_peers


#: While the calling process runs rank 0 of ``NativeProcesses``: its place in the group.
_caller_rank: _CallerRank | None = None


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


def _leave_group(barrier: bool) -> None:
    """The caller's process group gone at the end of its stage (the next launch makes its own);
    ``barrier``: after every rank has reached this point (a rank that closes its connections
    while a peer still reads its last message aborts that peer, on gloo)."""
    if not dist.is_initialized():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()


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


# ---------------------------------------------------------------------------------------------
# The strategies.
# ---------------------------------------------------------------------------------------------
class NativeSingle(Strategy):
    """One process on one device of standard PyTorch (``accelerator``: ``cpu``, ``cuda``, or a
    native backend's ``tpu``/``neuron``, untested here). The base of the native family.

    Args:
        compile: run the module's ``forward`` through ``torch.compile``.
        compile_kwargs: passed to ``torch.compile`` (``mode``, ``fullgraph``, ``dynamic``...).
        timeout_seconds: how long a collective may wait for the other processes.
        agreement_seconds: with several processes, the least time between two of their
            agreements on stopping (a signal, ``should_stop``, ``max_time``) and on a non-finite
            loss. Each is an all-reduce of its own, started at a logging step and settled after
            the next batch; 0 starts one at every logging step. A stop is taken, and a non-finite
            loss reported, up to this long (and a batch) after it was asked for or happened.
    """

    name = "native"
    #: The ``devices`` this strategy accepts: only 1 for ``NativeSingle``.
    multi_process: ClassVar[bool] = False

    def __init__(self, compile: bool = False, compile_kwargs: dict[str, Any] | None = None,
                 timeout_seconds: float = 1800.0, agreement_seconds: float = AGREEMENT_SECONDS) -> None:
        super().__init__()
        if isinstance(agreement_seconds, bool) or not isinstance(agreement_seconds, (int, float)) \
                or not agreement_seconds >= 0:
            raise ValueError(f"{type(self).__name__}(agreement_seconds={agreement_seconds!r}): give seconds, 0 or more.")
        self.compile, self.compile_kwargs, self.timeout_seconds = compile, dict(compile_kwargs or {}), timeout_seconds
        self.agreement_seconds = float(agreement_seconds)
        self.runtime.compiling = compile
        self.accelerator = "auto"
        self._owns_process_group = False
        self.collectives = ProcessGroup(torch.device("cpu"))

    def _make_runtime(self) -> EagerRuntime:
        return EagerRuntime("cpu")  # until configure() names the device

    # ---- configuration --------------------------------------------------------------------
    def _check_accelerator(self, accelerator: str, num_nodes: int) -> None:
        self.accelerator = str(accelerator).lower()
        self.runtime = EagerRuntime.for_accelerator(self.accelerator)  # refuses what this host cannot run
        self.runtime.compiling = self.compile
        if num_nodes == 1:
            return
        if not under_torchrun():  # several hosts are started by their launcher, each host's processes in place
            raise ValueError(f"num_nodes={num_nodes}: the native strategies run on several hosts under torchrun (or a "
                             f"launcher like it): start each host's processes with torchrun --nnodes={num_nodes}, "
                             "or leave num_nodes=1.")
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if world != num_nodes * local:
            raise ValueError(f"num_nodes={num_nodes}, but the launcher started {world} processes, {local} on this host "
                             f"({world // max(local, 1)} host(s)): give num_nodes={world // max(local, 1)}, or start "
                             f"{num_nodes} hosts.")

    def _resolve_devices(self, devices: int | str) -> int | None:
        if under_torchrun():
            if int(os.environ["WORLD_SIZE"]) > 1 and not self.multi_process:
                raise ValueError(f"strategy={self.name!r} runs on one device, but torchrun started "
                                 f"{os.environ['WORLD_SIZE']} processes: use 'native_ddp' or 'native_fsdp'.")
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local is not None:
                self._check_local_count(int(local), f"torchrun started {local} processes on this host")
            return int(os.environ["WORLD_SIZE"])
        if devices == "auto":
            return self.runtime.local_device_count() if self.multi_process else 1
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r}: give a positive int or 'auto'.")
        if devices > 1 and not self.multi_process:
            raise ValueError(f"devices={devices}: strategy={self.name!r} "
                             "runs on one device; use 'native_ddp' or 'native_fsdp' for several.")
        self._check_local_count(devices, f"devices={devices}")
        return devices

    def _check_local_count(self, processes: int, asked: str) -> None:
        """Refuses more processes on this host than it has devices of the kind. Only the CPU,
        which takes any number, runs here: the test gives the host a device count."""
        kind = self.runtime.type
        if kind != "cpu" and processes > (here := self.runtime.local_device_count()):
            raise ValueError(f"{asked}, but this host has {here} {kind} device(s): start {here} or fewer "
                             f"processes per host, and more hosts (torchrun --nnodes) for more.")

    @property
    def launcher(self) -> launchers.Launcher:
        if _REPLICA_OF_CALLER in os.environ or (self.devices != 1 and not under_torchrun()):
            return NativeProcesses(self.devices, self.timeout_seconds)  # in its replicas too: they report to the caller
        return InPlace(self.devices)

    def setup_environment(self) -> None:
        import datetime

        runtime = self.runtime
        caller, grouped = _caller_rank, in_process_group_env()
        device = runtime.start(int(os.environ["LOCAL_RANK"]) if grouped and caller is None else 0)
        self.precision.device_type = runtime.autocast_device_type
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        options: dict[str, Any] = {}
        if device.type != "cpu":
            options["device_id"] = device  # untested here: no accelerator
        if caller is not None and not dist.is_initialized():  # rank 0 of NativeProcesses, in the calling process
            caller.wait_for_peers()
            dist.init_process_group(runtime.process_group_backend(), store=dist.PrefixStore("default_pg", caller.store),
                                    rank=0, world_size=caller.world_size, timeout=timeout, **options)
            self._owns_process_group = True
        elif grouped and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
            with interrupts.ending_at_once():  # joining the process group: nothing to save yet
                store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
                store.set_timeout(timeout)
                if _REPLICA_OF_CALLER in os.environ:  # a rank of NativeProcesses: its caller serves the store
                    store.add(_JOINED_KEY, 1)  # rank 0 waits for every rank's, watching that none ended
                    group_store = dist.PrefixStore("default_pg", store)
                else:
                    group_store = _store_of_this_attempt(store)
                dist.init_process_group(runtime.process_group_backend(), store=group_store, rank=rank,
                                        world_size=world_size, timeout=timeout, **options)
            self._owns_process_group = True
        self.collectives = ProcessGroup(device, self.agreement_seconds)
        _rank_zero_only_rank(self.global_rank)

    # ---- the module -----------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self.compile:
            module.module.compile(**self.runtime.compile_options(self.compile_kwargs))  # compiled on first call
        return self._wrap(module)

    def _wrap(self, module: nn.Module) -> nn.Module:
        return module

    def clip_gradients(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer, value: float,
                       algorithm: str) -> None:
        """Clip the reduced gradients of ``optimizer``: by the norm of the whole gradient, or each
        element to ``[-value, value]``. Gradients that FSDP2 shards (DTensors) are clipped by the
        norm of all their shards together, as one process clips the whole gradient; the norm is
        computed once, the square root of the sum of every element's square, the same way
        whatever the world size. Everything stays on the device (no host sync); sharded gradients
        cost one all-reduce of one number."""
        del wrapped
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        shards = [_local(grad) for grad in grads]
        if algorithm == "value":
            for shard in shards:
                shard.clamp_(-value, value)
            return
        norm = _gradient_norm(grads, shards)
        coefficient = torch.clamp(value / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        # One multiply over each group of shards of one device and dtype (torch's foreach kernels,
        # as clip_grads_with_norm_ uses), by the coefficient in their dtype: the same products as
        # one mul_ per shard, without a kernel launch per tensor.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for shard in shards:
            groups.setdefault((shard.device, shard.dtype), []).append(shard)
        for (device, dtype), group in groups.items():
            torch._foreach_mul_(group, coefficient.to(device=device, dtype=dtype))

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        self.runtime.drop_closures()
        super().teardown(wrapped, failed)


def _rank_zero_only_rank(rank: int) -> None:
    """Tell lightning-utilities' rank-zero helpers which rank this process is."""
    rank_zero_only.rank = rank


class NativeDDP(NativeSingle, ParallelStrategy):
    """``DistributedDataParallel`` over the processes: rank 0's weights are broadcast when the
    module is wrapped, gradients are all-reduced (averaged) in backward, each process steps.

    A resumed run ends bitwise equal to an uninterrupted one only if every step sums each gradient
    element over the processes in the same order. DDP lays its gradient buckets out once when the
    module is wrapped and again, in the order the first backward produced gradients, after that
    backward (unless ``find_unused_parameters=True`` without ``static_graph``): the first step
    after a resume runs on another layout than the uninterrupted run did at that step. A ring
    all-reduce adds each element's terms in an order that depends on where the element lies in
    its bucket; two terms add the same either way, three or more do not. So, at 3 processes or
    more, ``reduce_in_rank_order`` sums each bucket in rank order instead (``_rank_order_mean``),
    which no layout changes. It moves the bytes of a ring all-reduce, but waits in backward for
    the first of its two collectives and takes up to two more buffers of a bucket's size: 4 gloo
    processes on 2 cores took 84-96 ms for a forward and backward of a 2.1M-parameter MLP,
    against DDP's 63-68 ms.

    Args:
        compile, compile_kwargs, timeout_seconds, agreement_seconds: as ``NativeSingle``.
        reduce_in_rank_order: ``None`` (the default): sum the gradients in rank order over gloo at
            3 processes or more, where DDP rebuilds its buckets; over another backend (nccl)
            DDP's all-reduce stands, and a resume there at 3 processes or more is close but not
            bitwise. ``True``: in rank order on any backend, at 3 processes or more. ``False``:
            DDP's all-reduce always.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``gradient_as_bucket_view``, ``static_graph``...).
    """

    name = "native_ddp"
    multi_process = True
    reduces_wrapped_trainable_only = True

    def __init__(self, compile: bool = False, compile_kwargs: dict[str, Any] | None = None,
                 timeout_seconds: float = 1800.0, agreement_seconds: float = AGREEMENT_SECONDS,
                 reduce_in_rank_order: bool | None = None, **ddp_kwargs: Any) -> None:
        super().__init__(compile, compile_kwargs, timeout_seconds, agreement_seconds)
        if reduce_in_rank_order is not None and not isinstance(reduce_in_rank_order, bool):
            raise ValueError(f"NativeDDP(reduce_in_rank_order={reduce_in_rank_order!r}): give None, True or False.")
        check_wrapper_kwargs(nn.parallel.DistributedDataParallel, ddp_kwargs, NativeDDP, "DistributedDataParallel")
        self.ddp_kwargs, self.reduce_in_rank_order = ddp_kwargs, reduce_in_rank_order

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return module
        device_ids = [self.device] if self.device.type != "cpu" else None
        wrapped = nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        if self._reduces_in_rank_order(wrapped):
            wrapped.register_comm_hook(wrapped.process_group, _rank_order_mean)
        return wrapped

    def _reduces_in_rank_order(self, wrapped: nn.parallel.DistributedDataParallel) -> bool:
        """Whether ``wrapped`` sums its buckets in rank order: where its own all-reduce would add
        a step's terms in another order after a resume (see the class)."""
        if self.reduce_in_rank_order is False or self.world_size <= 2:
            return False  # a + b == b + a: two processes' sums do not depend on the layout
        if wrapped.find_unused_parameters and not wrapped.static_graph:
            return False  # DDP never lays its buckets out again
        return self.reduce_in_rank_order is True or dist.get_backend(wrapped.process_group) == "gloo"

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module if isinstance(wrapped, nn.parallel.DistributedDataParallel) else wrapped

    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and isinstance(wrapped, nn.parallel.DistributedDataParallel):
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def manual_backward(self, wrapped: nn.Module, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Each backward pass of manual optimization arms DDP's reducer (``ddp.arm_reducer``):
        a ``training_step`` may run several."""
        from xtrainer.strategies.xla_ddp import arm_reducer, rebuild_buckets

        arm_reducer(wrapped, loss)
        self.backward(loss, *args, **kwargs)
        rebuild_buckets(wrapped)


def _rank_order_mean(group, bucket):  # unannotated: DDP checks a hook's annotations as objects
    """A DDP communication hook: a future of the mean of ``bucket`` (a ``dist.GradBucket``) over
    the processes of ``group``, each element's parts added in rank order (rank 0's, then rank
    1's...) wherever the element lies in the bucket. Each process's part is first multiplied by
    1 / world size, as DDP's own reduction does while copying gradients into a bucket (exact at a
    power of two). The bucket, padded to a multiple of the world size, is split into one chunk per
    process; an all-to-all brings each process every process's part of its chunk, which it adds
    in rank order, and an all-gather brings the summed chunks to every process. The all-to-all is
    waited for here, so that every process issues its collectives in one order (the autograd
    thread's, bucket after bucket). The same bits at every step however DDP laid out its buckets:
    a resumed run adds as the uninterrupted one did."""
    world = group.size()
    buffer = bucket.buffer()
    size = buffer.numel()
    chunk = -(-size // world)
    if chunk * world == size:
        padded = buffer
    else:
        padded = buffer.new_zeros(chunk * world)
        padded[:size].copy_(buffer)
    padded.mul_(1.0 / world)
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group)
    parts = received.view(world, chunk)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    work = dist.all_gather_into_tensor(padded, total, group=group, async_op=True)
    return work.get_future().then(lambda _: padded[:size])


class NativeFSDP(NativeSingle, ParallelStrategy):
    """FSDP2: ``torch.distributed.fsdp.fully_shard`` on every layer the policy names, then on the
    whole module; parameters, gradients and optimizer state are sharded over the processes.

    Args:
        auto_wrap_policy: which layers become units of their own, as for ``XlaFSDP``: layer
            classes, their names, ``"auto"`` (a Hugging Face model's ``_no_split_modules``), or
            None (the whole module is one unit).
        activation_checkpointing: recompute each unit's activations in backward
            (``torch.utils.checkpoint``, non-reentrant).
        reshard_after_forward: FSDP2's choice (True: ZeRO-3; False: keep gathered until backward).
        compile, compile_kwargs, timeout_seconds, agreement_seconds: as ``NativeSingle``.
        **fsdp_kwargs: passed to ``fully_shard`` (``mp_policy``, ``offload_policy``...).
    """

    name = "native_fsdp"
    multi_process = True
    shards_parameters = True

    def __init__(self, auto_wrap_policy: Any = None, activation_checkpointing: bool = False,
                 reshard_after_forward: bool = True, compile: bool = False,
                 compile_kwargs: dict[str, Any] | None = None, timeout_seconds: float = 1800.0,
                 agreement_seconds: float = AGREEMENT_SECONDS, **fsdp_kwargs: Any) -> None:
        super().__init__(compile, compile_kwargs, timeout_seconds, agreement_seconds)
        from torch.distributed.fsdp import fully_shard

        from xtrainer.strategies.wrap_policies import policy_kind

        if policy_kind(auto_wrap_policy) in ("size", "callable"):
            raise ValueError(f"NativeFSDP(auto_wrap_policy={auto_wrap_policy!r}): FSDP2 shards the layers it is given; "
                             "name them by class ({Block}, 'Block', or 'no_split_modules'), not by a parameter count "
                             "or a torch_xla policy.")
        check_wrapper_kwargs(fully_shard, fsdp_kwargs, NativeFSDP, "fully_shard")
        self.auto_wrap_policy, self.activation_checkpointing = auto_wrap_policy, activation_checkpointing
        self.reshard_after_forward, self.fsdp_kwargs = reshard_after_forward, fsdp_kwargs
        self._manual = False
        self._root: nn.Module | None = None  # the module fully_shard made the root (several processes)

    def _wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from xtrainer.strategies.wrap_policies import policy_layer_classes

        classes = tuple(policy_layer_classes(self.auto_wrap_policy, module.module))
        units = [m for m in module.module.modules() if classes and isinstance(m, classes) and m is not module.module]
        if self.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            wrapped_ids = {id(m) for m in units}
            # Private API of torch (what its FSDP tutorials use): each unit's forward recomputed in backward.
            apply_activation_checkpointing(module.module, check_fn=lambda m: id(m) in wrapped_ids)
            units = [m for m in module.module.modules()
                     if type(m).__name__ == "CheckpointWrapper" and id(getattr(m, "_checkpoint_wrapped_module", None))
                     in wrapped_ids]
        if self.world_size == 1:
            return module  # nothing to shard over; checkpoints are still distributed folders
        kwargs = {"reshard_after_forward": self.reshard_after_forward, **self.fsdp_kwargs}
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)
        self._root = module
        return module

    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and hasattr(wrapped, "set_requires_gradient_sync"):  # sharded (more than one process)
            return _gradient_sync_off(wrapped)
        return contextlib.nullcontext()

    def setup_optimizers(self, module: nn.Module, configure: Callable[[], Any], manual: bool = False) -> Any:
        self._manual = manual
        return super().setup_optimizers(module, configure, manual)

    def manual_backward(self, wrapped: nn.Module, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """A backward pass of manual optimization. ``training_step`` runs inside the forward of the
        sharded root (the dispatcher), so FSDP2 never sees this backward on its own: the loss gets
        the root's pre-backward hook (what FSDP2's post-forward gives a forward's outputs), which
        reduce-scatters every gradient into its shard at the end of the backward and reshards the
        root's parameters; they are gathered again for the rest of ``training_step``."""
        state = _fsdp_state(wrapped)
        if state is None or not torch.is_grad_enabled():  # one process: nothing is sharded
            self.backward(loss, *args, **kwargs)
            return
        register = getattr(state, "_register_pre_backward_hook", None)  # private API of torch's FSDP2 (see above)
        if register is None:
            raise RuntimeError(f"Manual optimization under native_fsdp needs FSDP2's pre-backward hook, which torch "
                               f"{torch.__version__} does not have: use automatic optimization, or native_ddp.")
        loss = register(loss)
        self.backward(loss, *args, **kwargs)
        wrapped.unshard()  # an all-gather of the root's parameters, on the device

    def requires_grad_changed(self, wrapped: nn.Module) -> None:
        """FSDP2 gives its gathered parameters the ``requires_grad`` of their shards only when it
        gathers them. Under manual optimization the root's parameters stay gathered for the rest
        of ``training_step`` (regathered after each backward and step), so a toggle between a
        step and the next forward would not reach them: it is copied to every parameter that is
        gathered now. Uses FSDP2's private per-parameter records (``_fsdp_param_group``), where
        torch has them; without them the next gathering copies it, as FSDP2 does."""
        for module in wrapped.modules():
            group = getattr(_fsdp_state(module), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", ()):
                gathered = getattr(fsdp_param, "_unsharded_param", None)
                wanted = fsdp_param.sharded_param.requires_grad
                if gathered is not None and gathered.requires_grad != wanted:
                    gathered.requires_grad_(wanted)

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        """Under manual optimization the step runs inside ``training_step``: the root's
        parameters, gathered before it, are gathered again so the rest of the step sees the
        stepped weights (units gather their own in their forward)."""
        super().optimizer_step(optimizer, before_step)
        root = self._root
        if self._manual and root is not None and _fsdp_state(root) is not None:
            root.reshard()
            root.unshard()  # an all-gather on the device, no host sync

    # ---- checkpoints: sharded, through torch.distributed.checkpoint -----------------------
    @property
    def checkpoint_layout(self) -> Distributed:
        """Folders through ``torch.distributed.checkpoint``: each process writes its own shards;
        any number of processes resumes them (DCP reshards on load); a whole file loads too."""
        return Distributed(spmd=False)

    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        return self.unwrap(wrapped).module.state_dict()  # DTensors: each process its shards

    def full_module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The whole weights on every process: each shard gathered (a collective of all processes)."""
        return {name: _full(tensor) for name, tensor in self.module_state_dict(wrapped).items()}

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        module = self.unwrap(wrapped).module
        live = module.state_dict()
        state = checkpoint["state_dict"]
        if isinstance(state, DistributedPart):
            check_fits(live, {entry.where[0]: entry.shape for entry in state.entries})
            target = {"state_dict": live}
            load_into(target, state.path, spmd=False)  # into the live shards, in place
            return
        check_fits(live, shapes_of(state))
        module.load_state_dict({name: _shard_like(live[name], value) for name, value in state.items()})

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Any) -> None:
        """From a distributed checkpoint each process reads its shards of the saved state (at any
        world size); from a whole file each state tensor is sharded as its parameter is."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if isinstance(state, DistributedPart):
            state = self._read_optimizer_state(params, state)
        else:
            state = {**state, "state": {index: {key: _shard_like(params[int(index)], value)
                                                if isinstance(value, torch.Tensor) else value
                                                for key, value in values.items()}
                                        for index, values in state.get("state", {}).items()}}
        optimizer.load_state_dict(state)

    def _read_optimizer_state(self, params: list[torch.Tensor], part: DistributedPart) -> dict[str, Any]:
        from xtrainer.strategies.xla_spmd import _place

        target: dict[Any, Any] = {"state": {}}  # an optimizer that has not stepped saves no state
        for entry in part.entries:
            if entry.where[0] == "state" and len(entry.where) == 3:  # ("state", parameter index, name)
                index = int(entry.where[1])
                if index >= len(params):
                    raise CheckpointError(
                        f"{part.path!r} holds optimizer state for parameter {index}, but the optimizer has "
                        f"{len(params)} parameters: is it a checkpoint of another model or optimizer?")
                value = _empty_like_saved(params[index], entry) if entry.shape is not None else None
                target["state"].setdefault(entry.where[1], {})[entry.where[2]] = value
            else:  # param_groups, and anything else the optimizer saved (keys as the loader names them)
                _place(target, tuple(str(key) for key in entry.where), None)
        load_into({"optimizer_states": {part.key.split(".")[1]: target}}, part.path, spmd=False)
        groups = target.get("param_groups", {})
        return {**target, "state": {int(index): value for index, value in target["state"].items()},
                "param_groups": [groups[key] for key in sorted(groups, key=int)]}

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        """The user's module back as it was given, with the whole trained weights: FSDP2's
        sharding and activation-checkpointing wrappers taken off, so that after a fit under
        torchrun (where the module stays in the process) it runs forward on its own, saves plain
        tensors under its own names, and a later ``validate``/``test`` shards it afresh. Gathering
        the weights is a collective: every process tears down at the same point."""
        self._root, self._manual = None, False
        if failed and self.world_size > 1:
            return  # as the base: this process's copy is discarded, and a peer may be gone
        _unshard_for_good(wrapped)
        _unwrap_checkpointing(self.unwrap(wrapped).module)
        super().teardown(wrapped, failed)


def _unshard_for_good(root: nn.Module) -> None:
    """Undo ``fully_shard`` on ``root`` and every module under it: each sharded parameter replaced
    by a plain one holding the whole tensor (gathered in the same order on every process; shared
    parameters stay shared), FSDP2's forward and state-dict hooks, state and class removed (the
    module pickles again, for the processes of a later stage). torch has no public
    way back (tested with torch 2.9 and 2.13): the internals used are named here, and a torch that
    moved them gets the module with its whole weights and a warning."""
    from torch.distributed.fsdp import FSDPModule

    whole: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if _is_dtensor(param):
                if id(param) not in whole:
                    whole[id(param)] = nn.Parameter(param.full_tensor().detach(), requires_grad=param.requires_grad)
                setattr(module, name, whole[id(param)])
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            from torch.distributed import _composable_state

            contract = importlib.import_module("torch.distributed._composable.contract")  # the package exports a function of that name

            state = module._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            for key in (contract.STATE_KEY, contract.REGISTRY_KEY):
                entries = module.__dict__.get(key)
                if isinstance(entries, dict):
                    for name in [k for k in entries if getattr(k, "__name__", k) == "fully_shard"]:
                        del entries[name]
            _composable_state._module_state_mapping.pop(module, None)
            module.__class__ = next(base for base in type(module).__bases__ if not issubclass(base, FSDPModule))
        except (AttributeError, ImportError, StopIteration) as err:
            warnings.warn(f"native_fsdp: the module keeps FSDP2's hooks after the fit ({err}); its weights are "
                          "whole. Run it through trainer.validate/test, or rebuild it and load its state_dict.",
                          stacklevel=2)
            return
    for module in root.modules():
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(attr, None)
        # FSDP2's state-dict hooks, on the modules that held its parameters (local functions of
        # its own: the module would not pickle for a later stage's processes)
        for attr in ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks"):
            hooks = getattr(module, attr, None)
            for key, hook in list(hooks.items()) if isinstance(hooks, dict) else ():
                if getattr(getattr(hook, "hook", hook), "__module__", "").startswith("torch.distributed.fsdp"):
                    del hooks[key]


def _unwrap_checkpointing(module: nn.Module) -> None:
    """Take the activation-checkpointing wrappers (``CheckpointWrapper``) out of ``module``: each
    wrapped layer back in its place, under its own name."""
    for parent in module.modules():
        for name, child in list(parent.named_children()):
            inner = getattr(child, "_checkpoint_wrapped_module", None)
            if type(child).__name__ == "CheckpointWrapper" and isinstance(inner, nn.Module):
                setattr(parent, name, inner)


@contextlib.contextmanager
def _gradient_sync_off(wrapped: nn.Module) -> Iterator[None]:
    """FSDP2 without reduce-scattering gradients (accumulating micro-batches)."""
    wrapped.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _fsdp_state(module: nn.Module) -> Any:
    """FSDP2's state of ``module`` if ``fully_shard`` sharded it, else None."""
    get = getattr(module, "_get_fsdp_state", None)  # FSDPModule's (torch's FSDP2)
    return get() if callable(get) else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds (a DTensor's local shard; else itself)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _squares(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s squared elements, in at least float32."""
    flat = tensor.reshape(-1).to(torch.promote_types(tensor.dtype, torch.float32))
    return torch.dot(flat, flat)


def _gradient_norm(grads: list[torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the whole gradient, on the device: ``grads`` as the parameters hold them,
    ``shards`` their local parts. A sharded gradient's squares are summed over its shards (one
    all-reduce for all of them); a replicated one's (a whole tensor, or a DTensor with a
    ``Replicate`` placement) count once."""
    sharded, whole, group = [], [], None
    for grad, shard in zip(grads, shards):
        if not _is_dtensor(grad):
            whole.append(_squares(grad))
        elif grad.device_mesh.ndim == 1 and grad.placements[0].is_shard():  # fully_shard's
            sharded.append(_squares(shard))
            group = grad.device_mesh.get_group()
        else:  # not fully_shard's over one mesh dimension: gathered whole (every process calls this)
            whole.append(_squares(grad.full_tensor()))
    dtype = torch.promote_types(torch.float32, shards[0].dtype)
    for part in sharded + whole:
        dtype = torch.promote_types(dtype, part.dtype)
    total = torch.zeros((), dtype=dtype, device=shards[0].device)
    if sharded:
        total = torch.stack([part.to(dtype) for part in sharded]).sum()
        dist.all_reduce(total, group=group)  # a collective on the device, no host sync
    if whole:
        total = total + torch.stack([part.to(dtype) for part in whole]).sum()
    return total.sqrt()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def _shard_like(live: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A whole ``value`` as ``live`` holds it: sharded over the same mesh if ``live`` is."""
    if not _is_dtensor(live) or _is_dtensor(value) or value.shape != live.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(device=live.device_mesh.device_type, dtype=live.dtype), live.device_mesh,
                             live.placements)


def _empty_like_saved(param: torch.Tensor, entry: DistributedEntry) -> torch.Tensor:
    """A tensor for a saved optimizer value to be read into: sharded as ``param`` if it has the
    parameter's shape, else a plain one (scalars such as Adam's ``step``)."""
    if entry.shape == tuple(param.shape) and _is_dtensor(param):
        return _shard_like(param, torch.zeros(entry.shape, dtype=entry.dtype))
    return torch.zeros(entry.shape, dtype=entry.dtype)
