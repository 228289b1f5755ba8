"""Lightning's ``lightning.pytorch.utilities.model_summary``: ``ModelSummary(model, max_depth=1)``,
whose ``str()`` is the summary table, ``summarize`` (which returns one) and
``get_human_readable_count``."""

from __future__ import annotations

from torch import nn

from xtrainer.summary import ModelSummary
from xtrainer.summary import human_readable_count as get_human_readable_count

__all__ = ["ModelSummary", "get_human_readable_count", "summarize"]


def summarize(lightning_module: nn.Module, max_depth: int = 1) -> ModelSummary:
    """The ``ModelSummary`` of ``lightning_module`` to ``max_depth`` levels of submodules."""
    return ModelSummary(lightning_module, max_depth=max_depth)
