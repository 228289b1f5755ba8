"""A tiny fit under a native strategy: the module of tests/stories/native/test_native.py, and a script for the
runs that need their own processes (torchrun, signals)::

    python native_run.py --strategy native_ddp --devices 2 --root ROOT --out OUT.pt [--ckpt last]
        [--steps N] [--global-batch B] [--pause SECONDS] [--ready FILE] [--clip V [--clip-algorithm value]]
        [--compile] [--layers] [--after-fit]

The data and the weights are small integers and dyadic fractions, computed in float64, so that
every sum in a step is exact: a step over one global batch gives the same bits however the batch
is split over processes and summed, which is what lets the tests compare runs of different world
sizes bitwise. ``OUT.pt`` holds the final whole weights (written by rank 0). Exits 128 + signal
when a signal stopped the fit. Imports nothing of torch_xla.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from xtrainer import Trainer, TrainingInterrupted, XDataModule, XModule
from xtrainer.callbacks import Callback, ModelCheckpoint

FEATURES = 4


def make_data(n: int = 64, seed: int = 0, nan_at: int | None = None) -> TensorDataset:
    """``n`` samples; ``nan_at``: the index of one sample whose input is NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, FEATURES), generator=g).double()
    y = torch.randint(-2, 3, (n, 1), generator=g).double()
    if nan_at is not None:
        x[nan_at, 0] = float("nan")
    return TensorDataset(x, y)


class Block(nn.Module):
    """A layer class of its own: the unit ``auto_wrap_policy`` names."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 2).double()

    def forward(self, x):
        return self.linear(x)


class ExactNet(XModule):
    """A linear layer (two outputs, summed), weights set to multiples of 1/8; SGD with momentum,
    lr 1/16. Linear in its weights, so a step adds a few bits to their fractions, no more."""

    def __init__(self, lr: float = 1 / 16) -> None:
        super().__init__()
        self.block = Block()
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_((torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) % 5 - 2 + i) / 8)
        self.lr = lr

    def forward(self, x):
        return self.block(x).sum(dim=1, keepdim=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self(x) - y) ** 2).mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)


class AheadNet(ExactNet):
    """Rank 1 waits, just before its read of logging step ``at``, until rank 0 has finished that
    step (a file in ``folder``): only a logging step that does not wait for the other process
    lets rank 0 get there. Logs without ``sync_dist`` (a value synced on request waits for all).
    Rank 1 alone sets ``should_stop`` after step ``stop_at``."""

    def __init__(self, folder: str, at: int, stop_at: int) -> None:
        super().__init__()
        self.folder, self.at, self.stop_at = folder, at, stop_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):  # after backward's all-reduce, before the read
        if self.trainer.global_rank == 1 and self.trainer.global_step + 1 == self.at:  # before the step count
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(self.folder, "rank0-passed")):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 did not get past logging step {self.at}: it waited for rank 1")
                time.sleep(0.01)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_rank == 0 and self.trainer.global_step == self.at:
            open(os.path.join(self.folder, "rank0-passed"), "w").close()
        if self.trainer.global_rank == 1 and self.trainer.global_step == self.stop_at:
            self.trainer.should_stop = True


class ManualNet(ExactNet):
    """``ExactNet`` under manual optimization: two optimizers (the weight, with momentum; the
    bias), two forward and backward passes per batch, the weight's gradient clipped by value
    (a multiple of 1/8: every sum stays exact). The bias steps on the sum of both passes'
    gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_weight, opt_bias = self.optimizers()
        loss = ((self(x) - y) ** 2).mean()
        self.manual_backward(loss)
        self.clip_gradients(opt_weight, gradient_clip_val=1 / 8, gradient_clip_algorithm="value")
        opt_weight.step()
        opt_weight.zero_grad()
        again = ((self(x) - y) ** 2).mean()  # with the stepped weight; the bias's gradient adds up
        self.manual_backward(again)
        opt_bias.step()
        opt_bias.zero_grad()
        opt_weight.zero_grad()
        self.log("train_loss", again, sync_dist=True)

    def configure_optimizers(self):
        return [torch.optim.SGD([self.block.linear.weight], lr=self.lr, momentum=0.5),
                torch.optim.SGD([self.block.linear.bias], lr=self.lr)]


class OneOptimizerManualNet(ExactNet):
    """``ExactNet`` under Lightning's documented manual loop: zero_grad, one backward, step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = ((self(x) - y) ** 2).mean()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss, sync_dist=True)


class ToggledNet(ManualNet):
    """``ManualNet`` with Lightning's GAN recipe: each pass between ``toggle_optimizer`` and
    ``untoggle_optimizer`` of its optimizer, so the other optimizer's parameter takes no gradient
    in it. The weight steps first; the bias then on the second pass's gradient only."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_weight, opt_bias = self.optimizers()
        self.toggle_optimizer(opt_weight)
        loss = ((self(x) - y) ** 2).mean()
        self.manual_backward(loss)
        self.clip_gradients(opt_weight, gradient_clip_val=1 / 8, gradient_clip_algorithm="value")
        opt_weight.step()
        opt_weight.zero_grad()
        self.untoggle_optimizer(opt_weight)
        self.toggle_optimizer(opt_bias)
        again = ((self(x) - y) ** 2).mean()
        self.manual_backward(again)
        opt_bias.step()
        opt_bias.zero_grad()
        self.untoggle_optimizer(opt_bias)
        self.log("train_loss", again, sync_dist=True)


class AdamNet(ExactNet):
    """``ExactNet`` with Adam: optimizer state with a scalar per parameter (``step``) beside the
    tensors shaped like it. Not exact after its first step (square roots)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Pause(Callback):
    """Slows every step down (so a signal arrives mid-fit) and writes ``ready`` once the first
    steps are done (only the first time: a restarted run does not); every process writes
    ``rank-R.step`` with its step when the fit ends."""

    def __init__(self, seconds: float, ready: str | None, folder: str) -> None:
        self.seconds, self.ready, self.folder = seconds, ready, folder

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.seconds:
            time.sleep(self.seconds)
        if self.ready and trainer.global_step == 3:  # READY (rank 0) and READY-R (each rank): the pid
            for path in ([self.ready] if trainer.is_global_zero else []) + [f"{self.ready}-{trainer.global_rank}"]:
                if not os.path.exists(path):
                    with open(path, "w") as f:
                        f.write(str(os.getpid()))

    def teardown(self, trainer, module, stage):
        if stage == "fit":
            with open(os.path.join(self.folder, f"rank-{trainer.global_rank}.step"), "w") as f:
                f.write(str(trainer.global_step))


class SleepOnRankOne(Callback):
    """Rank 1 stops stepping (sleeps) before its batch of global step ``at``; the others go on
    into the step's collectives and wait there."""

    def __init__(self, at: int = 3) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at and trainer.global_rank == 1:
            time.sleep(600)


class Threads(Callback):
    """The names of the Python threads of each rank's process and that process's id and parent's,
    seen mid-fit: rank 0's kept here (it runs in the calling process), the others' written to
    ``folder/threads-R.txt`` (``names``, one per line, after a line ``pid parent``)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.names, self.pid = folder, None, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx != 1:
            return
        names = sorted(t.name for t in threading.enumerate())
        if trainer.global_rank == 0:
            self.names, self.pid = names, os.getpid()
            return
        with open(os.path.join(self.folder, f"threads-{trainer.global_rank}.txt"), "w") as f:
            f.write("\n".join([f"{os.getpid()} {os.getppid()}", *names]))


def whole_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole weights on the host; DTensors (native_fsdp under torchrun) are gathered,
    which every process must do."""
    from torch.distributed.tensor import DTensor

    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
            for name, t in model.state_dict().items()}


class InOrderShards(XDataModule):
    """The training data split over the processes in order, sample i to rank i % world_size: a
    ``DistributedSampler`` without shuffling, built in each replica as a Lightning user builds one,
    so that the global batch of step k is the same samples at every world size. (Without it, the
    strategy's own sampler shuffles a training loader of several processes, as Lightning's does.)"""

    def __init__(self, data: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
                                     shuffle=False)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


def fit(strategy, devices: int, root: str, steps: int, global_batch: int, ckpt_path=None, pause: float = 0.0,
        ready: str | None = None, every_n_train_steps: int = 2, world_size: int | None = None,
        model: XModule | None = None, nan_at: int | None = None, in_order: bool = True, **kwargs):
    """Returns (trainer, model). ``world_size``: the processes the batch is split over (devices,
    or torchrun's); ``model``: an ``ExactNet`` unless given; ``nan_at``: a NaN sample (``make_data``);
    ``in_order``: the data shared out in order by a sampler of the data module's own
    (``InOrderShards``), else a plain loader that the strategy shares out."""
    world_size = world_size or devices
    samples, per_replica = make_data(nan_at=nan_at), global_batch // world_size
    data = InOrderShards(samples, per_replica) if in_order else XDataModule.from_datasets(samples,
                                                                                           batch_size=per_replica)
    model = model if model is not None else ExactNet()
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=steps, default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, logger=False,
                      log_every_n_steps=kwargs.pop("log_every_n_steps", 2),
                      num_sanity_val_steps=0,
                      callbacks=[ModelCheckpoint(every_n_train_steps=every_n_train_steps, save_last=True),
                                 Pause(pause, ready, root), *kwargs.pop("callbacks", [])], **kwargs)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="native_ddp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    parser.add_argument("--clip-algorithm", default="norm")
    parser.add_argument("--compile", action="store_true", help="the step's forward through torch.compile")
    parser.add_argument("--layers", action="store_true",
                        help="native_fsdp: shard each Block apart and recompute its activations in backward")
    parser.add_argument("--after-fit", action="store_true",
                        help="use the module after the fit (forward, validate, save_checkpoint): into OUT.pt")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", args.devices))
    clip = {"gradient_clip_val": args.clip, "gradient_clip_algorithm": args.clip_algorithm} if args.clip else {}
    try:
        strategy, options = args.strategy, {}
        if args.layers:
            options.update(auto_wrap_policy={Block}, activation_checkpointing=True)
        if args.compile:
            options["compile"] = True
        if options:
            from xtrainer.strategies import STRATEGIES

            strategy = STRATEGIES[args.strategy](**options)
        trainer, model = fit(strategy, args.devices, args.root, args.steps, args.global_batch, args.ckpt,
                             args.pause, args.ready, world_size=world_size, **clip)
    except TrainingInterrupted as err:
        sys.exit(err.exit_code)
    weights = whole_weights(model)
    after = after_fit(trainer, model, args.root) if args.after_fit else {}
    if trainer.is_global_zero:
        torch.save({"weights": weights, "global_step": trainer.global_step, "world_size": trainer.world_size,
                    "log_dir": trainer.log_dir, **after}, args.out)


def after_fit(trainer: Trainer, model: XModule, root: str) -> dict:
    """What a script does with its module after ``fit`` (every process): the parameters' types and
    names, a forward pass, ``validate``, and ``save_checkpoint`` (``ROOT/after.ckpt``)."""
    found = {"param_types": sorted({type(p).__name__ for p in model.parameters()}),
             "keys": list(model.state_dict()), "forward": model(torch.ones(2, FEATURES, dtype=torch.float64)).detach()}
    found["validate"] = trainer.validate(model, DataLoader(make_data(), batch_size=8))
    trainer.save_checkpoint(os.path.join(root, "after.ckpt"))
    return found


class Ballast(Callback):
    """Carries ``size`` bytes into the job, and reports the largest other bytes object that rank
    0's process holds mid-fit (in a container the garbage collector tracks, or a frame of the
    running stack), handed back to the caller as callback state is."""

    def __init__(self, size: int) -> None:
        self.ballast, self.held = bytes(size), None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.held = largest_bytes_held(exclude=self.ballast)

    def state_dict(self):
        return {"held": self.held}

    def load_state_dict(self, state):
        self.held = state["held"]


class ProcessFacts(Callback):
    """Reports, from rank 0's process mid-fit, the backward hooks (``_backward_hooks``) of the
    module's parameters and of the training data's tensors, and torch's intra-op threads, handed
    back as callback state."""

    def __init__(self) -> None:
        self.seen = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            data = trainer.train_dataloader.dataset.tensors
            self.seen = {"parameters": [p._backward_hooks for p in module.parameters()],
                         "data": [t._backward_hooks for t in data], "threads": torch.get_num_threads()}

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def largest_bytes_held(exclude: bytes) -> int:
    """The length of the largest bytes object, other than ``exclude``, referenced by a tuple, list
    or dict the garbage collector tracks, or reachable through tuples, lists and dicts from a
    local of a frame on any thread's stack."""
    import gc

    def largest(value, depth: int = 0) -> int:
        if type(value) is bytes:
            return 0 if value is exclude else len(value)
        if depth < 4 and type(value) in (tuple, list, dict):
            items = value.values() if type(value) is dict else value
            return max((largest(item, depth + 1) for item in items), default=0)
        return 0

    found = max((largest(holder, 3) for holder in gc.get_objects() if type(holder) in (tuple, list, dict)), default=0)
    for frame in sys._current_frames().values():
        while frame is not None:
            found = max(found, largest(dict(frame.f_locals)))
            frame = frame.f_back
    return found


if __name__ == "__main__":
    main()
