"""``Tuner(trainer).lr_find``: Lightning's learning-rate finder, with real (short) fits."""

import math

import pytest
import torch
from conftest import Regressor, make_loader
from torch import nn

from xtrainer import Trainer
from xtrainer import XDataModule as LightningDataModule
from xtrainer import XModule as LightningModule
from xtrainer.tuner import Tuner

STRATEGIES = ["xla_native", "native"]


def quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                enable_model_summary=False, **kwargs)


def weights(model):
    return {name: value.clone() for name, value in model.state_dict().items()}


def assert_same(before, after):
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


class HparamsRegressor(LightningModule):
    """A Lightning-style module whose learning rate is a saved hyperparameter only."""

    def __init__(self, learning_rate: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


class BothLr(HparamsRegressor):
    """``lr`` saved as a hyperparameter and kept as an attribute too: both are updated."""

    def __init__(self, lr: float = 0.01):
        LightningModule.__init__(self)
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class NoLr(HparamsRegressor):
    """Its learning rate is in ``step_size``: a name the finder has to be given."""

    def __init__(self):
        super().__init__()
        self.hparams.clear()
        self.step_size = 0.01

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.step_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lr_find_sweeps_the_learning_rate_and_leaves_the_weights_as_they_were(tmp_path, strategy):
    model = Regressor(lr=0.05)
    before = weights(model)
    trainer = Trainer(strategy=strategy, max_epochs=1, **quiet(tmp_path))
    finder = Tuner(trainer).lr_find(model, train_dataloaders=make_loader(n=64, batch_size=8), min_lr=1e-4,
                                    max_lr=1e-1, num_training=20, early_stop_threshold=None, update_attr=False)
    lrs, losses = finder.results["lr"], finder.results["loss"]
    assert len(lrs) == len(losses) == 20  # 8 batches an epoch: the search runs on into further epochs
    assert lrs[0] == pytest.approx(1e-4) and lrs[-1] == pytest.approx(1e-1)
    assert all(a < b for a, b in zip(lrs, lrs[1:]))
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]  # the loss fell while the learning rate rose to a good one
    lr = finder.suggestion(skip_begin=2)
    assert 1e-4 <= lr <= 1e-1 and lr in lrs
    assert model.lr == 0.05  # update_attr=False: left alone
    assert_same(before, weights(model))
    assert model.training

    trainer.fit(model, make_loader())  # the user's Trainer fits as usual afterwards
    assert trainer.global_step == 8 and model.trainer is trainer


def test_a_following_fit_matches_one_without_the_search(tmp_path):
    def fitted(search: bool):
        model = Regressor(lr=0.05)
        trainer = Trainer(strategy="native", max_epochs=1, **quiet(tmp_path))
        if search:
            Tuner(trainer).lr_find(model, make_loader(), num_training=10, update_attr=False)
        trainer.fit(model, make_loader(shuffle=True))
        return weights(model)

    assert_same(fitted(False), fitted(True))


def test_linear_mode_and_an_early_stop_on_a_diverging_loss(tmp_path):
    model = Regressor()
    trainer = Trainer(strategy="native", **quiet(tmp_path))
    finder = Tuner(trainer).lr_find(model, make_loader(), min_lr=1e-3, max_lr=100.0, num_training=30, mode="linear",
                                    update_attr=False)
    lrs, losses = finder.results["lr"], finder.results["loss"]
    assert 2 < len(losses) < 30 and len(lrs) == len(losses)  # stopped early: lr 100 diverges
    assert lrs[1] - lrs[0] == pytest.approx((100.0 - 1e-3) / 29)
    assert not (losses[-1] <= 4.0 * min(losses[:-1]))  # the point that exceeded the threshold is the last


def test_update_attr_sets_the_suggestion_on_the_attribute_and_in_hparams(tmp_path):
    model = Regressor(lr=0.05)
    trainer = Trainer(strategy="native", max_epochs=1, **quiet(tmp_path))
    finder = Tuner(trainer).lr_find(model, make_loader(), min_lr=1e-4, max_lr=1e-1, num_training=25)
    assert model.lr == finder.suggestion() and 1e-4 <= model.lr <= 1e-1

    saved = HparamsRegressor()
    finder = Tuner(trainer).lr_find(saved, make_loader(), min_lr=1e-4, max_lr=1e-1, num_training=25)
    assert saved.hparams.learning_rate == finder.suggestion() != 0.01
    trainer.fit(saved, make_loader())  # configure_optimizers reads the new value
    assert trainer.global_step == 8

    both = BothLr()
    finder = Tuner(trainer).lr_find(both, make_loader(), min_lr=1e-4, max_lr=1e-1, num_training=25)
    assert both.lr == both.hparams.lr == finder.suggestion() != 0.01
    assert trainer.lightning_module is saved


def test_attr_name_and_the_errors_that_say_what_to_do(tmp_path):
    trainer = Trainer(strategy="native", **quiet(tmp_path))
    model = NoLr()
    before = weights(model)
    with pytest.raises(AttributeError,
                       match=r"has no attribute 'lr' or 'learning_rate'.*attr_name=.*update_attr=False"):
        Tuner(trainer).lr_find(model, make_loader())
    with pytest.raises(AttributeError, match=r"attr_name='rate'\): NoLr has no attribute 'rate'"):
        Tuner(trainer).lr_find(model, make_loader(), attr_name="rate")
    assert_same(before, weights(model))  # refused before any training
    finder = Tuner(trainer).lr_find(model, make_loader(), num_training=15, attr_name="step_size")
    assert model.step_size == finder.suggestion()

    with pytest.raises(ValueError, match="only method='fit'"):
        Tuner(trainer).lr_find(model, make_loader(), method="validate")
    with pytest.raises(ValueError, match="mode='cosine'"):
        Tuner(trainer).lr_find(model, make_loader(), mode="cosine")
    with pytest.raises(ValueError, match="0 < min_lr < max_lr"):
        Tuner(trainer).lr_find(model, make_loader(), min_lr=1.0, max_lr=0.1)
    with pytest.raises(NotImplementedError, match="Set the batch size by hand"):
        Tuner(trainer).scale_batch_size(model)
    with pytest.raises(TypeError, match="xtrainer Trainer"):
        Tuner(object())


class Data(LightningDataModule):
    def __init__(self):
        super().__init__()
        self.calls = []

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return make_loader()

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")


def test_data_from_a_data_module_or_the_modules_own_hooks(tmp_path):
    trainer = Trainer(strategy="native", max_epochs=1, **quiet(tmp_path))
    data = Data()
    finder = Tuner(trainer).lr_find(Regressor(), datamodule=data, num_training=12, update_attr=False)
    assert len(finder.results["loss"]) == 12 and data.calls == ["setup:fit", "teardown:fit"]

    class OwnData(Regressor):
        def train_dataloader(self):
            return make_loader()

    with pytest.raises(ValueError, match="pass train_dataloaders="):
        Tuner(trainer).lr_find(OwnData(), dataloaders=make_loader())
    assert len(Tuner(trainer).lr_find(OwnData(), num_training=12, update_attr=False).results["lr"]) == 12


def test_too_few_points_give_no_suggestion_with_a_warning(tmp_path):
    model = Regressor()
    trainer = Trainer(strategy="native", **quiet(tmp_path))
    with pytest.warns(UserWarning, match="cannot suggest a learning rate"):
        finder = Tuner(trainer).lr_find(model, make_loader(), num_training=8)  # skip_begin=10 leaves none
    assert len(finder.results["lr"]) == 8 and finder.suggestion(skip_begin=0) is not None
    assert model.lr == 0.05  # no suggestion: the attribute is left as it was


def test_accumulation_counts_optimizer_steps_and_a_scheduler_is_left_out(tmp_path):
    class Scheduled(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    model = Scheduled()
    trainer = Trainer(strategy="native", accumulate_grad_batches=2, **quiet(tmp_path))
    finder = Tuner(trainer).lr_find(model, make_loader(), val_dataloaders=make_loader(16), num_training=12,
                                    update_attr=False)
    assert len(finder.results["lr"]) == 12  # optimizer steps, 24 batches


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    trainer = Trainer(strategy="native", **quiet(tmp_path))
    finder = Tuner(trainer).lr_find(Regressor(), make_loader(), num_training=20, update_attr=False)
    fig = finder.plot(suggest=True)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and len(ax.lines) == 2  # the curve and the suggestion


@pytest.mark.multi_device
def test_lr_find_on_two_replicas(tmp_path):
    model = Regressor()
    before = weights(model)
    trainer = Trainer(strategy="xla_ddp", devices=2, **quiet(tmp_path))
    finder = Tuner(trainer).lr_find(model, make_loader(), min_lr=1e-4, max_lr=1e-1, num_training=15)
    assert len(finder.results["lr"]) == len(finder.results["loss"]) == 15  # rank 0's records came home
    assert model.lr == finder.suggestion()
    assert_same(before, weights(model))
