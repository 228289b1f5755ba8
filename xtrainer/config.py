"""Configuration: a typed schema filled from YAML files and ``key=value`` overrides (OmegaConf).

A run is described by ``RunConfig``::

    seed: 0
    model:    {_target_: mypkg.models.Classifier, hidden: 256}     # the XModule and its arguments
    data:     {_target_: mypkg.data.Digits, batch_size: 64}        # optional: *_dataloader() methods
    strategy: xla_fsdp                 # or {name: xla_fsdp, reshard_after_forward: false}
    callbacks: [{_target_: xtrainer.callbacks.EarlyStopping, monitor: val_loss}]
    trainer:  {max_epochs: 8, devices: 4}                          # every other Trainer argument
    ckpt_path: null                    # or "last", or a checkpoint's path

Sources merge in order: the schema's defaults, each ``--config`` file, then ``key=value`` items.
Interpolations (``${model.hidden}``) and environment variables (``${oc.env:DATA_DIR}``) resolve
as in OmegaConf. ``load`` returns plain dataclasses and ``build`` turns them into a ``Trainer``,
a module and data, so nothing below the entry point sees an OmegaConf object. Every mistake
raises ``ConfigError`` with a message naming the key (and, for an unknown key, the closest valid
one) before anything trains.

``_target_`` is resolved by a small resolver over ``importlib`` (not Hydra, not jsonargparse): a
configuration is checked whole before anything in it is built (``plan``), and only then built
(``build``). Every ``_target_`` names a class, never a function, a method or a builtin, and the
class must be of the type its place expects: ``model`` an ``XModule`` subclass, ``data`` an
``XDataModule`` subclass or a class with ``*_dataloader()`` methods, ``trainer.callbacks`` a
``Callback``, ``trainer.logger`` a ``Logger``, ``trainer.strategy`` a ``Strategy`` (or a
strategy's name); a ``_target_`` inside arguments must fit the annotation of the parameter it
fills (a class, ``Optional`` or a union of classes, or a list of them), and a parameter without
one (none, ``Any``, ``object``, a builtin type) takes none. A ``_target_`` anywhere else is
refused. The arguments are checked against the class's signature too. So a configuration (or a
run's saved ``config.yaml`` edited by someone else) cannot call ``os.system``, ``subprocess.Popen``
or ``numpy.memmap``: they are not of the type of any place.

What remains, and is trusted: importing a module named in a configuration runs that module's
top-level code. Names are checked for their form first, modules are imported only as far as a
name needs, and no standard-library module is imported on a configuration's behalf (some run
code when imported); a module of your own (from the current folder or an installed package) is
your code. A class of the right type runs its own constructor with the configuration's
arguments: a logger or ``ModelCheckpoint`` writes where its ``save_dir``/``dirpath`` says, so
read the paths of a configuration you did not write. ``xtrainer config`` builds none of your
classes, only xtrainer's own (which create no file or folder until a run starts).

Hostile YAML is refused in one line before it is built: nesting deeper than ``MAX_DEPTH``,
anchors and aliases that expand to more than ``MAX_NODES`` values, integers beyond 64 bits, a
top level that is not a mapping. Secrets (``${oc.env:WANDB_API_KEY}``, a key named ``api_token``)
reach the run but are written as ``"***"`` in ``config.yaml`` (``xtrainer.redaction``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import inspect
import io
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, TypeVar, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from xtrainer.settings import TrainerSettings
from xtrainer.suggest import did_you_mean

T = TypeVar("T")
CONFIG_FILE = "config.yaml"
TARGET = "_target_"


class ConfigError(ValueError):
    """A configuration that cannot run: the message says which key and what to do."""


@dataclass
class TrainerConfig(TrainerSettings):
    """The ``Trainer``'s arguments as a config file sets them, laid out as ``Trainer(...)`` takes
    them (as LightningCLI does): ``TrainerSettings`` (the same dataclass ``Trainer.__init__``
    reads), plus ``strategy`` (a name, or ``{name: ..., <option>: ...}``), ``callbacks`` (a list of
    ``{_target_: ...}``) and ``logger`` (true, false, a ``{_target_: ...}`` or a list of them)."""

    strategy: Any = None
    callbacks: Optional[List[Any]] = None
    logger: Any = True


@dataclass
class RunConfig:
    """Everything ``xtrainer fit|validate|test|predict`` needs."""

    model: Dict[str, Any] = MISSING
    data: Optional[Dict[str, Any]] = None
    strategy: Any = None  # also accepted here, outside ``trainer`` (one of the two places)
    callbacks: Optional[List[Any]] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: Optional[int] = None
    ckpt_path: Optional[str] = None


def trainer_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """``Trainer(**trainer_kwargs(cfg.trainer))`` for the plain settings (no ``strategy``,
    ``callbacks`` or ``logger``: ``build`` makes those objects)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("strategy", "callbacks", "logger")}


def _one_place(config: "RunConfig", key: str) -> tuple[Any, str]:
    """``trainer.<key>`` or the top-level ``<key>``; both set is refused."""
    inner, outer = getattr(config.trainer, key), getattr(config, key)
    if inner is not None and outer is not None:
        raise ConfigError(f"Both {key} and trainer.{key} are set; keep trainer.{key} (it mirrors Trainer({key}=...)).")
    return (inner, f"trainer.{key}") if inner is not None else (outer, key)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def split_argv(argv: Sequence[str], schema: Any = RunConfig) -> tuple[list[str], list[str]]:
    """``--config FILE`` paths and ``key=value`` overrides, in the order given."""
    argv = list(argv)
    files, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML file after it.")
            files.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ConfigError(f"Unexpected argument {arg!r}: give --config FILE.yaml and key=value overrides "
                              f"(keys: {', '.join(_keys(schema))}).")
        i += 1
    return files, overrides


def load_config(schema: type[T], argv: Sequence[str] = ()) -> T:
    """An instance of the dataclass ``schema`` from ``--config FILE.yaml`` items and ``a.b=value``
    overrides: the schema's defaults, then each file in order, then the overrides in order."""
    files, overrides = split_argv(argv, schema)
    return _to_object(schema, _merged(schema, files, overrides))


def load(argv: Sequence[str] = ()) -> RunConfig:
    """The ``RunConfig`` of ``xtrainer fit --config run.yaml key=value ...`` (same arguments)."""
    return load_config(RunConfig, argv)


def _merged(schema: Any, files: list[str], overrides: list[str]) -> DictConfig:
    config = OmegaConf.structured(schema)
    try:
        for path in files:
            if not os.path.exists(path):
                raise ConfigError(f"Config file {path!r} does not exist.")
            config = OmegaConf.merge(config, _read_yaml(path))
        return OmegaConf.merge(config, _parse_overrides(overrides))
    except OmegaConfBaseException as err:
        raise _explain(err, schema) from None
    except TypeError as err:  # e.g. a file that holds a list where the schema is a mapping
        raise ConfigError(f"Invalid configuration: {_one_line(err)} (a config file holds a mapping of keys, "
                          f"e.g. model: {{{TARGET}: ...}}).") from None


def _read_yaml(path: str) -> Any:
    """``OmegaConf.load(path)`` (a safe YAML loader) after ``check_yaml``, with its errors as
    one-line ``ConfigError``s; a top level that is not a mapping is refused."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"Config file {path!r} cannot be read: {getattr(err, 'strerror', None) or err}.") from None
    try:
        top = check_yaml(text, f"Config file {path!r}")
    except yaml.YAMLError:
        top = None  # said below, by the loader itself
    if top not in (None, "mapping"):
        raise ConfigError(f"Config file {path!r} holds a {top} at its top level: a config file holds a mapping "
                          f"of keys, e.g. model: {{{TARGET}: ...}}.")
    try:
        return OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path!r}{_yaml_position(err)}: {_yaml_problem(err)}") from None


#: Limits on a YAML text (a configuration is a few levels of mappings and lists): deeper nesting
#: would exhaust Python's recursion in the loader, and aliases of aliases ("billion laughs")
#: would expand to more values than memory holds. Integers fit in 64 bits, as everything that
#: reads them (torch, the Trainer's counters) needs.
MAX_DEPTH = 64
MAX_NODES = 100_000
_INTEGER = re.compile(r"[-+]?(?:0x[0-9a-fA-F_]+|0o[0-7_]+|0b[01_]+|[0-9][0-9_]*)")


def check_yaml(text: str, source: str) -> Optional[str]:
    """Refuse ``text`` (a ``ConfigError`` that starts with ``source``) if it nests deeper than
    ``MAX_DEPTH``, if its aliases expand to more than ``MAX_NODES`` values or if it holds an
    integer beyond 64 bits. It is read as a stream of parser events, which neither recurses nor
    expands aliases. Returns the kind of its top-level node ("mapping", "list", "value"; None
    when empty). YAML syntax errors are ``yaml.YAMLError``s, as from the loader."""
    depth, top, total = 0, None, 0
    sizes: dict[str, int] = {}  # each anchor's expanded size
    open_nodes: list[list[Any]] = []  # [size so far, anchor] of each open collection

    def refuse(event: Any, problem: str) -> ConfigError:
        mark = event.start_mark
        return ConfigError(f"{source}, line {mark.line + 1}, column {mark.column + 1}: {problem}")

    def add(size: int, event: Any) -> None:
        nonlocal total
        total += size
        if total > MAX_NODES:
            raise refuse(event, f"its anchors and aliases expand to more than {MAX_NODES:,} values; a configuration "
                                "repeats a block with an alias, it does not nest aliases of aliases.")
        if open_nodes:
            open_nodes[-1][0] += size

    for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        if top is None and isinstance(event, yaml.NodeEvent):
            top = {yaml.MappingStartEvent: "mapping", yaml.SequenceStartEvent: "list"}.get(type(event), "value")
            if isinstance(event, yaml.ScalarEvent) and not event.style and event.value in ("", "~", "null"):
                top = None
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise refuse(event, f"nested more than {MAX_DEPTH} levels deep; a configuration is a few levels of "
                                    "mappings and lists.")
            add(1, event)  # the collection itself
            open_nodes.append([1, event.anchor])
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
            size, anchor = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = size
            if open_nodes:  # counted in the total already, value by value
                open_nodes[-1][0] += size - 1
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            if not event.style and _INTEGER.fullmatch(event.value) and _too_big(event.value):
                shown = event.value if len(event.value) <= 24 else f"{event.value[:12]}...{event.value[-6:]}"
                raise refuse(event, f"the integer {shown} ({len(event.value)} characters) does not fit in 64 bits.")
            add(1, event)
        elif isinstance(event, yaml.AliasEvent):
            add(sizes.get(event.anchor, 1), event)
    return top


def _too_big(literal: str) -> bool:
    if len(literal) > 100:
        return True
    try:
        value = int(literal.replace("_", ""), 0)
    except ValueError:  # e.g. 0123, which YAML 1.1 reads as octal
        return False
    return not -2**63 <= value < 2**64


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        try:
            check_yaml(item.split("=", 1)[1], repr(item))
        except yaml.YAMLError:
            pass  # said below, by the loader, with the item it is in
    try:
        return OmegaConf.from_dotlist(overrides)
    except yaml.YAMLError:
        for item in overrides:  # name the item that does not parse
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as item_err:
                err = item_err
                break
        else:
            item = " ".join(overrides)
        raise ConfigError(f"{item!r}: {_yaml_problem(err)}") from None


def _yaml_position(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _yaml_problem(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None) or str(err)
    tag = re.search(r"constructor for the tag '(?:tag:yaml\.org,2002:)?([^']*)'", problem)
    if tag:
        return (f"the YAML tag '!!{tag.group(1)}' is not allowed: a config holds plain values (numbers, strings, "
                f"lists, mappings) and names classes with {TARGET}.")
    context = getattr(err, "context", None)
    return _one_line(f"invalid YAML: {problem}" + (f" ({context})" if context else "") + ".")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _to_object(schema: Any, config: DictConfig) -> Any:
    try:
        OmegaConf.resolve(config)
        return OmegaConf.to_object(config)
    except OmegaConfBaseException as err:
        raise _explain(err, schema) from None
    except RecursionError:  # e.g. ${oc.decode:...} of a deeply nested value
        raise ConfigError(f"Invalid configuration: a value nests more than Python can follow; a configuration is "
                          f"a few levels of mappings and lists (at most {MAX_DEPTH}).") from None


def _explain(err: OmegaConfBaseException, schema: Any) -> ConfigError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    if isinstance(err, MissingMandatoryValue):
        return ConfigError(f"{key} is required and has no value: set it in a --config file or as {key}=...")
    if isinstance(err, ConfigKeyError):
        valid = _keys(schema)
        return ConfigError(f"Unknown key {key!r}.{did_you_mean(str(key), valid)} Valid keys: {', '.join(valid)}.")
    if isinstance(err, ValidationError):
        value = getattr(err, "value", None)
        expected = _type_name(_field_type(schema, str(key)))
        return ConfigError(f"{key}={value!r} is not a valid {expected}.")
    message = getattr(err, "msg", None) or str(err)
    return ConfigError(f"Invalid configuration at {key}: {message.splitlines()[0]}")


def _field_type(schema: Any, dotted: str) -> Any:
    node: Any = schema
    for part in dotted.split("."):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return None
        node = hints[part]
    return node


def _type_name(tp: Any) -> str:
    if tp is None:
        return "value"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))


def _keys(schema: Any, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints.get(f.name)):
            keys += _keys(hints[f.name], prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def to_yaml(config: Any) -> str:
    """The resolved configuration as YAML (defaults included), secrets written as ``"***"``
    (``xtrainer.redaction``): what ``config.yaml`` and ``xtrainer config`` show."""
    from xtrainer.redaction import redact

    resolved = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(redact(resolved)))


def save_config(config: Any, directory: str | os.PathLike) -> str:
    """Write the resolved ``config`` as ``config.yaml`` in ``directory``; returns its path.
    ``xtrainer fit --config <that file>`` runs the same configuration again. ``directory`` may be
    an fsspec URL (``s3://...``)."""
    from xtrainer.checkpoint import fs

    if fs.is_url(os.fspath(directory)):
        path = fs.join(os.fspath(directory), CONFIG_FILE)
        fs.write_text(path, to_yaml(config))
        return path
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.fspath(directory), CONFIG_FILE)
    with open(path, "w") as f:
        f.write(to_yaml(config))
    return path


def flatten(config: Any) -> dict[str, Any]:
    """``{"trainer.max_epochs": 8, "model._target_": "...", ...}``: scalars only (for TensorBoard's
    hyperparameters); lists become strings."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, (list, tuple)):
            out[prefix[:-1]] = str(node)
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(OmegaConf.structured(config), resolve=True), "")
    return out


# --------------------------------------------------------------------------------------------
# Naming classes: each `_target_` checked against the type its place expects
# --------------------------------------------------------------------------------------------
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
        raise ConfigError(f"{key}={dotted!r}: importing {module_name} failed: {_one_line(err)}") from None


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
            raise ConfigError(f"{self.where}: {_one_line(err)}") from None

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
        inner, dotted = next(_targets(value, where))
        raise ConfigError(f"{inner}.{TARGET}={dotted!r} is refused: a {TARGET} fills a parameter whose annotation "
                          f"names a class, not a key inside the plain data {where} holds: make it an argument of "
                          f"its own, or build the object in {owner.__qualname__}.__init__.")
    if annotation is not None and not _fits(value, annotation):
        raise ConfigError(f"{where}={value!r} is not a valid {_type_name(annotation)} (an argument of {_name(owner)}).")
    return value


def _no_class_annotation(spec: Any, annotation: Any, where: str, owner: type, name: Any) -> ConfigError:
    dotted = spec.get(TARGET) if isinstance(spec, dict) else spec
    shown = "none" if annotation is None else _type_name(annotation)
    return ConfigError(f"{where}.{TARGET}={dotted!r} is refused: the parameter {name!r} of {_name(owner)} has no class "
                       f"annotation (it has {shown}), so nothing says which classes it takes: annotate it with the "
                       f"class it takes (e.g. {name}: torch.nn.Module), or build the object in "
                       f"{owner.__qualname__}.__init__.")


def _holds_target(value: Any) -> bool:
    return next(_targets(value, ""), None) is not None


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


def _targets(node: Any, where: str) -> Any:
    """``(key, value)`` of every ``_target_`` in ``node``, however deep."""
    if isinstance(node, dict):
        if TARGET in node:
            yield where, node[TARGET]
        for k, v in node.items():
            if k != TARGET:
                yield from _targets(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _targets(v, f"{where}[{i}]")


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
# The run: every place checked, then built
# --------------------------------------------------------------------------------------------
_STAGE_LIMITS = {"fit": "limit_train_batches", "validate": "limit_val_batches", "test": "limit_test_batches",
                 "predict": "limit_predict_batches"}


@dataclass
class Plan:
    """A ``RunConfig`` checked whole, nothing built yet: each place's ``Target``, the strategy's
    name or ``Target``, and the logger (a bool, or ``Target``s)."""

    strategy: Any
    strategy_where: str
    callbacks: List[Target]
    logger: Any
    model: Target
    data: Optional[Target]


def plan(config: RunConfig, stage: Optional[str] = None) -> Plan:
    """Refuse ``config`` before anything is built, or return what ``build`` will construct. Every
    ``_target_``'s form is checked before any module is imported; then each place's class is
    located and checked against the type the place expects (``place``), its arguments against
    its signature, and each nested ``_target_`` against the annotation of the parameter it fills;
    a ``_target_`` anywhere else is refused, as is a secret a saved ``config.yaml`` redacted, and
    a batch limit of ``stage`` that is 0."""
    tree = dataclasses.asdict(config)
    for where, dotted in _targets(tree, ""):
        check_name(dotted, where)
    for name in TrainerSettings.names():
        for where, dotted in _targets(getattr(config.trainer, name, None), f"trainer.{name}"):
            raise ConfigError(f"{where}.{TARGET}={dotted!r} is refused: trainer.{name} takes a plain value; a "
                              f"{TARGET} is taken by model, data, trainer.callbacks, trainer.logger, trainer.strategy "
                              "and the arguments of the classes they name.")
    _refuse_redacted(tree, "")
    strategy, strategy_where = _one_place(config, "strategy")
    strategy = _plan_strategy(strategy, strategy_where)
    specs, where = _one_place(config, "callbacks")
    callbacks = [resolve_target(spec, f"{where}[{i}]", place("callbacks")) for i, spec in enumerate(specs or [])]
    logger = config.trainer.logger
    if isinstance(logger, list):
        logger = [resolve_target(spec, f"trainer.logger[{i}]", place("logger")) for i, spec in enumerate(logger)]
    elif isinstance(logger, dict):
        logger = resolve_target(logger, "trainer.logger", place("logger"))
    elif not isinstance(logger, bool):
        raise ConfigError(f"trainer.logger={logger!r}: give true, false, a {{{TARGET}: ...}} or a list of them.")
    model = resolve_target(config.model, "model", place("model"))
    data = resolve_target(config.data, "data", place("data")) if config.data is not None else None
    name = _STAGE_LIMITS.get(stage or "")
    value = getattr(config.trainer, name, None) if name else None
    if value is not None and not isinstance(value, bool) and value == 0:
        raise ConfigError(f"trainer.{name}={value!r} leaves no batches to {stage}: give a number of batches (>= 1) "
                          "or a fraction in (0.0, 1.0].")
    return Plan(strategy, strategy_where, callbacks, logger, model, data)


def check(config: RunConfig, stage: Optional[str] = None) -> None:
    """``plan(config, stage)``, for its refusals only."""
    plan(config, stage)


def _refuse_redacted(node: Any, where: str) -> None:
    """A secret written as ``"***"`` (a saved ``config.yaml`` holds no secrets) is refused."""
    from xtrainer.redaction import REDACTED, looks_secret

    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{where}.{k}" if where else str(k)
            if v == REDACTED and looks_secret(k):
                raise ConfigError(f"{key}='{REDACTED}' is a secret the saved configuration does not hold: give it as "
                                  f"{key}=... or as ${{oc.env:NAME}} in the config file.")
            _refuse_redacted(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_redacted(v, f"{where}[{i}]")


def _plan_strategy(strategy: Any, where: str) -> Any:
    """A strategy's name (checked) or the ``Target`` of ``{name: ..., <option>: ...}`` or of
    ``{_target_: mypackage.MyStrategy, ...}``."""
    from xtrainer.strategies import LIGHTNING_NAMES, STRATEGIES, resolve_strategy

    if strategy is None:
        return "xla_native"
    if isinstance(strategy, dict):
        options = dict(strategy)
        glued = [k for k, v in options.items() if isinstance(k, str) and ":" in k and v is None]
        if glued:
            key, value = glued[0].split(":", 1)
            raise ConfigError(f"{where} has a key {glued[0]!r}: YAML needs a space after the colon, "
                              f"{{{key}: {value}}}.")
        if TARGET in options:
            if "name" in options:
                raise ConfigError(f"{where} has both name and {TARGET}: give one (a strategy's name, or a class).")
            return resolve_target(options, where, place("strategy"))
        name = LIGHTNING_NAMES.get(options.get("name"), options.pop("name", None))
        if name not in STRATEGIES:
            raise ConfigError(f"{where}.name={name!r}: use one of {', '.join(STRATEGIES)}.")
        return Target(STRATEGIES[name], check_arguments(STRATEGIES[name], options, where), where)
    if isinstance(strategy, str) and LIGHTNING_NAMES.get(strategy, strategy) in STRATEGIES:
        return strategy
    try:
        resolve_strategy(strategy)  # not a name it knows: its message says which ones it does
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {_one_line(err)}") from None
    raise ConfigError(f"{where}={strategy!r}: give a strategy's name or {{name: ..., <option>: ...}}.")


@dataclass
class Run:
    """The typed objects a ``RunConfig`` describes."""

    trainer: Any
    model: Any
    data: Any
    ckpt_path: Optional[str]


def build(config: RunConfig, stage: Optional[str] = None) -> Run:
    """Seed, ``plan(config, stage)`` (every check, nothing built), then construct the strategy,
    callbacks, loggers, Trainer, model and data of ``config``."""
    from xtrainer import seed_everything

    if config.seed is not None:
        seed_everything(config.seed)
    checked = plan(config, stage)  # after seeding, as importing a target may draw numbers
    trainer = _trainer(config, checked, own_only=False)
    model = checked.model.build()
    data = checked.data.build() if checked.data is not None else None
    trainer.run_config = flatten(config)
    return Run(trainer, model, data, config.ckpt_path)


def check_run(config: RunConfig, stage: Optional[str] = "fit") -> None:
    """Refuse ``config`` as ``build(config, stage)`` would, building nothing a configuration names
    but xtrainer's own classes (for ``xtrainer config``): ``plan``, then the strategy, xtrainer's
    callbacks and loggers and the Trainer, whose constructors check their values and create no
    file or folder (a Trainer claims its run folder when a run starts). Classes of your own
    (model, data, callbacks, loggers, a strategy) are checked against their signatures only."""
    _trainer(config, plan(config, stage), own_only=True)


def _trainer(config: RunConfig, checked: Plan, own_only: bool) -> Any:
    """The strategy, callbacks, loggers and ``Trainer`` of ``checked``; with ``own_only``, only
    those of xtrainer's own classes (the others are left out)."""
    from xtrainer import Trainer
    from xtrainer.strategies import resolve_strategy

    def chosen(targets: list[Target]) -> list[Any]:
        return [t.build() for t in targets if not own_only or t.is_own()]

    strategy = checked.strategy
    if isinstance(strategy, Target):
        strategy = strategy.build() if not own_only or strategy.is_own() else "xla_native"
    try:
        strategy = resolve_strategy(strategy)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{checked.strategy_where}: {_one_line(err)}") from None
    callbacks = chosen(checked.callbacks)
    logger = checked.logger
    if isinstance(logger, Target):
        logger = (chosen([logger]) or [False])[0]
    elif isinstance(logger, list):
        logger = chosen(logger)
    try:
        return Trainer(strategy=strategy, callbacks=callbacks, logger=logger, **trainer_kwargs(config.trainer))
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"trainer: {_one_line(err)}") from None
