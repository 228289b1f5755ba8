"""One task of the SLURM-requeue contender (``benchmarks/recovery_slurm.py``): the torchrun worker's
fit of ``benchmarks/recovery.py`` (the regressor of ``tests/ft_group.py``, 4 samples per step and
task, ``native_ddp``, a checkpoint every 10 steps, resumed from ``last``), as ``srun`` starts it on
each node of a job that is requeued when it loses a task::

    srun python benchmarks/recovery_slurm_job.py FOLDER STEPS [--pause SECONDS]

Each task writes ``FOLDER/pid-<rank>`` (its pid, at its first step) and appends
``<wall time> <global step> <SLURM_RESTART_COUNT>`` to ``FOLDER/steps-<rank>`` at every step's end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from ft_group import FEATURES, dataset  # noqa: E402
from xtrainer import Trainer, XModule, seed_everything  # noqa: E402
from xtrainer.callbacks import Callback, ModelCheckpoint  # noqa: E402

EVERY = 10  # a checkpoint every 10 steps (as benchmarks/recovery.py's torchrun contender)


class Regressor(XModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepClock(Callback):
    """Each step's end time and each task's pid; a pause per step (``seconds``)."""

    def __init__(self, folder: str, seconds: float) -> None:
        self.folder, self.seconds, self.noted = folder, seconds, False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.seconds:
            time.sleep(self.seconds)
        rank, restarts = trainer.global_rank, os.environ.get("SLURM_RESTART_COUNT", "0")
        if not self.noted:  # this process's first step (a requeued job's processes write theirs again)
            self.noted = True
            with open(os.path.join(self.folder, f"pid-{rank}"), "w") as f:
                f.write(str(os.getpid()))
        with open(os.path.join(self.folder, f"steps-{rank}"), "a") as f:
            f.write(f"{time.time():.6f} {trainer.global_step} {restarts}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("steps", type=int)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds each step sleeps")
    args = parser.parse_args()
    seed_everything(1)
    trainer = Trainer(strategy="native_ddp", devices="auto", num_nodes=int(os.environ["SLURM_NNODES"]),
                      max_steps=args.steps, max_epochs=1, default_root_dir=os.path.join(args.folder, "runs"),
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[StepClock(args.folder, args.pause),
                                 ModelCheckpoint(every_n_train_steps=EVERY, save_last=True)])
    trainer.fit(Regressor(), DataLoader(dataset(), batch_size=4), ckpt_path="last")


if __name__ == "__main__":
    main()
