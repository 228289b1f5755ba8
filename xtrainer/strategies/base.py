"""The strategy contract: everything the Trainer leaves to the device and the distribution.

A strategy decides how replicas are launched, how the module is wrapped, how gradients are reduced
and the optimizer stepped, where the lazy graph is cut, how batches reach the device and how
checkpoints are written. The Trainer owns the loop and calls these members in this order::

    launch(fn)                           # in the calling process; runs fn in every replica
      setup_environment()                # in each replica: device, process group
      setup_module(module)               # configure_model(), to the device, wrap
      setup_optimizers(wrapped, ...)     # configure_optimizers() against the wrapped parameters
      process_dataloader(loader)         # sampler for this replica, then batches to the device
      for each micro-batch:
        with no_backward_sync(enabled=not stepping):
          loss = wrapped(...); backward(loss)
        if stepping: optimizer_step(optimizer, before_step=clip)   # reduce, clip, step
        sync()                           # the graph cut: one execution per micro-batch
      checkpoint_layout.save / .load     # called on every replica, never on one only
      teardown(wrapped)                  # the user's module unwrapped, on the CPU

Every member runs on every replica; those that are collectives (``reduce``, ``barrier``,
``broadcast``, a checkpoint save) must be entered by all replicas or they hang.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import inspect
import itertools
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from xtrainer import _xla
from xtrainer.checkpoint import layout as ckpt_layout
from xtrainer.checkpoint.format import load_weights
from xtrainer.checkpoint.whole import WholeFile
from xtrainer import interrupts
from xtrainer.interrupts import TrainingInterrupted
from xtrainer.precision import Precision
from xtrainer.strategies import cpu_replicas
from xtrainer.suggest import did_you_mean


class Strategy(abc.ABC):
    """Base class of all strategies. Subclasses override what differs and nothing else."""

    #: The name ``Trainer(strategy=...)`` accepts for this class.
    name: ClassVar[str]

    def __init__(self) -> None:
        self.devices: int | None = 1
        self.precision = Precision("32")
        self._device: torch.device | None = None
        self._launch_rng_state: torch.Tensor | None = None

    # ---- configuration (calling process, before launch) --------------------------------
    def connect(self, devices: int | None, precision: Precision) -> None:
        """Receive the Trainer's ``devices`` (None: every local device) and precision."""
        self.devices = devices
        self.precision = precision

    # ---- launching ---------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in every replica and return the result of this host's first replica
        (rank 0 on a single host) in the calling process.

        ``fn`` begins by calling ``setup_environment()``. With one device it runs here, in the
        calling process. With more it runs in each replica: started by ``torch_xla.launch`` (one
        process per device on TPU), or, on the CPU runtime, as threads of one new process
        (``cpu_replicas``). Rank 0's return value comes back through a file (so it must pickle).
        The calling process never touches the XLA runtime itself, which ``torch_xla.launch``
        requires. If a replica fails, the others are stopped and its error is raised here.
        """
        if _xla.launched_externally() and _xla.requested_device_type() == "CPU" \
                and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(
                "This process is one of several started by torchrun (or a similar launcher), but torch_xla's "
                "CPU runtime cannot run collectives across processes. Start one process instead (python "
                "script.py or xtrainer fit) with Trainer(devices=N): xtrainer runs the N replicas itself.")
        if self.runs_in_caller:
            return fn(*args)
        self._launch_rng_state = torch.get_rng_state()
        with tempfile.TemporaryDirectory(prefix="xtrainer-launch-") as tmp:
            job = _ReplicaJob(fn, args, tmp)
            try:
                exitcode = self.start_replicas(job)
            except BaseException as err:
                job.raise_failure(cause=err)
                raise
            job.raise_failure()
            signum = interrupts.requested()
            if exitcode != 0 and signum is not None:  # stopped before it could stop gracefully
                raise TrainingInterrupted(f"Stopped by {signal.Signals(signum).name} while the replicas were "
                                          "starting; nothing was trained, no checkpoint was written.", signum)
            if exitcode != 0:
                how = f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
                when = "after rank 0 had finished" if os.path.exists(job.result_path) else "before rank 0 finished"
                raise RuntimeError(f"The replicas' process ended with {how} {when}, without reporting an error; "
                                   "its output above (Python stacks of every thread on a crash) may say why.")
            return job.result()

    def planned_world_size(self) -> int | None:
        """The world size a launch will have, as the calling process can tell before it: the
        replica count on the CPU runtime; None elsewhere (a TPU pod's size is known to the runtime
        only)."""
        if _xla.requested_device_type() == "CPU" and not _xla.launched_externally():
            return self.devices
        return None

    @property
    def runs_in_caller(self) -> bool:
        """Whether ``fit`` runs in the calling process (one device) rather than in started replicas."""
        return self.devices == 1

    def start_replicas(self, job: Callable[[], None]) -> int:
        """Run ``job()`` in every replica; returns the exit code of the replicas' process (0 when
        ``torch_xla.launch`` returns normally)."""
        if cpu_replicas.applies(self.devices):
            return cpu_replicas.launch(job, self.devices)
        if not _xla.launched_externally():
            _check_launch_devices(self.devices)
        _xla.launch(_replica_main, args=(job,))
        return 0

    def setup_environment(self) -> None:
        """Per replica, before anything else: pick the device, set up process groups."""
        self._device = _xla.device()

    # ---- where we are --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError("The strategy has no device before setup_environment().")
        return self._device

    @property
    def world_size(self) -> int:
        return _xla.world_size() if self._device is not None else 1

    @property
    def global_rank(self) -> int:
        return _xla.global_rank() if self._device is not None else 0

    @property
    def local_rank(self) -> int:
        return _xla.local_rank() if self._device is not None else 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    # ---- the module and the optimizers -------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device (in the strategy's precision) and wrap it.

        ``module`` is a dispatcher whose ``forward`` calls the user's ``*_step`` methods, so a
        wrapper's forward hooks run around every step; the user's ``configure_model()`` runs
        first. Returns the module to call.
        """
        with self._replica_random_state():
            module.module.configure_model()
        return self.precision.convert_module(module).to(self.device)

    @contextlib.contextmanager
    def _replica_random_state(self) -> Iterator[None]:
        """In a launched replica: torch's CPU random state as the calling process had it at launch,
        so that every replica builds the same layers (replicas start from copies of one module;
        only ``configure_model()`` creates weights in the replicas). Replicas that are threads
        share one generator and take turns.

        Rank 0's weights are not broadcast instead: writing into parameters on the device before
        ``XlaFullyShardedDataParallel`` wraps them makes it train wrongly (torch_xla 2.9).
        """
        if self._launch_rng_state is None:
            yield
            return
        with cpu_replicas.construction_lock(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._launch_rng_state)
            yield

    def setup_optimizers(self, module: "nn.Module", configure: Callable[[], Any]) -> Any:
        """Call the user's ``configure_optimizers`` once the module is wrapped."""
        del module
        return configure()

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The dispatcher inside whatever wrapper ``setup_module`` put around it."""
        return wrapped

    # ---- the step ------------------------------------------------------------------------
    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip gradient reduction during backward while ``enabled`` (accumulating)."""
        del wrapped, enabled
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        try:
            loss.backward(*args, **kwargs)
        except RuntimeError as err:
            if "device_ready_queues_" not in str(err):
                raise
            raise RuntimeError(
                "PyTorch's autograd engine was started (by a backward pass on the CPU) before the XLA "
                "runtime in this process, so it cannot run backward on XLA tensors. Start the XLA runtime "
                "first: call torch_xla.device() at the top of the script, before any backward()."
            ) from err

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make gradients equal on every replica before the step (if backward did not)."""
        del optimizer

    def clip_gradients(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer, value: float,
                       algorithm: str) -> None:
        """Clip the (reduced) gradients of ``optimizer`` by global norm or by value."""
        del wrapped
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(params, value)
        else:
            torch.nn.utils.clip_grad_value_(params, value)

    def manual_backward(self, wrapped: nn.Module, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """A backward pass under manual optimization (one of possibly several per step)."""
        del wrapped
        self.backward(loss, *args, **kwargs)

    def check_manual_optimization(self) -> None:
        """Refuse manual optimization where this strategy cannot do it (all but FSDP can)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        """Reduce gradients, run ``before_step`` (clipping) on the reduced ones, then step."""
        self.reduce_gradients(optimizer)
        if before_step is not None:
            before_step()
        optimizer.step()

    def sync(self) -> None:
        """Cut the lazy graph and launch its execution (asynchronously)."""
        _xla.sync()

    # ---- data ----------------------------------------------------------------------------
    def process_dataloader(self, loader: Iterable, distribute: bool = True) -> "DeviceData":
        """Give this replica its share of ``loader`` and deliver batches on the device
        (``distribute=False``: the loader as it is; its sampler must share out the data)."""
        owns_sampler = False
        if distribute and isinstance(loader, DataLoader) and (self.world_size > 1 or _plain_random(loader)):
            distributed = distribute_dataloader(loader, self.world_size, self.global_rank)
            owns_sampler, loader = distributed is not loader, distributed
        return DeviceData(loader, self.device, owns_sampler, self.input_sharding())

    def input_sharding(self) -> Any:
        """How batches are laid out over the devices as they are sent (None: on this replica's)."""
        return None

    # ---- collectives -----------------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce recorded in the graph (``sum``, ``max``, ``min``); identity for one replica."""
        if self.world_size == 1:
            return tensor
        return _xla.all_reduce(tensor, op)

    def any_replica(self, flag: bool) -> torch.Tensor | bool:
        """Whether any replica's ``flag`` is set: a device value recorded in the graph (read with
        the values it rides along with), or a bool where the replicas agree on the host."""
        return self.reduce(torch.tensor([1.0 if flag else 0.0]).to(self.device), "max")

    def preempted(self, step: int) -> bool:
        """Whether the platform's preemption notice stops the fit at ``step``, agreed by every
        replica (only strategies that use XLA's preemption sync say so)."""
        return False

    def all_gather_tensors(self, data: Any) -> Any:
        """Every replica's tensors in ``data``, stacked on a new first dimension, in the graph."""
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            stacked = tensor.unsqueeze(0)
            return stacked if self.world_size == 1 else _xla.all_gather(stacked, dim=0)

        return apply_to_collection(data, torch.Tensor, gather)

    def barrier(self, name: str = "barrier") -> None:
        if self.world_size > 1:
            _xla.rendezvous(name)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every replica's ``obj``, in rank order (a host rendezvous)."""
        if self.world_size == 1:
            return [obj]
        return _xla.all_gather_object(obj)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every replica (a host rendezvous)."""
        if self.world_size == 1:
            return obj
        return _xla.broadcast_object(obj)

    # ---- checkpoints ---------------------------------------------------------------------
    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's full state dict (keys as in the unwrapped module)."""
        return self.unwrap(wrapped).module.state_dict()

    def full_module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's whole state dict on this replica, even when training shards it.
        Every replica must call this (sharded strategies gather with a collective)."""
        return self.module_state_dict(wrapped)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    @property
    def checkpoint_layout(self) -> ckpt_layout.Layout:
        """How this strategy's checkpoints are written and which it resumes (``xtrainer.checkpoint``)."""
        return WholeFile()

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        load_weights(self.unwrap(wrapped).module, checkpoint["state_dict"])

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    # ---- the end ---------------------------------------------------------------------------
    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        """Leave the user's module unwrapped, on the CPU, and release what setup took.

        Moving the weights to the CPU is a device-to-host transfer (a host sync). After a failure
        with several replicas the device is left alone: pending work may hold a collective that
        the other replicas never join, and this replica's copy of the module is discarded anyway.
        """
        if failed and self.world_size > 1:
            return
        self.unwrap(wrapped).module.to("cpu")


def _check_launch_devices(devices: int | None) -> None:
    kind = _xla.requested_device_type()
    local = _xla.local_device_count_without_runtime()
    # torch_xla.launch runs one replica per local device and takes no count: another number of
    # devices cannot be honoured. (Checked against torch_xla's documentation; no TPU here.)
    if devices is not None and local is not None and devices != local:
        raise ValueError(
            f"devices={devices}, but torch_xla.launch runs one replica on each of the {local} local "
            f"{kind} devices. Use devices='auto' (or {local}), or make fewer devices visible to the runtime.")


def check_wrapper_kwargs(cls: type, kwargs: dict[str, Any], ours: type, theirs: str) -> None:
    """Refuse keyword arguments that the strategy ``ours`` passes on to the wrapper ``cls`` but
    ``cls`` does not take: now, not later when a replica builds the wrapper."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [*inspect.signature(ours.__init__).parameters, *params]
    known = [name for name in known if name not in ("self", "kwargs") and not name.endswith("_kwargs")]
    for key in kwargs:
        if key not in params:
            raise ValueError(f"{ours.__name__}({key}=...): neither {ours.__name__} nor {theirs} takes an argument "
                             f"{key!r}.{did_you_mean(key, known)}")


class ReplicaFailure(Exception):
    """The traceback of a replica's error, as the ``__cause__`` of the error raised in the caller."""


class _ReplicaJob:
    """What ``Strategy.launch`` sends to every replica (pickled into the replicas' processes).

    The first replica of each host writes its result to ``result.pt``; the first replica to fail
    writes its error to ``error.pkl`` (created exclusively, so later failures, often caused by
    the first, do not replace it).
    """

    _copy_lock = threading.Lock()

    def __init__(self, fn: Callable[..., Any], args: tuple, folder: str) -> None:
        self.fn, self.args = fn, args
        self.result_path = os.path.join(folder, "result.pt")
        self.error_path = os.path.join(folder, "error.pkl")

    def __call__(self) -> None:
        fn, args = self.fn, self.args
        try:
            if cpu_replicas.installed():
                # Replicas are threads of one process: each needs its own trainer, module and
                # strategy, as separate processes would have.
                with self._copy_lock:
                    fn, args = copy.deepcopy((fn, args))
            result = fn(*args)
            # The first replica of each host reports to that host's calling process (on a
            # multi-host pod every host runs its own; untested here). Weights are the same on
            # every replica.
            if _xla.local_rank() == 0:
                # Private to this launch (a folder only this user can read, made by the calling
                # process): the result may hold any object the user's hooks return.
                torch.save({"result": result}, self.result_path)
        except BaseException as err:
            self._record_failure(err)
            raise

    def _record_failure(self, err: BaseException) -> None:
        record = {"rank": _xla.global_rank(), "world_size": _xla.world_size(), "type": type(err).__name__,
                  "message": str(err), "traceback": "".join(traceback.format_exception(err))}
        try:
            payload = pickle.dumps({**record, "exception": err})
            pickle.loads(payload)
        except Exception:  # noqa: BLE001 - an exception that does not travel: send its text
            payload = pickle.dumps({**record, "exception": None})
        try:
            fd = os.open(self.error_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return  # another replica failed first
        with os.fdopen(fd, "wb") as f:
            f.write(payload)

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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
class DeviceData:
    """A data loader whose batches arrive on an XLA device, re-seeded at every epoch.

    A sampler the strategy put in (``owns_sampler``) shuffles with the run's seed and the epoch
    only, so a resumed run sees the same order as the original one.
    """

    def __init__(self, loader: Iterable, device: torch.device, owns_sampler: bool = False,
                 input_sharding: Any = None) -> None:
        self.loader, self.owns_sampler = loader, owns_sampler
        self._device_loader = _xla.DeviceBatches(loader, device, input_sharding)

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if self.owns_sampler and seed is not None:
            sampler.seed = seed
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch"):
            batch_sampler.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._device_loader)

    def resume_at(self, skip: int) -> Iterable[tuple[int, Any]]:
        """``(batch_idx, batch)`` from batch ``skip`` on: resuming inside an epoch.

        A map-style ``DataLoader`` skips at its batch sampler, by index: the skipped batches are
        neither loaded nor sent, so resuming late in an epoch costs what resuming at its start
        does. Any other loader (an ``IterableDataset``, a custom iterable) has no index to skip to:
        its first ``skip`` batches are read on the host and dropped (not sent to the device).
        """
        if skip == 0:
            return enumerate(self)
        loader = _skipping_loader(self.loader, skip)
        device_loader = _xla.DeviceBatches(loader, self._device_loader.device, self._device_loader.input_sharding,
                                           start=skip)
        return enumerate(device_loader, start=skip)


class _SkipBatches:
    """A batch sampler without its first ``skip`` batches (their indices are drawn, and dropped)."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]


class _DropFirst:
    """An iterable without its first ``skip`` items, read and dropped on the host."""

    def __init__(self, loader: Iterable, skip: int) -> None:
        self.loader, self.skip = loader, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.skip, None)


def _skipping_loader(loader: Iterable, skip: int) -> Iterable:
    if (isinstance(loader, DataLoader) and type(loader) is DataLoader and loader.batch_sampler is not None
            and not isinstance(loader.dataset, torch.utils.data.IterableDataset)):
        kwargs = {name: getattr(loader, name) for name in _DATALOADER_ARGS if hasattr(loader, name)}
        for name in ("batch_size", "drop_last"):  # they belong to the batch sampler
            kwargs.pop(name, None)
        if kwargs.get("num_workers", 0) == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        return DataLoader(loader.dataset, batch_sampler=_SkipBatches(loader.batch_sampler, skip), **kwargs)
    return _DropFirst(loader, skip)


_DATALOADER_ARGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                    "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
                    "persistent_workers")


def _plain_random(loader: DataLoader) -> bool:
    """A plain loader over a ``RandomSampler`` that a seeded ``DistributedSampler`` can stand in
    for exactly (same samples, an order that depends on the seed and the epoch only)."""
    sampler = loader.sampler
    return (type(loader) is DataLoader and type(loader.batch_sampler) is BatchSampler
            and type(sampler) is RandomSampler and not sampler.replacement
            and sampler._num_samples is None)  # private attribute: the num_samples argument


def distribute_dataloader(loader: DataLoader, num_replicas: int, rank: int) -> DataLoader:
    """``loader`` with its sampler replaced by a ``DistributedSampler`` for ``rank``.

    The new sampler keeps the loader's shuffle setting and is re-seeded each epoch by the
    Trainer (``set_epoch``). Its padding makes every replica see the same number of batches,
    so no replica waits at a collective for another that ran out of data.
    """
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if (type(loader) is not DataLoader or type(loader.batch_sampler) is not BatchSampler
            or type(loader.sampler) not in (SequentialSampler, RandomSampler)):
        raise TypeError(
            f"Cannot shard {type(loader).__name__} (sampler {type(loader.sampler).__name__}) across "
            f"{num_replicas} replicas automatically. Give it a torch.utils.data.DistributedSampler "
            f"with num_replicas={num_replicas} and rank=trainer.global_rank yourself."
        )
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise TypeError("An IterableDataset cannot be sharded by a sampler: split it by "
                        "trainer.global_rank inside the dataset instead.")
    shuffle = isinstance(loader.sampler, RandomSampler)
    return _with_sampler(loader, DistributedSampler(loader.dataset, num_replicas=num_replicas, rank=rank,
                                                    shuffle=shuffle))


def sequential_dataloader(loader: Any) -> Any:
    """``loader`` without shuffling (``overfit_batches``: the same first batches every epoch)."""
    if isinstance(loader, DataLoader) and type(loader) is DataLoader and isinstance(loader.sampler, RandomSampler) \
            and type(loader.batch_sampler) is BatchSampler:
        rank_zero_warn("overfit_batches: the training loader's shuffling is turned off, so every epoch sees the "
                       "same batches.")
        return _with_sampler(loader, SequentialSampler(loader.dataset))
    return loader


def _with_sampler(loader: DataLoader, sampler: Any) -> DataLoader:
    kwargs = {name: getattr(loader, name) for name in _DATALOADER_ARGS if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)
