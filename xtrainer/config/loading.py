"""Loading a configuration: ``--config`` files and ``key=value`` overrides merged over the
schema's defaults (OmegaConf), hostile YAML refused before it is read, every mistake a one-line
``ConfigError`` naming the key; and writing it back (``config.yaml``, secrets redacted)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import typing
from typing import Any, Optional, Sequence, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from xtrainer.config.redaction import redact
from xtrainer.config.schema import CONFIG_FILE, TARGET, ConfigError, RunConfig, one_line, type_name
from xtrainer.suggest import did_you_mean

T = TypeVar("T")


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
        raise ConfigError(f"Invalid configuration: {one_line(err)} (a config file holds a mapping of keys, "
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
_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep; a configuration is a few levels of mappings and lists."
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

    def check(event: Any) -> None:
        nonlocal depth, top
        if top is None and isinstance(event, yaml.NodeEvent):
            top = {yaml.MappingStartEvent: "mapping", yaml.SequenceStartEvent: "list"}.get(type(event), "value")
            if isinstance(event, yaml.ScalarEvent) and not event.style and event.value in ("", "~", "null"):
                top = None
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise refuse(event, _TOO_DEEP)
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

    try:
        for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            check(event)
    except yaml.MarkedYAMLError as err:
        # libyaml 0.2.6 (PyYAML 6.0.4) refuses more than 1000 open collections itself, while
        # looking ahead, before the event that passes MAX_DEPTH arrives: the same refusal.
        if "maximum nesting depth" not in str(err.problem) or err.problem_mark is None:
            raise
        mark = err.problem_mark
        raise ConfigError(f"{source}, line {mark.line + 1}, column {mark.column + 1}: {_TOO_DEEP}") from None
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
    return one_line(f"invalid YAML: {problem}" + (f" ({context})" if context else "") + ".")


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
        expected = type_name(_field_type(schema, str(key)))
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
    (``xtrainer/config/redaction.py``): what ``config.yaml`` and ``xtrainer config`` show."""
    resolved = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(redact(resolved)))


def save_config(config: Any, directory: str | os.PathLike) -> str:
    """Write the resolved ``config`` as ``config.yaml`` in ``directory``; returns its path.
    ``xtrainer fit --config <that file>`` runs the same configuration again. ``directory`` may be
    an fsspec URL (``s3://...``)."""
    from xtrainer.checkpoint import fs

    return fs.write_text_into(os.fspath(directory), CONFIG_FILE, to_yaml(config))


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
