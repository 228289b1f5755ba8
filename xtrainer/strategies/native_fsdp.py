"""``"native_fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``) over the processes of a native
run (the process group, the device and the launch as ``NativeSingle``'s, ``strategies/native.py``):
layers wrapped by class, optional activation checkpointing, sharded checkpoints through
``torch.distributed.checkpoint`` that resume at any world size, and the module given back whole
(FSDP2 taken off) when a fit ends.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

from xtrainer.checkpoint.distributed import (Distributed, DistributedEntry, DistributedPart, load_into,
                                            read_optimizer_state)
from xtrainer.checkpoint.format import check_fits, shapes_of
from xtrainer.strategies import dtensors
from xtrainer.strategies.native import AGREEMENT_SECONDS, NativeSingle
from xtrainer.strategies.parallel import ParallelStrategy, check_wrapper_kwargs


class NativeFSDP(NativeSingle, ParallelStrategy):
    """FSDP2: ``torch.distributed.fsdp.fully_shard`` on every layer the policy names, then on the
    whole module; parameters, gradients and optimizer state are sharded over the processes.

    Args:
        auto_wrap_policy: which layers become units of their own, as for ``XlaFSDP``: layer
            classes, their names, ``"auto"`` (a Hugging Face model's ``_no_split_modules``), or
            None (the whole module is one unit).
        activation_checkpointing: recompute each unit's activations in backward
            (``torch.utils.checkpoint``, non-reentrant).
        reshard_after_forward: FSDP2's choice (True: ZeRO-3; False: keep gathered until backward).
        compile, compile_kwargs, timeout_seconds, agreement_seconds: as ``NativeSingle``.
        **fsdp_kwargs: passed to ``fully_shard`` (``mp_policy``, ``offload_policy``...).
    """

    name = "native_fsdp"
    multi_process = True
    shards_parameters = True

    def __init__(self, auto_wrap_policy: Any = None, activation_checkpointing: bool = False,
                 reshard_after_forward: bool = True, compile: bool = False,
                 compile_kwargs: dict[str, Any] | None = None, timeout_seconds: float = 1800.0,
                 agreement_seconds: float = AGREEMENT_SECONDS, **fsdp_kwargs: Any) -> None:
        super().__init__(compile, compile_kwargs, timeout_seconds, agreement_seconds)
        from torch.distributed.fsdp import fully_shard

        from xtrainer.strategies.wrap_policies import policy_kind

        if policy_kind(auto_wrap_policy) in ("size", "callable"):
            raise ValueError(f"NativeFSDP(auto_wrap_policy={auto_wrap_policy!r}): FSDP2 shards the layers it is given; "
                             "name them by class ({Block}, 'Block', or 'no_split_modules'), not by a parameter count "
                             "or a torch_xla policy.")
        check_wrapper_kwargs(fully_shard, fsdp_kwargs, NativeFSDP, "fully_shard")
        self.auto_wrap_policy, self.activation_checkpointing = auto_wrap_policy, activation_checkpointing
        self.reshard_after_forward, self.fsdp_kwargs = reshard_after_forward, fsdp_kwargs
        self._manual = False
        self._root: nn.Module | None = None  # the module fully_shard made the root (several processes)

    def _wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from xtrainer.strategies.wrap_policies import policy_layer_classes

        classes = tuple(policy_layer_classes(self.auto_wrap_policy, module.module))
        units = [m for m in module.module.modules() if classes and isinstance(m, classes) and m is not module.module]
        if self.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            wrapped_ids = {id(m) for m in units}
            # Private API of torch (what its FSDP tutorials use): each unit's forward recomputed in backward.
            apply_activation_checkpointing(module.module, check_fn=lambda m: id(m) in wrapped_ids)
            units = [m for m in module.module.modules()
                     if type(m).__name__ == "CheckpointWrapper" and id(getattr(m, "_checkpoint_wrapped_module", None))
                     in wrapped_ids]
        if self.world_size == 1:
            return module  # nothing to shard over; checkpoints are still distributed folders
        kwargs = {"reshard_after_forward": self.reshard_after_forward, **self.fsdp_kwargs}
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)
        self._root = module
        return module

    def no_backward_sync(self, wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and hasattr(wrapped, "set_requires_gradient_sync"):  # sharded (more than one process)
            return _gradient_sync_off(wrapped)
        return contextlib.nullcontext()

    def setup_optimizers(self, module: nn.Module, configure: Callable[[], Any], manual: bool = False) -> Any:
        self._manual = manual
        return super().setup_optimizers(module, configure, manual)

    def manual_backward(self, wrapped: nn.Module, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """A backward pass of manual optimization. ``training_step`` runs inside the forward of the
        sharded root (the dispatcher), so FSDP2 never sees this backward on its own: the loss gets
        the root's pre-backward hook (what FSDP2's post-forward gives a forward's outputs), which
        reduce-scatters every gradient into its shard at the end of the backward and reshards the
        root's parameters; they are gathered again for the rest of ``training_step``."""
        state = _fsdp_state(wrapped)
        if state is None or not torch.is_grad_enabled():  # one process: nothing is sharded
            self.backward(loss, *args, **kwargs)
            return
        register = getattr(state, "_register_pre_backward_hook", None)  # private API of torch's FSDP2 (see above)
        if register is None:
            raise RuntimeError(f"Manual optimization under native_fsdp needs FSDP2's pre-backward hook, which torch "
                               f"{torch.__version__} does not have: use automatic optimization, or native_ddp.")
        loss = register(loss)
        self.backward(loss, *args, **kwargs)
        wrapped.unshard()  # an all-gather of the root's parameters, on the device

    def requires_grad_changed(self, wrapped: nn.Module) -> None:
        """FSDP2 gives its gathered parameters the ``requires_grad`` of their shards only when it
        gathers them. Under manual optimization the root's parameters stay gathered for the rest
        of ``training_step`` (regathered after each backward and step), so a toggle between a
        step and the next forward would not reach them: it is copied to every parameter that is
        gathered now. Uses FSDP2's private per-parameter records (``_fsdp_param_group``), where
        torch has them; without them the next gathering copies it, as FSDP2 does."""
        for module in wrapped.modules():
            group = getattr(_fsdp_state(module), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", ()):
                gathered = getattr(fsdp_param, "_unsharded_param", None)
                wanted = fsdp_param.sharded_param.requires_grad
                if gathered is not None and gathered.requires_grad != wanted:
                    gathered.requires_grad_(wanted)

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        """Under manual optimization the step runs inside ``training_step``: the root's
        parameters, gathered before it, are gathered again so the rest of the step sees the
        stepped weights (units gather their own in their forward)."""
        super().optimizer_step(optimizer, before_step)
        root = self._root
        if self._manual and root is not None and _fsdp_state(root) is not None:
            root.reshard()
            root.unshard()  # an all-gather on the device, no host sync

    # ---- checkpoints: sharded, through torch.distributed.checkpoint -----------------------
    @property
    def checkpoint_layout(self) -> Distributed:
        """Folders through ``torch.distributed.checkpoint``: each process writes its own shards;
        any number of processes resumes them (DCP reshards on load); a whole file loads too."""
        return Distributed(spmd=False)

    def module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        return self.unwrap(wrapped).module.state_dict()  # DTensors: each process its shards

    def full_module_state_dict(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        """The whole weights on every process: each shard gathered (a collective of all processes)."""
        return {name: dtensors.full(tensor) for name, tensor in self.module_state_dict(wrapped).items()}

    def load_module_state_dict(self, wrapped: nn.Module, checkpoint: dict[str, Any]) -> None:
        module = self.unwrap(wrapped).module
        live = module.state_dict()
        state = checkpoint["state_dict"]
        if isinstance(state, DistributedPart):
            check_fits(live, {entry.where[0]: entry.shape for entry in state.entries})
            target = {"state_dict": live}
            load_into(target, state.path, spmd=False)  # into the live shards, in place
            return
        check_fits(live, shapes_of(state))
        module.load_state_dict({name: dtensors.shard_like(live[name], value) for name, value in state.items()})

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Any) -> None:
        """From a distributed checkpoint each process reads its shards of the saved state (at any
        world size); from a whole file each state tensor is sharded as its parameter is."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if isinstance(state, DistributedPart):
            state = read_optimizer_state(state, params, _empty_like_saved, spmd=False)
        else:
            state = {**state, "state": {index: {key: dtensors.shard_like(params[int(index)], value)
                                                if isinstance(value, torch.Tensor) else value
                                                for key, value in values.items()}
                                        for index, values in state.get("state", {}).items()}}
        optimizer.load_state_dict(state)

    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        """The user's module back as it was given, with the whole trained weights: FSDP2's
        sharding and activation-checkpointing wrappers taken off, so that after a fit under
        torchrun (where the module stays in the process) it runs forward on its own, saves plain
        tensors under its own names, and a later ``validate``/``test`` shards it afresh. Gathering
        the weights is a collective: every process tears down at the same point."""
        self._root, self._manual = None, False
        if failed and self.world_size > 1:
            return  # as the base: this process's copy is discarded, and a peer may be gone
        _unshard_for_good(wrapped)
        _unwrap_checkpointing(self.unwrap(wrapped).module)
        super().teardown(wrapped, failed)


def _unshard_for_good(root: nn.Module) -> None:
    """Undo ``fully_shard`` on ``root`` and every module under it: each sharded parameter replaced
    by a plain one holding the whole tensor (gathered in the same order on every process; shared
    parameters stay shared), FSDP2's forward and state-dict hooks, state and class removed (the
    module pickles again, for the processes of a later stage). torch has no public
    way back (tested with torch 2.9 and 2.13): the internals used are named here, and a torch that
    moved them gets the module with its whole weights and a warning."""
    from torch.distributed.fsdp import FSDPModule

    whole: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if dtensors.is_dtensor(param):
                if id(param) not in whole:
                    whole[id(param)] = nn.Parameter(param.full_tensor().detach(), requires_grad=param.requires_grad)
                setattr(module, name, whole[id(param)])
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            from torch.distributed import _composable_state

            contract = importlib.import_module("torch.distributed._composable.contract")  # the package exports a function of that name

            state = module._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            for key in (contract.STATE_KEY, contract.REGISTRY_KEY):
                entries = module.__dict__.get(key)
                if isinstance(entries, dict):
                    for name in [k for k in entries if getattr(k, "__name__", k) == "fully_shard"]:
                        del entries[name]
            _composable_state._module_state_mapping.pop(module, None)
            module.__class__ = next(base for base in type(module).__bases__ if not issubclass(base, FSDPModule))
        except (AttributeError, ImportError, StopIteration) as err:
            warnings.warn(f"native_fsdp: the module keeps FSDP2's hooks after the fit ({err}); its weights are "
                          "whole. Run it through trainer.validate/test, or rebuild it and load its state_dict.",
                          stacklevel=2)
            return
    for module in root.modules():
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(attr, None)
        # FSDP2's state-dict hooks, on the modules that held its parameters (local functions of
        # its own: the module would not pickle for a later stage's processes)
        for attr in ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks"):
            hooks = getattr(module, attr, None)
            for key, hook in list(hooks.items()) if isinstance(hooks, dict) else ():
                if getattr(getattr(hook, "hook", hook), "__module__", "").startswith("torch.distributed.fsdp"):
                    del hooks[key]


def _unwrap_checkpointing(module: nn.Module) -> None:
    """Take the activation-checkpointing wrappers (``CheckpointWrapper``) out of ``module``: each
    wrapped layer back in its place, under its own name."""
    for parent in module.modules():
        for name, child in list(parent.named_children()):
            inner = getattr(child, "_checkpoint_wrapped_module", None)
            if type(child).__name__ == "CheckpointWrapper" and isinstance(inner, nn.Module):
                setattr(parent, name, inner)


@contextlib.contextmanager
def _gradient_sync_off(wrapped: nn.Module) -> Iterator[None]:
    """FSDP2 without reduce-scattering gradients (accumulating micro-batches)."""
    wrapped.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


def _fsdp_state(module: nn.Module) -> Any:
    """FSDP2's state of ``module`` if ``fully_shard`` sharded it, else None."""
    get = getattr(module, "_get_fsdp_state", None)  # FSDPModule's (torch's FSDP2)
    return get() if callable(get) else None


def _empty_like_saved(param: torch.Tensor, entry: DistributedEntry) -> torch.Tensor:
    """A tensor for a saved optimizer value to be read into: sharded as ``param`` if it has the
    parameter's shape, else a plain one (scalars such as Adam's ``step``)."""
    if entry.shape == tuple(param.shape) and dtensors.is_dtensor(param):
        return dtensors.shard_like(param, torch.zeros(entry.shape, dtype=entry.dtype))
    return torch.zeros(entry.shape, dtype=entry.dtype)
