"""``XlaFSDP``: torch_xla's ``XlaFullyShardedDataParallel`` (ZeRO-3 or ZeRO-2), sharded checkpoints."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from xtrainer._lazy_xla import xla as _xla
from xtrainer.checkpoint.format import load_weights
from xtrainer.checkpoint.fsdp import FsdpShards, consolidate_state_dicts
from xtrainer.strategies.parallel import ParallelStrategy, check_wrapper_kwargs
from xtrainer.strategies.wrap_policies import check_wrap_policy, wrap_policy

#: Instance attributes FSDP and activation checkpointing patch onto the user's modules.
_PATCHED_ATTRIBUTES = frozenset({"forward", "_xla_checkpointed_forward_original",
                                 "_xla_checkpointed_forward_no_kwargs"})


class XlaFSDP(ParallelStrategy):
    """Shards parameters, gradients and optimizer state across replicas.

    Args:
        reshard_after_forward: ``True`` (ZeRO-3: parameters are gathered for each forward and
            backward and freed after) or ``False`` (ZeRO-2: kept gathered between forward and
            backward).
        auto_wrap_policy: wrap submodules in their own FSDP unit: an int (every submodule with at
            least that many parameters), a set of module classes (e.g. transformer blocks), class
            names (``["LlamaDecoderLayer"]``, or ``{"transformer_layer_cls": [...]}`` as a YAML file
            writes it; matched against the classes of the module's own submodules, never
            imported), ``"no_split_modules"`` (the classes a Hugging Face model names in its
            ``_no_split_modules``: its decoder layers), or a torch_xla wrap policy callable. None:
            only the whole module is wrapped.
        activation_checkpointing: recompute each auto-wrapped unit's activations in backward
            instead of storing them (``checkpoint_module``).
        reduce_every_micro_batch: with gradient accumulation, reduce-scatter gradients after every
            micro-batch, keeping only gradient shards (less memory, more communication). Default
            False: accumulate full gradients under ``no_sync()`` and reduce once per step.
        **fsdp_kwargs: passed to ``XlaFullyShardedDataParallel`` (``compute_dtype``,
            ``buffer_dtype``, ``flatten_parameters``, ``shard_param_on_dim_0``, ...).

    For a model too large to build whole on the host, build it in ``XModule.configure_model()``
    and wrap each block there with ``self.trainer.strategy.wrap(block)`` (nested FSDP).

    Checkpoints are folders (``xtrainer.checkpoint.fsdp``): every rank writes
    ``rank-RRRRR-of-WWWWW.pt`` (its parameter and optimizer shards with the shard metadata), rank 0
    also ``trainer.pt`` and the ``manifest.json`` that marks the folder complete. ``xtrainer consolidate``
    turns such a folder into one plain state dict.
    """

    name = "xla_fsdp"
    shards_parameters = True
    flattens_parameters = True

    def __init__(self, reshard_after_forward: bool = True, auto_wrap_policy: Any = None,
                 activation_checkpointing: bool = False, reduce_every_micro_batch: bool = False,
                 **fsdp_kwargs: Any) -> None:
        super().__init__()
        for key in ("auto_wrapper_callable", "module"):
            if key in fsdp_kwargs:
                raise ValueError(f"XlaFSDP sets {key} itself; use auto_wrap_policy / activation_checkpointing.")
        check_wrapper_kwargs(self._fsdp_class(), fsdp_kwargs, XlaFSDP, "XlaFullyShardedDataParallel")
        check_wrap_policy(auto_wrap_policy)
        self.reshard_after_forward = reshard_after_forward
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing = activation_checkpointing
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.fsdp_kwargs = fsdp_kwargs
        self._saved_structure: list[tuple[nn.Module, dict, dict, set]] = []
        self._root: nn.Module | None = None

    # ---- wrapping --------------------------------------------------------------------------
    def _fsdp_class(self) -> type:
        return _xla.fsdp_wrapper_class()

    def _wrap_kwargs(self, module: nn.Module | None = None) -> dict[str, Any]:
        """FSDP's arguments; with ``module`` (the root being wrapped), the auto-wrap policy too,
        its class names resolved against ``module``'s submodules."""
        kwargs = dict(self.fsdp_kwargs, reshard_after_forward=self.reshard_after_forward)
        if self.activation_checkpointing:
            _checkpoint_status_per_thread()
        policy = wrap_policy(self.auto_wrap_policy, module) if module is not None else None
        if policy is not None:
            kwargs["auto_wrap_policy"] = policy
            if self.activation_checkpointing:
                checkpoint_module = _xla.checkpoint_module
                fsdp = self._fsdp_class()
                kwargs["auto_wrapper_callable"] = lambda m, *a, **kw: fsdp(checkpoint_module(m), *a, **kw)
        return kwargs

    def wrap(self, module: nn.Module) -> nn.Module:
        """Wrap one submodule in its own FSDP unit (call from ``configure_model``)."""
        self._snapshot(module)
        module = self.precision.convert_module(module).to(self.device)
        if self.activation_checkpointing:
            module = _xla.checkpoint_module(module)
        return self._fsdp_class()(module, **self._wrap_kwargs())

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.activation_checkpointing and self.auto_wrap_policy is None:
            raise ValueError("activation_checkpointing=True checkpoints each auto-wrapped unit: give an "
                             "auto_wrap_policy as well (a parameter count or a set of layer classes).")
        module = super().setup_module(module)  # configure_model(), which may call wrap(), then to device
        self._snapshot(module.module)
        self._root = self._fsdp_class()(module, **self._wrap_kwargs(module))
        return self._root

    def _snapshot(self, root: nn.Module) -> None:
        """Remember each module's own parameters, children and patched attributes before FSDP
        rewrites them, so that teardown can give the user's module back unwrapped."""
        seen = {id(entry[0]) for entry in self._saved_structure}
        for m in root.modules():
            if id(m) not in seen:
                self._saved_structure.append((m, dict(m._parameters), dict(m._modules),
                                              _PATCHED_ATTRIBUTES & set(m.__dict__)))

    def setup_optimizers(self, module: nn.Module, configure: Callable[[], Any], manual: bool = False) -> Any:
        """``configure_optimizers`` sees the sharded parameters through ``self.parameters()``."""
        if not manual:
            return self._configure_sharded(module, configure)
        raise NotImplementedError(
            "Manual optimization (automatic_optimization=False) is not supported under xla_fsdp: torch_xla's FSDP "
            "flattens the parameters of the module it wraps, so optimizers over parts of the module (a GAN's "
            "generator and discriminator) cannot be built. Use xla_fsdpv2 (SPMD FSDP, which shards parameters in "
            "place), xla_ddp or xla_native.")

    def _configure_sharded(self, module: nn.Module, configure: Callable[[], Any]) -> Any:
        """``configure_optimizers`` with ``self.parameters()`` giving the shards, and a
        submodule's parameters (``self.layer.parameters()``, ``named_parameters()``) the full
        parameters FSDP took out of the module: each optimizer's are then mapped to their shards
        (torch_xla keeps the shard of each full parameter as its ``_sharded_param``). With
        ``flatten_parameters=True`` a unit's parameters share one flat shard, so only whole units
        can be mapped."""
        user_module = self.unwrap(module).module
        user_module.parameters = module.parameters  # instance attribute shadows the method
        flattened = bool(self.fsdp_kwargs.get("flatten_parameters", False))
        message = ("Under xla_fsdp with flatten_parameters=True a unit's parameters are flattened into one shard, so "
                   "an optimizer cannot take a submodule's own: leave flatten_parameters at False (the default), make "
                   "that submodule a unit of its own (auto_wrap_policy), or optimize all of self.parameters.")
        try:
            with _full_parameters_in_place(user_module):
                config = configure()
        except ValueError as err:
            if flattened and "empty parameter list" in str(err):
                raise ValueError(message) from err
            raise
        finally:
            del user_module.parameters
        sharded = {id(p) for p in module.parameters()}
        for optimizer in _optimizers_in(config):
            _map_to_shards(optimizer, sharded, message if flattened else None)
        return config

    @contextlib.contextmanager
    def parameters_in_layers(self, wrapped: nn.Module,
                             optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[None]:
        """The user's module as it was built, between steps: each unit's module back in its
        parent's place, each full parameter FSDP took out of its layer (kept there as a plain
        attribute, its shard as ``_sharded_param``) back among the layer's parameters, and the
        optimizers' groups holding the full parameters instead of their shards. On leaving, each
        shard takes its full parameter's ``requires_grad`` (FSDP's backward reduces the gradient
        of a full parameter that requires one into its shard, and checks the shards' flags at the
        end of backward), and every group, new ones included, holds shards again (mapped as
        ``setup_optimizers`` maps them). No forward may run inside. Refused with
        ``flatten_parameters=True``: a unit's parameters are then one flat shard."""
        if wrapped is None or wrapped is not self._root:  # not wrapped (any more): the layers hold their own
            yield
            return
        if self.fsdp_kwargs.get("flatten_parameters", False):
            raise ValueError("Under xla_fsdp with flatten_parameters=True a unit's parameters are flattened into one "
                             "shard, so no layer can be frozen, unfrozen or given a parameter group of its own: set "
                             "XlaFSDP(flatten_parameters=False) (the default).")
        optimizers = list(optimizers)
        sharded = {id(p) for p in wrapped.parameters()}
        user_module = self.unwrap(wrapped).module
        fsdp = self._fsdp_class()
        units = [(parent, name, child) for parent in list(user_module.modules())
                 for name, child in parent._modules.items() if isinstance(child, fsdp)]
        try:
            for parent, name, child in units:
                parent._modules[name] = self.unwrap(child)
            with _full_parameters_in_place(user_module):
                full = {id(p._sharded_param): p for p in user_module.parameters() if hasattr(p, "_sharded_param")}
                _swap_in_groups(optimizers, full)
                try:
                    yield
                finally:
                    for param in full.values():
                        param._sharded_param.requires_grad_(param.requires_grad)
                    _swap_in_groups(optimizers, {id(p): p._sharded_param for p in full.values()})
        finally:
            for parent, name, child in units:
                parent._modules[name] = child
        for optimizer in optimizers:  # new groups too; a parameter that is not the module's refused
            _map_to_shards(optimizer, sharded, None)

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        inner = wrapped
        while hasattr(inner, "_fsdp_wrapped_module") or hasattr(inner, "_fpw_module"):
            inner = getattr(inner, "_fsdp_wrapped_module", None) or inner._fpw_module
        return inner

    # ---- the step ---------------------------------------------------------------------------
    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and not self.reduce_every_micro_batch:
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def clip_gradients(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer, value: float,
                       algorithm: str) -> None:
        if algorithm == "norm":
            wrapped.clip_grad_norm_(value)  # the norm over every rank's shards
        else:
            super().clip_gradients(wrapped, optimizer, value, algorithm)  # elementwise: shards suffice

    # ---- state ------------------------------------------------------------------------------
    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's shard of the parameters (keys as FSDP names them)."""
        return wrapped.state_dict()

    def full_module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter whole, named as in the user's module: this rank's shards, gathered from
        all ranks (a collective recorded in the graph), stitched by torch_xla's consolidation as
        if one rank had held them all. Tensors stay on the device."""
        shards, metadata = wrapped.state_dict(), wrapped.get_shard_metadata()
        if self.world_size > 1:
            shards = {name: _xla.all_gather(tensor) if _is_shard(name) else tensor for name, tensor in shards.items()}
            metadata = {**metadata, "world_size": 1}
        return consolidate_state_dicts([shards], metadata)

    @property
    def checkpoint_layout(self) -> FsdpShards:
        return FsdpShards(lambda: self._root.get_shard_metadata())

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        load_weights(wrapped, checkpoint["state_dict"])

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        """Give the user's module back unwrapped, with its full trained weights, on the CPU."""
        if failed and self.world_size > 1:
            return  # gathering the weights is a collective the other replicas may never join
        full = _xla.to_cpu(self.full_module_state_dict(wrapped))  # host sync: weights to the host
        for module, params, children, patched_before in self._saved_structure:
            for name in params:
                module.__dict__.pop(name, None)
            for name in _PATCHED_ATTRIBUTES - patched_before:  # FSDP's nn.Linear, checkpointing
                module.__dict__.pop(name, None)
            module._parameters.clear()
            module._parameters.update(params)
            module._modules.clear()
            module._modules.update(children)
        user_module = self.unwrap(wrapped).module
        fsdp = self._fsdp_class()
        for parent in list(user_module.modules()):  # units the user wrapped in configure_model()
            for name, child in list(parent._modules.items()):
                if isinstance(child, fsdp):
                    parent._modules[name] = self.unwrap(child)
        for prefix, module in user_module.named_modules():
            prefix = prefix + "." if prefix else ""
            for name, param in module._parameters.items():
                if param is not None:
                    module._parameters[name] = nn.Parameter(full[prefix + name], requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    key = prefix + name
                    # a non-persistent buffer is in no state dict: copy it as it is (a host sync)
                    module._buffers[name] = full[key] if key in full else buffer.to("cpu")
        self._saved_structure, self._root = [], None


class _CheckpointStatus(threading.local):
    """torch_xla's "inside a checkpoint's backward" flag, one per thread."""

    in_chkpt_bwd = False


_CHECKPOINT_STATUS = _CheckpointStatus()
_CHECKPOINT_STATUS_LOCK = threading.Lock()


def _checkpoint_status_per_thread() -> None:
    """Give torch_xla's activation checkpointing a per-thread ``chkpt_status``.

    torch_xla keeps one module-level flag, set while a checkpointed unit recomputes its forward in
    backward, and FSDP's pre-backward hook skips gathering a unit's parameters while it is set
    (``XlaFullyShardedDataParallel._pre_backward_hook``). The CPU runtime's replicas are threads
    of one process (``cpu_threads``): one replica's recompute then made another skip its gather
    and recompute against freed parameters ("Cannot infer shape for dot operation: f32[8,8] <dot>
    f32[1]") with any model at 2 or more replicas. One flag per thread keeps each replica's to
    itself; one process per device (a TPU host) behaves as before."""
    with _CHECKPOINT_STATUS_LOCK:
        _xla.set_checkpoint_status(_CHECKPOINT_STATUS)


@contextlib.contextmanager
def _full_parameters_in_place(root: nn.Module) -> Iterator[None]:
    """The full parameters FSDP took out of ``root``'s modules (keeping each as a plain
    attribute with its shard as ``_sharded_param``) put back into their modules' parameters for
    the duration, so that ``submodule.parameters()`` yields them."""
    added = []
    for m in root.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, nn.Parameter) and hasattr(value, "_sharded_param") and name not in m._parameters:
                m._parameters[name] = value
                added.append((m, name))
    try:
        yield
    finally:
        for m, name in added:
            m._parameters.pop(name, None)


def _swap_in_groups(optimizers: list[torch.optim.Optimizer], replacements: dict[int, torch.Tensor]) -> None:
    """Replace, in place, each parameter of the optimizers' groups that ``replacements`` names
    (by id) with its replacement (a shard with its full parameter, or back)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [replacements.get(id(p), p) for p in group["params"]]


def _map_to_shards(optimizer: torch.optim.Optimizer, sharded: set[int], flattened: str | None) -> None:
    """Replace, in place, each full parameter of ``optimizer``'s groups by its shard (before any
    step: the optimizer has no state yet, and schedulers keep pointing at the same optimizer)."""
    if not optimizer.param_groups or not any(group["params"] for group in optimizer.param_groups):
        raise ValueError(flattened or "Under xla_fsdp the optimizer got no parameters.")
    for group in optimizer.param_groups:
        mapped: list[torch.Tensor] = []
        for p in group["params"]:
            shard = p if id(p) in sharded else getattr(p, "_sharded_param", None)
            if shard is None or id(shard) not in sharded:
                raise ValueError(flattened or "Under xla_fsdp an optimizer holds a parameter that is not the module's "
                                 f"(shape {tuple(p.shape)}): build it from the module's parameters inside "
                                 "configure_optimizers().")
            if all(shard is not q for q in mapped):
                mapped.append(shard)
        group["params"] = mapped
    seen: set[int] = set()
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        if ids & seen:  # a unit's shards and its own layers' parameters, named in two groups
            raise ValueError("Under xla_fsdp two parameter groups of an optimizer hold the same parameter (a unit's "
                             "shard and a parameter of its layers): name each parameter in one group only.")
        seen |= ids


def _is_shard(name: str) -> bool:
    """Whether a key of an FSDP state dict names a parameter shard (not a buffer)."""
    return any(part.startswith("_fsdp_shard") for part in name.split("."))


def _optimizers_in(config: Any) -> Iterable[torch.optim.Optimizer]:
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, dict):
        return _optimizers_in(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        return [o for item in config for o in _optimizers_in(item)]
    return []
