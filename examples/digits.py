"""Train an MLP on scikit-learn's bundled digits (8x8 images, 10 classes; no download).

    python examples/digits.py                                  # defaults below
    python examples/digits.py --config examples/digits.yaml trainer.max_epochs=5 model.lr=1e-3
    python examples/digits.py trainer.devices=4 trainer.strategy=xla_ddp     # 4 replicas, even on a CPU

``data.batch_size`` is per replica: with ``trainer.devices=N`` each step trains on N of them.

Everything the run writes (TensorBoard logs, checkpoints, the resolved config.yaml) lands in one
run folder, ``<trainer.default_root_dir>/version_N``; the script prints where.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import Trainer, XModule
from xtrainer.config import TrainerConfig, load_config, save_config, trainer_kwargs


@dataclass
class ModelConfig:
    hidden: int = 256
    lr: float = 2e-3
    weight_decay: float = 1e-4


@dataclass
class DataConfig:
    batch_size: int = 64
    val_fraction: float = 0.2


@dataclass
class DigitsConfig:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        max_epochs=8, log_every_n_steps=10, default_root_dir="runs/digits"))


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


def digits_loaders(batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders over the 1,797 digits, pixel values scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    train = DataLoader(TensorDataset(x[train_idx], y[train_idx]), batch_size=batch_size, shuffle=True,
                       drop_last=True)
    val = DataLoader(TensorDataset(x[val_idx], y[val_idx]), batch_size=batch_size)
    return train, val


def main(argv: list[str]) -> dict[str, float]:
    cfg = load_config(DigitsConfig, argv)
    torch.manual_seed(cfg.seed)
    train, val = digits_loaders(cfg.data.batch_size, cfg.data.val_fraction, cfg.seed)
    model = DigitsClassifier(cfg.model.hidden, cfg.model.lr, cfg.model.weight_decay)
    trainer = Trainer(**trainer_kwargs(cfg.trainer))
    save_config(cfg, trainer.log_dir)
    trainer.fit(model, train, val)
    metrics = trainer.callback_metrics
    print(f"run folder: {trainer.log_dir}")
    print(f"validation accuracy: {metrics['val_acc']:.4f}")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
