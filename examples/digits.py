"""Train an MLP on scikit-learn's bundled digits (8x8 images, 10 classes; no download).

From the repository's root folder:

    xtrainer fit --config examples/digits.yaml                         # the configuration beside this file
    xtrainer fit --config examples/digits.yaml trainer.max_epochs=5 model.lr=1e-3
    xtrainer fit --config examples/digits.yaml trainer.devices=4 strategy=xla_ddp   # 4 replicas, even on a CPU
    python examples/digits.py trainer.max_epochs=5                    # the same, as a script

``data.batch_size`` is what each loader yields: per replica with ``xla_native``, ``xla_ddp`` and
``xla_fsdp`` (with ``trainer.devices=N`` a step trains on N such batches), and the step's whole
batch (each host's share on a pod), split over the devices, with ``xla_spmd`` and ``xla_fsdpv2``.
Everything the run writes (TensorBoard logs, checkpoints, the resolved config.yaml) lands in one
run folder, ``<trainer.default_root_dir>/version_N``; ``xtrainer fit --config <run folder>/config.yaml``
runs it again.
"""

from __future__ import annotations

import os
import sys

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import XModule

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.yaml")


class DigitsClassifier(XModule):
    def __init__(self, hidden: int = 256, lr: float = 2e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters(hidden=hidden, lr=lr, weight_decay=weight_decay)
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        # sync_dist: with several replicas, over the whole validation set, not rank 0's share
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(dim=-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])


class DigitsData:
    """Train and validation loaders over the 1,797 digits, pixel values scaled to [0, 1]."""

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> None:
        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        n_val = int(len(x) * val_fraction)
        self.batch_size = batch_size
        self.val = TensorDataset(x[order[:n_val]], y[order[:n_val]])
        self.train = TensorDataset(x[order[n_val:]], y[order[n_val:]])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    test_dataloader = val_dataloader


def main(argv: list[str]) -> dict[str, float]:
    """``xtrainer fit --config examples/digits.yaml *argv``; returns the final metrics."""
    from xtrainer.cli import run_stage
    from xtrainer.config import load

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # the configuration names examples.digits.*
        sys.path.insert(0, root)
    trainer, _ = run_stage("fit", load(["--config", CONFIG, *argv]))
    metrics = trainer.callback_metrics
    print(f"validation accuracy: {metrics['val_acc']:.4f}")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
