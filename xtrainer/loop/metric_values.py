"""``trainer.callback_metrics`` and ``trainer.logged_metrics`` as Lightning gives them: values
that are 0-dim CPU tensors (``.item()`` works, so do ``float()``, comparisons and f-string
formats), whatever the writer puts in (the values read from the device arrive as floats)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def as_tensor(value: Any) -> Any:
    """A number as a 0-dim CPU tensor (float32, as Lightning logs numbers; a tensor keeps its
    dtype); anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value  # host sync for a device tensor
    if isinstance(value, (bool, int, float)):
        return torch.scalar_tensor(float(value), dtype=torch.float32)  # torch.tensor's value, in half the time
    return value


class MetricValues(dict):
    """A dict whose values are stored as ``as_tensor`` makes them."""

    def __init__(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), **kwargs: Any) -> None:
        super().__init__()
        self.update(values, **kwargs)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, as_tensor(value))

    def update(self, values: Any = (), /, **kwargs: Any) -> None:  # type: ignore[override]
        items = values.items() if isinstance(values, Mapping) else values
        for key, value in items:
            self[key] = value
        for key, value in kwargs.items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __reduce__(self) -> Any:
        return (MetricValues, (dict(self),))

    def floats(self) -> dict[str, Any]:
        """The values as Python floats (non-numbers as they are)."""
        # CPU tensors (as_tensor stored them so): no device sync
        return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in self.items()}
