"""The ``Trainer``'s attributes (``xtrainer/trainer.py``): what may be assigned, as in Lightning, and
what is read-only, read from its owner. Nothing trains."""

import os

import pytest
import torch

from xtrainer import Trainer, XDataModule
from xtrainer.loggers import CSVLogger


@pytest.mark.parametrize("name, says", [
    ("callback_metrics", "change its entries in place"),
    ("logged_metrics", "change its entries in place"),
    ("progress_bar_metrics", "change its entries in place"),
    ("datamodule", "pass the data module to fit, validate, test or predict"),
    ("log_dir", "choose the folder with default_root_dir"),
    ("run_config", "call trainer.record_run_config(config)"),
])
def test_what_lightning_has_read_only_cannot_be_assigned(trainer_kwargs, name, says):
    trainer = Trainer(**trainer_kwargs)
    before = getattr(trainer, name)
    with pytest.raises(AttributeError, match=f"^trainer.{name} is read-only") as err:
        setattr(trainer, name, {} if name != "datamodule" else XDataModule())
    assert says in str(err.value) and "\n" not in str(err.value)
    assert getattr(trainer, name) == before  # unchanged


def test_the_metrics_dicts_change_in_place_and_are_the_publishers(trainer_kwargs):
    trainer = Trainer(**trainer_kwargs)
    trainer.callback_metrics["val_loss"] = 0.5  # as a callback adds a value, in Lightning too
    trainer.logged_metrics.update(step=3)
    trainer.progress_bar_metrics["lr"] = 0.1
    assert trainer.callback_metrics is trainer.run.publisher.callback_metrics
    value = trainer.callback_metrics["val_loss"]
    assert isinstance(value, torch.Tensor) and value == 0.5  # stored as Lightning's 0-dim tensor
    assert float(trainer.logged_metrics["step"]) == 3.0 and trainer.progress_bar_metrics == {"lr": 0.1}
    trainer.run.publisher.reset_metrics({"a": 1.0}, {}, {"b": 2.0})  # rank 0's, brought home
    assert dict(trainer.callback_metrics.floats()) == {"a": 1.0} and not trainer.logged_metrics
    assert trainer.progress_bar_metrics == {"b": 2.0}


def test_lightnings_settables_can_be_assigned(trainer_kwargs):
    trainer = Trainer(**trainer_kwargs)
    trainer.should_stop = True
    trainer.accumulate_grad_batches = 4  # as GradientAccumulationScheduler does
    trainer.ckpt_path = "last"
    trainer.callbacks = []
    assert (trainer.should_stop, trainer.accumulate_grad_batches, trainer.ckpt_path, trainer.callbacks) == \
        (True, 4, "last", [])
    assert trainer.settings.accumulate_grad_batches == 4


def test_a_recorded_run_config_is_shown_beside_the_settings(trainer_kwargs):
    trainer = Trainer(**trainer_kwargs)
    assert trainer.run_config == {}
    trainer.record_run_config({"model/width": 8, "data/token": "s3cr3t"})
    assert trainer.run_config == {"model/width": 8, "data/token": "s3cr3t"}
    settings = trainer.run_settings()
    assert settings["model/width"] == 8 and settings["data/token"] == "***" and "trainer/max_epochs" in settings


def test_the_run_folder_is_claimed_once_and_adopted_by_name(tmp_path):
    logger = CSVLogger(tmp_path, name="exp")
    trainer = Trainer(default_root_dir=str(tmp_path), logger=logger, enable_progress_bar=False,
                      enable_checkpointing=False)
    assert trainer.log_dir_claimed is None
    folder = trainer.claim_log_dir()
    assert folder == str(tmp_path / "exp" / "version_0") and os.path.isdir(folder)
    assert trainer.claim_log_dir() == folder == trainer.log_dir == trainer.log_dir_claimed  # once
    ours = str(tmp_path / "exp" / "version_5")  # rank 0's, broadcast
    os.mkdir(ours)
    trainer.adopt_log_dir(ours)
    assert trainer.log_dir == ours == logger.log_dir  # the logger follows
