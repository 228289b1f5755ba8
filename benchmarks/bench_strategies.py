"""Steps per second of a hand-written torch_xla loop and of the Trainer, side by side.

    PJRT_DEVICE=CPU python benchmarks/bench_strategies.py [--steps 600] [--repeats 3]

The hand loop is torch_xla's documented native recipe: ``MpDeviceLoader`` for the data and
``xm.optimizer_step`` to step. Every contestant trains the same MLP (64-256-256-10, AdamW) on the
same data for the same number of steps; each is warmed up first (compilation is not timed) and
timed ``--repeats`` times, interleaved, keeping the best. Ratios are against the hand loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from xtrainer import Trainer, XModule  # noqa: E402
from xtrainer import _xla  # noqa: E402
from xtrainer.strategies import STRATEGIES  # noqa: E402

BATCH = 64


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_loader(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, 64, generator=g)
    y = torch.randint(0, 10, (steps * BATCH,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True)


class MLP(XModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def hand_loop(loader: DataLoader) -> float:
    device = _xla.device()
    net = make_net().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    start = time.perf_counter()
    for x, y in _xla.device_loader(loader, device):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        _xla.optimizer_step(opt)
    _xla.sync()
    _xla.to_cpu(list(net.parameters()))  # host sync: wait for the last step before stopping the clock
    return time.perf_counter() - start


def trainer_loop(loader: DataLoader, strategy: str, root: str) -> float:
    model = MLP()
    trainer = Trainer(strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    start = time.perf_counter()
    trainer.fit(model, loader)  # ends with the weights copied to the host: includes the last step
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    # The SPMD strategies run each fit in a process of their own, whose start-up this timing
    # would include: they are left out here.
    parser.add_argument("--strategies", nargs="*", default=["xla_native", "xla_ddp", "xla_fsdp"],
                        choices=sorted(STRATEGIES))
    args = parser.parse_args()
    loader = make_loader(args.steps)
    root = tempfile.mkdtemp(prefix="xtrainer-bench-")
    contestants = {"hand loop": lambda: hand_loop(loader)}
    for name in args.strategies:
        contestants[f"Trainer({name})"] = lambda name=name: trainer_loop(loader, name, root)
    for run in contestants.values():  # warm-up: compile every graph once
        run()
    best = {name: float("inf") for name in contestants}
    for _ in range(args.repeats):
        for name, run in contestants.items():
            best[name] = min(best[name], run())
    base = args.steps / best["hand loop"]
    print(f"{'contestant':<24}{'steps/s':>10}{'ratio':>8}")
    for name, seconds in best.items():
        rate = args.steps / seconds
        print(f"{name:<24}{rate:>10.1f}{rate / base:>8.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
