"""``XDataModule``: data preparation and loaders in one object, with Lightning's hook names."""

from __future__ import annotations

from typing import Any

from xtrainer.module import BatchTransferHooks, HyperparametersMixin

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

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of this data module (plain data)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "trainer": None}
