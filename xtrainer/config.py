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

``_target_`` is instantiated by a few lines over ``importlib`` (``instantiate``), not Hydra:
import a dotted name, check the keyword arguments against the signature, call it. That is all
a run needs, and it keeps the errors ours. A ``_target_`` names a class, never a function, a
method or a builtin, nor anything from ``os``, ``subprocess``, ``sys`` and the other modules of
``REFUSED_MODULES``; ``build`` checks every ``_target_`` in the configuration before it
instantiates any, so neither a config file nor a run's saved ``config.yaml`` can run a command.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
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
    """``OmegaConf.load(path)`` (a safe YAML loader), with its errors as one-line ``ConfigError``s."""
    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path!r}{_yaml_position(err)}: {_yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"Config file {path!r} cannot be read: {getattr(err, 'strerror', None) or err}.") from None


def _parse_overrides(overrides: list[str]) -> DictConfig:
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
    """The resolved configuration as YAML (defaults included)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config), resolve=True)


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
# Building the run
# --------------------------------------------------------------------------------------------
# A `_target_` names a class, never a function, and never anything from these modules (nor
# their submodules; a leading underscore is ignored: `_io` is `io`, `_posixsubprocess` is
# `posixsubprocess`): a configuration, and the config.yaml a run saves, can then neither run a
# command nor touch files by naming a callable.
REFUSED_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "genericpath", "subprocess", "posixsubprocess", "winapi",
    "builtins", "builtin", "sys", "shutil", "importlib", "imp", "zipimport", "pkgutil", "runpy", "code",
    "codeop", "pickle", "cPickle", "copyreg", "shelve", "marshal", "dill", "cloudpickle", "joblib", "ctypes",
    "cffi", "socket", "socketserver", "ssl", "select", "selectors", "asyncio", "http", "urllib", "urllib3",
    "requests", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib", "xmlrpc", "webbrowser", "pty", "tty",
    "termios", "fcntl", "resource", "mmap", "multiprocessing", "concurrent", "threading", "thread", "signal",
    "io", "pathlib", "tempfile", "glob", "fileinput", "filecmp", "zipfile", "tarfile", "gzip", "bz2", "lzma",
    "dbm", "sqlite3", "logging", "atexit", "gc", "inspect", "types", "functools", "operator", "ast", "dis",
    "pdb", "bdb", "trace", "tracemalloc", "faulthandler", "cProfile", "profile", "timeit", "platform",
    "sysconfig", "site", "venv", "ensurepip", "distutils", "setuptools", "pip", "pkg_resources", "shlex",
    "getpass", "pwd", "grp", "syslog", "codecs",
})
_ALLOWED = (f"a {TARGET} names a class (a model, data, callback or logger class, e.g. mypackage.models.Classifier), "
            "never a function, method or builtin, nor anything from os, subprocess, sys, shutil, importlib, pickle "
            "or another system module, so that a config cannot run commands")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


def refused_module(module_name: Any) -> bool:
    """Whether ``module_name`` (or the package it belongs to) is one a ``_target_`` may not name."""
    if not isinstance(module_name, str):
        return True
    return module_name.split(".")[0].strip("_") in REFUSED_MODULES


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


def locate(dotted: str, where: str) -> type:
    """The class a dotted name (``package.module.Name``) refers to. Anything else (a function, a
    builtin, a method, a module, an object) and any class from ``REFUSED_MODULES`` is a
    ``ConfigError``; a refused module is not even imported."""
    key = f"{where}.{TARGET}"
    if not isinstance(dotted, str) or not _DOTTED.fullmatch(dotted):
        raise ConfigError(f"{key}={dotted!r} is not a dotted class name: {_ALLOWED}.")
    parts = dotted.split(".")
    if any(part.startswith("__") for part in parts):
        raise ConfigError(f"{key}={dotted!r}: names with '__' parts are refused: {_ALLOWED}.")
    if refused_module(dotted):
        raise ConfigError(f"{key}={dotted!r} is refused: {_ALLOWED}.")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and not module_name.startswith(err.name) and err.name != module_name:
                raise ConfigError(f"{key}={dotted!r}: importing {module_name} failed, because it "
                                  f"imports {err.name!r}, which is not installed.") from None
            continue
        except ImportError as err:
            raise ConfigError(f"{key}={dotted!r}: importing {module_name} failed: {_one_line(err)}") from None
        for i, attr in enumerate(parts[cut:]):
            if not (inspect.ismodule(obj) or inspect.isclass(obj)):
                raise ConfigError(f"{key}={dotted!r}: {'.'.join(parts[:cut + i])} is {_kind(obj)}, not a module "
                                  f"or class: {_ALLOWED}.")
            if not hasattr(obj, attr):
                raise ConfigError(f"{key}={dotted!r}: module {'.'.join(parts[:cut + i])} has no "
                                  f"attribute {attr!r}.")
            obj = getattr(obj, attr)
            if inspect.ismodule(obj) and refused_module(obj.__name__):
                raise ConfigError(f"{key}={dotted!r} reaches the module {obj.__name__}: {_ALLOWED}.")
        check_class(obj, key, dotted)
        return obj
    raise ConfigError(f"{key}={dotted!r}: no module {parts[0]!r} can be imported (run from the "
                      "folder that holds it, or install its package).")


def check_class(obj: Any, key: str, dotted: Any = None) -> None:
    """Refuse ``obj`` unless it is a class from a module that is not refused."""
    shown = f"{key}={dotted!r}" if dotted is not None else key
    if not inspect.isclass(obj):
        raise ConfigError(f"{shown} is {_kind(obj)}, not a class: {_ALLOWED}.")
    if refused_module(getattr(obj, "__module__", None)):
        raise ConfigError(f"{shown} is a class from {getattr(obj, '__module__', '?')}, which is refused: {_ALLOWED}.")


def instantiate(spec: Any, where: str) -> Any:
    """``{_target_: dotted.Class, **kwargs}`` constructed with its keyword arguments, checked first."""
    return call_checked(*_located(spec, where), where)


def checked_target(spec: Any, where: str) -> tuple[type, dict[str, Any]]:
    """The class ``{_target_: dotted.Class, **kwargs}`` names and its keyword arguments, checked
    as ``instantiate`` checks them (``locate``, then ``check_arguments``); nothing is constructed."""
    target, kwargs = _located(spec, where)
    check_arguments(target, kwargs, where)
    return target, kwargs


def _located(spec: Any, where: str) -> tuple[type, dict[str, Any]]:
    if not isinstance(spec, dict) or TARGET not in spec:
        raise ConfigError(f"{where} needs a {TARGET} (e.g. {where}: {{{TARGET}: mypackage.Thing, ...}}).")
    return locate(spec[TARGET], where), {k: v for k, v in spec.items() if k != TARGET}


def call_checked(target: Any, kwargs: dict[str, Any], where: str) -> Any:
    """``target(**kwargs)`` for a class ``target``, after ``check_arguments``; a ``ValueError`` or
    ``TypeError`` from the constructor becomes a ``ConfigError`` too."""
    check_arguments(target, kwargs, where)
    return _construct(target, kwargs, where)


def check_arguments(target: Any, kwargs: dict[str, Any], where: str) -> None:
    """Refuse ``kwargs`` for the class ``target`` before it is called: the names, the required
    arguments and simple types, against its signature, so that a mistake is a message naming the
    key."""
    check_class(target, where)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in params and not takes_any:
            raise ConfigError(f"Unknown key '{where}.{key}': {_name(target)} takes {', '.join(named) or 'nothing'}."
                              + did_you_mean(key, named))
    for name in named:
        if params[name].default is inspect.Parameter.empty and name not in kwargs:
            raise ConfigError(f"{where}.{name} is required by {_name(target)} and has no value: set {where}.{name}=...")
    hints = _hints(target)
    for key, value in kwargs.items():
        expected = hints.get(key)
        if expected is not None and not _fits(value, expected):
            raise ConfigError(f"{where}.{key}={value!r} is not a valid {_type_name(expected)} "
                              f"(an argument of {_name(target)}).")


def _construct(target: type, kwargs: dict[str, Any], where: str) -> Any:
    try:
        return target(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {_one_line(err)}") from None


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


_STAGE_LIMITS = {"fit": "limit_train_batches", "validate": "limit_val_batches", "test": "limit_test_batches",
                 "predict": "limit_predict_batches"}


def check(config: RunConfig, stage: Optional[str] = None) -> None:
    """Refuse ``config`` before anything is built: every ``_target_`` in it, however deep, must
    name a class ``locate`` accepts, and the batch limit of ``stage`` (``fit``: ``limit_train_batches``)
    must not be 0."""
    tree = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    for where, dotted in _targets(tree, ""):
        locate(dotted, where)
    name = _STAGE_LIMITS.get(stage or "")
    value = getattr(getattr(config, "trainer", None), name, None) if name else None
    if value is not None and not isinstance(value, bool) and value == 0:
        raise ConfigError(f"trainer.{name}={value!r} leaves no batches to {stage}: give a number of batches (>= 1) "
                          "or a fraction in (0.0, 1.0].")


def _name(target: Any) -> str:
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"


def _hints(target: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # noqa: BLE001 - annotations that do not evaluate: no type checks
        return {}


def _fits(value: Any, expected: Any) -> bool:
    """Whether ``value`` fits a simple annotation; anything this does not understand fits."""
    if expected is Any:
        return True
    origin = typing.get_origin(expected)
    if origin is Union:
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


@dataclass
class Run:
    """The typed objects a ``RunConfig`` describes."""

    trainer: Any
    model: Any
    data: Any
    ckpt_path: Optional[str]


def build(config: RunConfig, stage: Optional[str] = None) -> Run:
    """Seed, ``check(config, stage)``, then instantiate the strategy, callbacks, Trainer, model and
    data of ``config``."""
    from xtrainer import seed_everything

    if config.seed is not None:
        seed_everything(config.seed)
    trainer = _build_trainer(config, stage)  # check() first: after seeding, as importing a target may draw numbers
    model = instantiate(config.model, "model")
    data = instantiate(config.data, "data") if config.data is not None else None
    trainer.run_config = flatten(config)
    return Run(trainer, model, data, config.ckpt_path)


def check_run(config: RunConfig, stage: Optional[str] = "fit") -> None:
    """Refuse ``config`` exactly as ``build(config, stage)`` would, without constructing the model
    or the data (their arguments are checked against their signatures; what only their
    constructors or ``*_dataloader()`` methods refuse shows when the run starts): ``check``, the
    strategy's name and options, callbacks, loggers and the Trainer's settings, which are built
    (a Trainer creates no folder until a run starts). For ``xtrainer config``."""
    _build_trainer(config, stage)
    checked_target(config.model, "model")
    if config.data is not None:
        checked_target(config.data, "data")


def _build_trainer(config: RunConfig, stage: Optional[str]) -> Any:
    """``check(config, stage)``, then the strategy, callbacks, loggers and the ``Trainer``."""
    from xtrainer import Trainer
    from xtrainer.strategies import LIGHTNING_NAMES, STRATEGIES, resolve_strategy

    check(config, stage)
    strategy, where = _one_place(config, "strategy")
    strategy = "xla_native" if strategy is None else strategy
    try:
        if isinstance(strategy, dict):
            options = dict(strategy)
            glued = [k for k, v in options.items() if isinstance(k, str) and ":" in k and v is None]
            if glued:
                key, value = glued[0].split(":", 1)
                raise ConfigError(f"{where} has a key {glued[0]!r}: YAML needs a space after the colon, "
                                  f"{{{key}: {value}}}.")
            name = LIGHTNING_NAMES.get(options.get("name"), options.pop("name", None))
            if name not in STRATEGIES:
                raise ConfigError(f"{where}.name={name!r}: use one of {', '.join(STRATEGIES)}.")
            strategy = call_checked(STRATEGIES[name], options, where)
        else:
            strategy = resolve_strategy(strategy)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: {_one_line(err)}") from None
    specs, where = _one_place(config, "callbacks")
    callbacks = [instantiate(spec, f"{where}[{i}]") for i, spec in enumerate(specs or [])]
    logger = config.trainer.logger
    if isinstance(logger, (dict, list)):
        specs = logger if isinstance(logger, list) else [logger]
        logger = [instantiate(spec, f"trainer.logger[{i}]" if isinstance(config.trainer.logger, list)
                              else "trainer.logger") for i, spec in enumerate(specs)]
    elif not isinstance(logger, bool):
        raise ConfigError(f"trainer.logger={logger!r}: give true, false, a {{{TARGET}: ...}} or a list of them.")
    kwargs = trainer_kwargs(config.trainer)
    try:
        return Trainer(strategy=strategy, callbacks=callbacks, logger=logger, **kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"trainer: {_one_line(err)}") from None
