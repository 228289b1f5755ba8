"""``native_run.py``'s exact fit under torchrun, with validation, where one rank sends a signal to
its own torchrun (its parent) at a chosen point, as a cluster signals one host's launcher::

    python trust3_signal_run.py --root ROOT --out OUT.pt --steps N [--ckpt last] [--pause SECONDS]
        [--ready FILE] [--signal TERM|INT --rank R --at STEP --where train|validation]

``--where train``: in ``on_train_batch_end`` of global step STEP; ``validation``: in the first
validation batch's end after step STEP. The rank then waits until torchrun's forwarded signal has
reached it, so that the stop is asked for at that very point. The other ranks get no signal.
Each process writes the code it exits with to ``ROOT/rank-R.exit`` (under torchrun the launcher,
not the test, sees the workers' exit codes), and ``ROOT/rank-R.signal`` with the signal
``interrupts.requested()`` answers at the fit's end. Exits 128 + signal after a graceful stop.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

import native_run
from xtrainer import Trainer, TrainingInterrupted, seed_everything
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.launch import interrupts


class SignalOwnLauncher(Callback):
    """Rank ``rank`` sends ``signum`` to its parent (torchrun) at global step ``at``."""

    def __init__(self, signum: int, rank: int, at: int, where: str) -> None:
        self.signum, self.rank, self.at, self.where = signum, rank, at, where
        self.sent = False

    def _maybe_signal(self, trainer) -> None:
        if self.sent or trainer.global_rank != self.rank or trainer.global_step != self.at:
            return
        self.sent = True
        os.kill(os.getppid(), self.signum)
        deadline = time.monotonic() + 20
        while interrupts.requested() is None:  # torchrun forwards it within its monitor interval
            if time.monotonic() > deadline:
                raise TimeoutError("torchrun did not forward the signal to its worker")
            time.sleep(0.01)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.where == "train":
            self._maybe_signal(trainer)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.where == "validation" and not trainer.sanity_checking:
            self._maybe_signal(trainer)


def fit(args, world_size: int, devices: int = 1):
    """Returns (trainer, model). ``world_size``: the processes the batch is split over (torchrun's,
    or ``devices`` started by the Trainer: the uninterrupted reference). Seeded: the strategy
    shuffles the training data of several processes with the run's seed, as Lightning does."""
    seed_everything(0)
    loader = DataLoader(native_run.make_data(), batch_size=8 // world_size)
    val = DataLoader(native_run.make_data(n=16, seed=1), batch_size=8 // world_size)
    callbacks = [ModelCheckpoint(every_n_train_steps=2, save_last=True),
                 native_run.Pause(args.pause, args.ready, args.root)]
    if args.signal:
        callbacks.append(SignalOwnLauncher(getattr(signal, f"SIG{args.signal}"), args.rank, args.at, args.where))
    model = native_run.ExactNet()
    trainer = Trainer(strategy="native_ddp", devices=devices, max_steps=args.steps, default_root_dir=args.root,
                      enable_progress_bar=False, enable_model_summary=False, logger=False, log_every_n_steps=2,
                      num_sanity_val_steps=0, val_check_interval=4, callbacks=callbacks)
    trainer.fit(model, loader, val, ckpt_path=args.ckpt)
    return trainer, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--signal", choices=["TERM", "INT"], default=None)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--at", type=int, default=-1)
    parser.add_argument("--where", choices=["train", "validation"], default="train")
    args = parser.parse_args()
    rank = os.environ.get("RANK", "0")
    code: int | str = 0
    try:
        trainer, model = fit(args, int(os.environ.get("WORLD_SIZE", "1")))
        weights = native_run.whole_weights(model)
        if trainer.is_global_zero:
            torch.save({"weights": weights, "global_step": trainer.global_step}, args.out)
    except TrainingInterrupted as err:
        print(err, file=sys.stderr)
        code = err.exit_code
    except BaseException as err:  # an error, not an exit: named so that a test sees it
        code = type(err).__name__
        raise
    finally:
        with open(os.path.join(args.root, f"rank-{rank}.signal"), "w") as f:
            f.write(str(interrupts.requested() or 0))
        with open(os.path.join(args.root, f"rank-{rank}.exit"), "w") as f:
            f.write(str(code))
    sys.exit(code)


if __name__ == "__main__":
    main()
