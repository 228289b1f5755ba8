"""Checkpoints: what is written, resuming exactly (also after SIGKILL), and refusing bad files."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import Regressor, make_data, make_loader
from torch.utils.data import DataLoader
from torch import nn

import killable_run
from xtrainer import Trainer
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.checkpoint import CheckpointError, load_checkpoint


def fit(tmp_path, epochs, ckpt_path=None, callbacks=(), **kwargs):
    model = Regressor(optimizer="adam", lr=0.01)
    kwargs.setdefault("strategy", "xla_native")  # these runs are torch_xla's (their checkpoints name it)
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
                             "seed": torch.initial_seed() % 2**31, "validation_pending": False,
                             "epoch_schedulers_due": True, "batches_stepped": 16,
                             "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    assert [set(ckpt["epoch_results"][0])] == [{"train_loss"}]  # the epoch's accumulators, per replica
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


class CountingData(torch.utils.data.Dataset):
    """make_data's samples, remembering which were loaded."""

    def __init__(self):
        self.data, self.loaded = make_data(), []

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.loaded.append(i)
        return self.data[i]


def test_resuming_inside_an_epoch_skips_the_trained_batches_without_loading_them(tmp_path):
    saver = ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)
    fit(tmp_path, 1, callbacks=[saver], max_steps=5)
    data = CountingData()
    model = Regressor(optimizer="adam", lr=0.01)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=saver.best_model_path)
    assert trainer.global_step == 8
    assert len(data.loaded) == 3 * 8  # the three batches left of the epoch: nothing else was read


def test_top_k_by_monitored_metric_and_the_last_link(tmp_path):
    saver = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, filename="{epoch}-{val_loss:.4f}")
    trainer, _ = fit(tmp_path, 4, callbacks=[saver])
    folder = os.path.join(trainer.log_dir, "checkpoints")
    names = sorted(os.listdir(folder))
    # top 2 and last.ckpt (a link to the newest when it is among them, else the newest itself), as Lightning's
    assert "last.ckpt" in names and len(names) == 3
    assert all(name.startswith("epoch=") and "-val_loss=" in name for name in names if name != "last.ckpt")
    assert saver.best_model_score == min(saver.best_k_models.values())
    assert os.path.exists(saver.best_model_path) and saver.last_model_path == os.path.join(folder, "last.ckpt")
    last = load_checkpoint(saver.last_model_path)
    assert last["loops"]["epoch"] == 3
    assert last["callbacks"][saver.state_key]["best_k_models"] == saver.best_k_models  # top-k bookkeeping is saved


def test_top_k_bookkeeping_survives_resume(tmp_path):
    saver = ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_epochs=1)
    first, _ = fit(tmp_path, 2, callbacks=[saver])
    assert len(saver.best_k_models) == 2
    again = ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_epochs=1, dirpath=saver.dirpath)
    fit(tmp_path, 4, callbacks=[again], ckpt_path="last")
    # the first run's two files were known to the resumed run: kept or pruned, never orphaned
    files = {os.path.join(saver.dirpath, n) for n in os.listdir(saver.dirpath) if n != "last.ckpt"}
    assert files == set(again.best_k_models)  # the newest, when not among them, is last.ckpt itself
    assert len(again.best_k_models) == 2


def test_train_time_interval(tmp_path):
    saver = ModelCheckpoint(train_time_interval=0.0, save_top_k=-1)  # due after every step
    trainer, _ = fit(tmp_path, 1, callbacks=[saver])
    assert len([n for n in os.listdir(saver.dirpath) if n.startswith("epoch=")]) == 8


_STRAIGHT = {}


def _straight(strategy, devices, tmp_path_factory):
    """The uninterrupted run of ``killable_run`` (computed once per strategy and device count)."""
    if (strategy, devices) not in _STRAIGHT:
        root = str(tmp_path_factory.mktemp(f"straight-{strategy}-{devices}"))
        _STRAIGHT[strategy, devices] = killable_run.run(strategy, root, devices)[1].state_dict()
    return _STRAIGHT[strategy, devices]


def _multi(devices):
    return [pytest.mark.multi_device] if devices > 1 else []


# Where a preempted machine can die: mid-epoch, on an epoch's last batch (8 batches per epoch),
# right after validation, and in the middle of writing a whole or a sharded checkpoint. Two
# xla_ddp replicas stopped by a signal resume bitwise in tests/stories/signals/test_signals.py.
KILLS = [pytest.param(strategy, devices, when, step, marks=_multi(devices), id=f"{strategy}-x{devices}-{when}-{step}")
         for strategy, devices, when, step in [
             ("xla_native", 1, "step", 7), ("xla_native", 1, "step", 8),
             ("xla_ddp", 1, "validation", 8), ("xla_fsdp", 2, "save", 10),
             ("xla_fsdpv2", 4, "save", 8)]]


@pytest.mark.parametrize("strategy, devices, when, step", KILLS)
def test_killed_and_resumed_from_last_equals_an_uninterrupted_run(tmp_path, tmp_path_factory, strategy, devices,
                                                                  when, step):
    root = str(tmp_path / "killed")
    killed = subprocess.run([sys.executable, killable_run.__file__, strategy, root, str(devices), when, str(step)],
                            capture_output=True, text=True, cwd=os.path.dirname(killable_run.__file__))
    # SIGKILL: of this process, or of the replicas' process (then the caller reports it and fails)
    assert killed.returncode == -9 or "ended with signal 9" in killed.stderr, killed.stderr[-3000:]
    trainer, resumed = killable_run.run(strategy, root, devices, ckpt_path="last")
    assert trainer.global_step == 24
    # A kill in on_train_batch_end comes before that step's save: checkpoint callbacks run last.
    every = killable_run.SAVE_EVERY
    expected = {"step": step - (step % every or every), "save": step - every}.get(when, step - step % every)
    assert f"step={expected}.ckpt" in trainer.ckpt_path  # the newest complete checkpoint before the kill
    folder = os.path.dirname(trainer.ckpt_path)
    assert not [n for n in os.listdir(folder) if n.startswith(".")]  # the interrupted save was cleared away
    straight = _straight(strategy, devices, tmp_path_factory)
    for name, tensor in straight.items():
        assert torch.equal(resumed.state_dict()[name], tensor), name  # bitwise: same batches, masks, updates


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


def test_the_checkpoint_a_fit_resumed_from_is_never_removed_as_it_leaves_the_top_k(tmp_path):
    """As in Lightning: the file named by ``ckpt_path`` stays, though the resumed fit's newer
    checkpoints push it out of ``save_top_k=1`` (it used to be removed, so a later
    ``load_from_checkpoint`` of that path failed)."""
    def trainer(epochs):
        return Trainer(strategy="native", max_epochs=epochs, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=str(tmp_path),
                       callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=1)])

    trainer(1).fit(Regressor(), make_loader())
    (first,) = [str(tmp_path / "ck" / name) for name in os.listdir(tmp_path / "ck") if name.startswith("epoch")]
    resumed = trainer(3)
    resumed.fit(Regressor(), make_loader(), ckpt_path=first)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["epoch=0-step=8.ckpt", "epoch=2-step=24.ckpt", "last.ckpt"]  # the resumed-from one, the newest
    assert Regressor.load_from_checkpoint(first).hparams == Regressor().hparams


def test_a_full_disk_under_a_distributed_checkpoint_is_the_one_line_disk_full_error(small_disk):
    """torch.distributed.checkpoint reports the ranks' failures as a ``CheckpointException``, a
    ``BaseException``: a full disk under ``native_fsdp`` came out as its raw traceback. It is the
    same one-line error as a whole file's (found by the chaos harness, a full tmpfs under
    ``native_fsdp``)."""
    from xtrainer.checkpoint import distributed

    disk = small_disk("64k")
    state = {"state_dict": {"w": torch.zeros(64 * 1024)}, "optimizer_states": []}  # 256 KiB: does not fit
    with pytest.raises(CheckpointError, match="The disk is full: could not write"):
        distributed._save_state(state, os.path.join(disk, "step=2"), 0, spmd=False)
