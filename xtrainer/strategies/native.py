"""``"native"``: standard PyTorch (``torch.distributed``), the same ``XModule`` without torch_xla, on
one device (``NativeSingle``), and the base of the native family:

- ``NativeDDP`` (``"native_ddp"``, ``strategies/native_ddp.py``): ``DistributedDataParallel``, one
  process per device.
- ``NativeFSDP`` (``"native_fsdp"``, ``strategies/native_fsdp.py``): FSDP2
  (``torch.distributed.fsdp.fully_shard``), layers wrapped by class as the XLA FSDP strategies do,
  optional activation checkpointing, and sharded checkpoints through
  ``torch.distributed.checkpoint`` that resume at any world size.

Their processes join the default process group in ``strategies/process_group.py`` (which holds
their collectives, ``ProcessGroup``); their launchers are in
``strategies/launchers/native_processes.py``.

Each takes ``compile=True`` (the module's ``forward`` runs through ``torch.compile``). The device
comes from the Trainer's ``accelerator``: the strategy holds an ``EagerRuntime``
(``xtrainer/runtimes/eager.py`` holds every device specific: only ``cpu`` is tested here).
Processes: ``devices=N`` runs rank 0 in the calling process and starts N-1 processes on this host
for the others (``NativeProcesses``); under ``torchrun`` (its ``RANK``/``WORLD_SIZE``... in the
environment) each process runs its replica in place (``InPlace``), on any number of nodes.

Gradient clipping by norm is by the norm of the whole gradient in all three (``native_fsdp``'s
shards summed with one all-reduce); manual optimization arms DDP's reducer, or FSDP2's gradient
reduce-scatter, for each backward pass of a ``training_step``.

There is no lazy graph: a step runs eagerly. Logged values stay on the device and are read once
per ``log_every_n_steps`` (``add_step_closure`` runs the read at that step's ``sync()``).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from xtrainer.runtimes import EagerRuntime
from xtrainer.strategies import dtensors, launchers, process_group
from xtrainer.strategies.base import Strategy
from xtrainer.strategies.launchers import native_processes

#: The default ``agreement_seconds``: an agreement costs a gloo all-reduce of about 0.1-0.3 ms of
#: CPU time per process here, under 0.1% of the time between two, and a stop or a NaN report
#: waits half a second at most (a preemption notice gives 30 s).
AGREEMENT_SECONDS = 0.5


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
        self.collectives = process_group.ProcessGroup(torch.device("cpu"))

    def _make_runtime(self) -> EagerRuntime:
        return EagerRuntime("cpu")  # until configure() names the device

    # ---- configuration --------------------------------------------------------------------
    def _check_accelerator(self, accelerator: str, num_nodes: int) -> None:
        self.accelerator = str(accelerator).lower()
        self.runtime = EagerRuntime.for_accelerator(self.accelerator)  # refuses what this host cannot run
        self.runtime.compiling = self.compile
        if num_nodes == 1:
            return
        if not process_group.under_torchrun():  # several hosts are started by their launcher, each host's processes in place
            raise ValueError(f"num_nodes={num_nodes}: the native strategies run on several hosts under torchrun (or a "
                             f"launcher like it): start each host's processes with torchrun --nnodes={num_nodes}, "
                             "or leave num_nodes=1.")
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if world != num_nodes * local:
            raise ValueError(f"num_nodes={num_nodes}, but the launcher started {world} processes, {local} on this host "
                             f"({world // max(local, 1)} host(s)): give num_nodes={world // max(local, 1)}, or start "
                             f"{num_nodes} hosts.")

    def _resolve_devices(self, devices: int | str) -> int | None:
        if process_group.under_torchrun():
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
        if process_group.REPLICA_OF_CALLER in os.environ or (self.devices != 1 and not process_group.under_torchrun()):
            return native_processes.NativeProcesses(self.devices, self.timeout_seconds)  # in its replicas too: they report to the caller
        return native_processes.InPlace(self.devices)

    def setup_environment(self) -> None:
        runtime = self.runtime
        device = runtime.start(process_group.device_index())
        self.precision.device_type = runtime.autocast_device_type
        if process_group.join(runtime, device, self.timeout_seconds):
            self._owns_process_group = True
        self.collectives = process_group.ProcessGroup(device, self.agreement_seconds)
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
        shards = [dtensors.local(grad) for grad in grads]
        if algorithm == "value":
            for shard in shards:
                shard.clamp_(-value, value)
            return
        norm = dtensors.gradient_norm(grads, shards)
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


#: Names this module held before each native strategy had a module of its own (configurations,
#: pickles and imports may name them here): where each lives now.
_MOVED = {
    "NativeDDP": "xtrainer.strategies.native_ddp", "NativeFSDP": "xtrainer.strategies.native_fsdp",
    "ProcessGroup": "xtrainer.strategies.process_group", "in_process_group_env": "xtrainer.strategies.process_group",
    "under_torchrun": "xtrainer.strategies.process_group",
    "InPlace": "xtrainer.strategies.launchers.native_processes",
    "NativeProcesses": "xtrainer.strategies.launchers.native_processes",
}


def __getattr__(name: str) -> Any:
    """The names of ``_MOVED``, from their modules (imported on first use: ``native_ddp`` and
    ``native_fsdp`` import this one)."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
