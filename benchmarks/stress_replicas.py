"""Stress test of several replicas on the XLA CPU runtime: many fits, counting hangs and failures.

    python benchmarks/stress_replicas.py                      # 20 runs of each case
    python benchmarks/stress_replicas.py --runs 5 --devices 4 --strategies xla_fsdp

Each run is a separate ``python`` process training a small regressor for 2 epochs with
``Trainer(devices=N)``, checked for identical weights on every replica (the parent compares the
weights rank 0 returned with the ones each replica wrote). A run that has not finished after
``--timeout`` seconds counts as a hang and is killed. Prints one line per case: runs, failures,
hangs, and wall time (median and max, including the ~8 s start-up of the replicas' process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported below

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from xtrainer import Trainer, XModule, _xla  # noqa: E402
from xtrainer.callbacks import Callback  # noqa: E402


class Regressor(XModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SaveWeights(Callback):
    """Every replica writes its whole weights (FSDP: gathered) at the end of the fit."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_end(self, trainer, module):
        weights = _xla.to_cpu(trainer.strategy.full_module_state_dict(trainer.model))
        torch.save(weights, os.path.join(self.folder, f"rank-{trainer.global_rank}.pt"))


def one_run(strategy: str, devices: int, folder: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32 // devices)
    model = Regressor()
    Trainer(strategy=strategy, devices=devices, max_epochs=2, logger=False, enable_progress_bar=False,
            enable_checkpointing=False, default_root_dir=folder, callbacks=[SaveWeights(folder)]).fit(model, data)
    for rank in range(devices):
        saved = torch.load(os.path.join(folder, f"rank-{rank}.pt"))
        for name, tensor in model.state_dict().items():
            if not torch.equal(saved[name], tensor):
                raise SystemExit(f"replica {rank} differs from rank 0 in {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["xla_native", "xla_ddp", "xla_fsdp"])
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--one", nargs=2, metavar=("STRATEGY", "DEVICES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as folder:
            one_run(args.one[0], int(args.one[1]), folder)
        return
    print(f"{'case':<16}{'runs':>6}{'failed':>8}{'hangs':>7}{'median s':>10}{'max s':>8}", flush=True)
    for devices in args.devices:
        for strategy in args.strategies:
            times, failed, hangs = [], 0, 0
            for _ in range(args.runs):
                start = time.perf_counter()
                try:
                    done = subprocess.run([sys.executable, __file__, "--one", strategy, str(devices)],
                                          capture_output=True, text=True, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    hangs += 1
                    continue
                times.append(time.perf_counter() - start)
                if done.returncode != 0:
                    failed += 1
                    print(f"  {strategy} x{devices} failed:\n{done.stderr[-2000:]}", flush=True)
            median = statistics.median(times) if times else float("nan")
            print(f"{f'{strategy} x{devices}':<16}{args.runs:>6}{failed:>8}{hangs:>7}{median:>10.1f}"
                  f"{max(times, default=float('nan')):>8.1f}", flush=True)


if __name__ == "__main__":
    main()
