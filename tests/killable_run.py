"""A fit with shuffling and dropout that can be killed mid-epoch (``python killable_run.py STRATEGY
ROOT KILL_AT_STEP``: SIGKILL once that many optimizer steps are done; 0: never)."""

import os
import signal
import sys

import torch
from conftest import Regressor, make_loader
from torch import nn

from xtrainer import Trainer
from xtrainer.callbacks import Callback, ModelCheckpoint

EPOCHS, SAVE_EVERY = 3, 3


class DropoutRegressor(Regressor):
    def __init__(self):
        super().__init__(optimizer="adam", lr=0.01)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))


class KillAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind, as on a preempted machine


def run(strategy, root, kill_at=0, ckpt_path=None):
    torch.manual_seed(0)
    model = DropoutRegressor()
    callbacks = [ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_top_k=2)]
    if kill_at:
        callbacks.append(KillAt(kill_at))
    trainer = Trainer(strategy=strategy, max_epochs=EPOCHS, default_root_dir=root, enable_progress_bar=False,
                      logger=False, callbacks=callbacks)
    trainer.fit(model, make_loader(shuffle=True), ckpt_path=ckpt_path)
    return trainer, model


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
