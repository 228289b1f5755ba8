"""The evaluation loop (validation, test, predict), the sanity check before training, and the
results table ``validate``/``test`` print. Run by the Trainer in each replica."""

from __future__ import annotations

import re
from typing import Any

import torch

from xtrainer.loop.publishing import end_epoch
from xtrainer.loop.results import Results
from xtrainer.trainer_view import TrainerView


_HOOK_STAGE = {"validate": "validation", "test": "test", "predict": "predict"}


def run(trainer: "TrainerView", stage: str, datas: list, cap: int | None = None, in_fit: bool = False) -> Any:
    """One pass over every loader of ``stage``: metrics per loader, or the predictions.
    ``in_fit``: a fit's validation, no longer pending once its batches have run (a checkpoint
    written in its end hooks resumes after it)."""
    if not in_fit and not any(trainer.run.num_batches(data, stage) for data in datas):
        # No loader has a batch to give (limit_*_batches=0): nothing runs, no hook either, as in Lightning.
        return None if stage == "predict" else []
    hook = _HOOK_STAGE[stage]
    wrapped, module = trainer.model, trainer.module
    was_training = wrapped.training
    if in_fit:
        module.on_validation_model_zero_grad()
    getattr(module, f"on_{hook}_model_eval")()  # Lightning's: the model in eval mode
    results = trainer.run.results = Results(stage, default_on_step=False)
    predictions: list[list[Any]] = []
    if stage == "predict":  # each loader's batches' sample indices, as drawn (prediction writers' batch_indices)
        trainer.run.predict_batch_indices = []
    trainer.run.call(f"on_{hook}_start")
    trainer.run.call(f"on_{hook}_epoch_start")
    with torch.no_grad():
        for dl_idx, data in enumerate(datas):
            data.set_epoch(trainer.loop.current_epoch, trainer.loop.seed)
            extra = (dl_idx,) if len(datas) > 1 else ()
            results.suffix = f"/dataloader_idx_{dl_idx}" if len(datas) > 1 else ""
            results.loader = dl_idx
            limit = trainer.run.num_batches(data, stage)
            limit = limit if cap is None else min(cap, limit)
            outputs_of_loader: list[Any] = []
            seen = data.note_batch_indices() if stage == "predict" else None
            if stage == "predict":
                trainer.run.predict_batch_indices.append([])
            for batch_idx, batch in enumerate(data):
                if batch_idx >= limit:
                    break
                if seen is not None:
                    trainer.run.predict_batch_indices[dl_idx].append(seen.seen[batch_idx])
                if trainer.run.transfer is not None:
                    batch = trainer.run.transfer(batch, dl_idx)
                results.begin_batch(batch)  # values logged from here to the batch's end hooks are the batch's
                trainer.run.call(f"on_{hook}_batch_start", batch, batch_idx, *extra)
                outputs = wrapped(stage, batch, batch_idx, *extra)
                if stage == "predict":
                    # host sync: predictions are returned on the host, batch by batch
                    outputs = trainer.strategy.runtime.to_cpu(outputs)
                    outputs_of_loader.append(outputs)
                trainer.strategy.runtime.sync()  # the graph cut: one execution per evaluation batch
                trainer.run.call(f"on_{hook}_batch_end", outputs, batch, batch_idx, *extra)
                results.in_step = False
            predictions.append(outputs_of_loader)
    results.suffix = ""
    if in_fit:
        trainer.loop.validation_pending = False
    metrics = end_epoch(trainer, stage, f"on_{hook}_epoch_end")
    trainer.run.call(f"on_{hook}_end")
    if was_training and stage != "predict":
        getattr(module, f"on_{hook}_model_train")()  # back in training mode, as the fit left it
    elif was_training:
        wrapped.train()
    if stage == "predict":
        return predictions[0] if len(predictions) == 1 else predictions
    if len(datas) == 1:
        return [metrics]
    return [{k: v for k, v in metrics.items() if _logged_in(results, k, i)} for i in range(len(datas))]


_LOADER_IN_NAME = re.compile(r"/dataloader_idx_(\d+)")


def _logged_in(results: Results, key: str, loader: int) -> bool:
    """Whether ``key`` goes in the result of dataloader ``loader``, as in Lightning: a name with
    its ``/dataloader_idx_N`` in N's, one logged with ``add_dataloader_idx=False`` in the
    dataloaders it was logged in, anything else (a callback's own figure) in every one."""
    named = _LOADER_IN_NAME.search(key)
    if named is not None:
        return int(named.group(1)) == loader
    loaders = results.logged_in.get(key, results.logged_in.get(key.removesuffix("_epoch")))
    return loaders is None or loader in loaders


def validate_during_fit(trainer: "TrainerView", val: list) -> None:
    """A validation inside ``fit``; the training results are put back afterwards. None at all
    (no hooks either) where no loader has a batch to give (``limit_val_batches=0``), as in Lightning."""
    if not any(trainer.run.num_val_batches):
        trainer.loop.validation_pending = False
        return
    train_results = trainer.run.results
    run(trainer, "validate", val, in_fit=True)
    trainer.run.results = train_results


def sanity_check(trainer: "TrainerView", val: list) -> None:
    """Lightning's sanity check: the first ``num_sanity_val_steps`` batches of each validation
    loader, before training, to fail early on a broken ``validation_step``. Nothing it logs is
    kept, callbacks see ``trainer.sanity_checking``, and the random generators are left as they
    were, so a run with the check trains exactly as one without."""
    train_results = trainer.run.results
    trainer.run.sanity_checking = True
    steps = trainer.num_sanity_val_steps
    try:
        with trainer.strategy.runtime.rng_state_kept(), torch.random.fork_rng(devices=[]):
            for cb in trainer.callbacks:
                cb.on_sanity_check_start(trainer, trainer.module)
            run(trainer, "validate", val, cap=steps if steps > 0 else None)
            for cb in trainer.callbacks:
                cb.on_sanity_check_end(trainer, trainer.module)
    finally:
        trainer.run.sanity_checking = False
        trainer.run.results = train_results
    trainer.callback_metrics.clear()
    trainer.logged_metrics.clear()
    trainer.progress_bar_metrics.clear()


def print_results(stage: str, results: list[dict[str, float]]) -> None:
    """Lightning's table of ``validate``/``test`` results, printed by the calling process."""
    rows = [(name, value) for metrics in results for name, value in sorted(metrics.items())]
    if not rows:
        return
    width = max(len(name) for name, _ in rows)
    title = f"{'Validate' if stage == 'validate' else 'Test'} metric"
    print(f"{title:<{width}}  DataLoader 0")
    for name, value in rows:
        print(f"{name:<{width}}  {value:.6g}")
