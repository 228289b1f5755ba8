"""Lightning projects that port by changing their imports: a third set of patterns.

torchmetrics' own Lightning integration (metrics logged per step, reset at every epoch's end;
a metric logged after ``update()`` alone), hook-like names that are no hook, the model summary
over a module with odd attributes, Lightning's ``ModelSummary``, ``ParallelStrategy`` and the
export methods, the callbacks' state restored by ``test(ckpt_path=...)``, ``metrics.csv`` as
Lightning writes it, and the training data's order under DDP. Modules are written as a Lightning
user writes them; only the import lines differ.
"""

import csv
import os
import warnings

import pytest
import torch
from conftest import make_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, SumMetric

from xtrainer import Trainer
from xtrainer import XModule as LightningModule
from xtrainer.callbacks import Callback

STRATEGIES = ["native", "xla_native"]


def quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False, enable_model_summary=False,
                enable_checkpointing=False, num_sanity_val_steps=0, **kwargs)


def labelled(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).float())


# ---- torchmetrics' integration: metrics logged per step --------------------------------------

class CountsMetrics(LightningModule):
    """torchmetrics' integration test pattern: a metric called on every batch and logged per step
    (``training_step``'s default); another only updated, logged per step and per epoch."""

    def __init__(self, log_updated: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.log_updated = log_updated
        self.layer = nn.Linear(4, 1)
        self.seen = SumMetric()  # counts the samples of the epoch
        self.updated = MeanMetric()
        self.at_epoch_start, self.forward_cache_logged = [], []

    def on_train_epoch_start(self):
        self.at_epoch_start.append((float(self.seen.sum_value.cpu()), int(self.updated.update_count)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.layer(x).squeeze(-1)
        self.seen(torch.ones_like(y).sum())
        self.log("seen", self.seen)  # on_step=True, on_epoch=False: the default in training_step
        self.updated.update(y)
        if self.log_updated:
            self.log("updated", self.updated, on_step=True, on_epoch=True)  # no forward: nothing per step
        return nn.functional.mse_loss(out, y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.forward_cache_logged.append("updated_step" in self.trainer.callback_metrics)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_metrics_logged_per_step_are_reset_at_every_epoch_end(tmp_path, strategy):
    """Lightning resets every metric logged during an epoch at its end, on_step or on_epoch: a
    metric logged per step only counted every epoch so far."""
    model = CountsMetrics(log_updated=False)
    trainer = Trainer(strategy=strategy, max_epochs=3, log_every_n_steps=1, **quiet(tmp_path))
    trainer.fit(model, DataLoader(labelled(32), batch_size=8))
    assert [seen for seen, _ in model.at_epoch_start] == [0.0] * 3
    assert trainer.callback_metrics["seen"].item() == 8  # the last batch's own value, its forward's


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_metric_only_updated_logs_nothing_per_step_and_its_epoch_value(tmp_path, strategy):
    """A metric logged per step after ``update()`` alone has no value of the step (its forward
    cache is empty): Lightning logs nothing for the step and computes the epoch's value as usual."""
    model = CountsMetrics()
    data = labelled(32)
    trainer = Trainer(strategy=strategy, max_epochs=2, log_every_n_steps=1, **quiet(tmp_path))
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert not any(model.forward_cache_logged)
    assert "updated_step" not in trainer.logged_metrics
    assert trainer.callback_metrics["updated_epoch"].item() == pytest.approx(data.tensors[1].mean().item())
    assert trainer.callback_metrics["updated"].item() == pytest.approx(data.tensors[1].mean().item())


# ---- a method named like a hook that is none ------------------------------------------------

class OldHookName(LightningModule):
    """Lightning 1's ``training_epoch_end`` renamed by hand to a hook that does not exist: Lightning
    never calls it and runs on."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.called = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_training_epoch_end(self):
        self.called = True

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OnEveryThing(Callback):
    def on_everything(self, trainer, module):
        raise AssertionError("never called")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_method_named_like_a_hook_that_is_none_warns_and_the_fit_runs_on(tmp_path, strategy):
    model = OldHookName()
    with pytest.warns(UserWarning, match="on_training_epoch_end looks like a hook.*on_train_epoch_end"):
        trainer = Trainer(strategy=strategy, max_epochs=2, callbacks=[OnEveryThing()], **quiet(tmp_path))
        trainer.fit(model, DataLoader(make_data(16), batch_size=8))
    assert trainer.global_step == 4 and not model.called


# ---- the model summary ----------------------------------------------------------------------

class WithMockedMetric(LightningModule):
    """torchmetrics' integration test: a metric whose ``reset`` is a ``unittest.mock.Mock``
    (to count the Trainer's calls), an attribute that answers every ``getattr``."""

    def __init__(self):
        super().__init__()
        from unittest import mock

        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.metric = SumMetric()
        self.metric.reset = mock.Mock()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.metric(loss.detach())
        self.log("summed", self.metric, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", ["native", "xla_native", "xla_fsdp"])
def test_the_summary_counts_named_parameters_of_a_module_with_a_mock(tmp_path, strategy, capsys):
    model = WithMockedMetric()
    kwargs = {**quiet(tmp_path), "enable_model_summary": True}
    trainer = Trainer(strategy=strategy, max_epochs=2, **kwargs)
    trainer.fit(model, DataLoader(make_data(16), batch_size=8))
    out = capsys.readouterr().out
    assert "9         Total params" in out and "| layer  | Linear    | 9      | train" in out
    assert ("per replica (MB), sharded over 1 replica" in out) == (strategy == "xla_fsdp")
    assert model.metric.reset.call_count >= 2  # once per epoch, by the Trainer


def test_shards_parameters_is_the_strategys_to_say():
    from xtrainer.strategies import STRATEGIES

    assert {name for name, cls in STRATEGIES.items() if cls.shards_parameters} == {
        "xla_fsdp", "xla_fsdpv2", "native_fsdp", "model_parallel"}


class Summarized(LightningModule):
    """A Lightning course's model-summary lesson."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
        self.unused = nn.Linear(2, 2)
        self.example_input_array = torch.zeros(5, 28 * 28)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def test_lightnings_model_summary_class_with_example_input_sizes():
    from xtrainer.utilities.model_summary import ModelSummary, summarize

    model = Summarized()
    model.decoder.eval()
    summary = ModelSummary(model, max_depth=1)
    text = str(summary)
    lines = text.splitlines()
    assert lines[0].split(" | ")[1:] == ["Name   ", "Type      ", "Params", "Mode ", "In sizes", "Out sizes"]
    assert lines[2].split(" | ")[1:] == ["encoder", "Sequential", "50.4 K", "train", "[5, 784]", "[5, 3]"]
    assert lines[3].split(" | ")[1:] == ["decoder", "Sequential", "51.2 K", "eval ", "[5, 3]  ", "[5, 784]"]
    assert lines[4].split(" | ")[1:] == ["unused ", "Linear    ", "6     ", "train", "?       ", "?"]
    assert "101 K     Total params" in text and "0.407     Total estimated model params size (MB)" in text
    assert model.encoder.training and not model.decoder.training  # the modes are as they were
    assert summary.total_parameters == sum(p.numel() for p in model.parameters())
    assert summary.layer_names == ["encoder", "decoder", "unused"]
    assert summary.in_sizes[0] == [5, 784] and summary.out_sizes[2] == "?"
    deep = summarize(model, max_depth=-1)
    assert "encoder.0" in str(deep) and deep.layer_types[1] == "Linear"
    assert len(str(ModelSummary(model, max_depth=0)).splitlines()) == 6  # the totals alone


# ---- Lightning's ParallelStrategy: the ImageNet template's batch size ------------------------

class ImageNetLike(LightningModule):
    """Lightning's ImageNet template: the batch size per process is the given one divided by
    the processes (``ParallelStrategy.num_processes``), in ``setup``."""

    def __init__(self, batch_size: int = 16, expect_processes: int = 1):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.batch_size = batch_size

    def setup(self, stage):
        from xtrainer.strategies import ParallelStrategy

        if isinstance(self.trainer.strategy, ParallelStrategy):
            num_processes = max(1, self.trainer.strategy.num_processes)
            assert num_processes == self.hparams.expect_processes, num_processes
            assert len(self.trainer.strategy.parallel_devices) == num_processes
            self.batch_size = int(self.batch_size / num_processes)

    def train_dataloader(self):
        return DataLoader(make_data(64), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_multi_process_strategies_are_parallel_strategies():
    from xtrainer.strategies import STRATEGIES, ParallelStrategy, Strategy

    assert issubclass(ParallelStrategy, Strategy)
    assert {name for name, cls in STRATEGIES.items() if issubclass(cls, ParallelStrategy)} == set(STRATEGIES) - {
        "native"}


@pytest.mark.parametrize("strategy", ["native", "xla_native"])
def test_the_imagenet_templates_batch_size_at_one_device(tmp_path, strategy):
    trainer = Trainer(strategy=strategy, max_epochs=1, **quiet(tmp_path))
    trainer.fit(ImageNetLike())
    assert trainer.global_step == 4  # 64 samples, batches of 16


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["native_ddp", "xla_ddp"])
def test_the_imagenet_templates_batch_size_divided_by_the_processes(tmp_path, strategy):
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=1, **quiet(tmp_path))
    trainer.fit(ImageNetLike(expect_processes=2))
    assert trainer.global_step == 4  # each process: 32 samples in batches of 8


# ---- export after fit ----------------------------------------------------------------------

class Exported(LightningModule):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.example_input_array = torch.randn(2, 8)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_to_torchscript_and_to_onnx_on_the_trained_module(tmp_path, strategy):
    model = Exported()
    trainer = Trainer(strategy=strategy, max_epochs=1, **quiet(tmp_path))
    trainer.fit(model, DataLoader(make_data(16), batch_size=8))
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    assert model.training  # as fit left it
    scripted = model.to_torchscript(file_path=tmp_path / "model.pt")
    assert model.training
    assert torch.equal(scripted(x), expected)
    assert torch.equal(torch.jit.load(str(tmp_path / "model.pt"))(x), expected)
    traced = model.to_torchscript(method="trace")
    assert torch.equal(traced(x), expected)
    with pytest.raises(ValueError, match="'script' or 'trace'"):
        model.to_torchscript(method="compile")

    pytest.importorskip("onnx")
    import onnx

    model.to_onnx(tmp_path / "model.onnx", export_params=True)
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    assert [node.op_type for node in graph.node].count("Gemm") == 2 and model.training
    del model.example_input_array
    with pytest.raises(ValueError, match="needs an example input"):
        model.to_onnx(tmp_path / "other.onnx")


# ---- the callbacks' state restored by test(ckpt_path=...) ----------------------------------

class Validated(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.layer(x), y))

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_then_test_in_a_fresh_trainer(tmp_path, strategy, devices=1):
    from xtrainer.callbacks import ModelCheckpoint

    kwargs = dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                  enable_model_summary=False, strategy=strategy, devices=devices)
    data = DataLoader(make_data(32), batch_size=8)
    trainer = Trainer(max_epochs=3, callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2)], **kwargs)
    trainer.fit(Validated(), data, DataLoader(make_data(16, seed=1), batch_size=8))
    best, score = trainer.checkpoint_callback.best_model_path, trainer.checkpoint_callback.best_model_score
    assert best and os.path.exists(best)

    fresh = Trainer(callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2)], **kwargs)
    (result,) = fresh.test(Validated(), DataLoader(make_data(16, seed=1), batch_size=8), ckpt_path=best,
                           verbose=False)
    assert fresh.checkpoint_callback.best_model_path == best
    assert fresh.checkpoint_callback.best_model_score.item() == pytest.approx(score.item())
    assert result["test_loss"] == pytest.approx(score.item(), rel=1e-5)  # the best weights, on the same data
    fresh = Trainer(callbacks=[ModelCheckpoint(monitor="val_loss")], **kwargs)
    fresh.validate(Validated(), DataLoader(make_data(16, seed=1), batch_size=8), ckpt_path=best,
                   verbose=False)
    assert fresh.checkpoint_callback.best_model_path == best


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_fresh_trainers_test_with_ckpt_path_restores_the_callbacks_state(tmp_path, strategy):
    _fit_then_test_in_a_fresh_trainer(tmp_path, strategy)


@pytest.mark.multi_device
def test_a_fresh_trainers_test_with_ckpt_path_restores_the_callbacks_state_at_two_processes(tmp_path):
    _fit_then_test_in_a_fresh_trainer(tmp_path, "native_ddp", devices=2)


# ---- metrics.csv as Lightning writes it --------------------------------------------------------

class Logs(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("lr_monitor", [False, True])
def test_metrics_csv_holds_what_the_module_logged_with_epoch_and_step(tmp_path, strategy, lr_monitor):
    """A Lightning notebook plots every column of ``metrics.csv`` (``sns.relplot(data=metrics)``):
    the module's values, ``epoch`` and ``step``, and what Lightning's callbacks log; xtrainer's own
    figures (throughput, compilations, the automatic learning rates) go to TensorBoard only."""
    from xtrainer.callbacks import LearningRateMonitor
    from xtrainer.loggers import CSVLogger, TensorBoardLogger

    csv_logger = CSVLogger(tmp_path, name="csv")
    tb = TensorBoardLogger(tmp_path, name="tb")
    trainer = Trainer(strategy=strategy, max_epochs=2, log_every_n_steps=2, logger=[csv_logger, tb],
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      callbacks=[LearningRateMonitor()] if lr_monitor else [])
    trainer.fit(Logs(), DataLoader(make_data(32), batch_size=8), DataLoader(make_data(16, seed=1), batch_size=8))
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    expected = {"epoch", "step", "train_loss_step", "train_loss_epoch", "val_loss"} | ({"lr-SGD"} if lr_monitor else set())
    assert set(rows[0]) == expected
    assert all(any(row[key] for row in rows) for key in expected)
    from tbparse import SummaryReader

    tags = set(SummaryReader(tb.log_dir).scalars["tag"])
    assert {"train_loss_step", "val_loss"} <= tags and any(tag.startswith("throughput/") for tag in tags)


# ---- the data's order under DDP: Lightning's distributed sampler --------------------------------

def _indices(n=20):
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.zeros(n, 1))


class RecordsOrder(LightningModule):
    """Notes, per rank, the samples each step sees (the indices are the data)."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.layer = nn.Linear(1, 1)

    def _note(self, kind, batch):
        with open(os.path.join(self.folder, f"{kind}-{self.global_rank}.txt"), "a") as f:
            f.write(f"{self.current_epoch} {' '.join(str(int(i)) for i in batch[0][:, 0].cpu().tolist())}\n")

    def training_step(self, batch, batch_idx):
        self._note("train", batch)
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self._note("val", batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _seen(folder, kind, rank):
    order = {}
    with open(os.path.join(folder, f"{kind}-{rank}.txt")) as f:
        for line in f:
            epoch, *indices = line.split()
            order.setdefault(int(epoch), []).extend(int(i) for i in indices)
    return order


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy, use_distributed_sampler", [("native_ddp", True), ("xla_ddp", True),
                                                               ("native_ddp", False)])  # no sampler: the loop's alone
def test_the_training_data_order_under_ddp_is_lightnings(tmp_path, strategy, use_distributed_sampler):
    """A training loader built with shuffle=False gets a DistributedSampler(shuffle=True) seeded
    with the run's seed and set to each epoch; evaluation loaders one with shuffle=False; with
    use_distributed_sampler=False every rank reads each loader as it was built."""
    from torch.utils.data import DistributedSampler

    from xtrainer import seed_everything

    seed_everything(123)
    data, val = _indices(20), _indices(8)
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=2, use_distributed_sampler=use_distributed_sampler,
                      **{**quiet(tmp_path), "num_sanity_val_steps": 0})
    trainer.fit(RecordsOrder(str(tmp_path)), DataLoader(data, batch_size=5, shuffle=False),
                DataLoader(val, batch_size=2, shuffle=False))
    for rank in (0, 1):
        for epoch in (0, 1):
            if use_distributed_sampler:
                sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=123)
                sampler.set_epoch(epoch)
                expected = list(sampler)
                expected_val = list(DistributedSampler(val, num_replicas=2, rank=rank, shuffle=False))
            else:
                expected, expected_val = list(range(20)), list(range(8))
            assert _seen(tmp_path, "train", rank)[epoch] == expected, (rank, epoch)
            assert _seen(tmp_path, "val", rank)[epoch] == expected_val, (rank, epoch)


# ---- Lightning 2.6's newer API -----------------------------------------------------------------

class TwoOptimizers(LightningModule):
    """Lightning's GAN recipe with 2.6's context manager: ``with self.toggled_optimizer(opt):``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)
        self.inside, self.after = [], []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        with self.toggled_optimizer(opt_g):
            self.inside.append((self.g.weight.requires_grad, self.d.weight.requires_grad))
            loss_g = self.d(self.g(x)).mean()
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()
        self.after.append((self.g.weight.requires_grad, self.d.weight.requires_grad))
        with self.toggled_optimizer(opt_d):
            loss_d = self.d(x).pow(2).mean()
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.01)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_toggled_optimizer_as_a_context_manager(tmp_path, strategy):
    model = TwoOptimizers()
    trainer = Trainer(strategy=strategy, max_epochs=1, **quiet(tmp_path))
    trainer.fit(model, DataLoader(make_data(16), batch_size=8))
    assert trainer.global_step == 4  # two optimizers, two batches
    assert model.inside == [(True, False)] * 2 and model.after == [(True, True)] * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_only_is_accepted_by_every_entry_point(tmp_path, strategy):
    from xtrainer.callbacks import ModelCheckpoint

    kwargs = dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                  enable_model_summary=False, strategy=strategy)
    data, val = DataLoader(make_data(32), batch_size=8), DataLoader(make_data(16, seed=1), batch_size=8)
    trainer = Trainer(max_epochs=1, callbacks=[ModelCheckpoint(monitor="val_loss")], **kwargs)
    trainer.fit(Validated(), data, val, weights_only=True)
    path = trainer.checkpoint_callback.best_model_path
    resumed = Trainer(max_epochs=2, **kwargs)
    resumed.fit(Validated(), data, val, ckpt_path=path, weights_only=None)
    assert resumed.global_step == 8
    assert resumed.validate(Validated(), val, ckpt_path=path, weights_only=True, verbose=False)
    assert resumed.test(Validated(), val, ckpt_path=path, weights_only=True, verbose=False)
    assert resumed.predict(Validated(), val, ckpt_path=path, weights_only=True) is not None
    with pytest.raises(ValueError, match="weights_only=False.*weights_only=True"):
        resumed.test(Validated(), val, ckpt_path=path, weights_only=False)


class FailsAtBatch(Validated):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("a bad batch")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_checkpoint_saves_on_exception(tmp_path, strategy):
    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.checkpoint import load_checkpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_on_exception=True)
    trainer = Trainer(strategy=strategy, max_epochs=2, callbacks=[checkpoint], **{
        **quiet(tmp_path), "enable_checkpointing": True})
    with pytest.raises(RuntimeError, match="a bad batch"):
        trainer.fit(FailsAtBatch(), DataLoader(make_data(32), batch_size=8))
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert load_checkpoint(str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt"))["global_step"] == 3

    quiet_one = ModelCheckpoint(dirpath=tmp_path / "none")  # save_on_exception=False, Lightning's default
    with pytest.raises(RuntimeError, match="a bad batch"):
        Trainer(strategy=strategy, max_epochs=2, callbacks=[quiet_one], **{
            **quiet(tmp_path), "enable_checkpointing": True}).fit(FailsAtBatch(), DataLoader(make_data(32), batch_size=8))
    assert not os.path.exists(tmp_path / "none") or not os.listdir(tmp_path / "none")
