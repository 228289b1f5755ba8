"""Numeric precision of a run: ``"32"`` (float32) or ``"bf16"`` (bfloat16 parameters and inputs)."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

_DTYPES = {"32": torch.float32, "bf16": torch.bfloat16}
_ALIASES = {"32": "32", 32: "32", "32-true": "32", "fp32": "32",
            "bf16": "bf16", "bf16-true": "bf16", "bfloat16": "bf16"}


class Precision:
    """How parameters and floating-point inputs are represented on the device.

    ``"bf16"`` keeps parameters, gradients, optimizer state and floating-point inputs in
    bfloat16: what the deprecated ``XLA_USE_BF16=1`` did, done explicitly on the module and the
    batch instead of through a process-wide environment variable.
    """

    def __init__(self, value: Any = "32") -> None:
        if value not in _ALIASES:
            raise ValueError(f"precision={value!r} is not supported; use one of {sorted(set(_ALIASES.values()))}.")
        self.name = _ALIASES[value]
        self.dtype = _DTYPES[self.name]

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module if self.dtype == torch.float32 else module.to(self.dtype)

    def convert_input(self, data: Any) -> Any:
        if self.dtype == torch.float32:
            return data
        return apply_to_collection(data, torch.Tensor,
                                   lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"
