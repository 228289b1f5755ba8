"""Model FLOPs, tokens and MFU: how much of the chips' peak a run uses, comparable with published
figures.

**FLOPs of a training step** are counted once, at the first training batch, by running the
module's ``training_step`` and its backward on a copy of the module on the ``meta`` device (shapes
only: no data is copied, nothing runs on the XLA device, no graph is recorded) under
``torch.utils.flop_counter.FlopCounterMode``. That counts the matrix products and convolutions of
forward and backward, which is what MFU means (PaLM's definition: model FLOPs, not the recomputed
or the optimizer's). A module can declare its own instead, as an attribute or a method taking the
batch: ``flops_per_step`` (FLOPs of one micro-batch, forward and backward, on one replica's
batch) and ``tokens_per_step`` (tokens in one micro-batch of one replica). Without a declaration,
tokens are the elements of the batch's ``input_ids`` (a dict batch, as Hugging Face models take),
else not reported. The count is skipped, with one line saying why, for manual optimization and
modules it cannot run on ``meta`` (FSDP's flattened parameters, data-dependent Python): declare
``flops_per_step`` there.

**Peak FLOP/s per chip** (dense bfloat16, from the vendors' published specifications) are in
``PEAK_BF16_FLOPS``; add an entry for another chip and set ``XTRAINER_CHIP`` to its name, or set
``XTRAINER_CHIP`` to pick an entry where the chip is not detected (``_xla.chip_name``). The CPU
runtime has no meaningful peak: there the achieved FLOP/s are reported, and no MFU.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from typing import Any, Iterator

import torch
from torch import nn

from xtrainer.chips import gpu_chip, tpu_chip  # noqa: F401 - the chips' names, beside their peaks

#: Dense bfloat16 peak FLOP/s of one chip.
PEAK_BF16_FLOPS: dict[str, float] = {
    "tpu-v4": 275e12,
    "tpu-v5e": 197e12,
    "tpu-v5p": 459e12,
    "tpu-v6e": 918e12,
    "trainium1": 190e12,
    "trainium2": 667e12,
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
}

def peak_flops(chip: str | None) -> float | None:
    """The peak bf16 FLOP/s of ``chip`` (None: unknown chip, or the CPU runtime)."""
    return PEAK_BF16_FLOPS.get(chip) if chip else None


def declared(module: nn.Module, name: str, batch: Any) -> float | None:
    """The module's own ``flops_per_step``/``tokens_per_step``: a number, or a method of the batch."""
    value = getattr(module, name, None)
    if callable(value):
        value = value(batch)
    return None if value is None else float(value)


def tokens_in(batch: Any) -> float | None:
    """Tokens in a batch: the elements of its ``input_ids`` (shape only: no device read)."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return float(batch["input_ids"].numel())
    return None


def _meta_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return type(value)((k, _meta_like(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_meta_like(v) for v in value)
    return value


def count_training_step(module: nn.Module, batch: Any, batch_idx: int, keep: tuple = (), precision: Any = None
                        ) -> float:
    """FLOPs of ``module.training_step(batch, batch_idx)`` and its backward, counted on a copy of
    the module on the ``meta`` device. Host-side only: reads shapes, never values. ``keep``:
    objects the copy shares instead of copying (the trainer). Raises what the step raises on meta."""
    from torch.utils.flop_counter import FlopCounterMode

    from xtrainer.strategies.base import positional_count

    memo: dict[int, Any] = {id(obj): obj for obj in keep}
    for tensor in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    twin = copy.deepcopy(module, memo)
    twin.log = twin.log_dict = lambda *args, **kwargs: None  # the real run logs; the count must not
    for part in twin.modules():  # counted eagerly: torch.compile's wrapper belongs to the real module
        if getattr(part, "_compiled_call_impl", None) is not None:
            part._compiled_call_impl = None
    counter = FlopCounterMode(display=False)
    context = precision.step_context() if precision is not None else contextlib.nullcontext()
    batch = _meta_like(batch)
    batch = precision.convert_input(batch) if precision is not None else batch  # as the step sees it
    with host_random_state_kept(), counter, torch.device("meta"), context:
        args = (batch_idx,)[:max(0, positional_count(twin.training_step) - 1)]  # as the step dispatcher does
        out = twin.training_step(batch, *args)
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return float(counter.get_total_flops())


@contextlib.contextmanager
def host_random_state_kept() -> Iterator[None]:
    """The host's random generators (Python's, NumPy's, torch's CPU one) left as they were: a
    counted step (or the learning-rate finder's fit) that draws from them (an RL environment, a
    random crop) must not leave the run it precedes on another draw than a run without it."""
    state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
