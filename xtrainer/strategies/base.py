"""The strategy contract: everything the Trainer leaves to the device and the distribution.

A strategy decides how replicas are launched, how the module is wrapped, how gradients are reduced
and the optimizer stepped, where the lazy graph is cut, how batches reach the device and how
checkpoints are written. The Trainer owns the loop and calls these members in this order::

    launcher.launch(fn)                  # in the calling process; runs fn in every replica
      setup_environment()                # in each replica: device, process group, collectives
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

The loop reaches the device only through the strategy: ``to_cpu``, the device's random generator
(``rng_state``, ``set_rng_state``, ``rng_state_kept``), ``add_step_closure`` (the logging step's
read), ``batches_on_device``, ``device_counters`` and ``memory_info``. The XLA strategies hand
these to ``xtrainer._xla``; the native ones (``strategies/torch_native.py``) to PyTorch.

Launching is a family of its own (``strategies.launch``), and so are the replicas' collectives
(``strategies.collectives``), and delivering batches (``strategies.data``). What replicas that
share one process need (the CPU runtime's thread replicas) strategies ask the process
(``strategies.shared_process``), never the runtime that runs them. Every member runs on
every replica; collectives (``collectives.reduce``, ``collectives.barrier``,
``collectives.broadcast``, a checkpoint save) must be entered by all replicas or they hang.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import inspect
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from xtrainer import stepping
from xtrainer._lazy_xla import xla as _xla
from xtrainer.checkpoint import layout as ckpt_layout
from xtrainer.checkpoint.format import load_weights
from xtrainer.checkpoint.whole import WholeFile
from xtrainer.strategies import launch, shared_process
from xtrainer.strategies.collectives import Collectives, XlaReplicas
from xtrainer.strategies.data import DeviceData, _plain_random, distribute_dataloader
from xtrainer.strategies.precision import Precision
from xtrainer.suggest import did_you_mean


@dataclasses.dataclass(frozen=True)
class CompilerNames:
    """What ``XlaHealth`` calls a strategy's compiler (``Strategy.compiler``)."""

    prefix: str  # of the logged figures: "xla" gives "xla/compilations"
    name: str  # in messages: "XLA recompiled 1 graph(s)..."
    reasons: str  # how to see the compiler's own reasons for a recompilation


XLA_COMPILER = CompilerNames("xla", "XLA", "run with PT_XLA_DEBUG_LEVEL=2 to see torch_xla's reasons")


class Strategy(abc.ABC):
    """Base class of all strategies. Subclasses override what differs and nothing else."""

    #: The name ``Trainer(strategy=...)`` accepts for this class.
    name: ClassVar[str]
    #: Whether the replicas hold shards of the parameters (FSDP), not each a whole copy: the
    #: model summary then counts the shards whole and adds each replica's share.
    shards_parameters: ClassVar[bool] = False

    def __init__(self) -> None:
        self.devices: int | None = 1
        self.precision = Precision("32")
        self._device: torch.device | None = None
        #: How the replicas combine values and agree (``strategies.collectives``); this process
        #: alone until ``setup_environment()``.
        self.collectives: Collectives = Collectives()

    # ---- configuration (calling process, before launch) --------------------------------
    def connect(self, devices: int | None, precision: Precision) -> None:
        """Receive the Trainer's ``devices`` (None: every local device) and precision."""
        self.devices = devices
        self.precision = precision

    def check_accelerator(self, accelerator: str, num_nodes: int) -> None:
        """Refuse an ``accelerator`` (or ``num_nodes``) this strategy cannot run on (calling
        process, before launch)."""
        from xtrainer.config import arguments

        arguments.check_accelerator(accelerator, num_nodes)

    def resolve_devices(self, devices: int | str) -> int | None:
        """The Trainer's ``devices`` as a count (None: every local device)."""
        from xtrainer.config import arguments

        return arguments.resolve_devices(devices)

    # ---- launching ---------------------------------------------------------------------
    @property
    def launcher(self) -> launch.Launcher:
        """How ``fit`` runs in every replica (``strategies.launch``): in the calling process with
        one device; with more, as threads of one new process on the CPU runtime, or started by
        ``torch_xla.launch`` (one process per device on TPU)."""
        return launch.for_replicas(self.devices)

    def setup_environment(self) -> None:
        """Per replica, before anything else: pick the device, set up process groups; from here
        on ``collectives`` spans every replica."""
        self._device = _xla.device()
        self.collectives = XlaReplicas(self._device)

    # ---- where we are --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This replica's XLA device."""
        if self._device is None:
            raise RuntimeError("The strategy has no device before setup_environment().")
        return self._device

    @property
    def world_size(self) -> int:
        """How many replicas the run has (1 before ``setup_environment()``)."""
        return self.collectives.world_size

    @property
    def global_rank(self) -> int:
        """This replica's index among all of them."""
        return self.collectives.global_rank

    @property
    def local_rank(self) -> int:
        """This replica's index on its host."""
        return self.collectives.local_rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0 (which writes logs and a checkpoint's shared files)."""
        return self.global_rank == 0

    @property
    def node_rank(self) -> int:
        """This replica's host among all of them (0 before ``setup_environment()``)."""
        return self.collectives.node_rank

    def replicas_in_this_process(self) -> int:
        """How many replicas this process runs, sharing its counters, caches and CPU random
        generator: 1, unless the runtime that started them runs several as threads of one process
        (``strategies.shared_process``). Known from the replica's start, before
        ``setup_environment()``."""
        return shared_process.current().replicas()

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
        only ``configure_model()`` creates weights in the replicas). Replicas that share this
        process share one generator and take turns (``shared_process``).

        Rank 0's weights are not broadcast instead: writing into parameters on the device before
        ``XlaFullyShardedDataParallel`` wraps them makes it train wrongly (torch_xla 2.9).
        """
        rng_state = launch.launch_rng_state()
        if rng_state is None:
            yield
            return
        with shared_process.current().construction_lock(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng_state)
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

    #: The module's ``backward`` where it overrides ``XModule.backward`` (Lightning's hook), set
    #: for a stage: run in place of ``loss.backward()``.
    module_backward: Callable[..., None] | None = None

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` (or the module's ``backward``), with a message for an autograd
        engine started before the runtime."""
        try:
            if self.module_backward is not None:
                self.module_backward(loss, *args, **kwargs)
            else:
                loss.backward(*args, **kwargs)
        except RuntimeError as err:
            if "device_ready_queues_" not in str(err):
                raise
            raise RuntimeError(
                "PyTorch's autograd engine was started (by a backward pass on the CPU) before the XLA "
                "runtime in this process, so it cannot run backward on XLA tensors. Start the XLA runtime "
                "first: call torch_xla.device() at the top of the script, before any backward()."
            ) from err

    def _reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
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

    def requires_grad_changed(self, wrapped: nn.Module) -> None:
        """The module's ``toggle_optimizer``/``untoggle_optimizer`` switched ``requires_grad`` of
        the optimizers' parameters: a wrapper that computes with copies of them (gathered
        shards) takes the change here. Nothing to do where the optimizers' parameters are the
        ones the forward uses."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        """Reduce gradients, run ``before_step`` (clipping) on the reduced ones, then step."""
        self._reduce_gradients(optimizer)
        if before_step is not None:
            before_step()
        stepping.step(optimizer)

    def sync(self) -> None:
        """Cut the lazy graph and launch its execution (asynchronously)."""
        _xla.sync()

    def add_step_closure(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the step's work has been launched, at the next ``sync()`` (where
        reading the step's values costs one host sync)."""
        _xla.add_step_closure(fn)

    # ---- the device: transfers, random numbers, counters -----------------------------------
    def to_cpu(self, data: Any) -> Any:
        """Every device tensor in ``data`` (nested) copied to the host in one batched transfer.
        Syncs the host: callers say so where they call it."""
        return _xla.to_cpu(data)

    def rng_state(self) -> Any:
        """This replica's device random generator state (for XLA, a seed that every random op
        advances); what ``set_rng_state`` takes back."""
        return _xla.rng_state()

    def set_rng_state(self, state: Any) -> None:
        """Set this replica's device random generator: a state from ``rng_state()``, or an int seed."""
        _xla.set_rng_state(state)

    def seed_replica(self, seed: int, rank: int) -> None:
        """As a stage starts: this replica's device generator seeded with the run's seed plus its
        rank, so that replicas draw differently and a run draws the same as its repeat."""
        self.set_rng_state(seed + rank)

    def rng_state_kept(self) -> contextlib.AbstractContextManager:
        """Leave this replica's device generator as it was found (see ``_xla.rng_state_kept``)."""
        return _xla.rng_state_kept()

    def derived_rng_state(self, state: Any, offset: int) -> Any:
        """A generator state for replica ``offset`` when a checkpoint of another world size holds
        ``state`` (rank 0's): for XLA's seed, the seed plus the rank."""
        return state + offset

    def device_counters(self) -> dict[str, float]:
        """This process's counters (host counters: reading them syncs nothing), for ``XlaHealth``
        and goodput: always ``compiles`` (graphs compiled) and ``compile_s`` (their seconds); and
        those this strategy's compiler keeps among ``executions`` (graphs run), ``transfers``
        (device-to-host transfers) and ``graph_breaks``. XLA's: compilations, executions, transfers."""
        return {"compiles": self.compile_count(), "compile_s": self.compile_seconds(),
                "executions": _xla.execute_count(), "transfers": _xla.transfer_from_device_count()}

    # The two counters read at every step (by XlaHealth and goodput), each on its own.
    def compile_count(self) -> int:
        """``device_counters()["compiles"]``."""
        return _xla.compile_count()

    def compile_seconds(self) -> float:
        """``device_counters()["compile_s"]``."""
        return _xla.compile_seconds()

    #: How ``XlaHealth`` names this strategy's compiler: the prefix of its logged figures
    #: (``xla/compilations``...), the compiler in its messages, and how to see the compiler's own
    #: reasons for a recompilation.
    compiler: ClassVar[CompilerNames] = XLA_COMPILER

    def memory_info(self) -> dict[str, int] | None:
        """``{"bytes_used", "bytes_limit"}`` of this replica's device, or None where unknown."""
        return _xla.memory_info()

    def local_device_count(self) -> int:
        """This host's devices, as known without starting the runtime (0: unknown)."""
        return _xla.local_device_count_without_runtime()

    #: Whether this strategy's graphs are XLA's (the compilation cache, XLA's counters and chips).
    compiles_with_xla: bool = True
    #: Whether ops are recorded into a lazy graph that runs at ``sync`` (XLA), so that a few more
    #: in a step cost nothing until then; False where each op runs as it is called.
    lazy: bool = True

    #: Set for a run whose module (or data module) overrides a batch-transfer hook: its
    #: ``transfer_batch_to_device`` moves the batches, so a strategy that moves them in the
    #: training process delivers them on the host. The XLA strategies' batches still travel in
    #: torch_xla's loader (the hooks see them on the device, as in Lightning on TPUs).
    module_moves_batches: bool = False

    def batches_on_device(self, loader: Iterable, start: int = 0) -> Iterable:
        """``loader``'s batches delivered on this replica's device (``start``: the index of its
        first batch in the epoch, for messages)."""
        return _xla.DeviceBatches(loader, self.device, self._input_sharding(), start=start)

    # ---- data ----------------------------------------------------------------------------
    def process_dataloader(self, loader: Iterable, distribute: bool = True) -> DeviceData:
        """Give this replica its share of ``loader`` and deliver batches on the device
        (``distribute=False``: the loader as it is; its sampler must share out the data)."""
        owns_sampler = False
        if distribute and isinstance(loader, DataLoader) and (self.world_size > 1 or _plain_random(loader)):
            distributed = distribute_dataloader(loader, self.world_size, self.global_rank)
            owns_sampler, loader = distributed is not loader, distributed
        return DeviceData(loader, self.batches_on_device, owns_sampler, replicas=self.world_size)

    def _input_sharding(self) -> Any:
        """How batches are laid out over the devices as they are sent (None: on this replica's)."""
        return None

    # ---- stopping ---------------------------------------------------------------------------
    #: Whether ``preempted`` can say yes (the loop asks it after every batch only then).
    reads_preemption_notice = False

    def preempted(self, step: int) -> bool:
        """Whether the platform's preemption notice stops the fit at ``step``, agreed by every
        replica (only strategies that use XLA's preemption sync say so)."""
        return False

    # ---- checkpoints ---------------------------------------------------------------------
    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's full state dict (keys as in the unwrapped module)."""
        return self.unwrap(wrapped).module.state_dict()

    def full_module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's whole state dict on this replica, even when training shards it.
        Every replica must call this (sharded strategies gather with a collective)."""
        return self.module_state_dict(wrapped)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a checkpoint saves of ``optimizer`` on this replica."""
        return optimizer.state_dict()

    @property
    def checkpoint_layout(self) -> ckpt_layout.Layout:
        """How this strategy's checkpoints are written and which it resumes (``xtrainer.checkpoint``)."""
        return WholeFile()

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        """Load a checkpoint's weights into the module (as ``module_state_dict`` saved them)."""
        load_weights(self.unwrap(wrapped).module, checkpoint["state_dict"])

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what ``optimizer_state_dict`` saved into ``optimizer``."""
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
