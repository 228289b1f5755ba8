"""What a checkpoint holds, and the rule that keeps it data: plain containers, numbers, strings
and tensors, nothing that needs code to rebuild.

A checkpoint is one plain dict:

=====================  ==========================================================================
key                    what it holds
=====================  ==========================================================================
``format``             ``"xtrainer"``; ``format_version`` its layout version (now 2)
``xtrainer_version``   the package version that wrote it
``strategy``           the strategy's name; ``world_size`` how many replicas trained
``state_dict``         the user module's state dict, as ``module.state_dict()`` gives it
``optimizer_states``   one ``optimizer.state_dict()`` per optimizer
``lr_schedulers``      one ``scheduler.state_dict()`` per scheduler
``loops``              ``global_step``, ``epoch``, ``batches_in_epoch``, ``epoch_finished``, ``seed``,
                       ``validation_pending`` (saved between a batch and the validation it
                       triggers), ``epoch_schedulers_due`` (saved at an epoch's end, before the
                       epoch's scheduler step), ``batches_stepped`` (the loggers' step; absent in
                       older checkpoints: ``global_step``), ``callback_metrics`` (the logged values,
                       floats)
``rng_states``         Python, NumPy, torch CPU generators; each replica's XLA generator
``epoch_results``      per replica: the epoch accumulators of values logged with ``on_epoch``
                       (combined when another number of replicas resumes them)
``data_state``         per replica: the states, at the epoch's start, of the user's generators
                       that order the training data
``callbacks``          ``{callback.state_key: callback.state_dict()}``
``hyper_parameters``   the module's ``hparams`` (a plain dict)
=====================  ==========================================================================

Every value is one of the types ``torch.load(weights_only=True)`` rebuilds without running code
(``SAVABLE``): a checkpoint that would need anything else is refused when it is written, with the
key that holds it, so that every checkpoint xtrainer writes can be read without trusting it.
"""

from __future__ import annotations

import collections
import enum
import os
import pathlib
from typing import Any

import torch

FORMAT = "xtrainer"
#: 2: sharded folders carry a ``manifest.json``; whole files are verified by their zip CRCs.
FORMAT_VERSION = 2

STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"
LR_SCHEDULERS = "lr_schedulers"
LOOPS = "loops"
RNG_STATES = "rng_states"
CALLBACKS = "callbacks"
HYPER_PARAMETERS = "hyper_parameters"
STRATEGY = "strategy"
WORLD_SIZE = "world_size"

#: Where the user's module sits inside the Trainer's step dispatcher, which sharded strategies wrap.
DISPATCHER_PREFIX = "module."


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, unsafe, or does not fit this run."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint asked for does not exist."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file is truncated or corrupt, or a sharded checkpoint lacks shards: another,
    older checkpoint may still be good."""


_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)  # Counter: MultiStepLR's milestones
_CONTAINERS = (*_MAPPINGS, list, tuple, set, torch.Size)


def check_savable(value: Any, where: str = "checkpoint") -> None:
    """Refuse a value that ``torch.load(weights_only=True)`` could not read back: anything but
    plain containers of numbers, strings, tensors, dtypes and devices. ``where`` names the key.
    A container that holds itself is refused too (a checkpoint is a tree)."""
    done: set[int] = set()

    def check(item: Any, path: str, active: frozenset) -> None:
        kind = type(item)
        if isinstance(item, _LEAVES) and (kind in _LEAVES or isinstance(item, torch.Tensor)):
            return
        if kind not in _CONTAINERS:
            raise CheckpointError(
                f"{path} is a {kind.__module__}.{kind.__qualname__}: checkpoints hold plain data only (dicts, "
                "lists, tuples, numbers, strings, tensors), so that loading one never runs code. Convert it in "
                "state_dict() / on_save_checkpoint (e.g. to a dict, a list or a tensor).")
        if id(item) in active:
            raise CheckpointError(f"{path} contains itself: a checkpoint holds a tree of plain data, not a cycle.")
        if id(item) in done:  # shared by two keys: checked once
            return
        if len(active) > 64:
            raise CheckpointError(f"{path} is nested more than 64 levels deep: is it a cycle?")
        active = active | {id(item)}
        if kind in _MAPPINGS:
            for key, sub in item.items():
                if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                    raise CheckpointError(f"{path} has a key of type {type(key).__name__}; checkpoints hold "
                                          "plain data only (keys: str, int, float, bool, tuple).")
                check(sub, f"{path}[{key!r}]", active)
        else:
            for i, sub in enumerate(item):
                check(sub, f"{path}[{i}]", active)
        done.add(id(item))

    check(value, where, frozenset())


def plain_hparams(hparams: Any) -> Any:
    """``hparams`` as plain data: OmegaConf containers, paths, enums and namespaces converted;
    anything else stored as its ``repr`` (a checkpoint never holds objects that need code)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        DictConfig = ListConfig = ()  # type: ignore[assignment]

    def convert(value: Any, depth: int = 0) -> Any:
        if depth > 32:  # deeper than any configuration: circular, or not a hyperparameter
            return repr(value)[:200]
        if DictConfig and isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
        if isinstance(value, dict):
            return {str(k) if not isinstance(k, (str, int)) else k: convert(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [convert(v, depth + 1) for v in value]
            return tuple(items) if type(value) is tuple else items
        if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            return value.item()  # a NumPy scalar: its Python number
        if isinstance(value, enum.Enum):
            return convert(value.value)
        if isinstance(value, (pathlib.PurePath, os.PathLike)):
            return os.fspath(value)
        if isinstance(value, _LEAVES) and type(value) in _LEAVES or isinstance(value, torch.Tensor):
            return value
        if hasattr(value, "__dict__") and type(value).__name__ == "Namespace":
            return convert(vars(value), depth + 1)
        return repr(value)

    return convert(dict(hparams))


def lightning_checkpoint(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` is one PyTorch Lightning wrote (its version entry and a state dict)."""
    return (isinstance(checkpoint, dict) and isinstance(checkpoint.get("pytorch-lightning_version"), str)
            and isinstance(checkpoint.get(STATE_DICT), dict))


def check_header(checkpoint: Any, path: str) -> None:
    """Refuse what is not an xtrainer checkpoint, or one newer than this xtrainer reads."""
    if lightning_checkpoint(checkpoint) and checkpoint.get("format") != FORMAT:
        raise CheckpointError(
            f"{path!r} was written by PyTorch Lightning {checkpoint['pytorch-lightning_version']}: its weights "
            "and hyperparameters load with YourModule.load_from_checkpoint(path). Pass that module to "
            "validate/test/predict, or to fit without ckpt_path (the fit then starts its optimizer, schedulers "
            "and loop afresh: Lightning's optimizer and loop state do not carry over).")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise CheckpointError(
            f"{path!r} is not an xtrainer checkpoint (no 'format': 'xtrainer' entry). To start from "
            "plain weights, load them into your module with module.load_state_dict() before fit().")
    version = checkpoint.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise UnreadableCheckpointError(f"{path!r} has a malformed header (format_version={version!r}).")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has checkpoint format version {checkpoint['format_version']}, newer than this "
            f"xtrainer reads ({FORMAT_VERSION}). Upgrade xtrainer.")


def load_weights(module: torch.nn.Module, state_dict: Any) -> None:
    """``module.load_state_dict(state_dict)``, refusing a state dict of another model with an
    error that lists the missing and unexpected keys and the shape mismatches."""
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"its state_dict is a {type(state_dict).__name__}, not a dict of tensors")
    check_fits(module.state_dict(), shapes_of(state_dict))
    module.load_state_dict(state_dict)


def shapes_of(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``{name: shape}`` of a state dict (None for entries that are not tensors)."""
    return {k: v.shape if isinstance(v, torch.Tensor) else None for k, v in state_dict.items()}


def check_fits(own: dict[str, Any], shapes: dict[str, Any]) -> None:
    """Refuse saved module state, given as ``{name: shape or None}``, that does not fit the module
    whose state dict is ``own``, listing the missing and unexpected keys and the shape mismatches."""
    if not isinstance(shapes, dict):
        raise CheckpointError(f"its state_dict is a {type(shapes).__name__}, not a dict of tensors")
    missing = [k for k in own if k not in shapes]
    unexpected = [k for k in shapes if k not in own]
    mismatched = [f"{k} {tuple(shape)} (module: {tuple(own[k].shape)})" for k, shape in shapes.items()
                  if k in own and shape is not None and tuple(shape) != tuple(own[k].shape)]
    mismatched += [f"{k} is not a tensor" for k, shape in shapes.items()
                   if k in own and shape is None and isinstance(own[k], torch.Tensor)]
    problems = [f"{label} ({len(keys)}): {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}"
                for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                    ("shape mismatches", mismatched)) if keys]
    if problems:
        raise CheckpointError("it does not fit this module, so nothing was trained: " + "; ".join(problems)
                              + ". Is it a checkpoint of another model (or of another configure_model())?")
