"""One scenario of the chaos harness (``benchmarks/chaos.py``): a tiny fit that hits itself, or
another process of its job, with a fault at a chosen point::

    python chaos_run.py --strategy S --devices N --root ROOT --state DIR [--ckpt last] [--steps 12]
        [--async] [--fault TERM|INT|KILL|USR1|HANG --target rank|launcher|all --rank R
         --when step|validation|epoch_end|save|resume --at K]

The fit is ``native_run``'s exact module (float64, SGD with momentum) on shuffled data with
validation every 4 steps, a checkpoint every 2 steps and ``last``; 8 batches an epoch. ``--when``:
``step``: at the end of global step K; ``validation``: in the first validation batch after step K;
``epoch_end``: in the first epoch's ``on_train_epoch_end``; ``save``: in the middle of writing the
checkpoint of step K (half its bytes written; in the background writer with ``--async``);
``resume``: at the first step this run makes (a resumed run: right after resuming). ``HANG``: a
sample of step K sleeps in ``__getitem__`` far past ``hang_timeout`` (``exit_on_hang=True``); where
the loader runs in a thread of its own beside thread replicas, in whichever replica's loader
fetches it.
``--target``: ``rank``: rank R's own process; ``launcher``: the process that started the job (the
calling process, or torchrun); ``all``: every process of the job.

Written under DIR (outside the runs root): ``main-R.pid`` (the process that runs this script, per
torchrun rank), ``rank-R.pid`` (each rank's process), ``progress`` (rank 0's global step after each
batch, for faults sent from outside), ``fired`` once the fault was sent, ``main-R.exit`` (the code
this script exits with, or the name of the exception), and ``weights.pt`` (rank 0's whole weights
at the end of a fit that finished). Imports nothing of torch_xla itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import native_run
from xtrainer import Trainer, TrainingInterrupted
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.launch import interrupts

BATCH = 8  # the global batch: 8 steps an epoch of 64 samples
_local = threading.local()  # the replica's trainer, for the dataset (replicas may be threads of one process)
_trainers: dict = {}  # rank: trainer, for a loader that runs in a thread of its own (XLA's)
_once = threading.Lock()
_fired = False


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Faulty(Dataset):
    """``native_run.make_data()``, where one rank's first sample of step ``at`` (counted in fetches:
    ``per_step`` a step) sleeps ``seconds``."""

    def __init__(self, data, rank: int, at: int, seconds: float, per_step: int) -> None:
        self.data, self.rank, self.at, self.seconds, self.per_step = data, rank, at, seconds, per_step
        self.fetched = 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        # Counted by fetch, not by the trainer's step: XLA's loader fetches ahead, in a thread of its own.
        trainer = getattr(_local, "trainer", None) or _trainers.get(self.rank)
        if trainer is not None and trainer.global_rank == self.rank:
            with _once:
                self.fetched += 1
                due = self.fetched > self.at * self.per_step
            if due:
                _fire_once(None)
                time.sleep(self.seconds)
        return self.data[i]


def _fire_once(targets) -> bool:
    """Marks the fault as sent (once per process); sends ``targets``' signal if given."""
    global _fired
    with _once:
        if _fired:
            return False
        _fired = True
    args = _args
    _write(os.path.join(args.state, "fired"), str(time.time()))
    if targets is None:
        return True
    signum = getattr(signal, f"SIG{args.fault}")
    me = os.getpid()
    for pid in targets:
        if pid != me:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    if me in targets:
        os.kill(me, signum)
    if args.fault in ("TERM", "INT"):
        deadline = time.monotonic() + 20  # a forwarded signal (torchrun's, the caller's) arrives a little later
        while interrupts.requested() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    return True


def _pids(state: str, prefix: str) -> list[int]:
    return sorted({int(open(os.path.join(state, name)).read()) for name in os.listdir(state)
                   if name.startswith(prefix) and name.endswith(".pid")})


def _launcher() -> int:
    """The process that started the job: torchrun (this worker's parent), else the script's process."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.getppid()
    return int(open(os.path.join(_args.state, "main-0.pid")).read())


class Chaos(Callback):
    """Sends the scenario's fault at its point; writes the pids and rank 0's progress."""

    def __init__(self, args) -> None:
        self.args = args
        self.started = False

    def _targets(self, trainer) -> list[int]:
        args = self.args
        if args.target == "rank":
            return [os.getpid()]
        if args.target == "launcher":
            return [_launcher()]
        return sorted(set(_pids(args.state, "rank-") + _pids(args.state, "main-") + [_launcher()]))

    def _here(self, trainer) -> bool:
        who = self.args.rank if self.args.target == "rank" else 0
        return trainer.global_rank == who

    def setup(self, trainer, module, stage):
        global _args
        _args = self.args  # a started rank's process runs no main(): the scenario comes with the callback
        _local.trainer = _trainers[trainer.global_rank] = trainer
        _write(os.path.join(self.args.state, f"rank-{trainer.global_rank}.pid"), str(os.getpid()))
        if self.args.when == "save" and self.args.fault not in (None, "HANG"):
            self._during_save(trainer)

    def on_train_start(self, trainer, module):
        _local.trainer = trainer

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            _write(os.path.join(self.args.state, "progress"), str(trainer.global_step))
        first, self.started = not self.started, True
        if not self._here(trainer) or self.args.fault in (None, "HANG"):
            return
        if (self.args.when == "step" and trainer.global_step == self.args.at) or (
                self.args.when == "resume" and first):
            _fire_once(self._targets(trainer))

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if (self.args.when == "validation" and not trainer.sanity_checking and trainer.global_step >= self.args.at
                and self._here(trainer) and self.args.fault not in (None, "HANG")):
            _fire_once(self._targets(trainer))

    def on_train_epoch_end(self, trainer, module):
        if self.args.when == "epoch_end" and self._here(trainer) and self.args.fault not in (None, "HANG"):
            _fire_once(self._targets(trainer))

    def _during_save(self, trainer) -> None:
        """The fault once half of the first file of the checkpoint of step ``at`` is written."""
        from xtrainer.checkpoint import storage

        write, callback = storage._HashingWriter.write, self
        if getattr(write, "chaos", False):
            return  # thread replicas: patched once for the process

        def write_then_fault(writer, data):
            written = write(writer, data)
            if trainer.global_step >= callback.args.at and writer.size > 64:  # a background write runs later
                _fire_once(callback._targets(trainer))
            return written

        write_then_fault.chaos = True
        storage._HashingWriter.write = write_then_fault

    def on_train_end(self, trainer, module):
        weights = native_run.whole_weights(module)  # every rank: FSDP2's shards are gathered
        if trainer.is_global_zero:
            torch.save({"weights": weights, "global_step": trainer.global_step},
                       os.path.join(self.args.state, "weights.pt"))


def fit(args) -> Trainer:
    world = int(os.environ.get("WORLD_SIZE", "0")) or args.devices
    data = native_run.make_data()
    if args.fault == "HANG":
        data = Faulty(data, args.rank if args.target == "rank" else 0, args.at, 600, BATCH // world)
    loader = DataLoader(data, batch_size=BATCH // world, shuffle=True)
    val = DataLoader(native_run.make_data(n=16, seed=1), batch_size=BATCH // world)
    callbacks = [ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=2), Chaos(args)]
    extra = {}
    if args.fault == "HANG":
        extra = dict(hang_timeout=args.hang_timeout, exit_on_hang=True)
    torch.manual_seed(0)
    model = native_run.ExactNet()
    devices = 1 if "TORCHELASTIC_RUN_ID" in os.environ else args.devices
    trainer = Trainer(strategy=args.strategy, devices=devices, max_steps=args.steps, default_root_dir=args.root,
                      enable_progress_bar=False, enable_model_summary=False, logger=False, log_every_n_steps=2,
                      num_sanity_val_steps=0, val_check_interval=4, callbacks=callbacks,
                      async_checkpointing=args.async_, **extra)
    trainer.fit(model, loader, val, ckpt_path=args.ckpt)
    return trainer


_args = None


def main() -> None:
    global _args
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--root", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--async", dest="async_", action="store_true")
    parser.add_argument("--fault", choices=["TERM", "INT", "KILL", "USR1", "HANG"], default=None)
    parser.add_argument("--target", choices=["rank", "launcher", "all"], default="rank")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--when", choices=["step", "validation", "epoch_end", "save", "resume"], default="step")
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=8.0)
    _args = args = parser.parse_args()
    rank = os.environ.get("RANK", "0")
    _write(os.path.join(args.state, f"main-{rank}.pid"), str(os.getpid()))
    code: int | str = 0
    try:
        fit(args)
    except TrainingInterrupted as err:
        print(err, file=sys.stderr)
        code = err.exit_code
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
        raise
    except BaseException as err:  # an error, not an exit: named so that the harness sees it
        code = type(err).__name__
        raise
    finally:
        _write(os.path.join(args.state, f"main-{rank}.exit"), str(code))
    sys.exit(code)


if __name__ == "__main__":
    main()
