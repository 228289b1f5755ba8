"""A stage (``fit``, ``validate``, ``test``, ``predict``), both halves.

In the calling process (``fit``, ``evaluate``, ``launch``): the data prepared and torn down
(``loaders.py``), the checkpoint it starts from resolved, the run folder claimed, the replicas
started through the strategy's launcher (``strategies/launchers/__init__.py``), rank 0's results
brought home, and a run that failed before it wrote anything leaving no folder.

In each replica (``run_stage``, what the launcher runs): the environment, the module's setup, its
data on the device, the optimizers, the checkpoint it continues from, then the fit loop
(``fit.py``) or an evaluation (``evaluation.py``), and the teardown, also when it fails; what it
returns travels to the calling process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer import compile_cache
from xtrainer.checkpoint import background as ckpt_background
from xtrainer.checkpoint import folders as ckpt_folders
from xtrainer.datamodule import XDataModule
from xtrainer.launch import interrupts
from xtrainer.loop import checkpoints, evaluation, loaders, metric_sync
from xtrainer.loop import fit as fit_loop
from xtrainer.loop.optimization import Optimization
from xtrainer.loop.results import Results
from xtrainer.loop.run import run_cleanup
from xtrainer.loop.steps import batch_transfer, check_eval_step, check_module
from xtrainer.module import XModule
from xtrainer.states import TrainerState
from xtrainer.strategies.base import StepDispatcher
from xtrainer.strategies.data import padded_samples
from xtrainer.strategies.launchers import SpmdProcess
from xtrainer.trainer_view import TrainerView


# ---- the calling process ---------------------------------------------------------------------
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
                launch(trainer, "fit", model, sources, ckpt_path)
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
        cluster = trainer.cluster_environment
        # a cluster's requeue signal ends the stage (nothing to save), then the cluster requeues the job
        with interrupts.ending_stage_on(cluster.stop_signals() if cluster is not None else (), stage):
            try:
                results = launch(trainer, stage, model, sources, ckpt_path)
            except interrupts.TrainingInterrupted as stop:
                if cluster is not None:
                    cluster.stopped(stop.signal)
                raise
    except BaseException as err:
        error = err
        raise
    finally:
        run_cleanup([("the data module's teardown", lambda: loaders.teardown(trainer, stage))], error)
    if verbose and stage != "predict":
        evaluation.print_results(stage, results)
    return results


def launch(trainer: TrainerView, stage: str, model: XModule, sources: dict[str, list | None], ckpt_path: Any) -> Any:
    """Start the replicas of ``stage`` and return rank 0's outputs; where the replicas ran in
    other processes, rank 0's weights, loop state, metrics and callback states come home."""
    resolved = checkpoints.resolve_once(trainer, ckpt_path, stage)
    trainer.ckpt_path = resolved
    claims = claims_run_folder()
    if claims:
        trainer.claim_log_dir()  # here, in the calling process, so that every replica shares one run folder
    # Decided here, so that every replica agrees: it seeds the samplers' shuffling (with the
    # epoch) and each replica's XLA random generator (with its rank).
    trainer.loop.draw_seed(torch.initial_seed() % 2**31)
    trainer.run.interrupted = False
    # its metrics are its own (Lightning resets them too), and ``model`` is ``lightning_module`` once it is over
    trainer.run.publisher.reset_metrics()
    trainer.run.last_module = model
    launcher = trainer.strategy.launcher
    try:
        # Held still from here until every replica has read it (``run_stage`` lets go): another
        # run of the lineage resuming at the same moment may prune it meanwhile.
        with ckpt_folders.pinned(resolved) if resolved is not None else contextlib.nullcontext() as readable:
            result = launcher.launch(functools.partial(run_stage, trainer), stage, model, sources, readable)
    except BaseException as err:
        # (where the replicas ran in other processes, the caller's Trainer learns it here)
        trainer.run.interrupted = isinstance(err, (interrupts.TrainingInterrupted, KeyboardInterrupt))
        if not launcher.runs_in_caller:  # what ran, and how it ended, for trainer.state
            trainer.run.state, trainer.run.ended_by_exception = TrainerState("idle", stage, trainer.run), True
        if claims:
            remove_if_empty(trainer.log_dir)  # a run that failed before writing anything leaves no folder
        raise
    if "state_dict" in result:  # replicas ran elsewhere: bring rank 0's results home
        load_home(trainer, stage, model, result["state_dict"])
        trainer.loop.adopt(result["loop"])
        trainer.run.state, trainer.run.ended_by_exception = TrainerState("idle", stage, trainer.run), False
        trainer.should_stop = result["should_stop"]
        trainer.run.publisher.reset_metrics(result["callback_metrics"], result["logged_metrics"],
                                            result["progress_bar_metrics"])
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
    learns rank 0's folder when its replica starts (``run_stage``) and claims nothing, so
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


# ---- each replica ---------------------------------------------------------------------------
def run_stage(trainer: "TrainerView", stage: str, module: "XModule", sources: dict[str, list | None], ckpt_path: str | None
        ) -> dict[str, Any]:
    """One replica's run of ``stage``: its environment, the module's setup, its data on the device,
    the optimizers, a checkpoint to continue from, then the fit loop or an evaluation, and the
    teardown, also when it fails. What it returns travels to the calling process."""
    run = trainer.run
    compile_cache.activate(trainer)  # goodput: before this process's first compilation
    trainer.strategy.setup_environment()
    run.replica_ready = True
    if trainer.world_size > 1:
        # On several hosts each calling process claimed a folder and drew a seed of its own (under
        # torchrun only rank 0 claimed one: claims_run_folder); rank 0's are the run's, and a folder
        # claimed for nothing is given back.
        own = trainer.log_dir_claimed
        ours = trainer.log_dir if trainer.is_global_zero else own
        folder, trainer.loop.seed = trainer.strategy.collectives.broadcast((ours, trainer.loop.seed))
        trainer.adopt_log_dir(folder)
        if own is not None and own != folder:
            remove_if_empty(own)
    trainer.strategy.runtime.seed_replica(trainer.loop.seed, trainer.global_rank, trainer.strategy.launcher.runs_in_caller)
    run.state, trainer.should_stop, run.agreement.stop_agreed = TrainerState(stage, stage, run), False, False
    run.ended_by_exception = False
    module.trainer = trainer
    run.module = module
    in_process, error = trainer.strategy.launcher.runs_in_caller, None
    background_writes = trainer.settings.async_checkpointing
    ckpt_background.stage_starts(background_writes)  # goodput: background checkpoint writes, during this run only
    try:
        for cb in trainer.callbacks:
            cb.setup(trainer, module, stage)
        if trainer.datamodule is not None:
            trainer.datamodule.trainer = trainer  # a replica's copy of the data module
        module.setup(stage)
        # Read now (lazily: its tensors when asked for): a resumed data module's state comes back
        # before its loader hooks are asked for loaders, as in Lightning (a curriculum's batch size).
        checkpoint = trainer.strategy.checkpoint_layout.load(trainer.strategy.collectives, ckpt_path) \
            if ckpt_path is not None else None
        if checkpoint is not None:
            checkpoints.restore_datamodule(trainer, checkpoint)
        run.wrapped = trainer.strategy.setup_module(StepDispatcher(module, trainer.precision))  # configure_model()
        run.transfer = batch_transfer(module, trainer.datamodule, trainer.strategy.device)
        trainer.strategy.use_module_hooks(module.backward if type(module).backward is not XModule.backward else None,
                                          moves_batches=run.transfer is not None)
        # Lightning's order: setup(stage) and configure_model(), then the loader hooks (the module
        # may build its datasets in setup, its tokenizer in configure_model), in every replica.
        sources = loaders.in_replica(trainer, module, sources)
        data = run.stage_data = {name: [run.device_data(dl) for dl in dls] for name, dls in sources.items()}
        warn_padded_evaluation(trainer, data)
        if stage == "fit":
            run.train_results = run.results = Results("train", default_on_step=True)
            run.train_data, run.restored_data_state = data["train"][0], None
            run.count_training_batches()
            run.num_val_batches = [run.num_batches(d, "validate") for d in data["validate"]]
        # Lightning's order: the checkpoint's module and callback states, then the optimizers
        # (configure_optimizers sees what on_load_checkpoint did), then theirs and the loop's.
        if checkpoint is not None:
            checkpoints.restore_module(trainer, checkpoint, trainer.ckpt_path or ckpt_path, stage)
        if stage == "fit":
            run.optim = Optimization()
            run.optim.setup(trainer)
            if checkpoint is not None:
                run.optim.prepare_resume(trainer, checkpoint)  # parameter groups added during the saved fit
                checkpoints.restore_training(trainer, checkpoint, trainer.ckpt_path or ckpt_path)
            # a fault-tolerant strategy's live peers (the fit's state served to them from here on),
            # and the state of one of them to heal from
            live = trainer.strategy.join_live_peers(lambda: checkpoints.build_checkpoint(trainer), checkpoint)
            if live is not None:
                checkpoints.restore_datamodule(trainer, live)
                checkpoints.restore_module(trainer, live, "a live peer's state", stage)
                checkpoints.restore_training(trainer, live, "a live peer's state")
        if checkpoint is not None:  # every replica has read it: the calling process's hold on it goes
            checkpoint = None
            with trainer.strategy.runtime.rng_state_kept():  # (a host rendezvous, which may cut an XLA graph)
                trainer.strategy.collectives.barrier("checkpoint read")
            ckpt_folders.unpin(ckpt_path)
        # an explicit metric.compute() in a hook syncs in the graph, on every replica alike
        with metric_sync.synced_through(module, trainer.strategy.collectives.all_gather_tensors, trainer.world_size):
            if stage == "fit":
                fit_loop.run_epochs(trainer, data["train"][0], data["validate"])
                outputs = None
            else:
                outputs = evaluation.run(trainer, stage, data[stage])
        ckpt_background.drain()  # goodput: every background write done (a failed one raises here)
        result: dict[str, Any] = {"outputs": outputs}
        if not in_process:
            result.update(
                state_dict=trainer.strategy.runtime.to_cpu(trainer.strategy.full_module_state_dict(run.wrapped)),  # host sync
                loop=dataclasses.replace(trainer.loop), should_stop=trainer.should_stop,
                callback_metrics=dict(trainer.callback_metrics), logged_metrics=dict(trainer.logged_metrics),
                progress_bar_metrics=dict(trainer.progress_bar_metrics),
                callbacks={cb.state_key: cb.state_dict() for cb in trainer.callbacks})
        return result
    except BaseException as err:
        error = err
        if not isinstance(err, interrupts.TrainingInterrupted):  # that one called the hook already
            run.call_on_exception(err)
        raise
    finally:
        failed, wrapped = error is not None, run.wrapped
        steps = [("the checkpoint writes' wait", lambda: ckpt_background.drain(raise_errors=False)),
                 # flush what was logged, also when training failed
                 ("closing the loggers", lambda: run.publisher.close(trainer, failed))]
        if wrapped is not None:
            steps.append((f"{type(trainer.strategy).__name__}.teardown",
                          lambda: trainer.strategy.teardown(wrapped, failed)))
        steps += [(f"{type(cb).__name__}.teardown", functools.partial(cb.teardown, trainer, module, stage))
                  for cb in trainer.callbacks]
        steps.append((f"{type(module).__name__}.teardown", functools.partial(module.teardown, stage)))
        try:
            run_cleanup(steps, error)
        finally:
            ckpt_background.stage_ends(background_writes)  # a save after the stage is written before it returns
            ckpt_background.drain(raise_errors=False)  # one a teardown hook queued
            run.state = TrainerState("idle", run.state.fn, run)
            run.end_stage()
            trainer.strategy.use_module_hooks()
            if trainer.strategy.launcher.group_ends_with_stage:
                run.replica_ready = False  # rank 0 ran here in a group now gone: the sizes are the plan's again


def warn_padded_evaluation(trainer: "TrainerView", data: dict[str, list]) -> None:
    """Say once per stage (rank 0) when the sampler put in an evaluation loader repeats samples
    to give every replica as many batches: the stage's values then count them twice."""
    for stage, datas in data.items():
        if stage == "train":
            continue
        for data_of_stage in datas:
            repeated, size = padded_samples(data_of_stage)
            if repeated:
                rank_zero_warn(f"{stage}: the {size} samples are dealt to {trainer.world_size} replicas by a "
                               f"DistributedSampler, which repeats {repeated} of them so that every replica gets as "
                               "many batches (as in Lightning): this stage's values count those twice. For exact "
                               f"values, {stage} with devices=1 or a dataset whose size divides by "
                               f"{trainer.world_size}.")
                break


def remove_if_empty(path: str) -> None:
    """Remove the run folder ``path`` if nothing was written in it (a claimed folder not used)."""
    try:
        os.rmdir(path)  # only an empty folder: anything written stays
    except OSError:
        pass
