"""``XlaDDP``: torch's DistributedDataParallel over the ``xla`` process group."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from xtrainer._lazy_xla import xla as _xla
from xtrainer.strategies import shared_process
from xtrainer.strategies.parallel import ParallelStrategy, check_wrapper_kwargs
from xtrainer.strategies.launchers.processes import free_port


#: A bucket cap below any parameter's size: DDP then gives every parameter its own bucket.
_PER_PARAMETER_BUCKETS_MB = 1e-6


class XlaDDP(ParallelStrategy):
    """Wraps the module in ``DistributedDataParallel`` (``gradient_as_bucket_view=True``, which
    XLA needs); DDP all-reduces gradients during backward and the optimizer steps with a plain
    ``optimizer.step()``. Micro-batches that do not step the optimizer run under ``no_sync()``.

    On the CPU runtime, each parameter gets a bucket of its own unless ``bucket_cap_mb`` is given.
    A gradient is a view into its bucket, and the lazy graph writes every gradient into the bucket
    with a ``dynamic-update-slice`` that copies the whole bucket when the CPU runtime cannot update
    it in place: with DDP's default 25 MB buckets, a 4-layer transformer's step took twice the CPU
    time of ``xla_native``'s (``benchmarks/RESULTS.md``). Bucketing buys no overlap in a lazy graph,
    where all collectives of a step are compiled together. On TPU, DDP's default stands (torch_xla
    measured it there); whether per-parameter buckets are faster on TPU is untested here.

    Args:
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``static_graph``, ``bucket_cap_mb``, ...).
    """

    name = "xla_ddp"
    reduces_wrapped_trainable_only = True

    def __init__(self, **ddp_kwargs: Any) -> None:
        super().__init__()
        if ddp_kwargs.get("gradient_as_bucket_view", True) is not True:
            raise ValueError("XlaDDP needs gradient_as_bucket_view=True: on XLA, gradients copied out of DDP's "
                             "buckets are not kept in step with them. Remove the gradient_as_bucket_view argument.")
        for key in ("device_ids", "output_device"):
            if key in ddp_kwargs:
                raise ValueError(f"XlaDDP places the module on the XLA device itself; remove {key}=.")
        check_wrapper_kwargs(DistributedDataParallel, ddp_kwargs, XlaDDP, "DistributedDataParallel")
        self.ddp_kwargs = {**ddp_kwargs, "gradient_as_bucket_view": True}
        self._owns_process_group = False

    def setup_environment(self) -> None:
        super().setup_environment()
        if not dist.is_initialized():
            _xla.register_xla_process_group_backend()
            with _own_port_when_alone(self.devices == 1):
                dist.init_process_group("xla", init_method="xla://")
            self._owns_process_group = True

    def setup_module(self, module: nn.Module) -> nn.Module:
        kwargs = dict(self.ddp_kwargs)
        if _xla.device_type() == "CPU":
            kwargs.setdefault("bucket_cap_mb", _PER_PARAMETER_BUCKETS_MB)
        module = super().setup_module(module)
        # DistributedDataParallel(module, **kwargs), started as this process's replicas can.
        return shared_process.current().wrap_ddp(module, kwargs)

    def manual_backward(self, wrapped: nn.Module, loss: Any, *args: Any, **kwargs: Any) -> None:
        """DDP's reducer is armed once per forward; manual optimization may run several backward
        passes per ``training_step``: ``arm_reducer`` before each."""
        arm_reducer(wrapped, loss)
        super().manual_backward(wrapped, loss, *args, **kwargs)
        rebuild_buckets(wrapped)

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped

    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return wrapped.no_sync() if enabled else contextlib.nullcontext()

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        super().teardown(wrapped, failed)
        if self._owns_process_group and dist.is_initialized():
            if not failed:
                # Rank 0 hosts the rendezvous store: nobody tears down before everybody is done.
                self.collectives.barrier("xtrainer_ddp_teardown")
            dist.destroy_process_group()
            self._owns_process_group = False


def arm_reducer(wrapped: nn.Module, loss: Any) -> None:
    """Arm ``DistributedDataParallel``'s reducer for a backward pass of ``loss``, as its forward
    does. Manual optimization may run several backward passes per ``training_step`` (a GAN's
    generator and discriminator), one forward of the wrapper: each after the first would leave
    the reducer unprepared (gradients not averaged, and the next forward fails). Parameters a
    backward does not reach (the other optimizer's, toggled off) need
    ``find_unused_parameters=True``, as with DDP anywhere."""
    if isinstance(wrapped, DistributedDataParallel) and torch.is_grad_enabled() \
            and wrapped.require_backward_grad_sync:
        wrapped.require_forward_param_sync = True
        outputs = [loss] if wrapped.find_unused_parameters and not wrapped.static_graph else []
        wrapped.reducer._rebuild_buckets()  # private torch API, as DDP's own forward calls it
        wrapped.reducer.prepare_for_backward(outputs)


def rebuild_buckets(wrapped: nn.Module) -> None:
    """After a backward pass of manual optimization: let ``DistributedDataParallel`` rebuild its
    gradient buckets (once, in the order the first backward produced gradients) now, between
    the backward and the end of the wrapper's forward. DDP rebuilds them at the start of its
    next forward, but under manual optimization the backward runs inside the forward
    (``training_step`` is called through DDP), whose end arms the reducer for a backward that
    never comes; the rebuild then refuses ("``initialize_buckets`` must NOT be called during
    autograd execution") and the second batch of a one-optimizer loop failed.

    Called only while a rebuild is due (DDP rebuilds once, and never with
    ``find_unused_parameters`` on a dynamic graph): the call releases the GIL, and the CPU
    runtime's thread replicas crashed more often (glibc heap corruption, 2 runs of 8 under load
    against none of 18) with a call after every backward (``strategies/launchers/processes.py`` on that race)."""
    if isinstance(wrapped, DistributedDataParallel) and torch.is_grad_enabled() \
            and not getattr(wrapped, "_has_rebuilt_buckets", False) \
            and (wrapped.static_graph or not wrapped.find_unused_parameters):
        if wrapped.reducer._rebuild_buckets():  # private torch API, as DDP's own forward calls it
            wrapped._has_rebuilt_buckets = True


@contextlib.contextmanager
def _own_port_when_alone(alone: bool) -> Iterator[None]:
    """A single in-process replica rendezvous with itself on a free port, so that two runs on one
    machine do not both claim torch_xla's default ``MASTER_PORT``. With several replicas the
    documented default (or the user's ``MASTER_PORT``) stands: every replica must agree on it."""
    if not alone or "MASTER_PORT" in os.environ:
        yield
        return
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        yield
    finally:
        os.environ.pop("MASTER_PORT", None)
