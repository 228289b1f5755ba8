"""Manual optimization as Lightning documents it: a GAN with two optimizers, written as a
Lightning user writes one, trained and compared with the same GAN written as a plain loop."""

import glob
import os

import pytest
import torch
from torch import nn
from native_run import InOrderShards
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import Trainer, XModule, _xla
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.loggers import Logger
from xtrainer.strategies import XlaDDP

STEPS_PER_EPOCH = 4


def real_data(n=32, batch_size=8):
    g = torch.Generator().manual_seed(0)
    points = torch.randn(n, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0])
    noise = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(points, noise), batch_size=batch_size)


def nets():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
            nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)))


def gan_losses(generator, discriminator, real, noise):
    fake = generator(noise)
    ones, zeros = torch.ones(len(real), 1, device=real.device), torch.zeros(len(real), 1, device=real.device)
    bce = nn.functional.binary_cross_entropy_with_logits
    g_loss = bce(discriminator(fake), ones)
    d_loss = lambda: (bce(discriminator(real), ones) + bce(discriminator(fake.detach()), zeros)) / 2  # noqa: E731
    return g_loss, d_loss


class GAN(XModule):
    def __init__(self, clip=None):
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = nets()
        self.clip = clip

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        sched_g, _ = self.lr_schedulers()

        self.toggle_optimizer(opt_g)
        g_loss, d_loss_fn = gan_losses(self.generator, self.discriminator, real, noise)
        self.manual_backward(g_loss)
        if self.clip:
            self.clip_gradients(opt_g, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = d_loss_fn()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        sched_g.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=0.05)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 2, 0.5),
                                torch.optim.lr_scheduler.StepLR(opt_d, 2, 0.5)]


def plain_loop(epochs, clip=None, batches=None):
    """The same GAN as a hand-written loop on one XLA device."""
    device = _xla.device()
    generator, discriminator = (m.to(device) for m in nets())
    opt_g = torch.optim.Adam(generator.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, 2, 0.5)
    for _ in range(epochs):
        for i, (real, noise) in enumerate(real_data()):
            if batches is not None and i >= batches:
                break
            real, noise = real.to(device), noise.to(device)
            g_loss, d_loss_fn = gan_losses(generator, discriminator, real, noise)
            for p in discriminator.parameters():
                p.requires_grad = False
            g_loss.backward()
            for p in discriminator.parameters():
                p.requires_grad = True
            if clip:
                torch.nn.utils.clip_grad_norm_(list(generator.parameters()), clip)
            opt_g.step()
            opt_g.zero_grad()
            for p in generator.parameters():
                p.requires_grad = False
            d_loss_fn().backward()
            for p in generator.parameters():
                p.requires_grad = True
            opt_d.step()
            opt_d.zero_grad()
            sched_g.step()
            _xla.sync()
    return {**{f"generator.{k}": v.cpu() for k, v in generator.state_dict().items()},
            **{f"discriminator.{k}": v.cpu() for k, v in discriminator.state_dict().items()}}


def quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, num_sanity_val_steps=0, **kwargs)


@pytest.mark.parametrize("strategy", ["xla_native", "xla_fsdpv2"])
def test_a_gan_trains_as_the_plain_loop_does(tmp_path, strategy):
    model = GAN(clip=0.5)
    trainer = Trainer(strategy=strategy, max_epochs=2, log_every_n_steps=2, enable_checkpointing=False,
                      **quiet(tmp_path))
    trainer.fit(model, real_data())
    assert trainer.global_step == 2 * 2 * STEPS_PER_EPOCH  # Lightning counts every optimizer step
    expected = plain_loop(2, clip=0.5)
    for name, tensor in model.state_dict().items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name
    assert {"g_loss", "d_loss"} <= set(trainer.callback_metrics)
    assert all(p.requires_grad for p in model.parameters())  # untoggled


def test_a_gan_resumed_from_a_mid_epoch_checkpoint_equals_an_uninterrupted_run(tmp_path):
    whole = GAN()
    Trainer(max_epochs=2, enable_checkpointing=False, **quiet(tmp_path / "whole")).fit(whole, real_data())
    saver = ModelCheckpoint(every_n_train_steps=6, save_top_k=-1)  # 6 optimizer steps: mid-epoch 0
    Trainer(max_epochs=1, limit_train_batches=3, callbacks=[saver], **quiet(tmp_path / "cut")).fit(GAN(), real_data())
    (path,) = glob.glob(str(tmp_path / "cut" / "**" / "*step=6*.ckpt"), recursive=True)
    saved = torch.load(path, weights_only=True)
    assert len(saved["optimizer_states"]) == 2 and len(saved["lr_schedulers"]) == 2
    resumed = GAN()
    Trainer(max_epochs=2, enable_checkpointing=False, **quiet(tmp_path / "resumed")).fit(
        resumed, real_data(), ckpt_path=path)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name



class Steps(Logger):
    """Records the step the loggers are given with each logged value's name."""

    def __init__(self):
        super().__init__()
        self.logged = []

    @property
    def name(self):
        return "steps"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params):
        pass

    def log_metrics(self, metrics, step):
        self.logged.append((step, sorted(metrics)))


def _steps_of(logger, key):
    """The steps at which ``key`` was logged."""
    return [step for step, keys in logger.logged if key in keys]


def test_the_loggers_step_counts_batches_not_the_optimizers_steps_and_a_resume_continues_it(tmp_path):
    """As Lightning's ``_batches_that_stepped``: two optimizers stepping in every batch are one
    step of the loggers, not two, and a resumed run logs on from where the checkpoint was."""
    whole = Steps()
    trainer = Trainer(max_epochs=2, log_every_n_steps=2, enable_checkpointing=False, logger=whole,
                      **quiet(tmp_path / "whole"))
    trainer.fit(GAN(), real_data())
    assert trainer.global_step == 16  # every optimizer step counts there
    assert _steps_of(whole, "g_loss") == [1, 3, 5, 7]  # every second batch of 8 (log_every_n_steps counts batches)
    saver = ModelCheckpoint(every_n_train_steps=6, save_top_k=-1)  # 6 optimizer steps: 3 batches
    Trainer(max_epochs=1, limit_train_batches=3, callbacks=[saver], logger=False,
            **quiet(tmp_path / "cut")).fit(GAN(), real_data())
    (path,) = glob.glob(str(tmp_path / "cut" / "**" / "*step=6*.ckpt"), recursive=True)
    assert torch.load(path, weights_only=True)["loops"]["batches_stepped"] == 3
    again = Steps()
    Trainer(max_epochs=2, log_every_n_steps=2, enable_checkpointing=False, logger=again,
            **quiet(tmp_path / "resumed")).fit(GAN(), real_data(), ckpt_path=path)
    assert _steps_of(again, "g_loss") == [3, 5, 7]  # batches 4, 6 and 8 of the uninterrupted run

class Counter(Callback):
    def __init__(self):
        self.at_epoch_start = []

    def on_train_epoch_start(self, trainer, module):
        _xla.wait_device_ops()
        self.at_epoch_start.append((_xla.compile_count(), _xla.execute_count()))


def test_a_gan_cuts_one_graph_per_step_and_never_recompiles_when_warm(tmp_path):
    counter = Counter()
    trainer = Trainer(strategy="xla_native", max_epochs=4, log_every_n_steps=1000, callbacks=[counter],
                      enable_checkpointing=False,
                      **quiet(tmp_path))
    trainer.fit(GAN(clip=1.0), real_data())
    compiles = [c for c, _ in counter.at_epoch_start]
    assert compiles[1:] == [compiles[1]] * len(compiles[1:]), compiles
    executions = [b[1] - a[1] for a, b in zip(counter.at_epoch_start, counter.at_epoch_start[1:])]
    # one execution per training_step call; the epoch-end read takes values the last step computed
    assert executions[1:] == [STEPS_PER_EPOCH] * len(executions[1:]), executions


def test_several_optimizers_need_manual_optimization(tmp_path):
    class Automatic(GAN):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

    with pytest.raises(ValueError, match="gave 2 optimizers. Several optimizers need manual optimization"):
        Trainer(**quiet(tmp_path)).fit(Automatic(), real_data())
    with pytest.raises(ValueError, match="gradient_clip_val with manual optimization"):
        Trainer(gradient_clip_val=1.0, **quiet(tmp_path)).fit(GAN(), real_data())
    with pytest.raises(NotImplementedError, match="not supported under xla_fsdp.*Use xla_fsdpv2"):
        Trainer(strategy="xla_fsdp", **quiet(tmp_path)).fit(GAN(), real_data())


class SaveWeights(Callback):
    """Each replica writes its whole weights at the end."""

    def __init__(self, folder):
        self.folder = str(folder)

    def on_fit_end(self, trainer, module):
        torch.save(_xla.to_cpu(trainer.strategy.full_module_state_dict(trainer.model)),
                   os.path.join(self.folder, f"rank-{trainer.global_rank}.pt"))


@pytest.mark.multi_device
# xla_native's wrapped step is its automatic step (reduce, clip, step), compared at 2 replicas in
# test_replicas; DDP's re-armed reducer is what manual optimization adds.
@pytest.mark.parametrize("strategy", ["xla_ddp"])
def test_a_gan_on_two_replicas_equals_one_replica_on_the_global_batch(tmp_path, strategy):
    for attempt in (1, 2, 3):
        chosen = XlaDDP(find_unused_parameters=True) if strategy == "xla_ddp" else strategy
        model = GAN(clip=0.5)
        trainer = Trainer(strategy=chosen, devices=2, max_epochs=2, callbacks=[SaveWeights(tmp_path)],
                          enable_checkpointing=False, **quiet(tmp_path / str(attempt)))
        try:
            trainer.fit(model, datamodule=InOrderShards(real_data().dataset, 4))  # the global batches in order
            break
        except RuntimeError as err:
            # In about one run of three under load, XLA's CPU runtime aborts the replicas' process in C++
            # (glibc: "free(): invalid next size", "corrupted size vs. prev_size") while the two thread
            # replicas run DDP with find_unused_parameters=True; not in their Python, and not diagnosed
            # further (the automatic xla_ddp tests have never shown it). A crash, never a wrong result:
            # the run is made again, and a third crash fails the test (two in a row happened once, under
            # the suite's full load).
            if attempt == 3 or "ended with signal" not in str(err):
                raise
    replicas = [torch.load(p, weights_only=True) for p in sorted(glob.glob(str(tmp_path / "rank-*.pt")))]
    assert len(replicas) == 2
    reference = GAN(clip=0.5)
    Trainer(strategy="xla_native", max_epochs=2, enable_checkpointing=False, **quiet(tmp_path / "one")).fit(
        reference, real_data())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(replicas[0][name], replicas[1][name]), name
        assert torch.allclose(model.state_dict()[name], tensor, atol=1e-5), name


class Passes(XModule):
    """Manual optimization with one optimizer and one or two forward/backward passes per batch,
    each reaching every parameter: DDP without ``find_unused_parameters`` fits it. One pass is
    Lightning's documented loop (zero_grad, manual_backward, step), whose backward runs inside
    DDP's forward (``rebuild_buckets``); a second needs the reducer re-armed (``arm_reducer``)."""

    def __init__(self, passes: int = 2):
        super().__init__()
        self.automatic_optimization = False
        self.passes = passes
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = (self.net(real) - noise).pow(2).mean()
        self.manual_backward(loss)
        opt.step()
        if self.passes == 2:
            opt.zero_grad()
            again = (self.net(real) - noise).abs().mean()  # with the stepped weights
            self.manual_backward(again)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            loss = again
        self.log("loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.multi_device
@pytest.mark.parametrize("passes", [1, 2])
def test_backward_passes_of_one_optimizer_on_two_ddp_replicas_without_unused_parameters_equal_one_replica(
        tmp_path, passes):
    model = Passes(passes)
    trainer = Trainer(strategy=XlaDDP(find_unused_parameters=False), devices=2, max_epochs=2,
                      callbacks=[SaveWeights(tmp_path)], enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(model, datamodule=InOrderShards(real_data().dataset, 4))  # each replica 4 of the global batch's 8
    assert trainer.global_step == passes * 2 * STEPS_PER_EPOCH
    replicas = [torch.load(p, weights_only=True) for p in sorted(glob.glob(str(tmp_path / "rank-*.pt")))]
    assert len(replicas) == 2
    reference = Passes(passes)
    Trainer(strategy="xla_native", max_epochs=2, enable_checkpointing=False, **quiet(tmp_path / "one")).fit(
        reference, real_data())
    start = Passes(passes).state_dict()
    for name, tensor in reference.state_dict().items():
        assert not torch.equal(tensor, start[name]), name  # it trained
        assert torch.equal(replicas[0][name], replicas[1][name]), name
        assert torch.allclose(model.state_dict()[name], tensor, atol=1e-5), name
