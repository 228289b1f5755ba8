"""How long the training loop stalls per checkpoint save, synchronous against asynchronous.

    python benchmarks/checkpoint_stall.py [--width 2048] [--layers 6] [--saves 4]

An MLP of ``layers`` square ``width`` layers (SGD: the checkpoint is the weights and the loop
state) saves every 4 steps with ``ModelCheckpoint(save_top_k=-1)``; the stall per save is the
goodput account's ``checkpointing`` time (the time ``Trainer.save_checkpoint`` holds the loop)
divided by the saves. With ``async_checkpointing=True`` that is the copy off the device and the
host snapshot; the write happens in the background (and the end of ``fit`` waits for the last one,
which is not counted as a stall). Printed as a Markdown table for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from xtrainer import Trainer, XModule  # noqa: E402
from xtrainer.callbacks import ModelCheckpoint  # noqa: E402
from xtrainer.goodput import Goodput  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=4)
    args = parser.parse_args()

    class Wide(XModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    data = DataLoader(TensorDataset(torch.randn(64, args.width)), batch_size=8)
    size = sum(p.numel() * 4 for p in Wide().parameters()) / 1e6
    rows = []
    for background in (False, True):
        with tempfile.TemporaryDirectory() as root:
            account = Goodput(summary=False)
            start = time.perf_counter()
            Trainer(max_steps=4 * args.saves, default_root_dir=root, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_xla_health=False, async_checkpointing=background,
                    callbacks=[account, ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)]).fit(Wide(), data)
            wall = time.perf_counter() - start
            stall = account.record["seconds"]["checkpointing"] / args.saves
            rows.append(("asynchronous" if background else "synchronous", stall, wall))
    print(f"| saves ({size:.0f} MB each) | stall per save | whole fit |\n| --- | ---: | ---: |")
    for name, stall, wall in rows:
        print(f"| {name} | {stall:.2f} s | {wall:.1f} s |")


if __name__ == "__main__":
    main()
