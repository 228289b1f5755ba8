"""``"model_parallel"``: Lightning's ``ModelParallelStrategy``, FSDP2 and tensor parallelism through
DTensor, applied by the module itself in ``configure_model()`` over a 2-D device mesh.

The strategy builds the mesh, ``("data_parallel", "tensor_parallel")`` of ``data_parallel_size`` x
``tensor_parallel_size`` processes, and gives it to the module as ``self.device_mesh`` before
``configure_model()`` runs; the module parallelizes its layers with it (torch's
``parallelize_module`` over ``self.device_mesh["tensor_parallel"]``, ``fully_shard`` over
``self.device_mesh["data_parallel"]``), as in Lightning. The strategy wraps nothing itself. Each
data-parallel group reads its own share of the data; the processes of one tensor-parallel group
read the same batches. Checkpoints are ``torch.distributed.checkpoint`` folders that resume at
another mesh shape (DCP reshards on load), or, with ``save_distributed_checkpoint=False``, one
whole file that rank 0 writes. After a stage the module is given back whole, on the CPU, with its
parallelization taken off, so a later stage's ``configure_model()`` parallelizes it afresh.

Processes, devices and the process group are the native family's (``strategies/native.py``):
``devices=N`` starts them, or torchrun does; one process runs over a group of its own (a mesh of
1 x 1) so the module's parallelization code runs unchanged.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from xtrainer.checkpoint.distributed import Distributed
from xtrainer.checkpoint.layout import Layout
from xtrainer.checkpoint.whole import WholeFile
from xtrainer.strategies import dtensors, process_group
from xtrainer.strategies.data import DeviceData, _plain_random, distribute_dataloader
from xtrainer.strategies.native import AGREEMENT_SECONDS
from xtrainer.strategies.native_fsdp import NativeFSDP

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The names of the mesh's dimensions, as Lightning names them.
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")


def _size(name: str, value: Any) -> "int | str":
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"ModelParallelStrategy({name}={value!r}): give a positive int or 'auto'.")


class ModelParallelStrategy(NativeFSDP):
    """FSDP2 and tensor parallelism that the module applies in ``configure_model()`` over
    ``self.device_mesh`` (Lightning's ``ModelParallelStrategy``).

    Args:
        data_parallel_size: the processes of each tensor-parallel position that split the data
            (the mesh's first dimension); ``"auto"``: the number of hosts (``num_nodes``), as in
            Lightning.
        tensor_parallel_size: the processes that split each layer (the mesh's second dimension);
            ``"auto"``: the processes of one host, as in Lightning.
        save_distributed_checkpoint: True: each process writes its shards of the weights and
            optimizer state into a checkpoint folder (any mesh shape resumes it); False: the
            whole weights and optimizer state are gathered and rank 0 writes one file.
        process_group_backend: the backend of the process group; None or the device's own (gloo
            on the CPU, nccl on CUDA): the native family's process group is the device's.
        timeout: how long a collective may wait for the other processes (a ``timedelta`` or
            seconds).
        compile, compile_kwargs, agreement_seconds: as ``NativeSingle``.

    The product of the two sizes must be the number of processes.
    """

    name = "model_parallel"

    def __init__(self, data_parallel_size: "int | str" = "auto", tensor_parallel_size: "int | str" = "auto",
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: "datetime.timedelta | float | None" = datetime.timedelta(seconds=1800),
                 compile: bool = False, compile_kwargs: dict[str, Any] | None = None,
                 agreement_seconds: float = AGREEMENT_SECONDS) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        super().__init__(compile=compile, compile_kwargs=compile_kwargs,
                         timeout_seconds=1800.0 if seconds is None else float(seconds),
                         agreement_seconds=agreement_seconds)
        self._data_parallel_size = _size("data_parallel_size", data_parallel_size)
        self._tensor_parallel_size = _size("tensor_parallel_size", tensor_parallel_size)
        self._save_distributed_checkpoint = bool(save_distributed_checkpoint)
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._mesh_shape: tuple[int, int] | None = None
        self._device_mesh: "DeviceMesh | None" = None
        self._own_group = False  # a group of one process, made here for the mesh

    # ---- configuration (calling process) -------------------------------------------------
    def configure(self, accelerator: str, devices: "int | str", num_nodes: int, precision: Any) -> None:
        """As the native family, then the mesh's shape checked against the processes the run
        will have (before any starts)."""
        super().configure(accelerator, devices, num_nodes, precision)
        self._num_nodes = num_nodes
        backend = self.runtime.process_group_backend()
        if self._process_group_backend not in (None, backend):
            raise ValueError(f"ModelParallelStrategy(process_group_backend={self._process_group_backend!r}): the "
                             f"{self.runtime.type} device's process group is {backend!r}; leave it None.")
        world = int(os.environ["WORLD_SIZE"]) if process_group.under_torchrun() else (self.devices or 1) * num_nodes
        self._mesh_shape = self._shape(world)

    def _shape(self, world: int) -> tuple[int, int]:
        """(data parallel, tensor parallel) for ``world`` processes, by Lightning's rule: "auto" is
        the number of hosts for the first, the processes of a host for the second."""
        per_host = world // max(self._num_nodes, 1)
        dp = self._num_nodes if self._data_parallel_size == "auto" else int(self._data_parallel_size)
        tp = per_host if self._tensor_parallel_size == "auto" else int(self._tensor_parallel_size)
        if dp * tp != world:
            if self._data_parallel_size != "auto" and world % dp == 0:  # keep the size given, fit the other
                fit = (dp, world // dp)
            elif world % tp == 0 and tp > 0:
                fit = (world // tp, tp)
            else:
                fit = (1, world)
            raise ValueError(
                f"ModelParallelStrategy(data_parallel_size={self._data_parallel_size!r}, tensor_parallel_size="
                f"{self._tensor_parallel_size!r}) makes a mesh of {dp} x {tp} = {dp * tp} processes, but the run has "
                f"{world}: give sizes whose product is {world} (e.g. data_parallel_size={fit[0]}, "
                f"tensor_parallel_size={fit[1]}), or devices={dp * tp}.")
        return dp, tp

    # ---- the mesh ----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """The native family's process group (a group of one for one process), then the 2-D mesh."""
        super().setup_environment()
        if not dist.is_initialized():  # one process: a group of its own, for the mesh
            dist.init_process_group(self.runtime.process_group_backend(), store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=self.timeout_seconds))
            self._own_group = True
        from torch.distributed.device_mesh import init_device_mesh

        shape = self._shape(self.world_size)
        self._device_mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=MESH_DIM_NAMES)

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The 2-D mesh of the run's processes, ``("data_parallel", "tensor_parallel")``."""
        if self._device_mesh is None:
            raise RuntimeError("ModelParallelStrategy.device_mesh is made when the processes start: read it from "
                               "configure_model() or later hooks (self.device_mesh in the module).")
        return self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        """The processes that split the data (the mesh's first dimension)."""
        return self._device_mesh.size(0) if self._device_mesh is not None else self._planned()[0]

    @property
    def tensor_parallel_size(self) -> int:
        """The processes that split each layer (the mesh's second dimension)."""
        return self._device_mesh.size(1) if self._device_mesh is not None else self._planned()[1]

    def _planned(self) -> tuple[int, int]:
        return self._mesh_shape or (1, 1)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """This process's share of the data: its data-parallel group's (the processes of one
        tensor-parallel group read the same samples)."""
        if self._device_mesh is None:  # the calling process, before the processes start: rank 0's
            return {"num_replicas": self._planned()[0], "rank": 0}
        mesh = self._device_mesh["data_parallel"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    # ---- the module ------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The mesh given to the module (``self.device_mesh``), ``configure_model()`` (which
        parallelizes), the module to the device; then a check that it used the mesh."""
        user = module.module
        user._device_mesh = self._device_mesh
        try:
            module = super().setup_module(module)
            self._check_parallelized(user)
        except BaseException:  # no teardown follows a module that was never set up: release here
            self._release(user)
            raise
        return module

    def _wrap(self, module: nn.Module) -> nn.Module:
        return module  # the module parallelized itself in configure_model()

    def tensor_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``Trainer.init_module(empty_init=True)``: layers built on the meta device (no memory),
        given memory on the device and their ``reset_parameters()`` after ``configure_model()``
        has parallelized them, each process its own shards (Lightning's way, from torchtitan)."""
        return torch.device("meta") if empty_init else contextlib.nullcontext()

    def _materialize(self, module: nn.Module) -> None:
        """Tensors on the meta device (``init_module(empty_init=True)``) given memory on the device
        (each process its shards), then every layer that holds tensors reset
        (``reset_parameters()``); layers that cannot be are named in a warning, as in Lightning."""
        if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            return
        module.to_empty(device=self.device)
        unset = set()
        for layer in module.modules():
            if next(iter([*layer.parameters(recurse=False), *layer.buffers(recurse=False)]), None) is None:
                continue
            reset = getattr(layer, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                unset.add(type(layer).__name__)
        if unset:
            from lightning_utilities.core.rank_zero import rank_zero_warn

            rank_zero_warn(f"{type(module).__name__}: the layers built on the meta device (init_module(empty_init=True)) "
                           f"have memory but no values where they have no reset_parameters(): {', '.join(sorted(unset))}; "
                           "set them in a hook (on_train_start), or load a checkpoint.")

    def _check_parallelized(self, user: nn.Module) -> None:
        """Refuse a module that does not use the mesh where it must: with several tensor-parallel
        processes, no parameter split over ``tensor_parallel`` (each would compute the whole
        layer); with several data-parallel ones, a trainable parameter outside ``fully_shard``
        over ``data_parallel`` (its gradient would never be averaged over them)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        name = type(user).__name__
        if any(isinstance(m, FullyShardedDataParallel) for m in user.modules()):
            raise TypeError(f"{name}.configure_model() wraps layers in FullyShardedDataParallel (FSDP1); "
                            "ModelParallelStrategy takes FSDP2: torch.distributed.fsdp.fully_shard(layer, "
                            "mesh=self.device_mesh['data_parallel']).")
        dp, tp = self._device_mesh.size(0), self._device_mesh.size(1)

        def over(param: torch.Tensor, dim: str) -> bool:
            return dtensors.is_dtensor(param) and dim in (param.device_mesh.mesh_dim_names or ())

        params = list(user.named_parameters())
        if tp > 1 and not any(over(p, "tensor_parallel") for _, p in params):
            raise ValueError(f"{name}.configure_model() split no layer over self.device_mesh['tensor_parallel'] "
                             f"(tensor_parallel_size={tp}): parallelize its layers there (torch's parallelize_module), "
                             "or give ModelParallelStrategy(tensor_parallel_size=1).")
        if dp > 1:
            outside = [n for n, p in params if p.requires_grad and not over(p, "data_parallel")]
            if outside:
                raise ValueError(
                    f"{name}.configure_model() left {len(outside)} trainable parameter(s) outside fully_shard over "
                    f"self.device_mesh['data_parallel'] (data_parallel_size={dp}), so their gradients would not be "
                    f"averaged over the data: {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}. Apply "
                    "fully_shard(module, mesh=self.device_mesh['data_parallel']) to the layers that hold them.")

    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Accumulating micro-batches: no gradient reduce-scatter in the FSDP2 modules the module
        made, until the micro-batch that steps."""
        if not enabled:
            return contextlib.nullcontext()
        return _gradient_sync_off([m for m in wrapped.modules() if hasattr(m, "set_requires_gradient_sync")])

    # ---- data --------------------------------------------------------------------------------
    def process_dataloader(self, loader: Iterable, distribute: bool = True) -> DeviceData:
        """As every strategy, but shared out over the data-parallel groups only: the processes of
        one tensor-parallel group read the same batches."""
        shares = self.distributed_sampler_kwargs
        owns_sampler = False
        if distribute and isinstance(loader, DataLoader) and (shares["num_replicas"] > 1 or _plain_random(loader)):
            distributed = distribute_dataloader(loader, shares["num_replicas"], shares["rank"])
            owns_sampler, loader = distributed is not loader, distributed
        return DeviceData(loader, self._deliver, owns_sampler, replicas=shares["num_replicas"])

    # ---- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_layout(self) -> Layout:
        """A ``torch.distributed.checkpoint`` folder (each process writes its shards; any mesh
        resumes it), or with ``save_distributed_checkpoint=False`` one whole file."""
        if self._save_distributed_checkpoint:
            return Distributed(spmd=False)
        return _Gathered()

    # ---- the end -----------------------------------------------------------------------------
    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        """The module whole again (FSDP2 and tensor parallelism taken off, its parameters and
        buffers plain tensors holding the whole trained values: a collective, at the same point
        on every process), on the CPU; the mesh dropped, and a group of one process destroyed."""
        try:
            if not (failed and self.world_size > 1):
                _take_off_tensor_parallel(wrapped)
            super().teardown(wrapped, failed)
        finally:
            self._release(self.unwrap(wrapped).module)

    def _release(self, user: nn.Module) -> None:
        """The mesh dropped (from the module too: it would not pickle for a later stage), and a
        group of one process destroyed."""
        user._device_mesh = None
        self._device_mesh = None
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False


@contextlib.contextmanager
def _gradient_sync_off(modules: list[nn.Module]) -> Any:
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def _take_off_tensor_parallel(root: nn.Module) -> None:
    """Undo ``parallelize_module``/``distribute_module`` under ``root``: DTensor buffers made
    whole, the forward hooks that lay inputs and outputs out over the mesh removed, and the mark
    that refuses a second ``distribute_module`` cleared (a later stage parallelizes afresh). The
    parameters are made whole with FSDP2's (``native_fsdp``'s teardown). torch has no public way
    back: the hooks are known by the module that defines them (``torch.distributed.tensor``)."""
    for module in root.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and dtensors.is_dtensor(buffer):
                module._buffers[name] = buffer.full_tensor()  # a collective; the same order on every process
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if getattr(hook, "__module__", "").startswith("torch.distributed.tensor"):
                    del hooks[key]
        module.__dict__.pop("_distribute_module_applied", None)


class _Gathered(WholeFile):
    """``save_distributed_checkpoint=False``: the whole weights and optimizer state gathered on
    every process (collectives, in the same order on each), then one whole file as the
    unsharded strategies write it (rank 0 writes)."""

    def save(self, replicas: Any, checkpoint: dict[str, Any], path: str) -> None:
        from lightning_utilities.core.apply_func import apply_to_collection

        whole = {**checkpoint, "state_dict": {k: dtensors.full(v) for k, v in checkpoint["state_dict"].items()},
                 "optimizer_states": apply_to_collection(checkpoint["optimizer_states"], torch.Tensor, dtensors.full)}
        super().save(replicas, whole, path)
