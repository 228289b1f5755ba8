"""The one module of xtrainer that imports ``torch_xla``.

Everything else in the package reaches the XLA runtime through the functions here, so that a
version difference, a deprecated name or a private API lives in one place. Importing this module
does not initialise the XLA runtime: ``torch_xla.launch`` refuses to start replicas if the parent
process has touched the runtime, so nothing here talks to a device until a function is called.

Checked against torch_xla 2.9 (``TORCH_XLA_VERSION`` below). Functions marked *private API* use
torch_xla internals that may move in another release; ``private_internals()`` at the end hands
torch_xla's modules to ``xtrainer/strategies/cpu_replicas.py``, whose recipe for several replicas
on the CPU runtime patches them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from typing import Any, Callable, Iterable, Iterator

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as _metrics
import torch_xla.distributed.parallel_loader as _parallel_loader
import torch_xla.runtime as xr
from lightning_utilities.core.imports import RequirementCache
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn

TORCH_XLA_VERSION = torch_xla.__version__
#: The release every private API used below was checked against.
TESTED_TORCH_XLA = RequirementCache("torch_xla>=2.9,<2.10")
if not TESTED_TORCH_XLA:
    rank_zero_warn(f"xtrainer was checked against torch_xla 2.9, not {TORCH_XLA_VERSION}: the private "
                   "torch_xla APIs it uses (marked in xtrainer/_xla.py) may behave differently.")


# --------------------------------------------------------------------------------------------
# Runtime facts that are safe to ask in a parent process (no runtime initialisation).
# --------------------------------------------------------------------------------------------
def requested_device_type() -> str:
    """The PJRT device type the runtime will use (``PJRT_DEVICE``), without initialising it.

    An unset ``PJRT_DEVICE`` lets torch_xla choose (a TPU if one is present, else the CPU).
    """
    value = os.environ.get("PJRT_DEVICE")
    if value:
        return value.upper()
    import torch_xla._internal.tpu as tpu  # private API: PCI scan, no runtime start

    return "TPU" if tpu.num_available_chips() > 0 else "CPU"


def local_device_count_without_runtime() -> int | None:
    """How many replicas ``torch_xla.launch`` would run on this host, or None if unknown.

    Reads the environment and, on TPU hosts, the PCI bus; it never starts the runtime, so the
    parent of a multi-replica launch may call it. On the CPU runtime this is ``CPU_NUM_DEVICES``
    (default 1).
    """
    kind = requested_device_type()
    if kind == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if kind == "TPU":
        import torch_xla._internal.tpu as tpu  # private API; untested here (no TPU on CI)

        return tpu.num_available_devices()
    return None


# --------------------------------------------------------------------------------------------
# Inside a replica.
# --------------------------------------------------------------------------------------------
def device() -> torch.device:
    """This replica's XLA device (starts the runtime). Also tells lightning-utilities' rank-zero
    helpers (``rank_zero_warn``...) which rank this is."""
    dev = torch_xla.device()
    holder = getattr(rank_zero_only, "rank", None)
    if hasattr(holder, "set"):  # one holder per thread when replicas are threads (cpu_replicas)
        holder.set(xr.global_ordinal())
    else:
        rank_zero_only.rank = xr.global_ordinal()
    return dev


def device_type() -> str:
    return xr.device_type()


def world_size() -> int:
    return xr.world_size()


def global_rank() -> int:
    return xr.global_ordinal()


def local_rank() -> int:
    return xr.local_ordinal()


def launched_externally() -> bool:
    """Whether torchrun (or a launcher setting the same environment) started this process as one
    of several; ``torch_xla.launch`` then runs the replica in this process instead of spawning."""
    import torch.distributed as dist

    return dist.is_torchelastic_launched()


def launch(fn: Callable[..., Any], args: tuple = ()) -> None:
    """Run ``fn(index, *args)`` once per local replica (``torch_xla.launch``).

    On TPU this starts one process per chip with the ``spawn`` method, so ``fn`` and ``args``
    must pickle. Under torchrun it calls ``fn`` in this process (one replica per process).
    """
    torch_xla.launch(fn, args=args)


def sync() -> None:
    """Cut the lazy graph here and launch its execution (asynchronous; no host wait)."""
    torch_xla.sync()


def add_step_closure(fn: Callable[..., Any], args: tuple = ()) -> None:
    xm.add_step_closure(fn, args=args)


def reduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    """All-reduce (mean) the gradients of ``optimizer``'s parameters across replicas."""
    xm.reduce_gradients(optimizer)


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """``xm.optimizer_step``: all-reduce gradients across replicas, then ``optimizer.step()``."""
    xm.optimizer_step(optimizer)


REDUCE_OPS = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """An all-reduce recorded in the lazy graph (no host sync)."""
    return xm.all_reduce(REDUCE_OPS[op], tensor)


def all_gather(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every replica's ``tensor`` concatenated along ``dim``, recorded in the graph."""
    return xm.all_gather(tensor, dim=dim)


def rng_state() -> int:
    """This replica's XLA random generator state (a seed, advanced by every random op)."""
    return int(xm.get_rng_state(torch_xla.device()))


def set_rng_state(seed: int) -> None:
    xm.set_rng_state(int(seed), torch_xla.device())


@contextlib.contextmanager
def rng_state_kept() -> Iterator[None]:
    """Leave this replica's XLA generator as it was found. Every graph cut advances it, and host
    reads and rendezvous may cut the graph (with several replicas on the CPU runtime they do): work
    that a run does or not (a save, a check before one) must not change the random numbers it
    draws afterwards, or a resumed run would differ from an uninterrupted one."""
    seed = rng_state()
    try:
        yield
    finally:
        set_rng_state(seed)


def all_gather_object(obj: Any) -> list[Any]:
    """Every replica's ``obj``, in rank order, on every replica. A host rendezvous."""
    return xm.mesh_reduce("xtrainer_all_gather_object", obj, list)


def rendezvous(tag: str) -> None:
    """A host-side barrier of every replica. Blocks the host until all replicas arrive."""
    xm.rendezvous(tag)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every replica. A host-side rendezvous: use it rarely."""
    return xm.mesh_reduce("xtrainer_broadcast_object", obj, lambda values: values[0])


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xla"


def to_cpu(data: Any) -> Any:
    """Every XLA tensor in ``data`` (nested) copied to the host in one batched transfer.

    Syncs the host: it waits for the pending graph that produces the tensors. *Private API*
    (``xm._maybe_convert_to_cpu``) so that many tensors cost one transfer, not one each.
    """
    return xm._maybe_convert_to_cpu(data)


class _HostBatches:
    """The host loader as ``ParallelLoader``'s background thread reads it.

    That thread drops any exception the loader raises (a dataset's ``__getitem__``, a
    ``collate_fn``, a sampler) and just ends the stream, so the consumer would see a short epoch.
    Here the exception is kept, and the stream ends where it was raised; ``DeviceBatches`` raises
    it in the consuming thread once the batches before it have been used. Host-side only.
    """

    def __init__(self, loader: Iterable) -> None:
        self.loader, self.count, self.error = loader, 0, None
        self._iterator: Iterator[Any] = iter(())

    def __iter__(self) -> _HostBatches:
        try:
            self._iterator = iter(self.loader)
        except Exception as err:  # noqa: BLE001 - raised again in the consuming thread
            self.error = err
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._iterator)
        except StopIteration:
            raise
        except Exception as err:  # noqa: BLE001 - raised again in the consuming thread
            self.error, self._iterator = err, iter(())
            raise StopIteration from None
        self.count += 1
        return batch


def _describe_loader(loader: Iterable) -> str:
    dataset = getattr(loader, "dataset", None)
    name = type(loader).__name__
    return f"{name} over {type(dataset).__name__}" if dataset is not None else name


class DeviceBatches:
    """Like ``MpDeviceLoader``, but it leaves graph cuts to the caller (the strategy's
    ``sync()``), so that each step costs one cut, not two; and it stops its loader threads when
    iteration ends early (``break`` after ``limit_*_batches``) instead of leaving them blocked.

    An exception raised by the host loader reaches the consumer: after the batches loaded before
    it, as the same exception, with a note naming the batch and the loader. ``start`` is the
    index of the loader's first batch in its epoch (a loader that resumes inside an epoch).
    """

    def __init__(self, loader: Iterable, dev: torch.device, input_sharding: Any = None, start: int = 0) -> None:
        self.loader, self.device, self.input_sharding, self.start = loader, dev, input_sharding, start

    def __iter__(self) -> Iterator[Any]:
        host = _HostBatches(self.loader)
        parallel = _parallel_loader.ParallelLoader(host, [self.device], batches_per_execution=sys.maxsize,
                                                   input_sharding=self.input_sharding)
        try:
            yield from parallel.per_device_loader(self.device)
        finally:
            parallel.close()
        if host.error is not None:
            error, host.error = host.error, None
            where = f"batch index {self.start + host.count} of {_describe_loader(self.loader)}"
            error.add_note(f"(raised while loading {where}; the batches before it were used)")
            raise error


# --------------------------------------------------------------------------------------------
# Debug metrics (used by tests and benchmarks to count compilations and transfers).
# --------------------------------------------------------------------------------------------
def metric_count(name: str) -> int:
    """How many times the XLA metric ``name`` was recorded (0 if never)."""
    data = _metrics.metric_data(name)
    return int(data[0]) if data else 0


def compile_count() -> int:
    return metric_count("CompileTime")


def compile_seconds() -> float:
    """Total time spent compiling graphs in this process."""
    data = _metrics.metric_data("CompileTime")
    return float(data[1]) / 1e9 if data else 0.0


def memory_info() -> dict[str, int] | None:
    """``{"bytes_used", "bytes_limit"}`` of this replica's device, or None where the runtime does
    not report it (the CPU runtime). Asks the allocator; no graph runs."""
    try:
        info = xm.get_memory_info(torch_xla.device())
    except RuntimeError:
        return None
    if "bytes_used" in info:
        return {"bytes_used": int(info["bytes_used"]), "bytes_limit": int(info["bytes_limit"])}
    if "kb_total" in info:  # older runtimes report kilobytes
        return {"bytes_used": 1024 * int(info["kb_total"] - info["kb_free"]),
                "bytes_limit": 1024 * int(info["kb_total"])}
    return None


def execute_count() -> int:
    return metric_count("ExecuteTime")


def transfer_from_device_count() -> int:
    return metric_count("TransferFromDeviceTime")


def wait_device_ops() -> None:
    """Block until every pending execution on this host's devices has finished (a host sync;
    tests and benchmarks use it to count executions exactly)."""
    xm.wait_device_ops()


def clear_metrics() -> None:
    _metrics.clear_all()


# --------------------------------------------------------------------------------------------
# SPMD: one program partitioned over every device by sharding annotations.
# --------------------------------------------------------------------------------------------
def use_spmd() -> None:
    """Switch this process to SPMD; must come before any XLA tensor exists."""
    xr.use_spmd()


def is_spmd() -> bool:
    return xr.is_spmd()


def spmd_device_count() -> int:
    """Every device the SPMD program spans (all hosts)."""
    return xr.global_runtime_device_count()


def process_count() -> int:
    return xr.process_count()


def process_index() -> int:
    return xr.process_index()


class PreemptionNotice:
    """XLA's preemption sync (the one torch_xla's ``CheckpointManager`` uses): once any process of
    the job gets SIGTERM (a TPU VM's maintenance or preemption notice, or Kubernetes' stop), the
    processes agree, through the runtime's coordination service, on one step at which every one of
    them sees ``reached(step)`` true, with no collective of the training program.

    While active it owns SIGTERM in this process (a C-level handler replaces Python's); SIGINT
    stays with Python. On TPU pods the coordination service spans the hosts (untested here: no
    pod); on the CPU runtime it runs for one process, which is how the tests exercise it."""

    def __init__(self) -> None:
        count = xr.process_count()
        master = xr.get_master_ip() if count > 1 else "localhost"  # the IP lookup exists on TPU/Neuron only
        torch_xla._XLAC._ensure_xla_coordinator_initialized(xr.process_index(), count, master)
        torch_xla._XLAC._activate_preemption_sync_manager()

    def reached(self, step: int) -> bool:
        """Whether the job agreed to stop at ``step`` (true at that one step only; a host call,
        no device sync)."""
        return bool(torch_xla._XLAC._sync_point_reached(step))


def spmd():
    """torch_xla's SPMD package (``Mesh``, ``mark_sharding``, ``ShardingSpec``)."""
    import torch_xla.distributed.spmd as xs

    return xs


def mesh(shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Any:
    """A device mesh over every device, in device order."""
    import numpy as np

    return spmd().Mesh(np.arange(spmd_device_count()), tuple(shape), tuple(axis_names))


def sharding_of(tensor: torch.Tensor) -> str:
    """The tensor's sharding as XLA prints it (``""``: none, ``{replicated}``, ``{devices=[4,1]...}``)."""
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def fsdpv2_partition_spec(param: torch.Tensor) -> tuple:
    """The partition spec ``SpmdFullyShardedDataParallel`` gives a parameter it shards.
    *Private API* (``_prepare_spmd_partition_spec``), so that the two never disagree."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    return _prepare_spmd_partition_spec(param, shard_maximal=True)


def spmd_checkpoint_planners() -> tuple[Any, Any]:
    """torch_xla's ``torch.distributed.checkpoint`` planners for sharded XLA tensors: a save planner
    that writes each process's local shards, and a load planner that reads into sharded tensors
    in place (resharding when the mesh differs from the one that saved)."""
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

    return SPMDSavePlanner(), SPMDLoadPlanner()


def fsdpv2_class() -> type:
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    return SpmdFullyShardedDataParallel


class BatchSharding:
    """Shards every tensor of a batch along dim 0 over one mesh axis, whatever its rank, as it is
    sent to the device (``ParallelLoader(input_sharding=...)`` asks ``xla_spec`` per tensor)."""

    def __init__(self, mesh: Any, axis: str, minibatch: bool = False) -> None:
        self.mesh, self.axis, self.minibatch = mesh, axis, minibatch
        self._specs: dict[int, Any] = {}

    def xla_spec(self, tensor: torch.Tensor) -> Any:
        rank = tensor.dim()
        if rank == 0:
            return None
        if rank not in self._specs:
            spec = (self.axis,) + (None,) * (rank - 1)
            self._specs[rank] = spmd().ShardingSpec(self.mesh, spec, minibatch=self.minibatch)
        return self._specs[rank].xla_spec(tensor)


# --------------------------------------------------------------------------------------------
# Profiling.
# --------------------------------------------------------------------------------------------
def start_profiler_server(port: int) -> Any:
    """torch_xla's profiler server (for on-demand captures by TensorBoard); keep the handle."""
    import torch_xla.debug.profiler as xp

    return xp.start_server(port, only_on_master=False)


def start_trace(log_dir: str) -> None:
    import torch_xla.debug.profiler as xp

    xp.start_trace(log_dir)


def stop_trace() -> None:
    """Ends the trace and writes it under ``<log_dir>/plugins/profile/`` (TensorBoard's layout)."""
    import torch_xla.debug.profiler as xp

    xp.stop_trace()


# --------------------------------------------------------------------------------------------
# Distributed pieces used by strategies.
# --------------------------------------------------------------------------------------------
def register_xla_process_group_backend() -> None:
    """Register the ``xla`` backend of ``torch.distributed`` (import side effect)."""
    import torch_xla.distributed.xla_backend  # noqa: F401


def fsdp_module():
    """torch_xla's FSDP package (``XlaFullyShardedDataParallel`` and its helpers)."""
    import torch_xla.distributed.fsdp as fsdp

    return fsdp


# --------------------------------------------------------------------------------------------
# Private torch_xla internals, for ``xtrainer/strategies/cpu_replicas.py`` only: the recipe that
# lets several replicas run as threads of one process on the CPU runtime. Nothing else may use
# these; they are checked against torch_xla 2.9 only (``TESTED_TORCH_XLA``).
# --------------------------------------------------------------------------------------------
@functools.cache
def private_internals() -> Any:
    """The torch_xla modules the CPU thread-replica recipe patches and calls, and ``run_threads``:
    what ``torch_xla.launch`` does inside its child process on the CPU runtime (start the runtime,
    set the replication devices, run ``fn(index, *args)`` in one thread per device)."""
    import torch_xla._internal.pjrt as pjrt

    def run_threads(fn: Callable[..., Any], args: tuple = ()) -> None:
        pjrt._run_thread_per_device(0, 1, pjrt._SpawnFn(fn, *args), pjrt.initialize_multiprocess)

    return types.SimpleNamespace(torch_xla=torch_xla, xla_model=xm, XLAC=torch_xla._XLAC,
                                 run_threads=run_threads)

