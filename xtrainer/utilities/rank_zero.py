"""``lightning.pytorch.utilities.rank_zero``'s names, where a Lightning project imports them from:
lightning-utilities' own helpers, which the Trainer points at each replica's rank."""

from lightning_utilities.core.rank_zero import (rank_zero_debug, rank_zero_deprecation, rank_zero_info,
                                                rank_zero_only, rank_zero_warn)

__all__ = ["rank_zero_debug", "rank_zero_deprecation", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]
