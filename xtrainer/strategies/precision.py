"""Numeric precision of a run: ``"32"`` (float32), ``"bf16"`` (bfloat16 parameters and inputs) or
``"bf16-mixed"`` (float32 parameters, bfloat16 compute under autocast)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

_DTYPES = {"32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.float32}
_ALIASES = {"32": "32", 32: "32", "32-true": "32", "fp32": "32",
            "bf16": "bf16", "bf16-true": "bf16", "bfloat16": "bf16",
            "bf16-mixed": "bf16-mixed", "16-mixed": "bf16-mixed", 16: "bf16-mixed", "16": "bf16-mixed"}
_LIGHTNING_NAMES = {"32": "32-true", "bf16": "bf16-true", "bf16-mixed": "bf16-mixed"}


class Precision(str):
    """How parameters and floating-point inputs are represented on the device; the string is
    Lightning's name for it (``trainer.precision == "bf16-mixed"``), ``name`` is the short one.

    ``"bf16"`` keeps parameters, gradients, optimizer state and floating-point inputs in
    bfloat16: what the deprecated ``XLA_USE_BF16=1`` did, done explicitly on the module and the
    batch instead of through a process-wide environment variable.

    ``"bf16-mixed"`` keeps parameters and optimizer state in float32 and runs each step under
    ``torch.autocast("xla", dtype=torch.bfloat16)``. Lightning's ``"16-mixed"`` (float16 with a
    gradient scaler, made for GPUs) becomes ``"bf16-mixed"`` here, with a warning: XLA devices
    compute in bfloat16, which needs no loss scaling.
    """

    name: str
    dtype: torch.dtype
    device_type: str

    def __new__(cls, value: Any = "32") -> "Precision":
        if value not in _ALIASES:
            raise ValueError(f"precision={value!r} is not supported; use one of "
                             f"{sorted({str(v) for v in _ALIASES})}.")
        name = _ALIASES[value]
        if name == "bf16-mixed" and "bf16" not in str(value):
            rank_zero_warn(f"precision={value!r}: XLA devices compute in bfloat16, not float16; running "
                           "precision='bf16-mixed' (no gradient scaler is needed).")
        self = super().__new__(cls, _LIGHTNING_NAMES[name])
        self.name = name
        self.dtype = _DTYPES[name]
        #: The device kind autocast acts on (a native strategy sets its own: "cpu", "cuda"...).
        self.device_type = "xla"
        return self

    def step_context(self) -> contextlib.AbstractContextManager:
        """What each step runs under: autocast for ``"bf16-mixed"``."""
        if self.name == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module if self.dtype == torch.float32 else module.to(self.dtype)

    def convert_input(self, data: Any) -> Any:
        if self.dtype == torch.float32:
            return data
        return apply_to_collection(data, torch.Tensor,
                                   lambda t: t.to(self.dtype) if t.is_floating_point() else t)

