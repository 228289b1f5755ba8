"""``summarize``: Lightning's model summary table, as text; ``ModelSummary``, Lightning's class of
it (``str()`` is the table, with In sizes and Out sizes from the module's ``example_input_array``).

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
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSummary", "summarize", "human_readable_count"]

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


def _numel(p: nn.Parameter) -> int:
    if isinstance(p, nn.parameter.UninitializedParameter):  # a lazy module not run yet
        return 0
    return p.numel()


def _parameters(module: nn.Module, sharded: bool = False):
    """Every parameter under ``module`` once (shared ones too), from ``named_parameters()`` as
    Lightning counts them, as (tensor, numel, bytes per element, per-replica shard or None).

    ``sharded`` (the strategy shards parameters, ``Strategy.shards_parameters``): torch_xla's FSDP
    removes the parameters it shards from their modules and keeps each as a plain tensor attribute
    pointing to its shard (``_sharded_param``, whose ``_orig_size`` is the full shape); those are
    counted whole, in place of the flat shards FSDP registers."""
    seen: set[int] = set()
    for _, p in module.named_parameters():
        if sharded and getattr(p, "_is_sharded", False) is True:  # an FSDP shard: counted below, whole
            continue
        seen.add(id(p))
        yield p, _numel(p), p.element_size(), None
    if not sharded:
        return
    for m in module.modules():
        for value in vars(m).values():
            if not isinstance(value, torch.Tensor) or id(value) in seen:
                continue
            shard = getattr(value, "_sharded_param", None)
            if isinstance(shard, torch.Tensor) and isinstance(getattr(shard, "_orig_size", None), torch.Size):
                seen.add(id(value))
                yield value, shard._orig_size.numel(), shard.element_size(), shard


def _layers(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    """The submodules a summary lists, by name: to ``max_depth`` levels (-1: all)."""
    return [(name, sub) for name, sub in module.named_modules()
            if name and (max_depth == -1 or name.count(".") < max_depth)]


def _check_depth(max_depth: Any) -> None:
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ValueError(f"max_depth must be an int >= -1 (-1: every layer, 0: none), got {max_depth!r}.")


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
    _check_depth(max_depth)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
    return _table(module, max_depth, world_size, sharded)


def _table(module: nn.Module, max_depth: int, world_size: int = 1, sharded: bool = False,
           sizes: tuple[list[str], list[str]] | None = None) -> str:
    """The summary's text; ``sizes``: the In sizes and Out sizes columns, one entry per layer."""
    rows = []
    for name, sub in _layers(module, max_depth):
        count = sum(n for _, n, _, _ in _parameters(sub, sharded))
        rows.append((name, type(sub).__name__, human_readable_count(count), "train" if sub.training else "eval"))

    total = trainable = size = per_replica = 0
    for p, n, element, shard in _parameters(module, sharded):
        total += n
        trainable += n if (shard if shard is not None else p).requires_grad else 0
        size += n * element
        per_replica += (shard.numel() if shard is not None else math.ceil(n / world_size)) * element
    modes = [m.training for m in module.modules()][1:]  # not the module itself, as Lightning counts

    columns = [(" ", [str(i) for i in range(len(rows))])] + [
        (header, [row[i] for row in rows]) for i, header in enumerate(["Name", "Type", "Params", "Mode"])]
    if sizes is not None:
        columns += [("In sizes", sizes[0]), ("Out sizes", sizes[1])]
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


def _shape(value: Any) -> Any:
    """A forward's input or output as Lightning's summary shows it: a tensor's shape as a list,
    sequences of them nested, ``"?"`` for anything else."""
    if hasattr(value, "shape"):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(item) for item in value]
    return "?"


class ModelSummary:
    """Lightning's ``ModelSummary(model, max_depth=1)`` (``lightning.pytorch.utilities.model_summary``):
    ``str()`` is the summary table. Where the module has an ``example_input_array``, the module runs
    it once (in eval mode, without gradients, its modes restored after) and the table adds each
    layer's In sizes and Out sizes (``"?"``: a layer the forward did not run).

    Args:
        model: the module to summarize (an ``XModule``, or any ``nn.Module``).
        max_depth: the depth of submodules listed: 1 (default) the module's children, ``-1`` every
            submodule, ``0`` none (the totals only).
    """

    def __init__(self, model: nn.Module, max_depth: int = 1) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelSummary() takes an nn.Module, got {type(model).__name__}.")
        _check_depth(max_depth)
        self._model, self._max_depth = model, max_depth
        self._layers = _layers(model, max_depth)
        self._sizes: dict[str, tuple[Any, Any]] = {}
        if getattr(model, "example_input_array", None) is not None:
            self._forward_example_input()

    def _forward_example_input(self) -> None:
        from xtrainer.module import move_data_to_device

        hooks = []
        for name, layer in self._layers:
            def record(_, args, kwargs, out, name=name):
                if name not in self._sizes:  # the first call of a layer run several times
                    inputs = (*args, *kwargs.values())
                    self._sizes[name] = (_shape(inputs[0] if len(inputs) == 1 else inputs), _shape(out))
            if not isinstance(layer, torch.jit.ScriptModule):
                hooks.append(layer.register_forward_hook(record, with_kwargs=True))
        model = self._model
        example = model.example_input_array
        device = next((p.device for p in model.parameters()), None)
        if device is not None:
            example = move_data_to_device(example, device)
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.no_grad():
                if isinstance(example, (list, tuple)):
                    model(*example)
                elif isinstance(example, dict):
                    model(**example)
                else:
                    model(example)
        finally:
            for handle in hooks:
                handle.remove()
            for m, training in modes.items():
                m.training = training

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self._layers]

    @property
    def layer_types(self) -> list[str]:
        return [type(layer).__name__ for _, layer in self._layers]

    @property
    def in_sizes(self) -> list[Any]:
        return [self._sizes.get(name, ("?", "?"))[0] for name, _ in self._layers]

    @property
    def out_sizes(self) -> list[Any]:
        return [self._sizes.get(name, ("?", "?"))[1] for name, _ in self._layers]

    @property
    def param_nums(self) -> list[int]:
        return [sum(n for _, n, _, _ in _parameters(layer)) for _, layer in self._layers]

    @property
    def training_modes(self) -> list[bool]:
        return [layer.training for _, layer in self._layers]

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for m in self._model.modules()][1:]  # not the module itself
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        return sum(n for _, n, _, _ in _parameters(self._model))

    @property
    def trainable_parameters(self) -> int:
        return sum(n for p, n, _, _ in _parameters(self._model) if p.requires_grad)

    @property
    def model_size(self) -> float:
        """The parameters' estimated size in MB (each by its dtype)."""
        return sum(n * element for _, n, element, _ in _parameters(self._model)) / 1e6

    def __str__(self) -> str:
        sizes = None
        if getattr(self._model, "example_input_array", None) is not None:
            sizes = ([str(x) for x in self.in_sizes], [str(x) for x in self.out_sizes])
        return _table(self._model, self._max_depth, sizes=sizes)

    def __repr__(self) -> str:
        return str(self)
