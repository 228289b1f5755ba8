"""The training loop of PyTorch's DDP tutorial, written by hand with no xtrainer: the reference the
native strategies are held to (tests/stories/native/test_native_scale.py)::

    python hand_ddp_run.py --world-size 4 --out OUT.pt [--steps N] [--global-batch B]

``torch.multiprocessing.spawn`` starts one process per rank; each joins a gloo process group,
wraps the model in ``DistributedDataParallel``, reads its share of the data through a
``DistributedSampler`` (no shuffling) and steps SGD. The model, data and optimizer are those of
``native_run.py`` (``ExactNet``), rebuilt here from plain torch: a linear layer of 4 inputs and 2
outputs in float64, weights set to multiples of 1/8, the outputs summed; SGD(lr=1/16,
momentum=0.5); mean squared error. Rank 0 writes the final weights to ``OUT.pt``.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES = 4


def make_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, FEATURES), generator=g).double()
    y = torch.randint(-2, 3, (n, 1), generator=g).double()
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 2).double()
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_((torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) % 5 - 2 + i) / 8)

    def forward(self, x):
        return self.linear(x).sum(dim=1, keepdim=True)


def train(rank: int, world_size: int, port: int, steps: int, global_batch: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=1 / 16, momentum=0.5)
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=global_batch // world_size, sampler=sampler)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    if rank == 0:
        torch.save({name: t.detach().clone() for name, t in model.module.state_dict().items()}, out)
    dist.barrier()  # no process closes its connections while a peer still reads from them
    dist.destroy_process_group()
    # The result is written: end without the interpreter's teardown, where a gloo process of torch
    # 2.13 aborted now and then after a good run ("terminate called without an active exception",
    # SIGABRT), as xtrainer's own launcher ends its processes (strategies/launchers/processes.py, end_now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A free port below the kernel's ephemeral range (one the kernel picked itself could be handed
    to another test's store before rank 0 binds it)."""
    for port in random.SystemRandom().sample(range(20000, 29000), 100):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29000")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mp.spawn(train, args=(args.world_size, free_port(), args.steps, args.global_batch, args.out),
             nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
