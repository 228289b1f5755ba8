"""``XDataModule``: data preparation and loaders in one object, with Lightning's hook names."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from xtrainer.module import BatchTransferHooks, HyperparametersMixin, class_only

#: The loader hook of each stage, on a data module or on the module itself.
LOADER_HOOKS = {"train": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
                "predict": "predict_dataloader"}


class XDataModule(BatchTransferHooks, HyperparametersMixin):
    """Subclass this instead of ``lightning.LightningDataModule``; the hook names are the same.

    ``prepare_data()`` runs once per host, then ``setup(stage)``, both in the calling process
    before the replicas start; ``self.trainer`` is attached there and its ``world_size``,
    ``num_devices``, ``global_rank``, ``is_global_zero``... are already the run's (rank 0 of the
    planned replicas), so a global batch can be divided by the world size in ``setup``. The
    ``*_dataloader()`` hooks are then called in every replica, after the module's own
    ``setup(stage)`` (Lightning's order), on the replica's copy of this data module; each replica
    takes its own part of the loader through a distributed sampler. ``teardown(stage)`` runs in
    the calling process when the stage is over. ``state_dict()`` goes into checkpoints and comes
    back through ``load_state_dict()``.

    Define any of ``train_dataloader``, ``val_dataloader``, ``test_dataloader``,
    ``predict_dataloader``; ``Trainer.fit(model, datamodule=dm)`` uses them.
    """

    def __init__(self) -> None:
        self.trainer: Any = None

    def prepare_data(self) -> None:
        """Download or write data. Once per host, before ``setup``."""

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage`` (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``)."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built."""

    @classmethod
    def from_datasets(cls, train_dataset: Any = None, val_dataset: Any = None, test_dataset: Any = None,
                      predict_dataset: Any = None, batch_size: int = 1, num_workers: int = 0,
                      **datamodule_kwargs: Any) -> "XDataModule":
        """A data module over datasets, as Lightning's: each stage's ``DataLoader`` with
        ``batch_size`` and ``num_workers`` (the training one shuffled, unless it streams); a
        list or dict of datasets gives a list or dict of loaders. ``datamodule_kwargs`` go to
        ``__init__``."""
        datamodule = cls(**datamodule_kwargs)
        stages = (("train_dataloader", train_dataset, True), ("val_dataloader", val_dataset, False),
                  ("test_dataloader", test_dataset, False), ("predict_dataloader", predict_dataset, False))
        for hook, datasets, shuffle in stages:
            if datasets is not None:  # a partial of a module function: the data module still pickles
                loaders = functools.partial(_dataset_loaders, datasets, shuffle, batch_size, num_workers)
                setattr(datamodule, hook, loaders)
        return datamodule

    @class_only
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, hparams_file: str | os.PathLike | None = None,
                             **kwargs: Any) -> "XDataModule":
        """A new data module built from the hyperparameters a checkpoint recorded of the fit's
        data module (``kwargs`` override them), with its saved state (``load_state_dict``)."""
        from xtrainer.checkpoint import read_datamodule

        hparams, state = read_datamodule(checkpoint_path)
        if hparams_file is not None:
            from omegaconf import OmegaConf

            hparams = OmegaConf.to_container(OmegaConf.load(os.fspath(hparams_file)), resolve=True)
        hparams = {**hparams, **kwargs}
        parameters = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            hparams = {k: v for k, v in hparams.items() if k in parameters and k != "self"}
        datamodule = cls(**hparams)
        if state is not None:
            datamodule.load_state_dict(state)
        return datamodule

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of this data module (plain data)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "trainer": None}


def _dataset_loaders(datasets: Any, shuffle: bool, batch_size: int, num_workers: int) -> Any:
    """``XDataModule.from_datasets``' loaders: one per dataset, in the datasets' shape."""
    def one(dataset: Any) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and not isinstance(dataset, IterableDataset),
                          num_workers=num_workers)

    if isinstance(datasets, Mapping):
        return {key: one(value) for key, value in datasets.items()}
    if isinstance(datasets, (list, tuple)):
        return [one(value) for value in datasets]
    return one(datasets)
