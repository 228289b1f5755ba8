"""How long resuming inside an epoch takes, at its start and 90% through.

    python benchmarks/resume_time.py [--batches 2000] [--sleep-ms 1]

A 2,000-batch epoch over a data set whose ``__getitem__`` sleeps 1 ms (a slow disk or decoder).
A checkpoint is written at batch 0 and at batch 1,800 of the first epoch; each is resumed in a
fresh Trainer, and the time from ``fit()`` to the first trained batch is measured (the resumed
epoch's first batch has to be read either way). Printed as a table for docs/checkpoints.md ("Resuming inside an epoch").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from conftest import Regressor  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from xtrainer import Trainer  # noqa: E402
from xtrainer.callbacks import Callback, ModelCheckpoint  # noqa: E402


class SlowData(Dataset):
    def __init__(self, n: int, sleep: float) -> None:
        self.x, self.y, self.sleep = torch.randn(n, 8), torch.randn(n, 1), sleep

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.sleep)
        return self.x[i], self.y[i]


class FirstBatch(Callback):
    def __init__(self) -> None:
        self.at = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.at is None:
            self.at = time.perf_counter()
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--sleep-ms", type=float, default=1.0)
    args = parser.parse_args()
    data = SlowData(args.batches, args.sleep_ms / 1000)
    loader = DataLoader(data, batch_size=1, shuffle=True)
    with tempfile.TemporaryDirectory() as root:
        rows = []
        for fraction in (0.0, 0.9):
            steps = int(args.batches * fraction)
            saver = ModelCheckpoint(every_n_train_steps=max(steps, 1), save_top_k=-1)
            if steps:
                Trainer(max_steps=steps, default_root_dir=root, enable_progress_bar=False, logger=False,
                        enable_xla_health=False, callbacks=[saver]).fit(Regressor(), loader)
                ckpt = saver.best_model_path
            else:
                ckpt = None
            first = FirstBatch()
            trainer = Trainer(max_epochs=1, default_root_dir=root, enable_progress_bar=False, logger=False,
                              enable_xla_health=False, enable_checkpointing=False, callbacks=[first])
            start = time.perf_counter()
            trainer.fit(Regressor(), loader, ckpt_path=ckpt)
            rows.append((steps, first.at - start))
        print("| resumed at batch | time to the first trained batch |\n| ---: | ---: |")
        for steps, seconds in rows:
            print(f"| {steps} of {args.batches} | {seconds:.2f} s |")


if __name__ == "__main__":
    main()
