"""One replica group of a ``native_ft`` fit, as tests/stories/native/test_fault_tolerance.py and
benchmarks/recovery.py start it: ``python tests/ft_group.py OUT_DIR GROUP GROUPS [options]``.

The module is a tiny linear regressor over samples that carry their index. It notes, in
``OUT_DIR/trained-<GROUP>.jsonl``, the sample indices of every step this group committed (at the
batch's end, so a killed process notes only what it finished), paces its steps
(``OUT_DIR/slow``: while that file exists each step sleeps ``--slow`` seconds), stops at the step
written in ``OUT_DIR/stop_at`` (every group checks it after each step, so all stop at the same
one), and writes ``OUT_DIR/result-<GROUP>-<pid>.pt`` at the end: its final weights, its
``uncommitted_steps``, ``healed_at`` and ``global_step``. ``--die-at N`` SIGKILLs this process in
the backward pass of the N-th step it trains, after ``--die-delay`` seconds (its peers are
waiting in the step's all-reduce by then). ``--compile`` runs the module through torch.compile
(``--cache off``: without the compilation cache). ``--ckpt-every N`` writes a checkpoint every
N steps (and ``last``) into ``OUT_DIR/group<GROUP>``; ``--resume`` continues from ``last``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xtrainer import Trainer, XModule, seed_everything  # noqa: E402
from xtrainer.callbacks import ModelCheckpoint  # noqa: E402
from xtrainer.strategies.native_ft import NativeFaultTolerant  # noqa: E402

SAMPLES, FEATURES = 4096, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g)
    return TensorDataset(torch.arange(SAMPLES), x, y)


class Noted(XModule):
    def __init__(self, out: str, group: int, die_at: int | None, die_delay: float, slow: float,
                 compile_net: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)
        self.out, self.group, self.die_at, self.die_delay, self.slow = out, group, die_at, die_delay, slow
        self.trained = 0
        self._ids: list[int] = []
        self._log = open(os.path.join(out, f"trained-{group}.jsonl"), "a")

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self._ids = ids.tolist()
        self._step = self.trainer.global_step
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.die_at is not None and self.trained + 1 == self.die_at:
            def die(grad):
                time.sleep(self.die_delay)  # the peers reach the step's all-reduce and wait in it
                os.kill(os.getpid(), signal.SIGKILL)
                return grad
            loss.register_hook(die)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trained += 1
        if self._step not in self.trainer.strategy.uncommitted_steps:
            self._log.write(json.dumps({"step": self._step, "ids": self._ids, "pid": os.getpid(),
                                        "time": time.time(), "cpu": time.process_time()}) + "\n")
            self._log.flush()
        if os.path.exists(os.path.join(self.out, "slow")):
            time.sleep(self.slow)
        stop = os.path.join(self.out, "stop_at")
        if os.path.exists(stop):
            text = open(stop).read().strip()
            if text and self.trainer.global_step >= int(text):
                self.trainer.should_stop = True

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("group", type=int)
    parser.add_argument("groups", type=int)
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=1, help="max_epochs (-1: as many as max_steps takes)")
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-delay", type=float, default=0.3)
    parser.add_argument("--slow", type=float, default=0.02)
    parser.add_argument("--quorum-timeout", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--compile", action="store_true", help="torch.compile the module")
    parser.add_argument("--ckpt-every", type=int, default=0, help="a checkpoint every N steps (and last)")
    parser.add_argument("--resume", action="store_true", help='ckpt_path="last"')
    parser.add_argument("--cache", choices=("on", "off"), default="on", help="the compilation cache")
    args = parser.parse_args()
    seed_everything(1)
    strategy = NativeFaultTolerant(lighthouse=args.lighthouse, replica_group=args.group,
                                   num_replica_groups=args.groups, timeout_seconds=args.timeout,
                                   quorum_timeout_seconds=args.quorum_timeout, connect_timeout_seconds=5.0,
                                   compile=args.compile)
    module = Noted(args.out, args.group, args.die_at, args.die_delay, args.slow)
    trainer = Trainer(strategy=strategy, max_steps=args.max_steps, max_epochs=args.epochs,
                      default_root_dir=os.path.join(args.out, f"group{args.group}"), enable_progress_bar=False,
                      logger=False, enable_checkpointing=bool(args.ckpt_every), enable_model_summary=False,
                      num_sanity_val_steps=0, compilation_cache=args.cache == "on",
                      callbacks=[ModelCheckpoint(every_n_train_steps=args.ckpt_every, save_last=True)]
                      if args.ckpt_every else [])
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=False)
    trainer.fit(module, loader, ckpt_path="last" if args.resume else None)
    torch.save({"state_dict": {k: v.clone() for k, v in module.state_dict().items()},
                "uncommitted_steps": strategy.uncommitted_steps, "healed_at": strategy.healed_at,
                "global_step": trainer.global_step},
               os.path.join(args.out, f"result-{args.group}-{os.getpid()}.pt"))


if __name__ == "__main__":
    main()
