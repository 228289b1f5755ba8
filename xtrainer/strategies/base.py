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

The device is not the strategy's: it belongs to the runtime the strategy holds
(``strategy.runtime``, ``xtrainer.runtimes``): graph cuts, host transfers, the device's random
generator, counters, memory figures and the device loader. The loop calls the runtime directly.
The XLA strategies hold an ``XlaRuntime``; the native ones (``strategies/native.py``) an
``EagerRuntime`` for the Trainer's ``accelerator``.

Launching is a family of its own (``strategies.launchers``), and so are the replicas' collectives
(``strategies.collectives``), and delivering batches (``strategies.data``). What replicas that
share one process need (the CPU runtime's thread replicas) strategies ask the process
(``strategies.shared_process``), never the runtime that runs them. Every member runs on
every replica; collectives (``collectives.reduce``, ``collectives.barrier``,
``collectives.broadcast``, a checkpoint save) must be entered by all replicas or they hang.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn
from torch.optim import optimizer as _torch_optimizer
from torch.utils.data import DataLoader

from xtrainer.checkpoint import layout as ckpt_layout
from xtrainer.checkpoint.format import load_weights
from xtrainer.checkpoint.whole import WholeFile
from xtrainer.runtimes import Runtime, XlaRuntime
from xtrainer.runtimes import xla as xla_runtime
from xtrainer.strategies import launchers, shared_process
from xtrainer.strategies.collectives import Collectives, XlaReplicas
from xtrainer.strategies.data import DeviceData, _plain_random, distribute_dataloader
from xtrainer.strategies.lightning_api import LightningCollectives
from xtrainer.strategies.precision import Precision


class Strategy(LightningCollectives, abc.ABC):
    """Base class of all strategies. Subclasses override what differs and nothing else. Lightning's
    collectives (``barrier``, ``broadcast``...) come from ``strategies.lightning_api``."""

    #: The name ``Trainer(strategy=...)`` accepts for this class.
    name: ClassVar[str]

    # What the strategy does, for code outside ``strategies/`` that must know (never its name):
    #: Parameters are split over the replicas (each holds a shard of each, FSDP's way), not each a
    #: whole copy: the model summary counts the shards whole and adds each replica's share.
    shards_parameters: ClassVar[bool] = False
    #: Parameters are taken out of their layers into shards the wrapper holds (torch_xla's FSDP):
    #: code that reads a layer's parameters outside the strategy (counting a step's FLOPs on a copy
    #: of the module) finds none; an optimizer over a layer's parameters is mapped to the shards
    #: by ``setup_optimizers``, a fine-tuning callback's by ``parameters_in_layers``.
    flattens_parameters: ClassVar[bool] = False
    #: Gradients are reduced only for the parameters that needed them when the module was
    #: wrapped (DDP's reducer): a layer unfrozen later would train apart on each replica.
    reduces_wrapped_trainable_only: ClassVar[bool] = False
    #: The strategy trains with nothing but this host's processes (``xtrainer doctor`` checks
    #: every such strategy); False: it needs a service started first (``native_ft``: a lighthouse).
    runs_standalone: ClassVar[bool] = True

    def __init__(self) -> None:
        self.devices: int | None = 1
        self.precision = Precision("32")
        #: The device this strategy's replicas compute on (``xtrainer.runtimes``).
        self.runtime: Runtime = self._make_runtime()
        #: How the replicas combine values and agree (``strategies.collectives``); this process
        #: alone until ``setup_environment()``.
        self.collectives: Collectives = Collectives()

    def _make_runtime(self) -> Runtime:
        """The runtime of a new strategy: torch_xla's, for the XLA strategies."""
        return XlaRuntime()

    # ---- configuration (calling process, before launch) --------------------------------
    def configure(self, accelerator: str, devices: int | str, num_nodes: int, precision: Precision) -> None:
        """Take the Trainer's settings (calling process, before launch): refuse an
        ``accelerator`` (or ``num_nodes``) this strategy cannot run on, and keep ``devices`` as a
        count (None: every local device) and the precision."""
        self._check_accelerator(accelerator, num_nodes)
        self.devices = self._resolve_devices(devices)
        self.precision = precision

    def _check_accelerator(self, accelerator: str, num_nodes: int) -> None:
        xla_runtime.check_accelerator(accelerator, num_nodes)

    def _resolve_devices(self, devices: int | str) -> int | None:
        return xla_runtime.resolve_devices(devices)

    # ---- launching ---------------------------------------------------------------------
    @property
    def launcher(self) -> launchers.Launcher:
        """How ``fit`` runs in every replica (``strategies.launchers``): in the calling process with
        one device; with more, as threads of one new process on the CPU runtime, or started by
        ``torch_xla.launch`` (one process per device on TPU)."""
        return launchers.for_replicas(self.devices)

    def setup_environment(self) -> None:
        """Per replica, before anything else: pick the device, set up process groups; from here
        on ``collectives`` spans every replica."""
        self.collectives = XlaReplicas(self.runtime.start(0))

    # ---- where we are --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This replica's device (the runtime's)."""
        return self.runtime.device

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

    # ---- the module and the optimizers -------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The user's ``configure_model()``, then ``module`` (a ``StepDispatcher``) to the device
        in the strategy's precision, wrapped. Returns the module to call."""
        with self._replica_random_state():
            module.module.configure_model()
            self._materialize(module.module)
        return self.precision.convert_module(module).to(self.device)

    def tensor_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Where ``Trainer.init_module(empty_init)`` builds a module (in the calling process): as
        it is, on the host; the strategy moves it to the device when a stage sets it up."""
        del empty_init
        return contextlib.nullcontext()

    def _materialize(self, module: nn.Module) -> None:
        """After ``configure_model()``, in the replica's random state: give tensors that were
        built without memory (on the meta device) theirs; nothing by default."""

    @contextlib.contextmanager
    def _replica_random_state(self) -> Iterator[None]:
        """In a launched replica: torch's CPU random state as the calling process had it at launch,
        so that every replica builds the same layers (replicas start from copies of one module;
        only ``configure_model()`` creates weights in the replicas). Replicas that share this
        process share one generator and take turns (``shared_process``).

        Rank 0's weights are not broadcast instead: writing into parameters on the device before
        ``XlaFullyShardedDataParallel`` wraps them makes it train wrongly (torch_xla 2.9).
        """
        rng_state = launchers.launch_rng_state()
        if rng_state is None:
            yield
            return
        with shared_process.current().construction_lock(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng_state)
            yield

    def setup_optimizers(self, module: "nn.Module", configure: Callable[[], Any], manual: bool = False) -> Any:
        """Call the user's ``configure_optimizers`` once the module is wrapped (``manual``: under
        manual optimization, which a strategy that cannot do it refuses here)."""
        del module, manual
        return configure()

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The dispatcher inside whatever wrapper ``setup_module`` put around it."""
        return wrapped

    # ---- the step ------------------------------------------------------------------------
    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip gradient reduction during backward while ``enabled`` (accumulating)."""
        del wrapped, enabled
        return contextlib.nullcontext()

    #: The module's ``backward`` where it overrides ``XModule.backward`` (``use_module_hooks``).
    _module_backward: Callable[..., None] | None = None
    #: Whether the module's batch-transfer hooks move the batches (``use_module_hooks``).
    _module_moves_batches: bool = False

    def use_module_hooks(self, backward: Callable[..., None] | None = None, moves_batches: bool = False) -> None:
        """For a stage (its end calls this with nothing): ``backward``, the module's override of
        ``XModule.backward`` (Lightning's hook), runs in place of ``loss.backward()``; and
        ``moves_batches``, a module (or data module) that overrides a batch-transfer hook moves
        the batches itself (its ``transfer_batch_to_device``), so a strategy that moves them in
        the training process delivers them on the host. The XLA strategies' batches still travel
        in torch_xla's loader (the hooks see them on the device, as in Lightning on TPUs)."""
        self._module_backward, self._module_moves_batches = backward, moves_batches

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` (or the module's ``backward``), with a message for an autograd
        engine started before the runtime."""
        try:
            if self._module_backward is not None:
                self._module_backward(loss, *args, **kwargs)
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

    def requires_grad_changed(self, wrapped: nn.Module) -> None:
        """The module's ``toggle_optimizer``/``untoggle_optimizer`` switched ``requires_grad`` of
        the optimizers' parameters: a wrapper that computes with copies of them (gathered
        shards) takes the change here. Nothing to do where the optimizers' parameters are the
        ones the forward uses."""

    def parameters_in_layers(self, wrapped: nn.Module,
                             optimizers: Iterable[torch.optim.Optimizer]) -> contextlib.AbstractContextManager:
        """A context, between steps, in which the user's module holds its own parameters in its
        layers and ``optimizers``' groups hold those parameters, so that code can freeze or
        unfreeze a layer and give its parameters to an optimizer as a new group (the fine-tuning
        callbacks); on leaving it, a wrapper that took the parameters out of their layers (into
        shards) takes those changes into what it trains. Nothing to do where the layers hold the
        parameters that train; a strategy that cannot hand them out refuses here."""
        del wrapped, optimizers
        return contextlib.nullcontext()

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        """Reduce gradients, run ``before_step`` (clipping) on the reduced ones, then step."""
        self._reduce_gradients(optimizer)
        if before_step is not None:
            before_step()
        optimizer_call(optimizer)

    # ---- data ----------------------------------------------------------------------------
    def process_dataloader(self, loader: Iterable, distribute: bool = True) -> DeviceData:
        """Give this replica its share of ``loader`` and deliver batches on the device
        (``distribute=False``: the loader as it is; its sampler must share out the data)."""
        owns_sampler = False
        if distribute and isinstance(loader, DataLoader) and (self.world_size > 1 or _plain_random(loader)):
            distributed = distribute_dataloader(loader, self.world_size, self.global_rank)
            owns_sampler, loader = distributed is not loader, distributed
        return DeviceData(loader, self._deliver, owns_sampler, replicas=self.world_size)

    def _deliver(self, loader: Iterable, start: int = 0) -> Iterable:
        """``loader``'s batches on this replica's device, laid out as this strategy shards them."""
        return self.runtime.batches_on_device(loader, start, self._input_sharding(), self._module_moves_batches)

    def _input_sharding(self) -> Any:
        """How batches are laid out over the devices as they are sent (None: on this replica's)."""
        return None

    # ---- stopping ---------------------------------------------------------------------------
    #: Whether the platform's preemption notice stops the fit at a step, agreed by every replica:
    #: ``preempted(step)``, or None where the strategy reads no notice (only strategies that use
    #: XLA's preemption sync read one; the loop asks after every batch only then).
    preempted: Callable[[int], bool] | None = None

    # ---- checkpoints ---------------------------------------------------------------------
    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's full state dict (keys as in the unwrapped module)."""
        return self.unwrap(wrapped).module.state_dict()

    def full_module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's whole state dict on this replica, even when training shards it.
        Every replica must call this (sharded strategies gather with a collective)."""
        return self.module_state_dict(wrapped)

    @property
    def checkpoint_layout(self) -> ckpt_layout.Layout:
        """How this strategy's checkpoints are written and which it resumes (``xtrainer.checkpoint``)."""
        return WholeFile()

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        """Load a checkpoint's weights into the module (as ``module_state_dict`` saved them)."""
        load_weights(self.unwrap(wrapped).module, checkpoint["state_dict"])

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what a checkpoint saved of ``optimizer`` (its ``state_dict()`` on this replica, in
        the layout's form) into ``optimizer``."""
        optimizer.load_state_dict(state)

    # ---- fault tolerance -------------------------------------------------------------------
    #: Called by the fit loop before each training batch (its batch drawn, nothing of it run yet),
    #: or None where the strategy needs no such call (the loop asks only then). ``native_ft``
    #: takes the step's quorum there.
    step_starts: Callable[[], None] | None = None

    def join_live_peers(self, snapshot: Callable[[], dict[str, Any]],
                        checkpoint: dict[str, Any] | None) -> dict[str, Any] | None:
        """Before a fit restores its state (every replica): a fault-tolerant strategy joins the
        replica groups training already, and returns a live peer's checkpoint to continue from
        where this group must heal (None: continue from ``checkpoint``, or from the start).
        ``snapshot()`` builds this fit's checkpoint, served to a peer that heals from this one
        later. Only ``native_ft`` has live peers."""
        del snapshot, checkpoint
        return None

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


# ---- the module as the strategy wraps it --------------------------------------------------
STEP_METHODS = {"train": "training_step", "validate": "validation_step", "test": "test_step",
                "predict": "predict_step"}


class StepDispatcher(nn.Module):
    """What ``setup_module`` wraps: calls the user's ``*_step`` from ``forward``, so a wrapper's
    forward hooks (DDP's, FSDP's) run around every step; floating-point inputs are cast to the
    run's precision here. ``batch_idx`` and ``dataloader_idx`` are passed as far as the step
    takes them (Lightning lets ``training_step(self, batch)`` leave them out)."""

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.module, self.precision = module, precision
        self._extra = {stage: max(0, positional_count(getattr(module, name)) - 1)
                       for stage, name in STEP_METHODS.items()}
        self.__dict__["_user"] = module  # read on every step without nn.Module's attribute lookup
        self._plain = precision.name == "32"  # nothing to cast, no autocast

    def forward(self, stage: str, batch: Any, *args: Any) -> Any:
        step = getattr(self._user, STEP_METHODS[stage])
        if self._plain:
            return step(batch, *args[:self._extra[stage]])
        with self.precision.step_context():
            return step(self.precision.convert_input(batch), *args[:self._extra[stage]])

    def __call__(self, stage: str, batch: Any, *args: Any) -> Any:
        """``forward`` straight away when nothing sits on this module (a wrapper's hooks, FSDP2's,
        or a compilation): ``nn.Module.__call__``'s checks cost more than the rest of the call."""
        if (self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks
                or self._compiled_call_impl is not None or not self._plain):
            return super().__call__(stage, batch, *args)
        return getattr(self._user, STEP_METHODS[stage])(batch, *args[:self._extra[stage]])


def positional_count(method: Any) -> int:
    """Positional arguments a bound step method takes (many for ``*args``)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return 3
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)


# ---- the optimizer's calls in a training step ------------------------------------------------
# ``optimizer_call`` (``optimizer.step()``) and ``clear_gradients``
# (``optimizer.zero_grad(set_to_none=True)``), without the profiler ranges torch puts around them
# when nothing records them.
#
# torch wraps the ``step`` of every optimizer class in ``Optimizer.profile_hook_step``: a
# ``record_function`` range (two operator calls and a handle object) and the step hooks. On the CPU
# the range costs about 25 us of host time per step: several percent of a small model's step, more
# than the rest of the Trainer's own work on it. Where nothing can see that range (torch's
# profiler is off) and nothing would run around the step (no step hooks, global or the optimizer's
# own), ``optimizer_call`` calls what torch wrapped, as torch would have called it, and nothing
# else changes: the optimizer's own ``step`` (with its ``no_grad`` wrapper), the learning-rate
# schedulers' record that the optimizer stepped, the result. Anything else (an optimizer whose
# ``step`` torch did not wrap, one with a ``step`` set on the instance, hooks, profiling) goes
# through ``optimizer.step()``. ``Strategy.optimizer_step`` calls it; XLA's ``xm.optimizer_step``
# calls ``optimizer.step()`` itself.


def _profiled_step_code() -> Any:
    """The code object of torch's step wrapper (one for every class it wraps), or None where
    this torch has no such wrapper."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    if wrap is None:
        return None
    try:
        return wrap(lambda *args, **kwargs: None).__code__
    except Exception:  # noqa: BLE001 - another torch: take the plain path
        return None


_PROFILED_STEP = _profiled_step_code()
_GLOBAL_HOOKS = (getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
                 getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))


@functools.lru_cache(maxsize=None)
def _unwrapped(step: Any) -> Any:
    """What torch's wrapper ``step`` calls, or None where ``step`` is not that wrapper."""
    code = getattr(step, "__code__", None)
    inner = getattr(step, "__wrapped__", None)
    return inner if _PROFILED_STEP is not None and code is _PROFILED_STEP and callable(inner) else None


def optimizer_call(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()``, without torch's profiler range where nothing records it."""
    inner = _unwrapped(type(optimizer).step)
    if inner is None or _observed(optimizer):
        return optimizer.step()
    own = optimizer.__dict__.get("step")
    if own is not None:
        # The learning-rate scheduler's record that the optimizer stepped (it warns otherwise), set
        # on the instance by torch's LRScheduler around the class's step: kept. Anything else set
        # there is the user's: called as it is.
        if not getattr(own, "_wrapped_by_lr_sched", False) or getattr(own, "__wrapped__", None) is not \
                type(optimizer).step:
            return optimizer.step()
        optimizer._opt_called = True  # type: ignore[attr-defined]
    out = inner(optimizer)
    optimizer._optimizer_step_code()  # torch's entry point for its profiler's Python tracing, as its wrapper calls it
    return out


def _observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether anything would see or run around the step: torch's profiler, or step hooks. (As
    torch's own compiled code decides whether to record its ranges, by the profiler's flag: an
    execution-trace observer running without the profiler does not see the range.)"""
    if _profiling():
        return True
    pre, post = _GLOBAL_HOOKS
    if pre is None or post is None or pre or post:
        return True
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", True)
                or getattr(optimizer, "_optimizer_step_post_hooks", True))


def clear_gradients(optimizer: Any) -> None:
    """``optimizer.zero_grad(set_to_none=True)``. Where that method is torch's own
    (``torch.optim.Optimizer.zero_grad``: every optimizer of ``torch.optim``), the same is done
    here: each parameter's gradient set to None. torch wraps its loop in a profiler range and a
    ``torch.compile`` guard, which cost about 10 us of host time per call on the CPU. Under
    torch's profiler (where the range is wanted) and for an optimizer with a ``zero_grad`` of its
    own, that method is called."""
    if type(optimizer).zero_grad is _TORCH_ZERO_GRAD and not _profiling():
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
    else:
        optimizer.zero_grad(set_to_none=True)


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _profiling() -> bool:
    """Whether torch's profiler records (where this torch cannot say: as if it did)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
