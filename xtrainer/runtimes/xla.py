"""``XlaRuntime``: torch_xla's lazy tensors, on any PJRT device (TPU, a PJRT plugin, the CPU runtime).

Every call goes to ``xtrainer._xla``, the one module that imports torch_xla, which this runtime
imports when it is built (so that ``import xtrainer`` works without torch_xla): a device call is
the runtime's method and ``_xla``'s function.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, ClassVar, Iterable

import torch

from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer._lazy_xla import xla as lazy_xla
from xtrainer.runtimes.base import CompilerNames, Runtime

XLA_COMPILER = CompilerNames("xla", "XLA", "run with PT_XLA_DEBUG_LEVEL=2 to see torch_xla's reasons")


# ---- the Trainer's device arguments, for the XLA strategies (before any runtime starts) ----------
def resolve_devices(devices: int | str) -> int | None:
    """``devices`` as a count of XLA devices on this host (None: every one)."""
    if devices == "auto":
        if lazy_xla.requested_device_type() == "CPU":
            return 1  # several replicas on the CPU runtime are opt-in: devices=N
        return lazy_xla.local_device_count_without_runtime()
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}: give a positive int or 'auto'.")
    return devices


def check_accelerator(accelerator: str, num_nodes: int) -> None:
    """``accelerator`` names the XLA device kind: "cpu" is the XLA CPU runtime, "tpu"/"xla" what
    PJRT_DEVICE names (the settings refused anything else)."""
    accelerator = accelerator.lower()
    if accelerator in ("gpu", "cuda", "neuron"):
        raise ValueError(f"accelerator={accelerator!r}: the XLA strategies run on XLA devices. Use a native strategy "
                         "(strategy='native', 'native_ddp' or 'native_fsdp') for it, or accelerator='auto', 'tpu' or "
                         "'cpu' (the XLA CPU runtime).")
    requested = lazy_xla.requested_device_type()
    if accelerator == "cpu" and requested != "CPU":
        raise ValueError(f"accelerator='cpu' asks for the XLA CPU runtime, but PJRT_DEVICE={requested}; "
                         "unset PJRT_DEVICE (or set it to CPU), or use accelerator='auto'.")
    if accelerator == "tpu" and requested == "CPU":
        rank_zero_warn(f"accelerator={accelerator!r}, but PJRT_DEVICE is CPU: running on the XLA CPU runtime.")
    if num_nodes > 1 and requested == "CPU":
        raise ValueError(f"num_nodes={num_nodes}: the XLA CPU runtime runs on one host; use devices=N for N replicas.")


def _xla_module() -> Any:
    """``xtrainer._xla``, with the message of ``_lazy_xla`` where torch_xla is missing."""
    from xtrainer._lazy_xla import xla

    xla.sync  # noqa: B018 - imports it (raising the one-line install hint where torch_xla is missing)
    return importlib.import_module("xtrainer._xla")


class XlaRuntime(Runtime):
    """torch_xla: the device is ``xla``, ops build a graph that runs at each ``sync()``."""

    type = "xla"
    lazy: ClassVar[bool] = True
    compiles_with_xla: ClassVar[bool] = True
    compiler = XLA_COMPILER

    def __init__(self) -> None:
        super().__init__()
        self._xla: Any = None

    @property
    def xla(self) -> Any:
        """``xtrainer._xla``, imported at the first use."""
        if self._xla is None:
            self._xla = _xla_module()
        return self._xla

    def start(self, local_rank: int) -> torch.device:
        del local_rank  # torch_xla knows its replica's device
        self._device = self.xla.device()
        return self._device

    def local_device_count(self) -> int:
        return self.xla.local_device_count_without_runtime() or 0

    @property
    def autocast_device_type(self) -> str:
        return "xla"

    def sync(self) -> None:
        self.xla.sync()

    def add_step_closure(self, fn: Callable[[], None]) -> None:
        self.xla.add_step_closure(fn)

    def to_cpu(self, data: Any) -> Any:
        return self.xla.to_cpu(data)

    def batches_on_device(self, loader: Iterable, start: int = 0, sharding: Any = None,
                          on_host: bool = False) -> Iterable:
        del on_host  # torch_xla's loader moves them; the hooks see them on the device, as in Lightning on TPUs
        return self.xla.DeviceBatches(loader, self.device, sharding, start=start)

    def rng_state(self) -> Any:
        """A seed that every random op advances."""
        return self.xla.rng_state()

    def set_rng_state(self, state: Any) -> None:
        self.xla.set_rng_state(state)

    def rng_state_kept(self) -> Any:
        return self.xla.rng_state_kept()

    def derived_rng_state(self, state: Any, offset: int) -> Any:
        """XLA's generator state is a seed: rank 0's plus the rank."""
        return state + offset

    def device_counters(self) -> dict[str, float]:
        """XLA's compilations, their seconds, executions and device-to-host transfers."""
        xla = self.xla
        return {"compiles": xla.compile_count(), "compile_s": xla.compile_seconds(),
                "executions": xla.execute_count(), "transfers": xla.transfer_from_device_count()}

    def compile_count(self) -> int:
        return self.xla.compile_count()

    def compile_seconds(self) -> float:
        return self.xla.compile_seconds()

    def memory_info(self) -> dict[str, int] | None:
        return self.xla.memory_info()

    def chip_name(self) -> str | None:
        return self.xla.chip_name()

    def process_group_backend(self) -> str:
        return "xla"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_xla": None}
