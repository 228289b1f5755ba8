"""A stage (``fit``, ``validate``, ``test``, ``predict``) as the calling process runs it: the data
prepared and torn down (``loaders.py``), the checkpoint it starts from resolved, the run folder
claimed, the replicas started through the strategy's launcher (``strategies/launchers/__init__.py``), rank
0's results brought home, and a run that failed before it wrote anything leaving no folder.
What each replica then does is ``loop/replica.py``."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from xtrainer.datamodule import XDataModule
from xtrainer.launch import interrupts
from xtrainer.loop import checkpoints, evaluation, loaders, replica
from xtrainer.loop.replica import remove_if_empty
from xtrainer.loop.run import run_cleanup
from xtrainer.loop.steps import check_eval_step, check_module
from xtrainer.strategies.launchers import SpmdProcess
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


def fit(trainer: TrainerView, model: XModule, train_dataloaders: Any, val_dataloaders: Any,
        datamodule: XDataModule | None, ckpt_path: Any) -> None:
    """``Trainer.fit``: the data of the fit, then the replicas, under a graceful stop on SIGTERM/SIGINT."""
    check_module(model, "fit")
    if isinstance(train_dataloaders, XDataModule):  # Lightning accepts it in this place too
        train_dataloaders, datamodule = None, train_dataloaders
    loaders.prepare(trainer, "fit", model, datamodule,
                    given=train_dataloaders is not None or val_dataloaders is not None)
    error = None
    cluster = trainer.cluster_environment
    try:
        sources = loaders.for_fit(trainer, model, train_dataloaders, val_dataloaders)
        if cluster is not None:
            ckpt_path = _cluster_ckpt_path(trainer, cluster.fit_ckpt_path(ckpt_path), ckpt_path)
        # SIGTERM/SIGINT (and a cluster's requeue signal): finish the step, write a checkpoint, raise
        with interrupts.graceful(also=cluster.stop_signals() if cluster is not None else ()):
            try:
                run(trainer, "fit", model, sources, ckpt_path)
            except interrupts.TrainingInterrupted as stop:
                if cluster is not None:
                    cluster.stopped(stop.signal)  # the checkpoint is written: SLURM's requeue, say
                raise
    except BaseException as err:
        error = err
        raise
    finally:  # a data module's teardown that fails too does not hide the fit's error
        run_cleanup([("the data module's teardown", lambda: loaders.teardown(trainer, "fit"))], error)


def _cluster_ckpt_path(trainer: TrainerView, wanted: Any, given: Any) -> Any:
    """The checkpoint a fit of a restarted cluster job starts from: ``wanted`` (``"last"`` of a
    requeued SLURM job), unless the run has no checkpoint yet and the user gave one (``given``)."""
    if wanted == "last" and given not in (None, "last") and trainer.resolve_ckpt_path("last") is None:
        return given
    return wanted


def evaluate(trainer: TrainerView, stage: str, model: XModule, dataloaders: Any, ckpt_path: Any, verbose: bool,
             datamodule: XDataModule | None) -> Any:
    """``Trainer.validate``/``test``/``predict`` of ``model``: its data, then the replicas; the
    results table printed when ``verbose``."""
    if isinstance(dataloaders, XDataModule):
        dataloaders, datamodule = None, dataloaders
    check_module(model, stage)
    if datamodule is None and dataloaders is None:
        datamodule = trainer.datamodule  # the fit's, if it had one
    loaders.prepare(trainer, stage, model, datamodule, given=dataloaders is not None)
    error = None
    try:
        sources = loaders.for_stage(trainer, model, stage, dataloaders)
        check_eval_step(model, stage)
        results = run(trainer, stage, model, sources, ckpt_path)
    except BaseException as err:
        error = err
        raise
    finally:
        run_cleanup([("the data module's teardown", lambda: loaders.teardown(trainer, stage))], error)
    if verbose and stage != "predict":
        evaluation.print_results(stage, results)
    return results


def run(trainer: TrainerView, stage: str, model: XModule, sources: dict[str, list | None], ckpt_path: Any) -> Any:
    """Start the replicas of ``stage`` and return rank 0's outputs; where the replicas ran in
    other processes, rank 0's weights, loop state, metrics and callback states come home."""
    resolved = checkpoints.resolve_once(trainer, ckpt_path, stage)
    trainer.ckpt_path = resolved
    claims = claims_run_folder()
    if claims:
        trainer.log_dir  # claimed here, in the calling process, so that every replica shares one run folder
    # Decided here, so that every replica agrees: it seeds the samplers' shuffling (with the
    # epoch) and each replica's XLA random generator (with its rank).
    trainer.loop.draw_seed(torch.initial_seed() % 2**31)
    trainer.run.interrupted = False
    # its metrics are its own (Lightning resets them too), and ``model`` is ``lightning_module`` once it is over
    trainer.callback_metrics, trainer.logged_metrics, trainer.progress_bar_metrics = {}, {}, {}
    trainer.run.last_module = model
    launcher = trainer.strategy.launcher
    try:
        result = launcher.launch(functools.partial(replica.run_stage, trainer), stage, model, sources, resolved)
    except BaseException as err:
        # (where the replicas ran in other processes, the caller's Trainer learns it here)
        trainer.run.interrupted = isinstance(err, (interrupts.TrainingInterrupted, KeyboardInterrupt))
        if claims:
            remove_if_empty(trainer.log_dir)  # a run that failed before writing anything leaves no folder
        raise
    if "state_dict" in result:  # replicas ran elsewhere: bring rank 0's results home
        load_home(trainer, stage, model, result["state_dict"])
        trainer.loop.adopt(result["loop"])
        trainer.should_stop = result["should_stop"]
        trainer.callback_metrics = result["callback_metrics"]
        trainer.logged_metrics = result["logged_metrics"]
        trainer.progress_bar_metrics = result["progress_bar_metrics"]
        for cb in trainer.callbacks:
            cb.load_state_dict(result["callbacks"].get(cb.state_key, {}))
    return result["outputs"]


def load_home(trainer: TrainerView, stage: str, model: XModule, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's weights into the calling process's ``model``, where the replicas ran on copies of
    it (the XLA strategies with several devices). A parameter or buffer that a hook added to the
    replicas' copies (or took from them, or reshaped) has no place here: a one-line error names
    it and says what to do, instead of ``load_state_dict``'s strict refusal."""
    own = model.state_dict()
    changed = ([f"{name} (added)" for name in state if name not in own]
               + [f"{name} (gone)" for name in own if name not in state]
               + [f"{name} ({tuple(own[name].shape)} -> {tuple(state[name].shape)})" for name in state
                  if name in own and own[name].shape != state[name].shape])
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise RuntimeError(
            f"strategy={trainer.strategy.name!r} trained copies of {type(model).__name__} in its replicas, and their "
            f"parameters or buffers changed during {stage}: "
            f"{shown}; rank 0's weights cannot be loaded back into the module here, which keeps the weights it had "
            "(the run's checkpoints hold the trained ones). Create every submodule, parameter and buffer in the "
            "module's __init__ (not in a hook such as on_fit_start), or use a native strategy (native_ddp, "
            "native_fsdp), whose rank 0 trains this very module in this process.")
    model.load_state_dict(state)


def claims_run_folder() -> bool:
    """Whether this calling process claims the run folder (and writes what the ``xtrainer``
    command writes and prints there): every one but a process of rank other than 0 that torchrun
    (or a launcher setting its variables: ``RANK``, ``WORLD_SIZE``...) started. Such a process
    learns rank 0's folder when its replica starts (``loop/replica.py``) and claims nothing, so
    that a run, and each of torchrun's restarts, makes one folder."""
    from xtrainer.strategies.process_group import in_process_group_env

    rank = os.environ.get("RANK", "0")
    return not (in_process_group_env() and rank.isdigit() and int(rank) != 0)


def planned_world_size(trainer: TrainerView) -> int:
    """The replicas the launch will start (before it has): what ``trainer.world_size`` says in the
    calling process, as in Lightning."""
    planned = trainer.strategy.launcher.planned_world_size()
    if planned is not None:
        return planned
    if isinstance(trainer.strategy.launcher, SpmdProcess):
        return trainer.num_nodes  # one SPMD process per host
    return trainer.num_devices * trainer.num_nodes
