"""``XlaRuntime``: torch_xla's lazy tensors, on any PJRT device (TPU, a PJRT plugin, the CPU runtime).

Every call goes to ``xtrainer._xla``, the one module that imports torch_xla, which this runtime
imports when it is built (so that ``import xtrainer`` works without torch_xla): a device call is
the runtime's method and ``_xla``'s function.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, ClassVar, Iterable

import torch

from xtrainer.runtimes.base import CompilerNames, Runtime

XLA_COMPILER = CompilerNames("xla", "XLA", "run with PT_XLA_DEBUG_LEVEL=2 to see torch_xla's reasons")


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
