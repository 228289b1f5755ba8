"""The optimizer's calls in a training step, without the profiler ranges torch puts around them
when nothing records them: ``step`` (``optimizer.step()``) and ``clear_gradients``
(``optimizer.zero_grad(set_to_none=True)``).

torch wraps the ``step`` of every optimizer class in ``Optimizer.profile_hook_step``: a
``record_function`` range (two operator calls and a handle object) and the step hooks. On the CPU
the range costs about 25 us of host time per step: several percent of a small model's step, more
than the rest of the Trainer's own work on it. Where nothing can see that range (torch's
profiler is off) and nothing would run around the step (no step hooks, global or the optimizer's
own), ``step`` calls what torch wrapped, as torch would have called it, and nothing else changes:
the optimizer's own ``step`` (with its ``no_grad`` wrapper), the learning-rate schedulers' record
that the optimizer stepped, the result. Anything else (an optimizer whose ``step`` torch did not
wrap, one with a ``step`` set on the instance, hooks, profiling) goes through ``optimizer.step()``.
The strategies' optimizer step calls ``step``; XLA's ``xm.optimizer_step`` calls ``optimizer.step()``
itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer


def _profiled_step_code() -> Any:
    """The code object of torch's step wrapper (one for every class it wraps), or None where
    this torch has no such wrapper."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    if wrap is None:
        return None
    try:
        return wrap(lambda *args, **kwargs: None).__code__
    except Exception:  # noqa: BLE001 - another torch: take the plain path
        return None


_PROFILED_STEP = _profiled_step_code()
_GLOBAL_HOOKS = (getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
                 getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))


@functools.lru_cache(maxsize=None)
def _unwrapped(step: Any) -> Any:
    """What torch's wrapper ``step`` calls, or None where ``step`` is not that wrapper."""
    code = getattr(step, "__code__", None)
    inner = getattr(step, "__wrapped__", None)
    return inner if _PROFILED_STEP is not None and code is _PROFILED_STEP and callable(inner) else None


def step(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()``, without torch's profiler range where nothing records it."""
    inner = _unwrapped(type(optimizer).step)
    if inner is None or _observed(optimizer):
        return optimizer.step()
    own = optimizer.__dict__.get("step")
    if own is not None:
        # The learning-rate scheduler's record that the optimizer stepped (it warns otherwise), set
        # on the instance by torch's LRScheduler around the class's step: kept. Anything else set
        # there is the user's: called as it is.
        if not getattr(own, "_wrapped_by_lr_sched", False) or getattr(own, "__wrapped__", None) is not \
                type(optimizer).step:
            return optimizer.step()
        optimizer._opt_called = True  # type: ignore[attr-defined]
    out = inner(optimizer)
    optimizer._optimizer_step_code()  # torch's entry point for its profiler's Python tracing, as its wrapper calls it
    return out


def _observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether anything would see or run around the step: torch's profiler, or step hooks. (As
    torch's own compiled code decides whether to record its ranges, by the profiler's flag: an
    execution-trace observer running without the profiler does not see the range.)"""
    if _profiling():
        return True
    pre, post = _GLOBAL_HOOKS
    if pre is None or post is None or pre or post:
        return True
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", True)
                or getattr(optimizer, "_optimizer_step_post_hooks", True))


def clear_gradients(optimizer: Any) -> None:
    """``optimizer.zero_grad(set_to_none=True)``. Where that method is torch's own
    (``torch.optim.Optimizer.zero_grad``: every optimizer of ``torch.optim``), the same is done
    here: each parameter's gradient set to None. torch wraps its loop in a profiler range and a
    ``torch.compile`` guard, which cost about 10 us of host time per call on the CPU. Under
    torch's profiler (where the range is wanted) and for an optimizer with a ``zero_grad`` of its
    own, that method is called."""
    if type(optimizer).zero_grad is _TORCH_ZERO_GRAD and not _profiling():
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
    else:
        optimizer.zero_grad(set_to_none=True)


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _profiling() -> bool:
    """Whether torch's profiler records (where this torch cannot say: as if it did)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
