"""torchmetrics objects logged as Lightning users log them: states on the device, synced across
replicas in the graph at the epoch's end, no host read per step."""

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from xtrainer import Trainer, XModule, _xla
from xtrainer.callbacks import Callback


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


def metrics(prefix):
    # validate_args=False: argument checks would read tensors back to the host on every update
    return MetricCollection({"acc": MulticlassAccuracy(3, average="micro", validate_args=False),
                             "f1": MulticlassF1Score(3, average="macro", validate_args=False)}, prefix=prefix)


class Classifier(XModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 3)
        self.train_acc = MulticlassAccuracy(3, average="micro", validate_args=False)
        self.val_metrics = metrics("val_")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits, y)  # forward: this batch's value, and the epoch's state updated
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_metrics.update(self.net(x), y)
        self.log_dict(self.val_metrics)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Reads(Callback):
    """Device-to-host transfers over each training epoch (after the first)."""

    def __init__(self):
        self.at_start = []

    def on_train_epoch_start(self, trainer, module):
        self.at_start.append(_xla.transfer_from_device_count())


def expected(model, dataset):
    """What torchmetrics computes on the CPU over the whole validation set."""
    x, y = dataset.tensors
    reference = metrics("val_")
    with torch.no_grad():
        reference.update(model.net(x), y)
    return {k: float(v) for k, v in reference.compute().items()}


def fit(tmp_path, devices=1, callbacks=()):
    model = Classifier()
    trainer = Trainer(strategy="xla_native", devices=devices, max_epochs=3, log_every_n_steps=1000, enable_progress_bar=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, callbacks=list(callbacks),
                      default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(data(), batch_size=8 // devices), DataLoader(data(32, 1), batch_size=8 // devices))
    return trainer, model


def test_logged_metric_objects_give_lightnings_values_without_host_reads_per_step(tmp_path):
    reads = Reads()
    trainer, model = fit(tmp_path, callbacks=[reads])
    got = trainer.callback_metrics
    for name, value in expected(model, data(32, 1)).items():
        assert got[name] == pytest.approx(value, abs=1e-6), name
    assert {"train_acc_step", "train_acc_epoch"} <= set(got)
    per_epoch = [b - a for a, b in zip(reads.at_start, reads.at_start[1:])]
    # 8 steps per epoch, 3 reads: the training epoch's, the validation's, and one inside torchmetrics'
    # macro-averaged F1 compute() (its own host read, once per epoch): nothing per step
    assert per_epoch == [3, 3], per_epoch
    assert model.train_acc.update_count == 0  # reset after each epoch, as Lightning does


@pytest.mark.multi_device
def test_metric_states_are_synced_across_replicas(tmp_path):
    trainer, model = fit(tmp_path, devices=2)
    for name, value in expected(model, data(32, 1)).items():
        assert trainer.callback_metrics[name] == pytest.approx(value, abs=1e-6), name


class Overlap:
    """How many replica threads are inside a metric's compute at once (they share the process)."""
    inside = 0
    most = 0


class MaskedMean(MeanMetric):
    """A metric whose compute indexes with a boolean mask: XLA runs the pending graph from C++ there.
    It writes the most replicas it saw computing at once to ``report``."""

    def __init__(self, report):
        super().__init__()
        self.report = report

    def compute(self):
        Overlap.inside += 1
        Overlap.most = max(Overlap.most, Overlap.inside)
        time.sleep(0.2)  # the other replica reaches its epoch's end meanwhile
        value = self.mean_value.clone()
        value[value.isnan()] = 0.0
        Overlap.inside -= 1
        self.report.write_text(str(Overlap.most))
        return value / self.weight


class Masked(Classifier):
    def __init__(self, report):
        super().__init__()
        self.masked = MaskedMean(report)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.masked.update(self.net(batch[0]).sum(dim=1))
        self.log("masked", self.masked)


@pytest.mark.multi_device
def test_replica_threads_compute_their_metrics_one_at_a_time(tmp_path):
    # two replica threads running a boolean-mask compute at once crashed the process (signal 11)
    # in one 60-epoch run of three: they now compute in turn, states gathered first
    report = tmp_path / "most_computing_at_once"
    model = Masked(report)
    trainer = Trainer(strategy="xla_native", devices=2, max_epochs=2, limit_train_batches=1, enable_progress_bar=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(data(), batch_size=4), DataLoader(data(32, 1), batch_size=4))
    assert report.read_text() == "1"
    x, _ = data(32, 1).tensors
    with torch.no_grad():
        outputs = model.net(x).sum(dim=1)
    assert trainer.callback_metrics["masked"] == pytest.approx(float(outputs.mean()), rel=1e-5)


class LocalAccuracy(Classifier):
    def __init__(self):
        super().__init__()
        self.local_acc = MulticlassAccuracy(3, average="micro", validate_args=False, sync_on_compute=False)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.local_acc.update(self.net(x), y)
        self.log("local_acc", self.local_acc)


@pytest.mark.multi_device
def test_a_metric_built_not_to_sync_gives_each_replica_its_own_value(tmp_path):
    model = LocalAccuracy()
    trainer = Trainer(strategy="xla_native", devices=2, max_epochs=1, enable_progress_bar=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(data(), batch_size=4), DataLoader(data(32, 1), batch_size=4))
    x, y = data(32, 1).tensors
    with torch.no_grad():
        right = (model.net(x).argmax(dim=1) == y).float()
    assert float(right[0::2].mean()) != float(right.mean())  # rank 0's half differs from the whole
    assert trainer.callback_metrics["local_acc"] == pytest.approx(float(right[0::2].mean()), abs=1e-6)


def test_a_metric_read_in_the_modules_epoch_end_hook_is_still_published_whole(tmp_path):
    """The module's on_validation_epoch_end reads callback_metrics (the epoch's values are read
    then): the metric object computed there is not reset before the epoch's publication, so the
    callbacks and the result see the same accuracy, not one of an emptied metric."""
    seen = {}

    class Reads(Classifier):
        def on_validation_epoch_end(self):
            seen["module"] = float(self.trainer.callback_metrics["val_acc"])

    class Sees(Callback):
        def on_validation_epoch_end(self, trainer, module):
            seen["callback"] = float(trainer.callback_metrics["val_acc"])

    model = Reads()
    result = Trainer(strategy="native", callbacks=[Sees()], default_root_dir=str(tmp_path), logger=False,
                     enable_progress_bar=False).validate(model, DataLoader(data(seed=1), batch_size=16), verbose=False)
    loader = DataLoader(data(seed=1), batch_size=64)
    x, y = next(iter(loader))
    with torch.no_grad():
        expected = (model.net(x).argmax(1) == y).float().mean().item()
    assert seen["module"] == seen["callback"] == pytest.approx(result[0]["val_acc"]) == pytest.approx(expected)
