"""'Did you mean ...?' for names given wrong (config keys, arguments, hooks, strategies)."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the option closest to ``name`` (a typo, or its start), or ``""``."""
    options = list(options)
    starts = [option for option in options if option.startswith(name) and len(name) >= 3]
    close = starts[:1] or difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
