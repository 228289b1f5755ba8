"""Lightning 2.6's newer API, as a Lightning project uses it: the weight averaging callbacks
(``WeightAveraging``, ``EMAWeightAveraging``), a time-based ``val_check_interval``, and under
``xla_fsdp`` an optimizer built from a submodule's parameters and ``BaseFinetuning``. Modules are
written as a Lightning user writes them; only the import lines differ.
"""

import datetime
import glob
import os
import time

import pytest
import torch
from conftest import make_data
from torch import nn
from torch.utils.data import DataLoader

from xtrainer import Trainer
from xtrainer import XModule as LightningModule
from xtrainer.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, WeightAveraging

STRATEGIES = ["native", "xla_native"]


def quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False, enable_model_summary=False,
                num_sanity_val_steps=0, **kwargs)


# ---- WeightAveraging / EMAWeightAveraging ------------------------------------------------------

class Averaged(LightningModule):
    """Lightning's weight-averaging test model: a BatchNorm (buffers averaged too), an optimizer
    over a submodule's parameters; validation notes the weights it runs with."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.validated_with = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 0:
            self.validated_with.append(self.layer[0].weight.detach().cpu().clone())
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class Recorder(Callback):
    """The module's state after every optimizer step (placed before the averaging callback)."""

    def __init__(self):
        self.after_step = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after_step.append({k: v.detach().cpu().clone() for k, v in module.state_dict().items()})


def ema_of(states, decay):
    """The EMA of ``states`` as torch's ``get_ema_avg_fn`` computes it (the first one copied)."""
    averages = [dict(states[0])]
    for state in states[1:]:
        averages.append({k: (decay * averages[-1][k] + (1 - decay) * v).to(v.dtype) for k, v in state.items()})
    return averages


def assert_states(actual, expected, exact):
    assert actual.keys() == expected.keys()
    for name in expected:
        a, e = actual[name].cpu(), expected[name].cpu()
        assert torch.equal(a, e) if exact else torch.allclose(a.double(), e.double(), atol=1e-6), name


def _fit(tmp_path, strategy, callbacks, devices=1, max_epochs=3, ckpt_path=None, name="a"):
    model = Averaged()
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=max_epochs, callbacks=callbacks,
                      **quiet(tmp_path / name))
    trainer.fit(model, DataLoader(make_data(32), batch_size=8 // devices),
                DataLoader(make_data(16, seed=1), batch_size=8), ckpt_path=ckpt_path)
    return model


def _saved(tmp_path, name, epoch):
    (path,) = glob.glob(str(tmp_path / name / "**" / f"epoch={epoch}-*.ckpt"), recursive=True)
    return path


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ema_weight_averaging_validates_and_ends_with_the_average_and_resumes_bitwise(tmp_path, strategy):
    """EMAWeightAveraging updates after every optimizer step, validation runs on the average, the
    fit ends with the average in the module, training itself is untouched, a checkpoint holds
    the average as state_dict (current_model_state: the module's own), and a fit resumed from
    it ends bitwise where the uninterrupted one did."""
    exact = strategy == "native"  # the XLA compiler may fuse the EMA's multiply-add
    recorder = Recorder()
    ema = EMAWeightAveraging(decay=0.5)
    model = _fit(tmp_path, strategy, [recorder, ema, ModelCheckpoint(save_top_k=-1)])
    expected = ema_of(recorder.after_step, 0.5)
    assert len(expected) == 12 and ema._average_model.count == 12
    assert_states(model.state_dict(), expected[-1], exact)  # the average, copied in at the end
    for epoch, weight in enumerate(model.validated_with):  # validation after each epoch's 4 steps
        assert_states({"w": weight}, {"w": expected[4 * epoch + 3]["layer.0.weight"]}, exact)

    plain = Recorder()
    _fit(tmp_path, strategy, [plain], name="plain")  # the same training without averaging
    for with_averaging, without in zip(recorder.after_step, plain.after_step, strict=True):
        assert_states(with_averaging, without, exact=True)

    saved = torch.load(_saved(tmp_path, "a", 0), weights_only=True)
    assert_states(saved["state_dict"], expected[3], exact)
    assert_states(saved["current_model_state"], recorder.after_step[3], exact=True)
    assert int(saved["averaging_state"]["n_averaged"]) == 4
    assert saved["callbacks"]["EMAWeightAveraging"] == {"latest_update_step": 4}
    loaded = Averaged.load_from_checkpoint(_saved(tmp_path, "a", 0))  # Lightning's: the averaged weights
    assert_states(loaded.state_dict(), expected[3], exact)

    resumed_ema = EMAWeightAveraging(decay=0.5)
    resumed = _fit(tmp_path, strategy, [resumed_ema], ckpt_path=_saved(tmp_path, "a", 0), name="resumed")
    assert_states(resumed.state_dict(), {k: v.cpu() for k, v in model.state_dict().items()}, exact=True)
    assert_states(resumed_ema._average_model.state_dict(), ema._average_model.state_dict(), exact=True)


class EveryOtherEpoch(WeightAveraging):
    """Lightning's SWA pattern: an equally weighted average, updated after chosen epochs only."""

    def should_update(self, step_idx=None, epoch_idx=None):
        return epoch_idx in (0, 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weight_averaging_updates_when_should_update_says(tmp_path, strategy):
    recorder = Recorder()
    swa = EveryOtherEpoch(use_buffers=False)
    model = _fit(tmp_path, strategy, [recorder, swa], max_epochs=3)
    after_epoch = [recorder.after_step[3], recorder.after_step[11]]  # the SWA of the ends of epochs 0 and 2
    expected = {k: v + (after_epoch[1][k] - v) / 2 for k, v in after_epoch[0].items() if "running" not in k
                and "num_batches" not in k}
    final = model.state_dict()
    assert_states({k: final[k] for k in expected}, expected, exact=False)  # torch's SWA runs as a lerp
    assert torch.equal(final["layer.1.running_mean"], recorder.after_step[11]["layer.1.running_mean"])  # copied
    assert swa._average_model.count == 2


def test_ema_should_update_follows_lightnings_rules():
    ema = EMAWeightAveraging(update_every_n_steps=3, update_starting_at_step=6, update_starting_at_epoch=2)
    assert [s for s in range(12) if ema.should_update(step_idx=s)] == [6, 9]
    assert [e for e in range(4) if ema.should_update(epoch_idx=e)] == [2, 3]
    assert not EMAWeightAveraging().should_update(epoch_idx=5)
    assert WeightAveraging().should_update(step_idx=0) and not WeightAveraging().should_update(epoch_idx=0)
    from xtrainer.callbacks.weight_averaging import EMAWeightAveraging as FromModule

    assert FromModule is EMAWeightAveraging


@pytest.mark.parametrize("kwargs", [{}, {"use_buffers": False}, {"avg_fn": "ema"}])
def test_the_averaged_copy_updates_as_torchs_averaged_model(kwargs):
    """The copy keeps its count on the host (no read of the device per update) and otherwise
    computes what torch's AveragedModel does, to the bit."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    from xtrainer.callbacks.weight_averaging import AveragedModule, EMAAverage

    model = Averaged()
    ours = AveragedModule(model, None, use_buffers=kwargs.get("use_buffers", True),
                          avg_fn=EMAAverage(0.9) if kwargs.get("avg_fn") else None)
    torchs = AveragedModel(model, use_buffers=kwargs.get("use_buffers", True),
                           avg_fn=get_ema_avg_fn(0.9) if kwargs.get("avg_fn") else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_data(32), batch_size=8):
        nn.functional.mse_loss(model.layer(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        ours.update_parameters(model)
        torchs.update_parameters(model)
    assert ours.count == 4
    assert_states(ours.state_dict(), torchs.state_dict(), exact=True)


def test_weight_averaging_under_a_sharding_strategy_says_what_to_use(tmp_path):
    with pytest.raises(ValueError, match="keeps a whole copy of the module.*xla_fsdp.*use an unsharded strategy"):
        _fit(tmp_path, "xla_fsdp", [EMAWeightAveraging()], max_epochs=1)


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["native_ddp"])
def test_ema_weight_averaging_at_two_processes_resumes_bitwise(tmp_path, strategy):
    """Under DDP every rank averages its (equal) weights; rank 0's validation runs on the average,
    and a fit resumed from a checkpoint ends bitwise where the uninterrupted one did."""
    recorder, ema = Recorder(), EMAWeightAveraging(decay=0.5)
    model = _fit(tmp_path, strategy, [recorder, ema, ModelCheckpoint(save_top_k=-1)], devices=2, max_epochs=2)
    expected = ema_of(recorder.after_step, 0.5)  # rank 0's steps: 4 global batches of 8 per epoch
    assert len(expected) == 8
    assert_states(model.state_dict(), expected[-1], exact=True)
    assert_states({"w": model.validated_with[0]}, {"w": expected[3]["layer.0.weight"]}, exact=True)
    resumed = _fit(tmp_path, strategy, [EMAWeightAveraging(decay=0.5)], devices=2, max_epochs=2,
                   ckpt_path=_saved(tmp_path, "a", 0), name="resumed")
    assert_states(resumed.state_dict(), model.state_dict(), exact=True)


# ---- xla_fsdp: an optimizer over a submodule's parameters -----------------------------------------

class BugReport(LightningModule):
    """Lightning's bug-report template: the optimizer is built from ``self.layer.parameters()``
    (here with a feature layer in front that the optimizer leaves out)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Linear(8, 8)
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(torch.relu(self.features(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def _fit_bug_report(tmp_path, strategy, devices, **strategy_kwargs):
    from xtrainer.strategies import XlaFSDP

    model = BugReport()
    chosen = XlaFSDP(**strategy_kwargs) if strategy == "xla_fsdp" else strategy
    Trainer(strategy=chosen, devices=devices, max_epochs=2, enable_checkpointing=False,
            **quiet(tmp_path / strategy)).fit(model, DataLoader(make_data(32), batch_size=8))
    return model


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multi_device)])
def test_xla_fsdp_maps_an_optimizer_over_a_submodules_parameters_to_its_shards(tmp_path, devices):
    """The optimizer trains the layer it was given, through the layer's shards, and nothing else:
    the same weights as the same fit under xla_native (to the last bits the reduction allows)."""
    initial = BugReport().state_dict()
    sharded = _fit_bug_report(tmp_path, "xla_fsdp", devices)
    plain = _fit_bug_report(tmp_path, "xla_native", devices)
    trained = sharded.state_dict()
    assert torch.equal(trained["features.weight"], initial["features.weight"])  # not in the optimizer
    assert not torch.equal(trained["layer.weight"], initial["layer.weight"])
    for name, tensor in plain.state_dict().items():
        assert torch.allclose(trained[name], tensor, atol=1e-6), name


def test_xla_fsdp_with_flattened_parameters_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="flatten_parameters=True.*leave flatten_parameters at False"):
        _fit_bug_report(tmp_path, "xla_fsdp", 1, flatten_parameters=True)


# ---- xla_fsdp: BackboneFinetuning ---------------------------------------------------------------------

class Pretrained(LightningModule):
    """Lightning's fine-tuning example: a backbone frozen until ``BackboneFinetuning`` unfreezes
    it, a head trained throughout, the optimizer over what requires gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


class EpochEnds(Callback):
    """The whole weights at each training epoch's end (gathered from the shards under FSDP)."""

    def __init__(self):
        self.weights = []

    def on_train_epoch_end(self, trainer, module):
        whole = trainer.strategy.full_module_state_dict(trainer.model)  # every replica: a collective under FSDP
        self.weights.append({k: v.cpu().clone() for k, v in whole.items()})  # host sync, once per epoch

    def state_dict(self):  # comes back from the replicas with the callback's state
        return {"weights": self.weights}

    def load_state_dict(self, state):
        self.weights = state["weights"]


def _fit_pretrained(tmp_path, strategy, devices, name, ckpt_path=None, **strategy_kwargs):
    from xtrainer.callbacks import BackboneFinetuning
    from xtrainer.strategies import XlaFSDP

    model, ends = Pretrained(), EpochEnds()
    chosen = XlaFSDP(**strategy_kwargs) if strategy == "xla_fsdp" else strategy
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), ends, ModelCheckpoint(save_top_k=-1)]
    Trainer(strategy=chosen, devices=devices, max_epochs=3, callbacks=callbacks, **quiet(tmp_path / name)).fit(
        model, DataLoader(make_data(32), batch_size=8 // devices), ckpt_path=ckpt_path)
    return model, ends.weights


@pytest.mark.parametrize("devices, strategy_kwargs", [
    (1, {}), (1, {"auto_wrap_policy": {nn.Linear}}),  # each Linear a unit: the backbone's shards a unit's own
    pytest.param(2, {}, marks=pytest.mark.multi_device)], ids=["one", "one-units", "two"])
def test_backbone_finetuning_under_xla_fsdp_trains_as_xla_native_and_resumes_bitwise(tmp_path, devices,
                                                                                    strategy_kwargs):
    """The backbone frozen before the fit keeps its weights through epoch 0 and trains from epoch
    1, in a group of its own; the head trains throughout; the weights are those of the same fit
    under xla_native (atol=1e-6, as the optimizer over a submodule's parameters above), and a fit
    resumed from the checkpoint of epoch 1 (after the unfreeze) ends bitwise where this one did."""
    initial = Pretrained().state_dict()
    model, ends = _fit_pretrained(tmp_path, "xla_fsdp", devices, "fsdp", **strategy_kwargs)
    backbone, head = ["backbone.0.weight", "backbone.0.bias"], ["head.weight", "head.bias"]
    for name in backbone:
        assert torch.equal(ends[0][name], initial[name]), name  # frozen in epoch 0
        assert not torch.equal(ends[1][name], ends[0][name]), name  # unfrozen at epoch 1
        assert not torch.equal(ends[2][name], ends[1][name]), name
    for name in head:
        assert not torch.equal(ends[0][name], initial[name]) and not torch.equal(ends[1][name], ends[0][name]), name
    trained = model.state_dict()
    plain, _ = _fit_pretrained(tmp_path, "xla_native", devices, "native")
    for name, tensor in plain.state_dict().items():
        assert torch.allclose(trained[name], tensor, atol=1e-6), name
    resumed, _ = _fit_pretrained(tmp_path, "xla_fsdp", devices, "resumed", ckpt_path=_saved(tmp_path, "fsdp", 1),
                                 **strategy_kwargs)
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_backbone_finetuning_under_xla_fsdp_with_flattened_parameters_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="flatten_parameters=True .* no layer can be frozen, unfrozen.*"
                                         r"set XlaFSDP\(flatten_parameters=False\)"):
        _fit_pretrained(tmp_path, "xla_fsdp", 1, "flat", flatten_parameters=True)


# ---- a time-based val_check_interval ---------------------------------------------------------------

class SlowData(torch.utils.data.Dataset):
    """Each sample takes ``delay`` seconds to load, so that training time passes at a known pace."""

    def __init__(self, n, delay):
        self.data, self.delay = make_data(n), delay

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(self.delay)
        return self.data[index]


class TimedValidation(LightningModule):
    """Notes when each training batch ended and when each validation ran (rank 1 a little later
    after each batch than rank 0, so that their clocks disagree near the interval's end)."""

    def __init__(self, folder):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.folder = folder

    def _note(self, what):
        with open(os.path.join(self.folder, f"events-{self.global_rank}.txt"), "a") as f:
            f.write(f"{what} {self.global_step} {time.monotonic()}\n")

    def on_train_start(self):
        self._note("start")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._note("batch")
        if self.global_rank == 1:
            time.sleep(0.03)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def on_validation_start(self):
        self._note("validation")

    def on_validation_end(self):
        self._note("validated")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _events(folder, rank):
    with open(os.path.join(folder, f"events-{rank}.txt")) as f:
        return [(what, int(step), float(at)) for what, step, at in (line.split() for line in f)]


def _check_timed_validations(events, seconds, slack):
    """Each validation ran after the first batch that ended ``seconds`` or more after training
    began or the last validation ended; returns the steps it ran at."""
    since, steps, batch_ends = None, [], []
    for what, step, at in events:
        if what in ("start", "validated"):
            since, batch_ends = at, []
        elif what == "batch":
            batch_ends.append(at - since)
        elif what == "validation":
            assert batch_ends and batch_ends[-1] >= seconds - slack, (step, batch_ends)
            assert len(batch_ends) == 1 or batch_ends[-2] < seconds + slack, (step, batch_ends)
            steps.append(step)
    return steps


@pytest.mark.parametrize("strategy, interval", [("native", datetime.timedelta(seconds=1)),
                                                ("xla_native", "00:00:00:01")])
def test_a_time_based_val_check_interval_validates_when_the_time_has_passed(tmp_path, strategy, interval):
    """Lightning 2.6's time-based val_check_interval: validation after the first batch that ends
    once the interval has passed since training began or the last validation ended, and not at
    every epoch's end (3 epochs of about 0.8 s here)."""
    model = TimedValidation(str(tmp_path))
    trainer = Trainer(strategy=strategy, max_epochs=3, val_check_interval=interval, enable_checkpointing=False,
                      **quiet(tmp_path))
    assert trainer.val_check_interval == interval
    trainer.fit(model, DataLoader(SlowData(16, 0.05), batch_size=2), DataLoader(make_data(8), batch_size=4))
    steps = _check_timed_validations(_events(tmp_path, 0), 1.0, 0.05)
    assert 1 <= len(steps) <= 4, steps  # by time (3 epochs of about 0.8 s), not per epoch


@pytest.mark.multi_device
def test_a_time_based_val_check_interval_is_agreed_by_the_ranks(tmp_path):
    """At 2 processes every rank validates after the same batches, which the ranks agree on at
    their logging steps (each rank's clock rides in the vote they take there anyway), although
    rank 1's clock runs behind rank 0's after each batch."""
    model = TimedValidation(str(tmp_path))
    trainer = Trainer(strategy="native_ddp", devices=2, max_epochs=3, val_check_interval={"seconds": 1},
                      log_every_n_steps=1, enable_checkpointing=False, **quiet(tmp_path))
    trainer.fit(model, DataLoader(SlowData(48, 0.05), batch_size=2), DataLoader(make_data(8), batch_size=2))
    ranks = [[(step, what) for what, step, _ in _events(tmp_path, rank) if what.startswith("valid")]
             for rank in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) >= 2, ranks
    # the vote comes at the next agreement (every agreement_seconds=0.5 at most), settled a batch later
    _check_timed_validations(_events(tmp_path, 0), 1.0, 1.0)


def test_a_time_based_val_check_interval_that_does_not_parse_says_what_to_give(tmp_path):
    with pytest.raises(ValueError, match="val_check_interval='1:00': give 'DD:HH:MM:SS'"):
        Trainer(val_check_interval="1:00", **quiet(tmp_path))
    with pytest.raises(ValueError, match="val_check_interval=.*a dict takes timedelta's fields"):
        Trainer(val_check_interval={"minute": 1}, **quiet(tmp_path))


# ---- configure_model before the loader hooks ----------------------------------------------------

class BuiltInConfigureModel(LightningModule):
    """A module that builds what its loaders need in ``configure_model`` (a vocabulary, say), as
    Lightning allows: Lightning calls ``setup``, then ``configure_model``, then the loader hooks."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.calls = []
        self.scale = None

    def setup(self, stage):
        self.calls.append("setup")

    def configure_model(self):
        self.calls.append("configure_model")
        self.scale = 0.5

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        x, y = make_data(32, 0).tensors
        return DataLoader(list(zip(x * self.scale, y)), batch_size=8)  # fails if configure_model did not run

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        x, y = make_data(16, 1).tensors
        return DataLoader(list(zip(x * self.scale, y)), batch_size=8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_configure_model_runs_before_the_loader_hooks_as_in_lightning(tmp_path, strategy):
    model = BuiltInConfigureModel()
    trainer = Trainer(strategy=strategy, max_steps=4, **quiet(tmp_path))
    trainer.fit(model)
    assert trainer.global_step == 4
    assert model.calls[:4] == ["setup", "configure_model", "train_dataloader", "val_dataloader"], model.calls
