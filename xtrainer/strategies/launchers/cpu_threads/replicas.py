"""The replicas' process: what its replica threads share, installed before any of them exists.

``process_main`` runs in the new process that ``cpu_threads.launch`` starts. It checks the
torch_xla version, builds the one ``ThreadReplicas`` of the process and installs it: as this
process's ``shared_process`` (what strategies ask: how many replicas the process runs, the lock
to build modules under, how DDP starts), and as torch_xla's graph cut, device-to-host read,
collectives and rendezvous. Then it runs the job in one thread per device.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import pickle
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from xtrainer._lazy_xla import xla as _xla
from xtrainer.launch import watchdog
from xtrainer.strategies import shared_process
from xtrainer.strategies.launchers.processes import end_now
from xtrainer.strategies.launchers.cpu_threads import collectives

#: Seconds the first failing replica gives the others to stop at a graph cut or barrier (and
#: flush their logs) before it ends the process. Replicas blocked inside an XLA collective that
#: waits for the failed one cannot stop by themselves; ending the process stops them.
PEER_STOP_GRACE_SECONDS = 3.0


class PeerReplicaFailed(RuntimeError):
    """Raised in a replica when another replica of the same run has failed."""


def check_version() -> None:
    if not _xla.TESTED_TORCH_XLA:
        raise RuntimeError(
            f"Several replicas on the XLA CPU runtime rely on torch_xla internals that xtrainer checked "
            f"with torch_xla 2.9 only; this is torch_xla {_xla.TORCH_XLA_VERSION}, where they could hang. "
            "Install torch_xla 2.9 (pip install 'torch_xla==2.9.*' 'torch==2.9.*'), or use devices=1.")


class ThreadReplicas(shared_process.SharedProcess):
    """What the replica threads of this process share, and its answers to what strategies ask of
    the process (``shared_process.SharedProcess``)."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.cut_lock = threading.RLock()  # one replica traces and compiles at a time (computing_alone re-enters)
        self._construction_lock = threading.Lock()  # modules are built with the global CPU RNG
        self.meeting = threading.Barrier(devices)
        self.payloads: list[bytes] = [b""] * devices
        self.state = threading.Condition()
        self.running = 0
        self.failed = False

    def check_peers(self) -> None:
        if self.failed:
            raise PeerReplicaFailed("Another replica of this run failed; this one stops too.")

    # ---- what strategies ask of the process ------------------------------------------------
    def replicas(self) -> int:
        return self.devices

    def construction_lock(self) -> contextlib.AbstractContextManager:
        """Replica threads share torch's CPU random generator: they build modules in turn."""
        return self._construction_lock

    @contextlib.contextmanager
    def computing_alone(self) -> Iterator[None]:
        """Device work that C++ runs and reads outside the serialised cut (torchmetrics' boolean-mask
        index in a macro F1's ``compute()`` runs the pending graph from C++): two replicas doing it
        at once crashed the process (signal 11) in one 60-epoch run of three. The pending graph
        (an all-gather of the metric's states) is cut first, as every replica does it, and the
        work then runs holding the cut's lock: its own cuts and reads take it again."""
        self.sync()
        with self.cut_lock:
            yield

    def wrap_ddp(self, module: nn.Module, kwargs: dict[str, Any]) -> DistributedDataParallel:
        """DDP's start-up (``init_sync``) reads XLA tensors outside the serialised graph cut: it is
        done by ``start_ddp`` instead."""
        if not kwargs.get("init_sync", True):
            return DistributedDataParallel(module, **kwargs)
        wrapped = DistributedDataParallel(module, **{**kwargs, "init_sync": False})
        states = [p for name, p in module.named_parameters() if name not in wrapped.parameters_to_ignore]
        if wrapped.broadcast_buffers:
            states += [b for name, b in module.named_buffers() if name not in wrapped.parameters_to_ignore]
        self.start_ddp(states)
        return wrapped

    def start_ddp(self, tensors: list[torch.Tensor]) -> None:
        """What ``DistributedDataParallel`` does when it starts (check that every replica holds the
        same shapes, then give everyone rank 0's values), done through this process's rendezvous
        and serialised cut. DDP's own check reads the gathered shapes with ``.item()`` from C++,
        which compiles and runs a graph outside the serialised cut, in every replica at once: a
        process crashed there (signal 11) in one run of many."""
        mine = pickle.dumps([(tuple(t.shape), str(t.dtype)) for t in tensors])
        for rank, theirs in enumerate(self.rendezvous(mine)):
            if theirs != mine:
                raise RuntimeError(
                    f"DistributedDataParallel: replica {rank} holds parameters or buffers of other shapes or "
                    f"dtypes than replica {_xla.global_rank()}; every replica must build the same module.")
        if tensors:
            self.check_peers()
            _xla.collective_broadcast(tensors, 0)
            self.sync()

    # ---- what it installs in torch_xla -------------------------------------------------------
    def sync(self, wait: bool = False, reset_scope: bool = True) -> None:
        """``torch_xla.sync()`` for thread replicas: the cut is taken under a process-wide lock (one
        compilation, one executable for all), then this replica's execution is awaited with the GIL
        released, and only then do step closures run and the all-reduce token go."""
        del wait  # always waits: see above
        self.check_peers()
        device = _xla.default_device_name()
        with self.cut_lock:
            _xla.step_marker(device, reset_scope)
        _xla.wait_device_ops_of(device)
        _xla.end_step()

    def compute_for_native_read(self, tensors: list[torch.Tensor]) -> None:
        """The int32 results of the process group's collectives, which DDP's reducer reads from
        C++ right after (its map of the parameters each replica used, with
        ``find_unused_parameters=True``; its bucket order): computed now through the serialised
        cut, so that the read only transfers: read as they were, each replica compiled and ran a
        graph outside the cut, as every replica did at once."""
        with self.cut_lock:
            _xla.launch_graph_of(tensors)
        for device in sorted({str(t.device) for t in tensors}):
            _xla.wait_device_ops_of(device)

    def read_after_cut(self, convert: Callable[[Any], Any], data: Any, *args: Any, **kwargs: Any) -> Any:
        """Device-to-host reads run the pending graph through the serialised cut first. Host data
        (a rendezvous of Python objects) needs no cut: a cut would also advance the replica's XLA
        random generator, so a run that rendezvouses more often (a resumed one) would draw other
        numbers."""
        if _holds_xla_tensor(data):
            self.sync()
        return convert(data, *args, **kwargs)

    def rendezvous(self, payload: bytes = b"", ordinals: Any = None, tag: str | None = None) -> list[bytes]:
        """``xm.xla_rendezvous`` for thread replicas: the threads meet in Python, without compiling
        and running XLA collectives for each payload size."""
        del ordinals, tag
        self.check_peers()
        rank = _xla.global_rank()
        self.payloads[rank] = bytes(payload)
        try:
            self.meeting.wait()
            payloads = list(self.payloads)
            self.meeting.wait()  # nobody overwrites a payload before everyone has read them all
        except threading.BrokenBarrierError:
            raise PeerReplicaFailed("Another replica of this run failed during a rendezvous.") from None
        return payloads

    # ---- the replica threads -----------------------------------------------------------------
    def run_replica(self, index: int, job: Callable[[], None]) -> None:
        import torch.distributed as dist

        # Process-group names live in one process-wide registry: give each thread its own range.
        dist.distributed_c10d._world.group_count = 1000 * index
        with self.state:
            self.running += 1
        try:
            job()
        except BaseException:
            with self.state:
                first, self.failed = not self.failed, True
                self.running -= 1
                self.state.notify_all()
            if first:
                self.stop_process()
            return  # a later failure (often PeerReplicaFailed): the first one ends the process
        with self.state:
            self.running -= 1
            self.state.notify_all()

    def stop_process(self) -> None:
        """Give the other replicas a moment to stop at a cut or barrier, then end the process."""
        self.meeting.abort()
        with self.state:
            self.state.wait_for(lambda: self.running == 0, timeout=PEER_STOP_GRACE_SECONDS)
        end_now(1)


class _ThreadRank(threading.local):
    """``rank_zero_only.rank`` for lightning-utilities' rank-zero helpers, one value per thread
    (``_xla.device()`` sets it through ``set``)."""

    value = 0

    def set(self, rank: int) -> None:
        self.value = rank

    def __eq__(self, other: object) -> bool:
        return self.value == other

    def __hash__(self) -> int:
        return hash(self.value)


def process_main(job: Callable[[], None], devices: int) -> None:
    """The replicas' process: install, then run ``job`` in one thread per device."""
    faulthandler.enable()  # a crash in native code still shows every replica's Python stack
    watchdog.end_here_on_hang()  # a hung replica thread ends the process with the hang's exit code
    run = install(devices)
    _xla.run_thread_per_device(run.run_replica, (job,))


def install(devices: int) -> ThreadReplicas:
    """Everything the replica threads need, in this process, before any of them exists."""
    check_version()
    run = ThreadReplicas(devices)
    shared_process.install(run)
    # Every graph cut of this process, from xtrainer, torch_xla (FSDP, DDP's process group,
    # rendezvous) or user code, goes through the serialised cut.
    _xla.replace_sync(run.sync)
    _xla.replace_to_cpu(lambda convert: functools.partial(run.read_after_cut, convert))
    # Collectives with channel ids; installed before any FSDP module binds xm.all_gather.
    _xla.replace_collectives(collectives.all_reduce, collectives.all_gather, collectives.reduce_scatter)
    _xla.replace_rendezvous(run.rendezvous)
    _xla.after_int32_collectives(run.compute_for_native_read)
    # One torch.distributed world per thread (private torch API, as in torch's own threaded tests).
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld
    from lightning_utilities.core.rank_zero import rank_zero_only

    dist.distributed_c10d._world = ThreadLocalWorld()
    rank_zero_only.rank = _ThreadRank()
    return run


def _holds_xla_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return _xla.is_xla_tensor(data)
    if isinstance(data, dict):
        return any(_holds_xla_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_holds_xla_tensor(v) for v in data)
    return False
