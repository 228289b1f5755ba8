"""Where a run's data comes from: the loaders given to ``fit``/``validate``/``test``/``predict``,
else a data module's hooks, else the module's own; ``prepare_data`` and the data module's
``setup``/``teardown`` in the calling process; the loader hooks called in every replica after the
module's ``setup(stage)`` (Lightning's order: the module may build its datasets there); reloading
the training loader every n epochs; and how many batches of a loader a run takes
(``limit_*_batches``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from xtrainer.config import arguments
from xtrainer.datamodule import LOADER_HOOKS, XDataModule
from xtrainer.module import XModule
from xtrainer.strategies.data import sequential_dataloader, shuffled_dataloader
from xtrainer.utilities.combined_loader import CombinedLoader, flatten
from xtrainer.trainer_view import TrainerView


_LIMIT_NAMES = {"validate": "val"}  # limit_val_batches


def prepare(trainer: "TrainerView", stage: str, model: XModule, datamodule: XDataModule | None, given: bool) -> None:
    """In the calling process, before any replica starts: the module's extra callbacks, then
    ``prepare_data`` (module, then data module) and the data module's ``setup(stage)``."""
    if datamodule is not None and not isinstance(datamodule, XDataModule):
        raise TypeError(f"datamodule must be an xtrainer.XDataModule, got {type(datamodule).__name__}.")
    if datamodule is not None and given:
        raise ValueError(f"{stage}() got both dataloaders and a datamodule; give one of them.")
    trainer.callbacks = arguments.with_module_callbacks(trainer.callbacks, model)
    trainer.run.datamodule = datamodule  # trainer.datamodule reads it
    model.trainer = trainer  # as in Lightning: prepare_data may read the Trainer's properties
    model.prepare_data()
    if datamodule is not None:
        datamodule.trainer = trainer
        datamodule.prepare_data()
        datamodule.setup(stage)


def teardown(trainer: "TrainerView", stage: str) -> None:
    if trainer.datamodule is not None:
        trainer.datamodule.teardown(stage)


def for_fit(trainer: "TrainerView", model: XModule, train_dataloaders: Any, val_dataloaders: Any
            ) -> dict[str, list | None]:
    """In the calling process: the loaders given to ``fit``, checked; ``None`` for a stage whose
    loaders come from a hook, which every replica calls after the module's ``setup(stage)``
    (``in_replica``), as Lightning does: the module may build its datasets there."""
    train = training_source(train_dataloaders, "fit(train_dataloaders=...)")
    if not train and _hook_owner(trainer, model, "train") is None:
        raise ValueError(f"fit() got no training data: pass train_dataloaders=..., a datamodule, or define "
                         f"{type(model).__name__}.train_dataloader().")
    val = evaluation_sources(val_dataloaders, "fit(val_dataloaders=...)")
    if val and not _validates(model):
        raise ValueError(f"Validation data was given but {type(model).__name__} has no validation_step.")
    return {"train": train or None, "validate": val or None}


def for_stage(trainer: "TrainerView", model: XModule, stage: str, dataloaders: Any) -> dict[str, list | None]:
    """In the calling process: the loaders given to ``validate``/``test``/``predict``, or ``None``
    for the hook's (called in every replica after ``setup``)."""
    loaders = evaluation_sources(dataloaders, f"{stage}(dataloaders=...)")
    if not loaders and _hook_owner(trainer, model, stage) is None:
        raise ValueError(f"{stage}() got no data: pass dataloaders=..., a datamodule, or define "
                         f"{type(model).__name__}.{LOADER_HOOKS[stage]}().")
    return {stage: loaders or None}


def in_replica(trainer: "TrainerView", model: XModule, sources: dict[str, list | None]) -> dict[str, list]:
    """In a replica, after ``setup(stage)``: every stage's loaders, the hooks asked for those the
    caller did not get (Lightning's order: ``prepare_data``, ``setup``, then the loader hooks)."""
    found: dict[str, list] = {}
    for stage, given in sources.items():  # "train" first in a fit
        if given is not None:
            found[stage] = list(given)
            trainer.run.loader_hooks.pop(stage, None)  # not reloaded from a hook of an earlier run
        elif stage == "validate" and "train" in sources and not _validates(model):
            found[stage] = []  # a fit without validation_step does not ask for validation data
        else:
            found[stage] = from_hooks(trainer, model, stage)
        if stage != "validate" or "train" not in sources:  # validation data is optional in a fit
            _check_found(trainer, model, stage, found[stage])
    if found.get("train"):
        found["train"] = [training_order(trainer, found["train"][0])]
    return found


def training_order(trainer: "TrainerView", loader: Any) -> Any:
    """The training loader in Lightning's order: in order for ``overfit_batches``; shuffled on
    several replicas with ``use_distributed_sampler`` (Lightning's ``DistributedSampler`` of a
    training loader shuffles, with the run's seed and the epoch, even where the loader was built
    with ``shuffle=False``); else as it was built."""
    if trainer.overfit_batches:
        return each_loader(loader, sequential_dataloader)
    if trainer.use_distributed_sampler and trainer.world_size > 1:
        return each_loader(loader, shuffled_dataloader)
    return loader


def training_source(loaders: Any, where: str) -> list:
    """The training data in ``loaders``, as a list of one loader: several (a dict, a list or a
    tuple of them) are read together as a ``CombinedLoader`` in ``max_size_cycle`` mode, as in
    Lightning; a ``CombinedLoader`` as it is. Empty: none given."""
    if loaders is None:
        return []
    if isinstance(loaders, CombinedLoader):
        if loaders.mode == "sequential":
            raise ValueError(f"{where}: fit does not read a CombinedLoader(mode='sequential') (one loader after "
                             "the other), as Lightning does not; use 'max_size_cycle', 'min_size' or 'max_size'.")
        return [loaders]
    if isinstance(loaders, (list, tuple)) and len(loaders) == 1:
        loaders = loaders[0]
    if isinstance(loaders, (Mapping, list, tuple)):
        return [CombinedLoader(loaders, "max_size_cycle")] if loaders else []
    return [loaders]


def evaluation_sources(loaders: Any, where: str) -> list:
    """The loaders of a ``validate``/``test``/``predict`` run (or a fit's validation), read one
    after the other: a dict's or a list's, nested as they may be, in order (``dataloader_idx``),
    as Lightning reads them; a ``CombinedLoader``'s, which must then be ``sequential``."""
    if isinstance(loaders, CombinedLoader):
        if loaders.mode != "sequential":
            raise ValueError(f"{where}: a CombinedLoader(mode={loaders.mode!r}) is read in training only; evaluation "
                             "reads its loaders one after the other: pass them as a list (or "
                             "CombinedLoader(..., mode='sequential')).")
        return loaders.flattened
    if isinstance(loaders, (Mapping, list, tuple)):
        return flatten(loaders)[0]
    return arguments.as_list(loaders)


def each_loader(source: Any, change: Any) -> Any:
    """``change(loader)`` of ``source``, or of each of a ``CombinedLoader``'s (a new one)."""
    if isinstance(source, CombinedLoader):
        combined = CombinedLoader(source.iterables, source.mode)
        combined.flattened = [change(loader) for loader in source.flattened]
        return combined
    return change(source)


def _check_found(trainer: "TrainerView", model: XModule, stage: str, found: list) -> None:
    what = "fit() got no training data" if stage == "train" else f"{stage}() got no data"
    if not found:
        owner = _hook_owner(trainer, model, stage)
        raise ValueError(f"{what}: {type(owner).__name__}.{LOADER_HOOKS[stage]}() returned nothing; return a "
                         "DataLoader (or pass the loaders to the Trainer's method).")


def _validates(model: XModule) -> bool:
    return type(model).validation_step is not XModule.validation_step


def _hook_owner(trainer: "TrainerView", model: XModule, stage: str) -> Any:
    """Who answers ``stage``'s loader hook: the data module if it defines it, else the module
    (None when neither does)."""
    hook = LOADER_HOOKS[stage]
    for owner in (trainer.datamodule, model):
        if owner is not None and callable(getattr(owner, hook, None)):
            return owner
    return None


def from_hooks(trainer: "TrainerView", model: XModule, stage: str) -> list:
    """The loaders the data module's hook for ``stage`` returns, else the module's own."""
    owner = _hook_owner(trainer, model, stage)
    if owner is None:
        return []
    trainer.run.loader_hooks[stage] = owner
    where = f"{type(owner).__name__}.{LOADER_HOOKS[stage]}()"
    returned = _call_hook(owner, LOADER_HOOKS[stage])
    return training_source(returned, where) if stage == "train" else evaluation_sources(returned, where)


def reloaded(trainer: "TrainerView", train: Any, first_epoch: int) -> Any:
    """``reload_dataloaders_every_n_epochs``: the training loader from its hook again (in a replica)."""
    every, owner = trainer.reload_dataloaders_every_n_epochs, trainer.run.loader_hooks.get("train")
    if not every or owner is None or trainer.current_epoch == first_epoch or trainer.current_epoch % every:
        return train
    loader = training_source(_call_hook(owner, LOADER_HOOKS["train"]), f"{type(owner).__name__}.train_dataloader()")
    if len(loader) != 1:
        raise ValueError(f"{type(owner).__name__}.train_dataloader() returned no loader on reload.")
    run = trainer.run
    run.train_data = run.device_data(training_order(trainer, loader[0]))
    run.count_training_batches()
    return run.train_data


def num_batches(data: Any, limit: int | float, stage: str) -> float:
    """The batches of ``data`` a run of ``stage`` takes under ``limit`` (``limit_<stage>_batches``):
    a fraction or a count; infinite for a loader without a length."""
    try:
        length: float = len(data)
    except TypeError:
        length = math.inf
    if isinstance(limit, float):
        if math.isinf(length):
            if limit != 1.0:
                raise ValueError(f"limit_{_LIMIT_NAMES.get(stage, stage)}_batches={limit} is a fraction, but the loader has no "
                                 "length; give a number of batches instead.")
            return length
        return int(length * limit) if limit < 1.0 else length
    return min(length, limit)


def _call_hook(owner: Any, hook: str) -> Any:
    fn = getattr(owner, hook, None)
    return fn() if callable(fn) else None
