"""The runtime contract: the device a replica computes on, apart from how replicas are distributed.

A runtime owns everything about the device: which ``torch.device`` this process uses and how many
a host has, the process-group backend that device speaks, graph cuts and host transfers, the
device's random generator, its counters and memory figures, how batches reach it, and what
``torch.compile`` and autocast are told for it. A strategy (``xtrainer.strategies``) owns the
distribution (process groups, wrapping, gradient reduction, the optimizer step, the checkpoint
layout) and holds one runtime, ``strategy.runtime``; the loop reaches the device through that
runtime, one call away.

Two runtimes exist: ``XlaRuntime`` (``runtimes/xla.py``, torch_xla's lazy tensors) and
``EagerRuntime`` (``runtimes/eager.py``, any device PyTorch runs eagerly, reached through
``torch.accelerator``: cpu, cuda, TorchTPU's ``tpu``, TorchNeuron's ``neuron``, and any backend
that registers itself).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
from typing import Any, Callable, ClassVar, Iterable

import torch


@dataclasses.dataclass(frozen=True)
class CompilerNames:
    """What ``XlaHealth`` calls a runtime's compiler (``Runtime.compiler``)."""

    prefix: str  # of the logged figures: "xla" gives "xla/compilations"
    name: str  # in messages: "XLA recompiled 1 graph(s)..."
    reasons: str  # how to see the compiler's own reasons for a recompilation


class Runtime(abc.ABC):
    """One kind of device, as one replica process uses it."""

    #: The device type of ``torch.device`` this runtime computes on ("xla", "cpu", "cuda", ...).
    type: str
    #: Whether ops are recorded into a lazy graph that runs at ``sync`` (XLA), so that a few more
    #: in a step cost nothing until then; False where each op runs as it is called.
    lazy: ClassVar[bool] = False
    #: Whether graphs are XLA's (the persistent compilation cache, XLA's counters and chips).
    compiles_with_xla: ClassVar[bool] = False
    #: How the runtime's compiler is named in figures and messages.
    compiler: ClassVar[CompilerNames]

    def __init__(self) -> None:
        self._device: torch.device | None = None

    # ---- where: devices and processes ---------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This replica's device (after ``start``)."""
        if self._device is None:
            raise RuntimeError("The runtime has no device before the replica starts (setup_environment()).")
        return self._device

    @abc.abstractmethod
    def start(self, local_rank: int) -> torch.device:
        """Take this process's device (``local_rank``: its index among the processes of its host,
        where the backend's convention uses it) and make it current."""

    @abc.abstractmethod
    def local_device_count(self) -> int:
        """This host's devices, as known without starting the runtime (0: unknown)."""

    @property
    def autocast_device_type(self) -> str:
        """The ``device_type`` that ``torch.autocast`` takes for this runtime's device."""
        return self.type

    # ---- the step: graph cuts and host transfers ------------------------------------------------
    @abc.abstractmethod
    def sync(self) -> None:
        """Cut the lazy graph and launch its execution (asynchronously); eager runtimes run the
        closures added since the last one."""

    @abc.abstractmethod
    def add_step_closure(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the step's work has been launched, at the next ``sync()`` (where
        reading the step's values costs one host sync)."""

    @abc.abstractmethod
    def to_cpu(self, data: Any) -> Any:
        """Every device tensor in ``data`` (nested) copied to the host in one batched transfer.
        Syncs the host: callers say so where they call it."""

    @abc.abstractmethod
    def batches_on_device(self, loader: Iterable, start: int = 0, sharding: Any = None,
                          on_host: bool = False) -> Iterable:
        """``loader``'s batches delivered on this replica's device (``start``: the index of its
        first batch in the epoch, for messages; ``sharding``: how an SPMD batch is laid out;
        ``on_host``: left on the host, for a module whose batch-transfer hooks move them)."""

    # ---- random numbers ---------------------------------------------------------------------------
    @abc.abstractmethod
    def rng_state(self) -> Any:
        """This replica's device random generator state; what ``set_rng_state`` takes back."""

    @abc.abstractmethod
    def set_rng_state(self, state: Any) -> None:
        """Set this replica's device generator: a state from ``rng_state()``, or an int seed."""

    def seed_replica(self, seed: int, rank: int, in_caller: bool) -> None:
        """As a stage starts: this replica's device generator seeded with the run's seed plus its
        rank, so that replicas draw differently and a run draws the same as its repeat
        (``in_caller``: this replica runs in the process that built the module)."""
        del in_caller
        self.set_rng_state(seed + rank)

    @contextlib.contextmanager
    def rng_state_kept(self) -> Any:
        """Leave this replica's device generator as it was found: work that a run does or not (a
        save, a check before one) must not change the random numbers it draws afterwards."""
        state = self.rng_state()
        try:
            yield
        finally:
            self.set_rng_state(state)

    @abc.abstractmethod
    def derived_rng_state(self, state: Any, offset: int) -> Any:
        """A generator state for replica ``offset`` when a checkpoint of another world size holds
        ``state`` (rank 0's)."""

    # ---- counters and memory --------------------------------------------------------------------
    @abc.abstractmethod
    def device_counters(self) -> dict[str, float]:
        """This process's counters (host counters: reading them syncs nothing), for ``XlaHealth``
        and goodput: always ``compiles`` (graphs compiled) and ``compile_s`` (their seconds); and
        those the compiler keeps among ``executions``, ``transfers`` and ``graph_breaks``."""

    @abc.abstractmethod
    def compile_count(self) -> int:
        """``device_counters()["compiles"]``, on its own (read after every batch)."""

    @abc.abstractmethod
    def compile_seconds(self) -> float:
        """``device_counters()["compile_s"]``, on its own."""

    #: Whether ``compile_count`` can ever move in this run (False: per-batch watches of
    #: compilations have nothing to watch).
    counts_compilations: bool = True

    def chip_name(self) -> str | None:
        """The chip this process runs on, as ``flops.PEAK_BF16_FLOPS`` names it (for MFU), or None
        where it cannot be told; ``XTRAINER_CHIP`` overrides."""
        return os.environ.get("XTRAINER_CHIP") or None

    @abc.abstractmethod
    def memory_info(self) -> dict[str, int] | None:
        """``{"bytes_used", "bytes_limit"}`` of this replica's device, or None where unknown."""

    # ---- what other layers are told ---------------------------------------------------------------
    def process_group_backend(self) -> str:
        """The ``torch.distributed`` backend of this device (gloo, nccl, tpu_dist, neuron, xccl...)."""
        raise NotImplementedError(f"The {self.type} runtime has no torch.distributed backend of its own.")

    def compile_options(self, user: dict[str, Any]) -> dict[str, Any]:
        """What ``torch.compile`` is called with for this device: its defaults, then ``user``'s."""
        return dict(user)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)
