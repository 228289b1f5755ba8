"""Hyperparameters as loggers write them: Lightning's accepted forms (a dict, a ``Namespace``, an
OmegaConf container) as plain YAML-safe values, flattened for TensorBoard, and ``hparams.yaml``
written whole or not at all."""

from __future__ import annotations

import enum
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from xtrainer.checkpoint import storage


def omegaconf_plain(value: Any) -> Any:
    """An OmegaConf container as plain dicts and lists (interpolations resolved where they
    resolve); anything else unchanged."""
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if not isinstance(value, Container):
        return value
    try:
        return OmegaConf.to_container(value, resolve=True)
    except Exception:  # an interpolation that does not resolve: kept as written
        return OmegaConf.to_container(value, resolve=False)


def params_dict(params: Any) -> dict[str, Any]:
    """Lightning's accepted forms: a dict, an ``argparse.Namespace``, an OmegaConf container, None."""
    if params is None:
        return {}
    params = omegaconf_plain(vars(params) if isinstance(params, Namespace) else params)
    if not isinstance(params, Mapping):
        raise TypeError(f"hyperparameters must be a dict, a Namespace or a DictConfig, got {type(params).__name__}.")
    return dict(params)


def scalar(value: Any) -> Any:
    """A tensor or NumPy scalar as its Python number; anything else unchanged."""
    module = type(value).__module__ or ""
    if (module.startswith("torch") or module.startswith("numpy")) and hasattr(value, "item"):
        try:
            if getattr(value, "ndim", 0) == 0 or value.numel() == 1:
                return value.item()  # host sync for a device tensor: hyperparameters, once per run
        except (AttributeError, TypeError, ValueError, RuntimeError):
            pass
    return value


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as YAML-safe plain data: dicts, lists, numbers, strings, None; objects as text."""
    if depth > 32:  # deeper than any configuration: a cycle, or not a hyperparameter
        return str(value)[:200]
    value = omegaconf_plain(scalar(value))
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, enum.Enum):
        return plain(value.value, depth + 1)
    if isinstance(value, Mapping):
        return {k if type(k) in (str, int, float, bool) else str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [plain(v, depth + 1) for v in items]
    if value is None or type(value) in (bool, int, float, str):
        return value
    for base in (bool, int, float, str):  # their subclasses, as the plain type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def flatten(params: Mapping[str, Any], separator: str = "/", prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        key = f"{prefix}{separator}{key}" if prefix else str(key)
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, separator, key))
        else:
            flat[key] = value
    return flat


def atomic_write(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (the checkpoint package's atomic replace)."""
    storage.replace_text(path, text)


def write_hparams_yaml(path: str, params: Mapping[str, Any]) -> None:
    import yaml

    atomic_write(path, yaml.safe_dump(plain(dict(params)), sort_keys=False, allow_unicode=True))

