"""``EagerRuntime``: a device that PyTorch runs eagerly, reached through ``torch.accelerator``.

Device types: ``cpu`` (tested here), ``cuda`` (``accelerator="gpu"`` too), TorchTPU's ``tpu``,
TorchNeuron's ``neuron``, and any backend that registers itself with PyTorch as its accelerator
(PrivateUse1). This module is the only one that calls a device module's API
(``torch.get_device_module``, ``torch.cuda``); everything else asks the runtime.

Conventions, each from its backend's documentation (only ``cpu`` runs here; the selection logic
is tested against a PrivateUse1 device registered without tensors):

- the device index of a process: ``LOCAL_RANK`` for backends with several devices per process
  view (CUDA), ``torch.accelerator.current_device_index()`` for those that show each process
  one device (TorchTPU runs one process per chip, and each sees its chip as ``tpu:0``);
- the process-group backend: ``torch.distributed.Backend.default_device_backend_map`` (gloo,
  nccl, xccl, and what a backend registers: ``tpu_dist``, ``neuron``);
- ``torch.compile``: inductor on cpu and cuda; ``backend="tpu", dynamic=False`` on TorchTPU;
  ``backend="neuron", fullgraph=True, dynamic=False`` on TorchNeuron.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable, Iterable, Iterator

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from xtrainer.runtimes.base import CompilerNames, Runtime

#: ``Trainer(accelerator=...)`` names of the eager device types (``"auto"`` aside).
ACCELERATORS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "tpu": "tpu", "neuron": "neuron"}

#: The package a device type needs imported before PyTorch knows the device (untested here).
_BACKEND_PACKAGES = {"tpu": "torch_tpu", "neuron": "torch_neuronx"}

#: Process-group backends of the device types whose backend torch may not list.
_KNOWN_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}

#: Device types whose processes each see one device, as index 0 (TorchTPU: one process per chip).
_ONE_DEVICE_PER_PROCESS = frozenset({"tpu"})

#: ``torch.compile``'s defaults per device type, as their backends document them (untested here).
_COMPILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "tpu": {"backend": "tpu", "dynamic": False},
    "neuron": {"backend": "neuron", "fullgraph": True, "dynamic": False},
}

TORCH_COMPILE = CompilerNames("torch_compile", "torch.compile",
                              "run with TORCH_LOGS=recompiles to see the guard that failed")


def native_accelerator() -> str | None:
    """The device type of PyTorch's current accelerator (CUDA, a registered native backend), or
    None where PyTorch has none (the CPU alone)."""
    if not torch.accelerator.is_available():
        return None
    current = torch.accelerator.current_accelerator()
    return current.type if current is not None else None


def device_type_of(accelerator: str) -> str:
    """The eager device type ``accelerator`` asks for; ``"auto"``: PyTorch's accelerator, else the
    CPU. Refuses what this host cannot run, in one line that says what to do."""
    accelerator = str(accelerator).lower()
    if accelerator == "auto":
        return native_accelerator() or "cpu"
    kind = ACCELERATORS.get(accelerator)
    if kind is None:
        registered = native_accelerator()
        if accelerator != registered:
            raise ValueError(f"accelerator={accelerator!r}: the native strategies run on "
                             f"{', '.join(repr(a) for a in ['auto', *ACCELERATORS])}"
                             f"{f' or {registered!r}' if registered else ''}.")
        kind = registered
    _import_backend(kind)
    if kind != "cpu" and native_accelerator() != kind:
        raise RuntimeError(f"accelerator={accelerator!r}, but PyTorch sees no {kind} device here; install its "
                           f"PyTorch backend or use accelerator='cpu'.")
    return kind


def _import_backend(kind: str) -> None:
    package = _BACKEND_PACKAGES.get(kind)
    if package is None or native_accelerator() == kind:
        return
    try:
        importlib.import_module(package)  # registers the device with PyTorch (untested here)
    except ImportError as err:
        raise RuntimeError(f"accelerator={kind!r} needs the {package} package (PyTorch's native {kind} backend); "
                           f"install it, or use accelerator='cpu'.") from err


def process_group_backend(kind: str) -> str:
    """The ``torch.distributed`` backend of device type ``kind``."""
    registered = getattr(torch.distributed.Backend, "default_device_backend_map", {}).get(kind)
    found = registered or _KNOWN_BACKENDS.get(kind)
    if found is None:
        raise RuntimeError(f"No process-group backend is registered for the {kind!r} device: import its PyTorch "
                           "backend package before the Trainer starts.")
    return found


def compile_options(kind: str, user: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile``'s arguments on ``kind``: its defaults, then the user's."""
    return {**_COMPILE_DEFAULTS.get(kind, {}), **user}


def device_index(kind: str, local_rank: int) -> int:
    """The index of this process's ``kind`` device, by the backend's convention."""
    if kind in _ONE_DEVICE_PER_PROCESS:
        return torch.accelerator.current_device_index()
    count = torch.accelerator.device_count()
    if count == 1:
        return 0  # one device visible to this process (CUDA_VISIBLE_DEVICES, a scheduler's binding)
    if local_rank >= count:
        raise RuntimeError(f"This process is local rank {local_rank}, but it sees {count} {kind} device(s): start at "
                           f"most {count} processes per host.")
    return local_rank


def to_host(data: Any) -> Any:
    """Every tensor in ``data`` (nested) on the host; a host sync for device tensors (callers
    say so). CPU tensors pass unchanged."""
    return apply_to_collection(data, torch.Tensor, lambda t: t if t.device.type == "cpu" else t.cpu())  # host sync


@functools.cache
def _dynamo_utils() -> Any:
    """``torch._dynamo.utils`` (private), imported once; None for a torch without Dynamo."""
    try:
        from torch._dynamo import utils as dynamo_utils
    except ImportError:
        return None
    return dynamo_utils


def compiled_graphs() -> int:
    """Graphs Dynamo compiled in this process so far (a recompilation is one more): the one
    counter XlaHealth reads after every batch; 0 if it moved."""
    counters = getattr(_dynamo_utils(), "counters", None)
    stats = counters.get("stats") if isinstance(counters, dict) else None
    return int(stats.get("unique_graphs", 0)) if stats else 0


def torch_compile_counters() -> dict[str, float]:
    """This process's torch.compile counters so far (host counters): graphs Dynamo compiled
    (``compiled_graphs``), the seconds spent compiling them, and graph breaks. Read from
    ``torch._dynamo.utils`` (private: its ``counters`` and ``compilation_time_metrics``, checked
    with torch 2.9 and 2.14); zeros if they moved."""
    dynamo_utils = _dynamo_utils()
    counters = getattr(dynamo_utils, "counters", {})
    times = getattr(dynamo_utils, "compilation_time_metrics", {})
    seconds = times.get("_compile.compile_inner") or times.get("entire_frame_compile") or []
    return {"compiles": compiled_graphs(), "compile_s": float(sum(seconds)),
            "graph_breaks": int(sum(counters["graph_break"].values())) if "graph_break" in counters else 0}


class EagerRuntime(Runtime):
    """One eager device type of standard PyTorch.

    Args:
        kind: the device type (``device_type_of(accelerator)``).
    """

    compiler = TORCH_COMPILE

    def __init__(self, kind: str = "cpu") -> None:
        super().__init__()
        self.type = kind
        #: Whether the strategy runs the module through ``torch.compile`` (set by it): without it
        #: no compilation happens, and nothing counts them.
        self.compiling = False
        self._closures: list[Callable[[], None]] = []

    @classmethod
    def for_accelerator(cls, accelerator: str) -> "EagerRuntime":
        return cls(device_type_of(accelerator))

    # ---- where --------------------------------------------------------------------------------
    def start(self, local_rank: int) -> torch.device:
        if self.type == "cpu":
            self._device = torch.device("cpu")
        else:
            index = device_index(self.type, local_rank)
            torch.accelerator.set_device_index(index)
            self._device = torch.device(self.type, index)
        return self._device

    def local_device_count(self) -> int:
        return 1 if self.type == "cpu" else int(torch.accelerator.device_count())

    def process_group_backend(self) -> str:
        return process_group_backend(self.type)

    def compile_options(self, user: dict[str, Any]) -> dict[str, Any]:
        return compile_options(self.type, user)

    # ---- the step -------------------------------------------------------------------------------
    def sync(self) -> None:
        """No lazy graph to cut: the step ran as it was called. Closures added during the step
        (the logging step's read of its values) run here."""
        if self._closures:
            closures, self._closures = self._closures, []
            for fn in closures:
                fn()

    def add_step_closure(self, fn: Callable[[], None]) -> None:
        self._closures.append(fn)

    def drop_closures(self) -> None:
        """Forget closures of a stage that ended (a failed step's read)."""
        self._closures = []

    def to_cpu(self, data: Any) -> Any:
        return to_host(data)

    def batches_on_device(self, loader: Iterable, start: int = 0, sharding: Any = None,
                          on_host: bool = False) -> Iterable:
        del sharding
        return _OnDevice(loader, None if on_host else self.device, start)

    # ---- random numbers ----------------------------------------------------------------------------
    def rng_state(self) -> Any:
        """The device generator's state. Read through torch (``torch.utils.checkpoint``'s
        ``get_device_states``), not the device module: TorchTPU refuses its RNG getters called
        from outside PyTorch (torch >= 2.13). An empty tensor names the device; no sync."""
        if self.type == "cpu":
            return torch.get_rng_state()
        from torch.utils.checkpoint import get_device_states

        return get_device_states(torch.empty(0, device=self.device))[1][0]

    def set_rng_state(self, state: Any) -> None:
        """An int seeds the device's generator; a state from ``rng_state`` is set back through
        torch (``set_device_states``), as it was read."""
        if isinstance(state, int):
            if self.type == "cpu":
                torch.manual_seed(state)
            else:
                torch.get_device_module(self.type).manual_seed(state)
        elif self.type == "cpu":
            torch.set_rng_state(state)
        else:
            from torch.utils.checkpoint import set_device_states

            set_device_states([self.device.index or 0], [state], device_type=self.type)

    def seed_replica(self, seed: int, rank: int, in_caller: bool) -> None:
        """On the CPU the device's generator is the host's, which the calling process has drawn
        from already (the module's initialisation, after ``seed_everything``): rank 0 running in
        that process goes on from where it stands, as in Lightning, instead of seeding it again
        and drawing the initialisation's numbers once more in its steps. Other ranks, and
        processes of their own, are seeded with the run's seed plus their rank."""
        if self.type == "cpu" and rank == 0 and in_caller:
            return
        super().seed_replica(seed, rank, in_caller)

    def derived_rng_state(self, state: Any, offset: int) -> Any:
        """A seed for replica ``offset`` derived from rank 0's generator state (torch's states are
        not seeds that can be offset)."""
        seed = int.from_bytes(bytes(torch.as_tensor(state, dtype=torch.uint8)[-8:].tolist()), "little") % 2**62  # a CPU state, at restore: no device
        return seed + offset

    # ---- counters and memory ------------------------------------------------------------------------
    @property
    def counts_compilations(self) -> bool:  # type: ignore[override]
        return self.compiling

    def device_counters(self) -> dict[str, float]:
        """torch.compile's counters (``torch_compile_counters``); no compilations without it.
        Executions and transfers are not counted: PyTorch keeps no such counters."""
        if not self.compiling:
            return {"compiles": 0, "compile_s": 0.0}
        return torch_compile_counters()

    def compile_count(self) -> int:
        return compiled_graphs() if self.compiling else 0

    def compile_seconds(self) -> float:
        return torch_compile_counters()["compile_s"] if self.compiling else 0.0

    def chip_name(self) -> str | None:
        """``XTRAINER_CHIP``; else a CUDA device by its name, a TorchTPU chip by the accelerator type
        its VM announces (``TPU_ACCELERATOR_TYPE``); None on the CPU and for other devices."""
        from xtrainer import chips

        named = super().chip_name()
        if named or self.type == "cpu":
            return named
        if self.type == "cuda":
            return chips.gpu_chip(torch.cuda.get_device_name(self.device))
        if self.type == "tpu" and os.environ.get("TPU_ACCELERATOR_TYPE"):
            return chips.tpu_chip(os.environ["TPU_ACCELERATOR_TYPE"])
        return None

    def memory_info(self) -> dict[str, int] | None:
        """Bytes in use (``torch.accelerator.memory_allocated``) and the device's capacity, asked
        of the allocator (no device sync); None for the CPU and where the capacity is unknown."""
        if self.type == "cpu":
            return None
        if self.type != "cuda":
            return None  # the native backends' capacity is not exposed through torch.accelerator (untested here)
        return {"bytes_used": int(torch.accelerator.memory_allocated(self.device)),
                "bytes_limit": int(torch.cuda.get_device_properties(self.device).total_memory)}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_closures"] = []
        return state


class _OnDevice:
    """A host loader's batches moved to ``device`` as they are drawn (``move_data_to_device``:
    every tensor and every object with a ``to`` method, as Lightning moves them; non-blocking
    copies; None: left on the host, the CPU's or for the module's batch-transfer hooks).
    A loader's exception is raised with a note naming the batch."""

    def __init__(self, loader: Iterable, device: torch.device | None, start: int = 0) -> None:
        self.loader, self.device, self.start = loader, device, start

    def __iter__(self) -> Iterator[Any]:
        from xtrainer.module import move_data_to_device

        index = self.start
        device = self.device if self.device is not None and self.device.type != "cpu" else None
        try:
            # What the loop does with a batch happens outside this generator: an exception here
            # comes from the loader or the move.
            for batch in self.loader:
                yield batch if device is None else move_data_to_device(batch, device)
                index += 1
        except Exception as err:
            dataset = getattr(self.loader, "dataset", None)
            what = type(self.loader).__name__ + (f" over {type(dataset).__name__}" if dataset is not None else "")
            err.add_note(f"(raised while loading batch index {index} of {what}; the batches before it were used)")
            raise
