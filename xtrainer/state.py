"""A run's state in a checkpoint: what is saved of a fit, and how a fit continues from it.

``build_checkpoint`` makes the plain dict ``xtrainer.checkpoint.format`` documents; ``restore``
puts a loaded one back: weights, optimizers, schedulers, the loops' position (step, epoch, the
next unseen batch, a validation still due), every random generator and every callback's state.
Writing and reading files is the checkpoint package's; this module never touches a file.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer import _xla
from xtrainer.checkpoint import format as ckpt_format
from xtrainer.checkpoint.format import CheckpointError
from xtrainer.optim import keeping_foreach

try:
    import numpy as _numpy
except ImportError:  # NumPy is optional; its generator is saved when it is installed
    _numpy = None

if TYPE_CHECKING:
    from xtrainer.trainer import Trainer


def build_checkpoint(trainer: "Trainer") -> dict[str, Any]:
    """The checkpoint of a running fit (tensors still on the device), before the hooks add to it."""
    from xtrainer import __version__

    strategy = trainer.strategy
    return {
        "format": ckpt_format.FORMAT, "format_version": ckpt_format.FORMAT_VERSION,
        "xtrainer_version": __version__, "strategy": strategy.name, "world_size": trainer.world_size,
        "state_dict": strategy.module_state_dict(trainer.model),
        "optimizer_states": [strategy.optimizer_state_dict(opt) for opt in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "loops": {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                  "batches_in_epoch": trainer._batches_in_epoch, "epoch_finished": trainer._epoch_finished,
                  "seed": trainer._seed, "validation_pending": trainer._validation_pending},
        "rng_states": rng_states(strategy),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "hyper_parameters": ckpt_format.plain_hparams(trainer.module.hparams),
        "hparams_name": trainer.module._hparams_name,
        **({"datamodule": trainer.datamodule.state_dict(),
            "datamodule_hyper_parameters": ckpt_format.plain_hparams(trainer.datamodule.hparams)}
           if trainer.datamodule is not None else {}),
    }


def keep_weights_only(checkpoint: dict[str, Any]) -> None:
    """Strip ``checkpoint`` to the module's weights, its hyperparameters and the loop counters."""
    checkpoint.update(optimizer_states=[], lr_schedulers=[], callbacks={}, weights_only=True)
    checkpoint.pop("rng_states", None)


def fitted_checkpoint(trainer: "Trainer", model: Any) -> dict[str, Any]:
    """A weights-only checkpoint of a module after its fit (on the host; the replicas are gone)."""
    from xtrainer import __version__

    checkpoint = {
        "format": ckpt_format.FORMAT, "format_version": ckpt_format.FORMAT_VERSION,
        "xtrainer_version": __version__, "strategy": trainer.strategy.name, "world_size": 1,
        "state_dict": model.state_dict(),
        "loops": {"global_step": trainer.global_step, "epoch": max(0, trainer.current_epoch - 1),
                  "batches_in_epoch": 0, "epoch_finished": True, "seed": trainer._seed},
        "hyper_parameters": ckpt_format.plain_hparams(model.hparams),
        "hparams_name": model._hparams_name,
    }
    keep_weights_only(checkpoint)
    return checkpoint


def restore(trainer: "Trainer", checkpoint: dict[str, Any], path: str, stage: str) -> None:
    """Put ``checkpoint`` (read from ``path``) back into this replica's run of ``stage``."""
    strategy = trainer.strategy
    try:
        strategy.load_module_state_dict(trainer.model, checkpoint)
    except CheckpointError as err:
        raise CheckpointError(f"Cannot resume from {path!r}: {err}") from None
    if stage == "fit" and checkpoint.get("weights_only"):
        raise CheckpointError(
            f"{path!r} holds the module's weights only (save_weights_only=True, or Trainer.save_checkpoint(..., "
            "weights_only=True)): no optimizer or loop state to resume a fit from. Start a new fit from its weights "
            "with Model.load_from_checkpoint(path), or evaluate it with validate/test(ckpt_path=path).")
    if stage == "fit":
        states = checkpoint.get("optimizer_states", [])
        if len(states) != len(trainer.optimizers):
            raise CheckpointError(f"{path!r} holds {len(states)} optimizer states; this module configures "
                                  f"{len(trainer.optimizers)} optimizers.")
        for optimizer, state in zip(trainer.optimizers, states):
            with keeping_foreach(optimizer):
                strategy.load_optimizer_state_dict(optimizer, state)
        for config, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", [])):
            config.scheduler.load_state_dict(state)
        loops = checkpoint["loops"]
        if checkpoint.get("world_size", trainer.world_size) != trainer.world_size and not loops["epoch_finished"]:
            rank_zero_warn(
                f"Resuming inside an epoch with {trainer.world_size} replicas from a checkpoint of "
                f"{checkpoint['world_size']}: the data is sharded differently, so the rest of this epoch "
                "is not exactly the batches the original run would have seen.")
        trainer.global_step = loops["global_step"]
        trainer._seed = loops.get("seed", trainer._seed)
        set_rng_states(checkpoint.get("rng_states"), trainer.global_rank, trainer.world_size)
        trainer._epoch_finished = loops["epoch_finished"]
        trainer.current_epoch = loops["epoch"] + (1 if loops["epoch_finished"] else 0)
        trainer._skip_batches = 0 if loops["epoch_finished"] else loops["batches_in_epoch"]
        trainer._batches_in_epoch = trainer._skip_batches
        trainer._validation_pending = bool(loops.get("validation_pending")) and not loops["epoch_finished"]
        for cb in trainer.callbacks:
            if cb.state_key in checkpoint.get("callbacks", {}):
                cb.load_state_dict(checkpoint["callbacks"][cb.state_key])
    if trainer.datamodule is not None and "datamodule" in checkpoint:
        trainer.datamodule.load_state_dict(checkpoint["datamodule"])
    trainer.module.on_load_checkpoint(checkpoint)
    for cb in trainer.callbacks:
        cb.on_load_checkpoint(trainer, trainer.module, checkpoint)


def rng_states(strategy: Any) -> dict[str, Any]:
    """Every random generator's state, to continue a resumed run with the same random numbers:
    Python's, NumPy's and torch's CPU generators (shared by a process) and each replica's XLA
    generator (a host rendezvous with several replicas, as all of a save is)."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _numpy is not None:  # as plain lists: the checkpoint stays loadable with torch.load(weights_only=True)
        name, keys, pos, has_gauss, cached = _numpy.random.get_state()
        states["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]  # a NumPy array: no device involved
    xla = _xla.rng_state()
    states["xla"] = strategy.all_gather_object(xla) if strategy.world_size > 1 else [xla]
    return states


def set_rng_states(states: dict[str, Any] | None, rank: int, world_size: int) -> None:
    if not states:
        return
    # Saving turns tuples into lists (xm's device-to-host copy); the generators want tuples.
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    if _numpy is not None and "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        _numpy.random.set_state((name, _numpy.array(keys, dtype=_numpy.uint32), pos, has_gauss, cached))
    xla = states["xla"]
    _xla.set_rng_state(xla[rank] if len(xla) == world_size else xla[0] + rank)


def seed_everything(seed: int, workers: bool = False) -> int:
    """Seed Python's, NumPy's and torch's random generators. A fit then derives its shuffling
    order and each replica's XLA generator from this seed, so runs repeat exactly. ``workers``
    is accepted for Lightning's signature: DataLoader workers are seeded from torch's generator."""
    del workers
    random.seed(seed)
    if _numpy is not None:
        _numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed
