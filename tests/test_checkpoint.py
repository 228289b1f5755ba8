"""Checkpoints: what is written, resuming exactly, and refusing bad files."""

import os

import pytest
import torch
from conftest import Regressor, make_loader

from xtrainer import Trainer
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.checkpoint import CheckpointError, load_checkpoint


def fit(tmp_path, epochs, ckpt_path=None, callbacks=(), **kwargs):
    model = Regressor(optimizer="adam", lr=0.01)
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      callbacks=list(callbacks), **kwargs)
    trainer.fit(model, make_loader(), make_loader(n=16, seed=1), ckpt_path=ckpt_path)
    return trainer, model


def test_default_checkpoint_is_a_documented_plain_dict(tmp_path):
    trainer, model = fit(tmp_path, 2)
    path = os.path.join(trainer.log_dir, "checkpoints", "epoch=1-step=16.ckpt")
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # save_top_k=1: only the newest
    ckpt = load_checkpoint(path)
    assert ckpt["format"] == "xtrainer" and ckpt["strategy"] == "xla_native" and ckpt["world_size"] == 1
    assert ckpt["loops"] == {"global_step": 16, "epoch": 1, "batches_in_epoch": 8, "epoch_finished": True}
    assert set(ckpt["state_dict"]) == set(model.state_dict())  # no wrapper prefixes
    assert all(t.device.type == "cpu" for t in ckpt["state_dict"].values())
    for name, tensor in model.state_dict().items():
        assert torch.equal(ckpt["state_dict"][name], tensor)
    assert len(ckpt["optimizer_states"]) == 1 and ckpt["optimizer_states"][0]["state"]


def test_resume_is_exact(tmp_path):
    _, straight = fit(tmp_path / "a", 4)
    first, _ = fit(tmp_path / "b", 2)
    ckpt = os.path.join(first.log_dir, "checkpoints", "epoch=1-step=16.ckpt")
    resumed_trainer, resumed = fit(tmp_path / "b", 4, ckpt_path=ckpt)
    assert resumed_trainer.global_step == 32 and resumed_trainer.current_epoch == 4
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_resume_inside_an_epoch(tmp_path):
    _, straight = fit(tmp_path / "a", 2)
    saver = ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)
    fit(tmp_path / "b", 1, callbacks=[saver], max_steps=5)
    ckpt = load_checkpoint(saver.best_model_path)
    assert ckpt["loops"] == {"global_step": 5, "epoch": 0, "batches_in_epoch": 5, "epoch_finished": False}
    trainer, resumed = fit(tmp_path / "b", 2, ckpt_path=saver.best_model_path)
    assert trainer.global_step == 16
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_top_k_by_monitored_metric(tmp_path):
    saver = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, save_last=True,
                            filename="{epoch}-{val_loss:.4f}")
    trainer, _ = fit(tmp_path, 4, callbacks=[saver])
    names = sorted(os.listdir(os.path.join(trainer.log_dir, "checkpoints")))
    assert len(names) == 3 and "last.ckpt" in names
    assert saver.best_model_score == min(saver.best_k_models.values())
    assert os.path.exists(saver.best_model_path)
    state = load_checkpoint(os.path.join(trainer.log_dir, "checkpoints", "last.ckpt"))["callbacks"]
    assert state[saver.state_key]["best_model_path"] == saver.best_model_path


def test_monitoring_a_metric_that_was_not_logged(tmp_path):
    with pytest.raises(KeyError, match="monitor='val_acc'.* Logged: .*val_loss"):
        fit(tmp_path, 1, callbacks=[ModelCheckpoint(monitor="val_acc")])


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    trainer, _ = fit(tmp_path, 1)
    good = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(open(good, "rb").read()[:500])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        fit(tmp_path, 2, ckpt_path=str(truncated))
    foreign = tmp_path / "weights.pt"
    torch.save(Regressor().state_dict(), foreign)
    with pytest.raises(CheckpointError, match="not an xtrainer checkpoint"):
        fit(tmp_path, 2, ckpt_path=str(foreign))
    with pytest.raises(FileNotFoundError):
        fit(tmp_path, 2, ckpt_path=str(tmp_path / "missing.ckpt"))
    assert os.path.exists(good)  # nothing was lost


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    from xtrainer import checkpoint

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_file({"a": 1}, str(tmp_path / "x.ckpt"))
    assert os.listdir(tmp_path) == []
