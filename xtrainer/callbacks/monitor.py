"""What ``ModelCheckpoint`` and ``EarlyStopping`` share: a logged metric and a direction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

MODES = ("min", "max")


@dataclass(frozen=True)
class Monitor:
    """A logged metric (``name``) where lower (``mode="min"``) or higher (``"max"``) is better."""

    name: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: use 'min' or 'max'.")

    @property
    def worst(self) -> float:
        return math.inf if self.mode == "min" else -math.inf

    def read(self, metrics: Mapping[str, float], owner: str) -> float:
        """The monitored value, or an error naming what was logged instead."""
        if self.name not in metrics:
            raise KeyError(f"{owner}(monitor={self.name!r}) found no such logged metric. Logged: "
                           f"{sorted(metrics)}. Log it with self.log({self.name!r}, ...).")
        return metrics[self.name]

    def better(self, score: float, than: float, min_delta: float = 0.0) -> bool:
        """Whether ``score`` improves on ``than`` by more than ``min_delta``. NaN never does."""
        if math.isnan(score):
            return False
        if math.isnan(than):
            return True
        return score < than - min_delta if self.mode == "min" else score > than + min_delta

    def sort_key(self, score: float) -> tuple[bool, float]:
        """Best first, NaN last."""
        return (math.isnan(score), score if self.mode == "min" else -score)
