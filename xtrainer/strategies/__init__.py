"""Strategies: how xtrainer launches replicas, wraps the module and steps the optimizer."""

from __future__ import annotations

from xtrainer.strategies.base import Strategy
from xtrainer.strategies.ddp import XlaDDP
from xtrainer.strategies.fsdp import XlaFSDP
from xtrainer.strategies.native import XlaNative
from xtrainer.strategies.spmd import XlaFSDPv2, XlaSPMD
from xtrainer.suggest import did_you_mean

#: Every name ``Trainer(strategy=...)`` accepts, mapped to its class.
STRATEGIES: dict[str, type[Strategy]] = {
    XlaNative.name: XlaNative,
    XlaDDP.name: XlaDDP,
    XlaFSDP.name: XlaFSDP,
    XlaSPMD.name: XlaSPMD,
    XlaFSDPv2.name: XlaFSDPv2,
}


def resolve_strategy(strategy: "str | Strategy") -> Strategy:
    """A ``Strategy`` instance for a name from ``STRATEGIES``, or the instance given."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return STRATEGIES[strategy]()
    hint = did_you_mean(strategy, STRATEGIES) if isinstance(strategy, str) else ""
    raise ValueError(f"Unknown strategy {strategy!r}.{hint} Valid names: {', '.join(sorted(STRATEGIES))}; "
                     "or pass a Strategy instance.")


__all__ = ["STRATEGIES", "Strategy", "XlaDDP", "XlaFSDP", "XlaFSDPv2", "XlaNative", "XlaSPMD", "resolve_strategy"]
