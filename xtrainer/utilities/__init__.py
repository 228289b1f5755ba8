"""Lightning's ``lightning.pytorch.utilities`` names a project imports, so that it ports by
changing the import: the rank-zero helpers (lightning-utilities' own, which the Trainer sets for
every replica), ``grad_norm``, ``AttributeDict``, ``move_data_to_device`` and ``CombinedLoader``.
``types`` holds the type aliases; ``rank_zero``, ``exceptions`` (``MisconfigurationException``),
``combined_loader`` and ``grads`` are Lightning's submodules of those names, for imports that name
them. A name with no counterpart here raises an ImportError that says what to use."""

from __future__ import annotations

from typing import Any

from xtrainer.module import AttributeDict, move_data_to_device
from xtrainer.utilities.combined_loader import CombinedLoader
from xtrainer.utilities.grads import grad_norm
from xtrainer.utilities.rank_zero import (rank_zero_debug, rank_zero_deprecation, rank_zero_info, rank_zero_only,
                                          rank_zero_warn)

__all__ = ["AttributeDict", "CombinedLoader", "grad_norm", "move_data_to_device", "rank_zero_debug",
           "rank_zero_deprecation", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]

#: Lightning's utilities with no counterpart here, and what to do instead.
MISSING = {
    "measure_flops": "the Trainer counts a step's FLOPs itself (xtrainer.flops, printed after fit)",
    "find_shared_parameters": "compare parameters by identity (`p is q`) in your module",
    "set_shared_parameters": "tie the parameters in your module's __init__ (`self.b.weight = self.a.weight`)",
    "is_shared_filesystem": "checkpoints and run folders are written by rank 0 (or per rank, by the strategy)",
    "suggested_max_num_workers": "use os.cpu_count() divided by the processes per host",
    "disable_possible_user_warnings": "use warnings.filterwarnings",
}


def __getattr__(name: str) -> Any:
    if name in MISSING:
        raise ImportError(f"xtrainer.utilities has no {name} (a Lightning utility with no counterpart here): "
                          f"{MISSING[name]}.")
    raise AttributeError(f"module 'xtrainer.utilities' has no attribute {name!r}")
