"""One scenario of the chaos harness (``benchmarks/chaos.py``): a tiny fit that hits itself, or
another process of its job, with a fault at a chosen point::

    python chaos_run.py --strategy S --devices N --root ROOT --state DIR [--ckpt last] [--steps 12]
        [--async] [--compile] [--fault TERM|INT|KILL|USR1|HANG|HANGC|FULL --target rank|launcher|all --rank R
         --when step|validation|epoch_end|save|resume|compile --at K] [--fill DIR] [--outside-kill]

The fit is ``native_run``'s exact module (float64, SGD with momentum) on shuffled data with
validation every 4 steps, a checkpoint every 2 steps and ``last``; 8 batches an epoch. ``--when``:
``step``: at the end of global step K; ``validation``: in the first validation batch after step K;
``epoch_end``: in the first epoch's ``on_train_epoch_end``; ``save``: in the middle of writing the
checkpoint of step K (half its bytes written; in the background writer with ``--async``);
``resume``: at the first step this run makes (a resumed run: right after resuming); ``compile``:
once K files are in the compilation cache beside the run (``--compile``: ``torch.compile`` under
``native``, whose Inductor writes ``<root>/inductor_cache``; ``compilation_cache=True`` under
``xla_native``, ``<root>/xla_cache``), that is while the first step compiles. ``HANG``: a sample
of step K sleeps in ``__getitem__`` far past ``hang_timeout`` (``exit_on_hang=True``); where the
loader runs in a thread of its own beside thread replicas, in whichever replica's loader fetches
it. ``HANGC``: rank R sleeps alone at the end of step K, so that the other ranks wait for it in
the next step's collective. ``FULL``: at the end of step K the filesystem of ``--fill DIR`` (a
small tmpfs that holds the runs root) is filled up by another file, so that the next checkpoint
meets a full disk.
``--target``: ``rank``: rank R's own process; ``launcher``: the process that started the job (the
calling process, or rank R's torchrun: one node of two); ``all``: every process of the job (the
torchruns' pids are in ``launcher-N.pid``). A fault is sent once per job, also across torchrun's
restarts (``fired`` is on disk). ``--outside-kill``: the job runs as PID 1 of a PID namespace,
which no signal without a handler reaches from inside: a SIGKILL or SIGUSR1 of the launcher is
asked of the harness (``kill-request``), which sends it from outside.

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
from xtrainer.launch.hang_monitor import RunHung

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
            if due and _fire_once(None):  # once per job: not again in a worker torchrun restarted
                time.sleep(self.seconds)
        return self.data[i]


def _fire_once(targets) -> bool:
    """Marks the fault as sent (once per job: a worker torchrun restarted finds ``fired``); sends
    ``targets``' signal if given."""
    global _fired
    args = _args
    with _once:
        if _fired or os.path.exists(os.path.join(args.state, "fired")):
            _fired = True
            return False
        _fired = True
        _write(os.path.join(args.state, "fired"), str(time.time()))
    if targets is None:
        return True
    if args.fault == "FULL":
        _fill(args.fill)
        return True
    if args.fault == "HANGC":
        time.sleep(600)  # alone: the other ranks wait in the next collective
        return True
    signum = getattr(signal, f"SIG{args.fault}")
    me = os.getpid()
    if args.outside_kill and args.fault in ("KILL", "USR1") and 1 in targets:
        _write(os.path.join(args.state, "kill-request"), args.fault)  # the harness sends it from outside
        time.sleep(60)
        return True
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


def _fill(folder: str) -> None:
    """Fills the filesystem of ``folder`` up, as another program's file would."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 16, 4096, 512, 1):  # unbuffered: the last bytes too
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


def _watch_cache(folder: str, count: int, targets) -> None:
    """Sends the fault once ``count`` files are in ``folder`` (the compilation cache), from a
    thread: the first step is compiling and writing them."""
    def watch():
        while not _fired:
            found = sum(len(files) for _, _, files in os.walk(folder))
            if found >= count:
                _fire_once(targets)
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True, name="chaos-cache-watch").start()


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
        if args.target == "rank":  # the scenario's rank, also where another rank's write fires it (a save)
            if trainer.global_rank == args.rank:
                return [os.getpid()]
            return [int(open(os.path.join(args.state, f"rank-{args.rank}.pid")).read())]
        if args.target == "launcher":
            return [_launcher()]
        return sorted(set(_pids(args.state, "rank-") + _pids(args.state, "main-") + [_launcher()]
                          + _pids(args.state, "launcher-")))

    def _here(self, trainer) -> bool:
        who = self.args.rank if self.args.target in ("rank", "launcher") else 0
        return trainer.global_rank == who

    def setup(self, trainer, module, stage):
        global _args
        _args = self.args  # a started rank's process runs no main(): the scenario comes with the callback
        _local.trainer = _trainers[trainer.global_rank] = trainer
        _write(os.path.join(self.args.state, f"rank-{trainer.global_rank}.pid"), str(os.getpid()))
        if self.args.when == "save" and self.args.fault not in (None, "HANG"):
            self._during_save(trainer)
        if self.args.when == "compile" and self.args.fault not in (None, "HANG") and self._here(trainer):
            name = "xla_cache" if self.args.strategy.startswith("xla") else "inductor_cache"
            _watch_cache(os.path.join(_local_root(self.args.root), name), self.args.at, self._targets(trainer))

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


def _local_root(root: str) -> str:
    return os.path.abspath(root[len("file://"):] if root.startswith("file://") else root)


def fit(args) -> Trainer:
    world = int(os.environ.get("WORLD_SIZE", "0")) or args.devices
    data = native_run.make_data()
    if args.fault == "HANG":
        data = Faulty(data, args.rank if args.target == "rank" else 0, args.at, 600, BATCH // world)
    loader = DataLoader(data, batch_size=BATCH // world, shuffle=True)
    val = DataLoader(native_run.make_data(n=16, seed=1), batch_size=BATCH // world)
    callbacks = [ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=2), Chaos(args)]
    extra = {}
    if args.fault in ("HANG", "HANGC"):
        extra = dict(hang_timeout=args.hang_timeout, exit_on_hang=True)
    torch.manual_seed(0)
    model = native_run.ExactNet()
    devices = 1 if "TORCHELASTIC_RUN_ID" in os.environ else args.devices
    strategy = args.strategy
    if args.compile and strategy == "native":
        from xtrainer.strategies import NativeSingle

        strategy = NativeSingle(compile=True)
    elif args.compile:
        extra["compilation_cache"] = True  # the XLA CPU runtime writes it (and cannot load it)
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=args.steps, default_root_dir=args.root,
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
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fault", choices=["TERM", "INT", "KILL", "USR1", "HANG", "HANGC", "FULL"], default=None)
    parser.add_argument("--target", choices=["rank", "launcher", "all"], default="rank")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--when", choices=["step", "validation", "epoch_end", "save", "resume", "compile"],
                        default="step")
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=8.0)
    parser.add_argument("--fill", default=None, help="FULL: a folder on the small filesystem to fill")
    parser.add_argument("--outside-kill", action="store_true", help="the job is PID 1 of a PID namespace")
    _args = args = parser.parse_args()
    rank = os.environ.get("RANK", "0")
    _write(os.path.join(args.state, f"main-{rank}.pid"), str(os.getpid()))
    code: int | str = 0
    try:
        fit(args)
    except (TrainingInterrupted, RunHung) as err:  # as the xtrainer command exits for them
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
