"""A fit that a signal stops (``python signal_run.py ROOT DEVICES WHEN [OUT]``).

``WHEN``: ``self-term:S`` (the fit sends itself SIGTERM after step S), ``self-int2:S`` (two SIGINTs
after step S), ``wait`` (it writes ``ROOT/pid`` with the replicas' process id at step 2 and goes on
slowly, for the test to signal it from outside), or ``resume`` (from ``last``, to the end). The
final weights go to OUT; ``SIGNAL_RUN_STRATEGY`` names the strategy (default ``auto``). Exit status: 143 or 130 after a graceful stop, as the command's.
"""

import os
import signal
import sys
import time

import torch
from conftest import make_loader
from killable_run import DropoutRegressor

from xtrainer import Trainer, TrainingInterrupted
from xtrainer.callbacks import Callback, ModelCheckpoint


class SignalAt(Callback):
    def __init__(self, when):
        self.when = when
        self.noted = None
        self.flags = None  # Lightning's trainer.interrupted and received_sigterm, as on_exception sees them

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        kind, _, step = self.when.partition(":")
        if kind == "wait":
            if trainer.global_step == 2 and trainer.is_global_zero:
                with open(os.path.join(os.path.dirname(trainer.log_dir), "pid"), "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(0.05)
        elif trainer.global_step == int(step or -1):
            os.kill(os.getpid(), signal.SIGINT if kind == "self-int2" else signal.SIGTERM)
            if kind == "self-int2":  # a second Ctrl-C, after the window in which it is the first one again
                from xtrainer.launch import interrupts

                time.sleep(interrupts.SAME_CTRL_C_SECONDS + 0.2)
                os.kill(os.getpid(), signal.SIGINT)

    def on_exception(self, trainer, module, exception):
        self.noted = type(exception).__name__  # saved with the checkpoint written next
        self.flags = (trainer.interrupted, trainer.received_sigterm)

    def state_dict(self):
        return {"noted": self.noted, "flags": self.flags}


def run(root, devices, when, ckpt_path=None):
    torch.manual_seed(0)
    model = DropoutRegressor()
    trainer = Trainer(strategy=os.environ.get("SIGNAL_RUN_STRATEGY", "auto"), devices=devices, max_epochs=3, default_root_dir=root, enable_progress_bar=False, logger=False,
                      log_every_n_steps=2, enable_xla_health=False,
                      callbacks=[ModelCheckpoint(every_n_epochs=1), SignalAt(when)])
    trainer.fit(model, make_loader(shuffle=True, batch_size=8 // devices), ckpt_path=ckpt_path)
    return trainer, model


if __name__ == "__main__":
    root, devices, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    try:
        _, model = run(root, devices, "none" if when == "resume" else when, "last" if when == "resume" else None)
    except TrainingInterrupted as err:
        print(err, file=sys.stderr)
        sys.exit(err.exit_code)
    if len(sys.argv) > 4:
        torch.save(model.state_dict(), sys.argv[4])
