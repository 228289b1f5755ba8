"""The native strategies against hand-written PyTorch loops, on the CPU (no torch_xla needed).

    python benchmarks/native.py                 # every contender, 3 repeats
    python benchmarks/native.py --steps 200 --repeats 1 --contenders hand native

Contenders, each training the digits-sized MLP of ``run.py`` (64-256-256-10, AdamW(lr=1e-3),
batches of 64 per process) for the same steps:

- ``hand``: the plain eager loop in one process; ``native``: the Trainer with ``strategy="native"``.
- ``hand_ddp``: the loop of PyTorch's DDP tutorial on 2 processes over gloo
  (``DistributedSampler``, ``DistributedDataParallel``); ``native_ddp``: the Trainer with
  ``strategy="native_ddp", devices=2``.
- ``..._compile``: the same with the model's forward through ``torch.compile``.

The figure is rank 0's CPU time per step (``time.process_time``) over the steady state (after
``--warmup`` steps), and the ratio to the hand-written loop of the same repeat. Every measurement
is a process of its own, interleaved with the others. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from xtrainer import Trainer, XModule  # noqa: E402
from xtrainer.callbacks import Callback  # noqa: E402

CONTENDERS = ["hand", "native", "hand_compile", "native_compile", "hand_ddp", "native_ddp", "hand_ddp_compile",
              "native_ddp_compile"]
BATCH = 64


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_data(steps: int, processes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH * processes
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


class Model(XModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Probe(Callback):
    """Rank 0's CPU time from the end of step ``warmup`` to the end of the fit."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks = warmup, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step in (self.warmup, trainer.max_steps):
            self.marks.append((trainer.global_step, time.process_time()))

    def state_dict(self):
        return {"marks": self.marks}

    def load_state_dict(self, state):
        self.marks = state.get("marks", self.marks)


def per_step(marks: list) -> float:
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return (t1 - t0) / (s1 - s0)


def trainer_run(contender: str, steps: int, warmup: int) -> float:
    from xtrainer.strategies import NativeDDP, NativeSingle

    ddp = "ddp" in contender
    compile_ = contender.endswith("_compile")
    strategy = NativeDDP(compile=compile_) if ddp else NativeSingle(compile=compile_)
    probe = Probe(warmup)
    trainer = Trainer(strategy=strategy, devices=2 if ddp else 1, max_steps=steps, log_every_n_steps=50,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_xla_health=False,
                      enable_model_summary=False, default_root_dir=os.path.join(HERE, ".runs"), callbacks=[probe])
    trainer.fit(Model(), DataLoader(make_data(steps, 2 if ddp else 1), batch_size=BATCH))
    return per_step(probe.marks)


def hand_run(contender: str, steps: int, warmup: int) -> float:
    """The eager loop (one process), or the DDP tutorial's loop when torchrun-style variables are set."""
    ddp = "ddp" in contender
    if ddp:
        dist.init_process_group("gloo")
    net = make_net()
    if contender.endswith("_compile"):
        net.compile()
    model = nn.parallel.DistributedDataParallel(net) if ddp else net
    data = make_data(steps, dist.get_world_size() if ddp else 1)
    sampler = DistributedSampler(data, shuffle=False) if ddp else None
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    marks, total = [], torch.zeros(())
    for step, (x, y) in enumerate(loader, start=1):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.detach()  # kept, read every 50 steps as the Trainer reads its logged values
        if step % 50 == 0:
            float(total)  # host read, as the Trainer's logging interval
        if step in (warmup, steps):
            marks.append((step, time.process_time()))
    if ddp:
        dist.destroy_process_group()
    return per_step(marks)


def one(contender: str, steps: int, warmup: int) -> float:
    """One measurement in a process of its own (two, for hand_ddp: started like torchrun does)."""
    if contender.startswith("hand_ddp"):
        from xtrainer.strategies.process import free_port

        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, __file__, "--one", contender, "--steps", str(steps), "--warmup",
                                   str(warmup)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]
        outs = [p.communicate()[0] for p in procs]
        return json.loads(outs[0].strip().splitlines()[-1])["cpu_per_step"]
    out = subprocess.run([sys.executable, __file__, "--one", contender, "--steps", str(steps), "--warmup", str(warmup)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["cpu_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", default=None)
    args = parser.parse_args()
    if args.one:
        run = hand_run if args.one.startswith("hand") else trainer_run
        print(json.dumps({"cpu_per_step": run(args.one, args.steps, args.warmup)}), flush=True)
        return
    results: dict[str, list[float]] = {c: [] for c in args.contenders}
    for _ in range(args.repeats):
        for contender in args.contenders:
            results[contender].append(one(contender, args.steps, args.warmup))
    print(f"torch {torch.__version__}, {args.steps} steps ({args.warmup} warm-up), {args.repeats} repeat(s)\n")
    print("| contender | CPU ms per step (rank 0), median | ratio to the hand loop, median (range) |")
    print("| --- | --- | --- |")
    for contender, runs in results.items():
        base_name = contender.replace("native", "hand")
        base = results.get(base_name)
        line = f"| `{contender}` | {1000 * statistics.median(runs):.3f} |"
        if base and base_name != contender:
            ratios = [r / b for r, b in zip(runs, base)]
            line += f" {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        else:
            line += " 1 |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
