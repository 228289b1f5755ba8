"""Runtimes: the device a replica computes on (``runtimes/base.py`` has the contract).

``select_family`` is Lightning's ``accelerator="auto"``: a native accelerator when PyTorch has one
(CUDA, TorchTPU, TorchNeuron, any registered backend); torch_xla where it is installed and PJRT
has a real XLA accelerator (a TPU); else the CPU, eagerly. torch_xla's CPU runtime is an explicit
choice: ``accelerator="xla"`` or an ``xla_*`` strategy.
"""

from __future__ import annotations

import importlib.util
import os

from xtrainer.runtimes.base import CompilerNames, Runtime
from xtrainer.runtimes.eager import ACCELERATORS, EagerRuntime, native_accelerator
from xtrainer.runtimes.xla import XlaRuntime

#: The two families of strategies a runtime belongs to.
XLA, NATIVE = "xla", "native"


def xla_accelerator_present() -> bool:
    """Whether torch_xla is installed and PJRT has a real XLA accelerator here: ``PJRT_DEVICE``
    names one other than the CPU, or, unset, torch_xla finds TPU chips on the PCI bus (its own
    scan; the runtime is not started)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False
    requested = os.environ.get("PJRT_DEVICE")
    if requested:
        return requested.upper() != "CPU"
    from xtrainer._lazy_xla import xla

    return xla.requested_device_type() != "CPU"


def select_family(accelerator: str) -> str:
    """Which family of strategies ``accelerator`` runs: ``XLA`` or ``NATIVE``."""
    accelerator = str(accelerator).lower()
    if accelerator == "xla":
        return XLA
    if accelerator == "tpu":  # TorchTPU where it is installed, else torch_xla's TPU
        native = native_accelerator() == "tpu" or importlib.util.find_spec("torch_tpu") is not None
        return NATIVE if native or importlib.util.find_spec("torch_xla") is None else XLA
    if accelerator == "auto":
        if native_accelerator() is not None:
            return NATIVE
        return XLA if xla_accelerator_present() else NATIVE
    return NATIVE


__all__ = ["ACCELERATORS", "NATIVE", "XLA", "CompilerNames", "EagerRuntime", "Runtime", "XlaRuntime",
           "native_accelerator", "select_family", "xla_accelerator_present"]
