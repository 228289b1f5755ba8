"""Checkpoints: what is written, resuming exactly (also after SIGKILL), and refusing bad files."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import Regressor, make_loader
from torch import nn

import killable_run
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
    folder = os.path.dirname(path)
    assert sorted(os.listdir(folder)) == [os.path.basename(path), "last.ckpt"]  # save_top_k=1: the newest
    assert os.readlink(os.path.join(folder, "last.ckpt")) == os.path.basename(path)
    ckpt = load_checkpoint(path)
    assert ckpt["format"] == "xtrainer" and ckpt["strategy"] == "xla_native" and ckpt["world_size"] == 1
    assert ckpt["loops"] == {"global_step": 16, "epoch": 1, "batches_in_epoch": 8, "epoch_finished": True,
                             "seed": torch.initial_seed() % 2**31}
    assert set(ckpt["rng_states"]) == {"python", "numpy", "torch", "xla"} and len(ckpt["rng_states"]["xla"]) == 1
    assert torch.load(path, weights_only=True)["loops"] == ckpt["loops"]  # plain types only
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
    assert {k: ckpt["loops"][k] for k in ("global_step", "epoch", "batches_in_epoch", "epoch_finished")} == {
        "global_step": 5, "epoch": 0, "batches_in_epoch": 5, "epoch_finished": False}
    trainer, resumed = fit(tmp_path / "b", 2, ckpt_path=saver.best_model_path)
    assert trainer.global_step == 16
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_top_k_by_monitored_metric_and_the_last_link(tmp_path):
    saver = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, filename="{epoch}-{val_loss:.4f}")
    trainer, _ = fit(tmp_path, 4, callbacks=[saver])
    folder = os.path.join(trainer.log_dir, "checkpoints")
    names = sorted(os.listdir(folder))
    assert "last.ckpt" in names and len(names) in (3, 4)  # top 2, the newest (if not among them), the link
    assert saver.best_model_score == min(saver.best_k_models.values())
    assert os.path.exists(saver.best_model_path) and saver.last_model_path.startswith(os.path.join(folder, "3-"))
    assert os.path.realpath(os.path.join(folder, "last.ckpt")) == saver.last_model_path
    state = load_checkpoint(os.path.join(folder, "last.ckpt"))["callbacks"]
    assert state[saver.state_key]["best_k_models"] == saver.best_k_models  # top-k bookkeeping is saved


def test_top_k_bookkeeping_survives_resume(tmp_path):
    saver = ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_epochs=1)
    first, _ = fit(tmp_path, 2, callbacks=[saver])
    assert len(saver.best_k_models) == 2
    again = ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_epochs=1, dirpath=saver.dirpath)
    fit(tmp_path, 4, callbacks=[again], ckpt_path="last")
    # the first run's two files were known to the resumed run: kept or pruned, never orphaned
    files = {os.path.join(saver.dirpath, n) for n in os.listdir(saver.dirpath) if n != "last.ckpt"}
    assert files == set(again.best_k_models) | {again.last_model_path}
    assert len(again.best_k_models) == 2


def test_train_time_interval(tmp_path):
    saver = ModelCheckpoint(train_time_interval=0.0, save_top_k=-1)  # due after every step
    trainer, _ = fit(tmp_path, 1, callbacks=[saver])
    assert len([n for n in os.listdir(saver.dirpath) if n.startswith("epoch=")]) == 8


@pytest.mark.parametrize("strategy", ["xla_native", "xla_ddp", "xla_fsdp"])
def test_killed_mid_epoch_and_resumed_from_last_equals_an_uninterrupted_run(tmp_path, strategy):
    root = str(tmp_path / "killed")
    killed = subprocess.run([sys.executable, killable_run.__file__, strategy, root, "10"], capture_output=True,
                            text=True, cwd=os.path.dirname(killable_run.__file__))
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL at step 10; the last save was at step 9
    trainer, resumed = killable_run.run(strategy, root, ckpt_path="last")
    assert trainer.global_step == 24
    _, straight = killable_run.run(strategy, str(tmp_path / "straight"))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # bitwise: same batches, same dropout masks, same updates


def test_last_falls_back_to_the_newest_readable_checkpoint(tmp_path):
    saver = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    first, _ = fit(tmp_path, 1, callbacks=[saver])
    folder = saver.dirpath
    newest = os.path.realpath(os.path.join(folder, "last.ckpt"))
    assert newest.endswith("step=8.ckpt")
    with open(newest, "r+b") as f:  # the newest file is damaged after the fact
        f.truncate(300)
    with pytest.warns(UserWarning, match="step=8.ckpt.*truncated or corrupt"):
        trainer, _ = fit(tmp_path, 2, ckpt_path="last")
    assert trainer.global_step == 16  # resumed from step 4, then trained on
    with pytest.warns(UserWarning, match="found no checkpoint in .*empty/version_\\*/checkpoints.*from scratch"):
        fresh, _ = fit(tmp_path / "empty", 1, ckpt_path="last")  # as Lightning: a warning and a fresh start
    assert fresh.global_step == 8 and fresh.ckpt_path is None


def test_a_checkpoint_of_another_model_is_refused_before_training(tmp_path):
    trainer, _ = fit(tmp_path, 1)

    class Wider(Regressor):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1), nn.Linear(1, 1))

    other = Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    with pytest.raises(CheckpointError, match="missing keys \\(2\\): net.3.weight, net.3.bias; shape mismatches "
                       "\\(3\\): net.0.weight \\(16, 8\\) \\(module: \\(32, 8\\)\\)"):
        other.fit(Wider(), make_loader(), ckpt_path="last")
    assert other.global_step == 0


def test_a_full_disk_stops_training_and_keeps_the_earlier_checkpoints(tmp_path, small_disk):
    disk = small_disk("96k")  # a real filesystem: a few checkpoints fit, then it is full
    saver = ModelCheckpoint(dirpath=disk, every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(CheckpointError, match=f"The disk is full: could not write '{disk}/epoch=.*KiB needed, .* free.*"
                       "written before are intact"):
        fit(tmp_path, 10, callbacks=[saver])
    names = os.listdir(disk)
    assert not [n for n in names if n.startswith(".")]  # the failed save left nothing behind
    written = sorted(n for n in names if n != "last.ckpt")
    assert len(written) >= 2
    newest = load_checkpoint(os.path.join(disk, "last.ckpt"))  # verified: complete, every byte as written
    assert f"step={newest['loops']['global_step']}.ckpt" in os.path.realpath(os.path.join(disk, "last.ckpt"))
    for name in written:
        load_checkpoint(os.path.join(disk, name))


def test_an_unwritable_dirpath_stops_training_with_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="Could not write .*file/ckpts"):
        fit(tmp_path, 1, callbacks=[ModelCheckpoint(dirpath=str(blocker / "ckpts"))])


def test_monitoring_a_metric_that_was_not_logged(tmp_path):
    with pytest.raises(KeyError, match="monitor='val_acc'.* Logged: .*val_loss"):
        fit(tmp_path, 1, callbacks=[ModelCheckpoint(monitor="val_acc")])


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    trainer, _ = fit(tmp_path, 1)
    good = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(open(good, "rb").read()[:500])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        fit(tmp_path, 2, ckpt_path=str(truncated))
    foreign = tmp_path / "weights.pt"
    torch.save(Regressor().state_dict(), foreign)
    with pytest.raises(CheckpointError, match="not an xtrainer checkpoint"):
        fit(tmp_path, 2, ckpt_path=str(foreign))
    with pytest.raises(FileNotFoundError):
        fit(tmp_path, 2, ckpt_path=str(tmp_path / "missing.ckpt"))
    assert os.path.exists(good)  # nothing was lost


def test_checkpoint_files_get_the_users_umask(tmp_path):
    old = os.umask(0o027)
    try:
        trainer, _ = fit(tmp_path, 1)
    finally:
        os.umask(old)
    path = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    assert os.stat(path).st_mode & 0o777 == 0o640
