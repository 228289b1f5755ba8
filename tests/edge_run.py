"""A fit that is stopped at an awkward moment, to be resumed and compared bitwise.

    python edge_run.py SPEC_JSON

``SPEC_JSON`` holds ``root``, and optionally: ``devices`` (1), ``strategy`` ("auto"), ``epochs`` (3),
``accumulate`` (1), ``val_check_interval`` (1.0), ``log_every_n_steps`` (50), ``sampler``
("shuffle", "weighted", "subset" or "iterable"), ``checkpoint`` (keyword arguments of the
``ModelCheckpoint``; default: Lightning's default one), ``event`` (what stops the run, below),
``resume`` (true: from ``last``) and ``out`` (where the final weights and metrics go).

``event``: ``term@E:B`` (SIGTERM to itself after batch B of epoch E), ``term@val:E`` (SIGTERM
during the validation at the end of epoch E), ``kill@valend:S`` (SIGKILL right after the
validation that follows step S, once every callback has seen it). With several replicas rank 0
sends the signal; SIGKILL takes down the replicas' process. Exit status: 128 + the signal after
a graceful stop, as the command's.
"""

import json
import os
import signal
import sys

import torch
from conftest import make_data
from killable_run import DropoutRegressor
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler, WeightedRandomSampler

from xtrainer import Trainer, TrainingInterrupted
from xtrainer.callbacks import Callback, ModelCheckpoint


class ShuffledStream(IterableDataset):
    """An iterable dataset that shuffles with torch's global generator when an epoch starts."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        for i in torch.randperm(len(self.data)).tolist():
            yield self.data[i]


class StopAt(Callback):
    def __init__(self, event):
        self.event = event or ""

    def _signal(self, trainer, signum):
        if trainer.is_global_zero:
            os.kill(os.getpid(), signum)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        kind, _, where = self.event.partition("@")
        if kind == "term" and not where.startswith("val"):
            epoch, batch = (int(x) for x in where.split(":"))
            if trainer.current_epoch == epoch and batch_idx == batch:
                self._signal(trainer, signal.SIGTERM)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.event.startswith("term@val:") and not trainer.sanity_checking and batch_idx == 0 \
                and trainer.current_epoch == int(self.event.split(":")[1]):
            self._signal(trainer, signal.SIGTERM)


class KilledAfterValidation(DropoutRegressor):
    """``kill@valend:S``: SIGKILL in the module's ``on_validation_end``, which runs after every
    callback's (the checkpoint callback's included), as in Lightning."""

    kill_step = -1

    def on_validation_end(self):
        if not self.trainer.sanity_checking and self.trainer.global_step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


def loader(sampler, batch_size):
    data = make_data(64)
    if sampler == "weighted":
        return DataLoader(data, batch_size, sampler=WeightedRandomSampler(torch.linspace(0.1, 1.0, 64), 64))
    if sampler == "subset":
        return DataLoader(data, batch_size, sampler=SubsetRandomSampler(list(range(0, 64, 2)) + [1, 3, 5, 7]))
    if sampler == "iterable":
        return DataLoader(ShuffledStream(data), batch_size)
    return DataLoader(data, batch_size, shuffle=True)


def run(spec):
    torch.manual_seed(0)
    event = spec.get("event") or ""
    model = DropoutRegressor()
    if event.startswith("kill@valend:"):
        KilledAfterValidation.kill_step = int(event.split(":")[1])
        model = KilledAfterValidation()
    devices = spec.get("devices", 1)
    checkpoint = spec.get("checkpoint")
    callbacks = [StopAt(spec.get("event"))]
    if checkpoint is not None:
        callbacks.insert(0, ModelCheckpoint(**checkpoint))
    trainer = Trainer(strategy=spec.get("strategy", "auto"), devices=devices, max_epochs=spec.get("epochs", 3),
                      default_root_dir=spec["root"], enable_progress_bar=False, logger=False,
                      enable_xla_health=False, num_sanity_val_steps=0,
                      accumulate_grad_batches=spec.get("accumulate", 1),
                      val_check_interval=spec.get("val_check_interval", 1.0),
                      log_every_n_steps=spec.get("log_every_n_steps", 50), callbacks=callbacks)
    batch_size = 8 // devices
    trainer.fit(model, loader(spec.get("sampler", "shuffle"), batch_size),
                DataLoader(make_data(16, seed=1), batch_size), ckpt_path="last" if spec.get("resume") else None)
    return trainer, model


def outcome(trainer, model):
    """What two runs are compared on: the weights and the epoch-level values."""
    return {"state_dict": model.state_dict(), "global_step": trainer.global_step,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    try:
        trainer, model = run(spec)
    except TrainingInterrupted as err:
        print(err, file=sys.stderr)
        sys.exit(err.exit_code)
    if spec.get("out"):
        torch.save(outcome(trainer, model), spec["out"])
