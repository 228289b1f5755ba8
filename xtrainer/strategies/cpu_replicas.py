"""Several replicas on torch_xla's CPU runtime: N threads of one process, made to work.

``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` gives N virtual devices in one process, and ``torch_xla``
runs MPMD replicas there as one thread per device. Out of the box a training loop deadlocks (XLA
aborts the process after 10 s of waiting at a collective). Four causes, and what this module does
about each:

1. **Different executables.** XLA's CPU backend matches the halves of a collective by channel id,
   or, without one, by the id of the compiled module; torch_xla's MPMD collectives carry no
   channel id, so two replicas that compiled the same graph separately never meet. Here
   all-reduce, all-gather and reduce-scatter are lowered *with* channel ids (one channel per kind,
   on 1-D views, since XLA gives every collective of a channel one layout), and graph cuts are
   serialised so that one replica compiles and the others hit the cache.
2. **Thread-pool starvation.** Cheap executables run inline on torch_xla's thread pool
   (``XLA_THREAD_POOL_SIZE``, default: the core count). With more replicas than threads a
   collective waits forever, so the pool gets at least 16 threads and 4 per replica.
3. **Freeing a busy buffer while holding the GIL**, at the end of ``torch_xla.sync()``: the cut
   here waits for this replica's execution with the GIL released before it lets Python go on.
4. **Donated buffers freed under the cut's lock:** ``XLA_ENABLE_PARAM_ALIASING=0``.

Besides: ``torch.distributed`` keeps one world per thread (DDP) with distinct process-group names,
modules are built under a lock (torch's CPU random generator is process-global), and host-side
rendezvous (barriers, ``mesh_reduce``) meet in Python instead of through XLA collectives.

How it runs: the calling process starts one fresh process (``spawn``) with the environment above;
there the patches are installed before any replica exists, then one thread per device runs the
replica. The caller's own XLA runtime is never touched, so ``devices=N`` works from a script, a
notebook or a test session that already used an XLA device. If a replica fails, the others are
stopped at their next graph cut or barrier, and the process ends within a few seconds; the
caller then raises the first replica's error.

Everything here is switched on only for the CPU device type with more than one replica
(``applies``) and only inside that dedicated process; TPUs and other PJRT devices never import
its effects. It relies on private torch_xla internals checked with torch_xla 2.9 only, so
``launch`` refuses any other version rather than risk a hang.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import pickle
import sys
import threading
from typing import Any, Callable

import torch

from xtrainer._lazy_xla import xla as _xla
from xtrainer.strategies.process import free_port, run_in_new_process

#: Seconds the first failing replica gives the others to stop at a graph cut or barrier (and
#: flush their logs) before it ends the process. Replicas blocked inside an XLA collective that
#: waits for the failed one cannot stop by themselves; ending the process stops them.
PEER_STOP_GRACE_SECONDS = 3.0
#: How long XLA's CPU runtime lets a replica wait at a collective for the others before it aborts
#: the process (fixed inside XLA; measured with torch_xla 2.9).
XLA_COLLECTIVE_WAIT_SECONDS = 10
_ALL_GATHER_CHANNEL, _REDUCE_SCATTER_CHANNEL = 2, 3  # all-reduce uses channel 1


class PeerReplicaFailed(RuntimeError):
    """Raised in a replica when another replica of the same run has failed."""


def applies(devices: int | None) -> bool:
    """Whether ``devices`` replicas need this module: the CPU runtime with more than one."""
    return devices is not None and devices > 1 and _xla.requested_device_type() == "CPU"


def check_version() -> None:
    if not _xla.TESTED_TORCH_XLA:
        raise RuntimeError(
            f"Several replicas on the XLA CPU runtime rely on torch_xla internals that xtrainer checked "
            f"with torch_xla 2.9 only; this is torch_xla {_xla.TORCH_XLA_VERSION}, where they could hang. "
            "Install torch_xla 2.9 (pip install 'torch_xla==2.9.*' 'torch==2.9.*'), or use devices=1.")


def environment(devices: int) -> dict[str, str]:
    """The variables the replicas' process starts with (the runtime reads them at start-up)."""
    pool = max(_int_env("XLA_THREAD_POOL_SIZE"), 4 * devices, 16)
    port = free_port()  # a port of its own for torch.distributed's xla:// rendezvous
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "XLA_THREAD_POOL_SIZE": str(pool),
            "XLA_ENABLE_PARAM_ALIASING": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


# --------------------------------------------------------------------------------------------
# The calling process.
# --------------------------------------------------------------------------------------------
def launch(job: Callable[[], None], devices: int) -> int:
    """Run ``job()`` in ``devices`` replica threads of a new process; return its exit code.

    ``job`` must pickle. It reports its own result or error (see ``launch.CpuThreadReplicas``).
    """
    check_version()
    return run_in_new_process(_process_main, (job, devices), environment(devices), f"devices={devices}")


# --------------------------------------------------------------------------------------------
# The replicas' process.
# --------------------------------------------------------------------------------------------
class _Run:
    """What the replica threads of this process share."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.cut_lock = threading.Lock()  # one replica traces and compiles at a time
        self.construction_lock = threading.Lock()  # modules are built with the global CPU RNG
        self.meeting = threading.Barrier(devices)
        self.payloads: list[bytes] = [b""] * devices
        self.state = threading.Condition()
        self.running = 0
        self.failed = False

    def check_peers(self) -> None:
        if self.failed:
            raise PeerReplicaFailed("Another replica of this run failed; this one stops too.")


_run: _Run | None = None


def installed() -> bool:
    """Whether this process runs its replicas as threads with this module's recipe."""
    return _run is not None


def construction_lock() -> contextlib.AbstractContextManager:
    """Hold while building modules: replica threads share torch's CPU random generator."""
    return _run.construction_lock if _run is not None else contextlib.nullcontext()


class _ThreadRank(threading.local):
    """``rank_zero_only.rank`` for lightning-utilities' rank-zero helpers, one value per thread."""

    value = 0

    def set(self, rank: int) -> None:
        self.value = rank

    def __eq__(self, other: object) -> bool:
        return self.value == other

    def __hash__(self) -> int:
        return hash(self.value)


def _process_main(job: Callable[[], None], devices: int) -> None:
    faulthandler.enable()  # a crash in native code still shows every replica's Python stack
    _install(devices)
    _xla.run_thread_per_device(_replica_thread, (job,))


def _install(devices: int) -> None:
    global _run
    check_version()
    _run = _Run(devices)
    # Every graph cut of this process, from xtrainer, torch_xla (FSDP, DDP's process group,
    # rendezvous) or user code, goes through the serialised cut.
    _xla.replace_sync(_sync)
    _xla.replace_to_cpu(lambda convert: functools.partial(_read_after_cut, convert))
    # Collectives with channel ids; installed before any FSDP module binds xm.all_gather.
    _xla.replace_collectives(_all_reduce, _all_gather, _reduce_scatter)
    _xla.replace_rendezvous(_rendezvous)
    # One torch.distributed world per thread (private torch API, as in torch's own threaded tests).
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld
    from lightning_utilities.core.rank_zero import rank_zero_only

    dist.distributed_c10d._world = ThreadLocalWorld()
    rank_zero_only.rank = _ThreadRank()


def _replica_thread(index: int, job: Callable[[], None]) -> None:
    import torch.distributed as dist

    run = _run
    # Process-group names live in one process-wide registry: give each thread its own range.
    dist.distributed_c10d._world.group_count = 1000 * index
    with run.state:
        run.running += 1
    try:
        job()
    except BaseException:
        with run.state:
            first, run.failed = not run.failed, True
            run.running -= 1
            run.state.notify_all()
        if first:
            _stop_process(run)
        return  # a later failure (often PeerReplicaFailed): the first one ends the process
    with run.state:
        run.running -= 1
        run.state.notify_all()


def _stop_process(run: _Run) -> None:
    """Give the other replicas a moment to stop at a cut or barrier, then end the process."""
    run.meeting.abort()
    with run.state:
        run.state.wait_for(lambda: run.running == 0, timeout=PEER_STOP_GRACE_SECONDS)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _sync(wait: bool = False, reset_scope: bool = True) -> None:
    """``torch_xla.sync()`` for thread replicas: the cut is taken under a process-wide lock (one
    compilation, one executable for all), then this replica's execution is awaited with the GIL
    released, and only then do step closures run and the all-reduce token go."""
    del wait  # always waits: see above
    run = _run
    run.check_peers()
    device = _xla.default_device_name()
    with run.cut_lock:
        _xla.step_marker(device, reset_scope)
    _xla.wait_device_ops_of(device)
    _xla.end_step()


def _read_after_cut(convert: Callable[[Any], Any], data: Any, *args: Any, **kwargs: Any) -> Any:
    """Device-to-host reads run the pending graph through the serialised cut first. Host data
    (a rendezvous of Python objects) needs no cut: a cut would also advance the replica's XLA
    random generator, so a run that rendezvouses more often (a resumed one) would draw other
    numbers."""
    if _holds_xla_tensor(data):
        _sync()
    return convert(data, *args, **kwargs)


def _holds_xla_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return _xla.is_xla_tensor(data)
    if isinstance(data, dict):
        return any(_holds_xla_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_holds_xla_tensor(v) for v in data)
    return False


def _rendezvous(payload: bytes = b"", ordinals: Any = None, tag: str | None = None) -> list[bytes]:
    """``xm.xla_rendezvous`` for thread replicas: the threads meet in Python, without compiling
    and running XLA collectives for each payload size."""
    del ordinals, tag
    run = _run
    run.check_peers()
    rank = _xla.global_rank()
    run.payloads[rank] = bytes(payload)
    try:
        run.meeting.wait()
        payloads = list(run.payloads)
        run.meeting.wait()  # nobody overwrites a payload before everyone has read them all
    except threading.BrokenBarrierError:
        raise PeerReplicaFailed("Another replica of this run failed during a rendezvous.") from None
    return payloads


def start_ddp(tensors: list[torch.Tensor]) -> None:
    """What ``DistributedDataParallel`` does when it starts (check that every replica holds the same
    shapes, then give everyone rank 0's values), done through this module's rendezvous and
    serialised cut. DDP's own check reads the gathered shapes with ``.item()`` from C++, which
    compiles and runs a graph outside the serialised cut, in every replica at once: a process
    crashed there (signal 11) in one run of many."""
    run = _run
    mine = pickle.dumps([(tuple(t.shape), str(t.dtype)) for t in tensors])
    for rank, theirs in enumerate(_rendezvous(mine)):
        if theirs != mine:
            raise RuntimeError(
                f"DistributedDataParallel: replica {rank} holds parameters or buffers of other shapes or "
                f"dtypes than replica {_xla.global_rank()}; every replica must build the same module.")
    if tensors:
        run.check_peers()
        _xla.collective_broadcast(tensors, 0)
        _sync()


def _groups(groups: Any) -> list[list[int]]:
    return groups or [list(range(_xla.world_size()))]


def _all_reduce(reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None,
                pin_layout: bool = True) -> Any:
    groups = _groups(groups)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return _xla.all_reduce_on_channel(reduce_type, t.reshape(-1), scale, groups).reshape(t.shape)

    if isinstance(inputs, torch.Tensor):
        return reduce(inputs)
    with torch.no_grad():
        for t in inputs:
            t.copy_(reduce(t))
    return inputs


def _all_gather(value: Any, dim: int = 0, groups: Any = None, output: Any = None,
                pin_layout: bool = True, channel_id: Any = None, use_global_device_ids: Any = None) -> Any:
    groups = _groups(groups)
    if isinstance(value, (list, tuple)):
        return _into(output, [_all_gather(v, dim, groups) for v in value])
    dim = dim % value.dim() if value.dim() else 0
    count = len(groups[0])
    moved = value.reshape(1) if value.dim() == 0 else value.movedim(dim, 0).contiguous()
    gathered = _xla.all_gather_on_channel(moved.reshape(-1), count, groups, _ALL_GATHER_CHANNEL)
    gathered = gathered.reshape((count * moved.shape[0],) + tuple(moved.shape[1:])).movedim(0, dim)
    return _into(output, gathered)


def _reduce_scatter(reduce_type: str, input: Any, scale: float, scatter_dim: int,
                    shard_count: int, groups: Any = None, output: Any = None, pin_layout: bool = True,
                    channel_id: Any = None, use_global_device_ids: Any = None) -> Any:
    groups = _groups(groups)
    if isinstance(input, (list, tuple)):
        return _into(output, [_reduce_scatter(reduce_type, t, scale, scatter_dim, shard_count, groups)
                              for t in input])
    # Scattering dim d is scattering contiguous chunks of the tensor with d moved to the front.
    moved = input.movedim(scatter_dim, 0).contiguous()
    flat = _xla.reduce_scatter_on_channel(reduce_type, moved.reshape(-1), scale, shard_count, groups,
                                          _REDUCE_SCATTER_CHANNEL)
    shard = flat.reshape((moved.shape[0] // shard_count,) + tuple(moved.shape[1:])).movedim(0, scatter_dim)
    return _into(output, shard)


def _into(output: Any, result: Any) -> Any:
    """Collectives' ``output=`` argument: copy the result into it and return it."""
    if output is None:
        return result
    with torch.no_grad():
        if isinstance(output, (list, tuple)):
            for o, r in zip(output, result):
                o.copy_(r)
        else:
            output.copy_(result)
    return output

