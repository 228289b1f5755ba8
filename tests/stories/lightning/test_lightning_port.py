"""Lightning code, written from Lightning's documented API, runs with its imports changed.

Each module and data module here is written as a Lightning user writes one; only the import
lines differ from a Lightning script (``XModule as LightningModule`` and so on).
"""

import os

import pytest
import torch
from conftest import make_data
from torch import nn
from torch.utils.data import DataLoader, random_split

from xtrainer import Trainer
from xtrainer import XDataModule as LightningDataModule
from xtrainer import XModule as LightningModule
from xtrainer.callbacks import Callback, EarlyStopping, ModelCheckpoint
from xtrainer.checkpoint import CheckpointError


class RegressionDataModule(LightningDataModule):
    def __init__(self, data_dir: str = "", batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.calls = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")
        full = make_data(80)
        self.train_set, self.val_set = random_split(full, [64, 16], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")


class LitRegressor(LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, encoder: nn.Module | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["encoder"])
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.stages = []

    def setup(self, stage):
        self.stages.append(stage)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):  # no batch_idx: Lightning allows leaving it out
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("hidden_from_loggers", loss, logger=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=True)
        self.log("val_worst", (self(x) - y).abs().max(), reduce_fx=torch.max)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))
        self.log("test_target_sum", self.all_gather(y.sum()).sum(), reduce_fx="sum")  # every replica's batch

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (steps + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "strict": True}}


def quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False, **kwargs)


def test_a_lightning_script_runs_with_its_imports_changed(tmp_path, capsys):
    dm = RegressionDataModule(batch_size=8)
    model = LitRegressor(hidden=12, encoder=nn.Linear(2, 2))
    assert dict(model.hparams) == {"hidden": 12, "lr": 0.05} and model.hparams.hidden == 12
    assert dict(dm.hparams) == {"data_dir": "", "batch_size": 8}
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1)
    trainer = Trainer(accelerator="cpu", strategy="auto", max_epochs=2, log_every_n_steps=2,
                      callbacks=[checkpoint], **quiet(tmp_path))
    trainer.fit(model, datamodule=dm)
    assert trainer.datamodule is dm and trainer.checkpoint_callback is checkpoint
    assert trainer.estimated_stepping_batches == 16 and trainer.global_step == 16
    assert dm.calls == ["prepare_data", "setup:fit", "teardown:fit"]
    assert "hidden_from_loggers" in trainer.callback_metrics and "val_worst" in trainer.callback_metrics
    best = checkpoint.best_model_path
    assert os.path.exists(best)

    # validate/test/predict without the model: the fitted one, from its best checkpoint
    validated = trainer.validate(datamodule=dm)
    assert trainer.ckpt_path == best
    assert set(validated[0]) == {"val_loss", "val_worst"}
    assert "Validate metric" in capsys.readouterr().out
    tested = trainer.test(ckpt_path="best", verbose=False)
    assert set(tested[0]) == {"test_loss", "test_target_sum"}
    assert tested[0]["test_target_sum"] == pytest.approx(float(sum(y.sum() for _, y in dm.test_dataloader())))
    predictions = trainer.predict(datamodule=dm)
    assert len(predictions) == 2 and predictions[0].shape == (8, 1)

    # hparams round-trip: the module rebuilt from the checkpoint, with its weights
    restored = LitRegressor.load_from_checkpoint(best)
    assert dict(restored.hparams) == {"hidden": 12, "lr": 0.05}
    assert restored.net[0].out_features == 12
    overridden = LitRegressor.load_from_checkpoint(best, lr=0.5)
    assert overridden.hparams.lr == 0.5
    state = torch.load(best, weights_only=True)["state_dict"]
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in state.items())

    # Lightning's save after fit: the fitted weights, to evaluate or rebuild from, not to resume
    after = str(tmp_path / "after-fit.ckpt")
    trainer.save_checkpoint(after)
    rebuilt = LitRegressor.load_from_checkpoint(after)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in model.state_dict().items())
    assert trainer.validate(rebuilt, datamodule=dm, ckpt_path=after, verbose=False)[0]["val_loss"] > 0
    with pytest.raises(CheckpointError, match="holds the module's weights only"):
        Trainer(max_epochs=3, **quiet(tmp_path)).fit(LitRegressor(hidden=12), datamodule=dm, ckpt_path=after)


@pytest.mark.parametrize("strategy", ["xla_fsdp", "xla_fsdpv2"])
def test_load_from_checkpoint_assembles_sharded_checkpoints(tmp_path, strategy):
    model = LitRegressor(hidden=8)
    trainer = Trainer(strategy=strategy, max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0,
                      **quiet(tmp_path))
    trainer.fit(model, datamodule=RegressionDataModule())
    path = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    assert os.path.isdir(path)
    restored = LitRegressor.load_from_checkpoint(path)
    assert restored.hparams.hidden == 8
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name


def test_save_hyperparameters_in_every_form(tmp_path):
    class Base(LightningModule):
        def __init__(self, width=4, **kwargs):
            super().__init__()
            self.save_hyperparameters()

    class Child(Base):
        def __init__(self, depth=2, width=8, **kwargs):
            super().__init__(width=width, **kwargs)

    assert dict(Child(depth=3, extra="x").hparams) == {"width": 8, "depth": 3, "extra": "x"}

    class Named(LightningModule):
        def __init__(self, a=1, b=2, c=3):
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert dict(Named().hparams) == {"a": 1, "c": 3}

    class Whole(LightningModule):
        def __init__(self, config):
            super().__init__()
            self.save_hyperparameters(config)
            self.layer = nn.Linear(config["n"], 1)

    whole = Whole({"n": 3, "name": "x"})
    assert whole.hparams.n == 3 and whole._hparams_name == "config"
    with pytest.raises(ValueError, match="'zz' is not an argument"):
        Named().save_hyperparameters("zz")
    with pytest.raises(AttributeError, match="hparams has no 'nope'"):
        Named().hparams.nope


def test_fast_dev_run_writes_nothing(tmp_path):
    model = LitRegressor()
    trainer = Trainer(fast_dev_run=True, callbacks=[ModelCheckpoint(save_top_k=-1)], **quiet(tmp_path))
    trainer.fit(model, datamodule=RegressionDataModule())
    assert trainer.global_step == 1
    assert trainer.checkpoint_callback.best_model_path == "" and not trainer.loggers  # kept, as in Lightning
    assert not any(files for _, _, files in os.walk(tmp_path))


class WritesHistograms(LitRegressor):
    def training_step(self, batch):
        self.logger.experiment.add_histogram("weights", self.net[0].weight, self.global_step)
        return super().training_step(batch)


def test_fast_dev_run_keeps_a_logger_that_writes_nothing_as_lightning_does(tmp_path):
    """A step that writes to the logger's experiment itself still runs under fast_dev_run."""
    trainer = Trainer(fast_dev_run=2, default_root_dir=str(tmp_path), enable_progress_bar=False)
    trainer.fit(WritesHistograms(), datamodule=RegressionDataModule())
    assert trainer.global_step == 2 and len(trainer.loggers) == 1
    assert not any(files for _, _, files in os.walk(tmp_path))


def test_a_broken_validation_step_fails_in_the_sanity_check_before_training(tmp_path):
    class Broken(LitRegressor):
        def validation_step(self, batch, batch_idx):
            raise RuntimeError("validation is broken")

    seen = []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append(batch_idx)

    with pytest.raises(RuntimeError, match="validation is broken"):
        Trainer(max_epochs=1, callbacks=[Steps()], **quiet(tmp_path)).fit(Broken(), datamodule=RegressionDataModule())
    assert seen == []


def test_the_sanity_check_changes_neither_training_nor_what_is_logged(tmp_path):
    results = {}
    for steps in (0, 2):
        model = LitRegressor()
        trainer = Trainer(max_epochs=2, num_sanity_val_steps=steps, enable_checkpointing=False,
                          **quiet(tmp_path / str(steps)))
        trainer.fit(model, datamodule=RegressionDataModule())
        results[steps] = (model.state_dict(), dict(trainer.callback_metrics))
    for name, tensor in results[0][0].items():
        assert torch.equal(results[2][0][name], tensor), name
    assert results[0][1] == results[2][1]


def test_min_epochs_max_time_overfit_and_skipping_the_rest_of_an_epoch(tmp_path):
    stopper = EarlyStopping(monitor="val_loss", patience=0, min_delta=100.0)  # stops at the first chance
    trainer = Trainer(max_epochs=10, min_epochs=3, callbacks=[stopper], num_sanity_val_steps=0, **quiet(tmp_path))
    trainer.fit(LitRegressor(), datamodule=RegressionDataModule())
    assert trainer.current_epoch == 3

    trainer = Trainer(max_epochs=10, max_time={"seconds": 0}, **quiet(tmp_path))
    trainer.fit(LitRegressor(), datamodule=RegressionDataModule())
    assert trainer.global_step == 1

    seen = []

    class Overfit(LitRegressor):
        def on_train_batch_start(self, batch, batch_idx):
            seen.append((self.current_epoch, batch[0][:, 0].tolist()))  # host read in a test
            if batch_idx == 1:
                return -1  # Lightning: skip the rest of this epoch

    trainer = Trainer(max_epochs=3, overfit_batches=2, num_sanity_val_steps=0, **quiet(tmp_path))
    trainer.fit(Overfit(), datamodule=RegressionDataModule())
    assert [epoch for epoch, _ in seen] == [0, 0, 1, 1, 2, 2]
    assert seen[0][1] == seen[2][1] == seen[4][1]  # the same first batch, unshuffled, every epoch
    assert trainer.global_step == 3  # the second batch of each epoch was skipped


def test_overridden_optimizer_step_and_module_callbacks(tmp_path):
    class Marker(Callback):
        def __init__(self):
            self.epochs = 0

        def on_train_epoch_end(self, trainer, module):
            self.epochs += 1

    class WarmUp(LitRegressor):
        def configure_callbacks(self):
            return [Marker()]

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            for group in optimizer.param_groups:  # a learning-rate warm-up, as Lightning's docs show
                group["lr"] = min(1.0, (self.trainer.global_step + 1) / 4) * self.hparams.lr
            optimizer.step(closure=optimizer_closure)

    model = WarmUp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(max_epochs=1, limit_train_batches=4, callbacks=[Marker()], **quiet(tmp_path))
    trainer.fit(model, datamodule=RegressionDataModule())
    assert sum(isinstance(cb, Marker) for cb in trainer.callbacks) == 1  # the module's replaced the Trainer's
    assert [cb for cb in trainer.callbacks if isinstance(cb, Marker)][0].epochs == 1
    assert trainer.global_step == 4
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lightning_names_and_refusals(tmp_path):
    # Lightning's names mean the accelerator's family: eager on this CPU, torch_xla when asked for
    assert Trainer(strategy="ddp", **quiet(tmp_path)).strategy.name == "native_ddp"
    assert Trainer(strategy="fsdp", **quiet(tmp_path)).strategy.name == "native_fsdp"
    assert Trainer(strategy="ddp", accelerator="xla", **quiet(tmp_path)).strategy.name == "xla_ddp"
    assert Trainer(strategy="fsdp", accelerator="xla", **quiet(tmp_path)).strategy.name == "xla_fsdp"
    assert Trainer(strategy="xla", **quiet(tmp_path)).strategy.name == "xla_native"
    assert Trainer(precision="bf16-mixed", **quiet(tmp_path)).precision.name == "bf16-mixed"
    with pytest.warns(UserWarning, match="bfloat16, not float16"):
        assert Trainer(precision="16-mixed", **quiet(tmp_path)).precision.name == "bf16-mixed"
    # trainer.precision reads as Lightning's string
    for given, lightning in [(32, "32-true"), ("32", "32-true"), ("bf16-true", "bf16-true"), ("bf16", "bf16-true"),
                             ("bf16-mixed", "bf16-mixed")]:
        precision = Trainer(precision=given, **quiet(tmp_path)).precision
        assert precision == lightning and str(precision) == lightning and f"{precision}" == lightning
    assert "16" in Trainer(precision="bf16-mixed", **quiet(tmp_path)).precision
    with pytest.raises(ValueError, match="accelerator='gpu'.*XLA devices"):
        Trainer(strategy="xla_native", accelerator="gpu")
    with pytest.raises(RuntimeError, match="accelerator='gpu', but PyTorch sees no cuda device here"):
        Trainer(accelerator="gpu")
    with pytest.raises(ValueError, match="max_time='12h'"):
        Trainer(max_time="12h")
    with pytest.raises(ValueError, match="num_nodes=2: the XLA CPU runtime runs on one host"):
        Trainer(strategy="xla_native", num_nodes=2)
    with pytest.raises(ValueError, match="num_nodes=2: the native strategies run on several hosts under torchrun"):
        Trainer(num_nodes=2)
    with pytest.raises(ValueError, match="both dataloaders and a datamodule"):
        Trainer(**quiet(tmp_path)).fit(LitRegressor(), DataLoader(make_data()), datamodule=RegressionDataModule())
    with pytest.raises(ValueError, match="has not fitted one"):
        Trainer(**quiet(tmp_path)).validate()
    with pytest.raises(TypeError, match="unexpected argument 'max_epoch'. Did you mean 'max_epochs'"):
        Trainer(max_epoch=1)
    with pytest.raises(ValueError, match="plugins=...: Lightning's plugins"):
        Trainer(plugins=[object()])

    bare = Trainer(barebones=True, **quiet(tmp_path))
    assert bare.checkpoint_callback is None and not bare.loggers and bare.num_sanity_val_steps == 0


class AugmentsOnDevice(LitRegressor):
    """Lightning's batch-transfer hooks: a dict made on the host, moved by the default transfer
    (through super()), the inputs doubled on the device."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.seen.append(("before", batch[0].device.type, dataloader_idx))
        return {"x": batch[0], "y": batch[1]}

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.seen.append(("move", device.type, dataloader_idx))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.seen.append(("after", batch["x"].device.type, dataloader_idx))
        return (batch["x"] * 2, batch["y"])


class DoubledData(RegressionDataModule):
    """The same data with the inputs doubled on the host: what AugmentsOnDevice trains on."""

    def setup(self, stage):
        super().setup(stage)
        x, y = make_data(80).tensors
        full = torch.utils.data.TensorDataset(x * 2, y)
        self.train_set, self.val_set = random_split(full, [64, 16], generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("strategy, before_on", [("xla_native", "xla"), ("native", "cpu")])
def test_the_batch_transfer_hooks_run_in_lightnings_order_before_each_step(tmp_path, strategy, before_on):
    """on_before_batch_transfer, transfer_batch_to_device, on_after_batch_transfer for every
    training and validation batch, before on_*_batch_start, with the loader's index; the model
    trains exactly as on data altered beforehand. On XLA batches travel in torch_xla's loader,
    so the first hook sees them on the device (as in Lightning on TPUs)."""
    order = []

    class Order(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            order.append(("start", type(batch).__name__))

    model = AugmentsOnDevice()
    kwargs = quiet(tmp_path / "hooks", max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                   num_sanity_val_steps=0, enable_checkpointing=False, strategy=strategy)
    Trainer(callbacks=[Order()], **kwargs).fit(model, datamodule=RegressionDataModule())
    device = "xla" if strategy.startswith("xla") else "cpu"
    assert model.seen == [("before", before_on, 0), ("move", device, 0), ("after", device, 0)] * 3
    assert order == [("start", "tuple")] * 2
    reference = LitRegressor()
    Trainer(**dict(kwargs, default_root_dir=str(tmp_path / "reference"))).fit(reference, datamodule=DoubledData())
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)

    model.seen.clear()
    loaders = [DataLoader(make_data(16), batch_size=8), DataLoader(make_data(8), batch_size=8)]
    Trainer(**kwargs).validate(model, loaders)
    assert [idx for what, _, idx in model.seen if what == "after"] == [0, 1]  # limit_val_batches=1 of each


def test_a_data_modules_batch_transfer_hook_is_used_and_wins_over_the_modules(tmp_path):
    """As in Lightning: the data module's hook where it overrides one, with a warning where the
    module overrides the same one."""

    class Doubles(RegressionDataModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch[0] * 2, batch[1]

    class AlsoOverrides(LitRegressor):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            raise AssertionError("the data module's hook is the one called")

    kwargs = quiet(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=0, enable_checkpointing=False)
    model = AlsoOverrides()
    with pytest.warns(UserWarning, match="on_after_batch_transfer is overridden in both AlsoOverrides and Doubles: "
                                         "the data module's is used"):
        Trainer(**kwargs).fit(model, datamodule=Doubles())
    reference = LitRegressor()
    Trainer(**kwargs).fit(reference, datamodule=DoubledData())
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_bf16_mixed_trains_with_float32_weights(tmp_path):
    model = LitRegressor()
    trainer = Trainer(precision="bf16-mixed", max_epochs=1, limit_train_batches=3, num_sanity_val_steps=0,
                      enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(model, datamodule=RegressionDataModule())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert trainer.callback_metrics["val_loss"] > 0


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["xla_fsdp"])  # DDP at 2 replicas: test_manual_optimization, test_replicas
def test_the_lightning_script_on_two_replicas(tmp_path, strategy):
    dm = RegressionDataModule(batch_size=4)
    model = LitRegressor(hidden=12)
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=1, callbacks=[ModelCheckpoint(monitor="val_loss")],
                      **quiet(tmp_path))
    trainer.fit(model, datamodule=dm)
    assert dm.calls == ["prepare_data", "setup:fit", "teardown:fit"]  # in the calling process, once
    assert trainer.global_step == 8 and "val_loss" in trainer.callback_metrics
    tested = trainer.test(verbose=False)  # the fitted module, from its best checkpoint
    expected = float(sum(y.sum() for _, y in dm.test_dataloader()))
    assert tested[0]["test_target_sum"] == pytest.approx(expected)  # all_gather saw both replicas' halves
    restored = LitRegressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    assert restored.hparams.hidden == 12


def test_reload_dataloaders_every_n_epochs_asks_the_hook_again(tmp_path):
    class Growing(RegressionDataModule):
        def train_dataloader(self):
            self.calls.append("train_dataloader")
            size = 16 * self.calls.count("train_dataloader")  # a bigger loader each time it is asked
            return DataLoader(torch.utils.data.Subset(self.train_set, range(size)), batch_size=8)

    dm = Growing()
    trainer = Trainer(max_epochs=4, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0,
                      enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(LitRegressor(), datamodule=dm)
    assert dm.calls.count("train_dataloader") == 2  # at the start, then for epoch 2
    assert trainer.global_step == 2 * 2 + 2 * 4  # epochs 0-1: 16 samples, epochs 2-3: 32


class _ManualWithEpochScheduler(LightningModule):
    """Lightning's manual-optimization recipe: step the scheduler on the epoch's last batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(8, 1)
        self.seen: list[tuple] = []

    def training_step(self, batch, batch_idx):
        opt, sch = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        t = self.trainer
        self.seen.append(("train", batch_idx, t.is_last_batch, t.training, t.validating, t.sanity_checking))
        if self.trainer.is_last_batch:
            sch.step()

    def validation_step(self, batch, batch_idx):
        t = self.trainer
        self.seen.append(("val", batch_idx, t.training, t.validating, t.sanity_checking, t.testing))

    def test_step(self, batch, batch_idx):
        t = self.trainer
        self.seen.append(("test", batch_idx, t.testing, t.training, t.validating, t.num_test_batches))

    def predict_step(self, batch, batch_idx):
        self.seen.append(("predict", batch_idx, self.trainer.predicting, self.trainer.num_predict_batches))
        return batch[0].sum()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def test_lightning_trainer_attributes_read_inside_a_module(tmp_path):
    """What a Lightning module reads off ``self.trainer``: ``is_last_batch`` (its manual
    optimization recipe steps the scheduler there), the stage flags, the loaders and batch counts
    and the limits; Lightning's spellings of ``devices`` and ``max_epochs=-1``."""
    from conftest import make_loader

    model = _ManualWithEpochScheduler()
    train, val = make_loader(40, 8), make_loader(16, 8)
    trainer = Trainer(accelerator="cpu", devices="1", max_epochs=-1, max_steps=10, num_sanity_val_steps=1,
                      limit_val_batches=2, log_every_n_steps=2, **quiet(tmp_path))
    trainer.fit(model, train, val)
    assert trainer.max_epochs == -1 and trainer.global_step == 10 and not trainer.interrupted
    # 5 batches per epoch: the last of each is the one the scheduler steps on (twice: lr 0.1 -> 0.025)
    lasts = [(i, last) for kind, i, last, *_ in model.seen if kind == "train"]
    assert lasts == [(i, i == 4) for i in range(5)] * 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)
    assert all(tuple(flags) == (True, False, False) for kind, _, _, *flags in model.seen if kind == "train")
    vals = [entry[2:] for entry in model.seen if entry[0] == "val"]
    assert vals[0] == (False, False, True, False)  # the sanity check: one batch
    assert vals[1:] == [(False, True, False, False)] * 4  # two epochs' validation, two batches each
    assert trainer.num_sanity_val_batches == [1] and trainer.num_val_batches == [2]
    assert trainer.limit_val_batches == 2 and trainer.limit_train_batches == 1.0
    assert trainer.train_dataloader.dataset is train.dataset and trainer.val_dataloaders.dataset is val.dataset
    assert trainer.enable_validation and not trainer.received_sigterm

    model.seen.clear()
    test_loader = make_loader(24, 8)
    trainer.test(model, test_loader, verbose=False)
    assert [entry[2:] for entry in model.seen] == [(True, False, False, [3])] * 3
    assert trainer.test_dataloaders.dataset is test_loader.dataset and not trainer.testing  # over once test() returns
    model.seen.clear()
    trainer.predict(model, [make_loader(16, 8), make_loader(8, 8)])
    assert [entry[2:] for entry in model.seen] == [(True, [2, 1])] * 3
    assert len(trainer.predict_dataloaders) == 2


@pytest.mark.parametrize("devices, count", [("2", 2), ([0, 1], 2), ("0,1", 2), ((0,), 1), (-1, None), ("-1", None)])
def test_lightnings_spellings_of_devices(devices, count):
    from xtrainer.config.settings import TrainerSettings, lightning_devices

    assert lightning_devices(devices) == (count if count is not None else "auto")
    assert TrainerSettings(devices=devices).check().devices == (count if count is not None else "auto")


def test_device_indices_other_than_the_first_are_refused_with_what_to_do():
    from xtrainer.config.settings import TrainerSettings

    with pytest.raises(ValueError, match=r"devices=\[1, 3\]: xtrainer uses the first devices .*CUDA_VISIBLE_DEVICES=1,3"):
        TrainerSettings(devices=[1, 3]).check()


class LossLogger(LightningModule):
    """Logs a value of its own under the name ``loss`` (many Lightning projects do)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("loss", loss * 0 + 123.0, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_value_the_module_logs_as_loss_is_its_own_metric(tmp_path, capsys):
    """``self.log("loss", ...)`` reaches callback_metrics, the loggers, the progress bar and a
    checkpoint's monitor, as in Lightning; the loop's own training loss does not replace it."""
    from xtrainer.loggers import CSVLogger

    checkpoint = ModelCheckpoint(monitor="loss", filename="{epoch}-{loss:.1f}")
    trainer = Trainer(strategy="native", max_epochs=1, log_every_n_steps=1, default_root_dir=tmp_path,
                      callbacks=[checkpoint], enable_model_summary=False, logger=CSVLogger(tmp_path))
    trainer.fit(LossLogger(), DataLoader(torch.randn(8, 4), batch_size=2))
    assert float(trainer.callback_metrics["loss"]) == float(trainer.logged_metrics["loss"]) == 123.0
    assert trainer.progress_bar_metrics["loss"] == 123.0
    assert os.path.basename(checkpoint.best_model_path) == "epoch=0-loss=123.0.ckpt"
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        header, *rows = [line.strip().split(",") for line in f]
    assert header.count("loss") == 1 and {row[header.index("loss")] for row in rows} == {"123.0"}
    assert "loss=123" in capsys.readouterr().out


class NoisyInputs(LightningModule):
    """Lightning's idiom for new tensors in a step: ``dtype=self.dtype, device=self.device``."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        noise = torch.randn(batch.shape, dtype=self.dtype, device=self.device)
        self.seen.append(noise.dtype)
        return self.layer(batch + noise).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-true", torch.bfloat16),
                                              ("bf16-mixed", torch.float32)])
def test_the_modules_dtype_is_its_parameters(tmp_path, precision, dtype):
    module = NoisyInputs()
    assert module.dtype == torch.float32
    trainer = Trainer(strategy="native", max_steps=2, precision=precision, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(torch.randn(8, 4), batch_size=4))
    assert module.seen == [dtype, dtype]


class StepAndEpochLogger(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("train_loss", loss)  # per step only, Lightning's default in training_step
        self.log("acc", loss * 0 + batch_idx, on_step=True, on_epoch=True)  # acc_step and acc_epoch
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_loggers_get_per_step_values_at_the_logging_steps_only(tmp_path):
    """As in Lightning: per-step values reach the loggers at the logging steps only. An epoch's
    end writes the epoch's values, not the last step's again (``callback_metrics`` still has
    them)."""
    import csv

    from xtrainer.loggers import CSVLogger

    trainer = Trainer(strategy="native", max_epochs=2, log_every_n_steps=2, logger=CSVLogger(tmp_path),
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                      enable_xla_health=False, default_root_dir=tmp_path)
    trainer.fit(StepAndEpochLogger(), DataLoader(torch.randn(20, 4), batch_size=4))  # 5 batches an epoch
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    step_rows = [row for row in rows if row["train_loss"]]
    # every 2nd of the 10 steps, at Lightning's step: the optimizer steps before the batch's own
    assert [int(row["step"]) for row in step_rows] == [1, 3, 5, 7, 9]
    assert all(row["acc_step"] and not row["acc_epoch"] for row in step_rows)
    epoch_rows = [row for row in rows if row["acc_epoch"]]
    assert [float(row["acc_epoch"]) for row in epoch_rows] == [2.0, 2.0]  # the mean of batch_idx 0..4
    assert all(not row["train_loss"] and not row["acc_step"] for row in epoch_rows)
    assert {"train_loss", "acc_step", "acc_epoch", "acc"} <= set(trainer.callback_metrics)
    # an epoch shorter than the interval: said, as Lightning says it
    with pytest.warns(UserWarning, match="5 training batches, fewer than log_every_n_steps=50"):
        Trainer(strategy="native", max_epochs=1, logger=CSVLogger(tmp_path / "short"), enable_checkpointing=False,
                enable_model_summary=False, enable_progress_bar=False, default_root_dir=tmp_path
                ).fit(StepAndEpochLogger(), DataLoader(torch.randn(20, 4), batch_size=4))


class MultiStep(LightningModule):
    """torch's MultiStepLR keeps its milestones in a collections.Counter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 3], gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("strategy", ["native", "xla_native", "native_fsdp"])
def test_a_multisteplr_is_checkpointed_and_resumes_exactly(tmp_path, strategy):
    """MultiStepLR's state (a Counter of milestones) is saved and read back: a fit stopped after
    two steps and resumed ends where one uninterrupted fit does, at the same learning rate."""
    data = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))

    def fit(root, max_steps, ckpt_path=None):
        trainer = Trainer(strategy=strategy, max_steps=max_steps, default_root_dir=root, logger=False,
                          enable_progress_bar=False, enable_model_summary=False)
        module = MultiStep()
        trainer.fit(module, DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
        return trainer, {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    _, expected = fit(tmp_path / "whole", 4)
    fit(tmp_path / "parts", 2)
    resumed, got = fit(tmp_path / "parts", 4, ckpt_path="last")
    assert resumed.global_step == 4 and resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)
    assert resumed.lr_scheduler_configs[0].scheduler.milestones == {2: 1, 3: 1}
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_after_a_stage_the_trainer_keeps_its_module_and_only_that_stages_metrics(tmp_path):
    """As in Lightning: ``trainer.lightning_module`` after fit, ``test()``'s metrics without the
    fit's, ``all_gather`` on one replica without a new dimension, and DDP named with its option."""
    from xtrainer.strategies import NativeDDP, XlaDDP, resolve_strategy

    class Gathers(LitRegressor):
        def test_step(self, batch, batch_idx):
            x, y = batch
            assert self.all_gather(y.sum()).shape == () and self.all_gather({"y": y})["y"].shape == y.shape
            self.log("test_loss", nn.functional.mse_loss(self(x), y))

    module = Gathers()
    trainer = Trainer(strategy="native", max_epochs=1, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    data = make_data(32)
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    assert trainer.lightning_module is module and "val_loss" in trainer.callback_metrics
    trainer.test(module, DataLoader(data, batch_size=8), verbose=False)
    assert set(trainer.callback_metrics) == set(trainer.logged_metrics) == {"test_loss"}
    strategy = resolve_strategy("ddp_find_unused_parameters_true")
    assert isinstance(strategy, NativeDDP) and strategy.ddp_kwargs["find_unused_parameters"] is True
    strategy = resolve_strategy("ddp_find_unused_parameters_true", accelerator="xla")
    assert isinstance(strategy, XlaDDP) and strategy.ddp_kwargs["find_unused_parameters"] is True


class Draws(LightningModule):
    """A step that draws from the host's generators, as an RL agent's exploration does."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.draws = []

    def training_step(self, batch, batch_idx):
        import random

        import numpy

        self.draws.append((random.random(), float(numpy.random.rand()), float(torch.rand(()))))
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_counting_the_steps_flops_leaves_the_hosts_random_draws_as_they_were(tmp_path):
    """The FLOP count runs training_step once more on the meta device; the real steps draw the
    same numbers as in a run without the count."""
    import random

    import numpy

    draws = []
    for health in (True, False):
        random.seed(0), numpy.random.seed(0), torch.manual_seed(0)
        module = Draws()
        Trainer(strategy="native", max_steps=3, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                enable_checkpointing=False, enable_model_summary=False, enable_xla_health=health
                ).fit(module, DataLoader(torch.randn(8, 4), batch_size=2))
        draws.append(module.draws)
    assert len(draws[0]) == 3 and draws[0] == draws[1]


class OwnHooks(LightningModule):
    """Overrides Lightning's less common module hooks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.dropout = nn.Dropout(0.5)
        self.calls = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.calls.append(("dropout on in validation", self.dropout.training))
        self.log("val", self.layer(batch).sum())

    def backward(self, loss, *args, **kwargs):
        self.calls.append("backward")
        (loss * 2).backward(*args, **kwargs)  # gradients doubled: SGD moves twice as far

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls.append(("clip", gradient_clip_val))
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="value")

    def lr_scheduler_step(self, scheduler, metric):
        self.calls.append("lr_scheduler_step")
        scheduler.step()

    def on_validation_model_eval(self):
        super().on_validation_model_eval()
        self.dropout.train()  # Monte-Carlo dropout in validation

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]


@pytest.mark.parametrize("strategy", ["native", "xla_native"])
def test_lightnings_backward_clipping_scheduler_step_and_model_mode_hooks_run_when_overridden(tmp_path, strategy):
    module = OwnHooks()
    start = module.layer.weight.detach().clone()
    data = DataLoader(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), batch_size=4)
    Trainer(strategy=strategy, max_epochs=1, gradient_clip_val=1e-3, default_root_dir=tmp_path, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            num_sanity_val_steps=0).fit(module, data, data)
    assert module.calls == ["backward", ("clip", 1e-3), ("dropout on in validation", True), "lr_scheduler_step"]
    moved = (module.layer.weight.detach().cpu() - start).abs()
    assert torch.allclose(moved, torch.full_like(moved, 0.1 * 1e-3), rtol=1e-3)  # each doubled gradient clipped to 1e-3
    assert module.training and not module.on_gpu


class BuiltLate(LightningModule):
    """Builds its layer in configure_model and keeps extra state through the checkpoint hooks."""

    def __init__(self, width: int = 4, wraps: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 1) if wraps else None
        self.loaded_extra = None

    def configure_model(self):
        if self.hparams.wraps:  # xla_fsdp's recipe: wraps with the trainer's strategy
            self.layer = self.trainer.strategy.wrap(self.layer)
        elif self.layer is None:
            self.layer = nn.Linear(self.hparams.width, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["extra"] = 42

    def on_load_checkpoint(self, checkpoint):
        self.loaded_extra = checkpoint.get("extra")


def test_load_from_checkpoint_runs_configure_model_and_on_load_checkpoint_first(tmp_path):
    trainer = Trainer(strategy="native", max_steps=2, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    module = BuiltLate()
    trainer.fit(module, DataLoader(torch.randn(8, 4), batch_size=2))
    path = trainer.checkpoint_callback.best_model_path
    loaded = BuiltLate.load_from_checkpoint(path)
    assert loaded.loaded_extra == 42 and torch.equal(loaded.layer.weight, module.layer.weight.detach().cpu())
    with pytest.warns(UserWarning, match=r"configure_model\(\) needs a Trainer"):
        wrapped = BuiltLate.load_from_checkpoint(path, wraps=True)  # built in __init__, wrapped in a fit only
    assert torch.equal(wrapped.layer.weight, module.layer.weight.detach().cpu())


#: Hooks that a callback and the module both have; Lightning calls the callbacks' first.
BOTH_HOOKS = ["on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_zero_grad",
              "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end",
              "on_validation_start", "on_validation_batch_start", "on_validation_batch_end", "on_validation_end",
              "on_train_end", "on_fit_end", "on_save_checkpoint", "on_exception"]


def _recording(name, seen, base):
    def hook(hook_name):
        return lambda self, *args: seen.append((hook_name, name))
    return type(f"Recording{name}", (base,), {hook_name: hook(hook_name) for hook_name in BOTH_HOOKS})


class FailsAtStep(LitRegressor):
    def training_step(self, batch):
        if self.trainer.global_step == 10:  # in the second epoch, after a checkpoint
            raise RuntimeError("bad batch")
        return super().training_step(batch)


def test_callbacks_hooks_run_before_the_modules_as_in_lightning(tmp_path):
    seen = []
    first, second = _recording("callback1", seen, Callback)(), _recording("callback2", seen, Callback)()
    module = _recording("module", seen, FailsAtStep)()
    trainer = Trainer(max_epochs=3, callbacks=[first, second], **quiet(tmp_path))
    data = RegressionDataModule()
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(module, datamodule=data)
    called = {hook for hook, _ in seen}
    assert called == set(BOTH_HOOKS) - {"on_train_end", "on_fit_end"}  # it failed in its second epoch
    runs = [seen[i:i + 3] for i in range(0, len(seen), 3)]
    assert all([who for _, who in run] == ["callback1", "callback2", "module"] and len({h for h, _ in run}) == 1
               for run in runs), runs


class Renamed(LitRegressor):
    """LitRegressor with its layers under another name: its on_load_checkpoint renames the keys of
    a checkpoint of the old layout before the weights are loaded, as Lightning lets it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = self.net
        del self.net

    def forward(self, x):
        return self.body(x)

    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {key.replace("net.", "body.", 1): value
                                    for key, value in checkpoint["state_dict"].items()}


def test_on_load_checkpoint_can_change_the_weights_before_they_are_loaded(tmp_path):
    first = Trainer(max_epochs=1, **quiet(tmp_path / "a"))
    first.fit(LitRegressor(), datamodule=RegressionDataModule())
    path = first.checkpoint_callback.last_model_path or first.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=True)  # Lightning's top-level keys, for scripts that read them
    assert (saved["epoch"], saved["global_step"]) == (0, first.global_step) == (0, 8)
    resumed = Trainer(max_epochs=2, **quiet(tmp_path / "b"))
    renamed = Renamed()
    resumed.fit(renamed, datamodule=RegressionDataModule(), ckpt_path=path)
    again = Trainer(max_epochs=2, **quiet(tmp_path / "c"))
    same = LitRegressor()
    again.fit(same, datamodule=RegressionDataModule(), ckpt_path=path)
    assert resumed.global_step == again.global_step > first.global_step
    for mine, theirs in zip(renamed.body.parameters(), same.net.parameters()):
        assert torch.equal(mine, theirs)
    scores = Trainer(**quiet(tmp_path / "d")).validate(Renamed(), datamodule=RegressionDataModule(), ckpt_path=path)
    expected = Trainer(**quiet(tmp_path / "e")).validate(LitRegressor(), datamodule=RegressionDataModule(),
                                                         ckpt_path=path)
    assert scores == expected


class KeepsItsLoss(LitRegressor):
    """Returns the loss alone, or a dict with another entry (``as_dict``); keeps what it returned."""

    def __init__(self, as_dict: bool = False):
        super().__init__()
        self.as_dict, self.returned = as_dict, []

    def training_step(self, batch):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        out = {"loss": loss, "batch_rows": torch.tensor(len(x))} if self.as_dict else loss
        self.returned.append(out)
        return out


class ManualKeepsItsLoss(KeepsItsLoss):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("as_dict", [False, True])
def test_on_train_batch_end_receives_lightnings_outputs_dict(tmp_path, as_dict):
    """Lightning's ``{"loss": the loss detached and divided by accumulate_grad_batches, **the
    other entries}``, so that ``outputs["loss"]`` in a callback ports."""
    seen = []

    class Reads(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(outputs)

    module = KeepsItsLoss(as_dict)
    Trainer(strategy="native", max_steps=3, accumulate_grad_batches=2, callbacks=[Reads()],
            **quiet(tmp_path)).fit(module, datamodule=RegressionDataModule())
    assert len(seen) == len(module.returned) == 6
    for outputs, returned in zip(seen, module.returned):
        loss = returned["loss"] if as_dict else returned
        assert type(outputs) is dict and list(outputs)[0] == "loss"
        assert not outputs["loss"].requires_grad and torch.equal(outputs["loss"], loss.detach() / 2)
        assert set(outputs) == ({"loss", "batch_rows"} if as_dict else {"loss"})
        if as_dict:
            assert outputs["batch_rows"] is returned["batch_rows"]

    seen.clear()
    manual = ManualKeepsItsLoss()
    Trainer(strategy="native", max_steps=2, callbacks=[Reads()], **quiet(tmp_path)).fit(
        manual, datamodule=RegressionDataModule())
    assert [set(o) for o in seen] == [{"loss"}] * 2
    assert all(not o["loss"].requires_grad and torch.equal(o["loss"], r.detach()) for o, r in zip(seen, manual.returned))


class UnfreezesOnLoad(LightningModule):
    """Its backbone is frozen when built; a checkpoint says whether it was trained, and only what
    trains is optimized."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.backbone.requires_grad_(False)
        self.optimized = None

    def on_save_checkpoint(self, checkpoint):
        checkpoint["backbone_trains"] = self.backbone.weight.requires_grad

    def on_load_checkpoint(self, checkpoint):
        self.backbone.requires_grad_(checkpoint["backbone_trains"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        self.optimized = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.Adam(self.optimized, lr=0.01)


@pytest.mark.parametrize("strategy", ["xla_native", "native"])
def test_on_load_checkpoint_runs_before_configure_optimizers_on_resume(tmp_path, strategy):
    """Lightning's order on a resumed fit: the module's on_load_checkpoint (here: unfreeze the
    backbone the checkpoint trained), then configure_optimizers, then the optimizer's state."""
    first = UnfreezesOnLoad()
    first.backbone.requires_grad_(True)
    trainer = Trainer(strategy=strategy, max_epochs=1, **quiet(tmp_path / "a"))
    trainer.fit(first, datamodule=RegressionDataModule())
    resumed = UnfreezesOnLoad()
    again = Trainer(strategy=strategy, max_epochs=2, **quiet(tmp_path / "b"))
    again.fit(resumed, datamodule=RegressionDataModule(), ckpt_path=trainer.checkpoint_callback.last_model_path)
    assert len(resumed.optimized) == 4 and again.global_step == 2 * trainer.global_step


def record_read(path, who, trainer, stage, value):
    """One line per read, in a file: replicas may run in another process."""
    with open(path, "a") as f:
        f.write(f"{who} {trainer.global_rank} {stage} {trainer.sanity_checking} "
                f"{'none' if value is None else value.item()!r}\n")


class ReadsItsEpochValues(LightningModule):
    """Reads ``self.trainer.callback_metrics`` in its own epoch-end hooks, as an epoch summary does."""

    def __init__(self, path, sync_dist=False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.path, self.sync_dist = str(path), sync_dist

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]), sync_dist=self.sync_dist)

    def on_validation_epoch_end(self):
        if self.sync_dist and self.global_rank != 0:
            return  # an epoch summary printed by rank 0 alone: no replica waits for its read
        record_read(self.path, "module", self.trainer, "val", self.trainer.callback_metrics.get("val_loss"))

    def on_train_epoch_end(self):
        if self.sync_dist and self.global_rank != 0:
            return
        record_read(self.path, "module", self.trainer, "train", self.trainer.callback_metrics.get("train_loss"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SeesEpochValues(Callback):
    def __init__(self, path):
        self.path = str(path)

    def on_validation_epoch_end(self, trainer, module):
        record_read(self.path, "callback", trainer, "val", trainer.callback_metrics.get("val_loss"))

    def on_train_epoch_end(self, trainer, module):
        record_read(self.path, "callback", trainer, "train", trainer.callback_metrics.get("train_loss"))


@pytest.mark.parametrize("strategy,devices,sync_dist", [("native", 1, False), ("xla_ddp", 2, False),
                                                        ("xla_ddp", 2, True)])
def test_the_modules_epoch_end_hooks_read_that_epochs_values(tmp_path, strategy, devices, sync_dist):
    """As in Lightning, ``callback_metrics`` read in the module's own ``on_validation_epoch_end``
    and ``on_train_epoch_end`` (which run before the callbacks') hold that epoch's values: the
    values the callbacks then see, not the last epoch's or none. With several replicas each
    reads its own values, with no collective: rank 0 alone reading ``sync_dist`` values there
    (an epoch summary it prints) does not leave it waiting for the others."""
    reads = tmp_path / "reads.txt"
    module = ReadsItsEpochValues(reads, sync_dist=sync_dist)
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=2, num_sanity_val_steps=1,
                      callbacks=[SeesEpochValues(reads)], **quiet(tmp_path))
    trainer.fit(module, datamodule=RegressionDataModule())
    trainer.validate(module, datamodule=RegressionDataModule(), verbose=False)
    lines = [line.split() for line in reads.read_text().splitlines()]
    # sanity check, then per epoch: validation, training; then validate()
    order = [["val", "True"], ["val", "False"], ["train", "False"], ["val", "False"], ["train", "False"],
             ["val", "False"]]
    for rank in map(str, range(1 if sync_dist else devices)):
        mine = [line[2:] for line in lines if line[:2] == ["module", rank]]
        theirs = [line[2:] for line in lines if line[:2] == ["callback", rank]]
        assert [m[:2] for m in mine] == [t[:2] for t in theirs] == order, rank
        assert "none" not in [m[2] for m in mine], mine
        assert mine[1][2] != mine[3][2]  # each epoch's own value
        if not sync_dist:  # (with it, rank 0's own values, then every replica's mean)
            assert mine == theirs


def lightning_written(path, module, **extra):
    """A checkpoint as PyTorch Lightning 2.5 writes it (its keys, read off one it wrote), for
    ``module`` built with its hyperparameters saved."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    checkpoint = {"epoch": 1, "global_step": 4, "pytorch-lightning_version": "2.5.6",
                  "state_dict": module.state_dict(), "loops": {"fit_loop": {"state_dict": {}}}, "callbacks": {},
                  "optimizer_states": [optimizer.state_dict()], "lr_schedulers": [],
                  "hparams_name": "kwargs", "hyper_parameters": dict(module.hparams), **extra}
    torch.save(checkpoint, path)
    return checkpoint


def test_a_lightning_checkpoint_loads_with_load_from_checkpoint(tmp_path):
    """A project's checkpoints from before the port: load_from_checkpoint rebuilds the module
    from their hyperparameters (as Lightning does: the ones __init__ takes) and loads the
    weights; ckpt_path, which would need Lightning's optimizer and loop state, says to do that."""
    written = LitRegressor(hidden=12, lr=0.01)
    with torch.no_grad():
        written.net[0].weight.add_(1.0)
    path = tmp_path / "lightning.ckpt"
    lightning_written(path, written, hyper_parameters={**written.hparams, "added_later": 3})
    loaded = LitRegressor.load_from_checkpoint(path)
    assert loaded.hparams.hidden == 12 and loaded.hparams.lr == 0.01
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), written.state_dict().values()))
    assert LitRegressor.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5
    with pytest.raises(CheckpointError, match=r"PyTorch Lightning 2\.5\.6.*load_from_checkpoint"):
        Trainer(strategy="native", **quiet(tmp_path)).test(LitRegressor(hidden=12), datamodule=RegressionDataModule(),
                                                           ckpt_path=str(path))
    # still weights-only: a Lightning checkpoint that names code to run is refused, nothing runs
    torch.save({**torch.load(path, weights_only=True), "evil": os.system}, path)
    with pytest.raises(CheckpointError, match="refused"):
        LitRegressor.load_from_checkpoint(path)


class LogsGradNorms(LitRegressor):
    """Logs its gradients' norms where Lightning's docs do, with Lightning's ``grad_norm``."""

    def on_before_optimizer_step(self, optimizer):
        from xtrainer.utilities import grad_norm

        self.log_dict(grad_norm(self, norm_type=2))


def test_lightning_utilities_port_by_their_import(tmp_path):
    """``from lightning.pytorch.utilities import grad_norm, rank_zero_only`` and the type aliases
    port by changing the import; Lightning names with no counterpart say what to use."""
    from xtrainer.utilities import grad_norm, rank_zero_only
    from xtrainer.utilities.types import STEP_OUTPUT  # noqa: F401  (annotations in ported code)

    calls = []

    @rank_zero_only
    def on_rank_zero():
        calls.append(1)

    on_rank_zero()
    assert calls == [1]
    trainer = Trainer(strategy="native", max_epochs=1, **quiet(tmp_path))
    module = LogsGradNorms()
    trainer.fit(module, datamodule=RegressionDataModule())
    names = [f"grad_2.0_norm/{name}" for name, _ in module.named_parameters()] + ["grad_2.0_norm_total"]
    assert set(names) <= set(trainer.callback_metrics)
    norms = grad_norm(module, 2)  # the last step's gradients are dropped after fit
    assert norms == {}
    module(torch.randn(4, 8)).sum().backward()
    norms = grad_norm(module, 2)
    total = torch.cat([p.grad.flatten() for p in module.parameters()]).norm(2)
    assert list(norms) == names and torch.allclose(norms["grad_2.0_norm_total"], total)
    with pytest.raises(ImportError, match="WandbLogger.*subclass xtrainer.loggers.Logger"):
        from xtrainer.loggers import WandbLogger  # noqa: F401
    with pytest.raises(ImportError, match="find_shared_parameters.*by identity"):
        from xtrainer.utilities import find_shared_parameters  # noqa: F401


def test_lightning_submodule_paths_port_by_their_import():
    """The submodules Lightning projects import names from port by the same change of prefix:
    ``lightning.pytorch.utilities.rank_zero``, ``.utilities.exceptions``,
    ``.callbacks.model_checkpoint``, ``.utilities.combined_loader`` and ``.utilities.grads``."""
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.callbacks.model_checkpoint import ModelCheckpoint as by_path
    from xtrainer.utilities import CombinedLoader
    from xtrainer.utilities.combined_loader import CombinedLoader as loader_by_path
    from xtrainer.utilities.exceptions import MisconfigurationException
    from xtrainer.utilities.grads import grad_norm  # noqa: F401
    from xtrainer.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn  # noqa: F401

    assert by_path is ModelCheckpoint and loader_by_path is CombinedLoader
    assert rank_zero_only is utilities_rank_zero_only  # the one the Trainer points at each replica's rank
    with pytest.raises(ValueError, match="bad setting"):  # a project's `except ValueError` still catches it
        raise MisconfigurationException("bad setting")
