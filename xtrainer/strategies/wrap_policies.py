"""FSDP auto-wrap policies: which submodules become FSDP units of their own.

One parser for every FSDP strategy: ``xla_fsdp`` (``strategies/xla_fsdp.py``) and ``xla_fsdpv2``
(``strategies/xla_spmd.py``) turn a policy into torch_xla's wrap policy (``wrap_policy``); the native
FSDP2 strategy (``strategies/native_fsdp.py``) asks which kind it is (``policy_kind``) and which
layer classes it names (``policy_layer_classes``). Accepted forms: a parameter count (int), layer
classes or class names (a set, list or tuple; ``{"transformer_layer_cls": [...]}`` as a YAML file
writes it), ``"no_split_modules"`` (the classes a Hugging Face model names in its
``_no_split_modules``), ``{"min_num_params": N}``, or a torch_xla wrap policy callable. A
malformed policy is refused when the strategy is made (``check_wrap_policy``); class names are
resolved later, against the classes of the module's own submodules, and never imported.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from torch import nn

from xtrainer._lazy_xla import xla as _xla
from xtrainer.suggest import did_you_mean


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
