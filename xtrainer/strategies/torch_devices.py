"""Everything the native strategies (``strategies/torch_native.py``) need to know about a device
kind of standard PyTorch: which ``accelerator`` names it, its ``torch.device`` per process, its
process-group backend, its random generator and its memory figures.

Kinds: ``cpu`` (process group ``gloo``; tested), ``cuda`` (``nccl``; ``accelerator="gpu"`` too),
and the native backends that replace torch_xla: TorchTPU (``torch_tpu``, device ``tpu``) and
TorchNeuron (device ``neuron``). Those register themselves as PyTorch devices and name their own
process-group backend in ``torch.distributed.Backend.default_device_backend_map``, which is
where the backend is looked up. Only ``cpu`` runs here: ``cuda``, ``tpu`` and ``neuron`` are
written to PyTorch's device-generic interfaces and their documentation, and are untested.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

#: ``Trainer(accelerator=...)`` names -> torch device kind.
ACCELERATORS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "tpu": "tpu", "neuron": "neuron"}

#: The module a backend kind needs imported before torch knows its device (untested here).
_BACKEND_MODULES = {"tpu": "torch_tpu", "neuron": "torch_neuronx"}

#: Process-group backends of the kinds whose backend torch may not list.
_KNOWN_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def kind_of(accelerator: str) -> str:
    """The device kind ``accelerator`` asks for; ``"auto"``: PyTorch's current accelerator (CUDA,
    or a native backend that registered itself), else the CPU."""
    accelerator = accelerator.lower()
    if accelerator == "auto":
        accelerators = getattr(torch, "accelerator", None)
        if accelerators is None or not accelerators.is_available():
            return "cpu"
        current = accelerators.current_accelerator()
        return current.type if current is not None else "cpu"
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r}: the native strategies run on "
                         f"{', '.join(repr(a) for a in ['auto', *ACCELERATORS])}.")
    kind = ACCELERATORS[accelerator]
    _import_backend(kind)
    if kind != "cpu" and not available(kind):
        raise RuntimeError(f"accelerator={accelerator!r}, but PyTorch sees no {kind} device here; install its "
                           f"PyTorch backend or use accelerator='cpu'.")
    return kind


def _import_backend(kind: str) -> None:
    module = _BACKEND_MODULES.get(kind)
    if module is None:
        return
    try:
        importlib.import_module(module)  # registers the device with PyTorch (untested here)
    except ImportError as err:
        raise RuntimeError(f"accelerator={kind!r} needs the {module} package (PyTorch's native {kind} backend); "
                           f"install it, or use accelerator='cpu'.") from err


def available(kind: str) -> bool:
    if kind == "cpu":
        return True
    module = getattr(torch, kind, None)
    return bool(module is not None and hasattr(module, "is_available") and module.is_available())


def local_count(kind: str) -> int:
    """How many devices of ``kind`` this host has (``devices="auto"``); 1 for the CPU."""
    if kind == "cpu":
        return 1
    return int(torch.get_device_module(kind).device_count())


def device(kind: str, local_rank: int) -> torch.device:
    """This process's device: the CPU, or device ``local_rank`` of its kind (made current)."""
    if kind == "cpu":
        return torch.device("cpu")
    dev = torch.device(kind, local_rank)
    torch.get_device_module(kind).set_device(dev)
    return dev


def backend(kind: str) -> str:
    """The process-group backend of ``kind``: gloo, nccl, or the one the device registered."""
    registered = getattr(torch.distributed.Backend, "default_device_backend_map", {}).get(kind)
    found = registered or _KNOWN_BACKENDS.get(kind)
    if found is None:
        raise RuntimeError(f"No process-group backend is registered for the {kind!r} device: import its PyTorch "
                           "backend package before the Trainer starts.")
    return found


def rng_state(dev: torch.device) -> torch.Tensor:
    """The state of ``dev``'s random generator (torch's CPU generator for the CPU)."""
    if dev.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(dev.type).get_rng_state(dev)


def set_rng_state(dev: torch.device, state: Any) -> None:
    """Seed ``dev``'s generator with an int, or set it to a state from ``rng_state``."""
    if isinstance(state, int):
        if dev.type == "cpu":
            torch.manual_seed(state)
        else:
            torch.get_device_module(dev.type).manual_seed(state)
        return
    if dev.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(dev.type).set_rng_state(state, dev)


def memory_info(dev: torch.device) -> dict[str, int] | None:
    """Bytes in use and the device's capacity, asked of the allocator (no device sync); None
    for the CPU."""
    if dev.type != "cuda":
        return None  # the native backends' allocator figures are not wired up (untested here)
    return {"bytes_used": int(torch.cuda.memory_allocated(dev)),
            "bytes_limit": int(torch.cuda.get_device_properties(dev).total_memory)}
