"""One replica's run: what happens between a launcher starting a replica and handing its result
back (the environment, setup, the stage, teardown), and the checkpoint it continues from."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer import compile_cache
from xtrainer.launch import interrupts
from xtrainer.loop import loaders, metric_sync
from xtrainer.checkpoint import background as ckpt_background
from xtrainer.loop import checkpoints, evaluation
from xtrainer.loop import fit as fit_loop
from xtrainer.loop.optimization import Optimization
from xtrainer.loop.results import Results
from xtrainer.loop.run import run_cleanup
from xtrainer.loop.steps import StepDispatcher, batch_transfer
from xtrainer.module import XModule
from xtrainer.strategies.data import padded_samples
from xtrainer.trainer_view import TrainerView


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
        # torchrun only rank 0 claimed one: launch/stages.py); rank 0's are the run's, and a folder
        # claimed for nothing is given back.
        own = trainer.log_dir_claimed
        ours = trainer.log_dir if trainer.is_global_zero else own
        trainer.log_dir, trainer.loop.seed = trainer.strategy.collectives.broadcast((ours, trainer.loop.seed))
        if own is not None and own != trainer.log_dir:
            remove_if_empty(own)
    trainer.strategy.runtime.seed_replica(trainer.loop.seed, trainer.global_rank, trainer.strategy.launcher.runs_in_caller)
    run.state, trainer.should_stop, run.publisher.stop_agreed = stage, False, False
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
        # Lightning's order: setup(stage), then the loader hooks (the module may build its
        # datasets in setup), in every replica.
        sources = loaders.in_replica(trainer, module, sources)
        run.wrapped = trainer.strategy.setup_module(StepDispatcher(module, trainer.precision))
        run.transfer = batch_transfer(module, trainer.datamodule, trainer.strategy.device)
        trainer.strategy.use_module_hooks(module.backward if type(module).backward is not XModule.backward else None,
                                          moves_batches=run.transfer is not None)
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
            checkpoints.restore_module(trainer, checkpoint, ckpt_path, stage)
        if stage == "fit":
            run.optim = Optimization()
            run.optim.setup(trainer)
            if checkpoint is not None:
                run.optim.prepare_resume(trainer, checkpoint)  # parameter groups added during the saved fit
                checkpoints.restore_training(trainer, checkpoint, ckpt_path)
            # a fault-tolerant strategy's live peers (the fit's state served to them from here on),
            # and the state of one of them to heal from
            live = trainer.strategy.join_live_peers(lambda: checkpoints.build_checkpoint(trainer), checkpoint)
            if live is not None:
                checkpoints.restore_datamodule(trainer, live)
                checkpoints.restore_module(trainer, live, "a live peer's state", stage)
                checkpoints.restore_training(trainer, live, "a live peer's state")
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
            run.state = "idle"
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
