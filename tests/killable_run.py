"""A fit with shuffling, dropout and validation that can be killed with SIGKILL at a chosen point.

    python killable_run.py STRATEGY ROOT DEVICES WHEN STEP [CKPT_PATH [OUT]]

``WHEN``: ``step`` (once STEP optimizer steps are done, after that step's checkpoint, if any),
``validation`` (right after the validation run that follows step STEP), ``save`` (in the middle
of writing the checkpoint of step STEP: half its bytes are on disk), or ``never``. The kill is
real (no clean-up of any kind, as on a preempted machine); with several replicas it takes down
the replicas' process. ``run(...)`` is the same fit, in the caller's process.
"""

import os
import signal
import sys

import torch
from conftest import Regressor, make_loader
from torch import nn

from xtrainer import Trainer
from xtrainer.callbacks import Callback, ModelCheckpoint

EPOCHS, SAVE_EVERY = 3, 2


class DropoutRegressor(Regressor):
    def __init__(self):
        super().__init__(optimizer="adam", lr=0.01)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(Callback):
    def __init__(self, when, step):
        self.when, self.step = when, step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.when == "step" and trainer.global_step == self.step:
            _die()

    def on_validation_end(self, trainer, module):
        if self.when == "validation" and trainer.global_step == self.step:
            _die()

    def setup(self, trainer, module, stage):
        if self.when == "save":
            _kill_while_writing(trainer, self.step)


def _kill_while_writing(trainer, step):
    """SIGKILL once half of the first file of the checkpoint of ``step`` is written."""
    from xtrainer.checkpoint import storage

    write = storage._HashingWriter.write

    def write_then_die(self, data):
        written = write(self, data)
        if trainer.global_step == step and self.size > 64:
            _die()
        return written

    storage._HashingWriter.write = write_then_die


def run(strategy, root, devices=1, when="never", step=0, ckpt_path=None):
    torch.manual_seed(0)
    model = DropoutRegressor()
    callbacks = [ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_top_k=2)]
    if when != "never":
        callbacks.append(KillAt(when, step))
    spmd = strategy in ("xla_spmd", "xla_fsdpv2")
    batch = 8 if spmd else 8 // devices  # SPMD loaders yield the global batch
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=EPOCHS, default_root_dir=root,
                      enable_progress_bar=False, logger=False, enable_xla_health=False, callbacks=callbacks)
    trainer.fit(model, make_loader(shuffle=True, batch_size=batch), make_loader(n=16, seed=1, batch_size=batch),
                ckpt_path=ckpt_path)
    return trainer, model


if __name__ == "__main__":
    # optional: CKPT_PATH (e.g. last) and a file to write the final weights to
    ckpt = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "none" else None
    _, final = run(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), ckpt_path=ckpt)
    if len(sys.argv) > 7:
        torch.save(final.state_dict(), sys.argv[7])
