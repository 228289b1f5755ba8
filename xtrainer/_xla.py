"""The one module of xtrainer that imports ``torch_xla``.

Everything else in the package reaches the XLA runtime through the functions here, so that a
version difference, a deprecated name or a private API lives in one place. Importing this module
does not initialise the XLA runtime: ``torch_xla.launch`` refuses to start replicas if the parent
process has touched the runtime, so nothing here talks to a device until a function is called.

It hands out functions and small classes of xtrainer's own, never torch_xla's modules. Checked
against torch_xla 2.9 (``TORCH_XLA_VERSION`` below). Functions marked *private API* use torch_xla
internals that may move in another release; the section at the end serves only
``xtrainer/strategies/cpu_threads/``, whose recipe for several replicas on the CPU runtime
patches and calls them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as _metrics
import torch_xla.distributed.parallel_loader as _parallel_loader
import torch_xla.runtime as xr
from lightning_utilities.core.imports import RequirementCache
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from torch import nn
from torch.overrides import TorchFunctionMode

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
    if hasattr(holder, "set"):  # a holder of one rank per thread, where replicas are threads of one process
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

    def __init__(self, loader: Iterable, watch: bool = False) -> None:
        self.loader, self.count, self.error, self.watch = loader, 0, None, watch
        self._iterator: Iterator[Any] = iter(())

    def __iter__(self) -> _HostBatches:
        try:
            with self._watched():
                self._iterator = iter(self.loader)
        except Exception as err:  # noqa: BLE001 - raised again in the consuming thread
            self.error = err
        return self

    def _watched(self) -> contextlib.AbstractContextManager:
        """Count the graphs a dataset compiles in this (background) thread, without cutting."""
        return DataOnDevice(cut=False) if self.watch else contextlib.nullcontext()

    def __next__(self) -> Any:
        try:
            with self._watched():
                batch = next(self._iterator)
        except StopIteration:
            raise
        except Exception as err:  # noqa: BLE001 - raised again in the consuming thread
            self.error, self._iterator = err, iter(())
            raise StopIteration from None
        self.count += 1
        return batch


def _describe_loader(loader: Iterable) -> str:
    while not hasattr(loader, "dataset") and hasattr(loader, "loader"):  # xtrainer's wrappers (a resumed epoch's)
        loader = loader.loader
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
        if getattr(self.loader, "read_in_calling_thread", False):
            yield from self._in_calling_thread()
            return
        # Not watched (DataOnDevice(cut=False) costs about 1 ms of CPU per 64-sample batch, every
        # op of the dataset and the collate intercepted): a dataset that runs the model is read
        # in the calling thread instead (read_in_calling_thread), where its graphs are counted.
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

    def _in_calling_thread(self) -> Iterator[Any]:
        """The loader read here, between training steps (after their graph cut), under
        ``DataOnDevice``: for a loader whose dataset runs the model on the device (an RL
        generator), so that its graphs never mix with a step's and are compiled once."""
        iterator, count = None, 0
        while True:
            try:
                with DataOnDevice():
                    if iterator is None:
                        iterator = iter(self.loader)
                    batch = next(iterator)
            except StopIteration:
                return
            except Exception as err:
                where = f"batch index {self.start + count} of {_describe_loader(self.loader)}"
                err.add_note(f"(raised while loading {where}; the batches before it were used)")
                raise
            count += 1
            yield send_to_device(batch, self.device, self.input_sharding)


def send_to_device(batch: Any, dev: torch.device, input_sharding: Any = None) -> Any:
    """``batch`` with its CPU tensors sent to ``dev`` (its XLA tensors as they are); no host sync.
    Sent as ``ParallelLoader`` sends it: inside a list (which torch_xla's transform returns as a
    list, whatever the batch is: a lone tensor would come back as a list)."""
    return xm.send_cpu_data_to_device([batch], dev, input_sharding)[0]


# --------------------------------------------------------------------------------------------
# A dataset that runs ops on the device (an RL generator calling its policy): its graphs.
# --------------------------------------------------------------------------------------------
#: Reads of a tensor's value by the host (each runs the graph that produces the tensor).
_HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
                         "__complex__", "__array__", "__repr__", "__format__", "equal", "allclose"})

_loading_lock = threading.Lock()
_loading = {"compiles": 0, "compile_s": 0.0, "reads": 0}


def data_loading_counters() -> dict[str, float]:
    """Graphs compiled in this process while a loader's dataset ran ops on the XLA device
    (``compiles``, ``compile_s``), and how many loader reads did (``reads``). Host counters."""
    with _loading_lock:
        return dict(_loading)


def _holds_xla(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return data.device.type == "xla"
    if isinstance(data, torch.device):
        return data.type == "xla"
    if isinstance(data, (list, tuple)):
        return any(_holds_xla(v) for v in data)
    if isinstance(data, dict):
        return any(_holds_xla(v) for v in data.values())
    return False


def _to_host(args: tuple, kwargs: dict) -> bool:
    """``tensor.to("cpu")`` and its spellings: a read of the value by the host."""
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, str) and value.startswith("cpu"):
            return True
        if isinstance(value, torch.device) and value.type == "cpu":
            return True
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return True
    return False


class DataOnDevice(TorchFunctionMode):
    """While a loader's dataset is read in this thread: every read of an XLA tensor's value by the
    host (``.item()``, ``.cpu()``, ``bool()``...) is preceded by a graph cut (``sync``), and the
    graphs compiled while the dataset used the device are counted (``data_loading_counters``).

    Why: a read runs the pending graph that produces the tensor, without a cut. Between two cuts,
    every random op (a policy's ``Categorical.sample()``) chains the device's random seed one step
    further, and ops the dataset left unread pile up; so without a cut each read's graph differs
    from the last one, and XLA compiles anew at nearly every environment step. Cut before each
    read, the dataset's graph is the same at every step (compiled once), and the read itself
    only transfers. Read only between training steps, after their cut: a cut inside a step
    would split its graph.

    ``cut=False`` only watches (a loader read in a background thread, where a cut would split the
    training step being traced in the main thread)."""

    def __init__(self, cut: bool = True) -> None:
        super().__init__()
        self.cut, self.touched = cut, False

    def __enter__(self) -> "DataOnDevice":
        self._compiles, self._compile_s = compile_count(), compile_seconds()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.touched:
            compiles, seconds = compile_count() - self._compiles, compile_seconds() - self._compile_s
            with _loading_lock:
                _loading["compiles"] += compiles
                _loading["compile_s"] += seconds
                _loading["reads"] += 1

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.cut:
            name = getattr(func, "__name__", "")
            if (name in _HOST_READS or (name == "to" and _to_host(args, kwargs))) and _holds_xla(args):
                self.touched = True
                torch_xla.sync()  # the graph cut before the read; the read itself syncs the host (the dataset's own)
        result = func(*args, **kwargs)
        if not self.touched and (_holds_xla(result) or _holds_xla(args) or _holds_xla(kwargs)):
            self.touched = True
        return result


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
# The persistent compilation cache and the chip (goodput: xtrainer/compile_cache.py, flops.py).
# --------------------------------------------------------------------------------------------
#: torch_xla's counters of the persistent compilation cache: a graph found on disk and loaded
#: (hit), not found (miss, compiled and written), found but not loadable (compiled again).
PERSISTENT_CACHE_COUNTERS = {"hits": "PersistentCacheHit", "misses": "PersistentCacheMiss",
                             "unloadable": "PersistentCacheDeserializeFailure"}


def compilation_cache_started() -> bool:
    """Whether this process's in-memory computation cache exists: it is made at the first
    compilation, and reads the persistent cache's settings then, never again."""
    return bool(torch_xla._XLAC._xla_computation_cache_is_initialized())


def initialize_compilation_cache(path: str) -> None:
    """Keep compiled executables in ``path`` (``torch_xla.runtime.initialize_cache``), for this
    process's later compilations and later processes. Must come before the process's first
    compilation (``compilation_cache_started()``); torch_xla reads it from the environment then."""
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=False)


def compilation_cache_path() -> str | None:
    """The persistent cache this process was given (None: none)."""
    return os.environ.get("XLA_PERSISTENT_CACHE_PATH") or None


def persistent_cache_counts() -> dict[str, int]:
    """``{"hits", "misses", "unloadable"}`` of the persistent compilation cache in this process
    (host counters, no device access)."""
    return {key: int(_metrics.counter_value(name) or 0) for key, name in PERSISTENT_CACHE_COUNTERS.items()}


def chip_name() -> str | None:
    """The accelerator chip this process runs on, as ``flops.PEAK_BF16_FLOPS`` names it
    (``"tpu-v5e"``, ``"trainium2"``...), or None where it cannot be told (the CPU runtime; an
    unknown device). TPU: the accelerator type the TPU VM announces (``TPU_ACCELERATOR_TYPE`` or
    its metadata server); Trainium: the instance type (``XTRAINER_CHIP`` overrides both).
    Untested on real TPUs and Trainium here (none on CI)."""
    if os.environ.get("XTRAINER_CHIP"):
        return os.environ["XTRAINER_CHIP"]
    kind = requested_device_type()
    if kind == "TPU":
        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        if not accelerator:
            try:
                import torch_xla._internal.tpu as tpu  # private API: the metadata server

                accelerator = str(tpu.get_tpu_type())
            except Exception:  # noqa: BLE001 - no metadata server: the chip stays unknown
                return None
        from xtrainer.chips import tpu_chip

        return tpu_chip(accelerator)
    if kind == "NEURON":
        instance = os.environ.get("AWS_INSTANCE_TYPE", "") or os.environ.get("NEURON_INSTANCE_TYPE", "")
        return "trainium2" if instance.startswith("trn2") else "trainium1" if instance.startswith("trn1") else None
    return None


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

    def __init__(self, local_port: int) -> None:
        """``local_port``: the coordinator's port when this is the job's only process (a free one,
        so that two runs on one machine do not collide); on several hosts every host reaches the
        coordinator at its default port, as torch_xla's ``CheckpointManager`` does."""
        count = xr.process_count()
        if count > 1:
            torch_xla._XLAC._ensure_xla_coordinator_initialized(xr.process_index(), count, xr.get_master_ip())
        else:
            torch_xla._XLAC._ensure_xla_coordinator_initialized(0, 1, "localhost", str(local_port))
        torch_xla._XLAC._activate_preemption_sync_manager()

    def reached(self, step: int) -> bool:
        """Whether the job agreed to stop at ``step`` (true at that one step only; a host call,
        no device sync)."""
        return bool(torch_xla._XLAC._sync_point_reached(step))


def _spmd():
    """torch_xla's SPMD package (``Mesh``, ``mark_sharding``, ``ShardingSpec``); this module's own."""
    import torch_xla.distributed.spmd as xs

    return xs


def mesh(shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Any:
    """A device mesh over every device, in device order."""
    import numpy as np

    return _spmd().Mesh(np.arange(spmd_device_count()), tuple(shape), tuple(axis_names))


def set_global_mesh(device_mesh: Any) -> None:
    """Make ``device_mesh`` the mesh that torch_xla's SPMD helpers use when given none."""
    _spmd().set_global_mesh(device_mesh)


def mark_sharding(tensor: torch.Tensor, device_mesh: Any, spec: tuple) -> None:
    """Annotate ``tensor`` to be laid out over ``device_mesh`` by the partition ``spec`` (one mesh
    axis name, or None, per dimension of the tensor)."""
    _spmd().mark_sharding(tensor, device_mesh, spec)


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
            self._specs[rank] = _spmd().ShardingSpec(self.mesh, spec, minibatch=self.minibatch)
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


def _fsdp():
    """torch_xla's FSDP package (``XlaFullyShardedDataParallel`` and its helpers); this module's own."""
    import torch_xla.distributed.fsdp as fsdp

    return fsdp


def fsdp_wrapper_class() -> type:
    """``XlaFullyShardedDataParallel``."""
    return _fsdp().XlaFullyShardedDataParallel


def checkpoint_module(module: nn.Module) -> nn.Module:
    """``module`` with its activations recomputed in backward instead of stored (torch_xla's
    ``checkpoint_module``, which FSDP units wrap)."""
    return _fsdp().checkpoint_module(module)


def consolidate_shards(state_dicts: list[dict[str, Any]], shard_metadata: dict[str, Any]) -> dict[str, Any]:
    """One full state dict from every rank's FSDP shard state dict (in rank order) and the shard
    metadata of any rank (torch_xla's ``consolidate_sharded_state_dicts``)."""
    return _fsdp().consolidate_sharded_state_dicts(state_dicts, shard_metadata)


def fsdp_size_wrap_policy(min_num_params: int) -> Callable[..., Any]:
    """The auto-wrap policy that gives every submodule of at least ``min_num_params`` parameters
    its own FSDP unit."""
    return functools.partial(_fsdp().wrap.size_based_auto_wrap_policy, min_num_params=min_num_params)


def fsdp_layer_wrap_policy(classes: set[type]) -> Callable[..., Any]:
    """The auto-wrap policy that gives every submodule of one of ``classes`` its own FSDP unit."""
    return functools.partial(_fsdp().wrap.transformer_auto_wrap_policy, transformer_layer_cls=classes)


def set_checkpoint_status(status: Any) -> None:
    """Make torch_xla's activation checkpointing and its FSDP read their "inside a checkpoint's
    backward" flag (``in_chkpt_bwd``) from ``status``. *Private API*: the module-level
    ``chkpt_status`` of ``torch_xla.utils.checkpoint`` and of FSDP's own module."""
    import torch_xla.utils.checkpoint as checkpoint

    fsdp = sys.modules[fsdp_wrapper_class().__module__]
    for owner in (checkpoint, fsdp):
        if getattr(owner, "chkpt_status", None) is not status:
            owner.chkpt_status = status


# --------------------------------------------------------------------------------------------
# Private torch_xla internals, for ``xtrainer/strategies/cpu_threads/`` only: the recipe that
# lets several replicas run as threads of one process on the CPU runtime. Nothing else may use
# these; they are checked against torch_xla 2.9 only (``TESTED_TORCH_XLA``).
# --------------------------------------------------------------------------------------------
def run_thread_per_device(fn: Callable[..., Any], args: tuple = ()) -> None:
    """What ``torch_xla.launch`` does inside its child process on the CPU runtime: start the
    runtime, set the replication devices, run ``fn(index, *args)`` in one thread per device."""
    import torch_xla._internal.pjrt as pjrt

    pjrt._run_thread_per_device(0, 1, pjrt._SpawnFn(fn, *args), pjrt.initialize_multiprocess)


def replace_sync(sync_fn: Callable[..., None]) -> None:
    """Make ``torch_xla.sync()`` (under both of its names) call ``sync_fn``: every graph cut of the
    process, from xtrainer, torch_xla (FSDP, DDP's process group, rendezvous) or user code."""
    torch_xla.sync = torch_xla.torch_xla.sync = sync_fn


def replace_to_cpu(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``xm._maybe_convert_to_cpu`` (batched device-to-host reads) by ``make(original)``."""
    xm._maybe_convert_to_cpu = make(xm._maybe_convert_to_cpu)


def replace_collectives(all_reduce_fn: Callable[..., Any], all_gather_fn: Callable[..., Any],
                        reduce_scatter_fn: Callable[..., Any]) -> None:
    """Replace ``xm.all_reduce``, ``xm.all_gather`` and ``xm.reduce_scatter`` (before any FSDP module
    binds ``xm.all_gather``)."""
    xm.all_reduce, xm.all_gather, xm.reduce_scatter = all_reduce_fn, all_gather_fn, reduce_scatter_fn


def after_int32_collectives(after: Callable[[list[torch.Tensor]], None]) -> None:
    """Call ``after(tensors)`` each time the ``xla`` process group's ``allreduce`` or
    ``broadcast`` has recorded a collective over int32 tensors: DistributedDataParallel's reducer
    reads its own right after, from C++, where no Python read passes (its map of the parameters
    each replica used, with ``find_unused_parameters=True``; its bucket order). A module's
    integer buffers (int64), which DDP broadcasts at every forward without reading them, are
    left to the step's graph."""
    from torch_xla.distributed.xla_backend import ProcessGroupXla

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(self: Any, tensors: list[torch.Tensor], opts: Any) -> Any:
            work = original(self, tensors, opts)
            read = [t for t in tensors if t.dtype == torch.int32]
            if read:
                after(read)
            return work
        return collective

    ProcessGroupXla.allreduce = wrap(ProcessGroupXla.allreduce)
    ProcessGroupXla.broadcast = wrap(ProcessGroupXla.broadcast)


def is_computed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s value exists on its device (no pending graph computes it)."""
    ops = [line for line in torch_xla._XLAC._get_xla_tensors_text([tensor]).splitlines() if "%" in line]
    return len(ops) == 1 and "xla::device_data" in ops[0]


def launch_graph_of(tensors: list[torch.Tensor]) -> None:
    """Launch the execution of the pending graph that computes ``tensors``, without waiting."""
    torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)


def replace_rendezvous(rendezvous_fn: Callable[..., list[bytes]]) -> None:
    """Replace ``xm.xla_rendezvous``, through which every host-side rendezvous passes."""
    xm.xla_rendezvous = rendezvous_fn


def default_device_name() -> str:
    """This thread's XLA device, as the runtime names it (``"xla:0"``)."""
    return torch_xla._XLAC._xla_get_default_device()


def step_marker(device_name: str, reset_scope: bool) -> None:
    """Cut the lazy graph of ``device_name`` and launch its execution, without waiting for it."""
    torch_xla._XLAC._xla_step_marker(device_name, [], wait=False, reset_scope=reset_scope)


def wait_device_ops_of(device_name: str) -> None:
    """Wait, with the GIL released, until the executions pending on ``device_name`` are done."""
    xlac = torch_xla._XLAC
    xlac._xla_wait_device_ops(xlac._xla_real_devices([device_name]))


def end_step() -> None:
    """What ``torch_xla.sync()`` does after the cut: run the step closures, then drop the
    all-reduce token."""
    context = xm._run_step_closures()
    torch_xla._XLAC._set_all_reduce_token(context.device, None)


def collective_broadcast(tensors: list[torch.Tensor], root: int) -> None:
    """Give every replica ``root``'s values of ``tensors``, in place (recorded in the graph)."""
    xm.collective_broadcast(tensors, root)


def all_reduce_on_channel(reduce_type: str, flat: torch.Tensor, scale: float,
                          groups: list[list[int]]) -> torch.Tensor:
    """An all-reduce of the 1-D ``flat`` lowered with a channel id (SPMD's lowering)."""
    return torch_xla._XLAC._xla_spmd_all_reduce(reduce_type, flat, scale, groups)


def all_gather_on_channel(flat: torch.Tensor, count: int, groups: list[list[int]], channel: int) -> torch.Tensor:
    """An all-gather of the 1-D ``flat`` over ``count`` replicas, lowered with ``channel``."""
    return torch_xla._XLAC._xla_all_gather(flat, 0, count, groups, False, channel, True)


def reduce_scatter_on_channel(reduce_type: str, flat: torch.Tensor, scale: float, shard_count: int,
                              groups: list[list[int]], channel: int) -> torch.Tensor:
    """A reduce-scatter of the 1-D ``flat`` into ``shard_count`` shards, lowered with ``channel``,
    ordered after the collectives before it by torch_xla's all-reduce token."""
    xlac = torch_xla._XLAC
    token, context = xm._get_all_reduce_token()
    flat, token = xlac._xla_reduce_scatter(reduce_type, flat, token, scale, 0, shard_count, groups,
                                           False, channel, True)
    xlac._set_all_reduce_token(context.device, token)
    return flat
