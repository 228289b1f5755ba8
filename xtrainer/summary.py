"""``summarize``: Lightning's model summary table, as text.

::

      | Name | Type       | Params | Mode
    -------------------------------------------
    0 | net  | Sequential | 161    | train
    -------------------------------------------
    161       Trainable params
    0         Non-trainable params
    161       Total params
    0.001     Total estimated model params size (MB)
    3         Modules in train mode
    0         Modules in eval mode
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["summarize", "human_readable_count"]

_UNITS = ["", "K", "M", "B", "T"]


def human_readable_count(number: int) -> str:
    """``161``, ``1.2 K``, ``87.5 M``, ``340 B`` (Lightning's format)."""
    if number < 0:
        raise ValueError(f"a parameter count cannot be negative: {number}")
    digits = len(str(int(number)))
    groups = min(math.ceil(digits / 3), len(_UNITS))
    index = groups - 1
    scaled = number / 10 ** (3 * index)
    if index == 0:
        return f"{int(number):,d}"
    if scaled >= 100:
        return f"{int(scaled):,d} {_UNITS[index]}"
    return f"{scaled:,.1f} {_UNITS[index]}"


def _own_parameters(module: nn.Module):
    """``module``'s own parameters (not its children's), as (tensor, numel, bytes per element,
    per-replica shard or None). torch_xla's FSDP removes the parameters it shards from their
    modules and keeps each as a plain attribute pointing to its shard (``_sharded_param``, whose
    ``_orig_size`` is the full shape): those are counted whole as well."""
    for p in module._parameters.values():
        if p is not None and not getattr(p, "_is_sharded", False):  # an FSDP shard: counted below, whole
            yield p, _numel(p), p.element_size(), None
    for value in vars(module).values():
        shard = getattr(value, "_sharded_param", None)
        if shard is not None and hasattr(shard, "_orig_size"):
            yield value, shard._orig_size.numel(), shard.element_size(), shard


def _numel(p: nn.Parameter) -> int:
    if isinstance(p, nn.parameter.UninitializedParameter):  # a lazy module not run yet
        return 0
    return p.numel()


def _parameters(module: nn.Module):
    """Every parameter under ``module`` once (shared ones too), FSDP-sharded ones counted whole."""
    seen: set[int] = set()
    for m in module.modules():
        for entry in _own_parameters(m):
            if id(entry[0]) not in seen:
                seen.add(id(entry[0]))
                yield entry


def summarize(module: nn.Module, max_depth: int = 1, world_size: int = 1, sharded: bool = False) -> str:
    """Lightning's model summary of ``module``, as text (the Trainer prints it on rank 0 when a
    fit starts, with ``enable_model_summary``).

    Args:
        module: the user's module, *unwrapped* (not the DDP/FSDP wrapper). Counts are of whole
            parameters: before FSDP wraps the module, or after (the shards' full shapes are read).
        max_depth: the depth of submodules listed: 1 (default) the module's children, 2 their
            children as well, ``-1`` every submodule, ``0`` none (the totals only).
        world_size: the number of replicas the parameters are spread over (with ``sharded``).
        sharded: the parameters are sharded across the ``world_size`` replicas (FSDP, ZeRO-3):
            adds a line with the estimated size each replica holds (each parameter split in
            ``world_size`` equal parts; FSDP's padding adds a little). Replicated strategies
            (DDP) hold everything on every replica: leave it False.

    The sizes are estimated from each parameter's dtype (the module as it is: before the
    Trainer converts it to bf16, 4 bytes per float32 parameter).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"summarize() takes an nn.Module, got {type(module).__name__}.")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ValueError(f"max_depth must be an int >= -1 (-1: every layer, 0: none), got {max_depth!r}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")

    rows = []
    for name, sub in module.named_modules():
        if not name:
            continue
        depth = name.count(".") + 1
        if max_depth != -1 and depth > max_depth:
            continue
        count = sum(n for _, n, _, _ in _parameters(sub))
        rows.append((name, type(sub).__name__, human_readable_count(count), "train" if sub.training else "eval"))

    total = trainable = size = per_replica = 0
    for p, n, element, shard in _parameters(module):
        total += n
        trainable += n if (shard if shard is not None else p).requires_grad else 0
        size += n * element
        per_replica += (shard.numel() if shard is not None else math.ceil(n / world_size)) * element
    modes = [m.training for m in module.modules()][1:]  # not the module itself, as Lightning counts

    columns = [(" ", [str(i) for i in range(len(rows))])] + [
        (header, [row[i] for row in rows]) for i, header in enumerate(["Name", "Type", "Params", "Mode"])]
    widths = [max([len(header)] + [len(v) for v in values]) for header, values in columns]
    rule = "-" * (sum(widths) + 3 * len(columns))
    lines = [" | ".join(header.ljust(w) for (header, _), w in zip(columns, widths)).rstrip(), rule]
    for i in range(len(rows)):
        lines.append(" | ".join(values[i].ljust(w) for (_, values), w in zip(columns, widths)).rstrip())
    if rows:
        lines.append(rule)
    else:
        lines = []
    totals = [
        (human_readable_count(trainable), "Trainable params"),
        (human_readable_count(total - trainable), "Non-trainable params"),
        (human_readable_count(total), "Total params"),
        (f"{size / 1e6:,.3f}", "Total estimated model params size (MB)"),
    ]
    if sharded:
        totals.append((f"{per_replica / 1e6:,.3f}",
                       f"Estimated params size per replica (MB), sharded over {world_size} "
                       f"replica{'s' if world_size != 1 else ''}"))
    totals += [(str(modes.count(True)), "Modules in train mode"), (str(modes.count(False)), "Modules in eval mode")]
    lines += [f"{value:<10}{label}" for value, label in totals]
    return "\n".join(lines)
