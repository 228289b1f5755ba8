"""A script written with Lightning's ``LightningCLI``, its imports changed: the suite's module
(``conftest.Regressor``) and a data module, for tests/stories/lightning/test_lightning_cli.py, and a command line for
the runs that need their own processes::

    python lightning_cli_run.py fit --trainer.strategy native_ddp --trainer.devices 2 ...
"""

from __future__ import annotations

import torch
from conftest import Regressor
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import XDataModule as LightningDataModule
from xtrainer.cli import LightningCLI


class Data(LightningDataModule):
    def __init__(self, batch_size: int = 8, samples: int = 64):
        super().__init__()
        self.batch_size, self.samples = batch_size, samples

    def setup(self, stage):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 8, generator=g)
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


if __name__ == "__main__":
    cli = LightningCLI(Regressor, Data)
    if cli.trainer.is_global_zero and cli.subcommand == "fit":
        torch.save(cli.model.state_dict(), f"{cli.trainer.log_dir}/weights.pt")
