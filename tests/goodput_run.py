"""A small fit in a fresh process, for the goodput tests (compilation cache, hang watchdog, goodput).

    python goodput_run.py ROOT JSON_OPTIONS

``JSON_OPTIONS`` holds Trainer arguments plus: ``devices``, ``steps`` (max_steps), ``ckpt_path``,
``sleep_at`` / ``sleep_s`` (a callback sleeps that long in ``on_train_batch_start`` of that
global step), ``deadlock_at`` (there, the main thread locks a mutex it holds, in C with the GIL
held: stuck where no Python runs), ``term_at`` / ``kill_at`` (the process sends itself SIGTERM / SIGKILL after that global step),
``ckpt_every`` (a ``ModelCheckpoint`` saving every that many steps), ``goodput_write_every``
(``Goodput(write_every=...)``), ``die_writing`` (SIGKILL
in the middle of writing the checkpoint file whose name holds that text, printing the global step
the loop had reached; ``slow_write_s`` slows every write down), ``out`` (where to save the final
weights). The
Trainer's summary lines go to stdout.
"""

import json
import os
import signal
import sys
import time

import torch
from conftest import Regressor, make_loader

from xtrainer import Trainer
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.goodput import Goodput


class SleepInStep(Callback):
    def __init__(self, at, seconds):
        self.at, self.seconds = at, seconds

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at:
            sleep_inside_the_step(self.seconds)


def sleep_inside_the_step(seconds):
    time.sleep(seconds)


class DeadlockInStep(Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at:
            stuck_in_c_holding_the_gil()


def stuck_in_c_holding_the_gil():
    import ctypes

    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL
    mutex = ctypes.create_string_buffer(64)  # zeros: an unlocked default mutex
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # never returns, signals or not


class SignalAfter(Callback):
    def __init__(self, at, signum):
        self.at, self.signum = at, signum

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), self.signum)


class Progress(Callback):
    step = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        Progress.step = trainer.global_step


def die_while_writing(name, slow):
    """Every checkpoint write sleeps ``slow`` s per chunk; the one of a file named ``*name*`` ends
    the process (SIGKILL) after its first bytes."""
    from xtrainer.checkpoint import storage

    write_with, write = storage.write_with, storage._HashingWriter.write
    state = {"target": False}

    def slow_write(self, data):
        time.sleep(slow)
        written = write(self, data)
        if state["target"] and self.size > 64:
            print(f"killed while writing, loop at step {Progress.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    def watching(produce, path, *args, **kwargs):
        state["target"] = name in os.path.basename(path)
        return write_with(produce, path, *args, **kwargs)

    storage._HashingWriter.write, storage.write_with = slow_write, watching


def main():
    root, options = sys.argv[1], json.loads(sys.argv[2])
    callbacks = [Progress()]
    if "die_writing" in options:
        die_while_writing(options.pop("die_writing"), options.pop("slow_write_s", 0.0))
    if "sleep_at" in options:
        callbacks.append(SleepInStep(options.pop("sleep_at"), options.pop("sleep_s")))
    if "deadlock_at" in options:
        callbacks.append(DeadlockInStep(options.pop("deadlock_at")))
    if "term_at" in options:
        callbacks.append(SignalAfter(options.pop("term_at"), signal.SIGTERM))
    if "kill_at" in options:
        callbacks.append(SignalAfter(options.pop("kill_at"), signal.SIGKILL))
    if "goodput_write_every" in options:
        callbacks.append(Goodput(write_every=options.pop("goodput_write_every")))
    if "ckpt_every" in options:
        callbacks.append(ModelCheckpoint(every_n_train_steps=options.pop("ckpt_every"), save_top_k=-1))
    steps, ckpt = options.pop("steps", 8), options.pop("ckpt_path", None)
    # torch_xla's runtime unless the test names another strategy: the compilation cache, the thread
    # replicas and XLA's counters are what these runs look at
    kwargs = dict(strategy="xla_native", default_root_dir=root, max_steps=steps, enable_progress_bar=False,
                  logger=False, log_every_n_steps=2, callbacks=callbacks, enable_model_summary=False)
    out = options.pop("out", None)
    kwargs.update(options)
    model = Regressor()
    Trainer(**kwargs).fit(model, make_loader(64, 8), ckpt_path=ckpt)
    if out:
        torch.save(model.state_dict(), out)


if __name__ == "__main__":
    main()
