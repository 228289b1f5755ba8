"""Strategies: how xtrainer launches replicas, wraps the module and steps the optimizer."""

from __future__ import annotations

import importlib.util
from typing import Any

from xtrainer.strategies.base import Strategy
from xtrainer.strategies.ddp import XlaDDP
from xtrainer.strategies.fsdp import XlaFSDP
from xtrainer.strategies.native import XlaNative
from xtrainer.strategies.spmd import XlaFSDPv2, XlaSPMD
from xtrainer.strategies.torch_native import NativeDDP, NativeFSDP, NativeSingle
from xtrainer.suggest import did_you_mean

#: Every name ``Trainer(strategy=...)`` accepts, mapped to its class.
STRATEGIES: dict[str, type[Strategy]] = {
    XlaNative.name: XlaNative,
    XlaDDP.name: XlaDDP,
    XlaFSDP.name: XlaFSDP,
    XlaSPMD.name: XlaSPMD,
    XlaFSDPv2.name: XlaFSDPv2,
    NativeSingle.name: NativeSingle,
    NativeDDP.name: NativeDDP,
    NativeFSDP.name: NativeFSDP,
}


#: Lightning's strategy names, for what they mean on an XLA device (docs/lightning.md, "Coming from Lightning").
LIGHTNING_NAMES: dict[str, str] = {
    "auto": XlaNative.name,  # Lightning's choice on TPUs: its XLAStrategy, native data parallel
    "xla": XlaNative.name,
    "single_xla": XlaNative.name,
    "ddp": XlaDDP.name,
    "ddp_spawn": XlaDDP.name,
    "fsdp": XlaFSDP.name,
}


#: Lightning's names of DDP with an option (what its users name to fix DDP's "unused parameters" error).
_LIGHTNING_DDP_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_find_unused_parameters_true": (XlaDDP.name, {"find_unused_parameters": True}),
    "ddp_find_unused_parameters_false": (XlaDDP.name, {"find_unused_parameters": False}),
    "ddp_spawn_find_unused_parameters_true": (XlaDDP.name, {"find_unused_parameters": True}),
    "ddp_spawn_find_unused_parameters_false": (XlaDDP.name, {"find_unused_parameters": False}),
}


def resolve_strategy(strategy: "str | Strategy") -> Strategy:
    """A ``Strategy`` instance for a name from ``STRATEGIES`` (or Lightning's name of one), or the
    instance given."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy == "auto" and importlib.util.find_spec("torch_xla") is None:
        strategy = NativeDDP.name  # no torch_xla: standard PyTorch (one device, or DDP with devices=N)
    if isinstance(strategy, str):
        strategy = LIGHTNING_NAMES.get(strategy, strategy)
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return STRATEGIES[strategy]()
    if isinstance(strategy, str) and strategy in _LIGHTNING_DDP_OPTIONS:  # Lightning's DDP with options in its name
        name, kwargs = _LIGHTNING_DDP_OPTIONS[strategy]
        return STRATEGIES[name](**kwargs)
    hint = did_you_mean(strategy, STRATEGIES) if isinstance(strategy, str) else ""
    raise ValueError(f"Unknown strategy {strategy!r}.{hint} Valid names: {', '.join(sorted(STRATEGIES))} "
                     f"(Lightning's {', '.join(sorted([*LIGHTNING_NAMES, *_LIGHTNING_DDP_OPTIONS]))} map to them); or "
                     "pass a Strategy instance.")


__all__ = ["LIGHTNING_NAMES", "STRATEGIES", "NativeDDP", "NativeFSDP", "NativeSingle", "Strategy", "XlaDDP", "XlaFSDP", "XlaFSDPv2", "XlaNative", "XlaSPMD", "resolve_strategy"]
