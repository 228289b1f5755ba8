"""Naming classes in a configuration: each ``_target_`` is checked against the type its place
expects (``place``), imported only as far as its name needs (``locate``), its arguments checked
against the class's signature and each nested ``_target_`` against the annotation of the
parameter it fills (``resolve_target``); nothing is built until ``Target.build``."""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from xtrainer.config.schema import TARGET, ConfigError, one_line, type_name
from xtrainer.suggest import did_you_mean

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_LOADER_HOOKS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")
#: Annotations that say nothing about a class: a parameter annotated with one takes no `_target_`.
_NOT_CLASSES = ("builtins", "typing", "typing_extensions", "collections.abc", "abc", "_collections_abc")
#: A list or tuple annotation's elements may be `_target_`s of the element type.
_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.MutableSequence,
              collections.abc.Iterable, collections.abc.Collection)


@dataclass(frozen=True)
class Expected:
    """What one place of a configuration takes: a subclass of one of ``bases`` (for ``data``, also
    a class with ``*_dataloader()`` methods); ``text`` says it in messages."""

    bases: tuple[type, ...]
    text: str
    loader_methods: bool = False

    def accepts(self, cls: type) -> bool:
        if issubclass(cls, self.bases):
            return True
        return self.loader_methods and any(callable(inspect.getattr_static(cls, h, None)) for h in _LOADER_HOOKS)

    def holds_standard_library_classes(self) -> bool:
        return any(_standard_library(base.__module__) for base in self.bases)


def place(name: str) -> Expected:
    """The type each top-level place expects: ``model``, ``data``, ``callbacks``, ``logger`` or
    ``strategy``. (Imports only that place's base class.)"""
    if name == "model":
        from xtrainer.module import XModule

        return Expected((XModule,), "an XModule subclass (your model, e.g. mypackage.models.Classifier)")
    if name == "data":
        from xtrainer.datamodule import XDataModule

        return Expected((XDataModule,), "an XDataModule subclass or a class with *_dataloader() methods "
                                        "(e.g. mypackage.data.Digits)", loader_methods=True)
    if name == "callbacks":
        from xtrainer.callbacks import Callback

        return Expected((Callback,), "a Callback subclass (e.g. xtrainer.callbacks.EarlyStopping)")
    if name == "logger":
        from xtrainer.loggers import Logger

        return Expected((Logger,), "a Logger subclass (e.g. xtrainer.loggers.CSVLogger)")
    if name == "strategy":
        from xtrainer.strategies import Strategy

        return Expected((Strategy,), "a Strategy subclass (or a strategy's name, e.g. strategy: xla_ddp)")
    raise ValueError(f"no place {name!r}: model, data, callbacks, logger or strategy")


def _standard_library(module_name: Any) -> bool:
    return isinstance(module_name, str) and module_name.split(".")[0] in sys.stdlib_module_names


def _qualified(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


_name = _qualified


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "a module"
    if inspect.isbuiltin(obj):
        return "a builtin function"
    if inspect.ismethod(obj) or inspect.ismethoddescriptor(obj):
        return "a method"
    if inspect.isfunction(obj):
        return "a function"
    return f"a {type(obj).__name__} object"


def _refused(key: str, dotted: Any, expected: Expected, why: str) -> ConfigError:
    return ConfigError(f"{key}={dotted!r} is refused: a {TARGET} names a class of the type its place expects, "
                       f"here {expected.text}; {why}.")


def check_name(dotted: Any, where: str) -> None:
    """Refuse a ``_target_`` that is not of the form ``package.module.Class``, before anything is imported."""
    key = f"{where}.{TARGET}"
    if not isinstance(dotted, str) or not _DOTTED.fullmatch(dotted):
        raise ConfigError(f"{key}={dotted!r} is not a dotted class name: a {TARGET} names a class "
                          "(e.g. mypackage.models.Classifier).")
    if any(part.startswith("__") for part in dotted.split(".")):
        raise ConfigError(f"{key}={dotted!r}: names with '__' parts are refused: a {TARGET} names a class "
                          "(e.g. mypackage.models.Classifier).")


def locate(dotted: Any, where: str, expected: Expected) -> type:
    """The class ``dotted`` names, if it is one ``expected`` accepts; a ``ConfigError`` otherwise.

    The name's form is checked first; then its modules are imported one by one, only as far as
    the name needs; every part after the module is a class (a nested class), never a function, a
    method or a module reached through another module's attribute. A standard-library module is
    not imported for a place whose type it cannot hold (none holds an ``XModule``, a ``Callback``
    ...), and never imported on a configuration's behalf at all: only one already imported is used."""
    check_name(dotted, where)
    key = f"{where}.{TARGET}"
    parts = dotted.split(".")
    if _standard_library(parts[0]) and (not expected.holds_standard_library_classes()
                                         or parts[0] not in sys.modules):
        raise _refused(key, dotted, expected, f"{parts[0]} is in Python's standard library, which holds none "
                                              "(it was not imported)")
    obj: Any = _import(parts[0], key, dotted)
    for i, part in enumerate(parts[1:], start=1):
        here = ".".join(parts[:i])
        if inspect.ismodule(obj):
            if hasattr(obj, part):
                found = getattr(obj, part)
                if inspect.ismodule(found) and found.__name__ != f"{obj.__name__}.{part}":
                    raise _refused(key, dotted, expected, f"{here}.{part} is the module {found.__name__}, reached "
                                                          f"through {here}: name the class where it lives")
            elif hasattr(obj, "__path__"):  # a package: its submodule, if it has one
                found = _import(f"{obj.__name__}.{part}", key, dotted, missing=f"module {here} has no attribute "
                                                                                f"{part!r}")
            else:
                raise ConfigError(f"{key}={dotted!r}: module {here} has no attribute {part!r}.")
        elif inspect.isclass(obj):
            found = inspect.getattr_static(obj, part, _MISSING_ATTR)  # runs no descriptor
            if found is _MISSING_ATTR:
                raise ConfigError(f"{key}={dotted!r}: class {here} has no attribute {part!r}.")
        else:
            raise _refused(key, dotted, expected, f"{here} is {_kind(obj)}, not a module or a class")
        obj = found
    if not inspect.isclass(obj):
        raise _refused(key, dotted, expected, f"{dotted} is {_kind(obj)}, not a class")
    if not expected.accepts(obj):
        raise _refused(key, dotted, expected, f"{dotted} is not one")
    return obj


_MISSING_ATTR = object()


def _import(module_name: str, key: str, dotted: str, missing: Optional[str] = None) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            if missing is not None:
                raise ConfigError(f"{key}={dotted!r}: {missing}.") from None
            raise ConfigError(f"{key}={dotted!r}: no module {module_name!r} can be imported (run from the folder "
                              "that holds it, or install its package).") from None
        raise ConfigError(f"{key}={dotted!r}: importing {module_name} failed, because it imports {err.name!r}, "
                          "which is not installed.") from None
    except ImportError as err:
        raise ConfigError(f"{key}={dotted!r}: importing {module_name} failed: {one_line(err)}") from None


@dataclass
class Target:
    """A checked ``{_target_: package.Class, **arguments}``: the class, its arguments (a nested
    ``_target_`` as a ``Target`` in its place, also inside lists) and where it is in the
    configuration. Nothing is built until ``build()``."""

    cls: type
    kwargs: Dict[str, Any]
    where: str

    def build(self) -> Any:
        """The nested targets first, then ``cls(**kwargs)``; a ``TypeError`` or ``ValueError`` from
        a constructor is a ``ConfigError`` naming the place."""
        kwargs = {k: _built(v) for k, v in self.kwargs.items()}
        try:
            return self.cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{self.where}: {one_line(err)}") from None

    def is_own(self) -> bool:
        """Whether this class and every nested one are xtrainer's own (their constructors only
        check and store their arguments: folders are created when a run starts)."""
        return self.cls.__module__.split(".")[0] == "xtrainer" and all(t.is_own() for t in _nested(self.kwargs))


def _built(value: Any) -> Any:
    if isinstance(value, Target):
        return value.build()
    if isinstance(value, list):
        return [_built(v) for v in value]
    return value


def _nested(value: Any) -> Any:
    if isinstance(value, Target):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _nested(v)
    elif isinstance(value, list):
        for v in value:
            yield from _nested(v)


def resolve_target(spec: Any, where: str, expected: Expected) -> Target:
    """``{_target_: dotted.Class, **kwargs}`` checked: the class against ``expected``, its
    arguments against its signature (names, required ones, simple types), and each nested
    ``_target_`` against the annotation of the parameter it fills. Nothing is constructed."""
    if not isinstance(spec, dict) or TARGET not in spec:
        raise ConfigError(f"{where} needs a {TARGET} (e.g. {where}: {{{TARGET}: mypackage.Thing, ...}}).")
    cls = locate(spec[TARGET], where, expected)
    return Target(cls, check_arguments(cls, {k: v for k, v in spec.items() if k != TARGET}, where), where)


def instantiate(spec: Any, where: str, base: type) -> Any:
    """``resolve_target`` against ``base``, then built: for schemas of your own (``load_config``)."""
    return resolve_target(spec, where, Expected((base,), f"a {_qualified(base)} subclass")).build()


def check_arguments(cls: type, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``kwargs`` for the class ``cls``, checked against its signature before it is called (the
    names, the required arguments, simple types), so that a mistake is a message naming the key;
    nested ``_target_``s resolved (``resolve_target``) against the parameters' annotations."""
    try:
        signature: Optional[inspect.Signature] = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        params = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in kwargs:
            if key not in params and not takes_any:
                raise ConfigError(f"Unknown key '{where}.{key}': {_name(cls)} takes {', '.join(named) or 'nothing'}."
                                  + did_you_mean(str(key), named))
        for name in named:
            if params[name].default is inspect.Parameter.empty and name not in kwargs:
                raise ConfigError(f"{where}.{name} is required by {_name(cls)} and has no value: "
                                  f"set {where}.{name}=...")
    hints = _hints(cls, signature)
    return {key: _argument(value, hints.get(key), f"{where}.{key}", cls, key) for key, value in kwargs.items()}


def _argument(value: Any, annotation: Any, where: str, owner: type, name: Any) -> Any:
    if isinstance(value, dict) and TARGET in value:
        expected = _annotated(annotation)
        if expected is None:
            raise _no_class_annotation(value, annotation, where, owner, name)
        return resolve_target(value, where, expected)
    if isinstance(value, list) and any(_holds_target(v) for v in value):
        element = _element(annotation)
        if element is None:
            i = next(i for i, v in enumerate(value) if _holds_target(v))
            raise _no_class_annotation(value[i], annotation, f"{where}[{i}]", owner, name)
        return [_argument(v, element, f"{where}[{i}]", owner, name) for i, v in enumerate(value)]
    if _holds_target(value):
        inner, dotted = next(targets_in(value, where))
        raise ConfigError(f"{inner}.{TARGET}={dotted!r} is refused: a {TARGET} fills a parameter whose annotation "
                          f"names a class, not a key inside the plain data {where} holds: make it an argument of "
                          f"its own, or build the object in {owner.__qualname__}.__init__.")
    if annotation is not None and not _fits(value, annotation):
        raise ConfigError(f"{where}={value!r} is not a valid {type_name(annotation)} (an argument of {_name(owner)}).")
    return value


def _no_class_annotation(spec: Any, annotation: Any, where: str, owner: type, name: Any) -> ConfigError:
    dotted = spec.get(TARGET) if isinstance(spec, dict) else spec
    shown = "none" if annotation is None else type_name(annotation)
    return ConfigError(f"{where}.{TARGET}={dotted!r} is refused: the parameter {name!r} of {_name(owner)} has no class "
                       f"annotation (it has {shown}), so nothing says which classes it takes: annotate it with the "
                       f"class it takes (e.g. {name}: torch.nn.Module), or build the object in "
                       f"{owner.__qualname__}.__init__.")


def _holds_target(value: Any) -> bool:
    return next(targets_in(value, ""), None) is not None


def _annotated(annotation: Any) -> Optional[Expected]:
    """The ``Expected`` of a parameter's annotation: its classes (a class, ``Optional`` or a
    union of classes); None when it names none (missing, ``Any``, ``object``, a builtin type,
    a protocol)."""
    classes = _classes(annotation)
    if not classes:
        return None
    return Expected(tuple(classes), " or ".join(f"a {_qualified(c)}" for c in classes)
                    + " (the annotation of the parameter it fills)")


def _members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _classes(annotation: Any) -> list[type]:
    return [m for m in _members(annotation)
            if inspect.isclass(m) and typing.get_origin(m) is None and m is not object
            and m.__module__ not in _NOT_CLASSES and not getattr(m, "_is_protocol", False)]


def _element(annotation: Any) -> Any:
    """The element annotation of a list or tuple annotation (``list[Callback]``, ``Sequence[X] | X``)."""
    elements = []
    for member in _members(annotation):
        if typing.get_origin(member) in _SEQUENCES:
            elements += [a for a in typing.get_args(member) if a is not Ellipsis]
    return Union[tuple(elements)] if elements else None


def targets_in(node: Any, where: str) -> Any:
    """``(key, value)`` of every ``_target_`` in ``node``, however deep."""
    if isinstance(node, dict):
        if TARGET in node:
            yield where, node[TARGET]
        for k, v in node.items():
            if k != TARGET:
                yield from targets_in(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from targets_in(v, f"{where}[{i}]")


def _hints(cls: Any, signature: Optional[inspect.Signature]) -> dict[str, Any]:
    """The evaluated annotations of ``cls``'s constructor; one that does not evaluate counts as
    none (so it takes no ``_target_``)."""
    try:
        return typing.get_type_hints(cls.__init__ if inspect.isclass(cls) else cls)
    except Exception:  # noqa: BLE001 - e.g. a name imported only under TYPE_CHECKING
        if signature is None:
            return {}
        return {n: p.annotation for n, p in signature.parameters.items()
                if p.annotation is not inspect.Parameter.empty and not isinstance(p.annotation, str)}


def _fits(value: Any, expected: Any) -> bool:
    """Whether ``value`` fits a simple annotation; anything this does not understand fits."""
    if expected is Any:
        return True
    origin = typing.get_origin(expected)
    if origin is Union or origin is types.UnionType:
        return any(_fits(value, a) for a in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected in (str, bool):
        return isinstance(value, expected)
    return True


# --------------------------------------------------------------------------------------------
