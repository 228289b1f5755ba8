"""Strategies: how xtrainer launches replicas, wraps the module and steps the optimizer."""

from __future__ import annotations

import os
from typing import Any

from xtrainer import runtimes
from xtrainer.strategies.base import Strategy
from xtrainer.strategies.xla_ddp import XlaDDP
from xtrainer.strategies.xla_fsdp import XlaFSDP
from xtrainer.strategies.xla_native import XlaNative
from xtrainer.strategies.parallel import ParallelStrategy
from xtrainer.strategies.xla_spmd import XlaFSDPv2, XlaSPMD
from xtrainer.strategies.native import NativeSingle
from xtrainer.strategies.native_ddp import NativeDDP
from xtrainer.strategies.native_fsdp import NativeFSDP
from xtrainer.strategies.model_parallel import ModelParallelStrategy
from xtrainer.strategies.native_ft import NativeFaultTolerant
from xtrainer.strategies.process_group import under_torchrun
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
    ModelParallelStrategy.name: ModelParallelStrategy,
    NativeFaultTolerant.name: NativeFaultTolerant,
}


#: Lightning's strategy names that name one family's strategy whatever the accelerator.
LIGHTNING_NAMES: dict[str, str] = {
    "xla": XlaNative.name,
    "single_xla": XlaNative.name,
    "single_device": NativeSingle.name,
}

#: Lightning's names that mean a kind of strategy, and the strategy of each family that does it
#: (the family follows the accelerator: ``runtimes.select_family``).
_BY_FAMILY: dict[str, dict[str, str]] = {
    "ddp": {runtimes.XLA: XlaDDP.name, runtimes.NATIVE: NativeDDP.name},
    "ddp_spawn": {runtimes.XLA: XlaDDP.name, runtimes.NATIVE: NativeDDP.name},
    "fsdp": {runtimes.XLA: XlaFSDP.name, runtimes.NATIVE: NativeFSDP.name},
}

#: Lightning's names of DDP with an option (what its users name to fix DDP's "unused parameters" error).
_LIGHTNING_DDP_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{kind}_find_unused_parameters_{value}": (kind, {"find_unused_parameters": value == "true"})
    for kind in ("ddp", "ddp_spawn") for value in ("true", "false")
}


def lightning_name(name: str, accelerator: str = "auto", devices: Any = "auto") -> str:
    """The strategy a name of Lightning's means for ``accelerator`` and ``devices`` (a name of
    ours as it is). ``"auto"``: the accelerator's family, one device or its data parallel."""
    if name in LIGHTNING_NAMES:
        return LIGHTNING_NAMES[name]
    if name in _BY_FAMILY:
        return _BY_FAMILY[name][runtimes.select_family(accelerator)]
    if name == "auto":
        if runtimes.select_family(accelerator) == runtimes.XLA:
            return XlaNative.name  # one device, or native data parallel over devices=N (Lightning's XLAStrategy)
        several = devices == "auto" and runtimes.EagerRuntime.for_accelerator(accelerator).local_device_count() > 1
        several = several or (isinstance(devices, int) and not isinstance(devices, bool) and devices > 1)
        several = several or (under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1)  # one of torchrun's group
        return NativeDDP.name if several else NativeSingle.name
    return name


def resolve_strategy(strategy: "str | Strategy", accelerator: str = "auto", devices: Any = "auto") -> Strategy:
    """A ``Strategy`` instance for a name from ``STRATEGIES`` (or Lightning's name of one, which
    may depend on ``accelerator`` and ``devices``), or the instance given."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy in _LIGHTNING_DDP_OPTIONS:  # Lightning's DDP with options in its name
        kind, kwargs = _LIGHTNING_DDP_OPTIONS[strategy]
        return STRATEGIES[lightning_name(kind, accelerator, devices)](**kwargs)
    if isinstance(strategy, str):
        strategy = lightning_name(strategy, accelerator, devices)
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return STRATEGIES[strategy]()
    hint = did_you_mean(strategy, STRATEGIES) if isinstance(strategy, str) else ""
    lightning = sorted(["auto", *LIGHTNING_NAMES, *_BY_FAMILY, *_LIGHTNING_DDP_OPTIONS])
    raise ValueError(f"Unknown strategy {strategy!r}.{hint} Valid names: {', '.join(sorted(STRATEGIES))} "
                     f"(Lightning's {', '.join(lightning)} map to them); or pass a Strategy instance.")


def known_name(name: Any) -> bool:
    """Whether ``name`` names a strategy (ours, or Lightning's name of one)."""
    return isinstance(name, str) and (name in STRATEGIES or name in LIGHTNING_NAMES or name in _BY_FAMILY
                                      or name == "auto" or name in _LIGHTNING_DDP_OPTIONS)


__all__ = ["LIGHTNING_NAMES", "known_name", "lightning_name", "ModelParallelStrategy", "STRATEGIES", "NativeDDP", "NativeFSDP", "NativeSingle", "ParallelStrategy", "Strategy", "XlaDDP", "XlaFSDP", "XlaFSDPv2", "XlaNative", "XlaSPMD", "resolve_strategy"]
