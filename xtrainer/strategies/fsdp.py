"""``XlaFSDP``: torch_xla's ``XlaFullyShardedDataParallel`` (ZeRO-3 or ZeRO-2), sharded checkpoints."""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable, Iterable

import torch
from torch import nn

from xtrainer._lazy_xla import xla as _xla
from xtrainer.checkpoint.format import load_weights
from xtrainer.checkpoint.fsdp import FsdpShards, consolidate_state_dicts
from xtrainer.strategies.base import Strategy, check_wrapper_kwargs
from xtrainer.suggest import did_you_mean

#: Instance attributes FSDP and activation checkpointing patch onto the user's modules.
_PATCHED_ATTRIBUTES = frozenset({"forward", "_xla_checkpointed_forward_original",
                                 "_xla_checkpointed_forward_no_kwargs"})


class XlaFSDP(Strategy):
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

    def check_manual_optimization(self) -> None:
        raise NotImplementedError(
            "Manual optimization (automatic_optimization=False) is not supported under xla_fsdp: torch_xla's FSDP "
            "flattens the parameters of the module it wraps, so optimizers over parts of the module (a GAN's "
            "generator and discriminator) cannot be built. Use xla_fsdpv2 (SPMD FSDP, which shards parameters in "
            "place), xla_ddp or xla_native.")

    def setup_optimizers(self, module: nn.Module, configure: Callable[[], Any]) -> Any:
        """``configure_optimizers`` sees the sharded parameters through ``self.parameters()``."""
        user_module = self.unwrap(module).module
        user_module.parameters = module.parameters  # instance attribute shadows the method
        message = ("Under xla_fsdp the optimizer must be built from self.parameters() inside "
                   "configure_optimizers(): those are the sharded parameters. Parameters taken from "
                   "submodules (or named_parameters()) refer to the unsharded originals, which FSDP removed.")
        try:
            config = configure()
        except ValueError as err:
            if "empty parameter list" in str(err):
                raise ValueError(message) from err
            raise
        finally:
            del user_module.parameters
        sharded = {id(p) for p in module.parameters()}
        for optimizer in _optimizers_in(config):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if not params or any(id(p) not in sharded for p in params):
                raise ValueError(message)
        return config

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


#: ``auto_wrap_policy`` spelling for "the layer classes the model names in its ``_no_split_modules``"
#: (Hugging Face ``PreTrainedModel``s do: ``LlamaForCausalLM._no_split_modules == ["LlamaDecoderLayer"]``).
NO_SPLIT_MODULES = "no_split_modules"
#: The keys a mapping ``auto_wrap_policy`` may have (one of them), as a YAML file writes it.
_POLICY_KEYS = ("transformer_layer_cls", "min_num_params")
_POLICY_FORMS = ("give a parameter count (int), layer classes ({Block} or [Block] in Python; class names in YAML: "
                 "{transformer_layer_cls: [LlamaDecoderLayer]} or [LlamaDecoderLayer]), "
                 f"{NO_SPLIT_MODULES!r} (the classes the model names in _no_split_modules, as Hugging Face "
                 "models do), {min_num_params: N}, or a torch_xla wrap policy callable (in Python)")
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_wrap_policy(policy: Any) -> None:
    """Refuse a malformed ``auto_wrap_policy`` when the strategy is made (a config file's mistake
    is reported before anything is built). Class names are resolved later, against the module."""
    _policy_parts(policy)


def _policy_parts(policy: Any) -> tuple[str, Any]:
    """``("none" | "callable" | "size" | "classes" | "no_split", value)``: what ``policy`` asks for,
    with a parameter count as an int and layer classes as a list of classes and class names."""
    if policy is None:
        return "none", None
    if isinstance(policy, bool):
        raise TypeError(f"auto_wrap_policy={policy!r}: {_POLICY_FORMS}.")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"auto_wrap_policy={policy!r}: a parameter count is at least 1.")
        return "size", policy
    if isinstance(policy, str):
        if policy == NO_SPLIT_MODULES:
            return "no_split", None
        return "classes", [_checked_name(policy)]
    if isinstance(policy, type):
        return "classes", [_checked_class(policy)]
    if isinstance(policy, dict):
        if len(policy) != 1 or next(iter(policy)) not in _POLICY_KEYS:
            unknown = [str(k) for k in policy if k not in _POLICY_KEYS]
            hint = did_you_mean(unknown[0], _POLICY_KEYS) if unknown else ""
            raise ValueError(f"auto_wrap_policy={policy!r}: a mapping has one key, "
                             f"{' or '.join(map(repr, _POLICY_KEYS))}.{hint} {_POLICY_FORMS[0].upper()}{_POLICY_FORMS[1:]}.")
        key, value = next(iter(policy.items()))
        if key == "min_num_params":
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"auto_wrap_policy={policy!r}: min_num_params is a parameter count (int).")
            return _policy_parts(value)
        if value == NO_SPLIT_MODULES:
            return "no_split", None
        kind, classes = _policy_parts(value if isinstance(value, (list, tuple, set, frozenset)) else [value])
        return kind, classes
    if isinstance(policy, (set, frozenset, list, tuple)):
        if not policy:
            raise ValueError(f"auto_wrap_policy={policy!r} names no layer class: {_POLICY_FORMS}.")
        return "classes", [_checked_class(item) if isinstance(item, type) else _checked_name(item) for item in policy]
    if callable(policy):
        return "callable", policy
    raise TypeError(f"auto_wrap_policy={policy!r}: {_POLICY_FORMS}.")


def policy_kind(policy: Any) -> str:
    """What ``policy`` asks for: ``"none"``, ``"callable"``, ``"size"``, ``"classes"`` or
    ``"no_split"`` (refusing a malformed one)."""
    return _policy_parts(policy)[0]


def policy_layer_classes(policy: Any, module: nn.Module) -> set[type]:
    """The layer classes of ``module`` that a ``"classes"`` or ``"no_split"`` policy names (empty
    for the other kinds); the native FSDP strategy shards each such layer as a unit."""
    kind, value = _policy_parts(policy)
    if kind == "no_split":
        return no_split_classes(module)
    if kind == "classes":
        return layer_classes(module, value)
    return set()


def _checked_class(cls: type) -> type:
    if not issubclass(cls, nn.Module):
        raise TypeError(f"auto_wrap_policy names {cls!r}, which is not an nn.Module class.")
    return cls


def _checked_name(name: Any) -> str:
    """A layer class's name as given (``LlamaDecoderLayer``, or ``package.module.LlamaDecoderLayer``).
    It is only ever compared with the classes of the module's own submodules: nothing is imported."""
    if not isinstance(name, str):
        raise TypeError(f"auto_wrap_policy: {name!r} is neither a layer class nor a class name: {_POLICY_FORMS}.")
    if not _CLASS_NAME.fullmatch(name):
        raise ValueError(f"auto_wrap_policy: {name!r} is not a class name (such as LlamaDecoderLayer). Names are "
                         "matched against the classes of the model's own submodules; nothing is imported.")
    hint = did_you_mean(name, [NO_SPLIT_MODULES]) if name.islower() else ""
    if hint:  # a layer class is named in CamelCase; this is the keyword, mistyped
        raise ValueError(f"auto_wrap_policy: {name!r} is neither a layer class's name nor {NO_SPLIT_MODULES!r}.{hint}")
    return name


def wrap_policy(policy: Any, module: nn.Module | None = None) -> Callable | None:
    """A torch_xla auto-wrap policy from a parameter count, layer classes, class names,
    ``"no_split_modules"`` or a callable (see ``_POLICY_FORMS``). Class names, and those of
    ``_no_split_modules``, are resolved against the classes of ``module``'s submodules, by name
    (``LlamaDecoderLayer``) or by qualified name (``transformers.models.llama.modeling_llama.LlamaDecoderLayer``);
    a name is never imported."""
    kind, value = _policy_parts(policy)
    if kind in ("none", "callable"):
        return value
    if kind == "size":
        return _xla.fsdp_size_wrap_policy(value)
    if module is None:
        if not all(isinstance(item, type) for item in value or [None]):
            raise ValueError("auto_wrap_policy by class name needs the module to resolve the names against.")
        classes = set(value)
    elif kind == "no_split":
        classes = no_split_classes(module)
    else:
        classes = layer_classes(module, value)
    return _xla.fsdp_layer_wrap_policy(classes)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _user_module(module: nn.Module) -> nn.Module:
    """The user's module inside the Trainer's step dispatcher (for the messages)."""
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) else module


def layer_classes(module: nn.Module, names: list, from_no_split: bool = False) -> set[type]:
    """The classes of ``module``'s submodules that ``names`` (classes or class names) name.
    A name that matches none, or several classes of the same short name, is an error, except
    that with ``from_no_split`` names absent from the model are skipped (a model's
    ``_no_split_modules`` may name layers that this configuration of it does not build)."""
    present: dict[str, set[type]] = {}
    for sub in module.modules():
        cls = type(sub)
        present.setdefault(cls.__name__, set()).add(cls)
        present.setdefault(_qualified(cls), set()).add(cls)
    owner = type(_user_module(module)).__name__
    classes: set[type] = set()
    for name in names:
        if isinstance(name, type):
            classes.add(name)  # a class given in Python: wrapped where it occurs (as torch_xla's policy does)
            continue
        found = present.get(name, set())
        if len(found) > 1:
            raise ValueError(f"auto_wrap_policy names {name!r}, and {owner} has several classes of that name: "
                             f"{sorted(map(_qualified, found))}. Give the qualified name of the one to wrap.")
        if not found:
            if from_no_split:
                continue
            short = sorted({cls.__name__ for group in present.values() for cls in group
                            if cls.__module__.split('.')[0] not in ("torch", "torch_xla", "xtrainer")})
            raise ValueError(
                f"auto_wrap_policy names {name!r}, but no submodule of {owner} is of a class by that name "
                f"(names are matched against the model's own layer classes; nothing is imported)."
                f"{did_you_mean(name, short)} Layer classes in the model: {', '.join(short[:20]) or 'none of its own'}.")
        classes |= found
    return classes


def no_split_classes(module: nn.Module) -> set[type]:
    """The layer classes that the ``_no_split_modules`` of ``module`` and its submodules name (the
    Hugging Face convention for "keep each of these whole": the decoder layers)."""
    names: list[str] = []
    for sub in module.modules():
        declared = getattr(sub, "_no_split_modules", None)
        if isinstance(declared, str):
            declared = [declared]
        if isinstance(declared, (list, tuple, set, frozenset)):
            names += [name for name in sorted(declared) if isinstance(name, str) and name not in names]
    owner = type(_user_module(module)).__name__
    if not names:
        raise ValueError(
            f"auto_wrap_policy={NO_SPLIT_MODULES!r} wraps the layer classes a model names in its _no_split_modules "
            f"(Hugging Face PreTrainedModels do, e.g. LlamaForCausalLM: ['LlamaDecoderLayer']), but no submodule of "
            f"{owner} has a _no_split_modules (or it is empty). Name the layer classes instead: "
            "auto_wrap_policy: {transformer_layer_cls: [MyBlock]} (XlaFSDP(auto_wrap_policy={MyBlock}) in Python).")
    classes = layer_classes(module, names, from_no_split=True)
    if not classes:
        raise ValueError(f"auto_wrap_policy={NO_SPLIT_MODULES!r}: {owner}'s _no_split_modules names {names}, but no "
                         "submodule is of those classes. Name the layer classes instead: "
                         "auto_wrap_policy: {transformer_layer_cls: [MyBlock]}.")
    return classes


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
