"""A run's state in a checkpoint: what is saved of a fit, and how a fit continues from it.

``build_checkpoint`` makes the plain dict ``xtrainer.checkpoint.format`` documents; ``save``
hands it to the strategy's checkpoint layout; ``resolve_ckpt_path`` finds and checks what a
run resumes from; ``restore`` puts a loaded one back: weights, optimizers, schedulers, the loops'
position (step, epoch, the next unseen batch, a validation still due), every random generator
and every callback's state; ``stop_on_signal`` is a graceful stop's checkpoint. Writing and
reading files is the checkpoint package's; this module never touches a file.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer import checkpoint as ckpt_io
from xtrainer.checkpoint import format as ckpt_format
from xtrainer.checkpoint import resume
from xtrainer.checkpoint.whole import WholeFile
from xtrainer.checkpoint.format import CheckpointError
from xtrainer.launch import interrupts
from xtrainer.loop.optimizers import keeping_foreach, step_schedulers
from xtrainer.loop.results import epoch_results_of_replica
from xtrainer.trainer_view import TrainerView

try:
    import numpy as _numpy
except ImportError:  # NumPy is optional; its generator is saved when it is installed
    _numpy = None


def build_checkpoint(trainer: "TrainerView") -> dict[str, Any]:
    """The checkpoint of a running fit (tensors still on the device), before the hooks add to it."""
    from xtrainer import __version__

    strategy = trainer.strategy
    return {
        "format": ckpt_format.FORMAT, "format_version": ckpt_format.FORMAT_VERSION,
        "xtrainer_version": __version__, "strategy": strategy.name, "world_size": trainer.world_size,
        "epoch": trainer.current_epoch, "global_step": trainer.global_step,  # Lightning's keys, for scripts that read them
        "state_dict": strategy.module_state_dict(trainer.model),
        "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],  # each replica's (sharded: its shards)
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "loops": {**trainer.loop.state_dict(),
                  "callback_metrics": {name: float(value) for name, value in trainer.callback_metrics.items()}},
        "rng_states": rng_states(strategy),
        "epoch_results": per_replica(strategy, trainer.run.train_results.state_dict(strategy.runtime.to_cpu)),
        "data_state": per_replica(strategy, trainer.run.train_data_state()),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "hyper_parameters": ckpt_format.plain_hparams(trainer.module.hparams),
        "hparams_name": trainer.module._hparams_name,
        **({"datamodule": trainer.datamodule.state_dict(),
            "datamodule_hyper_parameters": ckpt_format.plain_hparams(trainer.datamodule.hparams)}
           if trainer.datamodule is not None else {}),
    }


def save(trainer: "TrainerView", path: str, weights_only: bool = False) -> None:
    """``Trainer.save_checkpoint`` during a fit: every replica calls it."""
    bad = trainer.nonfinite_step()
    if bad is not None:
        raise CheckpointError(
            f"Not writing {path!r}: the training loss became NaN or infinite at global step {bad}, so "
            "the weights are not good any more. The checkpoints written before are intact.")
    module = trainer.module
    with trainer.strategy.runtime.rng_state_kept():  # the run goes on from the state the checkpoint records, as a resumed one does
        checkpoint = build_checkpoint(trainer)
        for cb in trainer.callbacks:  # the callbacks, then the module, as in Lightning
            cb.on_save_checkpoint(trainer, module, checkpoint)
        module.on_save_checkpoint(checkpoint)
        if weights_only:
            keep_weights_only(checkpoint)
        compiles = trainer.strategy.runtime.device_counters()["compiles"]
        trainer.strategy.checkpoint_layout.save(trainer.strategy.collectives, checkpoint, path)
        # A save that computes anything on the device (gathering shards, say) compiles graphs of
        # its own; those are not the training step's, and XlaHealth does not count them as
        # recompilations.
        trainer.run.checkpoint_compilations += trainer.strategy.runtime.device_counters()["compiles"] - compiles


def save_fitted(trainer: "TrainerView", model: Any, path: str) -> None:
    """``Trainer.save_checkpoint`` after a fit, in the calling process: the fitted weights."""
    checkpoint = fitted_checkpoint(trainer, model)
    writer = trainer.strategy.collectives if trainer.strategy.launcher.runs_in_caller else _Alone()
    WholeFile().save(writer, checkpoint, path)


class _Alone:
    """The calling process as the only replica: who writes a checkpoint after the replicas are gone."""

    world_size, global_rank, is_global_zero = 1, 0, True

    def barrier(self, name: str = "") -> None:
        del name

    def to_cpu(self, data: Any) -> Any:
        """The fitted module's tensors are on the host already (the replicas' teardown moved them)."""
        return apply_to_collection(data, torch.Tensor, lambda tensor: tensor.cpu())  # host tensors already: no sync


def stop_on_signal(trainer: "TrainerView", signum: int) -> None:
    """Stopped by a signal: ``on_exception``, a checkpoint (every replica), then raise
    ``TrainingInterrupted`` with one line saying where the checkpoint is."""
    name = signal.Signals(signum).name
    trainer.run.call_on_exception(interrupts.TrainingInterrupted(f"Stopped by {name}.", signum))
    saver = trainer.checkpoint_callback  # the first ModelCheckpoint writes it where it writes its own
    if saver is not None:
        path = saver.save_now(trainer)
    elif trainer.nonfinite_step() is None:
        path = os.path.join(ckpt_io.default_dirpath(trainer.log_dir),
                            f"interrupted-epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
    else:
        path = None
    where = f"step {trainer.global_step}, epoch {trainer.current_epoch}"
    if path is None:
        message = (f"Stopped by {name} at {where}; the training loss had become non-finite, so no checkpoint "
                   "was written (the good ones written before are intact).")
    else:
        message = (f"Stopped by {name} at {where}; checkpoint: {path}. Resume with fit(..., ckpt_path='last') "
                   "(xtrainer fit --config <run folder>/config.yaml ckpt_path=last).")
    raise interrupts.TrainingInterrupted(message, signum, path)


def resolve_once(trainer: "TrainerView", ckpt_path: str | os.PathLike | None, stage: str = "fit") -> str | None:
    """``resolve_ckpt_path`` of a stage's ``ckpt_path`` (None: a fresh start), or the answer
    ``Trainer.resolve_ckpt_path`` gave for the same ``ckpt_path`` before, used once."""
    if ckpt_path is None:
        return None
    run = trainer.run
    if run.resolved_ckpt is not None and run.resolved_ckpt[0] == ckpt_path:
        resolved, run.resolved_ckpt = run.resolved_ckpt[1], None
        return resolved
    return resolve_ckpt_path(trainer, ckpt_io.fs.local(os.fspath(ckpt_path)), stage)


def resolve_ckpt_path(trainer: "TrainerView", ckpt_path: str, stage: str = "fit") -> str | None:
    """The checkpoint ``ckpt_path`` (a path, ``"best"`` or ``"last"``) means for this run, checked
    completely, announced in one line; None for a fresh start (``"last"`` with none yet), or, for
    an evaluation after a fit that this Trainer took past every checkpoint, the module as it is."""
    if ckpt_path == "best":
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if not best:
            raise ckpt_io.CheckpointNotFoundError(
                "ckpt_path='best': no best checkpoint is known. It needs a fit with a ModelCheckpoint(monitor=...) "
                "in this Trainer; pass a path instead.")
        ckpt_path = best
    if ckpt_path != "last" and not ckpt_io.fs.exists(ckpt_path):
        raise ckpt_io.CheckpointNotFoundError(f"ckpt_path={ckpt_path!r} does not exist (or pass ckpt_path='last').")
    extra = [cb.dirpath for cb in trainer.checkpoint_callbacks if cb.dirpath]
    planned = next((lg.version_dir for lg in trainer.loggers if getattr(lg, "version_dir", None)), None)
    if planned:  # a version given by name (version="baseline") is not among the version_* siblings
        extra.append(ckpt_io.default_dirpath(planned))
    runs_root = trainer.runs_root
    search = resume.lineage_dirs(os.path.join(runs_root, "version_0"), extra)
    strategy = trainer.strategy
    header = resume.resolve(ckpt_path, search, strategy.checkpoint_layout, strategy.name,
                            strategy.launcher.planned_world_size(), root=runs_root)
    if header is None:
        return None
    if ckpt_path == "last" and stage != "fit" and header.global_step < trainer.global_step:
        # Lightning's "last" is a last.ckpt; without one it evaluates the module as it is: so here,
        # rather than an older checkpoint (the best, say) than the weights this Trainer trained.
        rank_zero_warn(f"{stage}(ckpt_path='last'): the newest checkpoint ({header.path}, step {header.global_step}) "
                       f"is older than this Trainer's fit (step {trainer.global_step}); the module is evaluated as it "
                       "is, as Lightning does without a last checkpoint. Set ModelCheckpoint(save_last=True) to keep "
                       "one.")
        return None
    print(f"xtrainer: resuming from {header.describe()}", flush=True)
    trainer.run.resumed_by_path = ckpt_path != "last"  # a file the user named (or "best"): never pruned
    return header.path


def keep_weights_only(checkpoint: dict[str, Any]) -> None:
    """Strip ``checkpoint`` to the module's weights, its hyperparameters and the loop counters."""
    checkpoint.update(optimizer_states=[], lr_schedulers=[], callbacks={}, weights_only=True)
    checkpoint.pop("rng_states", None)


def fitted_checkpoint(trainer: "TrainerView", model: Any) -> dict[str, Any]:
    """A weights-only checkpoint of a module after its fit (on the host; the replicas are gone)."""
    from xtrainer import __version__

    checkpoint = {
        "format": ckpt_format.FORMAT, "format_version": ckpt_format.FORMAT_VERSION,
        "xtrainer_version": __version__, "strategy": trainer.strategy.name, "world_size": 1,
        "epoch": trainer.current_epoch, "global_step": trainer.global_step,
        "state_dict": model.state_dict(),
        "loops": {"global_step": trainer.global_step, "epoch": max(0, trainer.current_epoch - 1),
                  "batches_in_epoch": 0, "epoch_finished": True, "seed": trainer.loop.seed,
                  "batches_stepped": trainer.loop.batches_stepped},
        "hyper_parameters": ckpt_format.plain_hparams(model.hparams),
        "hparams_name": model._hparams_name,
    }
    keep_weights_only(checkpoint)
    return checkpoint


def restore_datamodule(trainer: "TrainerView", checkpoint: dict[str, Any]) -> None:
    """The data module's state, before its loader hooks are asked for loaders (as in Lightning)."""
    if trainer.datamodule is not None and "datamodule" in checkpoint:
        trainer.datamodule.load_state_dict(checkpoint["datamodule"])


def restore_module(trainer: "TrainerView", checkpoint: dict[str, Any], path: str, stage: str) -> None:
    """What Lightning restores before the optimizers are made, after the data module's state
    (``restore_datamodule``): the module's ``on_load_checkpoint`` (first, so that it can change
    what is loaded: rename the keys of a layer that moved, or unfreeze what
    ``configure_optimizers`` will then optimize), its weights, and the callbacks'
    ``on_load_checkpoint`` and their states, in every stage (after ``test(ckpt_path=...)`` a
    fresh Trainer's ``ModelCheckpoint`` knows the fit's ``best_model_path``)."""
    trainer.module.on_load_checkpoint(checkpoint)
    try:
        trainer.strategy.load_module_state_dict(trainer.model, checkpoint)
    except CheckpointError as err:
        raise CheckpointError(f"Cannot resume from {path!r}: {err}") from None
    if stage == "fit" and checkpoint.get("weights_only"):
        raise CheckpointError(
            f"{path!r} holds the module's weights only (save_weights_only=True, or Trainer.save_checkpoint(..., "
            "weights_only=True)): no optimizer or loop state to resume a fit from. Start a new fit from its weights "
            "with Model.load_from_checkpoint(path), or evaluate it with validate/test(ckpt_path=path).")
    for cb in trainer.callbacks:
        cb.on_load_checkpoint(trainer, trainer.module, checkpoint)
    for cb in trainer.callbacks:
        if cb.state_key in checkpoint.get("callbacks", {}):
            cb.load_state_dict(checkpoint["callbacks"][cb.state_key])


def restore_training(trainer: "TrainerView", checkpoint: dict[str, Any], path: str) -> None:
    """A fit's state once its optimizers are made: theirs, the schedulers', the loop's position,
    the generators, and inside an epoch its accumulated values and data order."""
    strategy = trainer.strategy
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
    if not loops["epoch_finished"]:
        warn_if_the_epoch_continues_differently(trainer, checkpoint)
    trainer.loop.load_state_dict(loops)
    set_rng_states(checkpoint.get("rng_states"), trainer.strategy)
    metrics = loops.get("callback_metrics") or {}
    trainer.callback_metrics.update(metrics)
    if loops.get("epoch_schedulers_due") and loops["epoch_finished"] and trainer.run.optim.automatic:
        # Saved at the epoch's end, before its schedulers stepped: they step now, as they did then.
        step_schedulers(trainer.lr_scheduler_configs, "epoch", loops["epoch"] + 1, metrics)
    if not loops["epoch_finished"]:  # inside an epoch: its accumulated values and its data order go on
        rank, size = trainer.global_rank, trainer.world_size
        saved = epoch_results_of_replica(checkpoint.get("epoch_results"), rank, size)
        trainer.run.train_results.load_state_dict(saved, trainer.strategy.device)
        trainer.run.restored_data_state = of_this_replica(checkpoint.get("data_state"), rank, size)


def warn_if_the_epoch_continues_differently(trainer: "TrainerView", checkpoint: dict[str, Any]) -> None:
    """Resuming inside an epoch: a warning when the rest of the epoch is not the batches the saved
    run would have trained on (the data's layout, ``DeviceData.layout``, differs, or is not known
    while the world size changed). The same global batch over another number of replicas is the
    same batches: no warning."""
    saved_size = checkpoint.get("world_size", trainer.world_size)
    states = checkpoint.get("data_state")
    saved = states[0].get("layout") if isinstance(states, list) and states and isinstance(states[0], dict) else None
    data = trainer.run.train_data
    now = data.layout() if hasattr(data, "layout") else None
    if saved is not None and saved == now:
        return
    if saved is None or now is None:
        if saved_size == trainer.world_size:
            return  # the same replicas: each draws its own share again (its generators are restored)
        why = ("the data is sharded differently (a sampler of the loader's own, or a checkpoint from before "
               "xtrainer recorded how its batches were made)")
    else:
        changed = ", ".join(f"{name} {saved.get(name)} -> {now.get(name)}" for name in sorted(now)
                            if saved.get(name) != now.get(name))
        why = f"the global batches are made differently ({changed})"
    rank_zero_warn(
        f"Resuming inside an epoch with {trainer.world_size} replicas from a checkpoint of {saved_size}: {why}, "
        "so the rest of this epoch is not exactly the batches the original run would have seen.")


def per_replica(strategy: Any, value: Any) -> list[Any]:
    """``value`` of every replica, in rank order (a host rendezvous with several replicas, as all
    of a save is)."""
    return strategy.collectives.all_gather_object(value) if strategy.world_size > 1 else [value]


def of_this_replica(values: Any, rank: int, world_size: int) -> Any:
    """This replica's item of a ``per_replica`` list saved by as many replicas (else None)."""
    return values[rank] if isinstance(values, list) and len(values) == world_size else None


def rng_states(strategy: Any) -> dict[str, Any]:
    """Every random generator's state, to continue a resumed run with the same random numbers:
    Python's, NumPy's and torch's CPU generators (shared by a process) and each replica's XLA
    generator (a host rendezvous with several replicas, as all of a save is)."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _numpy is not None:  # as plain lists: the checkpoint stays loadable with torch.load(weights_only=True)
        name, keys, pos, has_gauss, cached = _numpy.random.get_state()
        states["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]  # a NumPy array: no device involved
    xla = strategy.runtime.rng_state()
    states["xla"] = strategy.collectives.all_gather_object(xla) if strategy.world_size > 1 else [xla]
    return states


def set_rng_states(states: dict[str, Any] | None, strategy: Any) -> None:
    rank, world_size = strategy.global_rank, strategy.world_size
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
    strategy.runtime.set_rng_state(xla[rank] if len(xla) == world_size else strategy.runtime.derived_rng_state(xla[0], rank))


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, NumPy's and torch's random generators. A fit then derives its shuffling
    order and each replica's XLA generator from this seed, so runs repeat exactly. As in
    Lightning: no seed reads ``PL_GLOBAL_SEED``, else 0 (warned, unless ``verbose=False``), one
    outside NumPy's range is 0 (warned), and the seed is left in ``PL_GLOBAL_SEED`` (and
    ``workers`` in ``PL_SEED_WORKERS``) for code that reads them. DataLoader workers are seeded
    from torch's generator."""
    if seed is None:
        given = os.environ.get("PL_GLOBAL_SEED")
        try:
            seed = int(given) if given is not None else None
        except ValueError:
            seed = None
        if seed is None:
            if verbose:
                rank_zero_warn("seed_everything(): no seed given" + (f" (PL_GLOBAL_SEED={given!r} is not a number)"
                                                                      if given is not None else "") + "; seed set to 0.")
            seed = 0
    seed = int(seed)
    if not 0 <= seed < 2**32:
        if verbose:
            rank_zero_warn(f"seed_everything({seed}): NumPy takes seeds from 0 to {2**32 - 1}; seed set to 0.")
        seed = 0
    os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"] = str(seed), str(int(workers))
    random.seed(seed)
    if _numpy is not None:
        _numpy.random.seed(seed)
    torch.manual_seed(seed)
    return seed
