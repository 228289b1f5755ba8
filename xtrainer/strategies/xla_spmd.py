"""``XlaSPMD`` and ``XlaFSDPv2``: one program, compiled once, partitioned over every device.

torch_xla's SPMD mode traces the step once, as if for one device, and the compiler partitions it
over a device mesh according to sharding annotations: here, the batch dimension of every input
(data parallel) and, for FSDPv2, every parameter along an ``fsdp`` mesh axis. There is one
process per host and no ``torch_xla.launch``: ``Trainer(strategy="xla_spmd", devices=N)`` runs the
fit in one new process (``launch.SpmdProcess``; SPMD must be switched on before any XLA tensor
exists, which the calling process may already have made), with N devices on the CPU runtime
(``CPU_NUM_DEVICES``) or every device of the host elsewhere. The processes, one per host, are
the replicas that agree on the host (``collectives.SpmdHosts``).

Checkpoints are folders written with ``torch.distributed.checkpoint`` and torch_xla's SPMD
planners: every process writes the shards it holds, and a resume reads each shard back into the
sharded tensors in place, on any mesh (another device count reshards). ``xtrainer consolidate``,
``xla_native`` and ``xla_ddp`` read such a folder whole.

Values computed in the step are already global (the compiler inserts the collectives), so
``self.log(..., sync_dist=True)`` needs no reduction and the batch your loader yields is the
global batch, split over the devices. On several hosts (untested here: no pod) each process
reads its share of the data (``minibatch`` sharding) and rank 0 writes logs and checkpoints.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xtrainer._lazy_xla import xla as _xla
from xtrainer.checkpoint.distributed import (Distributed, DistributedEntry, DistributedPart, load_into,
                                            read_optimizer_state)
from xtrainer.checkpoint.format import check_fits, shapes_of
from xtrainer.strategies.parallel import ParallelStrategy
from xtrainer.strategies.collectives import SpmdHosts
from xtrainer.strategies.launchers import SpmdProcess
from xtrainer.strategies.launchers.processes import free_port
from xtrainer.strategies.wrap_policies import check_wrap_policy, wrap_policy


class XlaSPMD(ParallelStrategy):
    """Data parallel by sharding: parameters replicated, each batch split on its first dimension.

    Args:
        mesh_shape: the device mesh's shape (default: every device on one axis).
        axis_names: its axis names; the batch is split over ``data_axis``.
        data_axis: the mesh axis the batch dimension is sharded over.
        shardings: ``{parameter name: partition spec}`` annotations applied before training, e.g.
            ``{"net.0.weight": ("model", None)}`` to shard a layer over a ``"model"`` axis (tensor
            parallelism); other parameters stay replicated.
    """

    name = "xla_spmd"
    _default_axes: tuple[str, ...] = ("data",)

    def __init__(self, mesh_shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] | None = None,
                 data_axis: str | None = None, shardings: dict[str, tuple] | None = None) -> None:
        super().__init__()
        preemption_sync_choice()  # a mistyped value is refused here, before a process starts
        self.axis_names = tuple(axis_names or self._default_axes)
        self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self.data_axis = data_axis or self.axis_names[0]
        if self.data_axis not in self.axis_names:
            raise ValueError(f"{type(self).__name__}(data_axis={self.data_axis!r}) is not one of the mesh's axes "
                             f"{self.axis_names}.")
        if self.mesh_shape is not None and len(self.mesh_shape) != len(self.axis_names):
            raise ValueError(f"{type(self).__name__}: mesh_shape {self.mesh_shape} and axis_names {self.axis_names} "
                             "must have the same length.")
        self.shardings = dict(shardings or {})
        self.mesh: Any = None
        self._specs: dict[int, tuple] = {}  # id(parameter) -> its partition spec
        self._owns_process_group = False
        self._preemption: _xla.PreemptionNotice | None = None

    #: One process per host drives every device of the host (ParallelStrategy's count), and its
    #: loader gives the host's whole batch, which the mesh splits.
    num_processes = 1

    # ---- launching: one new process, SPMD on -------------------------------------------------
    @property
    def launcher(self) -> SpmdProcess:
        """One new process, SPMD switched on before any XLA tensor exists, over ``devices``
        virtual devices on the CPU runtime (every device of the host elsewhere)."""
        return SpmdProcess(self.devices, f"strategy={self.name!r}")

    def setup_environment(self) -> None:
        """The device, the mesh, the hosts' CPU process group (on several hosts) and XLA's
        preemption sync (on TPU); the replicas are the hosts (``collectives.SpmdHosts``)."""
        super().setup_environment()
        self.collectives = SpmdHosts(self.device)
        count = _xla.spmd_device_count()
        if self.devices is not None and _xla.device_type() != "CPU" and self.devices != count:
            raise ValueError(f"devices={self.devices}, but an SPMD program spans every device ({count} here). "
                             f"Use devices='auto' (or {count}).")
        shape = self.mesh_shape or (count,) + (1,) * (len(self.axis_names) - 1)
        if math.prod(shape) != count:
            raise ValueError(f"mesh_shape={shape} holds {math.prod(shape)} devices; there are {count}.")
        self.mesh = _xla.mesh(shape, self.axis_names)
        if _xla.process_count() > 1 and not dist.is_initialized():
            # The hosts agree (barriers, and torch.distributed.checkpoint's coordination of their
            # writes) over a CPU process group, as torch_xla documents for SPMD (untested: no pod).
            _xla.register_xla_process_group_backend()
            dist.init_process_group("gloo", init_method="xla://")
            self._owns_process_group = True
        if preemption_sync_wanted():
            self._preemption = _xla.PreemptionNotice(local_port=free_port())

    # ---- stopping --------------------------------------------------------------------------------
    def preempted(self, step: int) -> bool:  # type: ignore[override]
        """Whether the job agreed, through XLA's preemption sync, to stop at ``step``."""
        return self._preemption is not None and self._preemption.reached(step)

    # ---- the module ----------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        self._annotate(module.module)
        return module

    def _annotate(self, user_module: nn.Module) -> None:
        params = dict(user_module.named_parameters())
        unknown = sorted(set(self.shardings) - set(params))
        if unknown:
            raise ValueError(f"{type(self).__name__}(shardings=...) names {unknown}, which the module does not have "
                             f"(its parameters: {', '.join(list(params)[:8])}...).")
        for name, spec in self.shardings.items():
            _xla.mark_sharding(params[name], self.mesh, tuple(spec))
            self._specs[id(params[name])] = tuple(spec)

    # ---- checkpoints: sharded, through torch.distributed.checkpoint -----------------------------
    @property
    def checkpoint_layout(self) -> Distributed:
        """Folders through ``torch.distributed.checkpoint``: each process writes the shards it holds
        (nothing is gathered); a distributed folder is read lazily, into the live sharded tensors,
        and a whole file of another strategy loads too."""
        return Distributed()

    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's state dict, named as the bare module names it (FSDPv2's inner units
        would add their own name to every key below them)."""
        return {self._bare(name): tensor for name, tensor in self.unwrap(wrapped).module.state_dict().items()}

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        """From a distributed checkpoint, every shard is read into the module's own sharded
        tensors in place; a whole file's tensors are copied into them."""
        module = self.unwrap(wrapped).module
        live = module.state_dict()
        names = {self._bare(name): name for name in live}  # as saved -> as the wrapped module has it
        own = {bare: live[name] for bare, name in names.items()}
        state = checkpoint["state_dict"]
        if isinstance(state, DistributedPart):
            check_fits(own, {entry.where[0]: entry.shape for entry in state.entries})
            target = {"state_dict": own}
            load_into(target, state.path)
            state = target["state_dict"]
        else:
            check_fits(own, shapes_of(state))
        module.load_state_dict({names[name]: tensor for name, tensor in state.items()})

    def _bare(self, name: str) -> str:
        return name

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Any) -> None:
        """Optimizer state is given the sharding of its parameter, as the state that training
        created had; otherwise the step would compile anew for it. From a distributed checkpoint
        it is read straight into tensors so sharded; from a whole file it arrives unsharded."""
        if isinstance(state, DistributedPart):
            params = [param for group in optimizer.param_groups for param in group["params"]]
            state = read_optimizer_state(state, params, self._optimizer_tensor)
        super().load_optimizer_state_dict(optimizer, state)
        for group in optimizer.param_groups:
            for param in group["params"]:
                spec = self._specs.get(id(param))
                if spec is None:
                    continue
                for value in optimizer.state.get(param, {}).values():
                    if _xla.is_xla_tensor(value) and value.shape == param.shape and not _xla.sharding_of(value):
                        _xla.mark_sharding(value, self.mesh, spec)

    def _optimizer_tensor(self, param: torch.Tensor, entry: DistributedEntry) -> torch.Tensor:
        """A tensor for a saved optimizer value to be read into: on the device and sharded as
        ``param`` if it has the parameter's shape, else on the host (scalars such as Adam's ``step``)."""
        if entry.shape != tuple(param.shape) or param.dim() == 0 or not _xla.is_xla_tensor(param):
            return torch.zeros(entry.shape, dtype=entry.dtype)  # the optimizer moves it where it belongs
        tensor = torch.zeros(entry.shape, dtype=entry.dtype, device=param.device)
        spec = self._specs.get(id(param))
        if spec is not None:
            _xla.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        super().teardown(wrapped, failed)
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    def _input_sharding(self) -> Any:
        return _xla.BatchSharding(self.mesh, self.data_axis, minibatch=self.world_size > 1)


class XlaFSDPv2(XlaSPMD):
    """FSDP by sharding (torch_xla's ``SpmdFullyShardedDataParallel``): every parameter split over
    the ``fsdp`` mesh axis, gathered by the compiler where it is used; the batch split over the
    same axis.

    Args:
        auto_wrap_policy: wrap submodules in their own unit, as for ``XlaFSDP``: an int
            (parameter count), layer classes or their names (``{"transformer_layer_cls":
            ["LlamaDecoderLayer"]}`` in YAML), or ``"no_split_modules"`` (a Hugging Face model's
            decoder layers).
        activation_checkpointing: recompute each wrapped unit's activations in backward.
        mesh_shape, axis_names: the mesh; default every device on ``("fsdp",)``. Add a second
            axis (e.g. ``axis_names=("fsdp", "model")``) and ``shardings`` for tensor parallelism.
        shardings: ``{parameter name: partition spec}`` applied first; FSDPv2 leaves those alone.
    """

    name = "xla_fsdpv2"
    shards_parameters = True
    _default_axes = ("fsdp",)

    def __init__(self, auto_wrap_policy: Any = None, activation_checkpointing: bool = False,
                 mesh_shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] | None = None,
                 shardings: dict[str, tuple] | None = None) -> None:
        super().__init__(mesh_shape, axis_names, "fsdp", shardings)
        check_wrap_policy(auto_wrap_policy)
        if activation_checkpointing and auto_wrap_policy is None:
            raise ValueError("activation_checkpointing=True checkpoints each auto-wrapped unit: give an "
                             "auto_wrap_policy as well (a parameter count or a set of layer classes).")
        self.auto_wrap_policy, self.activation_checkpointing = auto_wrap_policy, activation_checkpointing

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)  # configure_model(), to the device, user shardings
        fsdpv2 = _xla.fsdpv2_class()
        kwargs: dict[str, Any] = {"mesh": self.mesh, "shard_output": _leave_output}
        policy = wrap_policy(self.auto_wrap_policy, module)
        if policy is not None:
            kwargs["auto_wrap_policy"] = policy
            if self.activation_checkpointing:
                checkpoint_module = _xla.checkpoint_module
                kwargs["auto_wrapper_callable"] = lambda m, *a, **kw: fsdpv2(checkpoint_module(m), *a, **kw)
        wrapped = fsdpv2(module, **kwargs)
        for param in module.parameters():
            self._specs.setdefault(id(param), _xla.fsdpv2_partition_spec(param))
        return wrapped

    def _bare(self, name: str) -> str:
        return name.replace(_UNIT_ATTRIBUTE + ".", "")

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        fsdpv2 = _xla.fsdpv2_class()
        while isinstance(wrapped, fsdpv2):
            wrapped = wrapped.module
        return wrapped

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        """The user's module back without FSDPv2 units, its weights whole, on the CPU."""
        user_module = self.unwrap(wrapped).module
        fsdpv2 = _xla.fsdpv2_class()
        for parent in list(user_module.modules()):
            for name, child in list(parent._modules.items()):
                if isinstance(child, fsdpv2):
                    parent._modules[name] = self.unwrap(child)
        super().teardown(wrapped, failed)


#: The attribute under which an FSDPv2 unit holds the module it wraps.
_UNIT_ATTRIBUTE = "_orig_module"


def _leave_output(output: Any, mesh: Any) -> None:
    """The step returns a loss (or nothing), not activations: no output sharding to enforce."""
    del output, mesh


def preemption_sync_wanted() -> bool:
    """Whether to stop on XLA's preemption sync (``_xla.PreemptionNotice``): on TPU by default, where
    the platform's SIGTERM reaches every host and the hosts must stop at one step;
    ``XTRAINER_PREEMPTION_SYNC=1`` or ``0`` chooses (1 on the CPU runtime runs the same mechanism for
    one process; untested on TPU here)."""
    choice = preemption_sync_choice()
    return choice == "1" if choice else _xla.device_type() == "TPU"


def preemption_sync_choice() -> str:
    """``XTRAINER_PREEMPTION_SYNC`` as set: ``"1"``, ``"0"`` or ``""`` (the default); anything else
    is refused (also when the strategy is made, in the calling process)."""
    choice = os.environ.get("XTRAINER_PREEMPTION_SYNC", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"XTRAINER_PREEMPTION_SYNC={choice!r}: use 1 (stop on XLA's preemption sync) or 0 (don't).")
    return choice
