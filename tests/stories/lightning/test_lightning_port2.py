"""Lightning projects that port by changing their imports: the patterns real projects use.

Data built in the module's ``setup(stage)``, Trainer properties read in ``setup``/``prepare_data``,
lightning-utilities' ``rank_zero_only``, every ``configure_optimizers`` return form, the manual
optimizer's class, ``fast_dev_run`` with the user's callbacks, Lightning's callback names, and
fine-tuning callbacks that add parameter groups mid-fit. Modules are written as a Lightning
user writes them; only the import lines differ.
"""

import os
import subprocess
import sys
import textwrap

import conftest
import pytest
import torch
from conftest import make_data, subprocess_timeout
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, random_split

from xtrainer import Trainer
from xtrainer import XDataModule as LightningDataModule
from xtrainer import XModule as LightningModule
from xtrainer.callbacks import BasePredictionWriter, Callback
from xtrainer.strategies import STRATEGIES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(conftest.__file__)))


def quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False, enable_model_summary=False,
                **kwargs)


@rank_zero_only
def note_rank_zero(path, rank):
    """A user function that only rank 0 runs (lightning-utilities' decorator)."""
    with open(path, "a") as f:
        f.write(f"{rank}\n")


class HelloWorld(LightningModule):
    """Lightning's MNIST hello-world pattern: datasets made in ``setup``, returned by the hooks."""

    def __init__(self, batch_size: int = 8, expect_world_size: int = 1, expect_devices: int = 1, note: str = ""):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def prepare_data(self):
        if self.hparams.expect_world_size:
            assert self.trainer.world_size == self.hparams.expect_world_size  # in the calling process

    def setup(self, stage):
        trainer = self.trainer
        expected = (self.hparams.expect_world_size, self.hparams.expect_devices)
        if self.hparams.expect_world_size:
            assert (trainer.world_size, trainer.num_devices) == expected, (trainer.world_size, trainer.num_devices)
        assert trainer.is_global_zero == (trainer.global_rank == 0) and trainer.num_nodes == 1
        if stage == "fit":
            self.train_set, self.val_set = random_split(make_data(48), [32, 16],
                                                        generator=torch.Generator().manual_seed(0))
        self.test_set = make_data(16, seed=1)

    def on_train_start(self):
        if self.hparams.note:
            note_rank_zero(self.hparams.note, self.global_rank)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class PerReplicaBatch(LightningDataModule):
    """Divides the global batch by the world size in ``setup`` (a common pattern)."""

    def __init__(self, global_batch: int = 16):
        super().__init__()
        self.global_batch = global_batch
        self.seen = []

    def prepare_data(self):
        self.seen.append(("prepare_data", self.trainer.world_size, self.trainer.num_devices, self.trainer.global_rank))

    def setup(self, stage):
        self.seen.append(("setup", self.trainer.world_size, self.trainer.num_devices, self.trainer.is_global_zero))
        self.batch_size = self.global_batch // self.trainer.world_size
        self.data = make_data(64)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, drop_last=True)


class NoData(HelloWorld):
    def setup(self, stage):
        pass

    def train_dataloader(self):
        return None


@pytest.mark.parametrize("strategy", sorted(n for n, c in STRATEGIES.items() if c.runs_standalone))
def test_data_built_in_setup_at_one_device(tmp_path, strategy):
    trainer = Trainer(strategy=strategy, devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                      num_sanity_val_steps=1, enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(HelloWorld())
    assert trainer.global_step == 2 and "val_loss" in trainer.callback_metrics
    if strategy == "xla_native":  # the evaluation stages call their hook after setup(stage) too
        assert set(trainer.test(HelloWorld(), verbose=False)[0]) == {"test_loss"}
        assert trainer.world_size == 1 and trainer.device_ids == [0]


def test_a_loader_hook_that_returns_nothing_says_so(tmp_path):
    trainer = Trainer(max_epochs=1, enable_checkpointing=False, **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"NoData.train_dataloader\(\) returned nothing"):
        trainer.fit(NoData())
    with pytest.raises(ValueError, match="fit\\(\\) got no training data"):
        trainer.fit(nn.Module.__new__(type("Bare", (LightningModule,), {
            "training_step": HelloWorld.training_step, "configure_optimizers": HelloWorld.configure_optimizers})))


def test_properties_in_the_calling_process_before_the_replicas_start(tmp_path):
    # No replica runs here: what a data module's hooks and the module's prepare_data see of a
    # 2-replica Trainer in the calling process (the fit itself: the multi-device tests below).
    trainer = Trainer(strategy="xla_ddp", devices=2, **quiet(tmp_path))
    assert (trainer.world_size, trainer.num_devices, trainer.global_rank, trainer.local_rank) == (2, 2, 0, 0)
    assert trainer.is_global_zero and trainer.node_rank == 0 and trainer.device_ids == [0, 1]
    spmd = Trainer(strategy="xla_spmd", devices=4, **quiet(tmp_path))
    assert (spmd.world_size, spmd.num_devices) == (1, 4)  # one SPMD program per host
    assert Trainer(**quiet(tmp_path)).world_size == 1


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["xla_ddp", "xla_spmd"])
def test_setup_data_and_world_size_with_two_replicas(tmp_path, strategy):
    note = str(tmp_path / "rank_zero.txt")
    expect = 2 if strategy == "xla_ddp" else 1  # SPMD: one program, its replicas are the hosts
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=1, enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(HelloWorld(expect_world_size=expect, expect_devices=2, note=note))
    # 32 training samples, batches of 8: each of 2 MPMD replicas takes 16 (2 steps); SPMD splits each batch
    assert trainer.global_step == (2 if strategy == "xla_ddp" else 4) and "val_loss" in trainer.callback_metrics
    with open(note) as f:
        assert f.read() == "0\n"  # rank_zero_only ran on rank 0 only: each replica knows its rank

    dm = PerReplicaBatch(global_batch=16)
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=1, enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(HelloWorld(expect_world_size=expect, expect_devices=2), datamodule=dm)
    assert dm.seen == [("prepare_data", expect, 2, 0), ("setup", expect, 2, True)]
    # 64 samples in global batches of 16: 4 steps whatever the replica count
    assert trainer.global_step == 4
    if strategy == "xla_spmd":  # self.optimizers() on 2 devices: instances of the optimizers' classes
        # (under xla_ddp x2 this module fails in DDP's reducer, "initialize_buckets must NOT be called during
        # autograd execution", on main as well: a manual step with one backward per forward; not covered here)
        trainer = Trainer(strategy=strategy, devices=2, max_epochs=1, limit_val_batches=0, enable_checkpointing=False,
                          **quiet(tmp_path))
        trainer.fit(ManualTwo())
        assert trainer.global_step == 4 * 2  # 4 global batches, 2 optimizers


def test_rank_zero_only_is_set_when_xtrainer_is_imported(tmp_path):
    script = textwrap.dedent("""
        import warnings
        from lightning_utilities.core.rank_zero import rank_zero_only
        import torch
        from torch import nn
        from xtrainer import Trainer, XModule as LightningModule

        @rank_zero_only
        def user_function():
            return "ran"

        class Model(LightningModule):
            def __init__(self, encoder: nn.Module, lr: float = 0.1):
                super().__init__()
                self.save_hyperparameters()  # warns (through rank_zero_warn) about the nn.Module argument

        warnings.simplefilter("ignore")
        Model(nn.Linear(2, 2))
        for kwargs in ({"fast_dev_run": True}, {"benchmark": True}, {"deterministic": True},
                       {"precision": "16-mixed"}):
            Trainer(logger=False, enable_progress_bar=False, **kwargs)
        print(user_function(), rank_zero_only.rank)
    """)
    env = {**os.environ, "PYTHONPATH": REPO, "PJRT_DEVICE": "CPU"}
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=subprocess_timeout(300))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["ran", "0"]
    # a process a launcher started as rank 1: Lightning's environment variables
    probe = "import xtrainer; from lightning_utilities.core.rank_zero import rank_zero_only; print(rank_zero_only.rank)"
    done = subprocess.run([sys.executable, "-c", probe], env={**env, "LOCAL_RANK": "1"}, capture_output=True,
                          text=True, timeout=subprocess_timeout(60))
    assert done.stdout.strip() == "1", done.stderr


# ---- configure_optimizers: every form Lightning documents ------------------------------------------
def _params():
    return nn.Linear(2, 2).parameters()


def test_configure_optimizers_forms():
    from xtrainer.loop.optimizers import NoOptimizer, parse_optimizers

    plateau_cls, step_cls = torch.optim.lr_scheduler.ReduceLROnPlateau, torch.optim.lr_scheduler.StepLR
    a, b = torch.optim.SGD(_params(), lr=0.1), torch.optim.Adam(_params())
    sa, sb = step_cls(a, 1), step_cls(b, 1)
    parse = lambda config, automatic=False: parse_optimizers(config, "M", automatic)  # noqa: E731

    assert parse(a, True) == ([a], [])
    assert parse([a, b])[0] == [a, b] and parse((a, b))[0] == [a, b]
    opts, scheds = parse(([a, b], [sa, {"scheduler": sb, "interval": "step", "frequency": 2}]))
    assert opts == [a, b] and [(s.scheduler, s.interval, s.frequency) for s in scheds] == [(sa, "epoch", 1),
                                                                                          (sb, "step", 2)]
    assert parse(([a], sa))[1][0].scheduler is sa  # the second item may be one scheduler
    assert parse({"optimizer": a}, True) == ([a], [])
    assert parse({"optimizer": a, "lr_scheduler": sa}, True)[1][0].scheduler is sa
    # the monitor beside the scheduler (issue 26), and inside a scheduler dict
    plateau = plateau_cls(a)
    for config in ({"optimizer": a, "lr_scheduler": plateau, "monitor": "val_loss"},
                   {"optimizer": a, "lr_scheduler": {"scheduler": plateau}, "monitor": "val_loss"},
                   {"optimizer": a, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss", "strict": False}}):
        (found,) = parse(config, True)[1]
        assert found.scheduler is plateau and found.monitor == "val_loss" and found.reduce_on_plateau
    opts, scheds = parse([{"optimizer": a, "lr_scheduler": sa}, {"optimizer": b, "lr_scheduler": plateau_cls(b),
                                                                 "monitor": "g_loss"}])
    assert opts == [a, b] and [s.monitor for s in scheds] == [None, "g_loss"]
    assert parse(({"optimizer": a}, {"optimizer": b}))[0] == [a, b]
    with pytest.warns(UserWarning, match="no optimizer"):
        (none,), _ = parse(None, True)
    assert isinstance(none, NoOptimizer) and none.step(lambda: 3) == 3

    # what Lightning refuses, refused with what to return instead
    with pytest.raises(ValueError, match="manual optimization"):
        parse([a, b], True)
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs a metric to monitor"):
        parse({"optimizer": a, "lr_scheduler": plateau})
    with pytest.raises(ValueError, match="without an 'optimizer' key"):
        parse({"lr_scheduler": sa})
    with pytest.raises(ValueError, match="needs a 'scheduler' key"):
        parse({"optimizer": a, "lr_scheduler": {"interval": "step"}})
    with pytest.raises(ValueError, match="interval='batch'"):
        parse({"optimizer": a, "lr_scheduler": {"scheduler": sa, "interval": "batch"}})
    with pytest.raises(ValueError, match="not a form Lightning documents"):
        parse("adam")
    with pytest.raises(ValueError, match="did not return"):
        parse(([a], [sb]))
    with pytest.warns(UserWarning, match="unknown keys \\['opt_idx'\\]"):
        parse({"optimizer": a, "lr_scheduler": {"scheduler": sa, "opt_idx": 0}})


class Plateau(HelloWorld):
    def __init__(self, form: str = "beside"):
        super().__init__()
        self.form = form

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.08)
        if self.form == "none":
            return None
        # never an improvement (threshold 10: below best * -9): the rate halves at every epoch's end
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
        return {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"}

    def on_train_end(self):
        self.final_lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.logged_lr = float(self.trainer.callback_metrics["val_loss"].item())  # a tensor, as in Lightning


def test_reduce_lr_on_plateau_with_the_monitor_beside_it_and_no_optimizer(tmp_path):
    model = Plateau()
    trainer = Trainer(max_epochs=3, limit_train_batches=2, enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(model)
    assert model.final_lr == pytest.approx(0.08 / 2**3)
    model = Plateau(form="none")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="no optimizer"):
        Trainer(max_epochs=1, limit_train_batches=2, enable_checkpointing=False, **quiet(tmp_path)).fit(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- manual optimization: self.optimizers() is an instance of the optimizer's class ----------------
class ManualTwo(HelloWorld):
    def __init__(self):
        super().__init__(expect_world_size=0)
        self.automatic_optimization = False
        self.head = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        assert isinstance(opt_a, torch.optim.Adam) and isinstance(opt_b, torch.optim.SGD)
        assert not isinstance(opt_b, torch.optim.Adam) and isinstance(opt_a, torch.optim.Optimizer)
        assert opt_a.param_groups is opt_a.optimizer.param_groups and opt_a.defaults["lr"] == 0.01
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.net(x)), y)
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=0.01), torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_manual_optimizers_are_instances_of_their_class(tmp_path):
    trainer = Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, enable_checkpointing=False,
                      **quiet(tmp_path))
    trainer.fit(ManualTwo())
    assert trainer.global_step == 4  # two optimizers, two batches


def test_the_optimizer_wrapper_shares_everything_with_the_optimizer():
    from xtrainer.loop.optimizers import StrategyOptimizer

    class Strategy:
        def optimizer_step(self, optimizer, before):
            optimizer.step()

    layer = nn.Linear(2, 1)
    adam = torch.optim.Adam(layer.parameters(), lr=0.1)
    wrapped = StrategyOptimizer(adam, Strategy(), None)
    assert type(wrapped).__name__ == "StrategyAdam" and isinstance(wrapped, torch.optim.Adam)
    layer(torch.ones(1, 2)).sum().backward()
    wrapped.step()
    state = wrapped.state_dict()
    assert len(adam.state) == 2 and state["state"].keys() == {0, 1}
    wrapped.load_state_dict(state)  # replaces the optimizer's state: still one state, the optimizer's
    assert wrapped.state is adam.state and wrapped.param_groups is adam.param_groups
    wrapped.add_param_group({"params": [nn.Parameter(torch.ones(1))], "lr": 0.5})
    assert len(adam.param_groups) == 2 and sorted(vars(wrapped)) == sorted(StrategyOptimizer._OWN)
    wrapped.param_groups[0]["lr"] = 0.3
    assert adam.param_groups[0]["lr"] == 0.3


# ---- callbacks: fast_dev_run keeps them; Lightning's names; callback_metrics are tensors ------------
def test_fast_dev_run_keeps_the_users_checkpoint_callback(tmp_path):
    from xtrainer.callbacks import EarlyStopping, ModelCheckpoint

    checkpoint, early = ModelCheckpoint(monitor="val_loss"), EarlyStopping(monitor="val_loss")

    class WithModuleCallbacks(HelloWorld):
        def configure_callbacks(self):
            return [EarlyStopping(monitor="val_loss", patience=5)]  # replaces the one of its type given

    trainer = Trainer(fast_dev_run=True, callbacks=[checkpoint, early], **quiet(tmp_path))
    model = WithModuleCallbacks()
    trainer.fit(model)
    assert trainer.global_step == 1
    assert trainer.checkpoint_callback is checkpoint and checkpoint.best_model_path == ""
    assert trainer.checkpoint_callbacks == [checkpoint]
    assert trainer.early_stopping_callback.patience == 5 and len(trainer.early_stopping_callbacks) == 1
    assert trainer.progress_bar_callback is None and trainer.prediction_writer_callbacks == []
    assert not any(files for _, _, files in os.walk(tmp_path))  # nothing written
    metrics = trainer.callback_metrics
    assert isinstance(metrics["val_loss"], torch.Tensor) and metrics["val_loss"].device.type == "cpu"
    assert metrics["val_loss"].item() > 0 and f"{metrics['val_loss']:.3f}" == f"{metrics['val_loss'].item():.3f}"
    assert isinstance(trainer.logged_metrics["train_loss"], torch.Tensor)
    assert trainer.validate(model, verbose=False)[0]["val_loss"] > 0  # no best checkpoint: the module as it is
    # without a checkpoint callback given, the default one is there too (saving nothing)
    trainer = Trainer(fast_dev_run=2, **quiet(tmp_path))
    trainer.fit(HelloWorld())
    assert trainer.checkpoint_callback.best_model_path == "" and trainer.global_step == 2


def test_lightning_callback_names_work(tmp_path, capsys):
    from xtrainer.callbacks import (BasePredictionWriter, DeviceStatsMonitor, GradientAccumulationScheduler,
                                    LambdaCallback, ModelSummary, RichModelSummary, RichProgressBar, Timer,
                                    TQDMProgressBar, XlaHealth)

    class Writer(BasePredictionWriter):
        def __init__(self):
            super().__init__(write_interval="batch_and_epoch")
            self.batches, self.epochs = 0, []

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.batches += 1

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.epochs.append(len(predictions))
            self.predictions = predictions

    class Predicting(HelloWorld):
        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

        predict_dataloader = HelloWorld.test_dataloader

    epochs_seen = []
    timer = Timer(duration={"days": 1})
    accumulate = GradientAccumulationScheduler({1: 2})
    trainer = Trainer(max_epochs=2, limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=False,
                      default_root_dir=str(tmp_path), logger=False,
                      callbacks=[RichModelSummary(max_depth=2), TQDMProgressBar(refresh_rate=10), timer, accumulate,
                                 DeviceStatsMonitor(cpu_stats=True),
                                 LambdaCallback(on_train_epoch_end=lambda t, m: epochs_seen.append(t.current_epoch))])
    trainer.fit(HelloWorld())
    out = capsys.readouterr().out
    assert out.count("Total params") == 1 and "net.0" in out  # one summary, to depth 2
    assert epochs_seen == [0, 1] and trainer.global_step == 4 + 2  # 4 batches, then 4 accumulated by 2
    assert 0 < timer.time_elapsed("train") < 600 and timer.time_remaining() > 0
    assert sum(isinstance(cb, XlaHealth) for cb in trainer.callbacks) == 1
    assert isinstance(trainer.progress_bar_callback, TQDMProgressBar)
    assert RichProgressBar(leave=True).leave and ModelSummary(max_depth=0).max_depth == 0
    # a Timer stops the fit
    trainer = Trainer(max_epochs=50, callbacks=[Timer(duration="00:00:00:00", verbose=False)],
                      enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(HelloWorld())
    assert trainer.current_epoch <= 1
    writer = Writer()
    trainer = Trainer(callbacks=[writer], enable_checkpointing=False, **quiet(tmp_path))
    trainer.predict(Predicting())
    assert writer.batches == 2 and writer.epochs == [2] and trainer.prediction_writer_callbacks == [writer]
    # with several dataloaders, one list of predictions per dataloader, as trainer.predict returns them
    loaders = [DataLoader(make_data(16, seed=1), batch_size=8), DataLoader(make_data(12, seed=2), batch_size=8)]
    returned = trainer.predict(Predicting(), loaders)
    assert writer.epochs[-1] == 2 and [len(p) for p in writer.predictions] == [2, 2]
    assert all(torch.equal(a, b) for mine, theirs in zip(writer.predictions, returned) for a, b in zip(mine, theirs))
    with pytest.raises(ImportError, match="no StochasticWeightAveraging.*AveragedModel"):
        from xtrainer.callbacks import StochasticWeightAveraging  # noqa: F401


class IndexWriter(BasePredictionWriter):
    """A prediction writer as Lightning's documentation writes one: each replica saves its
    predictions and the batches' dataset indices to files of its own rank."""

    def __init__(self, folder, interval):
        super().__init__(interval)
        self.folder = folder

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        torch.save({"indices": batch_indices, "x": batch[0]},
                   os.path.join(self.folder, f"b{trainer.global_rank}_{dataloader_idx}_{batch_idx}.pt"))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save({"predictions": predictions, "indices": batch_indices},
                   os.path.join(self.folder, f"epoch{trainer.global_rank}.pt"))


class PredictSums(HelloWorld):
    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return batch[0].sum(dim=1)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from make_data(8, seed=3)


@pytest.mark.parametrize("workers", [0, 2])
def test_prediction_writers_get_the_batches_dataset_indices_as_drawn(tmp_path, workers):
    """``batch_indices``: the dataset indices of each batch's samples, in the order the (here
    shuffling) sampler drew them, also with workers drawing ahead; at the epoch's end one list
    per batch inside one list per dataloader, as Lightning gives them. A loader without a batch
    sampler gives []."""
    data = make_data(20, seed=5)
    shuffled = DataLoader(data, batch_size=6, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(7))
    trainer = Trainer(callbacks=[IndexWriter(str(tmp_path), "batch_and_epoch")], **quiet(tmp_path))
    returned = trainer.predict(PredictSums(), [shuffled, DataLoader(_Stream(), batch_size=4)])
    epoch = torch.load(tmp_path / "epoch0.pt")
    shuffled_indices, stream_indices = epoch["indices"]
    assert [len(b) for b in shuffled_indices] == [6, 6, 6, 2] and stream_indices == []
    assert sorted(i for b in shuffled_indices for i in b) == list(range(20))
    assert shuffled_indices != [list(range(i, min(i + 6, 20))) for i in range(0, 20, 6)]  # drawn shuffled
    for batch_idx, indices in enumerate(shuffled_indices):
        written = torch.load(tmp_path / f"b0_0_{batch_idx}.pt")
        assert written["indices"] == indices
        assert torch.equal(written["x"], data.tensors[0][indices])  # the batch is those samples
        assert torch.allclose(returned[0][batch_idx], data.tensors[0][indices].sum(dim=1))  # summed on the device
    assert torch.load(tmp_path / "b0_1_0.pt")["indices"] == []
    # one dataloader: the predictions flat, the indices still in a list of their own
    trainer = Trainer(callbacks=[IndexWriter(str(tmp_path), "epoch")], **quiet(tmp_path))
    trainer.predict(PredictSums(), DataLoader(data, batch_size=8))
    assert torch.load(tmp_path / "epoch0.pt")["indices"] == [[list(range(8)), list(range(8, 16)), [16, 17, 18, 19]]]


def test_prediction_writers_on_two_replicas_get_each_ones_share_of_the_indices(tmp_path):
    data = make_data(20, seed=5)
    trainer = Trainer(strategy="xla_ddp", devices=2, callbacks=[IndexWriter(str(tmp_path), "epoch")],
                      **quiet(tmp_path))
    trainer.predict(PredictSums(expect_world_size=2, expect_devices=2), DataLoader(data, batch_size=4, shuffle=True))
    shares = [torch.load(tmp_path / f"epoch{rank}.pt") for rank in (0, 1)]
    indices = [[i for b in share["indices"][0] for i in b] for share in shares]
    assert sorted(indices[0] + indices[1]) == list(range(20)) and not set(indices[0]) & set(indices[1])
    for share in shares:  # each prediction is that of the samples its indices name
        for batch, prediction in zip(share["indices"][0], share["predictions"]):
            assert torch.allclose(prediction, data.tensors[0][batch].sum(dim=1))  # computed on the XLA device


# ---- fine-tuning: a parameter group added mid-fit, across a checkpoint and resume ------------------
class WithBackbone(HelloWorld):
    def __init__(self):
        super().__init__(expect_world_size=0)  # runs under several launches: no expectation
        torch.manual_seed(1)
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(self.backbone(x)), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(self.backbone(x)), y))

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


def one_and_a_half(epoch):
    return 1.5


def _finetune(tmp_path, max_epochs, ckpt_path=None, **kwargs):
    from xtrainer.callbacks import BackboneFinetuning, ModelCheckpoint

    model = WithBackbone()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=one_and_a_half)
    callbacks = [finetuning, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)]
    trainer = Trainer(max_epochs=max_epochs, num_sanity_val_steps=0, callbacks=callbacks, **quiet(tmp_path),
                      **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer, finetuning


@pytest.mark.filterwarnings("ignore:2 of the parameters to add")
def test_backbone_finetuning_resumes_bitwise_after_the_unfreeze(tmp_path):
    initial = WithBackbone().backbone[0].weight.detach().clone()
    frozen, _, _ = _finetune(tmp_path / "frozen", max_epochs=1)
    assert torch.equal(frozen.backbone[0].weight, initial)  # frozen in epoch 0
    whole, trainer, finetuning = _finetune(tmp_path / "whole", max_epochs=3)
    assert not torch.equal(whole.backbone[0].weight, initial)  # trained from epoch 1
    groups = finetuning._internal_optimizer_metadata[0]
    # BatchNorm stayed trainable (train_bn=True), so its parameters were in the first group already
    assert len(groups) == 2 and groups[1]["params"] == ["backbone.0.weight", "backbone.0.bias"]
    assert finetuning.previous_backbone_lr == pytest.approx(0.001 * 1.5)
    # stopped after the unfreeze (end of epoch 1: two groups in the optimizer), then resumed
    _finetune(tmp_path / "split", max_epochs=2)
    last = str(tmp_path / "split" / "ckpt" / "last.ckpt")
    resumed, trainer, finetuning = _finetune(tmp_path / "split", max_epochs=3, ckpt_path=last)
    assert trainer.global_step == 3 * 4 and len(finetuning._internal_optimizer_metadata[0]) == 2
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_finetuning_helpers_and_refusals(tmp_path):
    from xtrainer.callbacks import BackboneFinetuning, BaseFinetuning

    model = WithBackbone()
    BaseFinetuning.freeze(model.backbone, train_bn=True)
    assert not model.backbone[0].weight.requires_grad and model.backbone[1].weight.requires_grad
    assert [p.shape for p in BaseFinetuning.filter_params(model.backbone, requires_grad=False)] == [(8, 8), (8,)]
    BaseFinetuning.freeze(model.backbone, train_bn=False)
    assert not model.backbone[1].weight.requires_grad and not model.backbone[1].track_running_stats
    opt = torch.optim.SGD(model.net.parameters(), lr=0.1)
    BaseFinetuning.unfreeze_and_add_param_group(model.backbone, opt)  # lr: the first group's / 10
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == pytest.approx(0.01)
    assert model.backbone[1].track_running_stats and len(opt.param_groups[1]["params"]) == 4
    with pytest.warns(UserWarning, match="in the optimizer already"):
        BaseFinetuning.unfreeze_and_add_param_group(model.backbone, opt)
    assert len(opt.param_groups) == 2
    assert len(BaseFinetuning.flatten_modules(nn.ModuleDict({"a": model.backbone, "b": model.net}))) == 6  # the leaves
    with pytest.raises(ValueError, match="an nn.Module attribute 'backbone'"):
        Trainer(max_epochs=1, callbacks=[BackboneFinetuning()], enable_checkpointing=False,
                **quiet(tmp_path)).fit(HelloWorld())


@pytest.mark.multi_device
@pytest.mark.filterwarnings("ignore:2 of the parameters to add")
@pytest.mark.parametrize("strategy", ["xla_spmd"])  # sharded checkpoints; xla_native x2 passes too (4 min for both)
def test_backbone_finetuning_resumes_bitwise_with_two_replicas(tmp_path, strategy):
    whole, _, _ = _finetune(tmp_path / "whole", max_epochs=3, strategy=strategy, devices=2)
    _finetune(tmp_path / "split", max_epochs=2, strategy=strategy, devices=2)
    last = str(tmp_path / "split" / "ckpt" / "last.ckpt")
    resumed, trainer, _ = _finetune(tmp_path / "split", max_epochs=3, ckpt_path=last, strategy=strategy, devices=2)
    assert not torch.equal(whole.backbone[0].weight, WithBackbone().backbone[0].weight)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


# ---- an optimizer over part of the model under the FSDP strategies ----------------------------------
class PartlyOptimized(HelloWorld):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.net(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=0.01)  # the head is not trained


@pytest.mark.parametrize("strategy", ["xla_fsdp", "xla_fsdpv2"])
def test_an_optimizer_over_part_of_the_model_under_fsdp(tmp_path, strategy):
    model = PartlyOptimized()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(strategy=strategy, max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                      enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(model)  # under xla_fsdp the optimizer's parameters are mapped to their shards
    assert torch.equal(model.head.weight, before["head.weight"])
    assert not torch.equal(model.net[0].weight, before["net.0.weight"])


# ---- torchmetrics' compute() called explicitly in a hook, with several replicas ---------------------
class ExplicitCompute(HelloWorld):
    def __init__(self):
        super().__init__(expect_world_size=0)
        import torchmetrics

        self.explicit = torchmetrics.MeanSquaredError()
        self.by_object = torchmetrics.MeanSquaredError()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.explicit.update(self.net(x), y)
        self.by_object(self.net(x), y)
        self.log("val_mse_logged", self.by_object)

    def on_validation_epoch_end(self):
        self.log("val_mse_explicit", self.explicit.compute())  # every replica's states, gathered in the graph
        self.explicit.reset()


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["xla_native", "xla_ddp"])
def test_an_explicit_metric_compute_sees_every_replica(tmp_path, strategy):
    model = ExplicitCompute()
    data = make_data(16, seed=3)
    with torch.no_grad():
        expected = nn.functional.mse_loss(model.net(data.tensors[0]), data.tensors[1]).item()
    trainer = Trainer(strategy=strategy, devices=2, **quiet(tmp_path))
    (result,) = trainer.validate(model, DataLoader(data, batch_size=4), verbose=False)
    assert result["val_mse_logged"] == pytest.approx(expected, rel=1e-5)
    assert result["val_mse_explicit"] == pytest.approx(expected, rel=1e-5)


class _FloatStream(torch.utils.data.IterableDataset):
    """Eight samples, streamed: a loader without a length."""

    def __iter__(self):
        for i in range(8):
            yield torch.tensor([float(i)])


class _StreamModule(LightningModule):
    """A one-cycle schedule over the fit's steps, and Lightning 2's recipe for epoch-end work over
    the validation outputs (``torch.stack`` of what the steps kept)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(1, 1)
        self.outputs, self.validated_at = [], []

    def training_step(self, batch, batch_idx):
        return self.net(batch[0] if isinstance(batch, list) else batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.outputs.append(self.net(batch[0]).mean())

    def on_validation_epoch_end(self):
        self.validated_at.append(self.global_step)
        torch.stack(self.outputs)
        self.outputs.clear()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(
            opt, 0.1, total_steps=self.trainer.estimated_stepping_batches)}


def test_a_stream_with_max_steps_and_an_int_validation_interval_runs_as_in_lightning(tmp_path):
    """``estimated_stepping_batches`` is ``max_steps`` for a loader without a length (it raised),
    and validation runs every N batches only (it also ran whenever the stream ran out)."""
    module = _StreamModule()
    trainer = Trainer(strategy="native", max_steps=16, val_check_interval=3, check_val_every_n_epoch=None,
                      num_sanity_val_steps=0, enable_checkpointing=False, **quiet(tmp_path))
    val = DataLoader(make_data(4, features=1), batch_size=2)
    trainer.fit(module, DataLoader(_FloatStream(), batch_size=1), val)
    assert trainer.estimated_stepping_batches == 16
    assert module.validated_at == [3, 6, 11, 14]  # Lightning's steps (two 8-batch epochs)
    assert Trainer(strategy="native", **quiet(tmp_path)).estimated_stepping_batches == float("inf")


def test_limit_val_batches_zero_runs_no_validation_hook(tmp_path):
    """No validation at all, as in Lightning: its epoch hooks ran with no batch, and the recipe
    above raised (``torch.stack`` of nothing)."""
    module = _StreamModule()
    trainer = Trainer(strategy="native", max_epochs=2, limit_val_batches=0, enable_checkpointing=False,
                      **quiet(tmp_path))
    trainer.fit(module, DataLoader(make_data(4, features=1), batch_size=2),
                DataLoader(make_data(4, features=1), batch_size=2))
    assert module.validated_at == [] and trainer.global_step == 4
    # validate() with no batch to run: nothing runs and [] comes back, as in Lightning (the
    # epoch-end recipe raised on an empty list); predict() gives None.
    data = DataLoader(make_data(4, features=1), batch_size=2)
    for stage, limit in (("validate", "limit_val_batches"), ("predict", "limit_predict_batches")):
        trainer = Trainer(strategy="native", enable_checkpointing=False, **{limit: 0}, **quiet(tmp_path))
        result = getattr(trainer, stage)(module, data)
        assert result == (None if stage == "predict" else []), stage
    assert module.validated_at == []


class _StopsItself(LightningModule):
    """Stops the fit from its step once a target is reached (a user's early stop)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.validated_at = []

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.trainer.should_stop = True
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def on_validation_epoch_end(self):
        self.validated_at.append(self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_stop_asked_for_inside_an_epoch_validates_and_checkpoints_that_step_first(tmp_path):
    """As Lightning does: the stop's batch is validated, so a monitored checkpoint of that step is
    written and ``test(ckpt_path="best")`` has one (neither happened before)."""
    from xtrainer.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss")
    module = _StopsItself()
    trainer = Trainer(strategy="native", max_epochs=5, num_sanity_val_steps=0, callbacks=[saver], **quiet(tmp_path))
    trainer.fit(module, DataLoader(make_data(40), batch_size=4), DataLoader(make_data(16), batch_size=8))
    assert trainer.global_step == 3 and module.validated_at == [3]
    assert os.path.basename(saver.best_model_path) == "epoch=0-step=3.ckpt" and "val_loss" in trainer.callback_metrics


class _LogsFromHooks(LightningModule):
    """``self.log`` where Lightning projects call it outside the step methods."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def on_train_start(self):
        self.log("start_metric", 1.0)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer):
        self.log("step_in_hook", float(self.global_step))  # as the grad_norm recipe logs there

    def validation_step(self, batch, batch_idx):
        return None

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.log("val_batch_idx", float(batch_idx))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _LogsAtEpochEnds(Callback):
    def on_validation_epoch_end(self, trainer, pl_module):
        pl_module.log("cb_val_metric", 7.0)

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.log("cb_train_metric", 8.0)


def test_values_logged_in_hooks_and_callbacks_are_per_step_or_per_epoch_as_in_lightning(tmp_path):
    """Batch hooks log per step in training (one row per step) and per epoch (a mean) in
    validation; callbacks' epoch-end values and ``on_train_start``'s reach the loggers and
    ``callback_metrics``. They were kept as one epoch value, or lost."""
    import csv

    from xtrainer.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    trainer = Trainer(strategy="native", max_epochs=1, log_every_n_steps=1, num_sanity_val_steps=0,
                      callbacks=[_LogsAtEpochEnds()], enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), logger=logger)
    trainer.fit(_LogsFromHooks(), DataLoader(make_data(16), batch_size=4), DataLoader(make_data(16), batch_size=4))
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    assert [float(r["step_in_hook"]) for r in rows if r.get("step_in_hook")] == [0.0, 1.0, 2.0, 3.0]
    assert [r["val_batch_idx"] for r in rows if r.get("val_batch_idx")] == ["1.5"]  # the mean of 0..3
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["val_batch_idx"] == 1.5 and metrics["start_metric"] == 1.0
    assert metrics["cb_val_metric"] == 7.0 and metrics["cb_train_metric"] == 8.0
    assert [r["cb_train_metric"] for r in rows if r.get("cb_train_metric")] == ["8.0"]


class _Curriculum(LightningDataModule):
    """A data module whose state (the batch size it has grown to) shapes its loader."""

    def __init__(self):
        super().__init__()
        self.batch_size, self.asked_with = 4, []

    def train_dataloader(self):
        self.asked_with.append(self.batch_size)
        return DataLoader(make_data(64), batch_size=self.batch_size)

    def state_dict(self):
        return {"batch_size": self.batch_size}

    def load_state_dict(self, state):
        self.batch_size = state["batch_size"]


class _Grows(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_epoch_end(self):
        self.trainer.datamodule.batch_size *= 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_resumed_data_module_has_its_state_back_before_its_loaders_are_asked_for(tmp_path):
    first = _Curriculum()
    Trainer(strategy="native", max_epochs=2, **quiet(tmp_path)).fit(_Grows(), datamodule=first)
    assert first.asked_with == [4]
    resumed, trainer = _Curriculum(), Trainer(strategy="native", max_epochs=3, **quiet(tmp_path))
    trainer.fit(_Grows(), datamodule=resumed, ckpt_path="last")
    assert resumed.asked_with == [16] and trainer.num_training_batches == 4  # it was asked with 4, then restored


class _Sized(LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.seen = 0

    def train_dataloader(self):
        return DataLoader(make_data(16), batch_size=self.hparams.batch_size)

    def state_dict(self):
        return {"seen": 3}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class _Plain(LightningModule):
    def __init__(self, backbone: nn.Module, width: int = 8):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.backbone(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_data_module_constructors_and_class_only_loading_as_in_lightning(tmp_path):
    """``from_datasets`` and a data module's ``load_from_checkpoint``; ``load_from_checkpoint``
    called on an instance is refused (it returned a new object and left the instance as it
    was); an argument the hyperparameters lack is named, with how to give it."""
    dm = LightningDataModule.from_datasets(make_data(16), val_dataset=[make_data(8), make_data(4)], batch_size=4)
    assert len(dm.train_dataloader()) == 4 and [len(dl) for dl in dm.val_dataloader()] == [2, 1]
    assert isinstance(dm.train_dataloader().sampler, torch.utils.data.RandomSampler)
    trainer = Trainer(strategy="native", max_epochs=1, **quiet(tmp_path))
    module = _Plain(nn.Linear(8, 1))
    trainer.fit(module, datamodule=_Sized(batch_size=8))
    path = trainer.checkpoint_callback.last_model_path
    restored = _Sized.load_from_checkpoint(path)
    assert restored.hparams.batch_size == 8 and restored.seen == 3
    assert _Sized.load_from_checkpoint(path, batch_size=2).hparams.batch_size == 2
    with pytest.raises(TypeError, match="called on the class"):
        module.load_from_checkpoint(path)
    with pytest.raises(TypeError, match=r"no value for backbone .*load_from_checkpoint\(path, backbone=\.\.\.\)"):
        _Plain.load_from_checkpoint(path)
    assert _Plain.load_from_checkpoint(path, backbone=nn.Linear(8, 1)).hparams.width == 8


def test_accumulation_set_twice_is_refused_as_in_lightning(tmp_path):
    from xtrainer.callbacks import GradientAccumulationScheduler

    with pytest.raises(ValueError, match="accumulate_grad_batches=2 and a GradientAccumulationScheduler"):
        Trainer(strategy="native", accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({0: 4})],
                **quiet(tmp_path))


class _LogsItsBatch(LightningModule):
    """Logs its batch index as a per-step training value."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        self.log("train_idx", float(batch_idx))
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ReadsMetricsAtBatchEnd(Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = trainer.callback_metrics.get("train_idx")
        self.seen.append(None if value is None else float(value))


def _counting_to_cpu(trainer, calls):
    to_cpu = trainer.strategy.runtime.to_cpu

    def counted(*args, **kwargs):
        calls.append(1)
        return to_cpu(*args, **kwargs)

    trainer.strategy.runtime.to_cpu = counted


@pytest.mark.parametrize("strategy", ["native", "xla_native"])
def test_a_training_value_monitored_every_n_train_steps_is_the_steps_own_between_logging_steps(tmp_path, strategy):
    """Lightning computes ``callback_metrics`` when read: a ``ModelCheckpoint(every_n_train_steps=2)``
    monitoring a value ``training_step`` logs ranks each checkpoint by its own step's value, also
    where that step is not a logging step (``log_every_n_steps`` 50 here). It kept nothing: the
    value had never been read. The read happens only where a hook asks (one host sync each time)."""
    from xtrainer.callbacks import ModelCheckpoint

    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 4)), batch_size=4)
    reader = _ReadsMetricsAtBatchEnd()
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="train_idx", mode="max", save_top_k=2,
                                  every_n_train_steps=2)
    trainer = Trainer(strategy=strategy, max_epochs=1, callbacks=[reader, checkpoints],
                      **quiet(tmp_path))
    trainer.fit(_LogsItsBatch(), data)
    assert reader.seen == [float(i) for i in range(10)]
    assert sorted((os.path.basename(p), float(s)) for p, s in checkpoints.best_k_models.items()) == [
        ("epoch=0-step=10.ckpt", 9.0), ("epoch=0-step=8.ckpt", 7.0)]
    if strategy == "native":
        return  # values on the CPU are read without a transfer: nothing to count
    # Nothing read where no hook asks: the same fit without the readers makes only the logging reads.
    calls = {}
    for name, callbacks in (("quiet", []), ("reading", [_ReadsMetricsAtBatchEnd()])):
        trainer = Trainer(strategy=strategy, max_epochs=1, callbacks=callbacks, log_every_n_steps=5,
                          **quiet(tmp_path, enable_checkpointing=False))
        calls[name] = []
        _counting_to_cpu(trainer, calls[name])
        trainer.fit(_LogsItsBatch(), data)
    assert len(calls["reading"]) == len(calls["quiet"]) + 8  # the 8 steps of 10 that are not logging steps


class _LogsAndReadsAtBatchEnd(_LogsItsBatch):
    """Logs a value in its own ``on_train_batch_end`` and reads it back at once, as Lightning
    lets it."""

    def __init__(self):
        super().__init__()
        self.read_back = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("end_idx", float(batch_idx))
        self.read_back.append(float(self.trainer.callback_metrics["end_idx"]))


@pytest.mark.parametrize("reader", [False, True])
def test_a_value_logged_in_on_train_batch_end_reads_back_at_once_whoever_read_before(tmp_path, reader):
    """Lightning's [0, 1, 2, ...] on logging steps and between them, also where a callback read
    ``callback_metrics`` earlier in the same hooks (the read there must not hide later values)."""
    module = _LogsAndReadsAtBatchEnd()
    trainer = Trainer(strategy="native", max_epochs=1, log_every_n_steps=2,
                      callbacks=[_ReadsMetricsAtBatchEnd()] if reader else [], **quiet(tmp_path))
    trainer.fit(module, DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=4))
    assert module.read_back == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


class _PlateauPerStep(LightningModule):
    """A ``ReduceLROnPlateau`` stepped every step on a training value (a plateau every other step)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.lrs = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).square().mean()
        self.log("train_loss", loss if batch_idx % 2 else loss * 0 + 100.0)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def test_a_plateau_scheduler_stepped_per_step_monitors_the_steps_own_training_value(tmp_path):
    """It raised KeyError between logging steps (the value was never read) and used an older step's
    value at them. Now it steps on each step's value, as in Lightning, whose hook sees the rate of
    the batch before (it steps its plateau schedulers after ``on_train_batch_end``); a run resumed
    from a checkpoint of any step ends bitwise as the whole run."""
    from xtrainer.callbacks import ModelCheckpoint

    data = DataLoader(torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=torch.Generator().manual_seed(1)) * 0.01), batch_size=4)
    module = _PlateauPerStep()
    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1)
    Trainer(strategy="native", max_epochs=1, callbacks=[every], **quiet(tmp_path)).fit(module, data)
    assert module.lrs == [1.0, 1.0, 0.5, 0.25, 0.125, 0.125, 0.0625, 0.03125]
    resumed = _PlateauPerStep()
    trainer = Trainer(strategy="native", max_epochs=1, **quiet(tmp_path, enable_checkpointing=False))
    trainer.fit(resumed, data, ckpt_path=str(tmp_path / "ck" / "epoch=0-step=3.ckpt"))
    assert resumed.lrs == module.lrs[3:]
    assert torch.equal(resumed.layer.weight, module.layer.weight) and torch.equal(resumed.layer.bias, module.layer.bias)
